use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, Request, header};
use http_body::Body;
use tower::Service;

use super::future::{estimate_into, lacks_stream_usage};
use super::settings::Settings;
use super::{RequestEstimate, ResponseFuture};
use crate::cost::Cost;
use crate::error::{BoxError, Error};

/// Estimates each request's [`Cost`] from its body and puts it in the request's extensions;
/// see the [module documentation](crate::estimate).
#[derive(Debug, Clone)]
pub struct Estimate<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S> Estimate<S> {
    /// Wraps `inner`, estimating with a [`CharEstimator`](super::CharEstimator) and the default
    /// [`Defaults`](super::Defaults); configure through [`EstimateLayer`](super::EstimateLayer).
    pub fn new(inner: S) -> Self {
        Self::from_settings(inner, Arc::default())
    }

    pub(super) fn from_settings(inner: S, settings: Arc<Settings>) -> Self {
        Self { inner, settings }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// Whether a content type is JSON: `application/json`, or any `+json` type.
fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        // No content type: look at the body.
        return true;
    };
    let Ok(value) = value.to_str() else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json")
        || essence
            .get(essence.len().saturating_sub(5)..)
            .is_some_and(|suffix| suffix.eq_ignore_ascii_case("+json"))
}

/// Whether the request's body can be read: a JSON (or unnamed) content type, and a size known
/// to be between 1 byte and `max` bytes.
fn readable<B: Body>(request: &Request<B>, max: usize) -> bool {
    if !is_json(request.headers()) {
        return false;
    }
    let max = u64::try_from(max).unwrap_or(u64::MAX);
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > max) {
        return false;
    }
    request
        .body()
        .size_hint()
        .upper()
        .is_some_and(|upper| upper > 0 && upper <= max)
}

impl<S, B> Service<Request<B>> for Estimate<S>
where
    S: Service<Request<B>> + Clone,
    S::Error: Into<BoxError>,
    B: Body + From<Bytes>,
    B::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Error::from_inner)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        if request.extensions().get::<Cost>().is_some() {
            return ResponseFuture::calling(self.inner.call(request));
        }
        let read = request.extensions_mut().remove::<RequestEstimate>();
        let max = self.settings.max_body_bytes;
        match read {
            // Read above, and nothing to rewrite: estimated here without the body.
            Some(read)
                if !(self.settings.include_stream_usage
                    && lacks_stream_usage(&read)
                    && readable(&request, max)) =>
            {
                let (mut parts, body) = request.into_parts();
                if let Err(no_price) = estimate_into(&mut parts, &read, &self.settings) {
                    return ResponseFuture::refused(Error::unpriced(no_price.into()));
                }
                ResponseFuture::calling(self.inner.call(Request::from_parts(parts, body)))
            }
            None if !readable(&request, max) => ResponseFuture::calling(self.inner.call(request)),
            // The body to read: to estimate it, or to ask a stream for its usage.
            read => {
                // The ready service goes with the request; this one readies a clone for the
                // next call.
                let clone = self.inner.clone();
                let ready = std::mem::replace(&mut self.inner, clone);
                let settings = self.settings.clone();
                ResponseFuture::reading(request.into_parts(), ready, settings, read)
            }
        }
    }
}
