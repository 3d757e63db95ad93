//! The provider's token bucket: pure integer arithmetic over nanoseconds, no I/O.
//!
//! A bucket holds at most `capacity` units and refills continuously at `capacity` per
//! `period`. To stay exact, the level is kept in *ticks*: one unit is `period` ticks (the
//! period in nanoseconds) and one nanosecond refills `capacity` ticks.

/// A token bucket; time is nanoseconds since the simulator started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bucket {
    capacity: u64,
    /// The period in nanoseconds, at least 1.
    period: u64,
    /// The level in ticks.
    level: u128,
    /// When `level` was last brought up to date.
    at: u64,
}

impl Bucket {
    /// A full bucket of `capacity` (at least 1) refilling over `period_nanos` (at least 1).
    pub(crate) fn full(capacity: u64, period_nanos: u64, now: u64) -> Self {
        let capacity = capacity.max(1);
        let period = period_nanos.max(1);
        Self {
            capacity,
            period,
            level: u128::from(capacity) * u128::from(period),
            at: now,
        }
    }

    /// The most the bucket holds.
    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    fn full_level(&self) -> u128 {
        u128::from(self.capacity) * u128::from(self.period)
    }

    /// Adds what refilled since the last update.
    fn refill(&mut self, now: u64) {
        if now > self.at {
            let added = u128::from(now - self.at) * u128::from(self.capacity);
            self.level = self.level.saturating_add(added).min(self.full_level());
            self.at = now;
        }
    }

    /// Whole units available now.
    pub(crate) fn remaining(&mut self, now: u64) -> u64 {
        self.refill(now);
        u64::try_from(self.level / u128::from(self.period)).unwrap_or(u64::MAX)
    }

    /// Nanoseconds until `amount` fits (0: it fits now), or `None` if it never fits.
    pub(crate) fn wait_for(&mut self, now: u64, amount: u64) -> Option<u64> {
        if amount > self.capacity {
            return None;
        }
        self.refill(now);
        let needed = u128::from(amount) * u128::from(self.period);
        let missing = needed.saturating_sub(self.level);
        Some(nanos(missing.div_ceil(u128::from(self.capacity))))
    }

    /// Takes `amount` (the caller checked that it fits; the level stops at zero).
    pub(crate) fn take(&mut self, now: u64, amount: u64) {
        self.refill(now);
        let taken = u128::from(amount) * u128::from(self.period);
        self.level = self.level.saturating_sub(taken);
    }

    /// Gives back `amount` (the level stops at the capacity).
    pub(crate) fn give_back(&mut self, now: u64, amount: u64) {
        self.refill(now);
        let given = u128::from(amount) * u128::from(self.period);
        self.level = self.level.saturating_add(given).min(self.full_level());
    }

    /// Nanoseconds until the bucket is full again.
    pub(crate) fn until_full(&mut self, now: u64) -> u64 {
        self.refill(now);
        let missing = self.full_level() - self.level;
        nanos(missing.div_ceil(u128::from(self.capacity)))
    }

    /// From `now`, holds at most `capacity` (at least 1) and refills at `capacity` per period;
    /// a level above the new capacity is cut to it.
    pub(crate) fn set_capacity(&mut self, now: u64, capacity: u64) {
        self.refill(now);
        self.capacity = capacity.max(1);
        self.level = self.level.min(self.full_level());
    }
}

fn nanos(value: u128) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;

    #[test]
    fn a_full_bucket_takes_its_capacity_then_refills_continuously() {
        let mut bucket = Bucket::full(60, 60 * SECOND, 0);
        assert_eq!(bucket.remaining(0), 60);
        assert_eq!(bucket.wait_for(0, 60), Some(0));
        bucket.take(0, 60);
        assert_eq!(bucket.remaining(0), 0);
        // One unit per second.
        assert_eq!(bucket.wait_for(0, 1), Some(SECOND));
        assert_eq!(bucket.wait_for(0, 3), Some(3 * SECOND));
        assert_eq!(bucket.remaining(SECOND / 2), 0);
        assert_eq!(bucket.remaining(SECOND), 1);
        assert_eq!(bucket.wait_for(SECOND, 1), Some(0));
        assert_eq!(bucket.until_full(SECOND), 59 * SECOND);
        assert_eq!(bucket.remaining(1_000 * SECOND), 60, "never above capacity");
        assert_eq!(bucket.until_full(1_000 * SECOND), 0);
    }

    #[test]
    fn an_amount_above_the_capacity_never_fits() {
        let mut bucket = Bucket::full(100, SECOND, 0);
        assert_eq!(bucket.wait_for(0, 101), None);
        assert_eq!(bucket.wait_for(0, 100), Some(0));
    }

    #[test]
    fn refunds_stop_at_the_capacity() {
        let mut bucket = Bucket::full(1_000, SECOND, 0);
        bucket.take(0, 900);
        bucket.give_back(0, 500);
        assert_eq!(bucket.remaining(0), 600);
        bucket.give_back(0, 5_000);
        assert_eq!(bucket.remaining(0), 1_000);
    }

    #[test]
    fn waits_round_up_to_the_nanosecond() {
        // 3 units per 10 ns: one unit every 3.33 ns.
        let mut bucket = Bucket::full(3, 10, 0);
        bucket.take(0, 3);
        assert_eq!(bucket.wait_for(0, 1), Some(4));
        assert_eq!(bucket.remaining(3), 0);
        assert_eq!(bucket.remaining(4), 1);
        assert_eq!(bucket.until_full(4), 6);
    }

    #[test]
    fn a_lowered_capacity_cuts_the_level_and_slows_the_refill() {
        let mut bucket = Bucket::full(100, 100 * SECOND, 0);
        bucket.set_capacity(10 * SECOND, 10);
        assert_eq!(bucket.capacity(), 10);
        assert_eq!(bucket.remaining(10 * SECOND), 10);
        bucket.take(10 * SECOND, 10);
        // 10 per 100 s: one unit per 10 s.
        assert_eq!(bucket.wait_for(10 * SECOND, 1), Some(10 * SECOND));
        assert_eq!(bucket.wait_for(10 * SECOND, 11), None);
    }

    #[test]
    fn degenerate_parameters_do_not_panic() {
        let mut bucket = Bucket::full(0, 0, 0);
        assert_eq!(bucket.capacity(), 1);
        bucket.take(0, u64::MAX);
        assert_eq!(bucket.remaining(u64::MAX), 1);
        let mut huge = Bucket::full(u64::MAX, u64::MAX, 0);
        huge.take(0, u64::MAX);
        assert_eq!(huge.remaining(u64::MAX), u64::MAX);
    }
}
