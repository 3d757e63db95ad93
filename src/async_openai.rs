//! An [async-openai] client whose calls go through the stack (feature `async-openai`).
//!
//! async-openai's `middleware` feature takes a tower service as the client's transport
//! ([`Client::with_http_service`]): every call of the client (chat, responses, embeddings,
//! streamed or not) reaches it as an [`HttpRequestFactory`]. [`QuotaTransport`] is that
//! service: it builds the request once and sends it through a [`QuotaMiddleware`], so each call
//! is estimated from its JSON body, waits for its turn in the budget's ordering with its
//! class, is retried on 429 and transient failures (`Retry-After` obeyed), and is settled with
//! the usage in its answer, or at the end of its stream.
//!
//! # Example
//!
//! ```no_run
//! use std::num::NonZeroU64;
//! use async_openai::Client;
//! use async_openai::config::OpenAIConfig;
//! use tower_llm_quota::async_openai::QuotaTransport;
//! use tower_llm_quota::{Dimension, Limit, Priority, Quota, QuotaStack};
//!
//! let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap());
//! let stack = QuotaStack::openai(Quota::new().with_limit(tpm));
//! let transport = QuotaTransport::new(stack);
//! let client = Client::with_config(OpenAIConfig::new()).with_http_service(transport.clone());
//! // A second client for nightly work, over the same budget and queue.
//! let batch = Client::with_config(OpenAIConfig::new())
//!     .with_http_service(transport.with_priority(Priority::Batch));
//! # let _ = (client, batch);
//! ```
//!
//! # Classes
//!
//! A call's class is, in order: the `x-priority` header of the call (`interactive`, `async`
//! or `batch`, set with async-openai's `RequestOptionsBuilder::header`; it is removed before
//! the request leaves), the transport's class ([`QuotaTransport::with_priority`]), or the
//! queue's default. An unknown `x-priority` fails the call with
//! [`OpenAIError::InvalidArgument`], sending nothing.
//!
//! # Retries: the stack's, not async-openai's
//!
//! [`Client::with_http_service`] replaces async-openai's default transport, and with it its
//! own retry layer: the stack retries (429s with the provider's `Retry-After` and
//! rate-limit headers, 5xx, connection failures), paced by the budget, so that a retry waits
//! in its place rather than hitting the provider again. Do not wrap the transport in
//! async-openai's `OpenAIRetryLayer`: it would retry the stack's final answer again, and the
//! provider would see each attempt of each retry. The stack's final answer (a 429 after its
//! retries, a 400) reaches async-openai as a response, which it turns into
//! [`OpenAIError::ApiError`] with the provider's message, as without the transport.
//!
//! # Errors
//!
//! - reqwest's errors come back as [`OpenAIError::Reqwest`].
//! - The stack's own decisions (a request too large for the quota, a full queue, a deadline
//!   passed, retries exhausted on a connection failure) come back as [`OpenAIError::Boxed`]
//!   holding this crate's [`Error`]; [`quota_error`] reads it.
//!
//! ```
//! use async_openai::error::OpenAIError;
//! use tower_llm_quota::async_openai::quota_error;
//!
//! fn refused_locally(error: &OpenAIError) -> bool {
//!     quota_error(error).is_some_and(tower_llm_quota::Error::is_local)
//! }
//! ```
//!
//! # Streams
//!
//! The estimation layer asks the provider for the stream's usage
//! (`stream_options.include_usage`) when the call did not, and removes that final chunk
//! before async-openai reads it; the reservation is settled with it when async-openai stops
//! reading the stream (at `[DONE]`), or refunded down to the estimate's prompt when the
//! stream is dropped before its usage came.
//!
//! [async-openai]: https://docs.rs/async-openai
//! [`Client::with_http_service`]: ::async_openai::Client::with_http_service
//! [`QuotaMiddleware`]: crate::middleware::QuotaMiddleware

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use ::async_openai::error::OpenAIError;
use ::async_openai::middleware::HttpRequestFactory;
use http::Extensions;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware};
use tower::{Layer, Service};

use crate::error::Error;
use crate::middleware::{QuotaMiddleware, RestOfChain};
use crate::priority::Priority;

/// The header a call may set its class with; removed before the request is sent.
pub const PRIORITY_HEADER: &str = "x-priority";

/// An async-openai transport running every call through a tower stack; see the
/// [module documentation](self).
///
/// Cloning it shares the stack (budget, queue, limits): clients built over clones of one
/// transport share one quota.
#[derive(Clone)]
pub struct QuotaTransport {
    client: ClientWithMiddleware,
    priority: Option<Priority>,
}

impl QuotaTransport {
    /// Calls through `layer` (a [`QuotaStack`](crate::QuotaStack), or layers of this crate
    /// assembled by hand) over a new `reqwest::Client`.
    pub fn new<L>(layer: L) -> Self
    where
        L: Layer<RestOfChain>,
        QuotaMiddleware<L::Service>: Middleware,
    {
        Self::with_client(reqwest::Client::new(), layer)
    }

    /// Calls through `layer` over `client` (your TLS, proxy and timeout settings).
    pub fn with_client<L>(client: reqwest::Client, layer: L) -> Self
    where
        L: Layer<RestOfChain>,
        QuotaMiddleware<L::Service>: Middleware,
    {
        let client = ClientBuilder::new(client)
            .with(QuotaMiddleware::new(layer))
            .build();
        Self::from_middleware_client(client)
    }

    /// Calls through a `reqwest_middleware` client built by hand: one holding a
    /// [`QuotaMiddleware`] among other middleware (tracing, say). Without a `QuotaMiddleware`
    /// the calls go out ungoverned.
    pub fn from_middleware_client(client: ClientWithMiddleware) -> Self {
        Self {
            client,
            priority: None,
        }
    }

    /// The same transport (the same stack) giving its calls `priority` when they set none.
    pub fn with_priority(mut self, priority: Priority) -> Self {
        self.priority = Some(priority);
        self
    }

    /// The class calls get when they set none (`None`: the queue's default).
    pub fn priority(&self) -> Option<Priority> {
        self.priority
    }
}

impl fmt::Debug for QuotaTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaTransport")
            .field("priority", &self.priority)
            .finish_non_exhaustive()
    }
}

/// The response future of [`QuotaTransport`].
///
/// # Cancel safety
///
/// Dropping it drops the call wherever it is: a request waiting for the budget leaves its
/// place, one in flight is abandoned and its reservation refunded down to what the provider
/// may already have counted (the stack's rules for a dropped call).
pub type TransportFuture =
    Pin<Box<dyn Future<Output = Result<reqwest::Response, OpenAIError>> + Send + 'static>>;

impl Service<HttpRequestFactory> for QuotaTransport {
    type Response = reqwest::Response;
    type Error = OpenAIError;
    type Future = TransportFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The stack's readiness is awaited inside each call, in its place in the ordering.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, factory: HttpRequestFactory) -> Self::Future {
        let client = self.client.clone();
        let default = self.priority;
        Box::pin(async move {
            // Built once: the stack keeps the body in memory for its own retries.
            let mut request = factory.build().await?;
            let mut extensions = Extensions::new();
            if let Some(priority) = take_priority(request.headers_mut())?.or(default) {
                extensions.insert(priority);
            }
            client
                .execute_with_extensions(request, &mut extensions)
                .await
                .map_err(into_openai_error)
        })
    }
}

/// The class a call's `x-priority` header names, taken off the request.
fn take_priority(headers: &mut http::HeaderMap) -> Result<Option<Priority>, OpenAIError> {
    let Some(value) = headers.remove(PRIORITY_HEADER) else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|name| name.parse().ok())
        .map(Some)
        .ok_or_else(|| {
            OpenAIError::InvalidArgument(format!(
                "{PRIORITY_HEADER}: {value:?} is not a class (expected `interactive`, `async` \
                 or `batch`)"
            ))
        })
}

/// The middleware client's error as async-openai's: reqwest's as `Reqwest`, the rest boxed,
/// this crate's [`Error`] among them whole.
fn into_openai_error(error: reqwest_middleware::Error) -> OpenAIError {
    match error {
        reqwest_middleware::Error::Reqwest(error) => OpenAIError::Reqwest(error),
        reqwest_middleware::Error::Middleware(error) => match error.downcast::<Error>() {
            Ok(error) => OpenAIError::Boxed(Box::new(error)),
            Err(error) => OpenAIError::Boxed(error.into()),
        },
    }
}

/// This crate's decision in an async-openai error, if the stack made one: a local refusal
/// (`is_local()`: too large, queue full, deadline) or retries given up (`retry_report()`).
pub fn quota_error(error: &OpenAIError) -> Option<&Error> {
    match error {
        OpenAIError::Boxed(error) => error.downcast_ref::<Error>(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_class_header_is_read_and_removed() {
        let mut headers = http::HeaderMap::new();
        headers.insert(PRIORITY_HEADER, "batch".parse().unwrap());
        assert_eq!(take_priority(&mut headers).unwrap(), Some(Priority::Batch));
        assert!(headers.is_empty());
        assert_eq!(take_priority(&mut headers).unwrap(), None);
    }

    #[test]
    fn an_unknown_class_is_an_invalid_argument() {
        let mut headers = http::HeaderMap::new();
        headers.insert(PRIORITY_HEADER, "urgent".parse().unwrap());
        let error = take_priority(&mut headers).unwrap_err();
        assert!(
            matches!(&error, OpenAIError::InvalidArgument(message) if message.contains("urgent")),
            "{error}"
        );
    }
}
