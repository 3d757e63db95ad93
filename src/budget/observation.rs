//! What a provider reports about a limit, fed back into a budget.

use std::num::NonZeroU64;
use std::time::Duration;

use crate::quota::Dimension;

/// A provider's report on one limit, typically read from rate-limit headers
/// (`x-ratelimit-limit-tokens`, `anthropic-ratelimit-requests-remaining`, ...).
///
/// [`Budget::observe`](crate::Budget::observe) applies it to the limit of the same dimension and
/// period: a different `limit` replaces the nominal amount (keeping the share and burst rule);
/// a `remaining` count lowers the local level to at most `remaining × share`, because a
/// provider that has less left than we think is being spent by someone else. An observation
/// never raises the level (other consumers of the same key are invisible to us), except, for a
/// limit whose adaptive share [spends the reported
/// burst](crate::budget::AdaptiveShare::spend_reported_burst), once the reports have agreed
/// with what the budget expects for a while. A limit with
/// an [`AdaptiveShare`](crate::budget::AdaptiveShare) compares `remaining` with what the provider
/// would hold if this budget were alone on the key, and plans a smaller share when it is
/// lower (see its documentation).
///
/// [`Profile::adapt`](crate::provider::Profile::adapt) builds observations from rate-limit
/// headers, naming the period of the budget's limit each header describes.
///
/// # Example
///
/// ```
/// use std::{num::NonZeroU64, time::Duration};
/// use tower_llm_quota::{Dimension, budget::Observation};
///
/// let seen = Observation::new(Dimension::TotalTokens, Duration::from_secs(60))
///     .with_limit(NonZeroU64::new(150_000).unwrap())
///     .with_remaining(149_984);
/// assert_eq!(seen.remaining(), Some(149_984));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observation {
    dimension: Dimension,
    period: Duration,
    limit: Option<NonZeroU64>,
    remaining: Option<u64>,
    at_once: bool,
}

impl Observation {
    /// A report on the limit of `dimension` per `period`, saying nothing yet.
    pub const fn new(dimension: Dimension, period: Duration) -> Self {
        Self {
            dimension,
            period: crate::timer::capped(period),
            limit: None,
            remaining: None,
            at_once: true,
        }
    }

    /// The provider's nominal limit. Defaults to unknown.
    pub const fn with_limit(self, limit: NonZeroU64) -> Self {
        Self {
            limit: Some(limit),
            ..self
        }
    }

    /// What the provider says is left. Defaults to unknown.
    pub const fn with_remaining(self, remaining: u64) -> Self {
        Self {
            remaining: Some(remaining),
            ..self
        }
    }

    /// Whether what remains may be spent at once: the provider counts the limit with one
    /// bucket of the period (OpenAI, Anthropic). Defaults to true; false for a provider that
    /// also enforces the limit over shorter windows (Azure OpenAI counts requests per minute
    /// over 1 or 10 seconds), so that the budget keeps to its own burst (see
    /// [`AdaptiveShare::spend_reported_burst`](crate::budget::AdaptiveShare::spend_reported_burst)).
    pub const fn spendable_at_once(self, at_once: bool) -> Self {
        Self { at_once, ..self }
    }

    /// Whether what remains may be spent at once.
    pub const fn is_spendable_at_once(&self) -> bool {
        self.at_once
    }

    /// The dimension reported on.
    pub const fn dimension(&self) -> Dimension {
        self.dimension
    }

    /// The period of the limit reported on.
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// The nominal limit, if reported.
    pub const fn limit(&self) -> Option<NonZeroU64> {
        self.limit
    }

    /// What is left, if reported.
    pub const fn remaining(&self) -> Option<u64> {
        self.remaining
    }
}
