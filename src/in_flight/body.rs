use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::OwnedSemaphorePermit;

use crate::reconcile::BodyEnd;

pin_project! {
    /// A response body holding a concurrency slot until it ends, fails or is dropped. Frames
    /// pass through unchanged.
    pub struct InFlightBody<B> {
        #[pin]
        inner: B,
        permit: Option<OwnedSemaphorePermit>,
    }
}

impl<B> InFlightBody<B> {
    pub(crate) fn new(inner: B, permit: Option<OwnedSemaphorePermit>) -> Self {
        Self { inner, permit }
    }

    /// Whether the body still holds its slot.
    pub fn holds_slot(&self) -> bool {
        self.permit.is_some()
    }
}

impl<B: Body> Body for InFlightBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        if BodyEnd::after(&frame, this.inner.is_end_stream()).is_some() {
            this.permit.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> fmt::Debug for InFlightBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightBody")
            .field("holds_slot", &self.permit.is_some())
            .finish_non_exhaustive()
    }
}
