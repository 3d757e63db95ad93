//! How long and how often to retry: per-class limits, full-jitter backoff, the provider's wait.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::Duration;

use crate::priority::Priority;

/// How a [`RetryAfterLayer`](crate::RetryAfterLayer) retries.
///
/// # Defaults
///
/// | class | attempts (first included) | total time |
/// |---|---|---|
/// | interactive | 3 | 8 s |
/// | async | 5 | 60 s |
/// | batch | 8 | 300 s |
///
/// A service tier without capacity ([`TierUnavailable`]): interactive work gets the answer at
/// once; async and batch work try again later, bounded by their total time only.
///
/// Backoff without a provider hint: full jitter, `uniform(0, min(20 s, 0.5 s × 2^retry))`. A
/// provider wait above 60 s is not honoured: the failure is permanent. Retries are bounded to
/// 10 % of recent requests plus 1 per second (the SRE book's share; Finagle uses 20 %).
///
/// The total time counts from the first attempt's sending. A rate-limited (429) async or
/// batch request is bounded by its total time and deadline only: neither the attempt count nor
/// the retry budget drops it (see the [module documentation](crate::retry)).
///
/// # Example
///
/// ```
/// use std::{num::NonZeroU32, time::Duration};
/// use tower_llm_quota::{Priority, RetryPolicy};
///
/// let policy = RetryPolicy::new()
///     .max_attempts(Priority::Interactive, NonZeroU32::new(2).unwrap())
///     .max_total(Priority::Batch, Duration::from_secs(900))
///     .backoff(Duration::from_millis(250), Duration::from_secs(30))?;
/// # Ok::<(), tower_llm_quota::retry::InvalidRetryPolicy>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    classes: [ClassRetry; 3],
    base: Duration,
    cap: Duration,
    max_honored_delay: Duration,
    budget_percent: f32,
    budget_min_per_sec: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ClassRetry {
    max_attempts: NonZeroU32,
    max_total: Duration,
    tier_unavailable: TierUnavailable,
}

const fn class(attempts: u32, total_secs: u64, tier_unavailable: TierUnavailable) -> ClassRetry {
    ClassRetry {
        max_attempts: match NonZeroU32::new(attempts) {
            Some(n) => n,
            None => NonZeroU32::MIN,
        },
        max_total: Duration::from_secs(total_secs),
        tier_unavailable,
    }
}

/// What a class does when the provider has no capacity for the request's service tier
/// ([`Transient::TierUnavailable`](crate::retry::Transient::TierUnavailable): OpenAI flex's 429
/// "Resource Unavailable", not billed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TierUnavailable {
    /// Tries again later, with backoff (the provider's wait when it gives one), within the
    /// class's total time and the request's deadline, whatever its attempt count: for work
    /// that can wait for the cheap tier.
    Retry,
    /// Hands the answer back at once (a [`Router`](crate::routing::Router) fallback with
    /// [`Condition::TierUnavailable`](crate::routing::Condition::TierUnavailable) may then
    /// send it at another tier): for work that cannot wait.
    GiveUp,
}

impl RetryPolicy {
    /// The defaults above.
    pub const fn new() -> Self {
        Self {
            classes: [
                class(3, 8, TierUnavailable::GiveUp),
                class(5, 60, TierUnavailable::Retry),
                class(8, 300, TierUnavailable::Retry),
            ],
            base: Duration::from_millis(500),
            cap: Duration::from_secs(20),
            max_honored_delay: Duration::from_secs(60),
            budget_percent: 0.1,
            budget_min_per_sec: 1,
        }
    }

    /// At most `attempts` attempts (the first included) for a request of `priority`. Defaults
    /// to 3, 5 and 8 for interactive, async and batch. Rate-limited async and batch requests
    /// are not bounded by it.
    pub const fn max_attempts(mut self, priority: Priority, attempts: NonZeroU32) -> Self {
        self.classes[priority.index()].max_attempts = attempts;
        self
    }

    /// At most `total` from the sending of the first attempt to the start of the last, for a
    /// request of `priority`: a wait that would cross it is not started. Defaults to 8 s, 60 s
    /// and 300 s.
    pub const fn max_total(mut self, priority: Priority, total: Duration) -> Self {
        self.classes[priority.index()].max_total = crate::timer::capped(total);
        self
    }

    /// What requests of `priority` do when their service tier has no capacity. Defaults to
    /// [`TierUnavailable::GiveUp`] for interactive work (fail fast, or fall back to another
    /// tier through a router) and [`TierUnavailable::Retry`] for async and batch work.
    pub const fn on_tier_unavailable(mut self, priority: Priority, then: TierUnavailable) -> Self {
        self.classes[priority.index()].tier_unavailable = then;
        self
    }

    /// Backoff without a provider hint: `uniform(0, min(cap, base × 2^retry))`. Defaults to
    /// 0.5 s and 20 s. Fails when `base` is zero or above `cap`.
    pub fn backoff(self, base: Duration, cap: Duration) -> Result<Self, InvalidRetryPolicy> {
        if base.is_zero() {
            return Err(InvalidRetryPolicy("the backoff base must not be zero"));
        }
        if base > cap {
            return Err(InvalidRetryPolicy(
                "the backoff base must not exceed its cap",
            ));
        }
        let (base, cap) = (crate::timer::capped(base), crate::timer::capped(cap));
        Ok(Self { base, cap, ..self })
    }

    /// A provider wait above `max` is not honoured: the failure becomes permanent
    /// ([`Permanent::WaitTooLong`](crate::retry::Permanent::WaitTooLong)). Azure's "retry after
    /// 86400 seconds" is a daily quota, not a pause. It also caps the pause a 429 puts on the
    /// shared budget ([`RetryAfterLayer::pause_on_rate_limit`](crate::RetryAfterLayer::pause_on_rate_limit)).
    /// Defaults to 60 s.
    pub const fn max_honored_delay(self, max: Duration) -> Self {
        Self {
            max_honored_delay: crate::timer::capped(max),
            ..self
        }
    }

    /// Retries may be at most `percent` (in `[0, 1]`) of the requests of the last ten
    /// seconds, plus `min_per_sec` per second, so a failing provider is not hammered.
    /// Defaults to 10 % and 1 per second. Fails when `percent` is outside `[0, 1]` (or NaN).
    pub fn retry_budget(self, percent: f32, min_per_sec: u32) -> Result<Self, InvalidRetryPolicy> {
        if !(0.0..=1.0).contains(&percent) {
            return Err(InvalidRetryPolicy(
                "the retry budget's percent must be in [0, 1]",
            ));
        }
        Ok(Self {
            budget_percent: percent,
            budget_min_per_sec: min_per_sec,
            ..self
        })
    }

    pub(crate) fn attempts(&self, priority: Priority) -> u32 {
        self.classes[priority.index()].max_attempts.get()
    }

    pub(crate) fn tier_unavailable(&self, priority: Priority) -> TierUnavailable {
        self.classes[priority.index()].tier_unavailable
    }

    pub(crate) fn total(&self, priority: Priority) -> Duration {
        self.classes[priority.index()].max_total
    }

    pub(crate) fn honors(&self, wait: Duration) -> bool {
        wait <= self.max_honored_delay
    }

    pub(crate) fn max_honored(&self) -> Duration {
        self.max_honored_delay
    }

    pub(crate) fn budget(&self) -> tower::retry::budget::TpsBudget {
        tower::retry::budget::TpsBudget::new(
            Duration::from_secs(10),
            self.budget_min_per_sec,
            self.budget_percent,
        )
    }

    /// The wait before retry number `retry` (0 for the first retry), given the provider's
    /// `hint` and a random `fraction` in `[0, 1)`.
    ///
    /// Without a hint: full jitter, `fraction × window` with `window = min(cap, base × 2^retry)`.
    /// With one: never earlier than the hint, and spread over twice the larger of the hint and
    /// the window (at most `cap`): clients told the same instant come back over a span, not in
    /// the same millisecond, so a herd of 1,000 puts fewer than 5 % of its retries in any 100 ms.
    pub(crate) fn wait(&self, retry: u32, hint: Option<Duration>, fraction: f64) -> Duration {
        let window = self
            .base
            .checked_mul(1 << retry.min(30))
            .map_or(self.cap, |w| w.min(self.cap));
        let fraction = if fraction.is_finite() {
            fraction.clamp(0.0, 1.0)
        } else {
            0.0
        };
        match hint {
            None => window.mul_f64(fraction),
            Some(hint) => {
                let spread = hint.max(window).saturating_mul(2).min(self.cap);
                hint.saturating_add(spread.mul_f64(fraction))
            }
        }
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::new()
    }
}

/// A retry policy parameter out of range (backoff, retry budget); the message says which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidRetryPolicy(&'static str);

impl fmt::Display for InvalidRetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for InvalidRetryPolicy {}

/// The source of randomness for jitter: uniform fractions in `[0, 1)`. Injectable so that tests
/// are deterministic.
pub trait Jitter: Send + Sync + 'static {
    /// A uniform fraction in `[0, 1)`.
    fn fraction(&self) -> f64;
}

/// The default [`Jitter`]: a fast thread-local generator seeded from the system.
#[derive(Debug, Clone, Copy, Default)]
pub struct ThreadJitter;

impl Jitter for ThreadJitter {
    fn fraction(&self) -> f64 {
        fastrand::f64()
    }
}

/// A seeded [`Jitter`], for reproducible tests and simulations.
#[derive(Debug)]
pub struct SeededJitter(Mutex<fastrand::Rng>);

impl SeededJitter {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(Mutex::new(fastrand::Rng::with_seed(seed)))
    }
}

impl Jitter for SeededJitter {
    fn fraction(&self) -> f64 {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    #[test]
    fn full_jitter_without_a_hint() {
        let policy = RetryPolicy::new();
        assert_eq!(policy.wait(0, None, 0.0), Duration::ZERO);
        assert_eq!(policy.wait(0, None, 0.5), SEC / 4);
        assert_eq!(policy.wait(3, None, 0.5), 2 * SEC);
        // Capped at 20 s, however many retries.
        assert_eq!(policy.wait(40, None, 0.5), 10 * SEC);
        assert_eq!(policy.wait(2, None, f64::NAN), Duration::ZERO);
    }

    #[test]
    fn never_earlier_than_the_hint_and_spread_after_it() {
        let policy = RetryPolicy::new();
        assert_eq!(policy.wait(0, Some(2 * SEC), 0.0), 2 * SEC);
        assert_eq!(policy.wait(0, Some(2 * SEC), 0.5), 4 * SEC);
        assert_eq!(policy.wait(0, Some(30 * SEC), 1.0), 50 * SEC);
    }

    #[test]
    fn invalid_backoff_is_refused() {
        assert!(RetryPolicy::new().backoff(Duration::ZERO, SEC).is_err());
        assert!(RetryPolicy::new().backoff(2 * SEC, SEC).is_err());
    }

    #[test]
    fn seeded_jitter_repeats() {
        let (a, b) = (SeededJitter::new(7), SeededJitter::new(7));
        for _ in 0..10 {
            assert_eq!(a.fraction(), b.fraction());
        }
    }
}

/// At most this many attempts for one request, the first included, whatever its class and its
/// failures (a 429 of async or batch work too): a request extension read by
/// [`RetryAfterLayer`](crate::RetryAfterLayer), below the policy's own limits.
/// `MaxAttempts(NonZeroU32::MIN)` sends once and hands every failure back, for a caller that
/// retries itself (an SDK behind a gateway, say).
///
/// ```
/// use std::num::NonZeroU32;
/// use tower_llm_quota::retry::MaxAttempts;
///
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(MaxAttempts(NonZeroU32::MIN));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxAttempts(pub NonZeroU32);
