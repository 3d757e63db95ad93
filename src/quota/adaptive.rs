//! The parameters of the adaptive share a [`Limit`](crate::Limit) plans with; the controller
//! that applies them lives with the budget's buckets.

/// The parameters of the adaptive share, the default way a [`Limit`](crate::Limit) plans its
/// share of the nominal amount. See [`Limit::with_adaptive_share`](crate::Limit::with_adaptive_share)
/// and, for a fixed share, [`Limit::with_headroom`](crate::Limit::with_headroom).
///
/// | parameter | default | bounds |
/// |---|---|---|
/// | [`min`](Self::min) | 0.2 | `(0, 1]` |
/// | [`decrease`](Self::decrease) | 0.8 | `(0, 1)` |
/// | [`increase`](Self::increase) | 0.5 per period | `(0, 1]` |
/// | [`tolerance`](Self::tolerance) | 0.02 | `[0, 1)` |
/// | [`spend_reported_burst`](Self::spend_reported_burst) | on | on or off |
///
/// Setters clamp out-of-range values into the bounds (NaN takes the default).
///
/// # Example
///
/// ```
/// use std::num::NonZeroU64;
/// use tower_llm_quota::{Dimension, Limit, budget::AdaptiveShare};
///
/// let share = AdaptiveShare::new().min(0.5).decrease(0.7);
/// let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap())
///     .with_adaptive_share(share);
/// assert_eq!(tpm.effective_amount(), 30_000); // the whole quota, until someone else spends it
/// assert_eq!(tpm.adaptive_share(), Some(share));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveShare {
    min: f64,
    decrease: f64,
    increase: f64,
    tolerance: f64,
    reported_burst: bool,
}

const DEFAULT: AdaptiveShare = AdaptiveShare {
    min: 0.2,
    decrease: 0.8,
    increase: 0.5,
    tolerance: 0.02,
    reported_burst: true,
};

fn clamp(value: f64, low: f64, high: f64, default: f64) -> f64 {
    if value.is_nan() {
        default
    } else {
        value.clamp(low, high)
    }
}

impl AdaptiveShare {
    /// The defaults in the table above.
    pub const fn new() -> Self {
        DEFAULT
    }

    /// The smallest share the controller plans for. Defaults to 0.2; clamped to
    /// `[0.01, 1]`.
    pub fn min(self, min: f64) -> Self {
        Self {
            min: clamp(min, 0.01, 1.0, DEFAULT.min),
            ..self
        }
    }

    /// The factor a 429 naming the limit multiplies the share by. Defaults to 0.8; clamped to
    /// `[0.05, 0.99]`.
    pub fn decrease(self, factor: f64) -> Self {
        Self {
            decrease: clamp(factor, 0.05, 0.99, DEFAULT.decrease),
            ..self
        }
    }

    /// The most the share rises per period when the provider's reports show more left than
    /// it plans for (a neighbour spends less, or stopped): from 0.68 back to the whole quota in
    /// 39 seconds of a one-minute limit by default. Defaults to 0.5; clamped to
    /// `[0.001, 1]`.
    pub fn increase(self, per_period: f64) -> Self {
        Self {
            increase: clamp(per_period, 0.001, 1.0, DEFAULT.increase),
            ..self
        }
    }

    /// How far below the expected remaining (as a share of the nominal limit) a provider's
    /// report may be before it counts as someone else's spending: rounding and timing.
    /// Defaults to 0.02; clamped to `[0, 0.5]`. Anthropic rounds its input and output
    /// remaining to the nearest thousand: for a limit below 25,000 tokens, raise the
    /// tolerance to `500 / limit` or more so that rounding is not taken for a neighbour.
    pub fn tolerance(self, share: f64) -> Self {
        Self {
            tolerance: clamp(share, 0.0, 0.5, DEFAULT.tolerance),
            ..self
        }
    }

    /// Whether the budget may spend at once, beyond its own burst, what the provider reports
    /// as remaining. On by default.
    ///
    /// A provider's bucket usually starts full, a whole period of quota, while the budget's
    /// burst is a sixth of it: without this, a short job waits for quota the provider holds.
    /// Once the share's measure of the others' spending is steady (it has run for a sixth of
    /// the period and lowered nothing for as long), the budget may spend the lower of the
    /// provider's `remaining` and what it expects the provider to hold (its own calls still on
    /// their way counted), less a cushion: the [`tolerance`](Self::tolerance), and a sixth of a
    /// period of the others' spending at the rate the share leaves them. Never more. A lowered
    /// share, a 429, a full bucket or a new nominal limit takes the extra back; without
    /// reports the budget keeps to its own burst. The extra never refills.
    pub const fn spend_reported_burst(self, on: bool) -> Self {
        Self {
            reported_burst: on,
            ..self
        }
    }

    /// Whether the budget spends the burst the provider reports.
    pub const fn spends_reported_burst(&self) -> bool {
        self.reported_burst
    }

    /// The smallest share.
    pub const fn min_share(&self) -> f64 {
        self.min
    }

    /// The decrease factor.
    pub const fn decrease_factor(&self) -> f64 {
        self.decrease
    }

    /// The share regained per period.
    pub const fn increase_per_period(&self) -> f64 {
        self.increase
    }

    /// The tolerance, as a share of the nominal limit.
    pub const fn tolerance_share(&self) -> f64 {
        self.tolerance
    }
}

impl Default for AdaptiveShare {
    fn default() -> Self {
        Self::new()
    }
}
