//! Reserve a request's estimated cost in every dimension before it leaves, or make it wait.
//!
//! [`TokenBudgetLayer`] reads the [`Cost`](crate::Cost) in each request's extensions, waits
//! until the shared [`Budget`](crate::Budget) admits it, puts the
//! [`Reservation`](crate::Reservation) into the request's extensions (as a
//! [`ReservationSlot`](crate::ReservationSlot)) and calls the inner service.
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU64;
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//! use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota, TokenBudgetLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_llm_quota::BoxError> {
//! let budget = Budget::new(Quota::new().with_limit(Limit::per_minute(
//!     Dimension::TotalTokens,
//!     NonZeroU64::new(30_000).unwrap(),
//! )));
//! let client = service_fn(|_req: http::Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(http::Response::new(String::from("hi")))
//! });
//! let mut governed = ServiceBuilder::new()
//!     .layer(TokenBudgetLayer::new(budget.clone()))
//!     .service(client);
//!
//! let mut request = http::Request::new(String::from("{...}"));
//! request.extensions_mut().insert(Cost::new(1_000, 200));
//! let response = governed.ready().await?.call(request).await?;
//! assert_eq!(response.into_body(), "hi");
//! // No ReconcileLayer settled it, so the estimate stays charged.
//! assert_eq!(budget.snapshot().limits()[0].level(), 5_000 - 1_200);
//! # Ok(()) }
//! ```
//!
//! # Design: why readiness does not reserve
//!
//! Tower's `poll_ready` cannot see the request, so it cannot know the cost to reserve. This
//! layer therefore waits for the budget *inside the response future*, and its `poll_ready`
//! says something weaker but honest: **ready when no request is waiting for this budget**,
//! so a new call would be considered at once rather than queue behind others. This gives three
//! properties:
//!
//! - **Inner readiness stays honest.** The inner service's `poll_ready` is driven only after
//!   the budget admitted the request, right before `call`: a request waiting for quota never
//!   holds a scarce inner slot (such as a concurrency permit).
//! - **An outer scheduler decides the order.** While one request waits for budget, the layer
//!   reports not ready, so a priority queue in front of it keeps the others and hands over the
//!   best one when the budget frees up, instead of every request queueing here in arrival
//!   order. Clones of the service each see the same readiness; requests that do enter the
//!   budget's queue are admitted first in, first out.
//! - **Cancel safety at every await point.** Dropped while waiting for the budget: it leaves
//!   the queue and reserves nothing. Dropped after admission but before the call: the
//!   reservation is refunded in full. Dropped during the call: the reservation is charged its
//!   estimate (the provider may have counted the call), unless an inner layer such as
//!   [`ReconcileLayer`](crate::ReconcileLayer) took it to settle with real usage.
//!
//! A request without a [`Cost`](crate::Cost) follows [`MissingCost`]: rejected by default,
//! with an error for which [`Error::is_missing_cost`](crate::Error::is_missing_cost) holds.
//!
//! # Deadlines, class headroom and timings
//!
//! A [`Deadline`](crate::Deadline) in the request's extensions (set by the caller, or by a
//! [`PriorityQueueLayer`](crate::PriorityQueueLayer) in front) bounds the wait for the budget
//! and for the inner service's readiness: past it, the request fails locally
//! ([`Error::is_deadline_exceeded`](crate::Error::is_deadline_exceeded)), leaving the budget's
//! queue or refunding its reservation. [`TokenBudgetLayer::class_headroom`] keeps a share of
//! every bucket out of reach of a lower [`Priority`](crate::Priority), so that higher classes
//! find it at once. The time waited and the time of the call are recorded apart in the
//! response's [`Timings`](crate::Timings).

mod future;
mod layer;
mod service;

pub use future::ResponseFuture;
pub use layer::TokenBudgetLayer;
pub use service::{MissingCost, TokenBudget};
