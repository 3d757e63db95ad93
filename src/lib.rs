//! Quota-aware [`tower`] layers for LLM API clients: reserve a call's estimated requests
//! **and tokens** before it leaves, wait in one ordering when the quota cannot pay yet, and
//! settle with the real usage when the response body ends. Calls that would exceed the quota
//! are never sent, so 429s become short local waits instead of retry storms.
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU64;
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Full};
//! use tower::{Layer, Service, ServiceExt, service_fn};
//! use tower_llm_quota::{Dimension, Limit, Priority, Quota, QuotaStack};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), tower_llm_quota::BoxError> {
//! let nz = |n| NonZeroU64::new(n).unwrap();
//! let quota = Quota::new()
//!     .with_limit(Limit::per_minute(Dimension::Requests, nz(500)))
//!     .with_limit(Limit::per_minute(Dimension::TotalTokens, nz(30_000)));
//! let stack = QuotaStack::openai(quota);
//! let budget = stack.budget().clone();
//! # let client = service_fn(|_request: http::Request<Full<Bytes>>| async {
//! #     let body = r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;
//! #     Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(body))))
//! # });
//! let mut llm = stack.layer(client); // any client: hyper, reqwest, async-openai, a mock
//!
//! let body = r#"{"model":"gpt-4o-mini","max_tokens":200,"messages":[{"role":"user","content":"Hi"}]}"#;
//! let request = http::Request::post("https://api.openai.com/v1/chat/completions")
//!     .extension(Priority::Interactive)
//!     .body(Full::new(Bytes::from(body)))?;
//! let response = llm.ready().await?.call(request).await?; // estimated, queued, reserved, sent
//! response.into_body().collect().await?; // settled with the usage in the body
//! assert_eq!(budget.snapshot().limits()[1].level(), 5_000 - 42);
//! # Ok(()) }
//! ```
//!
//! # Where things are
//!
//! - [`Budget`] and [`Quota`]: the shared handle that reserves and settles, in every dimension
//!   ([`Dimension`]) and period; [`budget::store`] is the seam a store shared by several
//!   processes implements (the `tower-llm-quota-redis` crate's Redis store is one).
//! - The layers, outermost first: [`routing`], [`idempotency`], [`retry`], [`queue`],
//!   [`estimate`], [`token_budget`], [`reconcile`]; [`QuotaStack`] assembles them for a
//!   provider [`provider::Profile`].
//! - [`tenant`]: a tree of tenants with weights, guarantees, limits and caps; [`pricing`]:
//!   spend in nano-dollars; [`group`]: many items in one call.
//! - Client seams: [`middleware`] (`reqwest_middleware`, feature `reqwest`), [`async_openai`]
//!   (feature `async-openai`), and the snippets of [`clients`].
//! - The crate root holds the names most programs write: the budget, the quota and its
//!   limits, a request's cost, class and deadline, the error, the layers and the stack.
//!
//! The README (on the repository and crates.io) tells the whole story with figures:
//! waiting, Redis fleets, tenants, spend, the gateway. Every async API documents its
//! **cancel safety**.
#![deny(missing_docs)]

#[cfg(feature = "async-openai")]
pub mod async_openai;
pub mod budget;
mod builder;
// Its snippets (doc tests) need every client seam's feature.
#[cfg(all(feature = "hyper", feature = "reqwest", feature = "async-openai"))]
pub mod clients;
mod cost;
pub mod error;
pub mod estimate;
pub mod group;
mod loom;
#[cfg(feature = "reqwest")]
pub mod middleware;
mod observe;
#[cfg(not(fuzzing))]
mod parse;
// The fuzz targets call the parsers directly.
#[cfg(fuzzing)]
pub mod parse;
pub mod pricing;
mod priority;
pub mod provider;
pub mod queue;
mod quota;
pub mod reconcile;
pub mod retry;
pub mod routing;
mod sched;
mod scope;
#[cfg(feature = "serde")]
mod serialize;
pub mod stack;
pub mod tenant;
#[cfg(test)]
mod test_util;
mod timer;
pub mod token_budget;
pub mod usage;

pub mod idempotency;

// The names users write: the budget and its quota, a request's cost and class, the crate's
// error, the layers and the stack. Seam types (bodies, futures, extractor traits, snapshots,
// typed answers of the budget) stay in their modules.
pub use budget::{Budget, Reservation};
pub use builder::ServiceBuilderExt;
pub use cost::{Cost, Usage};
pub use error::{BoxError, Error};
pub use estimate::EstimateLayer;
pub use idempotency::IdempotencyLayer;
pub use priority::{Deadline, Priority, Timings, UnknownPriority};
pub use queue::{PriorityQueueLayer, QueueConfig};
pub use quota::{CapWindow, Dimension, InvalidLimit, Limit, PeriodCap, Quota};
pub use reconcile::ReconcileLayer;
pub use retry::{RetryAfterLayer, RetryPolicy};
pub use stack::QuotaStack;
pub use timer::{MAX_DURATION, capped as capped_duration, saturating_deadline};
pub use token_budget::{MissingCost, TokenBudgetLayer};

// The README's examples run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;
