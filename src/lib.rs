#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod budget;
mod builder;
mod cost;
mod error;
pub mod estimate;
mod loom;
#[cfg(feature = "reqwest")]
pub mod middleware;
mod observe;
pub mod parse;
mod priority;
pub mod provider;
pub mod queue;
mod quota;
pub mod reconcile;
pub mod retry;
pub mod routing;
mod sched;
#[cfg(feature = "serde")]
mod serialize;
#[cfg(feature = "sim")]
pub mod sim;
pub mod stack;
pub mod tenant;
#[cfg(test)]
mod test_util;
mod timer;
pub mod token_budget;
pub mod usage;

pub mod idempotency;
pub mod jobs;

pub use budget::{
    AdaptiveShare, Budget, BudgetSnapshot, FailurePolicy, LimitSnapshot, Observation, Reservation,
    ReservationId, ReservationSlot, Reserve, Settlement, StoreUnavailable,
};
pub use builder::ServiceBuilderExt;
pub use cost::{Cost, Usage};
pub use error::{BoxError, Error, InsufficientCapacity, NotUntil, ReserveError, TryReserveError};
pub use estimate::{CharEstimator, Estimate, EstimateLayer, Estimator, LearnedOutput, OutputRoute};
pub use priority::{Deadline, EnqueuedAt, Priority, Timings};
pub use queue::{
    ClassSnapshot, PriorityQueue, PriorityQueueLayer, QueueConfig, QueueHandle, QueueSnapshot,
};
pub use quota::{DEFAULT_BURST_FRACTION, DEFAULT_HEADROOM, Dimension, InvalidLimit, Limit, Quota};
pub use reconcile::{
    BodyEnd, ExtensionUsage, ExtractUsage, Reconcile, ReconcileBody, ReconcileLayer, ScanUsage,
};
pub use retry::{
    Classify, ClassifyFn, FailureClass, ProviderErrors, RetryAfter, RetryAfterLayer, RetryPolicy,
    RetryReport,
};
pub use token_budget::{MissingCost, TokenBudget, TokenBudgetLayer};

pub use idempotency::{IdempotencyLayer, Operation};
