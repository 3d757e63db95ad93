//! The ramp controller: a route's share of traffic, grown on a schedule, paused or stepped
//! back while the route is unhealthy.
//!
//! Pure: [`RampState`] is fed outcomes and instants, and does no I/O; the router plumbs.

use crate::tenant::Tenant;
use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

/// A ramp's schedule and health thresholds; see the [module documentation](super).
///
/// A ramp caps either a share of the requests it applies to ([`Ramp::new`], in percent) or
/// the rate of requests its route is sent ([`Ramp::admitted_rate`], per minute).
#[derive(Debug, Clone, PartialEq)]
pub struct Ramp {
    cap: Cap,
    start: f64,
    growth_per_minute: f64,
    ceiling: f64,
    evaluation: Duration,
    max_rate_limited: f64,
    max_queue_depth: Option<usize>,
    max_p95: Option<Duration>,
    step_back: f64,
    tenant: Option<Tenant>,
}

/// A ramp rejected by [`Ramp::new`]: its reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidRamp(&'static str);

impl fmt::Display for InvalidRamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid ramp: {}", self.0)
    }
}

impl std::error::Error for InvalidRamp {}

/// What a ramp's value caps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cap {
    /// A percentage of the requests.
    Share,
    /// Requests per minute.
    Rate,
}

fn percent(value: f64) -> bool {
    value.is_finite() && (0.0..=100.0).contains(&value)
}

impl Ramp {
    /// A ramp starting at `start` percent, growing `growth_per_minute` points a minute while
    /// healthy, up to `ceiling` percent. Evaluated every 30 s; pauses when more than 5 % of
    /// the route's answers in a period were 429s.
    ///
    /// Fails when a share is not within 0 to 100, the start is above the ceiling, or the
    /// growth is negative or not finite.
    pub fn new(start: f64, growth_per_minute: f64, ceiling: f64) -> Result<Self, InvalidRamp> {
        if !percent(start) || !percent(ceiling) {
            return Err(InvalidRamp("shares are percentages, from 0 to 100"));
        }
        if start > ceiling {
            return Err(InvalidRamp("the start is above the ceiling"));
        }
        Self::with_cap(Cap::Share, start, growth_per_minute, ceiling)
    }

    /// A ramp capping the requests sent to its route at `start` a minute (spaced evenly:
    /// one every minute / rate), growing by `growth_per_minute` requests a minute each minute
    /// while healthy, up to `ceiling` a minute. The requests above the cap stay on the
    /// primary. Evaluated like [`Ramp::new`].
    ///
    /// Fails when a rate is negative or not finite, the start is above the ceiling, or the
    /// growth is negative or not finite.
    pub fn admitted_rate(
        start: f64,
        growth_per_minute: f64,
        ceiling: f64,
    ) -> Result<Self, InvalidRamp> {
        let rate = |v: f64| v.is_finite() && v >= 0.0;
        if !rate(start) || !rate(ceiling) {
            return Err(InvalidRamp("rates are finite and not negative"));
        }
        if start > ceiling {
            return Err(InvalidRamp("the start is above the ceiling"));
        }
        Self::with_cap(Cap::Rate, start, growth_per_minute, ceiling)
    }

    fn with_cap(
        cap: Cap,
        start: f64,
        growth_per_minute: f64,
        ceiling: f64,
    ) -> Result<Self, InvalidRamp> {
        if !growth_per_minute.is_finite() || growth_per_minute < 0.0 {
            return Err(InvalidRamp("the growth must be finite and not negative"));
        }
        Ok(Self {
            cap,
            start,
            growth_per_minute,
            ceiling,
            evaluation: Duration::from_secs(30),
            max_rate_limited: 0.05,
            max_queue_depth: None,
            max_p95: None,
            step_back: 0.0,
            tenant: None,
        })
    }

    /// Evaluates health, and grows, every `period` (at least 1 ms). Defaults to 30 s.
    pub fn evaluate_every(self, period: Duration) -> Self {
        Self {
            evaluation: crate::timer::capped(period).max(Duration::from_millis(1)),
            ..self
        }
    }

    /// Pauses when more than `share` (0 to 1) of the route's answers in a period were 429s
    /// (final, or retried by the route's retry layer). Defaults to 0.05.
    pub fn max_rate_limited(self, share: f64) -> Self {
        let share = if share.is_finite() {
            share.clamp(0.0, 1.0)
        } else {
            0.05
        };
        Self {
            max_rate_limited: share,
            ..self
        }
    }

    /// Pauses when more than `depth` requests wait in the route's budget at an evaluation.
    /// Defaults to no threshold.
    pub fn max_queue_depth(self, depth: usize) -> Self {
        Self {
            max_queue_depth: Some(depth),
            ..self
        }
    }

    /// Pauses when the p95 of the route's latency (to the response head) in a period is above
    /// `latency`. Defaults to no threshold.
    pub fn max_p95(self, latency: Duration) -> Self {
        Self {
            max_p95: Some(crate::timer::capped(latency)),
            ..self
        }
    }

    /// On an unhealthy period, steps the share (or the rate) back by `points` (never below 0)
    /// instead of only pausing its growth. Defaults to 0: pause only.
    pub fn step_back(self, points: f64) -> Self {
        let points = if points.is_finite() {
            points.clamp(0.0, 100.0)
        } else {
            0.0
        };
        Self {
            step_back: points,
            ..self
        }
    }

    /// Ramps only the requests within `scope` (their [`Tenant`] extension is `scope` or lies
    /// below it: a tenant, a team, a key); the others stay on the old route. Defaults to
    /// every request.
    pub fn for_tenant(self, scope: Tenant) -> Self {
        Self {
            tenant: Some(scope),
            ..self
        }
    }

    pub(crate) fn tenant(&self) -> Option<&Tenant> {
        self.tenant.as_ref()
    }

    /// The evaluation period.
    pub fn evaluation(&self) -> Duration {
        self.evaluation
    }
}

/// Why a ramp does not grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PauseReason {
    /// Too many 429s in the last period.
    RateLimited,
    /// Too many requests waiting in the route's budget.
    QueueDepth,
    /// The p95 latency of the last period is above the threshold.
    Latency,
}

impl PauseReason {
    /// A short lowercase name, stable enough for logs and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::RateLimited => "rate_limited",
            Self::QueueDepth => "queue_depth",
            Self::Latency => "latency",
        }
    }
}

/// A ramp's state, readable at any time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RampStatus {
    /// The share of the requests the ramp applies to that go to its route, in percent; for
    /// a ramp of [`Ramp::admitted_rate`], the requests per minute.
    pub share: f64,
    /// The ceiling, in the same unit.
    pub ceiling: f64,
    /// Why growth is paused, if it is.
    pub paused: Option<PauseReason>,
}

/// How many latencies a period keeps for its p95; past it, one in two is dropped.
const MAX_SAMPLES: usize = 4_096;

/// The controller: the share, and the current period's outcomes.
#[derive(Debug)]
pub(crate) struct RampState {
    config: Ramp,
    share: f64,
    period_start: Instant,
    answers: u64,
    rate_limited: u64,
    latencies: Vec<Duration>,
    paused: Option<PauseReason>,
    /// A rate cap: the earliest instant the next request may go to the route.
    next_at: Instant,
}

impl RampState {
    pub(crate) fn new(config: Ramp, now: Instant) -> Self {
        Self {
            share: config.start,
            config,
            period_start: now,
            answers: 0,
            rate_limited: 0,
            latencies: Vec::new(),
            paused: None,
            next_at: now,
        }
    }

    pub(crate) fn config(&self) -> &Ramp {
        &self.config
    }

    /// One answer of the route: its latency to the head, and whether it met a 429.
    pub(crate) fn record(&mut self, latency: Duration, rate_limited: bool) {
        self.answers += 1;
        self.rate_limited += u64::from(rate_limited);
        if self.latencies.len() >= MAX_SAMPLES {
            let mut keep = false;
            self.latencies.retain(|_| {
                keep = !keep;
                keep
            });
        }
        self.latencies.push(latency);
    }

    /// Evaluates every period that ended by `now`, with `queue_depth` waiting on the route.
    /// Returns whether the state changed.
    pub(crate) fn tick(&mut self, now: Instant, queue_depth: usize) -> bool {
        let period = self.config.evaluation;
        let Some(elapsed) = now.checked_duration_since(self.period_start) else {
            return false;
        };
        let periods = elapsed.as_nanos() / period.as_nanos().max(1);
        if periods == 0 {
            return false;
        }
        // The period with outcomes first; the ones after it saw nothing and are healthy,
        // unless requests still wait on the route.
        let verdict = self.verdict(queue_depth);
        self.apply(verdict, 1);
        let idle = periods - 1;
        if idle > 0 {
            let verdict = self.idle_verdict(queue_depth);
            self.apply(verdict, idle);
        }
        let skipped = u32::try_from(periods).unwrap_or(u32::MAX);
        self.period_start += period.saturating_mul(skipped);
        self.answers = 0;
        self.rate_limited = 0;
        self.latencies.clear();
        true
    }

    fn verdict(&mut self, queue_depth: usize) -> Option<PauseReason> {
        if self.answers > 0
            && self.rate_limited as f64 > self.config.max_rate_limited * self.answers as f64
        {
            return Some(PauseReason::RateLimited);
        }
        if let Some(reason) = self.idle_verdict(queue_depth) {
            return Some(reason);
        }
        if let (Some(max), Some(p95)) = (self.config.max_p95, p95(&mut self.latencies)) {
            if p95 > max {
                return Some(PauseReason::Latency);
            }
        }
        None
    }

    fn idle_verdict(&self, queue_depth: usize) -> Option<PauseReason> {
        match self.config.max_queue_depth {
            Some(max) if queue_depth > max => Some(PauseReason::QueueDepth),
            _ => None,
        }
    }

    fn apply(&mut self, verdict: Option<PauseReason>, periods: u128) {
        let periods = periods.min(1 << 40) as f64;
        self.paused = verdict;
        let step = match verdict {
            Some(_) => -self.config.step_back,
            None => self.config.growth_per_minute * self.config.evaluation.as_secs_f64() / 60.0,
        };
        self.share = (self.share + step * periods).clamp(0.0, self.config.ceiling);
        // Sums of binary fractions drift: a share within a millionth of the ceiling is it.
        if self.config.ceiling - self.share < 1e-6 {
            self.share = self.config.ceiling;
        }
    }

    /// Whether a request at `position` (a percentage, 0 to 100) arriving `now` falls within
    /// the share, or within the rate (which it then spends).
    pub(crate) fn admits(&mut self, position: f64, now: Instant) -> bool {
        match self.config.cap {
            Cap::Share => position < self.share,
            Cap::Rate => {
                if self.share <= 0.0 || now < self.next_at {
                    return false;
                }
                let spacing = Duration::from_secs_f64((60.0 / self.share).min(86_400.0));
                // No credit for idle time: the cap is never a burst.
                self.next_at = now + spacing;
                true
            }
        }
    }

    pub(crate) fn status(&self) -> RampStatus {
        RampStatus {
            share: self.share,
            ceiling: self.config.ceiling,
            paused: self.paused,
        }
    }
}

fn p95(latencies: &mut [Duration]) -> Option<Duration> {
    if latencies.is_empty() {
        return None;
    }
    let rank = (latencies.len() * 95).div_ceil(100).saturating_sub(1);
    let (_, p95, _) = latencies.select_nth_unstable(rank);
    Some(*p95)
}

/// A stable position, 0 to 100, for a request key: one conversation keeps its route while the
/// share does not cross it. FNV-1a, so it is the same in every process and release.
pub(crate) fn position_of(key: &[u8]) -> f64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash % 10_000) as f64 / 100.0
}

/// The position of the `n`-th request without a key: a low-discrepancy sequence, so any
/// prefix of requests is split in the share's proportion.
pub(crate) fn position_of_sequence(n: u64) -> f64 {
    // The fractional part of n times the golden ratio's conjugate.
    let fraction = (n as f64 * 0.618_033_988_749_895).fract();
    fraction * 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(start: Instant, secs: u64) -> Instant {
        start + Duration::from_secs(secs)
    }

    #[test]
    fn invalid_ramps_are_refused() {
        assert!(Ramp::new(5.0, 10.0, 100.0).is_ok());
        assert!(Ramp::new(-1.0, 10.0, 100.0).is_err());
        assert!(Ramp::new(5.0, 10.0, 101.0).is_err());
        assert!(Ramp::new(50.0, 10.0, 40.0).is_err());
        assert!(Ramp::new(5.0, f64::NAN, 100.0).is_err());
        assert!(Ramp::new(5.0, -1.0, 100.0).is_err());
    }

    #[test]
    fn grows_to_the_ceiling_on_schedule() {
        let start = Instant::now();
        let mut ramp = RampState::new(Ramp::new(5.0, 10.0, 100.0).unwrap(), start);
        // 95 points at 10 a minute: 9.5 minutes, 19 periods of 30 s.
        for period in 1..=18 {
            ramp.tick(at(start, 30 * period), 0);
        }
        assert!((ramp.status().share - 95.0).abs() < 1e-9);
        ramp.tick(at(start, 570), 0);
        assert_eq!(ramp.status().share, 100.0);
        ramp.tick(at(start, 3_600), 0);
        assert_eq!(ramp.status().share, 100.0);
    }

    #[test]
    fn idle_periods_grow_at_once() {
        let start = Instant::now();
        let mut ramp = RampState::new(Ramp::new(5.0, 10.0, 100.0).unwrap(), start);
        ramp.tick(at(start, 299), 0);
        assert!((ramp.status().share - 50.0).abs() < 1e-9);
    }

    #[test]
    fn pauses_on_429s_and_latency_and_resumes() {
        let start = Instant::now();
        let config = Ramp::new(10.0, 10.0, 100.0)
            .unwrap()
            .max_p95(Duration::from_secs(2))
            .max_queue_depth(10);
        let mut ramp = RampState::new(config, start);
        for _ in 0..10 {
            ramp.record(Duration::from_millis(100), false);
        }
        ramp.record(Duration::from_millis(100), true);
        ramp.tick(at(start, 30), 0);
        assert_eq!(ramp.status().paused, Some(PauseReason::RateLimited));
        assert_eq!(ramp.status().share, 10.0);
        for _ in 0..20 {
            ramp.record(Duration::from_secs(3), false);
        }
        ramp.tick(at(start, 60), 0);
        assert_eq!(ramp.status().paused, Some(PauseReason::Latency));
        ramp.tick(at(start, 90), 11);
        assert_eq!(ramp.status().paused, Some(PauseReason::QueueDepth));
        assert_eq!(ramp.status().share, 10.0);
        ramp.record(Duration::from_millis(100), false);
        ramp.tick(at(start, 120), 0);
        assert_eq!(ramp.status().paused, None);
        assert_eq!(ramp.status().share, 15.0);
    }

    #[test]
    fn steps_back_when_asked() {
        let start = Instant::now();
        let config = Ramp::new(20.0, 10.0, 100.0).unwrap().step_back(15.0);
        let mut ramp = RampState::new(config, start);
        ramp.record(Duration::ZERO, true);
        ramp.tick(at(start, 30), 0);
        assert_eq!(ramp.status().share, 5.0);
        ramp.record(Duration::ZERO, true);
        ramp.tick(at(start, 60), 0);
        assert_eq!(ramp.status().share, 0.0);
    }

    #[test]
    fn a_rate_cap_spaces_the_requests_and_grows() {
        let start = Instant::now();
        let config = Ramp::admitted_rate(6.0, 6.0, 60.0).unwrap();
        assert!(Ramp::admitted_rate(-1.0, 1.0, 10.0).is_err());
        let mut ramp = RampState::new(config, start);
        // 6 a minute: one every 10 s, whatever the position.
        let admitted = (0..30).filter(|s| ramp.admits(99.0, at(start, *s))).count();
        assert_eq!(admitted, 3);
        ramp.tick(at(start, 60), 0);
        assert_eq!(ramp.status().share, 12.0);
        let admitted = (60..120)
            .filter(|s| ramp.admits(0.0, at(start, *s)))
            .count();
        assert_eq!(admitted, 12);
    }

    #[test]
    fn positions_are_stable_and_spread() {
        assert_eq!(
            position_of(b"conversation-1"),
            position_of(b"conversation-1")
        );
        let within = (0..10_000u64)
            .filter(|n| position_of_sequence(*n) < 25.0)
            .count();
        assert!((2_400..=2_600).contains(&within), "{within}");
        let keyed = (0..10_000u64)
            .filter(|n| position_of(format!("key-{n}").as_bytes()) < 25.0)
            .count();
        assert!((2_300..=2_700).contains(&keyed), "{keyed}");
    }
}
