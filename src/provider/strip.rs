//! Usage the caller did not ask for, asked of the provider and hidden from the caller.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use crate::estimate::InjectedStreamUsage;

/// Removes the usage chunk (`"choices": []` with a `usage` object) from the event streams of
/// requests marked [`InjectedStreamUsage`], so that a caller who did not ask for it does not
/// see it. Other responses pass through untouched.
///
/// Place it outside [`ReconcileLayer`](crate::ReconcileLayer), which must see the chunk to
/// settle; see [`EstimateLayer::include_stream_usage`](crate::estimate::EstimateLayer::include_stream_usage).
/// Events are held until they are complete (at most 1 MiB each; a longer one is passed on
/// as it is), so the caller sees each event whole, at its end.
#[derive(Debug, Clone, Copy, Default)]
pub struct StripUsageLayer;

impl<S> Layer<S> for StripUsageLayer {
    type Service = StripUsage<S>;

    fn layer(&self, inner: S) -> StripUsage<S> {
        StripUsage { inner }
    }
}

/// The service of [`StripUsageLayer`].
#[derive(Debug, Clone)]
pub struct StripUsage<S> {
    inner: S,
}

impl<S, B, ResBody> Service<Request<B>> for StripUsage<S>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    type Response = Response<StripUsageBody<ResBody>>;
    type Error = S::Error;
    type Future = StripUsageFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let strip = request.extensions().get::<InjectedStreamUsage>().is_some();
        StripUsageFuture {
            inner: self.inner.call(request),
            strip,
        }
    }
}

pin_project! {
    /// The response future of [`StripUsage`].
    pub struct StripUsageFuture<F> {
        #[pin]
        inner: F,
        strip: bool,
    }
}

impl<F, B, E> Future for StripUsageFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<StripUsageBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = ready!(this.inner.poll(cx))?;
        let strip = *this.strip && response.status().is_success();
        Poll::Ready(Ok(response.map(|body| StripUsageBody {
            inner: body,
            held: strip.then(BytesMut::new),
        })))
    }
}

impl<F> fmt::Debug for StripUsageFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StripUsageFuture")
            .field("strip", &self.strip)
            .finish_non_exhaustive()
    }
}

/// The longest event held whole; a longer one passes as it is.
const MAX_EVENT: usize = 1 << 20;

pin_project! {
    /// A response body from [`StripUsage`]: untouched, or an event stream without its usage
    /// chunk.
    pub struct StripUsageBody<B> {
        #[pin]
        inner: B,
        // Bytes of the event not yet complete, when stripping.
        held: Option<BytesMut>,
    }
}

impl<B> Body for StripUsageBody<B>
where
    B: Body,
    B::Data: Buf,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        loop {
            let frame = ready!(this.inner.as_mut().poll_frame(cx));
            let Some(held) = this.held.as_mut() else {
                return Poll::Ready(
                    frame.map(|f| f.map(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining())))),
                );
            };
            match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(mut data) => {
                        held.extend_from_slice(&data.copy_to_bytes(data.remaining()));
                        let out = complete_events(held);
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(out))));
                        }
                    }
                    Err(frame) => {
                        return Poll::Ready(Some(Ok(
                            frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))
                        )));
                    }
                },
                Some(Err(error)) => return Poll::Ready(Some(Err(error))),
                None => {
                    // The end: whatever is held goes out as it is.
                    let rest = std::mem::take(held).freeze();
                    *this.held = None;
                    return Poll::Ready((!rest.is_empty()).then(|| Ok(Frame::data(rest))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream() && self.held.as_ref().is_none_or(|h| h.is_empty())
    }

    fn size_hint(&self) -> SizeHint {
        match self.held {
            // The length changes when the chunk is removed.
            Some(_) => SizeHint::default(),
            None => self.inner.size_hint(),
        }
    }
}

impl<B> fmt::Debug for StripUsageBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StripUsageBody")
            .field("stripping", &self.held.is_some())
            .finish_non_exhaustive()
    }
}

/// Takes the complete events out of `held`, without the usage chunk; a held event longer than
/// [`MAX_EVENT`] is given up on and passed as it is.
fn complete_events(held: &mut BytesMut) -> Bytes {
    let mut out = BytesMut::new();
    while let Some(end) = event_end(held) {
        let event = held.split_to(end);
        if !is_usage_chunk(&event) {
            out.extend_from_slice(&event);
        }
    }
    if held.len() > MAX_EVENT {
        out.extend_from_slice(&held.split());
    }
    out.freeze()
}

/// The length of the first complete event (through its blank line), if any.
fn event_end(bytes: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = memchr::memchr(b'\n', &bytes[from..]) {
        let i = from + i;
        let rest = &bytes[i + 1..];
        if rest.starts_with(b"\n") {
            return Some(i + 2);
        }
        if rest.starts_with(b"\r\n") {
            return Some(i + 3);
        }
        from = i + 1;
    }
    None
}

/// Whether an event is OpenAI's usage chunk: `choices` empty, `usage` an object.
fn is_usage_chunk(event: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(event) else {
        return false;
    };
    let data: String = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(str::trim_start)
        .collect::<Vec<_>>()
        .join("\n");
    let Ok(value) = serde_json::from_str::<serde_json::Value>(&data) else {
        return false;
    };
    value["choices"].as_array().is_some_and(Vec::is_empty) && value["usage"].is_object()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_usage_chunk_goes() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n",
            "data: [DONE]\n\n",
        );
        let mut held = BytesMut::from(&stream.as_bytes()[..20]);
        assert!(
            complete_events(&mut held).is_empty(),
            "an event is held until it ends"
        );
        held.extend_from_slice(&stream.as_bytes()[20..]);
        let out = complete_events(&mut held);
        assert_eq!(
            out,
            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\ndata: [DONE]\n\n"
        );
        assert!(held.is_empty());
    }
}
