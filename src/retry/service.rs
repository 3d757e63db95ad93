use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower::Service;

use super::settings::Settings;
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

/// The span of one logical request, across its attempts and the layers inside.
fn request_span<B>(request: &Request<B>) -> tracing::Span {
    let priority = request.extensions().get::<crate::priority::Priority>();
    let cost = request.extensions().get::<crate::cost::Cost>();
    tracing::debug_span!(
        "llm_request",
        priority = priority.map(|p| p.as_str()),
        input_tokens = cost.map(|c| c.input_tokens()),
        output_tokens = cost.map(|c| c.output_tokens()),
        attempt = 1u32,
        queue_wait_ms = tracing::field::Empty,
        budget_wait_ms = tracing::field::Empty,
        call_ms = tracing::field::Empty,
        usage_input = tracing::field::Empty,
        usage_output = tracing::field::Empty,
        decision = tracing::field::Empty,
    )
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
        // The service polled ready makes the first attempt; a clone stays for later ones.
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        let template = request.clone();
        let span = request_span(&template);
        // Inner layers record their facts (queue wait, budget wait, call time, usage) into it.
        let first = span.in_scope(|| ready.call(request));
        ResponseFuture::new(first, ready, template, self.settings.clone(), span)
    }
}
