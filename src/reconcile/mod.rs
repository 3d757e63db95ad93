//! Settle each reservation with the real usage, when the response body ends.
//!
//! [`ReconcileLayer`] takes the [`Reservation`](crate::Reservation) that
//! [`TokenBudget`](crate::token_budget::TokenBudget) put in the request's extensions and wraps the response
//! body in a [`ReconcileBody`] that settles it when the body **ends, fails or is dropped**,
//! whichever comes first. Streams report their usage at their end, so settling when the headers
//! arrive would be too early.
//!
//! The usage comes from an [`ExtractUsage`]: a scanner sees every byte of the body as it passes
//! through to the caller unchanged (nothing is buffered by this layer) and may report a
//! [`Usage`](crate::Usage) at the end. Without one, or when it finds nothing, a `Usage` placed in
//! the response's extensions by the inner client is used. With neither, the usage is missing and
//! the reservation is charged its estimate: never refunded blindly. The exception is an error
//! response (4xx or 5xx) without usage: providers bill no tokens for a rejected call, so its
//! tokens are refunded and only its request stays counted.
//!
//! A caller that needs the usage too puts a [`UsageReport`] in the request's extensions and
//! reads it when the body is done: the body is scanned once.
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU64;
//! use http_body_util::{BodyExt, Full};
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//! use tower_llm_quota::{
//!     Budget, Cost, Dimension, Limit, Quota, ReconcileLayer, TokenBudgetLayer, Usage,
//! };
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), tower_llm_quota::BoxError> {
//! let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap());
//! let budget = Budget::new(Quota::new().with_limit(tpm));
//! let client = service_fn(|_req: http::Request<String>| async {
//!     let mut response = http::Response::new(Full::new(bytes::Bytes::from("answer")));
//!     response.extensions_mut().insert(Usage::new(1_000, 40));
//!     Ok::<_, std::convert::Infallible>(response)
//! });
//! let mut governed = ServiceBuilder::new()
//!     .layer(TokenBudgetLayer::new(budget.clone()))
//!     .layer(ReconcileLayer::new())
//!     .service(client);
//!
//! let mut request = http::Request::new(String::new());
//! request.extensions_mut().insert(Cost::new(1_000, 200));
//! let response = governed.ready().await?.call(request).await?;
//! // Reserved 1,200 tokens; still held while the body is read...
//! assert_eq!(budget.snapshot().limits()[0].level(), 5_000 - 1_200);
//! let body = response.into_body().collect().await?.to_bytes();
//! assert_eq!(body, "answer");
//! // ...and settled at its end: 160 unused tokens came back.
//! assert_eq!(budget.snapshot().limits()[0].level(), 5_000 - 1_040);
//! # Ok(()) }
//! ```

mod body;
mod extract;
mod future;
mod layer;
mod report;
mod service;

pub use body::ReconcileBody;
pub use extract::{BodyEnd, ExtensionUsage, ExtractUsage, NoScan, ScanUsage};
pub use future::ResponseFuture;
pub use layer::ReconcileLayer;
pub use report::UsageReport;
pub use service::Reconcile;
