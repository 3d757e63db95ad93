use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tokio::time::Instant;
use tower::Service;

use super::ResponseFuture;
use super::engine::Full;
use super::shared::{QueueHandle, Shared};
use crate::error::{BoxError, Error};
use crate::priority::{Deadline, EnqueuedAt};

/// Orders requests by [`Priority`](crate::Priority) before the inner service sees them; see the
/// [module documentation](crate::queue).
///
/// Clones share the queue.
#[derive(Debug, Clone)]
pub struct PriorityQueue<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> PriorityQueue<S> {
    pub(crate) fn new(inner: S, shared: Arc<Shared>) -> Self {
        Self { inner, shared }
    }

    /// A handle for introspection.
    pub fn handle(&self) -> QueueHandle {
        QueueHandle {
            shared: self.shared.clone(),
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, B, ResBody> Service<Request<B>> for PriorityQueue<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
{
    type Response = Response<ResBody>;
    type Error = Error;
    type Future = ResponseFuture<S, B>;

    /// Always ready: the queue is where requests wait. A full queue sheds in `call`.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let now = Instant::now();
        let mut state = self.shared.lock();
        let config = *state.engine.config();
        let priority = *request
            .extensions_mut()
            .get_or_insert(config.default_class());
        let enqueued_at = request
            .extensions()
            .get::<EnqueuedAt>()
            .map_or(now, |at| at.instant().min(now));
        // A retried request keeps its place from its first attempt, but waits its class's full
        // maximum from now.
        let own_deadline = request
            .extensions()
            .get::<Deadline>()
            .map(Deadline::instant)
            .or_else(|| (enqueued_at < now).then(|| now + config.class(priority).max_wait()));
        match state.engine.push(priority, enqueued_at, own_deadline) {
            Ok(key) => {
                drop(state);
                // Inner layers keep enforcing it (the budget, while the request waits there).
                request
                    .extensions_mut()
                    .insert(Deadline::at(key.deadline()));
                ResponseFuture::queued(self.shared.clone(), key, self.inner.clone(), request)
            }
            Err(Full(depth)) => {
                drop(state);
                tracing::debug!(%priority, depth, "queue full, request shed");
                crate::observe::rate_limit_hit("queue_full", "local");
                ResponseFuture::failed(Error::queue_full(priority, depth))
            }
        }
    }
}
