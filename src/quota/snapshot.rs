//! One limit's state at one instant: the part of a snapshot that budgets and tenant nodes
//! report alike.

use std::time::Duration;

use tokio::time::Instant;

use super::{Dimension, Limit};

/// One limit's state in a [`BudgetSnapshot`](crate::budget::BudgetSnapshot).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitSnapshot {
    pub(crate) limit: Limit,
    pub(crate) capacity: u64,
    pub(crate) level: i64,
    pub(crate) extra: u64,
    pub(crate) available_at: Instant,
    pub(crate) full_at: Instant,
}

impl LimitSnapshot {
    /// The limit, as configured or last adapted.
    pub fn limit(&self) -> &Limit {
        &self.limit
    }

    /// The most the bucket holds.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// What the bucket holds, rounded down; negative while in debt.
    pub fn level(&self) -> i64 {
        self.level
    }

    /// What the budget may spend beyond the bucket's level and capacity, because the
    /// provider's rate-limit headers show it holds that much (see
    /// [`AdaptiveShare::spend_reported_burst`](crate::budget::AdaptiveShare::spend_reported_burst)):
    /// spent after the level, never refilled. 0 for a limit that does not adapt.
    pub fn extra(&self) -> u64 {
        self.extra
    }

    /// What the bucket owes: usage beyond the estimates, still to be paid off by refill.
    pub fn debt(&self) -> u64 {
        self.level.min(0).unsigned_abs()
    }

    /// When at least one unit may be spent, from the level or the [extra](Self::extra) (the
    /// snapshot's time if it may now).
    pub fn available_at(&self) -> Instant {
        self.available_at
    }

    /// When the bucket is full again (the snapshot's time if it is full now).
    pub fn full_at(&self) -> Instant {
        self.full_at
    }
}

/// The limit on `dimension` per `period` among `limits`.
pub(crate) fn find(
    limits: &[LimitSnapshot],
    dimension: Dimension,
    period: Duration,
) -> Option<&LimitSnapshot> {
    of(limits, dimension).find(|l| l.limit.period() == period)
}

/// The limits on `dimension` among `limits`.
pub(crate) fn of(
    limits: &[LimitSnapshot],
    dimension: Dimension,
) -> impl Iterator<Item = &LimitSnapshot> + '_ {
    limits
        .iter()
        .filter(move |l| l.limit.dimension() == dimension)
}
