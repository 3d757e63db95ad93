#![doc = include_str!("../README.md")]
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
pub mod parse;
pub mod prelude;
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
pub mod jobs;

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
pub use quota::{
    CapWindow, DEFAULT_BURST_FRACTION, DEFAULT_HEADROOM, Dimension, InvalidLimit, Limit, PeriodCap,
    Quota,
};
pub use reconcile::ReconcileLayer;
pub use retry::{RetryAfterLayer, RetryPolicy};
pub use stack::QuotaStack;
pub use timer::MAX_DURATION;
pub use token_budget::{MissingCost, TokenBudgetLayer};
