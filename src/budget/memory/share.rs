//! The adaptive share: how much of a nominal limit a budget plans for, as a controller.
//!
//! Pure arithmetic over a virtual clock (nanoseconds), no I/O: the store feeds it what the
//! provider reports and applies the share it answers.
//!
//! # Why a controller
//!
//! A fixed share below the nominal limit (the articles' 80-85 %) protects against consumers
//! the budget cannot see, but when the client is alone on its key it leaves that margin idle
//! for nothing: the modest default burst already keeps a margin in the provider's bucket. The
//! controller plans for the whole quota while the provider's rate-limit headers show nobody
//! else spending it, and backs off when they do, as TCP's congestion control does
//! (additive increase, multiplicative decrease):
//!
//! - **Decrease.** When the provider reports less remaining than the budget expects (by more
//!   than [`AdaptiveShare::tolerance`] of the nominal limit), the share is multiplied by
//!   `1 - gap / nominal`, but never by less than [`AdaptiveShare::decrease`]: a small gap
//!   (a neighbour whose share was nearly left) costs a small step, a wide one the whole
//!   factor. A 429 multiplies it by the decrease factor. At most once per sixth of the limit's period
//!   (the time the default burst takes to refill), so one burst of responses carrying the
//!   same news counts once. After a decrease, the provider's backlog takes a while to drain:
//!   a gap no wider than the one that caused the last decrease lowers nothing more (nor does
//!   the share grow meanwhile); only a wider one does. It never goes below
//!   [`AdaptiveShare::min`].
//! - **Increase.** While the gap stays closed, the share grows by
//!   [`AdaptiveShare::increase`] of the nominal limit per period, continuously, starting a
//!   sixth of a period after the last decrease. It never exceeds the nominal limit (a share
//!   of 1).
//!
//! # What the budget expects
//!
//! Next to each adaptive bucket the budget keeps a *shadow* of the provider's bucket as it
//! would be if the budget were alone on the key: it holds the nominal amount, refills it over
//! the period, and is debited and refunded exactly as the budget's own bucket is. Its level is
//! what the provider should report as remaining; what the provider reports below it (beyond
//! the tolerance) is someone else's spending. Estimates err high and reservations are debited
//! before the provider sees the call, so both errors keep the shadow below the provider and
//! the controller on the safe side. The shadow does not move when the share does, so a
//! decrease does not look like a wider gap. When the provider reports a new nominal amount
//! (a limit lowered without notice), the shadow starts again from the remaining of that
//! report, never higher than it was: the provider has charged under the new amount since it
//! changed it, before the budget could know, and a shadow merely cut to the new amount would
//! take that spending for someone else's.

use std::time::Duration;

use crate::quota::AdaptiveShare;

/// The controller's state for one limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ShareController {
    params: AdaptiveShare,
    /// The limit's period in nanoseconds (at least 1).
    period: u64,
    share: f64,
    /// When the share was last lowered.
    decreased_at: Option<u64>,
    /// The gap that lowered it last; 0 once the gap closed.
    lowered_for: u64,
    /// Up to when the increase has been counted.
    counted_to: u64,
    /// Since when the provider's reports agree with what the budget expects.
    agreeing_since: Option<u64>,
}

/// Changes below this are not applied (they would only churn the bucket).
const STEP: f64 = 0.005;

impl ShareController {
    /// A controller planning for the whole quota.
    pub(crate) fn new(params: AdaptiveShare, period: Duration, share: f64, now: u64) -> Self {
        Self {
            params,
            period: u64::try_from(period.as_nanos()).unwrap_or(u64::MAX).max(1),
            share: share.clamp(params.min_share(), 1.0),
            decreased_at: None,
            lowered_for: 0,
            counted_to: now,
            agreeing_since: None,
        }
    }

    pub(crate) fn share(&self) -> f64 {
        self.share
    }

    /// The time between two decreases, and from a decrease to the first increase.
    fn cooldown(&self) -> u64 {
        self.period / 6
    }

    /// Whether a report of `reported` remaining of `nominal` agrees with the `expected`: it is
    /// below it by no more than the tolerance (nobody else spends the key).
    fn agrees(&self, expected: u64, reported: u64, nominal: u64) -> bool {
        expected.saturating_sub(reported) <= self.tolerance(nominal)
    }

    /// What the budget may spend now, all at once, of what the provider reports: the lower of
    /// `reported` and `expected` less the tolerance, once the reports have agreed with what
    /// the budget expects for a cooldown (a neighbour spending a tenth of the quota or more
    /// shows in that time as a gap); `None` while they have not, or disagree now.
    pub(crate) fn spendable(
        &mut self,
        expected: u64,
        reported: u64,
        nominal: u64,
        now: u64,
    ) -> Option<u64> {
        if !self.agrees(expected, reported, nominal) {
            self.agreeing_since = None;
            return None;
        }
        let since = *self.agreeing_since.get_or_insert(now);
        (now.saturating_sub(since) >= self.cooldown()).then(|| {
            reported
                .min(expected)
                .saturating_sub(self.tolerance(nominal))
        })
    }

    fn tolerance(&self, nominal: u64) -> u64 {
        (nominal as f64 * self.params.tolerance_share()).ceil() as u64
    }

    /// The provider reported `reported` remaining of `nominal`, while the budget expected at
    /// least `expected`. Returns the new share when it changed.
    pub(crate) fn observe(
        &mut self,
        expected: u64,
        reported: u64,
        nominal: u64,
        now: u64,
    ) -> Option<f64> {
        let gap = expected.saturating_sub(reported);
        if self.agrees(expected, reported, nominal) {
            self.lowered_for = 0;
            return self.recover(now);
        }
        // The provider's backlog drains only after a decrease: a gap that is not wider than
        // the one that lowered the share last is the same news, and the last decrease is
        // still working on it.
        if gap <= self.lowered_for {
            self.counted_to = now;
            return None;
        }
        // In proportion to the gap, down to the decrease factor: a small, slowly growing gap
        // (a neighbour whose share was nearly left) costs a small step.
        let factor =
            (1.0 - gap as f64 / nominal.max(1) as f64).clamp(self.params.decrease_factor(), 1.0);
        let lowered = self.lower(factor, now);
        if lowered.is_some() {
            self.lowered_for = gap;
        }
        lowered
    }

    /// The provider refused with a 429 naming this limit.
    pub(crate) fn rate_limited(&mut self, now: u64) -> Option<f64> {
        self.agreeing_since = None;
        self.lower(self.params.decrease_factor(), now)
    }

    fn lower(&mut self, factor: f64, now: u64) -> Option<f64> {
        self.counted_to = now;
        if self
            .decreased_at
            .is_some_and(|at| now.saturating_sub(at) < self.cooldown())
        {
            return None;
        }
        self.decreased_at = Some(now);
        let lowered = (self.share * factor).max(self.params.min_share());
        (lowered < self.share).then(|| {
            self.share = lowered;
            lowered
        })
    }

    fn recover(&mut self, now: u64) -> Option<f64> {
        let from = match self.decreased_at {
            Some(at) => self.counted_to.max(at.saturating_add(self.cooldown())),
            None => self.counted_to,
        };
        if self.share >= 1.0 {
            self.counted_to = now;
            return None;
        }
        if now <= from {
            return None;
        }
        let gained = self.params.increase_per_period() * (now - from) as f64 / self.period as f64;
        let raised = (self.share + gained).min(1.0);
        if raised - self.share < STEP && raised < 1.0 {
            // Too small to apply yet: keep counting from `from`.
            return None;
        }
        self.counted_to = now;
        self.share = raised;
        Some(raised)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn controller() -> ShareController {
        ShareController::new(AdaptiveShare::new(), Duration::from_secs(60), 1.0, 0)
    }

    #[test]
    fn stays_at_the_whole_quota_while_the_gap_is_closed() {
        let mut c = controller();
        for t in 0..100 {
            assert_eq!(c.observe(900, 900, 1_000, t * SEC), None);
            assert_eq!(
                c.observe(900, 885, 1_000, t * SEC),
                None,
                "within tolerance"
            );
        }
        assert_eq!(c.share(), 1.0);
    }

    #[test]
    fn lowers_multiplicatively_once_per_cooldown_and_never_below_min() {
        let mut c = controller();
        assert_eq!(c.observe(900, 500, 1_000, 0), Some(0.8));
        // The same news within a sixth of the period counts once.
        assert_eq!(c.observe(900, 400, 1_000, 9 * SEC), None);
        assert_eq!(c.rate_limited(9 * SEC), None);
        // After it, a gap that is not wider is the last decrease still at work.
        assert_eq!(c.observe(900, 500, 1_000, 11 * SEC), None);
        assert_eq!(c.observe(900, 400, 1_000, 12 * SEC), Some(0.8 * 0.8));
        assert_eq!(c.rate_limited(30 * SEC), Some(0.8 * 0.8 * 0.8));
        for t in 2..100 {
            c.rate_limited(t * 10 * SEC);
        }
        assert_eq!(c.share(), 0.2);
    }

    #[test]
    fn recovers_additively_after_the_cooldown_up_to_the_whole_quota() {
        let mut c = controller();
        c.rate_limited(0);
        assert_eq!(c.share(), 0.8);
        // Nothing during the cooldown (10 s), then 0.1 per 60 s.
        assert_eq!(c.observe(10, 10, 1_000, 10 * SEC), None);
        let raised = c.observe(10, 10, 1_000, 40 * SEC).unwrap();
        assert!((raised - 0.85).abs() < 1e-9, "{raised}");
        assert_eq!(c.observe(10, 10, 1_000, 1_000 * SEC), Some(1.0));
        assert_eq!(c.observe(10, 10, 1_000, 2_000 * SEC), None);
    }

    #[test]
    fn tiny_steps_accumulate_instead_of_being_lost() {
        let mut c = controller();
        c.rate_limited(0);
        let mut t = 10 * SEC;
        let mut changes = 0;
        while t <= 70 * SEC {
            changes += usize::from(c.observe(10, 10, 1_000, t).is_some());
            t += SEC / 10;
        }
        assert!((c.share() - 0.9).abs() < 0.006, "{}", c.share());
        assert!(changes <= 25, "{changes} changes for a 0.1 rise");
    }

    #[test]
    fn parameters_are_clamped() {
        let p = AdaptiveShare::new()
            .min(f64::NAN)
            .decrease(2.0)
            .increase(-1.0)
            .tolerance(0.9);
        assert_eq!(p.min_share(), 0.2);
        assert_eq!(p.decrease_factor(), 0.99);
        assert_eq!(p.increase_per_period(), 0.001);
        assert_eq!(p.tolerance_share(), 0.5);
    }
}
