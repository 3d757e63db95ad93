use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tokio::time::Instant;
use tower::Service;

use super::ResponseFuture;
use super::inner::{Inner, QueueHandle};
use crate::error::{BoxError, Error};
use crate::priority::{Deadline, EnqueuedAt, NotBefore, Priority};
use crate::sched::saturating_deadline;

/// Orders requests by [`Priority`](crate::Priority) before the inner service sees them; see the
/// [module documentation](crate::queue).
///
/// Clones share the queue.
#[derive(Debug)]
pub struct PriorityQueue<S> {
    inner: S,
    queue: Arc<Inner>,
    /// `poll_ready` found nobody waiting here and the inner service ready: `call` may hand
    /// the request over at once.
    ready: bool,
}

// Written by hand: a clone shares the queue, but not the readiness its original took.
impl<S: Clone> Clone for PriorityQueue<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            queue: self.queue.clone(),
            ready: false,
        }
    }
}

impl<S> PriorityQueue<S> {
    pub(crate) fn new(inner: S, queue: Arc<Inner>) -> Self {
        Self {
            inner,
            queue,
            ready: false,
        }
    }

    /// A handle for introspection.
    pub fn handle(&self) -> QueueHandle {
        QueueHandle::new(self.queue.clone())
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
    ///
    /// When nobody waits in the queue, it asks the inner service's readiness here, so that
    /// `call` can hand the request over at once; an inner service that fails its readiness
    /// fails this one.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if !self.ready && self.queue.is_empty() {
            match self.inner.poll_ready(cx) {
                Poll::Ready(Ok(())) => self.ready = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(Error::from_inner(e))),
                // The request will wait in the queue's ordering, in its response future; the
                // handle gives up the place it may have taken in the inner service's own
                // waiting list (a semaphore's), which is the head's to take.
                Poll::Pending => self.inner = self.inner.clone(),
            }
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let now = Instant::now();
        let config = &self.queue.config;
        let extensions = request.extensions();
        let priority = extensions
            .get::<Priority>()
            .copied()
            .unwrap_or(config.default_class());
        let enqueued_at = extensions
            .get::<EnqueuedAt>()
            .map_or(now, |at| at.instant().min(now));
        // A retried request keeps its place from its first attempt, but waits its class's full
        // maximum from now, or from when it may go.
        let not_before = (extensions.get::<NotBefore>())
            .map(NotBefore::instant)
            .filter(|&at| at > now);
        let max_wait = config.class(priority).max_wait();
        let deadline = match extensions.get::<Deadline>() {
            Some(deadline) => (Some(deadline.instant()), true),
            None => (
                max_wait.map(|wait| saturating_deadline(not_before.unwrap_or(now), wait)),
                false,
            ),
        };
        let ready = std::mem::take(&mut self.ready);
        if ready && self.queue.is_empty() {
            // Nobody waits here and the inner service is ready: hand it over now. Inner layers
            // follow the placement: a budget orders its waiters by it, and gives up waiting at
            // its deadline.
            let scheduling = config.placed(priority, (enqueued_at, not_before), deadline);
            request.extensions_mut().insert(scheduling);
            if let Some(link) = self.queue.link() {
                request.extensions_mut().insert(link);
            }
            crate::observe::span_record("queue_wait_ms", 0);
            return ResponseFuture::calling(self.inner.call(request), priority, now);
        }
        if ready {
            // Others queued since `poll_ready`: the readiness taken is given back (the ready
            // handle is dropped for a fresh clone), so that the head of the queue can have it.
            self.inner = self.inner.clone();
        }
        ResponseFuture::new(
            self.queue.clone(),
            (priority, enqueued_at, not_before),
            deadline,
            self.inner.clone(),
            request,
        )
    }
}
