use std::fmt;
use std::sync::Arc;

use tower::Layer;

use super::settings::Settings;
use super::{Classify, Jitter, ProviderErrors, RetryAfter, RetryPolicy, ThreadJitter};
use crate::budget::Budget;

/// Applies [`RetryAfter`] to services; see the [module documentation](crate::retry).
///
/// Every service this layer builds shares one retry budget.
pub struct RetryAfterLayer<C = ProviderErrors> {
    settings: Settings<C>,
}

impl RetryAfterLayer {
    /// A layer retrying by `policy`, classifying failures with [`ProviderErrors`].
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            settings: Settings {
                budget: Arc::new(policy.budget()),
                policy,
                classify: ProviderErrors,
                pause: None,
                jitter: Arc::new(ThreadJitter),
            },
        }
    }
}

impl Default for RetryAfterLayer {
    fn default() -> Self {
        Self::new(RetryPolicy::default())
    }
}

impl<C> RetryAfterLayer<C> {
    /// Classifies failures with `classify`. Defaults to [`ProviderErrors`].
    pub fn classify<D: Classify>(self, classify: D) -> RetryAfterLayer<D> {
        let Settings {
            policy,
            budget,
            pause,
            jitter,
            ..
        } = self.settings;
        RetryAfterLayer {
            settings: Settings {
                policy,
                classify,
                budget,
                pause,
                jitter,
            },
        }
    }

    /// On a provider 429, pauses the dimensions it names in `budget` (all of them when it names
    /// none) until the provider's wait, or without one until the request's cost fits by the
    /// provider's reported remaining and rate (never until its bucket is full), capped by
    /// [`RetryPolicy::max_honored_delay`], so that no request of that budget is sent meanwhile,
    /// not only the one that got the 429. Overloaded answers (529, 503) pause nothing. Defaults
    /// to no budget.
    pub fn pause_on_rate_limit(mut self, budget: Budget) -> Self {
        self.settings.pause = Some(budget);
        self
    }

    /// Draws jitter from `jitter`. Defaults to [`ThreadJitter`].
    pub fn jitter(mut self, jitter: impl Jitter) -> Self {
        self.settings.jitter = Arc::new(jitter);
        self
    }
}

impl<C: Clone> Clone for RetryAfterLayer<C> {
    fn clone(&self) -> Self {
        Self {
            settings: self.settings.clone(),
        }
    }
}

impl<C> fmt::Debug for RetryAfterLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryAfterLayer")
            .field("policy", &self.settings.policy)
            .field("pause", &self.settings.pause.is_some())
            .finish_non_exhaustive()
    }
}

impl<S, C: Clone> Layer<S> for RetryAfterLayer<C> {
    type Service = RetryAfter<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryAfter::new(inner, Arc::new(self.settings.clone()))
    }
}
