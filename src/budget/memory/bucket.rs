//! The token bucket of one limit: pure integer arithmetic over a virtual clock, no I/O.
//!
//! The state is a single number, the instant at which the bucket will be full again
//! (`full_at`), as in GCRA. The level at time `t` is `capacity - (full_at - t) × rate`, so
//! refill is computed lazily from elapsed time: no timer, no periodic update, no drift.
//!
//! To stay exact for any rate, time is counted in *ticks*: one nanosecond is `rate` ticks and
//! one unit (a request, a token) is `period` (in nanoseconds) ticks. Every quantity is then an
//! integer and no rounding ever accumulates.
//!
//! A pause (a provider's 429) is a second number, the instant before which nothing is
//! admitted: it holds admissions without touching the level, so when it ends the level is what
//! the bucket (lowered to what the provider reported) holds by then, and it can be lifted.
//!
//! Above its capacity a bucket may hold an *extra*: what the provider's own report showed it
//! may spend now beyond the budget's burst (its bucket full, nobody else spending it). The
//! extra never refills: it is spent after the level, and taken back by a report that
//! disagrees, a pause or a new nominal amount.

use crate::budget::memory::share::ShareController;
use crate::quota::Limit;

/// A token bucket for one [`Limit`].
#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    limit: Limit,
    /// Units added per period (the effective amount).
    rate: u64,
    /// The period in nanoseconds.
    period: u64,
    /// The most the bucket holds.
    capacity: u64,
    /// When the bucket is full again, in ticks; at or before "now" it is full.
    full_at: u128,
    /// Nothing is admitted before this time (nanoseconds): a provider's pause.
    held_until: u64,
    /// The adaptive share's controller, unless the limit's share is fixed.
    share: Option<ShareController>,
    /// With an adaptive share: the provider's bucket as it would be if this budget were alone
    /// on the key (the nominal amount, refilled over the period, debited and refunded as this
    /// bucket is). What the provider reports below it, someone else spent.
    shadow: Option<Box<Bucket>>,
    /// Units beyond the capacity that the provider's last agreeing report allows: spent once
    /// the level is, never refilled.
    extra: u64,
    /// A wallet (a leased grant): it never refills by itself, only by deposits; `full_at` is
    /// then the deficit itself, in ticks, whatever the time.
    wallet: bool,
}

/// A share of a bucket's capacity that a request must leave untouched, so that requests of a
/// higher class find it: in parts per million. A store reserving with a floor admits only
/// when every bucket keeps [`Floor::of`] its capacity after the cost is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Floor(u32);

impl Floor {
    /// No floor: the whole capacity may be used.
    pub const NONE: Floor = Floor(0);

    /// A floor of `fraction` of the capacity, clamped to `[0, 1]` (NaN counts as 0).
    pub fn from_fraction(fraction: f64) -> Self {
        let ppm = (fraction.clamp(0.0, 1.0) * 1e6).round();
        Floor(if ppm.is_nan() { 0 } else { ppm as u32 })
    }

    /// The floor in units of a bucket of `capacity`, rounded up.
    pub fn of(self, capacity: u64) -> u64 {
        let units = (u128::from(capacity) * u128::from(self.0)).div_ceil(1_000_000);
        u64::try_from(units).unwrap_or(u64::MAX).min(capacity)
    }
}

/// Whether an amount fits a bucket now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fit {
    /// It fits now.
    Now,
    /// It fits at this time (nanoseconds), unless something changes.
    At(u64),
    /// It never fits: the amount exceeds the capacity.
    Never,
}

impl Bucket {
    /// A full bucket for `limit`.
    pub(crate) fn new(limit: Limit) -> Self {
        Self {
            limit,
            rate: limit.effective_amount(),
            period: u64::try_from(limit.period().as_nanos()).unwrap_or(u64::MAX),
            capacity: limit.capacity(),
            full_at: 0,
            held_until: 0,
            share: limit
                .adaptive_share()
                .map(|params| ShareController::new(params, limit.period(), limit.headroom(), 0)),
            shadow: limit
                .adaptive_share()
                .and_then(|_| shadow_of(&limit))
                .map(|shadow| Box::new(Bucket::new(shadow))),
            extra: 0,
            wallet: false,
        }
    }

    /// An empty wallet for `limit`: it holds at most the limit's capacity, never refills by
    /// itself, and is filled by [`Bucket::refund`] (a grant deposited).
    pub(crate) fn wallet(limit: Limit) -> Self {
        let limit = limit.with_headroom(limit.headroom()).unwrap_or(limit);
        let mut bucket = Self::new(limit);
        bucket.share = None;
        bucket.shadow = None;
        bucket.wallet = true;
        bucket.full_at = bucket.units(bucket.capacity);
        bucket
    }

    /// Whether the bucket is a wallet (see [`Bucket::wallet`]).
    pub(crate) fn is_wallet(&self) -> bool {
        self.wallet
    }

    /// The provider's reports show that `spendable` may be spent now (see
    /// `ShareController::spendable`): the level and the extra together may reach it (never
    /// less than the level already is).
    pub(crate) fn grant(&mut self, spendable: u64, now: u64) {
        if self.wallet {
            // A wallet holds what was granted to it, nothing a report says beyond.
            return;
        }
        let level = u64::try_from(self.level(now)).unwrap_or(0);
        self.extra = spendable.saturating_sub(level);
    }

    /// Takes the extra back: the measure is not steady (a lowered share, a full report), or a
    /// report may not be spent at once.
    pub(crate) fn revoke(&mut self) {
        self.extra = 0;
    }

    /// What the provider's report allows beyond the capacity (see [`Bucket::grant`]).
    pub(crate) fn extra(&self) -> u64 {
        self.extra
    }

    /// What the provider should hold at `now` if this budget were alone on the key: `None`
    /// for a fixed share.
    pub(crate) fn expected_remaining(&self, now: u64) -> Option<u64> {
        let shadow = self.shadow.as_ref()?;
        Some(u64::try_from(shadow.level(now)).unwrap_or(0))
    }

    /// Lowers what the provider is expected to hold to at most `remaining` (the shadow's level;
    /// nothing for a fixed share): the provider's own report, when a measure of the adaptive
    /// share starts or the provider's nominal amount changed. Never raised: a report can be
    /// older than the budget's last calls, which the shadow counts already.
    pub(crate) fn rebase_shadow(&mut self, remaining: u64, now: u64) {
        if let Some(shadow) = &mut self.shadow {
            shadow.cap_level(remaining, now);
        }
    }

    /// The adaptive share's controller, if the limit has one.
    pub(crate) fn share_mut(&mut self) -> Option<&mut ShareController> {
        self.share.as_mut()
    }

    pub(crate) fn limit(&self) -> &Limit {
        &self.limit
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The ticks of refill up to `now`: none for a wallet.
    fn ticks(&self, now: u64) -> u128 {
        if self.wallet {
            return 0;
        }
        u128::from(now) * u128::from(self.rate)
    }

    fn units(&self, amount: u64) -> u128 {
        u128::from(amount) * u128::from(self.period)
    }

    /// What the bucket lacks to be full, in ticks.
    fn deficit(&self, now: u64) -> u128 {
        self.full_at.saturating_sub(self.ticks(now))
    }

    /// The capacity a request may use when it must leave `floor` untouched.
    pub(crate) fn usable(&self, floor: Floor) -> u64 {
        self.capacity - floor.of(self.capacity)
    }

    /// Whether `amount` fits now while leaving `floor` of the capacity, and if not, when.
    pub(crate) fn fit(&self, amount: u64, floor: Floor, now: u64) -> Fit {
        if amount > self.usable(floor) {
            return Fit::Never;
        }
        let needed = amount.saturating_add(floor.of(self.capacity));
        // The common case needs no division: the level covers the amount now. (Sums of ticks
        // saturate: a limit of u64::MAX per u64::MAX nanoseconds fills a u128 product.)
        if now >= self.held_until
            && self.deficit(now).saturating_add(self.units(needed))
                <= self.units(self.capacity.saturating_add(self.extra))
        {
            return Fit::Now;
        }
        Fit::At(self.fit_at(needed, now))
    }

    /// The earliest time (nanoseconds), from `now` on, at which the level and the extra
    /// together reach `amount`, ignoring the capacity, and not before a pause ends.
    pub(crate) fn fit_at(&self, amount: u64, now: u64) -> u64 {
        self.ready_at(amount.saturating_sub(self.extra)).max(now)
    }

    /// The earliest time (nanoseconds) at which the level reaches `amount`, ignoring the
    /// capacity (so it also answers for amounts queued one after the other), and not before
    /// a pause ends.
    pub(crate) fn ready_at(&self, amount: u64) -> u64 {
        // The level reaches `amount` when the deficit falls to `capacity - amount`, that is
        // when ticks(t) >= full_at - (capacity - amount) × period.
        let target = i128::try_from(self.full_at)
            .unwrap_or(i128::MAX)
            .saturating_sub(
                (i128::from(self.capacity) - i128::from(amount))
                    .saturating_mul(i128::from(self.period)),
            );
        if target <= 0 {
            return self.held_until;
        }
        if self.wallet {
            // Only a deposit fills a wallet.
            return u64::MAX;
        }
        let rate = u128::from(self.rate);
        let ns = (target as u128).div_ceil(rate);
        u64::try_from(ns).unwrap_or(u64::MAX).max(self.held_until)
    }

    /// Takes `amount`, from the level first and then from the extra, which may drive the
    /// level below zero (debt), but never below minus one capacity: as in the shared store, an
    /// overrun beyond that is forgiven, so that a single absurd report cannot block the bucket
    /// for longer than two refills.
    pub(crate) fn debit(&mut self, amount: u64, now: u64) {
        self.debit_down_to(amount, self.capacity, now);
    }

    /// Takes `amount` as [`debit`](Self::debit) does, the level never below minus `debt`
    /// units (for a cost larger than the capacity, admitted into debt: none of it forgiven).
    pub(crate) fn debit_down_to(&mut self, amount: u64, debt: u64, now: u64) {
        if let Some(shadow) = &mut self.shadow {
            shadow.debit(amount, now);
        }
        let amount = if self.extra > 0 {
            let level = u64::try_from(self.level(now)).unwrap_or(0);
            let from_extra = amount.saturating_sub(level).min(self.extra);
            self.extra -= from_extra;
            amount - from_extra
        } else {
            amount
        };
        let start = self.full_at.max(self.ticks(now));
        let floor = self
            .ticks(now)
            .saturating_add(self.units(self.capacity.saturating_add(debt.max(self.capacity))));
        self.full_at = start
            .saturating_add(self.units(amount))
            .min(floor.max(start));
    }

    /// Gives `amount` back. A bucket never holds more than its capacity: what overflows is
    /// dropped when the level is next read.
    pub(crate) fn refund(&mut self, amount: u64) {
        if let Some(shadow) = &mut self.shadow {
            shadow.refund(amount);
        }
        self.full_at = self.full_at.saturating_sub(self.units(amount));
    }

    /// The level, rounded down; negative when the bucket is in debt.
    pub(crate) fn level(&self, now: u64) -> i64 {
        let owed = self.deficit(now).div_ceil(u128::from(self.period));
        let level = i128::from(self.capacity) - i128::try_from(owed).unwrap_or(i128::MAX);
        i64::try_from(level).unwrap_or(i64::MIN)
    }

    /// When the bucket is full again (nanoseconds).
    pub(crate) fn full_at(&self, now: u64) -> u64 {
        if self.wallet && self.full_at > 0 {
            return u64::MAX;
        }
        let ns = self.full_at.div_ceil(u128::from(self.rate));
        u64::try_from(ns).unwrap_or(u64::MAX).max(now)
    }

    /// Replaces the limit (a new amount, headroom or burst), keeping the current level, clamped
    /// to the new capacity, the pause, the extra (unless the nominal amount changes), and the
    /// adaptive share's state (unless the new limit changes how its share is planned).
    pub(crate) fn set_limit(&mut self, limit: Limit, now: u64) {
        let owed = self.deficit(now);
        let old_capacity = self.capacity;
        let (held_until, share) = (self.held_until, self.share);
        let mut shadow = self.shadow.take();
        let same_plan = limit.adaptive_share() == self.limit.adaptive_share();
        // The extra was the provider's word on the nominal amount it had: a new one voids it.
        let extra = if limit.amount() == self.limit.amount() {
            self.extra
        } else {
            0
        };
        let wallet = self.wallet;
        *self = match wallet {
            true => Bucket::wallet(limit),
            false => Bucket::new(limit),
        };
        self.extra = extra;
        self.held_until = held_until;
        if same_plan && share.is_some() {
            self.share = share;
            if let (Some(shadow), Some(nominal)) = (&mut shadow, shadow_of(&limit)) {
                if shadow.limit().amount() != nominal.amount() {
                    shadow.set_limit(nominal, now);
                }
            }
            self.shadow = shadow;
        }
        // Same period, so ticks of deficit per unit are unchanged: deficit' = capacity' − level.
        let owed = i128::try_from(owed).unwrap_or(i128::MAX).saturating_add(
            (i128::from(self.capacity) - i128::from(old_capacity))
                .saturating_mul(i128::from(self.period)),
        );
        self.full_at = self
            .ticks(now)
            .saturating_add(u128::try_from(owed.max(0)).unwrap_or(0));
    }

    /// Admits nothing before `until` (nanoseconds); the level is left as it is and keeps
    /// refilling, the extra is taken back. A later end extends a pause, an earlier one never
    /// shortens it.
    pub(crate) fn hold_until(&mut self, until: u64) {
        self.held_until = self.held_until.max(until);
        self.extra = 0;
    }

    /// Ends a pause now.
    pub(crate) fn lift(&mut self) {
        self.held_until = 0;
    }

    /// Lowers the level to at most `level` (never raises it): someone else spends this quota.
    pub(crate) fn cap_level(&mut self, level: u64, now: u64) {
        let owed = self.units(self.capacity.saturating_sub(level));
        if self.deficit(now) < owed {
            self.full_at = self.ticks(now).saturating_add(owed);
        }
    }
}

/// The provider's own bucket for `limit`: its nominal amount, all of it at once.
fn shadow_of(limit: &Limit) -> Option<Limit> {
    let nominal = limit.with_headroom(1.0).ok()?;
    Some(nominal.with_burst(limit.amount()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::Dimension;
    use std::num::NonZeroU64;
    use std::time::Duration;

    const MS: u64 = 1_000_000;
    const SEC: u64 = 1_000 * MS;

    /// 10 units per second, burst 10: one unit per 100 ms.
    fn bucket() -> Bucket {
        let limit = Limit::new(
            Dimension::Requests,
            NonZeroU64::new(10).unwrap(),
            Duration::from_secs(1),
        )
        .unwrap()
        .with_headroom(1.0)
        .unwrap()
        .with_burst_fraction(1.0)
        .unwrap();
        Bucket::new(limit)
    }

    #[test]
    fn refills_lazily_and_exactly() {
        let mut b = bucket();
        assert_eq!(b.level(0), 10);
        b.debit(10, 0);
        assert_eq!(b.level(0), 0);
        assert_eq!(b.fit(1, Floor::NONE, 0), Fit::At(100 * MS));
        assert_eq!(b.level(99 * MS), 0);
        assert_eq!(b.level(100 * MS), 1);
        assert_eq!(b.level(SEC), 10);
        assert_eq!(b.level(100 * SEC), 10, "capped at capacity");
    }

    #[test]
    fn thirds_do_not_drift() {
        // 3 units per second: 333_333_333.3 ns each, never rounded.
        let limit = Limit::new(
            Dimension::Requests,
            NonZeroU64::new(3).unwrap(),
            Duration::from_secs(1),
        )
        .unwrap()
        .with_headroom(1.0)
        .unwrap()
        .with_burst_fraction(1.0)
        .unwrap();
        let mut b = Bucket::new(limit);
        let mut now = 0;
        for _ in 0..3_000 {
            match b.fit(1, Floor::NONE, now) {
                Fit::Now => b.debit(1, now),
                Fit::At(at) => {
                    now = at;
                    b.debit(1, now);
                }
                Fit::Never => unreachable!(),
            }
        }
        // 3 from the burst, then 2_997 at 3 per second.
        assert_eq!(now, 999 * SEC);
    }

    #[test]
    fn debt_delays_by_debt_over_rate() {
        let mut b = bucket();
        b.debit(10, 0);
        b.debit(5, 0); // overrun: 5 units of debt
        assert_eq!(b.level(0), -5);
        assert_eq!(b.fit(1, Floor::NONE, 0), Fit::At(600 * MS));
    }

    #[test]
    fn refund_is_capped_at_capacity() {
        let mut b = bucket();
        b.debit(4, 0);
        b.refund(10);
        assert_eq!(b.level(0), 10);
        b.debit(10, SEC);
        assert_eq!(b.level(SEC), 0, "the earlier over-refund was not kept");
    }

    #[test]
    fn too_large_never_fits() {
        assert_eq!(bucket().fit(11, Floor::NONE, 0), Fit::Never);
    }

    #[test]
    fn set_limit_keeps_level_and_clamps() {
        let mut b = bucket();
        b.debit(4, 0); // level 6
        let smaller = b.limit().with_amount(NonZeroU64::new(5).unwrap());
        b.set_limit(smaller, 0);
        assert_eq!(b.capacity(), 5);
        assert_eq!(b.level(0), 5);
        b.debit(5, 0);
        assert_eq!(
            b.fit(1, Floor::NONE, 0),
            Fit::At(200 * MS),
            "new rate: 5 per second"
        );
    }

    #[test]
    fn a_floor_keeps_the_last_share_for_others() {
        let mut b = bucket();
        let floor = Floor::from_fraction(0.3);
        assert_eq!(b.usable(floor), 7);
        assert_eq!(b.fit(8, floor, 0), Fit::Never);
        b.debit(5, 0);
        // Level 5: 2 fit above the floor of 3, a third must wait for 100 ms of refill.
        assert_eq!(b.fit(2, floor, 0), Fit::Now);
        assert_eq!(b.fit(3, floor, 0), Fit::At(100 * MS));
        assert_eq!(b.fit(3, Floor::NONE, 0), Fit::Now);
        assert_eq!(Floor::from_fraction(f64::NAN), Floor::NONE);
        assert_eq!(Floor::from_fraction(2.0).of(10), 10);
    }

    #[test]
    fn a_pause_holds_admissions_and_keeps_the_level() {
        let mut b = bucket();
        b.debit(10, 0);
        b.hold_until(2 * SEC);
        // Nothing before the end of the pause, although the bucket refills meanwhile.
        assert_eq!(b.fit(1, Floor::NONE, 0), Fit::At(2 * SEC));
        assert_eq!(b.fit(1, Floor::NONE, SEC), Fit::At(2 * SEC));
        assert_eq!(b.level(SEC), 10);
        assert_eq!(b.fit(10, Floor::NONE, 2 * SEC), Fit::Now);
        b.hold_until(SEC);
        assert_eq!(b.fit(1, Floor::NONE, 0), Fit::At(2 * SEC), "not shortened");
        // Lowered to what the provider reports, it refills from there.
        b.cap_level(0, 0);
        assert_eq!(b.fit(5, Floor::NONE, 0), Fit::At(2 * SEC));
        assert_eq!(b.fit(30, Floor::NONE, 0), Fit::Never);
        b.lift();
        assert_eq!(b.fit(1, Floor::NONE, 0), Fit::At(100 * MS));
    }

    #[test]
    fn debt_is_bounded_at_one_capacity() {
        let mut b = bucket();
        b.debit(10, 0);
        b.debit(1_000_000_000_000, 0);
        assert_eq!(b.level(0), -10);
        // Two refills (2 s) bring the next unit.
        assert_eq!(b.fit(1, Floor::NONE, 0), Fit::At(SEC + 100 * MS));
    }

    #[test]
    fn cap_level_only_lowers() {
        let mut b = bucket();
        b.cap_level(3, 0);
        assert_eq!(b.level(0), 3);
        b.cap_level(8, 0);
        assert_eq!(b.level(0), 3);
    }

    #[test]
    fn absurd_limits_saturate_instead_of_overflowing() {
        use std::num::NonZeroU64;
        use std::time::Duration;
        let huge = Limit::new(Dimension::Requests, NonZeroU64::MAX, Duration::MAX).unwrap();
        for limit in [
            huge,
            huge.with_burst(NonZeroU64::MAX),
            huge.with_headroom(1.0).unwrap(),
        ] {
            let mut b = Bucket::new(limit);
            let cap = b.capacity();
            assert_eq!(b.fit(cap, Floor::NONE, u64::MAX), Fit::Now);
            b.debit(cap, u64::MAX / 2);
            b.debit(u64::MAX, u64::MAX / 2);
            assert!(matches!(
                b.fit(cap, Floor::from_fraction(0.5), 0),
                Fit::At(_) | Fit::Never
            ));
            let _ = (b.level(u64::MAX), b.full_at(0), b.ready_at(u64::MAX));
            b.refund(u64::MAX);
            b.cap_level(0, u64::MAX);
            b.set_limit(
                Limit::per_second(Dimension::Requests, NonZeroU64::MIN),
                u64::MAX,
            );
            b.set_limit(limit, 0);
            let _ = b.fit(1, Floor::NONE, u64::MAX);
        }
    }
}
