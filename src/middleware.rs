//! Run a `reqwest_middleware` client's requests through a tower stack (feature `reqwest`).
//!
//! [`QuotaMiddleware`] is a [`reqwest_middleware::Middleware`] built from a tower [`Layer`]
//! (a [`QuotaStack`](crate::stack::QuotaStack), or layers of this crate assembled by hand).
//! Each request goes through the layer's stack; the stack's innermost service,
//! [`RestOfChain`], hands every attempt back to the middleware, which runs it through the rest
//! of the middleware chain and the client. Retries of the stack therefore run the rest of the
//! chain again, attempt by attempt, all within the caller's task.
//!
//! # Example
//!
//! ```no_run
//! use std::num::NonZeroU64;
//! use reqwest_middleware::ClientBuilder;
//! use tower_llm_quota::middleware::QuotaMiddleware;
//! use tower_llm_quota::stack::QuotaStack;
//! use tower_llm_quota::{Dimension, Limit, Priority, Quota};
//!
//! # async fn run() -> Result<(), reqwest_middleware::Error> {
//! let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap());
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with(QuotaMiddleware::new(QuotaStack::openai(Quota::new().with_limit(tpm))))
//!     .build();
//!
//! let response = client
//!     .post("https://api.openai.com/v1/chat/completions")
//!     .header("content-type", "application/json")
//!     .body(r#"{"model":"gpt-4o-mini","max_tokens":100,"messages":[{"role":"user","content":"Hi"}]}"#)
//!     .with_extension(Priority::Interactive)
//!     .send()
//!     .await?;
//! let text = response.text().await?; // the end of the body settles the reservation
//! # let _ = text;
//! # Ok(()) }
//! ```
//!
//! # Priority, cost and deadline
//!
//! The request's `reqwest_middleware` extensions become its `http` extensions in the stack: set
//! a request's [`Priority`](crate::Priority), [`Cost`](crate::Cost) or
//! [`Deadline`](crate::Deadline) with
//! [`RequestBuilder::with_extension`](reqwest_middleware::RequestBuilder::with_extension), or
//! for every request of a client with [`ClientBuilder::with_init`] and
//! [`reqwest_middleware::Extension`]. Each attempt then passes its extensions on to the rest of
//! the chain, the caller's included.
//!
//! [`ClientBuilder::with_init`]: reqwest_middleware::ClientBuilder::with_init
//!
//! # Bodies and retries
//!
//! A request body held in memory (`.body(String)`, `.body(Vec<u8>)`, `.json(..)`) becomes a
//! [`ReplayBody`] of bytes: the estimation layer can read it and every retry re-sends it. A
//! streaming body cannot be replayed: it is sent once, and a retry of its request fails with
//! [`AttemptError::BodyNotReplayable`]. Its size is unknown in advance, so the estimation layer
//! does not read it either: give such a request a `Cost` extension.
//!
//! # Errors
//!
//! - Errors of the rest of the chain and of the client come back as they were
//!   (`reqwest_middleware::Error::Reqwest` for reqwest's), unless the stack retried them and
//!   gave up.
//! - Every other failure of the stack is a `reqwest_middleware::Error::Middleware` holding this
//!   crate's [`Error`]: a local decision (`is_too_large()`, `is_queue_full()`,
//!   `is_deadline_exceeded()`, ...) or retries exhausted (`retry_report()`, with the last
//!   failure as its source).
//!
//! ```
//! fn refused_locally(error: &reqwest_middleware::Error) -> bool {
//!     match error {
//!         reqwest_middleware::Error::Middleware(error) => error
//!             .downcast_ref::<tower_llm_quota::Error>()
//!             .is_some_and(tower_llm_quota::Error::is_local),
//!         reqwest_middleware::Error::Reqwest(_) => false,
//!     }
//! }
//! ```
//!
//! A response that ends the retries (a final 429, say) is returned as a response, with its
//! [`RetryReport`](crate::retry::RetryReport) in the response's extensions.

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Extensions;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use reqwest::ResponseBuilderExt;
use reqwest_middleware::{Middleware, Next};
use tokio::sync::{mpsc, oneshot};
use tower::{Layer, Service};

use crate::error::{BoxError, Error};

/// A [`reqwest_middleware::Middleware`] running each request through a tower stack; see the
/// [module documentation](self).
///
/// `S` is the stack, built over [`RestOfChain`]. Every request is served by a clone of it, so
/// the stack's shared state (budget, queue, limits) is shared by all requests of the client.
pub struct QuotaMiddleware<S> {
    stack: Mutex<S>,
}

impl<S> QuotaMiddleware<S> {
    /// Runs requests through `layer` applied to [`RestOfChain`].
    pub fn new<L>(layer: L) -> Self
    where
        L: Layer<RestOfChain, Service = S>,
    {
        Self::from_service(layer.layer(RestOfChain::new()))
    }

    /// Runs requests through `stack`, a service built over [`RestOfChain`].
    pub fn from_service(stack: S) -> Self {
        Self {
            stack: Mutex::new(stack),
        }
    }
}

impl<S> fmt::Debug for QuotaMiddleware<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaMiddleware").finish_non_exhaustive()
    }
}

/// A request's result as the rest of the chain gave it.
type AttemptResult = Result<http::Response<reqwest::Body>, BoxError>;

/// One attempt handed from [`RestOfChain`] to the middleware that runs it.
struct Attempt {
    request: http::Request<ReplayBody>,
    reply: oneshot::Sender<AttemptResult>,
}

/// Where [`RestOfChain`] sends a request's attempts: in the request's extensions.
#[derive(Clone)]
struct Attempts(mpsc::UnboundedSender<Attempt>);

impl<S, ResBody> QuotaMiddleware<S>
where
    S: Service<http::Request<ReplayBody>, Response = http::Response<ResBody>> + Clone + Send,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ResBody: Body + Send + Sync + 'static,
    ResBody::Data: Into<Bytes>,
    ResBody::Error: Into<BoxError>,
{
    async fn run(
        &self,
        request: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let mut request = into_http_request(request).await?;
        request.extensions_mut().extend(extensions.clone());
        let (sender, mut attempts) = mpsc::unbounded_channel();
        request.extensions_mut().insert(Attempts(sender));

        let mut stack = self
            .stack
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut outcome = pin!(async move {
            poll_fn(|cx| stack.poll_ready(cx))
                .await
                .map_err(Into::into)?;
            stack.call(request).await.map_err(Into::into)
        });
        // The attempts run here, beside the stack's future, so that they can borrow `next`.
        let mut running: Vec<Pin<Box<dyn Future<Output = ()> + Send + '_>>> = Vec::new();
        let outcome: Result<http::Response<ResBody>, BoxError> = poll_fn(|cx| {
            while let Poll::Ready(Some(attempt)) = attempts.poll_recv(cx) {
                running.push(Box::pin(run_attempt(next.clone(), attempt)));
            }
            running.retain_mut(|attempt| attempt.as_mut().poll(cx).is_pending());
            outcome.as_mut().poll(cx)
        })
        .await;
        match outcome {
            Ok(response) => Ok(response.map(reqwest::Body::wrap).into()),
            Err(error) => Err(into_middleware_error(error)),
        }
    }
}

impl<S, ResBody> Middleware for QuotaMiddleware<S>
where
    S: Service<http::Request<ReplayBody>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ResBody: Body + Send + Sync + 'static,
    ResBody::Data: Into<Bytes>,
    ResBody::Error: Into<BoxError>,
{
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        request: reqwest::Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> Pin<
        Box<
            dyn Future<Output = reqwest_middleware::Result<reqwest::Response>>
                + Send
                + 'async_trait,
        >,
    >
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.run(request, extensions, next))
    }
}

/// The request as the stack sees it: its body in memory when it is, its extensions kept.
async fn into_http_request(
    request: reqwest::Request,
) -> reqwest_middleware::Result<http::Request<ReplayBody>> {
    let empty = request.body().is_none();
    let replayable = request.body().is_none_or(|body| body.as_bytes().is_some());
    let (parts, body) = http::Request::<reqwest::Body>::try_from(request)?.into_parts();
    let body = if empty {
        ReplayBody::empty()
    } else if replayable {
        // A body in memory is read at once, without a copy.
        ReplayBody::from(body.collect().await?.to_bytes())
    } else {
        ReplayBody::stream(body)
    };
    Ok(http::Request::from_parts(parts, body))
}

/// Runs one attempt through the rest of the chain and answers the stack with its result. When
/// the stack stops waiting for it (a timeout layer gave up, say), the call is dropped at once
/// rather than left running beside its retry.
async fn run_attempt(next: Next<'_>, attempt: Attempt) {
    let Attempt { request, mut reply } = attempt;
    let mut call = pin!(send(next, request));
    let result = poll_fn(|cx| match call.as_mut().poll(cx) {
        Poll::Ready(result) => Poll::Ready(Some(result)),
        Poll::Pending => reply.poll_closed(cx).map(|()| None),
    })
    .await;
    if let Some(result) = result {
        // The stack may have stopped waiting meanwhile: then nobody reads it.
        let _ = reply.send(result);
    }
}

async fn send(next: Next<'_>, request: http::Request<ReplayBody>) -> AttemptResult {
    let (parts, body) = request.into_parts();
    let mut extensions = parts.extensions.clone();
    let body = body.into_reqwest()?;
    let empty = body.is_none();
    let mut request =
        reqwest::Request::try_from(http::Request::from_parts(parts, body.unwrap_or_default()))?;
    if empty {
        *request.body_mut() = None;
    }
    match next.run(request, &mut extensions).await {
        Ok(response) => Ok(into_http_response(response)),
        // Bare, so that the retry classifier recognizes reqwest's connection errors.
        Err(reqwest_middleware::Error::Reqwest(error)) => Err(Box::new(error)),
        Err(error) => Err(Box::new(ChainError(error))),
    }
}

/// The response as the stack sees it, keeping its URL for the caller.
fn into_http_response(response: reqwest::Response) -> http::Response<reqwest::Body> {
    let url = response.url().clone();
    let mut response = http::Response::<reqwest::Body>::from(response);
    if let Ok(marker) = http::Response::builder().url(url).body(()) {
        response
            .extensions_mut()
            .extend(marker.into_parts().0.extensions);
    }
    response
}

/// The stack's error, as the caller of a `reqwest_middleware` client reads it.
fn into_middleware_error(error: BoxError) -> reqwest_middleware::Error {
    let error = match error.downcast::<Error>() {
        Ok(error) if !error.is_inner() => return reqwest_middleware::Error::middleware(*error),
        Ok(error) => match error.into_inner() {
            Some(inner) => inner,
            None => return reqwest_middleware::Error::middleware(AttemptError::Cancelled),
        },
        Err(error) => error,
    };
    let error = match error.downcast::<reqwest::Error>() {
        Ok(error) => return reqwest_middleware::Error::Reqwest(*error),
        Err(error) => error,
    };
    match error.downcast::<ChainError>() {
        Ok(error) => error.0,
        Err(error) => reqwest_middleware::Error::middleware(Error::from_inner(error)),
    }
}

/// An error of the rest of the chain other than reqwest's, carried through the stack.
struct ChainError(reqwest_middleware::Error);

impl fmt::Debug for ChainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for ChainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ChainError {
    /// The middleware's own error, so that the retry classifier can read it.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.0 {
            reqwest_middleware::Error::Middleware(error) => Some(error.as_ref()),
            reqwest_middleware::Error::Reqwest(error) => Some(error),
        }
    }
}

/// The innermost service of a [`QuotaMiddleware`]'s stack: hands each attempt back to the
/// middleware, which sends it through the rest of the chain and the client.
///
/// It serves only requests that came through a [`QuotaMiddleware`]; any other fails with
/// [`AttemptError::OutsideMiddleware`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RestOfChain {
    _private: (),
}

impl RestOfChain {
    /// The service to build a [`QuotaMiddleware`]'s stack over.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Service<http::Request<ReplayBody>> for RestOfChain {
    type Response = http::Response<reqwest::Body>;
    type Error = BoxError;
    type Future = AttemptFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<ReplayBody>) -> Self::Future {
        let Some(Attempts(attempts)) = request.extensions_mut().remove::<Attempts>() else {
            return AttemptFuture::failed(AttemptError::OutsideMiddleware);
        };
        let (reply, answer) = oneshot::channel();
        match attempts.send(Attempt { request, reply }) {
            Ok(()) => AttemptFuture {
                state: AttemptState::Waiting(answer),
            },
            Err(_) => AttemptFuture::failed(AttemptError::Cancelled),
        }
    }
}

/// The response future of [`RestOfChain`]: the answer of the rest of the chain.
pub struct AttemptFuture {
    state: AttemptState,
}

enum AttemptState {
    Waiting(oneshot::Receiver<AttemptResult>),
    Failed(Option<AttemptError>),
}

impl AttemptFuture {
    fn failed(error: AttemptError) -> Self {
        Self {
            state: AttemptState::Failed(Some(error)),
        }
    }
}

impl Future for AttemptFuture {
    type Output = AttemptResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            AttemptState::Waiting(answer) => Pin::new(answer)
                .poll(cx)
                .map(|answer| answer.unwrap_or_else(|_| Err(AttemptError::Cancelled.into()))),
            AttemptState::Failed(error) => {
                Poll::Ready(Err(error.take().unwrap_or(AttemptError::Cancelled).into()))
            }
        }
    }
}

impl fmt::Debug for AttemptFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttemptFuture").finish_non_exhaustive()
    }
}

/// Why [`RestOfChain`] could not send an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttemptError {
    /// A retry of a request whose body was a stream, already sent by an earlier attempt.
    BodyNotReplayable,
    /// The request did not come through a [`QuotaMiddleware`].
    OutsideMiddleware,
    /// The request was abandoned before the rest of the chain answered.
    Cancelled,
}

impl fmt::Display for AttemptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::BodyNotReplayable => "the request's streaming body was already sent",
            Self::OutsideMiddleware => "the request did not come through the quota middleware",
            Self::Cancelled => "the request was abandoned before the client answered",
        })
    }
}

impl std::error::Error for AttemptError {}

/// A request body that every attempt can send: bytes in memory, or a stream sent once; see
/// the [module documentation](self#bodies-and-retries).
///
/// Clones of a body in memory share its bytes; clones of a stream share the one stream, and
/// only the first attempt to send it gets it.
#[derive(Clone)]
pub struct ReplayBody {
    inner: Inner,
}

#[derive(Clone)]
enum Inner {
    /// No body at all (a GET, say): sent as none.
    Empty,
    Bytes(Bytes),
    Stream(Arc<Mutex<Option<reqwest::Body>>>),
}

impl ReplayBody {
    /// No body.
    pub fn empty() -> Self {
        Self {
            inner: Inner::Empty,
        }
    }

    /// A streaming body, sent by one attempt only.
    pub fn stream(body: reqwest::Body) -> Self {
        Self {
            inner: Inner::Stream(Arc::new(Mutex::new(Some(body)))),
        }
    }

    /// Whether every attempt can send this body.
    pub fn is_replayable(&self) -> bool {
        !matches!(self.inner, Inner::Stream(_))
    }

    /// The body for reqwest: `None` for no body.
    fn into_reqwest(self) -> Result<Option<reqwest::Body>, AttemptError> {
        match self.inner {
            Inner::Empty => Ok(None),
            Inner::Bytes(bytes) => Ok(Some(reqwest::Body::from(bytes))),
            Inner::Stream(slot) => slot
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
                .map(Some)
                .ok_or(AttemptError::BodyNotReplayable),
        }
    }
}

impl From<Bytes> for ReplayBody {
    fn from(bytes: Bytes) -> Self {
        Self {
            inner: Inner::Bytes(bytes),
        }
    }
}

impl Default for ReplayBody {
    fn default() -> Self {
        Self::empty()
    }
}

impl Body for ReplayBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.inner {
            Inner::Empty => Poll::Ready(None),
            Inner::Bytes(bytes) if bytes.is_empty() => Poll::Ready(None),
            Inner::Bytes(bytes) => Poll::Ready(Some(Ok(Frame::data(std::mem::take(bytes))))),
            Inner::Stream(slot) => {
                let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
                match slot.as_mut() {
                    Some(body) => Pin::new(body)
                        .poll_frame(cx)
                        .map(|frame| frame.map(|frame| frame.map_err(Into::into))),
                    None => Poll::Ready(Some(Err(AttemptError::BodyNotReplayable.into()))),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Empty => true,
            Inner::Bytes(bytes) => bytes.is_empty(),
            Inner::Stream(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Empty => SizeHint::with_exact(0),
            Inner::Bytes(bytes) => SizeHint::with_exact(bytes.len() as u64),
            Inner::Stream(_) => SizeHint::default(),
        }
    }
}

impl fmt::Debug for ReplayBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("ReplayBody");
        match &self.inner {
            Inner::Empty => debug.field("len", &0),
            Inner::Bytes(bytes) => debug.field("len", &bytes.len()),
            Inner::Stream(_) => debug.field("stream", &true),
        };
        debug.finish()
    }
}
