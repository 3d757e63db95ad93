//! A point-in-time view of a budget, for introspection and health endpoints.

use std::num::NonZeroUsize;
use std::time::Duration;

use tokio::time::Instant;

use crate::cost::Cost;
use crate::quota::snapshot::{find, of};
use crate::quota::{Dimension, LimitSnapshot, PeriodCap};

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
    pub(crate) caps: Vec<(PeriodCap, u64)>,
    pub(crate) live_processes: Option<u32>,
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

    /// The state of the limit on `dimension` per `period`, if the quota has one.
    ///
    /// ```
    /// use std::{num::NonZeroU64, time::Duration};
    /// use tower_llm_quota::{Budget, Dimension, Limit, Quota};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let budget = Budget::new(
    ///     Quota::new()
    ///         .with_limit(Limit::per_minute(Dimension::Requests, NonZeroU64::new(500).unwrap()))
    ///         .with_limit(Limit::per_day(Dimension::TotalTokens, NonZeroU64::new(1_000_000).unwrap())),
    /// );
    /// let snapshot = budget.snapshot();
    /// let daily = snapshot.limit(Dimension::TotalTokens, Duration::from_secs(86_400)).unwrap();
    /// assert_eq!(daily.limit().dimension(), Dimension::TotalTokens);
    /// assert!(snapshot.limit(Dimension::TotalTokens, Duration::from_secs(60)).is_none());
    /// assert_eq!(snapshot.limits_of(Dimension::Requests).count(), 1);
    /// # }
    /// ```
    pub fn limit(&self, dimension: Dimension, period: Duration) -> Option<&LimitSnapshot> {
        find(&self.limits, dimension, period)
    }

    /// The states of every limit on `dimension` (a per-minute and a per-day limit, say), in
    /// the quota's order.
    pub fn limits_of(&self, dimension: Dimension) -> impl Iterator<Item = &LimitSnapshot> + '_ {
        of(&self.limits, dimension)
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

    /// Each of the account's own caps ([`Quota::with_cap`](crate::Quota::with_cap)) with what
    /// its current period has used, reservations included (for a budget shared through a
    /// store, the larger of this process's count and the fleet's as the store last told).
    pub fn used_in_period(&self) -> &[(PeriodCap, u64)] {
        &self.caps
    }

    /// For a budget shared through a store, the live processes on the account at the store's
    /// last count (its heartbeat), this one included: what
    /// [`FailurePolicy::LiveShare`](crate::budget::FailurePolicy::LiveShare) divides by. `None`
    /// in memory, before the first count, or from a store that does not count.
    pub fn live_processes(&self) -> Option<u32> {
        self.live_processes
    }
}
