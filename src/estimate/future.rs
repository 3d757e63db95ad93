use std::fmt;
use std::future::Future;
use std::num::NonZeroU64;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::Request;
use http::request::Parts;
use http_body::Body;
use pin_project_lite::pin_project;
use tower::Service;

use super::settings::Settings;
use super::{OutputRoute, RequestEstimate, read_embeddings, read_request};
use crate::error::{BoxError, Error};
use crate::pricing::NoPrice;

pin_project! {
    /// The response future of [`Estimate`](super::Estimate): reads the request body when it
    /// has one to estimate, then calls the inner service.
    ///
    /// # Cancel safety
    ///
    /// Dropped while reading the body, the request is dropped unsent, and nothing was
    /// reserved: the estimate is only an extension until a budget reserves it. Dropped during
    /// the call, it drops the inner service's future.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S::Future, B>,
        read: Option<Read<S>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B> {
        Reading { #[pin] body: B },
        Calling { #[pin] future: F },
        Refused { error: Option<Error> },
        Done,
    }
}

/// What a reading future holds besides the body.
struct Read<S> {
    parts: Parts,
    buffer: Buffer,
    service: S,
    settings: Arc<Settings>,
    /// What a layer above read of the body, if it did.
    read: Option<RequestEstimate>,
}

/// The body read so far: a single frame is kept as it came (no copy), several are joined.
#[derive(Default)]
enum Buffer {
    #[default]
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Buffer {
    fn push(&mut self, mut data: impl Buf) {
        if !data.has_remaining() {
            return;
        }
        *self = match std::mem::take(self) {
            // Free for `Bytes` frames, a copy for other buffers.
            Self::Empty => Self::One(data.copy_to_bytes(data.remaining())),
            Self::One(first) => {
                let mut joined = BytesMut::with_capacity(first.len() + data.remaining());
                joined.put(first);
                joined.put(data);
                Self::Many(joined)
            }
            Self::Many(mut joined) => {
                joined.put(data);
                Self::Many(joined)
            }
        };
    }

    fn freeze(self) -> Bytes {
        match self {
            Self::Empty => Bytes::new(),
            Self::One(bytes) => bytes,
            Self::Many(joined) => joined.freeze(),
        }
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(super) fn calling(future: S::Future) -> Self {
        Self {
            state: State::Calling { future },
            read: None,
        }
    }

    /// Refused before the call: the inner service is not called.
    pub(super) fn refused(error: Error) -> Self {
        Self {
            state: State::Refused { error: Some(error) },
            read: None,
        }
    }

    /// Reads the body, then estimates it (from `read`, what a layer above read of it, when
    /// given) and calls `service`.
    pub(super) fn reading(
        (parts, body): (Parts, B),
        service: S,
        settings: Arc<Settings>,
        read: Option<RequestEstimate>,
    ) -> Self {
        Self {
            state: State::Reading { body },
            read: Some(Read {
                parts,
                buffer: Buffer::Empty,
                service,
                settings,
                read,
            }),
        }
    }
}

impl<S, B> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
    B: Body + From<Bytes>,
    B::Error: Into<BoxError>,
{
    type Output = Result<S::Response, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Reading { mut body } => {
                    let read = this.read.as_mut().expect("polled after completion");
                    match ready!(body.as_mut().poll_frame(cx)) {
                        Some(Ok(frame)) => {
                            match frame.into_data() {
                                Ok(data) => read.buffer.push(data),
                                // Bodies rebuilt from bytes carry no trailers.
                                Err(_) => tracing::debug!("request trailers dropped"),
                            }
                            continue;
                        }
                        Some(Err(error)) => {
                            this.state.set(State::Done);
                            this.read.take();
                            return Poll::Ready(Err(Error::request_body(error.into())));
                        }
                        None => {}
                    }
                    let Read {
                        mut parts,
                        buffer,
                        mut service,
                        settings,
                        read,
                    } = this.read.take().expect("polled after completion");
                    let mut bytes = buffer.freeze();
                    match read.or_else(|| read_body(&parts, &bytes, &settings)) {
                        Some(request) => {
                            if settings.include_stream_usage {
                                bytes = include_stream_usage(&mut parts, bytes, &request);
                            }
                            if let Err(no_price) = estimate_into(&mut parts, &request, &settings) {
                                this.state.set(State::Done);
                                return Poll::Ready(Err(Error::unpriced(no_price.into())));
                            }
                        }
                        None => {
                            tracing::debug!("request body not estimated: not a known JSON request")
                        }
                    }
                    let future = service.call(Request::from_parts(parts, B::from(bytes)));
                    this.state.set(State::Calling { future });
                }
                StateProj::Calling { future } => {
                    let output = ready!(future.poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(output.map_err(Error::from_inner));
                }
                StateProj::Refused { error } => {
                    let error = error.take().expect("polled after completion");
                    this.state.set(State::Done);
                    return Poll::Ready(Err(error));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// Whether `request` streams without asking for its usage: the layer asks for it.
pub(super) fn lacks_stream_usage(request: &RequestEstimate) -> bool {
    request.streams() && !request.asks_stream_usage()
}

/// Adds `stream_options.include_usage` to a streaming OpenAI-style request that lacks it, and
/// marks the request so that the usage chunk is removed from its response. A body without
/// `stream_options` gets the member spliced in after its opening brace, unparsed.
fn include_stream_usage(parts: &mut Parts, body: Bytes, request: &RequestEstimate) -> Bytes {
    if !lacks_stream_usage(request) {
        return body;
    }
    let rewritten = match request.has_stream_options() {
        false => splice_stream_usage(&body),
        true => rewrite_stream_usage(&body),
    };
    let Some(rewritten) = rewritten else {
        return body;
    };
    parts.headers.remove(http::header::CONTENT_LENGTH);
    parts.extensions.insert(InjectedStreamUsage);
    tracing::debug!("stream usage asked of the provider for this crate");
    rewritten
}

/// `body` (a JSON object without `stream_options`) with the member as its first.
fn splice_stream_usage(body: &[u8]) -> Option<Bytes> {
    const MEMBER: &[u8] = br#""stream_options":{"include_usage":true}"#;
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let empty = body[open + 1..]
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_none_or(|b| *b == b'}');
    let mut out = Vec::with_capacity(body.len() + MEMBER.len() + 1);
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(MEMBER);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(&body[open + 1..]);
    Some(Bytes::from(out))
}

/// `body` with `stream_options.include_usage` set, parsed and written again.
fn rewrite_stream_usage(body: &[u8]) -> Option<Bytes> {
    let serde_json::Value::Object(mut json) = serde_json::from_slice(body).ok()? else {
        return None;
    };
    let options = json
        .entry("stream_options")
        .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
    options
        .as_object_mut()?
        .insert("include_usage".to_owned(), serde_json::Value::Bool(true));
    serde_json::to_vec(&json).ok().map(Bytes::from)
}

/// Reads `body` as the request `parts` names it: `None` when it is larger than the layer
/// reads, or not a known JSON request.
fn read_body(parts: &Parts, body: &[u8], settings: &Settings) -> Option<RequestEstimate> {
    if body.len() > settings.max_body_bytes {
        return None;
    }
    let estimator = settings.estimator.as_ref();
    match parts.uri.path().ends_with("/embeddings") {
        true => read_embeddings(body, estimator),
        false => read_request(body, estimator, &settings.defaults),
    }
}

/// Puts the estimated cost of `request`, the route its output is learned under and its
/// prices into the request's extensions; fails for a model the price table refuses.
pub(super) fn estimate_into(
    parts: &mut Parts,
    request: &RequestEstimate,
    settings: &Settings,
) -> Result<(), NoPrice> {
    let route = settings
        .learned
        .as_ref()
        .and_then(|learned| Some((learned, (settings.route_key)(parts, request)?)));
    let cost = match route {
        Some((learned, route)) => {
            let cost = request.cost_learned(&settings.defaults, learned, &route);
            // `choices()` is at least 1 (a missing or zero `n` is one choice).
            let choices = NonZeroU64::new(request.choices()).unwrap_or(NonZeroU64::MIN);
            parts
                .extensions
                .insert(OutputRoute::new(learned.clone(), route, choices));
            cost
        }
        None => request.cost(&settings.defaults),
    };
    let cost = match &settings.prices {
        Some((table, counting)) => {
            let model = request.model().unwrap_or_default();
            let priced = table.priced(model, request.service_tier(), *counting)?;
            let cost = cost.with_spend(priced.estimate(&cost));
            parts.extensions.insert(priced);
            cost
        }
        None => cost,
    };
    tracing::trace!(?cost, model = request.model(), "request estimated");
    parts.extensions.insert(cost);
    Ok(())
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Reading { .. } => "reading",
            State::Calling { .. } => "calling",
            State::Refused { .. } => "refused",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

/// Marks a request whose stream asks for usage only for this crate's sake: the estimation
/// layer added `stream_options.include_usage` that the caller had not set. Its response's final
/// usage chunk is removed by [`StripUsageLayer`](crate::provider::StripUsageLayer) before the
/// caller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InjectedStreamUsage;
