use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower::Service;

use super::flight::IdempotentBody;
use super::future::ResponseFuture;
use super::inner::Inner;
use crate::error::{BoxError, Error};

/// Deduplicates the operations of the requests it forwards; see the
/// [module documentation](super).
///
/// Always ready: the inner service's readiness is awaited by the call that leads an
/// operation, so a duplicate never holds inner capacity. Clones share the layer's store and
/// flights.
#[derive(Debug, Clone)]
pub struct Idempotency<S> {
    inner: S,
    layer: Inner,
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, layer: Inner) -> Self {
        Self { inner, layer }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, B, ResBody> Service<Request<B>> for Idempotency<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<IdempotentBody>;
    type Error = Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        ResponseFuture::new(self.inner.clone(), &self.layer, request)
    }
}
