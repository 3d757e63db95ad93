//! The innermost service of the stack: each attempt handed back to the middleware, which sends
//! it through the rest of the chain and the client.

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::{Context, Poll};

use reqwest::ResponseBuilderExt;
use reqwest_middleware::Next;
use tokio::sync::{mpsc, oneshot};
use tower::Service;

use super::attempt::{AttemptError, AttemptFuture, AttemptResult};
use super::replay::ReplayBody;
use crate::error::BoxError;

/// One attempt handed from [`RestOfChain`] to the middleware that runs it.
pub(super) struct Attempt {
    pub(super) request: http::Request<ReplayBody>,
    pub(super) reply: oneshot::Sender<AttemptResult>,
}

/// Where [`RestOfChain`] sends a request's attempts: in the request's extensions.
#[derive(Clone)]
pub(super) struct Attempts(pub(super) mpsc::UnboundedSender<Attempt>);

/// The innermost service of a [`QuotaMiddleware`](super::QuotaMiddleware)'s stack: hands each attempt back to the
/// middleware, which sends it through the rest of the chain and the client.
///
/// It serves only requests that came through a [`QuotaMiddleware`](super::QuotaMiddleware); any other fails with
/// [`AttemptError::OutsideMiddleware`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RestOfChain {
    _private: (),
}

impl RestOfChain {
    /// The service to build a [`QuotaMiddleware`](super::QuotaMiddleware)'s stack over.
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
            Ok(()) => AttemptFuture::waiting(answer),
            Err(_) => AttemptFuture::failed(AttemptError::Cancelled),
        }
    }
}

/// Runs one attempt through the rest of the chain and answers the stack with its result. When
/// the stack stops waiting for it (a timeout layer gave up, say), the call is dropped at once
/// rather than left running beside its retry.
pub(super) async fn run_attempt(next: Next<'_>, attempt: Attempt) {
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

/// An error of the rest of the chain other than reqwest's, carried through the stack.
pub(super) struct ChainError(pub(super) reqwest_middleware::Error);

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
