//! Errors: the crate-level [`Error`] of every service of this crate, and the typed answers of
//! [`Budget::reserve`](crate::budget::Budget::reserve) and
//! [`Budget::try_reserve`](crate::budget::Budget::try_reserve).
//!
//! # One story for the whole stack
//!
//! Every layer that decides something locally fails with [`Error`]: a cost that never fits
//! ([`Error::is_too_large`]), a shared store that did not answer
//! ([`Error::is_store_unavailable`]), a missing cost, a deadline passed while waiting, a full
//! queue, retries exhausted. A failure of the client is wrapped once, as
//! [`Error::is_inner`], and the client's own error is its
//! [`source`](std::error::Error::source). Layers stacked on each other pass an `Error` through
//! unchanged, so the outermost error is the one that decided.
//!
//! # Why a leaf
//!
//! Errors are named by every other module, so this module names only value types (a
//! [`Dimension`](crate::quota::Dimension), a [`Priority`](crate::priority::Priority), a
//! [`TenantRefused`](crate::tenant::TenantRefused)) and defines the failures the layers share:
//! the store's [`StoreUnavailable`], the retry layer's
//! [`FailureClass`](crate::retry::FailureClass) and [`RetryReport`](crate::retry::RetryReport),
//! the idempotency layer's [`IdempotencyError`](crate::idempotency::IdempotencyError). It never
//! names a layer: conversions into other shapes (a
//! [`RateLimitError`](crate::provider::RateLimitError)) live with those shapes.

mod binding;
mod capacity;
pub(crate) mod failure;
pub(crate) mod idempotency;
pub(crate) mod report;
mod reserve;
mod service;
mod store;

pub use binding::Binding;
pub use capacity::{InsufficientCapacity, NotUntil};
pub use reserve::{ReserveError, TryReserveError};
pub use service::{BoxError, Error};
pub use store::StoreUnavailable;
