use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::PollSemaphore;
use tower::Service;

use super::ResponseFuture;

/// Caps the calls in flight until their response bodies end; see the
/// [module documentation](crate::in_flight).
#[derive(Debug)]
pub struct InFlightLimit<S> {
    inner: S,
    semaphore: PollSemaphore,
    /// The slot acquired by `poll_ready`, spent by `call`.
    permit: Option<OwnedSemaphorePermit>,
}

impl<S> InFlightLimit<S> {
    /// Wraps `inner`, taking slots from `semaphore`.
    pub fn new(inner: S, semaphore: Arc<Semaphore>) -> Self {
        Self {
            inner,
            semaphore: PollSemaphore::new(semaphore),
            permit: None,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

// Written by hand: a clone shares the limit but must acquire its own slot.
impl<S: Clone> Clone for InFlightLimit<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            semaphore: self.semaphore.clone(),
            permit: None,
        }
    }
}

impl<S, B, ResBody> Service<Request<B>> for InFlightLimit<S>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    type Response = Response<super::InFlightBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if self.permit.is_none() {
            // The semaphore is never closed, so acquiring only waits.
            self.permit = ready!(self.semaphore.poll_acquire(cx));
            debug_assert!(self.permit.is_some(), "the semaphore is never closed");
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let permit = self
            .permit
            .take()
            .expect("InFlightLimit: poll_ready must be called first");
        ResponseFuture::new(self.inner.call(request), permit)
    }
}
