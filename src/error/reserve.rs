//! Why a budget admitted nothing: [`TryReserveError`] and [`ReserveError`].

use std::fmt;

use super::capacity::{InsufficientCapacity, NotUntil};
use super::service::Error;
use super::store::StoreUnavailable;
use crate::priority::Priority;
use crate::tenant::TenantRefused;

/// Why [`Budget::try_reserve`](crate::Budget::try_reserve) admitted nothing.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum TryReserveError {
    /// Not yet: retry at the time it names.
    NotYet(NotUntil),
    /// Every in-flight slot of the quota is taken: retry when a call ends.
    NoSlot,
    /// Never: the cost exceeds a bucket's capacity.
    Never(InsufficientCapacity),
    /// The budget is shared through a store that a synchronous call cannot ask.
    Unavailable(StoreUnavailable),
    /// A scope of the tenant path refused it (paused, its day spent, too large for it).
    Tenant(TenantRefused),
}

impl fmt::Display for TryReserveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TryReserveError::NotYet(e) => e.fmt(f),
            TryReserveError::NoSlot => f.write_str("every in-flight slot is taken"),
            TryReserveError::Never(e) => e.fmt(f),
            TryReserveError::Unavailable(e) => e.fmt(f),
            TryReserveError::Tenant(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for TryReserveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TryReserveError::NotYet(e) => Some(e),
            TryReserveError::NoSlot => None,
            TryReserveError::Never(e) => Some(e),
            TryReserveError::Unavailable(e) => Some(e),
            TryReserveError::Tenant(e) => Some(e),
        }
    }
}

/// Why [`Budget::reserve`](crate::Budget::reserve) admitted nothing.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ReserveError {
    /// The cost exceeds a bucket's capacity: it can never be admitted.
    TooLarge(InsufficientCapacity),
    /// The budget's shared store did not answer and its
    /// [`FailurePolicy`](crate::budget::FailurePolicy) is to refuse (or the local fallback
    /// share cannot pay the cost).
    Unavailable(StoreUnavailable),
    /// The budget's ordering holds as many waiting requests as the request's
    /// [`QueueConfig`](crate::QueueConfig) allows.
    QueueFull {
        /// The request's class.
        priority: Priority,
        /// The depth it would exceed.
        depth: usize,
    },
    /// A scope of the tenant path refused it (paused, its day spent, too large for it).
    Tenant(TenantRefused),
    /// Its deadline cannot be met: the costs waiting ahead of it and its own, at the quota's
    /// rate, would keep it waiting `predicted`, past it. Refused on arrival, not after
    /// waiting it out.
    DeadlineUnmet {
        /// The request's class.
        priority: Priority,
        /// How long it would wait, predicted.
        predicted: std::time::Duration,
        /// What it would wait for.
        binding: Box<super::Binding>,
    },
}

impl ReserveError {
    /// The bucket that is too small, when the cost can never be admitted.
    pub fn insufficient_capacity(&self) -> Option<&InsufficientCapacity> {
        match self {
            ReserveError::TooLarge(e) => Some(e),
            _ => None,
        }
    }

    /// The scope that refused it, when a node of its tenant path did.
    pub fn tenant_refused(&self) -> Option<&TenantRefused> {
        match self {
            ReserveError::Tenant(e) => Some(e),
            _ => None,
        }
    }
}

impl fmt::Display for ReserveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReserveError::TooLarge(e) => e.fmt(f),
            ReserveError::Unavailable(e) => e.fmt(f),
            ReserveError::QueueFull { priority, depth } => {
                write!(f, "{depth} requests already wait (class {priority})")
            }
            ReserveError::Tenant(e) => e.fmt(f),
            ReserveError::DeadlineUnmet {
                priority,
                predicted,
                ..
            } => write!(
                f,
                "{} {priority} request would wait about {} for the quota, past its deadline",
                super::service::article(*priority),
                super::service::rounded(*predicted)
            ),
        }
    }
}

impl std::error::Error for ReserveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReserveError::TooLarge(e) => Some(e),
            ReserveError::Unavailable(e) => Some(e),
            ReserveError::QueueFull { .. } | ReserveError::DeadlineUnmet { .. } => None,
            ReserveError::Tenant(e) => Some(e),
        }
    }
}

impl From<ReserveError> for Error {
    fn from(e: ReserveError) -> Self {
        match e {
            ReserveError::TooLarge(e) => e.into(),
            ReserveError::Unavailable(e) => Self::store_unavailable(Box::new(e)),
            ReserveError::QueueFull { priority, depth } => Self::queue_full(priority, depth),
            ReserveError::Tenant(e) => Self::tenant_refused_by(Box::new(e)),
            ReserveError::DeadlineUnmet {
                priority,
                predicted,
                binding,
            } => Self::deadline_unmet(priority, predicted, Some(binding)),
        }
    }
}
