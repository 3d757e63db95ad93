use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;
use tokio::sync::OwnedSemaphorePermit;

use super::InFlightBody;

pin_project! {
    /// The response future of [`InFlightLimit`](super::InFlightLimit): holds the slot, then
    /// hands it to the response body.
    ///
    /// # Cancel safety
    ///
    /// Dropped before the response, it releases the slot.
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        permit: Option<OwnedSemaphorePermit>,
    }
}

impl<F> ResponseFuture<F> {
    pub(crate) fn new(inner: F, permit: OwnedSemaphorePermit) -> Self {
        Self {
            inner,
            permit: Some(permit),
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<InFlightBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = ready!(this.inner.poll(cx))?;
        // An error drops the permit with the future; a response carries it in its body.
        let permit = this.permit.take();
        Poll::Ready(Ok(response.map(|body| InFlightBody::new(body, permit))))
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("holds_slot", &self.permit.is_some())
            .finish_non_exhaustive()
    }
}
