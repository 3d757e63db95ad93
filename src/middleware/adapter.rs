//! The middleware: each request through the stack, its attempts through the rest of the chain.

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::{Mutex, PoisonError};
use std::task::Poll;

use bytes::Bytes;
use http::Extensions;
use http_body::Body;
use http_body_util::BodyExt;
use reqwest_middleware::{Middleware, Next};
use tokio::sync::mpsc;
use tower::{Layer, Service};

use super::attempt::AttemptError;
use super::chain::{Attempts, ChainError, RestOfChain, run_attempt};
use super::replay::ReplayBody;
use crate::error::{BoxError, Error};

/// A [`reqwest_middleware::Middleware`] running each request through a tower stack; see the
/// [module documentation](super).
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
