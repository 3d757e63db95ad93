//! What an [`EstimateLayer`](super::EstimateLayer) and its services share.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;

use crate::pricing::{CacheCounting, PriceTable};

use super::{CharEstimator, Defaults, Estimator, LearnedOutput, RequestEstimate};

/// Chooses the route a request's output is learned under; `None` learns nothing for it.
pub(super) type RouteKey = dyn Fn(&Parts, &RequestEstimate) -> Option<String> + Send + Sync;

/// What an [`EstimateLayer`] and its services share.
#[derive(Clone)]
pub(super) struct Settings {
    pub(super) estimator: Arc<dyn Estimator>,
    pub(super) defaults: Defaults,
    pub(super) max_body_bytes: usize,
    pub(super) learned: Option<LearnedOutput>,
    pub(super) route_key: Arc<RouteKey>,
    pub(super) include_stream_usage: bool,
    /// The prices requests are priced at, and which cache tokens their provider's usage
    /// counts in its input.
    pub(super) prices: Option<(Arc<PriceTable>, CacheCounting)>,
}

impl Settings {
    /// Bodies read at most, by default.
    pub(super) const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

    /// The defaults of every setting, estimating with `estimator`.
    pub(super) fn new(estimator: Arc<dyn Estimator>) -> Self {
        Self {
            estimator,
            defaults: Defaults::new(),
            max_body_bytes: Self::DEFAULT_MAX_BODY_BYTES,
            learned: None,
            route_key: Arc::new(path_and_model),
            include_stream_usage: false,
            prices: None,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self::new(Arc::new(CharEstimator::new()))
    }
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("defaults", &self.defaults)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("learned", &self.learned)
            .finish_non_exhaustive()
    }
}

/// The default route: the request's path, and its model when the body names one.
fn path_and_model(parts: &Parts, request: &RequestEstimate) -> Option<String> {
    let path = parts.uri.path();
    Some(match request.model() {
        Some(model) => format!("{path} {model}"),
        None => path.to_owned(),
    })
}
