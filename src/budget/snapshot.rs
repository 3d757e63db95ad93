//! A point-in-time view of a budget, for introspection and health endpoints.

use std::num::NonZeroUsize;

use tokio::time::Instant;

use crate::cost::Cost;
use crate::quota::Limit;

/// A budget's state at one instant, from [`Budget::snapshot`](crate::Budget::snapshot).
///
/// With the `serde` feature it serializes (times relative to the snapshot), for a health or
/// debug endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetSnapshot {
    pub(crate) taken_at: Instant,
    pub(crate) limits: Vec<LimitSnapshot>,
    pub(crate) waiters: usize,
    pub(crate) queued: Cost,
    pub(crate) in_flight: usize,
    pub(crate) max_in_flight: Option<NonZeroUsize>,
}

impl BudgetSnapshot {
    /// When the snapshot was taken.
    pub fn taken_at(&self) -> Instant {
        self.taken_at
    }

    /// Every limit's state, in the quota's order.
    pub fn limits(&self) -> &[LimitSnapshot] {
        &self.limits
    }

    /// Requests waiting for admission.
    pub fn waiters(&self) -> usize {
        self.waiters
    }

    /// The total cost of the waiting requests.
    pub fn queued(&self) -> Cost {
        self.queued
    }

    /// Reservations holding an in-flight slot (calls admitted and not yet ended).
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The cap on calls in flight, if any.
    pub fn max_in_flight(&self) -> Option<NonZeroUsize> {
        self.max_in_flight
    }
}

/// One limit's state in a [`BudgetSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitSnapshot {
    pub(crate) limit: Limit,
    pub(crate) capacity: u64,
    pub(crate) level: i64,
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

    /// What the bucket owes: usage beyond the estimates, still to be paid off by refill.
    pub fn debt(&self) -> u64 {
        self.level.min(0).unsigned_abs()
    }

    /// When the bucket next holds at least one unit (the snapshot's time if it does now).
    pub fn available_at(&self) -> Instant {
        self.available_at
    }

    /// When the bucket is full again (the snapshot's time if it is full now).
    pub fn full_at(&self) -> Instant {
        self.full_at
    }
}
