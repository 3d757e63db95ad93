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
//! else spending it, and for what they show is left when someone does.
//!
//! # What the budget measures
//!
//! Next to each adaptive bucket the budget keeps a *shadow* of the provider's bucket: the
//! nominal amount, refilled over the period, debited and refunded exactly as the budget's own
//! bucket is (so its calls on their way count). When a measure starts, the shadow is lowered
//! to the provider's report (never raised: a report can be older than the budget's last
//! calls); from then on it is what the provider would hold had nobody else spent, and what the
//! provider reports below it, the others spent since. Both buckets stop at
//! the same top, so an idle spell that fills the provider's bucket is not taken for spending.
//!
//! - **Measuring.** Once a window (a sixth of the period), the others' rate since the start
//!   of the measure (between one window and one period ago; then it starts again) is measured
//!   as a share `f` of the nominal rate. When what they spent exceeds [`AdaptiveShare::tolerance`] of the
//!   nominal amount, the share is planned at `1 - f - tolerance`; below it (rounding, timing),
//!   the share may only rise, to `1 - f`. Within `[min, 1]`. A neighbour spending 30 % is
//!   planned around at its first window: 0.68 of the quota.
//! - **A full bucket** (a report within the tolerance of the nominal amount) hides the others'
//!   spending and shows room: the measure starts again from it, and the share rises.
//! - **Rising** is limited to [`AdaptiveShare::increase`] per period, and waits a window after
//!   a 429; **lowering** follows a measure at once. **A 429** multiplies the share by
//!   [`AdaptiveShare::decrease`], at most once per window. The share paces the refill only:
//!   the burst stays the limit's, so a request that fits the limit keeps fitting.
//!
//! # The burst the provider reports
//!
//! Once the measure is steady (a window old, nothing lowered for a window), the budget may
//! spend at once, beyond its own burst, the lower of the provider's report and the shadow's
//! level, less a cushion: the tolerance, and a window of the others' spending at the rate the
//! share leaves them ([`ShareController::spendable`]).
//!
//! When the provider reports a new nominal amount (a limit lowered without notice), the measure
//! starts again from that report: the provider has charged under the new amount since it
//! changed it, before the budget could know, and that is not someone else's spending.

use std::time::Duration;

use crate::quota::AdaptiveShare;

/// The controller's state for one limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ShareController {
    params: AdaptiveShare,
    /// The limit's period in nanoseconds (at least 1).
    period: u64,
    share: f64,
    /// When a 429 last lowered the share.
    rate_limited_at: Option<u64>,
    /// When the measure started: the shadow was lowered to the provider's report then.
    start: Option<u64>,
    /// When the share was last decided on a measure.
    decided_at: u64,
    /// When the share last changed on a measure: rises are counted from there.
    measured_at: u64,
    /// When the share was last lowered (a measure, a 429).
    lowered_at: Option<u64>,
}

/// Changes below this are not applied (they would only churn the bucket).
const STEP: f64 = 0.005;

/// What a report did to the controller.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Measure {
    /// The new share, when it changed.
    pub(crate) share: Option<f64>,
    /// A measure starts here: the shadow is to be lowered to the report.
    pub(crate) anchor: bool,
}

impl Measure {
    /// Nothing changed, no measure starts.
    pub(crate) const NOTHING: Measure = Measure {
        share: None,
        anchor: false,
    };
}

impl ShareController {
    /// A controller planning for the whole quota.
    pub(crate) fn new(params: AdaptiveShare, period: Duration, share: f64, now: u64) -> Self {
        Self {
            params,
            period: u64::try_from(period.as_nanos()).unwrap_or(u64::MAX).max(1),
            share: share.clamp(params.min_share(), 1.0),
            rate_limited_at: None,
            start: None,
            decided_at: now,
            measured_at: now,
            lowered_at: None,
        }
    }

    pub(crate) fn share(&self) -> f64 {
        self.share
    }

    /// A window, the time between two 429 decreases, and from a 429 to the first rise.
    fn window(&self) -> u64 {
        self.period / 6
    }

    /// What the budget may spend now, all at once, of what the provider reports: the lower of
    /// `reported` and `expected` (what the provider should hold for this budget alone, its calls
    /// on their way counted), less a cushion for the others: the tolerance, and what they
    /// spend in a window at the rate the share leaves them. Only once the measure is steady: it
    /// has run for a window, and lowered nothing for a window (a 429 included); `None` before,
    /// and always when the parameters do not spend the reported burst.
    pub(crate) fn spendable(
        &self,
        expected: u64,
        reported: u64,
        nominal: u64,
        now: u64,
    ) -> Option<u64> {
        if !self.params.spends_reported_burst() {
            return None;
        }
        let window = self.window();
        let start = self.start?;
        let quiet = self
            .lowered_at
            .is_none_or(|at| now.saturating_sub(at) >= window);
        if now.saturating_sub(start) < window || !quiet {
            return None;
        }
        let theirs = (1.0 - self.share) * nominal as f64 * window as f64 / self.period as f64;
        let cushion = self.tolerance(nominal).saturating_add(theirs.ceil() as u64);
        Some(reported.min(expected).saturating_sub(cushion))
    }

    fn tolerance(&self, nominal: u64) -> u64 {
        (nominal as f64 * self.params.tolerance_share()).ceil() as u64
    }

    /// The provider reported `reported` remaining of `nominal`, while the shadow, lowered to
    /// the provider's report when the measure started, expects `expected`: once a window, the
    /// others' rate since that start is measured and the share planned for what they leave
    /// (see the module documentation).
    pub(crate) fn observe(
        &mut self,
        expected: u64,
        reported: u64,
        nominal: u64,
        now: u64,
    ) -> Measure {
        let tolerance = self.tolerance(nominal);
        // A full bucket hides the others' spending, and shows room: the measure starts
        // again from it.
        if reported.saturating_add(tolerance) >= nominal {
            self.start = Some(now);
            return Measure {
                share: self.plan(1.0, now),
                anchor: true,
            };
        }
        let Some(start) = self.start else {
            self.restart(now);
            return Measure {
                share: None,
                anchor: true,
            };
        };
        let elapsed = now.saturating_sub(start);
        if now.saturating_sub(self.decided_at) < self.window() || elapsed < self.window() {
            return Measure::NOTHING;
        }
        self.decided_at = now;
        let gap = expected.saturating_sub(reported);
        let others = gap as f64 / nominal.max(1) as f64 * self.period as f64 / elapsed as f64;
        // A measure a period old starts again here: the next one counts from now.
        let anchor = elapsed >= self.period;
        if anchor {
            self.restart(now);
        }
        let share = if gap > tolerance {
            let target = 1.0 - others - self.params.tolerance_share();
            self.plan(target.clamp(self.params.min_share(), 1.0), now)
        } else {
            // Within the tolerance: evidence enough to rise, not to fall.
            let target = (1.0 - others).clamp(self.params.min_share(), 1.0);
            (target > self.share)
                .then(|| self.plan(target, now))
                .flatten()
        };
        Measure { share, anchor }
    }

    /// The measure starts again now (the shadow is lowered to the provider's report, or to a
    /// new nominal amount's).
    pub(crate) fn restart(&mut self, now: u64) {
        self.start = Some(now);
    }

    /// Moves the share towards `target`: down at once, up by at most the increase per period
    /// since the last change, and not within a window after a 429.
    fn plan(&mut self, target: f64, now: u64) -> Option<f64> {
        let planned = if target < self.share {
            self.lowered_at = Some(now);
            target
        } else {
            if self
                .rate_limited_at
                .is_some_and(|at| now.saturating_sub(at) < self.window())
            {
                return None;
            }
            let since = now.saturating_sub(self.measured_at) as f64 / self.period as f64;
            target.min(self.share + self.params.increase_per_period() * since)
        };
        if (planned - self.share).abs() < STEP && !(planned == 1.0 && self.share < 1.0) {
            return None;
        }
        self.measured_at = now;
        self.share = planned;
        Some(planned)
    }

    /// The provider refused with a 429 naming this limit.
    pub(crate) fn rate_limited(&mut self, now: u64) -> Option<f64> {
        self.lowered_at = Some(now);
        if self
            .rate_limited_at
            .is_some_and(|at| now.saturating_sub(at) < self.window())
        {
            return None;
        }
        self.rate_limited_at = Some(now);
        self.measured_at = now;
        let lowered = (self.share * self.params.decrease_factor()).max(self.params.min_share());
        (lowered < self.share).then(|| {
            self.share = lowered;
            lowered
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    /// A controller for 1,000 a minute (16.7 a second; tolerance 20; windows of 10 s), its
    /// measure started at 0 from a report of 500 (the shadow set to it).
    fn controller() -> ShareController {
        let mut c = ShareController::new(AdaptiveShare::new(), Duration::from_secs(60), 1.0, 0);
        assert_eq!(
            c.observe(500, 500, 1_000, 0),
            Measure {
                share: None,
                anchor: true
            }
        );
        c
    }

    #[test]
    fn stays_at_the_whole_quota_while_nobody_else_spends() {
        let mut c = controller();
        for t in 1..100u64 {
            // The provider's reports off by up to 15 (rounding, timing): within the tolerance.
            let reported = if t % 2 == 0 { 500 } else { 485 };
            assert_eq!(c.observe(500, reported, 1_000, t * 10 * SEC).share, None);
        }
        assert_eq!(c.share(), 1.0);
    }

    /// The shadow's level at `t` seconds since the start when a neighbour spends 5 a second
    /// (30 %) and the budget its 70 %: the provider stays at 500, the shadow (nobody else)
    /// gains 5 a second.
    fn expected(t: u64) -> u64 {
        500 + 5 * t
    }

    #[test]
    fn plans_what_a_neighbour_leaves_once_a_window() {
        let mut c = controller();
        // Nothing is decided within the first window.
        assert_eq!(
            c.observe(expected(5), 500, 1_000, 5 * SEC),
            Measure::NOTHING
        );
        // After 10 s the provider holds 50 less than the shadow: 0.3 of the rate; planned
        // 1 - 0.3 - the tolerance (0.02).
        let share = c.observe(expected(10), 500, 1_000, 10 * SEC).share.unwrap();
        assert!((share - 0.68).abs() < 1e-9, "{share}");
        // Not again within a window; then the same neighbour over longer spans from the same
        // start: the same share, nothing to change.
        assert_eq!(
            c.observe(expected(15), 500, 1_000, 15 * SEC),
            Measure::NOTHING
        );
        for t in [20, 30, 50] {
            assert_eq!(
                c.observe(expected(t), 500, 1_000, t * SEC),
                Measure::NOTHING,
                "{t}"
            );
        }
        // A period after the start, the measure starts again from the report.
        assert_eq!(
            c.observe(expected(60), 500, 1_000, 60 * SEC),
            Measure {
                share: None,
                anchor: true
            }
        );
        assert_eq!(c.observe(550, 500, 1_000, 70 * SEC), Measure::NOTHING);
        // A wider gap lowers it at the next window, never below the minimum.
        assert_eq!(c.observe(600, 0, 1_000, 80 * SEC).share, Some(0.2));
    }

    #[test]
    fn rises_back_by_the_increase_per_period_once_the_provider_shows_room() {
        let mut c = controller();
        c.observe(expected(10), 500, 1_000, 10 * SEC);
        let mut t = 10 * SEC;
        while c.share() < 1.0 {
            t += SEC;
            // The neighbour stopped: the provider's bucket is full.
            c.observe(1_000, 1_000, 1_000, t);
        }
        // 0.5 a period: from 0.68, 39 s.
        assert_eq!(
            t,
            49 * SEC,
            "the whole quota again 39 s after the neighbour stopped"
        );
    }

    #[test]
    fn a_429_lowers_by_the_factor_once_per_window_and_holds_the_share_for_a_window() {
        let mut c = controller();
        assert_eq!(c.rate_limited(0), Some(0.8));
        assert_eq!(
            c.rate_limited(9 * SEC),
            None,
            "the same news within a window"
        );
        assert_eq!(c.rate_limited(10 * SEC), Some(0.8 * 0.8));
        // No rise within a window of the last 429, whatever the reports say.
        assert_eq!(c.observe(1_000, 1_000, 1_000, 15 * SEC).share, None);
        assert!(c.observe(1_000, 1_000, 1_000, 25 * SEC).share.is_some());
        for t in 3..100 {
            c.rate_limited(t * 10 * SEC);
        }
        assert_eq!(c.share(), 0.2);
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
