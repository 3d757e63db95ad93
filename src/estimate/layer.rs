use std::sync::Arc;

use http::request::Parts;
use tower::Layer;

use super::settings::Settings;
use super::{CharEstimator, Defaults, Estimate, Estimator, LearnedOutput, RequestEstimate};
use crate::pricing::{CacheCounting, PriceTable};

/// Applies [`Estimate`] to a service; see the [module documentation](crate::estimate).
///
/// Every service this layer builds shares its estimator and its [`LearnedOutput`].
#[derive(Debug, Clone)]
pub struct EstimateLayer {
    settings: Arc<Settings>,
}

impl EstimateLayer {
    /// Bodies larger than this, 4 MiB by default, pass without an estimate.
    pub const DEFAULT_MAX_BODY_BYTES: usize = Settings::DEFAULT_MAX_BODY_BYTES;

    /// Estimates with a [`CharEstimator`] and the default [`Defaults`].
    pub fn new() -> Self {
        Self::with_estimator(CharEstimator::new())
    }

    /// Estimates with `estimator` and the default [`Defaults`].
    pub fn with_estimator(estimator: impl Estimator) -> Self {
        Self {
            settings: Arc::new(Settings::new(Arc::new(estimator))),
        }
    }

    /// What to assume where a request says nothing countable; see [`Defaults`].
    pub fn defaults(mut self, defaults: Defaults) -> Self {
        Arc::make_mut(&mut self.settings).defaults = defaults;
        self
    }

    /// Reads bodies of up to `max_body_bytes` bytes; larger ones, and bodies whose size is not
    /// known in advance, pass without an estimate. Defaults to 4 MiB.
    pub fn max_body_bytes(mut self, max_body_bytes: usize) -> Self {
        Arc::make_mut(&mut self.settings).max_body_bytes = max_body_bytes;
        self
    }

    /// Reserves the output `learned` expects for the request's route (bounded by its
    /// `max_tokens`) once the route has enough samples, and puts an
    /// [`OutputRoute`](super::OutputRoute) in the request's extensions so that the real usage
    /// can be recorded. The route is the request's path and model unless
    /// [`EstimateLayer::route_key`] says otherwise.
    pub fn learn_output(mut self, learned: LearnedOutput) -> Self {
        Arc::make_mut(&mut self.settings).learned = Some(learned);
        self
    }

    /// Chooses the route a request's output is learned under (by default
    /// `"{path} {model}"`, or the path alone); `None` learns nothing for that request.
    pub fn route_key<F>(mut self, route_key: F) -> Self
    where
        F: Fn(&Parts, &RequestEstimate) -> Option<String> + Send + Sync + 'static,
    {
        Arc::make_mut(&mut self.settings).route_key = Arc::new(route_key);
        self
    }
}

impl EstimateLayer {
    /// Prices each request it estimates at `prices` (see [`pricing`](crate::pricing)): the
    /// [`Cost`](crate::Cost) gains the spend of its estimate (its input at the dearest input
    /// price, its output bound at the output price, at the dearest of the tier it asks for
    /// and the standard tier), and its extensions a [`Priced`](crate::pricing::Priced) with
    /// which its reservation settles the spend of the real usage, whose input count holds the
    /// cache tokens `counting` says (its provider profile's
    /// [`cache_counting`](crate::provider::Profile::cache_counting)).
    /// A request for a model the table refuses ([`Unpriced::Refuse`](crate::pricing::Unpriced))
    /// fails with [`Error::is_unpriced`](crate::Error::is_unpriced), nothing sent. Requests that
    /// already carry a `Cost`, or whose body is not estimated, are not priced. Defaults to none.
    pub fn prices(mut self, prices: Arc<PriceTable>, counting: CacheCounting) -> Self {
        Arc::make_mut(&mut self.settings).prices = Some((prices, counting));
        self
    }

    /// Asks for the usage of OpenAI-style streams whose caller did not: a request with
    /// `"stream": true` and no `stream_options.include_usage` gets it (its body is rewritten,
    /// the only case where it is not passed on unchanged), and is marked
    /// [`InjectedStreamUsage`](super::InjectedStreamUsage) so that a
    /// [`StripUsageLayer`](crate::provider::StripUsageLayer) removes the usage chunk before the
    /// caller sees it. Without it, such a stream ends without usage and is charged from what
    /// it streamed. Defaults to off.
    ///
    /// Turn it on only in front of OpenAI Chat Completions and compatible endpoints: Anthropic
    /// and Gemini report usage in every stream and may refuse the unknown field.
    pub fn include_stream_usage(mut self, include: bool) -> Self {
        Arc::make_mut(&mut self.settings).include_stream_usage = include;
        self
    }
}

impl Default for EstimateLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for EstimateLayer {
    type Service = Estimate<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Estimate::from_settings(inner, self.settings.clone())
    }
}
