//! The seam between a budget and where its state lives.
//!
//! A [`Budget`](crate::Budget) keeps its wait queue in the process and asks a store for the
//! bucket arithmetic, through exactly the operations a shared store must perform as single
//! atomic calls: reserve every dimension or none, settle by reservation id, observe what the
//! provider reports, and snapshot. [`MemoryStore`] is the embedded default: plain values under
//! the budget's one mutex, no allocation on the reserve and settle paths.

use std::time::Duration;

use crate::budget::memory::bucket::{Bucket, Fit, Floor};
use crate::budget::memory::share::Measure;
use crate::budget::observation::Observation;
use crate::cost::Cost;
use crate::error::InsufficientCapacity;
use crate::quota::{Dimension, Limit, Quota};

/// Which store admitted a reservation, and so settles it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// The budget's own buckets (for a shared budget, its local fallback share).
    Local,
    /// The store shared with other processes.
    Remote,
}

/// A reservation's identity, unique within its budget; a shared store settles by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReservationId(pub(crate) u64);

impl ReservationId {
    /// The id as a number.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// Why a store admitted nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Denial {
    /// The cost fits at `at` (nanoseconds on the budget's clock); `limit` refills the longest.
    NotUntil { at: u64, limit: usize },
    /// The cost exceeds a capacity.
    Never(InsufficientCapacity),
}

/// One limit's state, as a store reports it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LimitState {
    pub(crate) limit: Limit,
    pub(crate) capacity: u64,
    pub(crate) level: i64,
    /// Beyond the capacity: what the provider reports the bucket may spend too.
    pub(crate) extra: u64,
    pub(crate) available_at: u64,
    pub(crate) full_at: u64,
}

/// The atomic operations of a quota store. Times are nanoseconds on the budget's clock.
pub(crate) trait Store {
    /// Whether every limit `cost` touches can pay it now, leaving `floor` of each untouched;
    /// if not, when at the earliest (or never). Changes nothing.
    fn check(&self, cost: &Cost, floor: Floor, now: u64) -> Result<(), Denial>;

    /// Takes `cost` from every limit it touches (after a [`check`](Store::check) under the
    /// same lock).
    fn take(&mut self, cost: &Cost, now: u64);

    /// Reserves `cost` in every limit it touches, leaving `floor` of each untouched, or
    /// reserves nothing: [`check`](Store::check), then [`take`](Store::take).
    fn reserve(
        &mut self,
        _id: ReservationId,
        cost: &Cost,
        floor: Floor,
        now: u64,
    ) -> Result<(), Denial> {
        self.check(cost, floor, now)?;
        self.take(cost, now);
        Ok(())
    }

    /// Replaces the reservation's `reserved` cost by the `actual` one: refunds what was not
    /// used, charges an overrun as debt. Returns whether capacity was freed. `now` is read only
    /// to charge an overrun: a refund needs no clock.
    fn settle(
        &mut self,
        id: ReservationId,
        reserved: &Cost,
        actual: &Cost,
        now: impl FnMut() -> u64,
    ) -> bool;

    /// Applies what the provider reports; with `adapt`, the adaptive shares learn from it.
    /// Returns whether limits changed.
    fn observe(&mut self, observation: &Observation, now: u64, adapt: bool) -> bool;

    /// Replaces (or adds) the limit of the same dimension and period, keeping its level.
    fn set_limit(&mut self, limit: Limit, now: u64);

    /// Admits nothing in `dimension` until `until`: the provider said its quota is spent.
    /// Holds the dimension's shortest window only, keeping its level; with `adapt`, its
    /// adaptive share counts the refusal. Returns whether limits changed.
    fn pause(&mut self, dimension: Dimension, until: u64, now: u64, adapt: bool) -> bool;

    /// Ends every pause of `dimension`.
    fn lift(&mut self, dimension: Dimension);

    /// The earliest time every limit could hold `amount`, ignoring capacities: when a request
    /// queued behind `amount - cost` of others could be admitted at the earliest.
    fn not_before(&self, amount: &Cost, now: u64) -> Option<(u64, usize)>;

    /// Fails when `cost` exceeds a capacity (less `floor`).
    fn check_capacity(&self, cost: &Cost, floor: Floor) -> Result<(), InsufficientCapacity>;

    /// The limit at `index` (as named by a [`Denial`]).
    fn limit(&self, index: usize) -> Limit;

    /// Every limit's state.
    fn snapshot(&self, now: u64) -> Vec<LimitState>;
}

/// Buckets in memory: the default store.
#[derive(Debug, Clone)]
pub(crate) struct MemoryStore {
    buckets: Vec<Bucket>,
}

impl MemoryStore {
    pub(crate) fn new(quota: &Quota) -> Self {
        Self {
            buckets: quota.limits().iter().copied().map(Bucket::new).collect(),
        }
    }

    /// The limits of the buckets.
    pub(crate) fn limits(&self) -> Vec<Limit> {
        self.buckets.iter().map(|bucket| *bucket.limit()).collect()
    }

    /// Keeps only the buckets whose limit `keep` accepts.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&Limit) -> bool) {
        self.buckets.retain(|bucket| keep(bucket.limit()));
    }

    /// Whether every bucket is full at `now` (a tenant node that may be forgotten).
    pub(crate) fn is_full(&self, now: u64) -> bool {
        self.buckets.iter().all(|bucket| bucket.full_at(now) <= now)
    }

    fn touched<'a>(&'a self, cost: &'a Cost) -> impl Iterator<Item = (usize, &'a Bucket, u64)> {
        self.buckets.iter().enumerate().filter_map(|(i, bucket)| {
            let amount = cost.amount(bucket.limit().dimension());
            (amount > 0).then_some((i, bucket, amount))
        })
    }
}

impl MemoryStore {
    /// Wallets for `quota`'s limits (see [`Bucket::wallet`]): empty, filled only by
    /// [`deposit`](Self::deposit), as a leased grant is.
    pub(crate) fn wallets(quota: &Quota) -> Self {
        Self {
            buckets: quota.limits().iter().copied().map(Bucket::wallet).collect(),
        }
    }

    /// Whether the buckets are wallets.
    pub(crate) fn holds_wallets(&self) -> bool {
        self.buckets.first().is_some_and(Bucket::is_wallet)
    }

    fn bucket_mut(&mut self, limit: &Limit) -> Option<&mut Bucket> {
        (self.buckets.iter_mut()).find(|b| b.limit().same_bucket(limit))
    }

    /// The level of `limit`'s bucket at `now` (negative in debt; 0 for an unknown limit).
    pub(crate) fn level_of(&self, limit: &Limit, now: u64) -> i64 {
        (self.buckets.iter())
            .find(|b| b.limit().same_bucket(limit))
            .map_or(0, |b| b.level(now))
    }

    /// Lowers `limit`'s wallet to at most `units`: the provider reports that no more is left
    /// of the whole account, so a grant beyond it could only be spent into refusals. What is
    /// cut is forfeited (reported as spent at the next renewal, never given back).
    pub(crate) fn cap_wallet(&mut self, limit: &Limit, units: u64, now: u64) {
        if let Some(bucket) = self.bucket_mut(limit).filter(|b| b.is_wallet()) {
            bucket.cap_level(units, now);
        }
    }

    /// Puts `units` into `limit`'s bucket (never above its capacity).
    pub(crate) fn deposit(&mut self, limit: &Limit, units: u64) {
        if let Some(bucket) = self.bucket_mut(limit) {
            bucket.refund(units);
        }
    }

    /// Takes `units` out of `limit`'s bucket (it holds them: a wallet giving them back).
    pub(crate) fn withdraw(&mut self, limit: &Limit, units: u64, now: u64) {
        if let Some(bucket) = self.bucket_mut(limit) {
            bucket.debit(units, now);
        }
    }

    /// Every touched bucket's fit, each asked for its amount.
    fn check_each(&self, cost: &Cost, floor: Floor, now: u64) -> Result<(), Denial> {
        let mut latest: Option<(u64, usize)> = None;
        for (i, bucket, amount) in self.touched(cost) {
            match bucket.fit(amount, floor, now) {
                Fit::Now => {}
                Fit::At(at) => {
                    if latest.is_none_or(|(t, _)| at > t) {
                        latest = Some((at, i));
                    }
                }
                Fit::Never => return Err(Denial::Never(too_large(bucket, amount, floor))),
            }
        }
        match latest {
            Some((at, limit)) => Err(Denial::NotUntil { at, limit }),
            None => Ok(()),
        }
    }
}

impl Store for MemoryStore {
    fn check(&self, cost: &Cost, floor: Floor, now: u64) -> Result<(), Denial> {
        self.check_each(cost, floor, now)
    }

    fn take(&mut self, cost: &Cost, now: u64) {
        for bucket in &mut self.buckets {
            let amount = cost.amount(bucket.limit().dimension());
            if amount > 0 {
                bucket.debit(amount, now);
            }
        }
    }

    fn settle(
        &mut self,
        _id: ReservationId,
        reserved: &Cost,
        actual: &Cost,
        mut now: impl FnMut() -> u64,
    ) -> bool {
        let mut freed = false;
        for bucket in &mut self.buckets {
            let dimension = bucket.limit().dimension();
            let (reserved, actual) = (reserved.amount(dimension), actual.amount(dimension));
            let actual = plausible(actual, reserved, bucket);
            if actual < reserved {
                bucket.refund(reserved - actual);
                freed = true;
            } else if actual > reserved {
                bucket.debit(actual - reserved, now());
            }
        }
        freed
    }

    fn observe(&mut self, observation: &Observation, now: u64, adapt: bool) -> bool {
        let mut changed = false;
        for bucket in &mut self.buckets {
            let limit = *bucket.limit();
            if limit.dimension() != observation.dimension()
                || limit.period() != observation.period()
            {
                continue;
            }
            let mut adopted = false;
            if let Some(amount) = observation.limit() {
                if amount != limit.amount() {
                    bucket.set_limit(limit.with_amount(amount), now);
                    changed = true;
                    adopted = true;
                }
            }
            let Some(remaining) = observation.remaining() else {
                continue;
            };
            if adopted {
                // The provider changed its limit before this report reached us, and charged
                // what it admitted since under the new amount; the shadow, carried over from
                // the old amount, is cut to the new one only now, which forgives that
                // spending. The report is all the budget knows of the provider's bucket under
                // the new amount: the shadow starts from it, so that the change is not taken
                // for someone else's spending (a neighbour who keeps spending widens the gap
                // again from there).
                bucket.rebase_shadow(remaining, now);
                if let Some(controller) = bucket.share_mut() {
                    controller.restart(now);
                }
            }
            let expected = bucket.expected_remaining(now).filter(|_| adapt);
            if let Some(expected) = expected {
                changed |= measure(bucket, expected, remaining, now);
            }
            let usable = (remaining as f64 * bucket.limit().headroom()).floor() as u64;
            bucket.cap_level(usable, now);
            // Beyond the burst: what the provider holds, once the measure is steady.
            if let Some(expected) = expected {
                let nominal = bucket.limit().amount().get();
                let spendable = bucket
                    .share_mut()
                    .filter(|_| observation.is_spendable_at_once())
                    .and_then(|c| c.spendable(expected, remaining, nominal, now));
                match spendable {
                    Some(spendable) => bucket.grant(spendable, now),
                    None => bucket.revoke(),
                }
            }
        }
        changed
    }

    fn set_limit(&mut self, limit: Limit, now: u64) {
        match self
            .buckets
            .iter_mut()
            .find(|b| b.limit().same_bucket(&limit))
        {
            Some(bucket) => {
                bucket.set_limit(limit, now);
                // A new amount or burst keeps the share the controller planned.
                if let Some(share) = bucket.share_mut().map(|c| c.share()) {
                    if share != limit.headroom() {
                        bucket.set_limit(limit.with_planned_share(share), now);
                    }
                }
            }
            None => self.buckets.push(Bucket::new(limit)),
        }
    }

    fn pause(&mut self, dimension: Dimension, until: u64, now: u64, adapt: bool) -> bool {
        // The shortest window of the dimension is the one a 429 names; every request in the
        // dimension pays it too, so holding it holds them all. A longer window (a day) is not
        // spent by a per-minute refusal.
        let Some(bucket) = self
            .buckets
            .iter_mut()
            .filter(|b| b.limit().dimension() == dimension)
            .min_by_key(|b| b.limit().period())
        else {
            return false;
        };
        bucket.hold_until(until);
        let share = if adapt {
            bucket.share_mut().and_then(|c| c.rate_limited(now))
        } else {
            None
        };
        if let Some(share) = share {
            tracing::debug!(%dimension, share, "adaptive share lowered by a 429");
            let planned = bucket.limit().with_planned_share(share);
            bucket.set_limit(planned, now);
        }
        share.is_some()
    }

    fn lift(&mut self, dimension: Dimension) {
        self.buckets
            .iter_mut()
            .filter(|b| b.limit().dimension() == dimension)
            .for_each(Bucket::lift);
    }

    fn not_before(&self, amount: &Cost, now: u64) -> Option<(u64, usize)> {
        self.touched(amount)
            .map(|(i, bucket, amount)| (bucket.fit_at(amount, now), i))
            .max_by_key(|(at, _)| *at)
    }

    fn check_capacity(&self, cost: &Cost, floor: Floor) -> Result<(), InsufficientCapacity> {
        match self
            .touched(cost)
            .find(|(_, b, amount)| *amount > b.usable(floor))
        {
            Some((_, bucket, amount)) => Err(too_large(bucket, amount, floor)),
            None => Ok(()),
        }
    }

    fn limit(&self, index: usize) -> Limit {
        *self.buckets[index].limit()
    }

    fn snapshot(&self, now: u64) -> Vec<LimitState> {
        self.buckets
            .iter()
            .map(|bucket| LimitState {
                limit: *bucket.limit(),
                capacity: bucket.capacity(),
                level: bucket.level(now),
                extra: bucket.extra(),
                available_at: bucket.fit_at(1, now),
                full_at: bucket.full_at(now),
            })
            .collect()
    }
}

/// The adaptive share of `bucket` measures what the provider holds below what the shadow
/// expects: someone else spent it (see the `share` module). Returns whether the share changed.
fn measure(bucket: &mut Bucket, expected: u64, remaining: u64, now: u64) -> bool {
    let nominal = bucket.limit().amount().get();
    let measure = bucket.share_mut().map_or(Measure::NOTHING, |c| {
        c.observe(expected, remaining, nominal, now)
    });
    if measure.anchor {
        bucket.rebase_shadow(remaining, now);
    }
    let Some(share) = measure.share else {
        return false;
    };
    tracing::debug!(
        dimension = %bucket.limit().dimension(),
        expected,
        remaining,
        share,
        "adaptive share changed"
    );
    let planned = bucket.limit().with_planned_share(share);
    bucket.set_limit(planned, now);
    true
}

/// A reported usage, clamped when it is far above both the estimate and the bucket's capacity
/// (more than twice the larger): such a report is a provider's or a parser's error, and
/// charging it would block the bucket for as long as it takes to refill it. It is charged the
/// larger of the two instead, and logged.
fn plausible(actual: u64, reserved: u64, bucket: &Bucket) -> u64 {
    let bound = reserved.max(bucket.capacity());
    if actual / 2 <= bound {
        return actual;
    }
    let limit = bucket.limit();
    tracing::warn!(
        dimension = %limit.dimension(),
        reported = actual,
        estimated = reserved,
        capacity = bucket.capacity(),
        charged = bound,
        "implausible usage report clamped"
    );
    bound
}

fn too_large(bucket: &Bucket, amount: u64, floor: Floor) -> InsufficientCapacity {
    let limit = bucket.limit();
    InsufficientCapacity {
        dimension: limit.dimension(),
        period: limit.period(),
        cost: amount,
        capacity: bucket.usable(floor),
    }
}

/// Nanoseconds in `duration`, saturating.
pub(crate) fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU64;

    const MS: u64 = 1_000_000;
    const SEC: u64 = 1_000 * MS;

    fn store() -> MemoryStore {
        let nz = |n| NonZeroU64::new(n).unwrap();
        let exact = |limit: Limit| limit.with_headroom(1.0).unwrap().with_burst_fraction(1.0);
        MemoryStore::new(
            &Quota::new()
                .with_limit(exact(Limit::per_second(Dimension::Requests, nz(10))).unwrap())
                .with_limit(exact(Limit::per_second(Dimension::TotalTokens, nz(1_000))).unwrap()),
        )
    }

    #[test]
    fn all_or_nothing() {
        let mut s = store();
        let id = ReservationId(0);
        s.reserve(id, &Cost::new(900, 0), Floor::NONE, 0).unwrap();
        // Tokens are short, requests are not: nothing may be debited.
        let denial = s
            .reserve(id, &Cost::new(200, 0), Floor::NONE, 0)
            .unwrap_err();
        assert_eq!(
            denial,
            Denial::NotUntil {
                at: 100 * MS,
                limit: 1
            }
        );
        let levels: Vec<i64> = s.snapshot(0).iter().map(|l| l.level).collect();
        assert_eq!(levels, [9, 100]);
    }

    #[test]
    fn zero_amounts_do_not_touch_a_bucket_in_debt() {
        let mut s = store();
        let id = ReservationId(0);
        s.reserve(id, &Cost::new(1_000, 0), Floor::NONE, 0).unwrap();
        s.settle(id, &Cost::new(1_000, 0), &Cost::new(1_500, 0), || 0);
        assert!(
            s.reserve(id, &Cost::requests_only(1), Floor::NONE, 0)
                .is_ok()
        );
    }

    #[test]
    fn settle_refunds_and_charges() {
        let mut s = store();
        let id = ReservationId(0);
        s.reserve(id, &Cost::new(600, 200), Floor::NONE, 0).unwrap();
        assert!(s.settle(id, &Cost::new(600, 200), &Cost::new(600, 50), || 0));
        assert_eq!(s.snapshot(0)[1].level, 350);
        assert!(!s.settle(id, &Cost::new(0, 0), &Cost::new(0, 450), || 0));
        assert_eq!(s.snapshot(0)[1].level, -100);
    }

    #[test]
    fn observe_adapts_limit_and_lowers_level() {
        let mut s = store();
        let observation = Observation::new(Dimension::TotalTokens, Duration::from_secs(1))
            .with_limit(NonZeroU64::new(500).unwrap())
            .with_remaining(100);
        assert!(s.observe(&observation, 0, true));
        let state = s.snapshot(0)[1];
        assert_eq!((state.capacity, state.level), (500, 100));
    }

    #[test]
    fn an_absurd_usage_report_is_clamped() {
        let mut s = store();
        let id = ReservationId(0);
        s.reserve(id, &Cost::new(100, 0), Floor::NONE, 0).unwrap();
        s.settle(
            id,
            &Cost::new(100, 0),
            &Cost::new(1_000_000_000_000, 0),
            || 0,
        );
        // Charged the capacity (1,000) instead: level 1,000 - 1,000.
        assert_eq!(s.snapshot(0)[1].level, 0);
        // An overrun within twice the bound is charged as reported.
        s.settle(id, &Cost::new(100, 0), &Cost::new(1_500, 0), || 0);
        assert_eq!(
            s.snapshot(0)[1].level,
            -1_000,
            "debt bounded at one capacity"
        );
    }

    #[test]
    fn the_adaptive_share_follows_the_gap_between_expected_and_reported() {
        let nz = |n| NonZeroU64::new(n).unwrap();
        let mut s = MemoryStore::new(
            &Quota::new().with_limit(Limit::per_second(Dimension::TotalTokens, nz(600))),
        );
        let at = |s: &MemoryStore| s.snapshot(0)[0].limit.headroom();
        let seen = |remaining| {
            Observation::new(Dimension::TotalTokens, Duration::from_secs(1))
                .with_remaining(remaining)
        };
        // The first report starts the measure: 400 left.
        assert!(!s.observe(&seen(400), 0, true));
        assert_eq!(at(&s), 1.0);
        // 200 ms later (a window is a sixth of the period) the provider should hold 520
        // (nothing was spent): it reports 472. Someone else spent 48 in 200 ms, 40 % of the
        // rate: planned 1 - 0.4 - the tolerance. The share paces the refill; the burst stays.
        assert!(s.observe(&seen(472), 200 * MS, true));
        assert!((at(&s) - 0.58).abs() < 1e-9, "{}", at(&s));
        let state = s.snapshot(200 * MS)[0];
        assert_eq!((state.limit.effective_amount(), state.capacity), (348, 100));
        // A fixed share, or a shared budget's fallback, does not adapt.
        assert!(!s.observe(&seen(0), 500 * MS, false));
        assert!((at(&s) - 0.58).abs() < 1e-9);
        // A 429 lowers it too.
        assert!(s.pause(Dimension::TotalTokens, 600 * MS, 500 * MS, true));
        assert!((at(&s) - 0.58 * 0.8).abs() < 1e-9);
    }

    /// A store of one adaptive limit of 600 tokens a minute (burst a sixth: 100), and a report
    /// of `remaining` tokens.
    fn minute_of_600(
        share: crate::quota::AdaptiveShare,
    ) -> (MemoryStore, impl Fn(u64) -> Observation) {
        let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(600).unwrap())
            .with_adaptive_share(share);
        let seen = |remaining| {
            Observation::new(Dimension::TotalTokens, Duration::from_secs(60))
                .with_remaining(remaining)
        };
        (MemoryStore::new(&Quota::new().with_limit(tpm)), seen)
    }

    /// Spends its own burst at 0, and 50 more at 5 s and at 10 s (the refill): the provider,
    /// alone with it, holds 500 throughout. Reports 500 at 0 and 5 s, and `at_10` at 10 s.
    fn spend_200_in_10_s(s: &mut MemoryStore, seen: &impl Fn(u64) -> Observation, at_10: u64) {
        let id = ReservationId(0);
        for (at, amount, reported) in [(0, 100, 500), (5, 50, 500), (10, 50, at_10)] {
            s.reserve(id, &Cost::new(amount, 0), Floor::NONE, at * SEC)
                .unwrap();
            s.observe(&seen(reported), at * SEC, true);
        }
    }

    #[test]
    fn the_burst_the_provider_reports_is_spent_once_the_measure_is_steady() {
        let (mut s, seen) = minute_of_600(crate::quota::AdaptiveShare::new());
        let id = ReservationId(0);
        let tokens = |n| Cost::new(n, 0);
        let level = |s: &MemoryStore, now| {
            let state = s.snapshot(now)[0];
            state.level + state.extra as i64
        };
        // Within the first window of the measure (from 0), its own burst only.
        let (mut early, _) = minute_of_600(crate::quota::AdaptiveShare::new());
        early.reserve(id, &tokens(100), Floor::NONE, 0).unwrap();
        early.observe(&seen(500), 0, true);
        assert_eq!(level(&early, 0), 0);
        // After a window (10 s) showing nobody else, what the provider holds may be spent at
        // once, less the tolerance (12); no more than the budget expects it to hold (500),
        // though the provider reports 550.
        spend_200_in_10_s(&mut s, &seen, 550);
        assert_eq!(level(&s, 10 * SEC), 488);
        for _ in 0..4 {
            // (A request above the budget's own burst never fits, extra or not.)
            s.reserve(id, &tokens(100), Floor::NONE, 10 * SEC).unwrap();
        }
        s.reserve(id, &tokens(88), Floor::NONE, 10 * SEC).unwrap();
        // Spent: the next token comes with the refill, 100 ms later.
        assert_eq!(
            s.reserve(id, &tokens(1), Floor::NONE, 10 * SEC),
            Err(Denial::NotUntil {
                at: 10 * SEC + 100 * MS,
                limit: 0
            })
        );
        // The extra never refills: a minute later the level is the burst again.
        assert_eq!(level(&s, 70 * SEC), 100);
        // A full bucket hides the others: the measure starts again, nothing extra meanwhile.
        s.observe(&seen(600), 70 * SEC, true);
        assert_eq!(level(&s, 70 * SEC), 100);
    }

    #[test]
    fn an_idle_spell_is_not_taken_for_someone_elses_spending() {
        let (mut s, seen) = minute_of_600(crate::quota::AdaptiveShare::new());
        let id = ReservationId(0);
        let share = |s: &MemoryStore| s.snapshot(0)[0].limit.headroom();
        s.reserve(id, &Cost::new(100, 0), Floor::NONE, 0).unwrap();
        s.observe(&seen(500), 0, true);
        // Idle for a minute: the provider's bucket and the shadow both fill to the top, the
        // refill beyond it lost to both. Then 100 more.
        s.reserve(id, &Cost::new(100, 0), Floor::NONE, 60 * SEC)
            .unwrap();
        s.observe(&seen(500), 60 * SEC, true);
        assert_eq!(share(&s), 1.0);
    }

    #[test]
    fn a_report_not_spendable_at_once_grants_nothing() {
        let (mut s, seen) = minute_of_600(crate::quota::AdaptiveShare::new());
        // Azure's per-minute limits hold over seconds too: its remaining is not spent at once.
        let azure = |remaining| seen(remaining).spendable_at_once(false);
        spend_200_in_10_s(&mut s, &azure, 500);
        let state = s.snapshot(10 * SEC)[0];
        assert_eq!((state.level, state.extra), (0, 0));
    }

    #[test]
    fn with_a_neighbour_measured_the_cushion_leaves_it_a_window_of_its_share() {
        let (mut s, seen) = minute_of_600(crate::quota::AdaptiveShare::new());
        let level = |s: &MemoryStore, now| {
            let state = s.snapshot(now)[0];
            state.level + state.extra as i64
        };
        // The provider holds 450 at 10 s where 500 were expected: someone else spent 50 in
        // 10 s, 0.5 of the rate. The share falls to 0.48, and nothing extra comes before a
        // quiet window.
        spend_200_in_10_s(&mut s, &seen, 450);
        let share = s.snapshot(10 * SEC)[0].limit.headroom();
        assert!((share - 0.48).abs() < 1e-9, "{share}");
        assert_eq!(level(&s, 10 * SEC), 0);
        // A window later, the same neighbour (spending 50 more) and the budget at its share
        // (48): the provider holds 450 - 50 + 100 - 48 = 452. Spendable: 452, less the
        // tolerance (12) and the neighbour's window at 0.52 of the rate (52).
        s.reserve(ReservationId(0), &Cost::new(48, 0), Floor::NONE, 20 * SEC)
            .unwrap();
        s.observe(&seen(452), 20 * SEC, true);
        assert_eq!(level(&s, 20 * SEC), 452 - 12 - 52);
    }

    #[test]
    fn a_pause_a_new_limit_or_the_option_off_take_the_reported_burst_back() {
        let (mut s, seen) = minute_of_600(crate::quota::AdaptiveShare::new());
        let level = |s: &MemoryStore, now| {
            let state = s.snapshot(now)[0];
            state.level + state.extra as i64
        };
        let agreed = |s: &mut MemoryStore| {
            spend_200_in_10_s(s, &seen, 500);
            assert_eq!(level(s, 10 * SEC), 488);
        };
        agreed(&mut s);
        s.pause(Dimension::TotalTokens, 0, 10 * SEC, true);
        assert_eq!(
            level(&s, 10 * SEC),
            0,
            "a 429 takes the extra back: its own level only, spent"
        );

        let (mut s, _) = minute_of_600(crate::quota::AdaptiveShare::new());
        agreed(&mut s);
        let lowered = Observation::new(Dimension::TotalTokens, Duration::from_secs(60))
            .with_limit(NonZeroU64::new(300).unwrap());
        s.observe(&lowered, 10 * SEC, true);
        assert_eq!(
            level(&s, 10 * SEC),
            0,
            "a new nominal amount: its own level only"
        );

        let off = crate::quota::AdaptiveShare::new().spend_reported_burst(false);
        let (mut s, seen) = minute_of_600(off);
        spend_200_in_10_s(&mut s, &seen, 500);
        assert_eq!(level(&s, 10 * SEC), 0);
    }

    /// A provider that lowers its limit without notice charges what it admits from then on
    /// under the new limit, while the budget learns of it only from the next response: the
    /// first report of the new limit is not someone else's spending, however late it comes.
    #[tokio::test(start_paused = true)]
    async fn a_limit_lowered_without_notice_is_not_taken_for_someone_elses_spending() {
        use tokio::time::advance;

        let nz = |n| NonZeroU64::new(n).unwrap();
        let second = Duration::from_secs(1);
        let tokens = Limit::new(Dimension::TotalTokens, nz(60_000), second)
            .unwrap()
            .with_burst(nz(10_000));
        let budget = crate::Budget::new(Quota::new().with_limit(tokens));
        let effective = || budget.snapshot().limits()[0].limit().effective_amount();
        let report = |remaining| {
            Observation::new(Dimension::TotalTokens, second)
                .with_limit(nz(15_000))
                .with_remaining(remaining)
        };
        // In flight when the provider cuts its limit to 15,000 (its bucket is full).
        let first = budget.reserve(Cost::new(1_000, 0)).await.unwrap();
        advance(Duration::from_millis(100)).await;
        // Admitted just after the cut: the provider charges 2,000 of its 15,000.
        let second_call = budget.reserve(Cost::new(2_000, 0)).await.unwrap();
        advance(Duration::from_millis(10)).await;
        // The first response reports the new limit: 13,000, refilled by 10 ms (150). The
        // budget, alone on the key, keeps planning for the whole of it.
        budget.observe(&report(13_150));
        let reported_at = tokio::time::Instant::now();
        let limit = *budget.snapshot().limits()[0].limit();
        assert_eq!(limit.amount().get(), 15_000);
        assert_eq!(
            effective(),
            15_000,
            "the cut taken for a neighbour: {limit:?}"
        );
        first.settle_cost(Cost::new(1_000, 0));
        second_call.settle_cost(Cost::new(2_000, 0));
        // Alone: the provider's bucket refills as the budget expects (50 ms: 750).
        advance(Duration::from_millis(50)).await;
        budget.observe(&report(13_900));
        assert_eq!(effective(), 15_000);
        // From the new start, a neighbour who spends 30 % of the rate is seen: the provider
        // refills 70 % of the rate for the budget, which spends 10,000.
        let spend = budget.reserve(Cost::new(10_000, 0)).await.unwrap();
        advance(Duration::from_millis(200)).await;
        let left = 13_150.0 + 15_000.0 * 0.7 * reported_at.elapsed().as_secs_f64() - 10_000.0;
        budget.observe(&report(left as u64));
        spend.settle_cost(Cost::new(10_000, 0));
        let planned = effective();
        assert!((10_199..=10_200).contains(&planned), "{planned}");
    }
}
