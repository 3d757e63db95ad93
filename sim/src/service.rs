//! The in-process provider: a tower `Service` and the body it streams.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame as BodyFrame, SizeHint};
use http_body_util::{BodyExt, Limited};
use tokio::time::{Instant, Sleep};

use super::config::Style;
use super::engine::{Admitted, Engine, Outcome, Settlement};
use super::wire::{Frame, Refusal};
use super::{anthropic, gemini, openai};
use tower_llm_quota::BoxError;

/// The largest request body read; a larger one is answered 400.
const MAX_REQUEST_BODY: usize = 32 * 1024 * 1024;

/// The simulated provider as a tower [`Service`](tower::Service), from
/// [`Simulator::service`](super::Simulator::service).
///
/// It is always ready. A response comes after the simulated latency (on tokio's clock, so
/// under a paused clock it costs no real time); a streamed body sends its events over the
/// generation time. An injected connection reset fails the call with an [`io::Error`] of kind
/// [`ConnectionReset`](io::ErrorKind::ConnectionReset); an unreadable request body fails it
/// with that body's error.
#[derive(Debug, Clone)]
pub struct SimService {
    engine: Arc<Engine>,
}

impl SimService {
    pub(crate) fn new(engine: Arc<Engine>) -> Self {
        Self { engine }
    }
}

impl<B> tower::Service<Request<B>> for SimService
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<SimBody>;
    type Error = io::Error;
    type Future = SimResponseFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), io::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> SimResponseFuture {
        let engine = Arc::clone(&self.engine);
        SimResponseFuture {
            inner: Box::pin(respond(engine, request)),
        }
    }
}

/// The future of a [`SimService`] call.
pub struct SimResponseFuture {
    inner: Pin<Box<dyn Future<Output = Result<Response<SimBody>, io::Error>> + Send>>,
}

impl fmt::Debug for SimResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimResponseFuture").finish_non_exhaustive()
    }
}

impl Future for SimResponseFuture {
    type Output = Result<Response<SimBody>, io::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

/// Reads the request, decides, waits the latency, and answers.
pub(crate) async fn respond<B>(
    engine: Arc<Engine>,
    request: Request<B>,
) -> Result<Response<SimBody>, io::Error>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = request.into_parts();
    let style = engine.config().style;
    if style == Style::Gemini {
        if parts.method == http::Method::GET && gemini::is_listing(parts.uri.path()) {
            let mut response = Response::new(SimBody::full(gemini::models(
                engine.config().max_output_tokens,
            )));
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            return Ok(response);
        }
        // Google takes the key from `?key=` as from its header.
        if let Some(key) = gemini::query_value(parts.uri.query(), "key")
            .and_then(|key| http::HeaderValue::from_str(key).ok())
        {
            parts.headers.entry("x-goog-api-key").or_insert(key);
        }
    }
    let body = match Limited::new(body, MAX_REQUEST_BODY).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => Err(Refusal::Invalid(
            format!("the request body exceeds {MAX_REQUEST_BODY} bytes"),
        )),
        Err(error) => return Err(io::Error::other(error)),
    };
    let outcome = engine.decide(&parts.method, parts.uri.path(), &parts.headers, body);
    let admitted = match outcome {
        Outcome::Answer {
            status,
            headers,
            body,
        } => {
            let padded = engine.config().faults.error_body_bytes;
            let body = if status.is_server_error() && padded > body.len() {
                SimBody::chunks(padded_chunks(&body, padded))
            } else {
                SimBody::full(body)
            };
            let mut response = Response::new(body);
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            return Ok(response);
        }
        Outcome::Reset => {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "connection reset by the simulated provider",
            ));
        }
        Outcome::Admitted(admitted) => admitted,
    };
    pause(admitted.first_token).await;
    let sse = gemini::query_value(parts.uri.query(), "alt") == Some("sse");
    if admitted.stream {
        let headers = engine.response_headers(
            admitted.settlement.organization(),
            style != Style::Gemini || sse,
            &admitted.completion.id,
        );
        let frames = match style {
            Style::OpenAi => openai::frames(&admitted.completion),
            Style::Anthropic => anthropic::frames(&admitted.completion),
            Style::Gemini => gemini::frames(&admitted.completion, sse),
        };
        let Admitted {
            per_token,
            settlement,
            ..
        } = admitted;
        let mut response = Response::new(SimBody::stream(frames, per_token, settlement));
        *response.headers_mut() = headers;
        return Ok(response);
    }
    let tokens = u32::try_from(admitted.completion.completion_tokens).unwrap_or(u32::MAX);
    pause(admitted.per_token.saturating_mul(tokens)).await;
    let body = match style {
        Style::OpenAi if admitted.completion.embeddings.is_some() => {
            openai::embeddings(&admitted.completion)
        }
        Style::OpenAi => openai::completion(&admitted.completion),
        Style::Anthropic => anthropic::completion(&admitted.completion),
        Style::Gemini if admitted.completion.embeddings.is_some() => {
            let batch = gemini::route(parts.uri.path())
                .is_some_and(|(_, method)| method == gemini::Method::BatchEmbed);
            gemini::embeddings(&admitted.completion, batch)
        }
        Style::Gemini => gemini::completion(&admitted.completion),
    };
    let organization = admitted.settlement.organization();
    drop(admitted.settlement);
    let headers = engine.response_headers(organization, false, &admitted.completion.id);
    let mut response = Response::new(SimBody::full(body));
    *response.headers_mut() = headers;
    Ok(response)
}

/// `body` followed by spaces up to `total` bytes, in chunks of 8 KiB.
fn padded_chunks(body: &Bytes, total: usize) -> VecDeque<Bytes> {
    const CHUNK: usize = 8 * 1024;
    let mut padded = Vec::with_capacity(total);
    padded.extend_from_slice(body);
    padded.resize(total, b' ');
    let padded = Bytes::from(padded);
    (0..total)
        .step_by(CHUNK)
        .map(|at| padded.slice(at..(at + CHUNK).min(total)))
        .collect()
}

/// Sleeps on tokio's clock; a zero wait does not yield.
async fn pause(duration: Duration) {
    if !duration.is_zero() {
        tokio::time::sleep(duration).await;
    }
}

/// The body of a simulated response: one JSON document, or server-sent events sent over the
/// generation time (each content event after the latency of its tokens).
///
/// Dropping a stream before its end still settles the usage with the whole completion, as a
/// provider that finished generating would.
pub struct SimBody {
    kind: Kind,
}

enum Kind {
    Full(Option<Bytes>),
    /// Chunks sent one after the other, with no length announced.
    Chunks(VecDeque<Bytes>),
    Stream(Box<Stream>),
}

struct Stream {
    frames: VecDeque<Frame>,
    per_token: Duration,
    sleep: Pin<Box<Sleep>>,
    /// Whether `sleep` is set for the next frame.
    armed: bool,
    settlement: Option<Settlement>,
}

impl fmt::Debug for SimBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Full(bytes) => f
                .debug_struct("SimBody")
                .field("len", &bytes.as_ref().map_or(0, Bytes::len))
                .finish(),
            Kind::Chunks(chunks) => f
                .debug_struct("SimBody")
                .field("chunks_left", &chunks.len())
                .finish(),
            Kind::Stream(stream) => f
                .debug_struct("SimBody")
                .field("events_left", &stream.frames.len())
                .finish_non_exhaustive(),
        }
    }
}

impl SimBody {
    fn full(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Full(Some(bytes)),
        }
    }

    fn chunks(chunks: VecDeque<Bytes>) -> Self {
        Self {
            kind: Kind::Chunks(chunks),
        }
    }

    fn stream(frames: Vec<Frame>, per_token: Duration, settlement: Settlement) -> Self {
        Self {
            kind: Kind::Stream(Box::new(Stream {
                frames: frames.into(),
                per_token,
                sleep: Box::pin(tokio::time::sleep_until(Instant::now())),
                armed: false,
                settlement: Some(settlement),
            })),
        }
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<BodyFrame<Bytes>, Infallible>>> {
        let stream = match &mut self.kind {
            Kind::Full(bytes) => return Poll::Ready(bytes.take().map(|b| Ok(BodyFrame::data(b)))),
            Kind::Chunks(chunks) => {
                return Poll::Ready(chunks.pop_front().map(|b| Ok(BodyFrame::data(b))));
            }
            Kind::Stream(stream) => stream,
        };
        let Some(next) = stream.frames.front() else {
            return Poll::Ready(None);
        };
        let tokens = u32::try_from(next.tokens).unwrap_or(u32::MAX);
        let delay = stream.per_token.saturating_mul(tokens);
        if !delay.is_zero() {
            if !stream.armed {
                let deadline = Instant::now() + delay;
                stream.sleep.as_mut().reset(deadline);
                stream.armed = true;
            }
            if stream.sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            stream.armed = false;
        }
        let Some(frame) = stream.frames.pop_front() else {
            return Poll::Ready(None);
        };
        if frame.settles {
            drop(stream.settlement.take());
        }
        Poll::Ready(Some(Ok(BodyFrame::data(frame.data))))
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full(bytes) => bytes.is_none(),
            Kind::Chunks(chunks) => chunks.is_empty(),
            Kind::Stream(stream) => stream.frames.is_empty(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full(Some(bytes)) => SizeHint::with_exact(bytes.len() as u64),
            Kind::Full(None) => SizeHint::with_exact(0),
            Kind::Chunks(_) | Kind::Stream(_) => SizeHint::default(),
        }
    }
}
