//! Quota configuration: which dimensions are limited, by how much, over which period.

mod adaptive;
pub(crate) mod cap;
pub(crate) mod snapshot;

pub use adaptive::AdaptiveShare;
pub use cap::{CapWindow, PeriodCap, WallClock};
pub use snapshot::LimitSnapshot;

use std::fmt;
use std::num::{NonZeroU64, NonZeroUsize};
use std::time::Duration;

/// A quantity a provider limits.
///
/// A [`Cost`](crate::Cost) has an amount in every dimension; a [`Limit`] caps one dimension over
/// one period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Dimension {
    /// Requests (RPM, RPD).
    Requests,
    /// Input (prompt) tokens (ITPM).
    InputTokens,
    /// Output (generated) tokens (OTPM).
    OutputTokens,
    /// Input plus output tokens (TPM).
    TotalTokens,
    /// Money, in nano-dollars (10⁻⁹ USD): a request's tokens at its model's prices (see
    /// [`pricing`](crate::pricing)).
    Spend,
}

impl Dimension {
    /// Every dimension, in a fixed order.
    pub const ALL: [Dimension; 5] = [
        Dimension::Requests,
        Dimension::InputTokens,
        Dimension::OutputTokens,
        Dimension::TotalTokens,
        Dimension::Spend,
    ];

    /// A short lowercase name, stable enough for logs and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Dimension::Requests => "requests",
            Dimension::InputTokens => "input_tokens",
            Dimension::OutputTokens => "output_tokens",
            Dimension::TotalTokens => "total_tokens",
            Dimension::Spend => "spend",
        }
    }
}

impl fmt::Display for Dimension {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dimension::Requests => "requests",
            Dimension::InputTokens => "input tokens",
            Dimension::OutputTokens => "output tokens",
            Dimension::TotalTokens => "total tokens",
            Dimension::Spend => "nano-dollars of spend",
        })
    }
}

/// One limit: at most `amount` of a [`Dimension`] per `period`, as a token bucket.
///
/// The bucket refills continuously at `amount × share` per `period` and holds at most its
/// *burst capacity*. The share is adaptive by default ([`AdaptiveShare`]): the whole quota
/// while the provider's rate-limit headers show nobody else spending it, lowered when they do
/// or a 429 arrives; [`Limit::with_headroom`] fixes it instead. Build one with
/// [`Limit::per_minute`] and friends, or [`Limit::new`] for any period (tests and demos run a
/// "minute" in seconds).
///
/// # Example
///
/// ```
/// use std::num::NonZeroU64;
/// use tower_llm_quota::{Dimension, Limit};
///
/// let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap());
/// assert_eq!(tpm.effective_amount(), 30_000); // the whole quota, adaptive
/// assert_eq!(tpm.capacity(), 5_000); // a sixth of it at once
/// let fixed = tpm.with_headroom(0.85)?;
/// assert_eq!((fixed.effective_amount(), fixed.capacity()), (25_500, 4_250));
///
/// let rpm = Limit::per_minute(Dimension::Requests, NonZeroU64::new(500).unwrap())
///     .with_headroom(1.0)?
///     .with_burst(NonZeroU64::new(50).unwrap());
/// assert_eq!((rpm.effective_amount(), rpm.capacity()), (500, 50));
/// # Ok::<(), tower_llm_quota::InvalidLimit>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limit {
    dimension: Dimension,
    amount: NonZeroU64,
    period: Duration,
    /// The share planned now: fixed, or the adaptive controller's starting point.
    headroom: f64,
    /// The controller's parameters, unless the share is fixed.
    adaptive: Option<AdaptiveShare>,
    burst: Burst,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Burst {
    /// Not set: [`Limit::DEFAULT_BURST_FRACTION`] for an account's limit, the whole amount for a
    /// tenant node's (see [`Limit::for_node`]).
    Default,
    Fraction(f64),
    Exact(NonZeroU64),
}

impl Limit {
    /// The fixed share of a nominal limit the articles recommend: 85 %, for
    /// [`Limit::with_headroom`].
    ///
    /// Provider accounting and ours never match exactly (tokenizers differ, other clients share the
    /// key), so calibrating below the nominal limit turns most would-be 429s into short local waits.
    /// A [`Limit`] no longer uses it by default: it plans with an [`AdaptiveShare`], the whole quota
    /// while the provider's headers show nobody else spending it.
    pub const DEFAULT_HEADROOM: f64 = 0.85;

    /// The burst a [`Limit`] accepts at once by default: a sixth of its (headroom-adjusted) amount,
    /// i.e. 10 seconds' worth of a per-minute limit.
    ///
    /// Providers enforce their per-minute limits over shorter windows too (Azure counts RPM over
    /// 10-second windows), so a minute's quota must not be spent in its first second. A provider
    /// counting with a token bucket (OpenAI, Anthropic) holds the whole minute's amount: a budget
    /// whose burst is a sixth of it and whose refill is at most the provider's rate keeps five
    /// sixths of the provider's bucket in reserve, so it never meets a 429 while it is alone on the
    /// key. Against a provider counting over a sliding window of the full period, a fixed
    /// [`Limit::DEFAULT_HEADROOM`] keeps a burst plus a period of refill below the nominal limit
    /// (`0.85 × (1 + 1/6) ≈ 0.99`).
    pub const DEFAULT_BURST_FRACTION: f64 = 1.0 / 6.0;

    /// At most `amount` of `dimension` per `period`.
    ///
    /// Fails when `period` is zero.
    pub const fn new(
        dimension: Dimension,
        amount: NonZeroU64,
        period: Duration,
    ) -> Result<Self, InvalidLimit> {
        if period.is_zero() {
            return Err(InvalidLimit("the period of a limit must not be zero"));
        }
        Ok(Self::with_period(
            dimension,
            amount,
            crate::timer::capped(period),
        ))
    }

    const fn with_period(dimension: Dimension, amount: NonZeroU64, period: Duration) -> Self {
        Self {
            dimension,
            amount,
            period,
            headroom: 1.0,
            adaptive: Some(AdaptiveShare::new()),
            burst: Burst::Default,
        }
    }

    /// At most `amount` of `dimension` per second.
    pub const fn per_second(dimension: Dimension, amount: NonZeroU64) -> Self {
        Self::with_period(dimension, amount, Duration::from_secs(1))
    }

    /// At most `amount` of `dimension` per minute (RPM, TPM).
    pub const fn per_minute(dimension: Dimension, amount: NonZeroU64) -> Self {
        Self::with_period(dimension, amount, Duration::from_secs(60))
    }

    /// At most `amount` of `dimension` per day (RPD, TPD).
    pub const fn per_day(dimension: Dimension, amount: NonZeroU64) -> Self {
        Self::with_period(dimension, amount, Duration::from_secs(86_400))
    }

    /// Uses a fixed `headroom` (in `(0, 1]`) of the nominal amount, for example
    /// [`Limit::DEFAULT_HEADROOM`], instead of the adaptive share. Defaults to an adaptive share.
    pub fn with_headroom(self, headroom: f64) -> Result<Self, InvalidLimit> {
        if !(headroom > 0.0 && headroom <= 1.0) {
            return Err(InvalidLimit("headroom must be in (0, 1]"));
        }
        Ok(Self {
            headroom,
            adaptive: None,
            ..self
        })
    }

    /// Plans the share of the nominal amount with an adaptive controller of these parameters,
    /// starting from the whole quota. The default, with [`AdaptiveShare::new`].
    pub const fn with_adaptive_share(self, share: AdaptiveShare) -> Self {
        Self {
            headroom: 1.0,
            adaptive: Some(share),
            ..self
        }
    }

    /// The adaptive share's parameters; `None` when the share is fixed.
    pub const fn adaptive_share(&self) -> Option<AdaptiveShare> {
        self.adaptive
    }

    /// The same limit planning `share` of its amount now (the controller's step).
    pub(crate) fn with_planned_share(self, share: f64) -> Self {
        Self {
            headroom: share.clamp(f64::MIN_POSITIVE, 1.0),
            ..self
        }
    }

    /// Accepts at most `burst` at once. Defaults to [`Limit::DEFAULT_BURST_FRACTION`] of the effective
    /// amount.
    ///
    /// The burst is also the largest single cost this limit can ever admit.
    pub const fn with_burst(self, burst: NonZeroU64) -> Self {
        Self {
            burst: Burst::Exact(burst),
            ..self
        }
    }

    /// Accepts at most `fraction` (in `(0, 1]`) of the effective amount at once. Defaults to
    /// [`Limit::DEFAULT_BURST_FRACTION`].
    pub fn with_burst_fraction(self, fraction: f64) -> Result<Self, InvalidLimit> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(InvalidLimit("burst fraction must be in (0, 1]"));
        }
        Ok(Self {
            burst: Burst::Fraction(fraction),
            ..self
        })
    }

    /// The same limit with a new nominal amount, keeping period, headroom and burst rule.
    pub const fn with_amount(self, amount: NonZeroU64) -> Self {
        Self { amount, ..self }
    }

    /// The limited dimension.
    pub const fn dimension(&self) -> Dimension {
        self.dimension
    }

    /// The nominal amount per period, as the provider states it.
    pub const fn amount(&self) -> NonZeroU64 {
        self.amount
    }

    /// The period over which `amount` applies.
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// The share of the nominal amount planned: fixed, or where the adaptive controller
    /// stands now (in a budget's snapshot).
    pub const fn headroom(&self) -> f64 {
        self.headroom
    }

    /// The amount per period the bucket refills: `amount × share`, rounded down, at least 1.
    pub fn effective_amount(&self) -> u64 {
        scale(self.amount.get(), self.headroom, f64::floor)
    }

    /// The most the bucket holds, and so the largest cost it can admit at once: a fraction of
    /// the effective amount for a fixed share, of the nominal amount for an adaptive one (the
    /// share it plans paces the refill; a request that fits the limit keeps fitting however
    /// low the share goes).
    pub fn capacity(&self) -> u64 {
        let fraction = match self.burst {
            Burst::Exact(burst) => return burst.get(),
            Burst::Default => Self::DEFAULT_BURST_FRACTION,
            Burst::Fraction(fraction) => fraction,
        };
        let base = match self.adaptive {
            Some(_) => self.amount.get(),
            None => self.effective_amount(),
        };
        scale(base, fraction, f64::ceil)
    }

    /// The limit as a tenant node's bucket plans it: a fixed share (an operator's limit does
    /// not adapt), and, unless a burst was set, the whole amount at once: "20 a minute" for a
    /// tenant admits 20 requests sent together, while the account keeps the burst that
    /// protects the provider.
    pub(crate) fn for_node(self) -> Self {
        let burst = match self.burst {
            Burst::Default => Burst::Fraction(1.0),
            set => set,
        };
        Self {
            adaptive: None,
            burst,
            ..self
        }
    }
}

/// `amount × factor`, rounded by `round`, clamped to `[1, amount]`.
fn scale(amount: u64, factor: f64, round: fn(f64) -> f64) -> u64 {
    // The float product is exact enough: limits are far below 2^53.
    let scaled = round(amount as f64 * factor) as u64;
    scaled.clamp(1, amount)
}

/// The set of [`Limit`]s a [`Budget`](crate::Budget) enforces together.
///
/// A dimension may carry several limits over different periods (requests per minute *and* per
/// day); a request must fit all of them. Adding a limit for a (dimension, period) pair that is
/// already present replaces it. A quota with no limits admits everything.
///
/// # Example
///
/// ```
/// use std::num::NonZeroU64;
/// use tower_llm_quota::{Dimension, Limit, Quota};
///
/// let nz = |n| NonZeroU64::new(n).unwrap();
/// let quota = Quota::new()
///     .with_limit(Limit::per_minute(Dimension::Requests, nz(500)))
///     .with_limit(Limit::per_minute(Dimension::TotalTokens, nz(30_000)))
///     .with_limit(Limit::per_day(Dimension::Requests, nz(10_000)));
/// assert_eq!(quota.limits().len(), 3);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Quota {
    limits: Vec<Limit>,
    max_in_flight: Option<NonZeroUsize>,
    caps: Vec<PeriodCap>,
    name: Option<std::sync::Arc<str>>,
}

impl Quota {
    /// A quota with no limits.
    pub const fn new() -> Self {
        Self {
            limits: Vec::new(),
            max_in_flight: None,
            caps: Vec::new(),
            name: None,
        }
    }

    /// Names the quota (the provider account, say): the `queue` label of the
    /// `llm_queue_depth` gauge of the budget's ordering, so that budgets and queues of one
    /// process do not overwrite each other's depth. Defaults to none: a [`QuotaStack`](crate::QuotaStack)
    /// names it after its profile, a Redis budget after its quota key, else `default`.
    pub fn with_name(self, name: impl Into<std::sync::Arc<str>>) -> Self {
        Self {
            name: Some(name.into()),
            ..self
        }
    }

    /// The quota's name, if set.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Caps the calls in flight at `max`: a limit that does not refill with time. A budget
    /// admits a request's slot together with its tokens, from the head of its ordering, and
    /// takes the slot back when the reservation ends (with
    /// [`ReconcileLayer`](crate::ReconcileLayer), when the response body ends). For a budget
    /// shared through Redis, the cap counts this process's calls. Defaults to no cap.
    pub fn with_max_in_flight(self, max: NonZeroUsize) -> Self {
        Self {
            max_in_flight: Some(max),
            ..self
        }
    }

    /// The cap on calls in flight, if any.
    pub const fn max_in_flight(&self) -> Option<NonZeroUsize> {
        self.max_in_flight
    }

    /// Adds `limit`, replacing any limit of the same dimension and period.
    pub fn with_limit(mut self, limit: Limit) -> Self {
        match self.limits.iter_mut().find(|l| l.same_bucket(&limit)) {
            Some(existing) => *existing = limit,
            None => self.limits.push(limit),
        }
        self
    }

    /// The limits, in the order they were added.
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// Adds a cap over a calendar period on the whole account (a monthly spend cap, a daily
    /// token cap), replacing any of the same dimension and window. Unlike a [`Limit`], a cap
    /// does not refill as time passes: a request that would take the period's use above it
    /// is refused at once ([`TenantRefused`](crate::tenant::TenantRefused), naming the account
    /// and when the period starts again), and the next period admits anew. Every request of
    /// the budget counts, whatever its tenant; with Redis, the count is kept in the store for
    /// every process (each admission asks the store, as for a tenant with a cap). The same
    /// caps exist on tenant nodes ([`TenantNode::with_cap`](crate::tenant::TenantNode::with_cap)).
    /// Defaults to none.
    ///
    /// # Example
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use tower_llm_quota::error::TryReserveError;
    /// use tower_llm_quota::tenant::{CapWindow, PeriodCap};
    /// use tower_llm_quota::{Budget, Cost, Dimension, Quota};
    ///
    /// // $500 a calendar month (UTC), in nano-dollars.
    /// let month = PeriodCap::new(
    ///     Dimension::Spend,
    ///     NonZeroU64::new(500_000_000_000).unwrap(),
    ///     CapWindow::CalendarMonthUtc,
    /// );
    /// let budget = Budget::new(Quota::new().with_name("openai").with_cap(month));
    /// let held = budget.try_reserve(Cost::requests_only(1).with_spend(400_000_000_000))?;
    /// // Another $200 would take the month above its cap: refused at once, naming the account.
    /// let Err(TryReserveError::Tenant(refusal)) =
    ///     budget.try_reserve(Cost::requests_only(1).with_spend(200_000_000_000))
    /// else {
    ///     panic!("admitted above the cap");
    /// };
    /// assert_eq!(refusal.account(), Some("openai"));
    /// assert!(refusal.is_capped());
    /// # drop(held);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_cap(mut self, cap: PeriodCap) -> Self {
        self.caps
            .retain(|c| (c.dimension, c.window) != (cap.dimension, cap.window));
        self.caps.push(cap);
        self
    }

    /// The caps over a period on the whole account, in the order they were added.
    pub fn caps(&self) -> &[PeriodCap] {
        &self.caps
    }
}

impl Limit {
    pub(crate) fn same_bucket(&self, other: &Limit) -> bool {
        self.dimension == other.dimension && self.period == other.period
    }
}

/// A limit parameter out of range; the message says which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidLimit(&'static str);

impl fmt::Display for InvalidLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for InvalidLimit {}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: u64) -> NonZeroU64 {
        NonZeroU64::new(n).unwrap()
    }

    #[test]
    fn defaults_plan_the_whole_quota_and_a_sixth() {
        let limit = Limit::per_minute(Dimension::Requests, nz(500));
        assert_eq!((limit.effective_amount(), limit.capacity()), (500, 84));
        assert!(limit.adaptive_share().is_some());
        let limit = limit.with_headroom(Limit::DEFAULT_HEADROOM).unwrap();
        assert_eq!(limit.adaptive_share(), None);
        assert_eq!(limit.effective_amount(), 425);
        assert_eq!(limit.capacity(), 71);
        // Burst plus a period of refill stays within the nominal limit.
        assert!(limit.capacity() + limit.effective_amount() <= limit.amount().get());
    }

    #[test]
    fn tiny_amounts_never_round_to_zero() {
        let limit = Limit::per_day(Dimension::Requests, nz(1));
        assert_eq!((limit.effective_amount(), limit.capacity()), (1, 1));
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        assert!(Limit::new(Dimension::Requests, nz(1), Duration::ZERO).is_err());
        let limit = Limit::per_second(Dimension::Requests, nz(1));
        for bad in [0.0, -0.1, 1.01, f64::NAN, f64::INFINITY] {
            assert!(limit.with_headroom(bad).is_err(), "{bad}");
            assert!(limit.with_burst_fraction(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn same_dimension_and_period_replaces() {
        let quota = Quota::new()
            .with_limit(Limit::per_minute(Dimension::Requests, nz(10)))
            .with_limit(Limit::per_minute(Dimension::Requests, nz(20)))
            .with_limit(Limit::per_day(Dimension::Requests, nz(20)));
        assert_eq!(quota.limits().len(), 2);
        assert_eq!(quota.limits()[0].amount().get(), 20);
    }
}
