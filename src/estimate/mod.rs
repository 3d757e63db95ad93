//! Estimate each request's [`Cost`](crate::Cost) from its body before it is sent.
//!
//! A budget can only reserve what it is told a request will cost. [`EstimateLayer`] reads the
//! JSON body of an LLM request (OpenAI Chat Completions, OpenAI Responses, Anthropic
//! Messages), counts its prompt tokens with an [`Estimator`], adds the output it may generate
//! (`max_tokens`, or a [default](Defaults::DEFAULT_OUTPUT_TOKENS)) and puts the resulting
//! `Cost` in the request's extensions, where a [`TokenBudgetLayer`](crate::TokenBudgetLayer)
//! below it finds it. Estimates err high: the reconcile step refunds what was not used.
//!
//! - [`CharEstimator`], the default: about 3.5 characters per token, weighted by kind of
//!   character so that it does not under-count code, numbers or non-English text. No tokenizer.
//! - `TiktokenEstimator`, with the `tiktoken` feature: OpenAI's exact encodings
//!   (`o200k_base`, `cl100k_base`), chosen by the request's model.
//! - [`read_request`] and [`estimate`]: the body reader, usable without the layer;
//!   [`read_embeddings`] for embeddings requests (read by the layer for a path ending in
//!   `/embeddings`); [`read_request_json`] and [`read_embeddings_json`] over a body already
//!   parsed.
//! - A layer above that already read the body (with this layer's estimator and defaults) may
//!   put its [`RequestEstimate`] in the request's extensions: the layer then prices it, learns
//!   its output and puts its `Cost` without reading the body again (it reads a streamed
//!   request's body only to ask for its usage). A `Cost` already there is kept as it is.
//! - [`LargestOutput`]: the most output each model may answer, what a request without a
//!   `max_tokens` is reserved at where a cap must never be passed.
//! - [`LearnedOutput`]: optionally reserve the p95 of a route's recent outputs instead of the
//!   full `max_tokens`; whatever reads the real usage feeds it through the [`OutputRoute`] the
//!   layer puts in the request's extensions.
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU64;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//! use tower_llm_quota::{Budget, Cost, Dimension, EstimateLayer, Limit, Quota, TokenBudgetLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_llm_quota::BoxError> {
//! let budget = Budget::new(Quota::new().with_limit(Limit::per_minute(
//!     Dimension::TotalTokens,
//!     NonZeroU64::new(30_000).unwrap(),
//! )));
//! let client = service_fn(|request: http::Request<Full<Bytes>>| async move {
//!     let cost = *request.extensions().get::<Cost>().expect("estimated");
//!     Ok::<_, std::convert::Infallible>(http::Response::new(cost))
//! });
//! let mut governed = ServiceBuilder::new()
//!     .layer(EstimateLayer::new())
//!     .layer(TokenBudgetLayer::new(budget))
//!     .service(client);
//!
//! let body = r#"{"model":"gpt-4o","max_tokens":200,"messages":[
//!     {"role":"system","content":"You are terse."},
//!     {"role":"user","content":"What is a token bucket?"}]}"#;
//! let request = http::Request::post("https://api.openai.com/v1/chat/completions")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from(body)))?;
//! let cost = governed.ready().await?.call(request).await?.into_body();
//! assert_eq!(cost.output_tokens(), 200);
//! // Per message 4 of framing, its role and its text; 3 priming the reply: 15 + 18 + 3.
//! assert_eq!(cost.input_tokens(), 36);
//! # Ok(()) }
//! ```
//!
//! # The body
//!
//! The service needs the request's body type to be rebuilt from bytes: `B: Body + From<Bytes>`,
//! as `http_body_util::Full<Bytes>`, `reqwest::Body` or `axum::body::Body` are. It reads the
//! body when
//!
//! - the request carries no `Cost` yet (a `Cost` set by the caller is left untouched, and the
//!   body is not read),
//! - its `content-type` is JSON (`application/json` or `*/*+json`) or absent,
//! - and its size is known in advance (`Body::size_hint` has an upper bound, as bodies built
//!   from bytes do) and at most [`EstimateLayer::max_body_bytes`] (4 MiB by default).
//!
//! It then passes `B::from(bytes)` on: the same bytes, in the same order; trailers, which no
//! LLM API uses, are not kept. Any other request passes through untouched, without a `Cost`:
//! the budget's [`MissingCost`](crate::MissingCost) policy decides what happens to it. So does
//! a body that is not a JSON request of a known shape. A body that fails while being read
//! fails the call with the body's error, before anything is sent.
//!
//! The service's error is a [`BoxError`](crate::BoxError): the inner service's error, boxed
//! (an [`Error`](crate::Error) of an inner layer of this crate can be downcast), or the body's.
//!
//! # Where it goes
//!
//! Anywhere above the [`TokenBudgetLayer`](crate::TokenBudgetLayer) and above a
//! [`PriorityQueueLayer`](crate::PriorityQueueLayer), which totals queued demand from the
//! costs. Above a `RetryAfterLayer`, the body is read once and the cost travels with every
//! attempt.
//!
//! # Learned output
//!
//! ```
//! use tower_llm_quota::{EstimateLayer, estimate::LearnedOutput};
//!
//! let learned = LearnedOutput::new();
//! let layer = EstimateLayer::new().learn_output(learned.clone());
//! // ... when a response's usage is known, read from the request's `OutputRoute`:
//! // route.record(usage.output_tokens());
//! # let _ = layer;
//! ```

mod estimator;
mod future;
mod largest;
mod layer;
mod learned;
mod request;
mod service;
mod settings;
#[cfg(feature = "tiktoken")]
mod tiktoken;

pub use estimator::{CharEstimator, Estimator};
pub use future::{InjectedStreamUsage, ResponseFuture};
pub use largest::LargestOutput;
pub use layer::EstimateLayer;
pub use learned::{InvalidQuantile, LearnedOutput, OutputRoute};
pub use request::{
    Defaults, RequestEstimate, estimate, read_embeddings, read_embeddings_json, read_request,
    read_request_json,
};
pub use service::Estimate;
#[cfg(feature = "tiktoken")]
pub use tiktoken::{TiktokenEncoding, TiktokenEstimator};
