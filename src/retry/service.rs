use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower::Service;
use tower::retry::budget::Budget as _;

use super::layer::Settings;
use super::{Classify, ResponseFuture, RetryBody};
use crate::error::{BoxError, Error};

/// Retries transient failures, obeying the provider; see the
/// [module documentation](crate::retry).
///
/// Clones share the retry budget.
pub struct RetryAfter<S, C> {
    inner: S,
    settings: Arc<Settings<C>>,
}

impl<S, C> RetryAfter<S, C> {
    pub(crate) fn new(inner: S, settings: Arc<Settings<C>>) -> Self {
        Self { inner, settings }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, C> Clone for RetryAfter<S, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<S: fmt::Debug, C> fmt::Debug for RetryAfter<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryAfter")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, C, B, ResBody> Service<Request<B>> for RetryAfter<S, C>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
    B: Clone,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
    C: Classify,
{
    type Response = Response<RetryBody<ResBody>>;
    type Error = Error;
    type Future = ResponseFuture<S, B, ResBody, C>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Error::from_inner)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // Every original request earns retries; retries spend them.
        self.settings.budget.deposit();
        // The service polled ready makes the first attempt; a clone stays for later ones.
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        let template = request.clone();
        let first = ready.call(request);
        ResponseFuture::new(first, ready, template, self.settings.clone())
    }
}
