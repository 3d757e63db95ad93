//! The run-time state of one node: its buckets, calls in flight, pause, daily counts, and a
//! meter of its recent use. Plain data under the budget's mutex.

use std::num::{NonZeroU64, NonZeroUsize};
use std::task::Waker;

use crate::budget::Floor;
use crate::budget::memory::store::{MemoryStore, ReservationId, Store};
use crate::cost::Cost;
use crate::priority::Priority;
use crate::quota::PeriodCap;
use crate::quota::cap::CapCount;
use crate::quota::{Dimension, Limit, Quota};
use crate::tenant::TenantNode;
use crate::tenant::{Refusal, Tenant};

const MINUTE: u64 = 60_000_000_000;

/// How long a request waits for a node that cannot pay it yet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct NodeWait {
    /// When its buckets can pay (nanoseconds), with the limit that binds; `None` while it
    /// waits for one of its calls in flight to end.
    pub(crate) at: Option<(u64, Limit)>,
    /// When the node refuses it instead (its `max_wait`), if it has one.
    pub(crate) give_up: Option<u64>,
}

/// What a node's requests used in the last minute: a sliding estimate over two fixed minutes
/// (the previous minute weighted by how much of it the sliding minute still covers).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Meter {
    minute: u64,
    current: u64,
    previous: u64,
}

impl Meter {
    fn roll(&mut self, now: u64) {
        let minute = now / MINUTE;
        if minute > self.minute {
            self.previous = if minute == self.minute + 1 {
                self.current
            } else {
                0
            };
            (self.minute, self.current) = (minute, 0);
        }
    }

    pub(crate) fn add(&mut self, amount: u64, now: u64) {
        self.roll(now);
        self.current = self.current.saturating_add(amount);
    }

    pub(crate) fn sub(&mut self, amount: u64, now: u64) {
        self.roll(now);
        let taken = amount.min(self.current);
        self.current -= taken;
        self.previous = self.previous.saturating_sub(amount - taken);
    }

    /// The use of the last minute at `now`.
    pub(crate) fn get(&mut self, now: u64) -> u64 {
        self.roll(now);
        let left = MINUTE - now % MINUTE;
        let previous = u128::from(self.previous) * u128::from(left) / u128::from(MINUTE);
        self.current
            .saturating_add(u64::try_from(previous).unwrap_or(u64::MAX))
    }
}

/// The state of one node while it has traffic or a state of its own.
#[derive(Debug)]
pub(crate) struct Node {
    /// The node's limits and borrowing caps (empty without any).
    pub(crate) store: MemoryStore,
    pub(crate) limited: bool,
    pub(crate) in_flight: usize,
    pub(crate) max_in_flight: Option<NonZeroUsize>,
    /// How long a request may wait for this node (nanoseconds), when bounded.
    pub(crate) max_wait: Option<u64>,
    pub(crate) paused: bool,
    pub(crate) days: Vec<CapCount>,
    pub(crate) meter: Meter,
    /// Its guarantee in the reference dimension, per minute.
    pub(crate) guaranteed: u64,
    /// The product of the weights on its path.
    pub(crate) weight: u32,
    /// Whether a configuration (its own or its depth's template) applies.
    pub(crate) configured: bool,
    /// Requests waiting out of the ordering for this node's limits.
    pub(crate) parked: Vec<Parked>,
    /// When a request last took or settled on it (nanoseconds).
    touched_at: u64,
}

impl Node {
    /// A node configured by `config` (`None`: nothing of its own), its borrowing cap scaled
    /// from `parent` limits.
    pub(crate) fn new(
        config: Option<&TenantNode>,
        parent: &[Limit],
        guaranteed: u64,
        weight: u32,
    ) -> Self {
        let mut quota = Quota::new();
        let mut days = Vec::new();
        let mut max_in_flight = None;
        let mut max_wait = None;
        if let Some(config) = config {
            max_wait = config.max_wait.map(nanos);
            quota = limits_of(config, parent)
                .into_iter()
                .fold(quota, Quota::with_limit);
            days = config.daily.iter().copied().map(CapCount::new).collect();
            max_in_flight = config.max_in_flight;
        }
        Self {
            limited: !quota.limits().is_empty(),
            store: MemoryStore::new(&quota),
            in_flight: 0,
            max_in_flight,
            max_wait,
            paused: false,
            days,
            meter: Meter::default(),
            guaranteed,
            weight,
            configured: config.is_some(),
            parked: Vec::new(),
            touched_at: 0,
        }
    }

    /// Applies a new configuration, keeping levels, counts and what is in flight.
    pub(crate) fn reconfigure(
        &mut self,
        config: &TenantNode,
        parent: &[Limit],
        guaranteed: u64,
        weight: u32,
        now: u64,
    ) {
        let limits = limits_of(config, parent);
        // Levels carry over for the limits that stay.
        self.store
            .retain(|limit| limits.iter().any(|l| l.same_bucket(limit)));
        for limit in &limits {
            self.store.set_limit(*limit, now);
        }
        self.limited = !limits.is_empty();
        self.max_in_flight = config.max_in_flight;
        self.max_wait = config.max_wait.map(nanos);
        recount(&mut self.days, &config.daily);
        (self.guaranteed, self.weight, self.configured) = (guaranteed, weight, true);
    }

    /// Whether a slot is free.
    pub(crate) fn slot_free(&self) -> bool {
        self.max_in_flight
            .is_none_or(|max| self.in_flight < max.get())
    }

    /// Why the node refuses `cost` outright, whatever the wait: paused, a day's cap spent, or
    /// a cost above a limit's capacity (`unix`: the wall clock's seconds, for the days).
    pub(crate) fn refusal(&mut self, cost: &Cost, unix: u64) -> Option<Refusal> {
        if self.paused {
            return Some(Refusal::Paused);
        }
        if let Some(refusal) = cap_refusal(&mut self.days, cost, unix) {
            return Some(refusal);
        }
        if !self.limited {
            return None;
        }
        let e = self.store.check_capacity(cost, Floor::NONE).err()?;
        Some(Refusal::TooLarge {
            dimension: e.dimension(),
            cost: e.cost(),
            capacity: e.capacity(),
        })
    }

    /// Whether the node can pay `cost` now (`Ok(None)`), or must be waited for: until an
    /// instant (with the limit that binds), or until one of its calls in flight ends, giving
    /// up at an instant (its `max_wait`, counted from `waited` ago); refused when that wait is
    /// already longer than its `max_wait`. Times are nanoseconds on the budget's clock.
    pub(crate) fn wait(
        &self,
        cost: &Cost,
        now: u64,
        waited: u64,
    ) -> Result<Option<NodeWait>, Refusal> {
        let give_up = self.max_wait.map(|max| max.saturating_sub(waited));
        if !self.slot_free() {
            if give_up == Some(0) {
                let max = self.max_in_flight.map_or(0, NonZeroUsize::get);
                return Err(Refusal::InFlight { max });
            }
            let give_up = give_up.map(|g| now.saturating_add(g));
            return Ok(Some(NodeWait { at: None, give_up }));
        }
        if !self.limited {
            return Ok(None);
        }
        let Some((ready, limit)) = self.store.not_before(cost, now).filter(|(r, _)| *r > now)
        else {
            return Ok(None);
        };
        let limit = self.store.limit(limit);
        if give_up.is_some_and(|g| ready - now > g) {
            return Err(Refusal::RateLimited {
                dimension: limit.dimension(),
                period: limit.period(),
                retry_after: std::time::Duration::from_nanos(ready - now),
            });
        }
        Ok(Some(NodeWait {
            at: Some((ready, limit)),
            give_up: None,
        }))
    }

    /// Debits the node (its fit checked before, under the same lock).
    pub(crate) fn take(&mut self, cost: &Cost, reference: Dimension, now: u64, unix: u64) {
        if self.limited {
            // Checked by the caller under the same lock: it fits.
            let _ = self.store.reserve(ReservationId(0), cost, Floor::NONE, now);
        }
        self.in_flight += 1;
        self.touched_at = now;
        take_caps(&mut self.days, cost, unix);
        self.meter.add(cost.amount(reference), now);
    }

    /// Settles a reservation: `actual` replaces `reserved`; its slot is given back. Returns
    /// whether capacity was freed (a parked request may go).
    pub(crate) fn settle(
        &mut self,
        (reserved, actual): (&Cost, &Cost),
        reference: Dimension,
        (now, unix): (u64, u64),
        scope: &dyn std::fmt::Display,
    ) -> bool {
        let mut freed = self.max_in_flight.is_some();
        self.in_flight = self.in_flight.saturating_sub(1);
        self.touched_at = now;
        if self.limited {
            freed |= self
                .store
                .settle(ReservationId(0), reserved, actual, || now);
        }
        settle_caps(&mut self.days, (reserved, actual), unix, scope);
        let (r, a) = (reserved.amount(reference), actual.amount(reference));
        if a > r {
            self.meter.add(a - r, now);
        } else {
            self.meter.sub(r - a, now);
        }
        freed
    }

    /// Whether the node holds nothing a default node would not, and has had no traffic for a
    /// minute (so a tenant sending one request at a time is not made again for each): it may
    /// be dropped.
    pub(crate) fn is_idle(&mut self, now: u64, unix: u64) -> bool {
        now.saturating_sub(self.touched_at) >= MINUTE
            && self.in_flight == 0
            && !self.paused
            && self.parked.is_empty()
            && self.meter.get(now) == 0
            && (!self.limited || self.store.is_full(now))
            && self.days.iter_mut().all(|d| d.is_empty(unix))
    }

    /// The parked requests' wakers, taken.
    pub(crate) fn unpark_all(&mut self) -> impl Iterator<Item = Waker> + '_ {
        self.parked.drain(..).map(|parked| parked.waker)
    }
}

/// Why caps over a period refuse `cost` (`unix`: the wall clock's seconds), if one does: the
/// first whose period's use it would take above the cap.
pub(crate) fn cap_refusal(days: &mut [CapCount], cost: &Cost, unix: u64) -> Option<Refusal> {
    days.iter_mut().find_map(|day| {
        let used = day.fits(cost.amount(day.cap.dimension), unix).err()?;
        Some(Refusal::PeriodCap {
            dimension: day.cap.dimension,
            window: day.cap.window,
            cap: day.cap.amount.get(),
            used,
            resets_at: day.cap.window.resets_at(unix),
            soft: day.cap.soft,
        })
    })
}

/// Counts `cost` in each cap's period (its fit checked before, under the same lock).
pub(crate) fn take_caps(days: &mut [CapCount], cost: &Cost, unix: u64) {
    for day in days {
        day.add(cost.amount(day.cap.dimension), unix);
    }
}

/// Settles a reservation in each cap's period: `actual` replaces `reserved`. A cap of
/// `scope` that this takes above its amount for the first time in its period is told.
pub(crate) fn settle_caps(
    days: &mut [CapCount],
    (reserved, actual): (&Cost, &Cost),
    unix: u64,
    scope: &dyn std::fmt::Display,
) {
    for day in days {
        let (r, a) = (
            reserved.amount(day.cap.dimension),
            actual.amount(day.cap.dimension),
        );
        if a > r {
            day.add(a - r, unix);
            if day.newly_passed(unix) {
                let used = day.used(unix);
                cap_passed(scope, &day.cap, used);
            }
        } else {
            day.sub(r - a, unix);
        }
    }
}

/// Tells that `scope`'s `cap` was passed (`used` of it): answers used more than their
/// reservations.
#[cold]
fn cap_passed(scope: &dyn std::fmt::Display, cap: &PeriodCap, used: u64) {
    let kind = if cap.soft { "soft" } else { "hard" };
    tracing::warn!(
        %scope,
        dimension = cap.dimension.as_str(),
        window = %cap.window,
        cap = cap.amount.get(),
        used,
        kind,
        "a cap over a period was passed: answers used more than their reservations"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "llm_quota_cap_passed_total",
        "scope" => scope.to_string(),
        "dimension" => cap.dimension.as_str(),
        "kind" => kind,
    )
    .increment(1);
}

/// Replaces the caps counted in `days` by `caps`, keeping the count of each that stays (same
/// dimension and window).
pub(crate) fn recount(days: &mut Vec<CapCount>, caps: &[PeriodCap]) {
    let mut counts = Vec::with_capacity(caps.len());
    for cap in caps {
        let kept = days
            .iter()
            .position(|d| (d.cap.dimension, d.cap.window) == (cap.dimension, cap.window));
        counts.push(match kept {
            Some(i) => {
                let mut count = days.swap_remove(i);
                count.cap = *cap;
                count
            }
            None => CapCount::new(*cap),
        });
    }
    *days = counts;
}

/// A request waiting out of the ordering for a node's limits: its ticket, class and path (for
/// the snapshots' queue counts), and its waker.
#[derive(Debug)]
pub(crate) struct Parked {
    pub(crate) ticket: u64,
    pub(crate) priority: Priority,
    pub(crate) path: Tenant,
    pub(crate) waker: Waker,
}

/// The limits a node enforces: each of `parent`'s scaled by its most share (its borrowing
/// cap), then its own (the lower of two for one dimension and period).
/// A duration in nanoseconds, saturating.
fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

pub(crate) fn limits_of(config: &TenantNode, parent: &[Limit]) -> Vec<Limit> {
    let mut limits: Vec<Limit> = Vec::new();
    if let Some(share) = config.max_share {
        for limit in parent {
            let amount = (limit.effective_amount() as f64 * share).floor() as u64;
            let burst = (limit.capacity() as f64 * share).ceil() as u64;
            let (Some(amount), Some(burst)) = (NonZeroU64::new(amount), NonZeroU64::new(burst))
            else {
                continue;
            };
            if let Ok(scaled) = Limit::new(limit.dimension(), amount, limit.period())
                .and_then(|l| l.with_headroom(1.0))
            {
                limits.push(scaled.with_burst(burst));
            }
        }
    }
    for own in &config.limits {
        // A fixed share of the operator's limit (a node's limits do not adapt), its own burst.
        let own = &own.for_node();
        match limits.iter_mut().find(|l| l.same_bucket(own)) {
            Some(cap) if own.effective_amount() < cap.effective_amount() => *cap = *own,
            Some(_) => {}
            None => limits.push(*own),
        }
    }
    limits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_meter_slides_over_the_last_minute() {
        let mut meter = Meter::default();
        meter.add(600, 0);
        assert_eq!(meter.get(MINUTE - 1), 600);
        // A quarter into the next minute, three quarters of the last one still count.
        meter.add(100, MINUTE + MINUTE / 4);
        assert_eq!(meter.get(MINUTE + MINUTE / 4), 100 + 450);
        // A refund comes off the current minute first, then the previous one.
        meter.sub(200, MINUTE + MINUTE / 4);
        assert_eq!(meter.get(MINUTE + MINUTE / 4), 500 * 3 / 4);
        assert_eq!(meter.get(3 * MINUTE), 0);
    }

    #[test]
    fn a_borrowing_cap_scales_the_parent_and_the_lower_limit_wins() {
        let nz = |n| NonZeroU64::new(n).unwrap();
        let parent = [Limit::per_minute(Dimension::TotalTokens, nz(10_000))
            .with_headroom(1.0)
            .unwrap()];
        let own = Limit::per_minute(Dimension::TotalTokens, nz(9_000));
        let capped = TenantNode::new().with_max_share(0.5).with_limit(own);
        let limits = limits_of(&capped, &parent);
        assert_eq!(limits.len(), 1);
        assert_eq!(limits[0].effective_amount(), 5_000);
        let loose = TenantNode::new()
            .with_max_share(0.5)
            .with_limit(Limit::per_minute(Dimension::TotalTokens, nz(1_000)));
        assert_eq!(limits_of(&loose, &parent)[0].effective_amount(), 1_000);
    }
}
