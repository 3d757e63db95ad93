//! Decide who goes next: priority classes, aging, per-class deadlines, bounded depth.
//!
//! [`PriorityQueueLayer`] gives every request its class (the configured default if it has
//! none), its place (its enqueue time, kept across retries by [`EnqueuedAt`])
//! and its deadline (its class's maximum wait, unless it carries a [`Deadline`](crate::Deadline)),
//! and orders the requests waiting for the inner service by them: by [`Priority`](crate::Priority),
//! then by age, not by arrival.
//!
//! Placed outside a [`TokenBudgetLayer`], the queue never holds a request itself: the budget is
//! always ready and its own ordering — the same one, fed by the class, place, aging and depth
//! the queue stamped on the request — decides which waiting request the quota, an in-flight
//! slot or a class floor serves next. One ordering holds at every place a request waits
//! (ARCHITECTURE.md, "The path of one request").
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU64;
//! use std::time::Duration;
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//! use tower_llm_quota::{
//!     Budget, Cost, Dimension, Limit, Priority, PriorityQueueLayer, QueueConfig, Quota,
//!     TokenBudgetLayer,
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_llm_quota::BoxError> {
//! let budget = Budget::new(Quota::new().with_limit(Limit::per_minute(
//!     Dimension::TotalTokens,
//!     NonZeroU64::new(30_000).unwrap(),
//! )));
//! let queue = PriorityQueueLayer::new(
//!     QueueConfig::new().max_wait(Priority::Interactive, Duration::from_millis(300)),
//! );
//! let handle = queue.handle();
//! let client = service_fn(|_req: http::Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(http::Response::new(String::from("done")))
//! });
//! let mut llm = ServiceBuilder::new()
//!     .layer(queue)
//!     .layer(TokenBudgetLayer::new(budget))
//!     .service(client);
//!
//! let mut request = http::Request::new(String::from("{...}"));
//! request.extensions_mut().insert(Cost::new(800, 200));
//! request.extensions_mut().insert(Priority::Interactive);
//! let response = llm.ready().await?.call(request).await?;
//! assert_eq!(response.into_body(), "done");
//! assert_eq!(handle.snapshot().depth(), 0);
//! # Ok(()) }
//! ```
//!
//! # Order of service
//!
//! A lower class is served only when no request of a higher class waits; inside a class,
//! first in, first out. **Aging** prevents starvation: the request at the front of a class moves
//! one class up once it has been the front for its class's ceiling
//! ([`QueueConfig::promote_after`]), and keeps moving up while it keeps waiting; among requests
//! of one (effective) class, the one that came first goes first (a promoted request before the
//! requests of its new class that came after it). Aging is computed when a
//! decision is made: no timer per request, no scan (only the front of each class can be next).
//!
//! Only the front ages, counted from when it became the front: a backlog submitted at once is
//! never promoted at once, so a higher class waits behind at most one promoted request of each
//! lower class at a time.
//!
//! **Worst-case wait.** Under a load of higher classes that saturates the quota, with the
//! defaults, the front of the batch class reaches interactive 150 s (120 + 30) after it became
//! the front, and the front of the async class 30 s after; it then waits for at most the
//! interactive requests that came before it and one request in flight. So the k-th batch
//! request in line waits at most about k × 150 s, the k-th async request k × 30 s, plus those
//! waits. Whenever the higher classes leave capacity, lower classes are served at once, without
//! waiting for aging. Without aging (`promote_after(.., None)`) a lower class can starve.
//!
//! # Deadlines and depth
//!
//! Each class has a maximum wait ([`QueueConfig::max_wait`]); a [`Deadline`](crate::Deadline)
//! in the request's extensions overrides it. The layer forwards the deadline in the request's
//! extensions, so a [`TokenBudgetLayer`] inside keeps enforcing it while the request waits for
//! budget. Past it, the request fails with an [`Error`](crate::Error) for which
//! `is_deadline_exceeded()` and `is_local()` hold, naming the class and the time waited:
//! nothing was sent. Past the total or per-class depth, a new request is shed at once
//! (`is_queue_full()`), so memory stays bounded.
//!
//! # Where the layers go
//!
//! The recommended stack, outermost first, and why:
//!
//! 1. **retry** outside the queue: every attempt queues again, keeping its first place, so
//!    retries obey priority and budget like first attempts;
//! 2. **[`PriorityQueueLayer`]** outside the budget: it stamps each request's class, place,
//!    aging and deadline, which the budget's ordering follows;
//! 3. **[`TokenBudgetLayer`]**: admits the request's tokens and its in-flight slot (a
//!    [`Quota::with_max_in_flight`](crate::Quota::with_max_in_flight)) together, from the head
//!    of its ordering, so a request waiting for a slot holds no tokens and one waiting for
//!    tokens holds no slot;
//! 4. **[`ReconcileLayer`](crate::ReconcileLayer)** next to the client: it sees the real body
//!    and settles the reservation (giving back the slot) when it ends.
//!
//! In the opposite order (budget outside the queue) the budget would order requests by the
//! defaults rather than by the queue's configuration.
//!
//! # Readiness
//!
//! [`PriorityQueue`] is always ready: requests wait in its response futures, and a full
//! ordering refuses there (`is_queue_full()`). A `tower::load_shed::LoadShed` outside it never
//! sheds; a `tower::buffer::Buffer` outside it forwards at once. Backpressure shows as queue
//! depth and as local refusals, not as `Pending` readiness.
//!
//! # Cancel safety
//!
//! A request dropped while queued leaves no trace: its place in the queue and its deadline
//! timer are gone, and the next request is told to look. It has reserved no budget yet.
//!
//! [`TokenBudgetLayer`]: crate::TokenBudgetLayer

mod config;
mod future;
mod inner;
mod layer;
mod service;

pub use crate::priority::{EnqueuedAt, NotBefore};
pub use crate::sched::{ClassSnapshot, QueueSnapshot};
pub use config::{ClassConfig, QueueConfig};
pub use future::ResponseFuture;
pub use inner::QueueHandle;
pub(crate) use inner::QueueLink;
pub use layer::PriorityQueueLayer;
pub use service::PriorityQueue;
