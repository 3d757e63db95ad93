//! The two bodies a connection wraps: the request's, which must arrive by a deadline, and
//! the answer's, whose end tells the connection's [`Watch`] that it is idle.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower_llm_quota::BoxError;

use super::watch::Watch;

/// A request body that did not arrive within the body timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BodyTimeout(pub(crate) Duration);

impl std::fmt::Display for BodyTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the request body did not arrive within {:.1} s",
            self.0.as_secs_f64()
        )
    }
}

impl std::error::Error for BodyTimeout {}

impl BodyTimeout {
    /// Whether `error`, or an error it wraps, is a body timeout.
    pub(crate) fn is_in(error: &(dyn std::error::Error + 'static)) -> bool {
        let mut error = Some(error);
        while let Some(current) = error {
            if current.is::<BodyTimeout>() {
                return true;
            }
            error = current.source();
        }
        false
    }
}

pin_project! {
    /// A request body that fails with [`BodyTimeout`] when it is not whole by its deadline.
    /// The timer is armed only when the body has to wait for bytes.
    pub(crate) struct TimedBody<B> {
        #[pin]
        inner: B,
        deadline: Instant,
        allowed: Duration,
        sleep: Option<Pin<Box<Sleep>>>,
        // Told when the body was read whole.
        watch: Option<Arc<Watch>>,
    }
}

impl<B> TimedBody<B> {
    pub(crate) fn new(inner: B, allowed: Duration) -> Self {
        Self {
            inner,
            deadline: Instant::now() + allowed,
            allowed,
            sleep: None,
            watch: None,
        }
    }

    /// The same, telling `watch` when the body was read whole.
    pub(crate) fn watched(inner: B, allowed: Duration, watch: Arc<Watch>) -> Self {
        Self {
            watch: Some(watch),
            ..Self::new(inner, allowed)
        }
    }
}

impl<B> Body for TimedBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        match this.inner.as_mut().poll_frame(cx) {
            Poll::Ready(frame) => {
                if frame.is_none() || this.inner.is_end_stream() {
                    if let Some(watch) = this.watch.take() {
                        watch.serving();
                    }
                }
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => {
                let deadline = *this.deadline;
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(BodyTimeout(*this.allowed).into()))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Tells the watch that the request ended when dropped.
#[derive(Debug)]
struct EndsRequest(Arc<Watch>);

impl Drop for EndsRequest {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

pin_project! {
    /// An answer's body: when it ends or is dropped, its connection is idle.
    pub(crate) struct AnswerBody<B> {
        #[pin]
        inner: B,
        _ends: EndsRequest,
    }
}

impl<B> AnswerBody<B> {
    pub(crate) fn new(inner: B, watch: Arc<Watch>) -> Self {
        Self {
            inner,
            _ends: EndsRequest(watch),
        }
    }
}

impl<B: Body> Body for AnswerBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test(start_paused = true)]
    async fn a_body_late_past_its_deadline_fails_with_a_timeout() {
        let (mut sender, body) = http_body_util::channel::Channel::<Bytes, BoxError>::new(1);
        let timed = TimedBody::new(body, Duration::from_secs(30));
        let start = Instant::now();
        let reading = tokio::spawn(timed.collect());
        sender.send_data(Bytes::from_static(b"{")).await.unwrap();
        let error = reading.await.unwrap().unwrap_err();
        assert!(BodyTimeout::is_in(&*error), "{error}");
        assert_eq!(start.elapsed(), Duration::from_secs(30));
        drop(sender);
    }

    #[tokio::test(start_paused = true)]
    async fn a_whole_body_never_arms_the_timer() {
        let timed = TimedBody::new(
            http_body_util::Full::new(Bytes::from_static(b"{}")),
            Duration::from_secs(30),
        );
        let bytes = timed.collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"{}");
    }
}
