use std::sync::Arc;

use tokio::sync::Semaphore;
use tower::Layer;

use super::InFlightLimit;

/// Applies [`InFlightLimit`] to services; see the [module documentation](crate::in_flight).
///
/// Every service this layer builds, and their clones, share one limit.
#[derive(Debug, Clone)]
pub struct InFlightLimitLayer {
    semaphore: Arc<Semaphore>,
    max: usize,
}

impl InFlightLimitLayer {
    /// At most `max` calls in flight, from the call until the end of the response body.
    pub fn new(max: usize) -> Self {
        Self {
            semaphore: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// Calls in flight now.
    pub fn in_flight(&self) -> usize {
        self.max - self.semaphore.available_permits()
    }
}

impl<S> Layer<S> for InFlightLimitLayer {
    type Service = InFlightLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        InFlightLimit::new(inner, self.semaphore.clone())
    }
}
