//! What a request brings to an ordering: its class, its place, how its class ages, how deep
//! the order may grow.

use std::time::Duration;

use tokio::time::Instant;

use crate::priority::Priority;

/// How long a class's front waits before it moves one class up, per class (indexed as
/// `Priority::ALL`), in nanoseconds; `u64::MAX` never.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Aging([u64; 3]);

impl Aging {
    /// No class ever moves up.
    #[cfg(test)]
    pub(crate) const NEVER: Aging = Aging([u64::MAX; 3]);

    /// The defaults of [`QueueConfig`](crate::QueueConfig): async after 30 s, batch after
    /// 120 s.
    pub(crate) const DEFAULT: Aging = Aging([u64::MAX, 30_000_000_000, 120_000_000_000]);

    /// Aging with `after` for each class, highest first.
    pub(crate) fn new(after: [Option<Duration>; 3]) -> Self {
        Aging(after.map(|after| {
            after.map_or(u64::MAX, |d| {
                u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
            })
        }))
    }

    /// How long the front of `priority` waits before it moves up, if it ever does.
    pub(crate) fn after(self, priority: Priority) -> Option<Duration> {
        match self.0[priority.index()] {
            u64::MAX => None,
            nanos => Some(Duration::from_nanos(nanos)),
        }
    }
}

/// A tenant's key and weight, for a fair share inside a class, and the node that guarantees
/// it a share (see `sched::fair`). Key 0 is the flow of a budget without tenants: its
/// requests are served in the order they entered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Flow {
    pub(crate) key: u64,
    pub(crate) weight: u32,
    /// The key of its nearest node with a guarantee (0: none), and that guarantee's share of
    /// the account in millionths.
    pub(crate) guarantor: u64,
    pub(crate) share_ppm: u32,
}

/// A depth limit: how many requests may wait; `u32::MAX` (or more) is no limit.
pub(crate) fn depth(limit: usize) -> u32 {
    u32::try_from(limit).unwrap_or(u32::MAX)
}

impl Flow {
    pub(crate) const DEFAULT: Flow = Flow {
        key: 0,
        weight: 1,
        guarantor: 0,
        share_ppm: 0,
    };
}

/// Everything an ordering needs to place a request; carried in the request's extensions from
/// the [`PriorityQueueLayer`](crate::PriorityQueueLayer) to the budget, so that the budget
/// orders its waiters as the queue would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Scheduling {
    pub(crate) priority: Priority,
    /// When the logical request first entered an ordering (kept across retries).
    pub(crate) enqueued_at: Instant,
    pub(crate) aging: Aging,
    /// The most requests that may wait in all, and in this request's class (`u32::MAX`: no
    /// limit).
    pub(crate) max_depth: u32,
    pub(crate) class_max_depth: u32,
    pub(crate) flow: Flow,
    /// The latest instant at which the request may still be admitted.
    pub(crate) deadline: Option<Instant>,
    /// The deadline is the caller's own ([`Deadline`](crate::Deadline)), not its class's
    /// maximum wait: a budget that can tell it will not be met refuses it at once.
    pub(crate) own_deadline: bool,
    /// The earliest: it waits in its place until then (a retry waiting out `Retry-After`).
    pub(crate) not_before: Option<Instant>,
}

impl Scheduling {
    /// A request of `priority` entering at `enqueued_at`, with the default aging and no depth
    /// limit.
    pub(crate) fn new(priority: Priority, enqueued_at: Instant) -> Self {
        Self {
            priority,
            enqueued_at,
            aging: Aging::DEFAULT,
            max_depth: u32::MAX,
            class_max_depth: u32::MAX,
            flow: Flow::DEFAULT,
            deadline: None,
            own_deadline: false,
            not_before: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aging_round_trips() {
        let aging = Aging::new([None, Some(Duration::from_secs(30)), Some(Duration::MAX)]);
        assert_eq!(aging.after(Priority::Interactive), None);
        assert_eq!(aging.after(Priority::Async), Some(Duration::from_secs(30)));
        assert_eq!(aging.after(Priority::Batch), None);
    }
}
