//! Run a `reqwest_middleware` client's requests through a tower stack (feature `reqwest`).
//!
//! [`QuotaMiddleware`] is a [`reqwest_middleware::Middleware`] built from a tower [`Layer`](tower::Layer)
//! (a [`QuotaStack`](crate::stack::QuotaStack), or layers of this crate assembled by hand).
//! Each request goes through the layer's stack; the stack's innermost service,
//! [`RestOfChain`], hands every attempt back to the middleware, which runs it through the rest
//! of the middleware chain and the client. Retries of the stack therefore run the rest of the
//! chain again, attempt by attempt, all within the caller's task.
//!
//! # Example
//!
//! ```no_run
//! use std::num::NonZeroU64;
//! use reqwest_middleware::ClientBuilder;
//! use tower_llm_quota::middleware::QuotaMiddleware;
//! use tower_llm_quota::stack::QuotaStack;
//! use tower_llm_quota::{Dimension, Limit, Priority, Quota};
//!
//! # async fn run() -> Result<(), reqwest_middleware::Error> {
//! let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap());
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with(QuotaMiddleware::new(QuotaStack::openai(Quota::new().with_limit(tpm))))
//!     .build();
//!
//! let response = client
//!     .post("https://api.openai.com/v1/chat/completions")
//!     .header("content-type", "application/json")
//!     .body(r#"{"model":"gpt-4o-mini","max_tokens":100,"messages":[{"role":"user","content":"Hi"}]}"#)
//!     .with_extension(Priority::Interactive)
//!     .send()
//!     .await?;
//! let text = response.text().await?; // the end of the body settles the reservation
//! # let _ = text;
//! # Ok(()) }
//! ```
//!
//! # Priority, cost and deadline
//!
//! The request's `reqwest_middleware` extensions become its `http` extensions in the stack: set
//! a request's [`Priority`](crate::Priority), [`Cost`](crate::Cost) or
//! [`Deadline`](crate::Deadline) with
//! [`RequestBuilder::with_extension`](reqwest_middleware::RequestBuilder::with_extension), or
//! for every request of a client with [`ClientBuilder::with_init`] and
//! [`reqwest_middleware::Extension`]. Each attempt then passes its extensions on to the rest of
//! the chain, the caller's included.
//!
//! [`ClientBuilder::with_init`]: reqwest_middleware::ClientBuilder::with_init
//!
//! # Bodies and retries
//!
//! A request body held in memory (`.body(String)`, `.body(Vec<u8>)`, `.json(..)`) becomes a
//! [`ReplayBody`] of bytes: the estimation layer can read it and every retry re-sends it. A
//! streaming body cannot be replayed: it is sent once, and a retry of its request fails with
//! [`AttemptError::BodyNotReplayable`]. Its size is unknown in advance, so the estimation layer
//! does not read it either: give such a request a `Cost` extension.
//!
//! # Errors
//!
//! - Errors of the rest of the chain and of the client come back as they were
//!   (`reqwest_middleware::Error::Reqwest` for reqwest's), unless the stack retried them and
//!   gave up.
//! - Every other failure of the stack is a `reqwest_middleware::Error::Middleware` holding this
//!   crate's [`Error`](crate::Error): a local decision (`is_too_large()`, `is_queue_full()`,
//!   `is_deadline_exceeded()`, ...) or retries exhausted (`retry_report()`, with the last
//!   failure as its source).
//!
//! ```
//! fn refused_locally(error: &reqwest_middleware::Error) -> bool {
//!     match error {
//!         reqwest_middleware::Error::Middleware(error) => error
//!             .downcast_ref::<tower_llm_quota::Error>()
//!             .is_some_and(tower_llm_quota::Error::is_local),
//!         reqwest_middleware::Error::Reqwest(_) => false,
//!     }
//! }
//! ```
//!
//! A response that ends the retries (a final 429, say) is returned as a response, with its
//! [`RetryReport`](crate::retry::RetryReport) in the response's extensions.

mod adapter;
mod attempt;
mod chain;
mod replay;

pub use adapter::QuotaMiddleware;
pub use attempt::{AttemptError, AttemptFuture};
pub use chain::RestOfChain;
pub use replay::ReplayBody;
