//! The names most programs use, in one import: `use tower_llm_quota::prelude::*;`.
//!
//! The crate root holds the layers and the budget; the prelude adds the typed answers and
//! reports most programs name next (a probe's [`TryReserveError`], a retry's [`RetryReport`],
//! the store's [`FailurePolicy`], a retried request's [`EnqueuedAt`], a header's
//! [`Observation`]), the provider profiles, tenants and grouping. It leaves out the crate's
//! `Error` and `BoxError`, whose short names clash with others': name them as
//! `tower_llm_quota::Error`.
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU64;
//! use tower_llm_quota::prelude::*;
//!
//! let quota = Quota::new()
//!     .with_limit(Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap()));
//! let stack = QuotaStack::openai(quota);
//! match stack.budget().try_reserve(Cost::new(100, 50)) {
//!     Ok(reservation) => drop(reservation), // refunded
//!     Err(TryReserveError::NotYet(when)) => println!("retry at {:?}", when.earliest()),
//!     Err(other) => println!("{other}"),
//! }
//! let _class = Priority::Batch;
//! ```

pub use crate::ServiceBuilderExt;
pub use crate::budget::{Budget, FailurePolicy, Observation, Reservation};
pub use crate::cost::{Cost, Usage};
pub use crate::error::TryReserveError;
pub use crate::estimate::EstimateLayer;
pub use crate::group::{GroupConfig, GroupItem, Grouper};
pub use crate::idempotency::IdempotencyLayer;
pub use crate::priority::{Deadline, EnqueuedAt, Priority};
pub use crate::provider::{Profile, ProviderUsage};
pub use crate::queue::{PriorityQueueLayer, QueueConfig};
pub use crate::quota::{Dimension, Limit, Quota};
pub use crate::reconcile::ReconcileLayer;
pub use crate::retry::{RetryAfterLayer, RetryPolicy, RetryReport};
pub use crate::stack::QuotaStack;
pub use crate::tenant::Tenant;
pub use crate::token_budget::TokenBudgetLayer;
