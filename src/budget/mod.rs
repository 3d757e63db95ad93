//! A shared, multi-dimension token budget: reserve before a call, settle after it.
//!
//! A [`Budget`] holds one token bucket per [`Limit`](crate::Limit) of a
//! [`Quota`](crate::Quota) (requests, input tokens, output tokens, total tokens; per minute, per
//! day, or any period). Buckets refill continuously, computed lazily from elapsed
//! [`tokio::time::Instant`]: no timers, no drift, and tests drive it with tokio's paused clock.
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU64;
//! use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota, Usage};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let nz = |n| NonZeroU64::new(n).unwrap();
//! let budget = Budget::new(
//!     Quota::new()
//!         .with_limit(Limit::per_minute(Dimension::Requests, nz(500)))
//!         .with_limit(Limit::per_minute(Dimension::TotalTokens, nz(30_000))),
//! );
//!
//! // Before the call: reserve the estimate (waits if the budget cannot pay yet).
//! let mut reservation = budget.reserve(Cost::new(1_200, 200)).await?;
//! reservation.mark_sent();
//! // ... the call ...
//! // After it: settle with what the provider reports; the unused 150 tokens come back.
//! let settled = reservation.settle(&Usage::new(1_200, 50));
//! assert_eq!(settled.refunded(Dimension::TotalTokens), 150);
//! # Ok(()) }
//! ```
//!
//! # Why a token bucket per dimension
//!
//! Providers limit requests *and* tokens, and a call must fit all of its limits: limiting only
//! calls lets ten huge prompts exhaust the token quota. A token bucket's capacity is the burst
//! accepted at once and its refill rate the sustained regime, so unlike a fixed window it never
//! passes two bursts at a window boundary. Admission is all or nothing: a request that does not
//! fit one bucket takes nothing from the others.
//!
//! # Waiting: one ordering
//!
//! Requests that cannot be admitted at once wait in the budget's ordering: by
//! [`Priority`](crate::Priority) (the front of a class ages up), then by the time they first
//! entered (kept across retries), then by arrival. Only the head may be admitted: a large
//! request at the head is never overtaken by a stream of small ones (a sleep-and-recheck loop
//! lets that happen). The trade-off is head-of-line blocking: a small request that would fit
//! now waits behind a large one at the head, exactly as tokio's semaphore does. One exception
//! keeps class floors honest: a head that waits only to keep its class's floor
//! ([`Reserve::floor`]) lets a request with a lower floor behind it go first.
//!
//! Only the head sleeps, until the instant its cost becomes available; it is woken earlier
//! when a refund, a released in-flight slot or a limit change makes that sooner. The others
//! wait without a timer, so waiting costs no CPU.
//!
//! Every resource of an admission is taken in one step from the head of that one ordering:
//! every bucket the cost touches and, when the quota caps calls in flight
//! ([`Quota::with_max_in_flight`](crate::Quota::with_max_in_flight)), a slot. So whatever
//! binds — tokens, a slot, a shared store, a floor — the next request served is the one the
//! ordering names, and a request waiting for one resource holds none of the others.
//!
//! # Cancel safety
//!
//! [`Reserve`] is cancel safe: dropping it leaves the queue (and wakes the next waiter if it was
//! at the head), and a reservation is only ever handed out by a completed future. A dropped
//! [`Reservation`] is refunded or charged by the rule in its documentation, so no capacity
//! leaks.

// No function of the admission path is longer than a screen (clippy.toml).
#![warn(clippy::too_many_lines)]

mod engine;
mod facade;
mod handle;
#[cfg(all(test, loom))]
mod loom_ordering;
pub(crate) mod memory;
mod observation;
mod reservation;
mod reserve;
pub(crate) mod snapshot;
pub mod store;
pub(crate) mod tenants;

pub use crate::error::StoreUnavailable;
pub use crate::quota::AdaptiveShare;
pub use crate::quota::LimitSnapshot;
pub(crate) use engine::{Answer, Ask, Step, Waiting};
pub use handle::Budget;
pub(crate) use memory::bucket::Floor;
pub use memory::store::ReservationId;
pub use observation::Observation;
pub use reservation::{Reservation, ReservationSlot, Settlement};
pub use reserve::Reserve;
pub use snapshot::BudgetSnapshot;
pub use store::FailurePolicy;
pub use tenants::TenantHandle;
