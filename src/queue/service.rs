use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tokio::time::Instant;
use tower::Service;

use super::ResponseFuture;
use super::shared::{QueueHandle, Shared};
use crate::error::{BoxError, Error};
use crate::priority::{Deadline, EnqueuedAt};
use crate::sched::saturating_deadline;

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
        QueueHandle::new(self.shared.clone())
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

    /// Always ready: requests wait in the response future, in priority order (in the queue's
    /// own ordering while the inner service is not ready, or in a budget's inside). A full
    /// ordering sheds there, with `is_queue_full()`.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let now = Instant::now();
        let config = &self.shared.config;
        let priority = *request
            .extensions_mut()
            .get_or_insert(config.default_class());
        let enqueued_at = request
            .extensions()
            .get::<EnqueuedAt>()
            .map_or(now, |at| at.instant().min(now));
        // A retried request keeps its place from its first attempt, but waits its class's full
        // maximum from now.
        let max_wait = config.class(priority).max_wait();
        let deadline = request
            .extensions()
            .get::<Deadline>()
            .map_or_else(|| saturating_deadline(now, max_wait), Deadline::instant);
        let scheduling = config.scheduling(priority, enqueued_at);
        // Inner layers keep both: a budget orders its waiters by the first, and gives up
        // waiting at the second.
        request.extensions_mut().insert(scheduling);
        request.extensions_mut().insert(Deadline::at(deadline));
        ResponseFuture::new(
            self.shared.clone(),
            scheduling,
            deadline,
            self.inner.clone(),
            request,
        )
    }
}
