//! The budget's typed answers about capacity: never ([`InsufficientCapacity`]) and not yet
//! ([`NotUntil`]).

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use crate::quota::Dimension;

/// A cost larger than a bucket's capacity: it can never be admitted, however long it waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InsufficientCapacity {
    pub(crate) dimension: Dimension,
    pub(crate) period: Duration,
    pub(crate) cost: u64,
    pub(crate) capacity: u64,
}

impl InsufficientCapacity {
    /// The dimension whose bucket is too small.
    pub fn dimension(&self) -> Dimension {
        self.dimension
    }

    /// The period of the limit whose bucket is too small.
    pub fn period(&self) -> Duration {
        self.period
    }

    /// The amount the request asked for in that dimension.
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// The bucket's capacity: the most it admits at once.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }
}

impl fmt::Display for InsufficientCapacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a cost of {} {} exceeds the capacity of {} of the limit per {:?}",
            self.cost, self.dimension, self.capacity, self.period
        )
    }
}

impl std::error::Error for InsufficientCapacity {}

/// Not admitted yet: the cost fits no earlier than [`NotUntil::earliest`].
///
/// The time is a lower bound: it accounts for the requests already waiting in the budget's
/// queue, but a settlement with debt or a lowered limit may push it later, and a refund may
/// bring it sooner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotUntil {
    pub(crate) at: Instant,
    pub(crate) dimension: Dimension,
    pub(crate) period: Duration,
}

impl NotUntil {
    /// The earliest instant at which the cost may be admitted.
    pub fn earliest(&self) -> Instant {
        self.at
    }

    /// How long to wait from `now`.
    pub fn wait_time_from(&self, now: Instant) -> Duration {
        self.at.saturating_duration_since(now)
    }

    /// The dimension that has to refill the longest.
    pub fn dimension(&self) -> Dimension {
        self.dimension
    }

    /// The period of the limit that has to refill the longest.
    pub fn period(&self) -> Duration {
        self.period
    }
}

impl fmt::Display for NotUntil {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "not enough {} in the limit per {:?} yet",
            self.dimension, self.period
        )
    }
}

impl std::error::Error for NotUntil {}
