//! A node's state at one instant, for a quota API or a status page.

use std::time::Duration;

use crate::priority::Priority;
use crate::quota::Dimension;
use crate::quota::LimitSnapshot;

use super::path::Tenant;
use crate::quota::PeriodCap;

/// One node of a tenant tree at one instant, from
/// [`TenantHandle::snapshot`](super::TenantHandle::snapshot).
///
/// Token figures are in the account's reference dimension (its total-tokens limit, else its
/// input-tokens limit, else requests) per minute: `used` is what the node's requests took in
/// the last minute (a sliding estimate), `guaranteed` what its guarantee is worth,
/// `borrowed` what it uses beyond it, `lent` the part of its guarantee it leaves to others.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantSnapshot {
    pub(crate) path: Tenant,
    pub(crate) limits: Vec<LimitSnapshot>,
    pub(crate) weight: u32,
    pub(crate) paused: bool,
    pub(crate) in_flight: usize,
    pub(crate) used: u64,
    pub(crate) guaranteed: u64,
    pub(crate) queued: [usize; 3],
    pub(crate) today: Vec<(PeriodCap, u64)>,
}

impl TenantSnapshot {
    /// The node.
    pub fn path(&self) -> &Tenant {
        &self.path
    }

    /// The node's own limits (its borrowing cap included) and their levels.
    pub fn limits(&self) -> &[LimitSnapshot] {
        &self.limits
    }

    /// The state of the node's limit on `dimension` per `period`, if it has one.
    pub fn limit(&self, dimension: Dimension, period: Duration) -> Option<&LimitSnapshot> {
        crate::quota::snapshot::find(&self.limits, dimension, period)
    }

    /// The states of every limit of the node on `dimension`, in its configuration's order.
    pub fn limits_of(&self, dimension: Dimension) -> impl Iterator<Item = &LimitSnapshot> + '_ {
        crate::quota::snapshot::of(&self.limits, dimension)
    }

    /// The node's weight in the fair share (the product of the weights on its path).
    pub fn weight(&self) -> u32 {
        self.weight
    }

    /// Whether the node is paused.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// Calls in flight below the node.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Tokens used in the last minute.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Tokens a minute its guarantee is worth (0 without one).
    pub fn guaranteed(&self) -> u64 {
        self.guaranteed
    }

    /// Tokens of the last minute used beyond the guarantee: borrowed from idle shares.
    pub fn borrowed(&self) -> u64 {
        self.used.saturating_sub(self.guaranteed)
    }

    /// The part of the guarantee left unused in the last minute: lent to the others.
    pub fn lent(&self) -> u64 {
        self.guaranteed.saturating_sub(self.used)
    }

    /// Requests of the node (and below it) waiting in `priority`'s class.
    pub fn queued(&self, priority: Priority) -> usize {
        self.queued[priority.index()]
    }

    /// Each daily cap with what its current day has used.
    pub fn used_in_period(&self) -> &[(PeriodCap, u64)] {
        &self.today
    }
}
