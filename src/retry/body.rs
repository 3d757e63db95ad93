use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;

use crate::error::BoxError;

pin_project! {
    /// The body of a response from [`RetryAfter`](super::RetryAfter): the inner body, streamed
    /// as it comes, or an error body the layer had to read to classify it. An error of the
    /// inner body is an [`Interrupted`](super::Interrupted), its source the inner error.
    ///
    /// # Spawning
    ///
    /// The body is `Send + 'static` when the inner body is, whatever the inner body's error:
    /// `tokio::spawn(async move { body.collect().await })` compiles over a client whose body
    /// error is itself a [`BoxError`] (tower-http's decompression, a `BoxBody`). The inner
    /// error's conversion is chosen when the body is made, so the `Body` implementation asks
    /// nothing of it (a bound such as `B::Error: Into<BoxError>` there would make the compiler
    /// prove the conversion for every lifetime when it checks a spawned future, and fail).
    pub struct RetryBody<B: Body> {
        #[pin]
        inner: Inner<B>,
    }
}

pin_project! {
    #[project = InnerProj]
    enum Inner<B: Body> {
        Streaming { #[pin] body: B, convert: fn(B::Error) -> BoxError },
        Buffered { #[pin] body: Full<Bytes> },
    }
}

fn into_box<E: Into<BoxError>>(error: E) -> BoxError {
    error.into()
}

impl<B> RetryBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    pub(crate) fn streaming(body: B) -> Self {
        Self {
            inner: Inner::Streaming {
                body,
                convert: into_box::<B::Error>,
            },
        }
    }
}

impl<B: Body> RetryBody<B> {
    pub(crate) fn buffered(bytes: Bytes) -> Self {
        Self {
            inner: Inner::Buffered {
                body: Full::new(bytes),
            },
        }
    }

    /// Whether this is an error body the layer read to classify the failure.
    pub fn is_buffered(&self) -> bool {
        matches!(self.inner, Inner::Buffered { .. })
    }
}

impl<B> Body for RetryBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().inner.project() {
            // A failure after the head: the provider processed the call.
            InnerProj::Streaming { body, convert } => body.poll_frame(cx).map(|frame| {
                frame.map(|frame| {
                    frame.map_err(|error| {
                        Box::new(super::Interrupted::new(convert(error))) as BoxError
                    })
                })
            }),
            InnerProj::Buffered { body } => body
                .poll_frame(cx)
                .map(|frame| frame.map(|frame| frame.map_err(|never| match never {}))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Streaming { body, .. } => body.is_end_stream(),
            Inner::Buffered { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Streaming { body, .. } => body.size_hint(),
            Inner::Buffered { body } => body.size_hint(),
        }
    }
}

impl<B: Body> fmt::Debug for RetryBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBody")
            .field("buffered", &self.is_buffered())
            .finish_non_exhaustive()
    }
}
