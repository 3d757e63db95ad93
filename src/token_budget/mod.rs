//! Reserve a request's estimated cost in every dimension before it leaves, or make it wait.
//!
//! [`TokenBudgetLayer`] reads the [`Cost`](crate::Cost) in each request's extensions, waits
//! until the shared [`Budget`](crate::Budget) admits it, puts the
//! [`Reservation`](crate::Reservation) into the request's extensions (as a
//! [`ReservationSlot`](crate::budget::ReservationSlot)) and calls the inner service.
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU64;
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//! use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota, TokenBudgetLayer};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
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
//! # Design: one ordering, readiness that does not reserve
//!
//! Tower's `poll_ready` cannot see the request, so it cannot know the cost to reserve. This
//! layer therefore waits for the budget *inside the response future*, in the budget's one
//! ordering, and is always ready. This gives these properties:
//!
//! - **One ordering at every wait.** A waiting request is placed by its class (aging up as
//!   [`QueueConfig`](crate::QueueConfig) says), then by when it first entered (kept across
//!   retries), then by arrival, from what a
//!   [`PriorityQueueLayer`](crate::PriorityQueueLayer) outside stamped on it (or its own
//!   [`Priority`](crate::Priority) and [`EnqueuedAt`](crate::queue::EnqueuedAt)). Only the head is
//!   admitted, with every resource at once: the buckets its cost touches and, when the quota
//!   caps calls in flight, a slot. Whatever binds, the next request served is the one the
//!   ordering names — across every client and layer sharing the budget.
//! - **Nothing held while waiting.** A request waiting for tokens holds no slot, one waiting
//!   for a slot holds no tokens, and neither holds the inner service's readiness: its future
//!   asks for it only once admitted, right before `call`.
//! - **Readiness.** `poll_ready` asks the inner service's readiness (for the service itself,
//!   so that a request the budget admits at once is sent at once, without waiting states)
//!   and is otherwise always ready: backpressure shows as waiting requests and local
//!   refusals, not as `Pending`. A `LoadShed` outside never sheds; a `Buffer` outside
//!   forwards at once; a full ordering refuses with `is_queue_full()`.
//! - **Cancel safety at every await point.** Dropped while waiting for the budget: it leaves
//!   the ordering and reserves nothing. Dropped after admission but before the call: the
//!   reservation is refunded in full. Dropped during the call: the reservation is charged its
//!   estimate (the provider may have counted the call), unless an inner layer such as
//!   [`ReconcileLayer`](crate::ReconcileLayer) took it to settle with real usage.
//!
//! A request without a [`Cost`](crate::Cost) follows [`MissingCost`]: rejected by default,
//! with an error for which [`Error::is_missing_cost`](crate::Error::is_missing_cost) holds.
//!
//! # Deadlines, class floor and timings
//!
//! A [`Deadline`](crate::Deadline) in the request's extensions (set by the caller, or by a
//! [`PriorityQueueLayer`](crate::PriorityQueueLayer) in front) bounds the wait for the budget
//! and for the inner service's readiness: past it, the request fails locally
//! ([`Error::is_deadline_exceeded`](crate::Error::is_deadline_exceeded)), leaving the budget's
//! queue or refunding its reservation. [`TokenBudgetLayer::class_floor`] keeps a share of
//! every bucket out of reach of a lower [`Priority`](crate::Priority), so that higher classes
//! find it at once. The time waited and the time of the call are recorded apart in the
//! response's [`Timings`](crate::Timings).

// No function of the admission path is longer than a screen (clippy.toml).
#![warn(clippy::too_many_lines)]

mod future;
mod layer;
mod service;

pub use future::ResponseFuture;
pub use layer::TokenBudgetLayer;
pub use service::{MissingCost, TokenBudget};
