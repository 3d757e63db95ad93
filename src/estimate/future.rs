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
use super::{OutputRoute, read_embeddings, read_request};
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
        Done,
    }
}

/// What a reading future holds besides the body.
struct Read<S> {
    parts: Parts,
    buffer: Buffer,
    service: S,
    settings: Arc<Settings>,
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

    pub(super) fn reading(parts: Parts, body: B, service: S, settings: Arc<Settings>) -> Self {
        Self {
            state: State::Reading { body },
            read: Some(Read {
                parts,
                buffer: Buffer::Empty,
                service,
                settings,
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
                    } = this.read.take().expect("polled after completion");
                    let mut bytes = buffer.freeze();
                    if settings.include_stream_usage {
                        bytes = include_stream_usage(&mut parts, bytes);
                    }
                    if let Err(no_price) = estimate_into(&mut parts, &bytes, &settings) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(Error::unpriced(no_price.into())));
                    }
                    let future = service.call(Request::from_parts(parts, B::from(bytes)));
                    this.state.set(State::Calling { future });
                }
                StateProj::Calling { future } => {
                    let output = ready!(future.poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(output.map_err(Error::from_inner));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// Adds `stream_options.include_usage` to a streaming OpenAI-style request that lacks it, and
/// marks the request so that the usage chunk is removed from its response.
fn include_stream_usage(parts: &mut Parts, body: Bytes) -> Bytes {
    let Ok(serde_json::Value::Object(mut json)) = serde_json::from_slice(&body) else {
        return body;
    };
    let streaming = json.get("stream").and_then(serde_json::Value::as_bool) == Some(true);
    let asked = json
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(serde_json::Value::as_bool)
        == Some(true);
    if !streaming || asked {
        return body;
    }
    let options = json
        .entry("stream_options")
        .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
    let Some(options) = options.as_object_mut() else {
        return body;
    };
    options.insert("include_usage".to_owned(), serde_json::Value::Bool(true));
    let Ok(rewritten) = serde_json::to_vec(&json) else {
        return body;
    };
    parts.headers.remove(http::header::CONTENT_LENGTH);
    parts.extensions.insert(InjectedStreamUsage);
    tracing::debug!("stream usage asked of the provider for this crate");
    Bytes::from(rewritten)
}

/// Puts the estimated cost of `body`, the route its output is learned under and its prices
/// into the request's extensions; fails for a model the price table refuses.
fn estimate_into(parts: &mut Parts, body: &[u8], settings: &Settings) -> Result<(), NoPrice> {
    if body.len() > settings.max_body_bytes {
        return Ok(());
    }
    let estimator = settings.estimator.as_ref();
    let read = match parts.uri.path().ends_with("/embeddings") {
        true => read_embeddings(body, estimator),
        false => read_request(body, estimator, &settings.defaults),
    };
    let Some(request) = read else {
        tracing::debug!("request body not estimated: not a known JSON request");
        return Ok(());
    };
    let route = settings
        .learned
        .as_ref()
        .and_then(|learned| Some((learned, (settings.route_key)(parts, &request)?)));
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
