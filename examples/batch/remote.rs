//! The `--url` mode's client: reqwest, governed through `reqwest_middleware`.
//!
//! The governed run puts [`QuotaMiddleware`] in a `reqwest_middleware` client, as an
//! application would; the naive run uses the same reqwest client without it. [`Reqwest`] turns
//! either into a tower service over `http` requests, so the runner drives both alike.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use tower::{Layer, Service};
use tower_llm_quota::BoxError;
use tower_llm_quota::middleware::{QuotaMiddleware, RestOfChain};
use tower_llm_quota::stack::QuotaStack;

use crate::run::{Meter, Metered};

/// A `reqwest_middleware` client as a tower service.
#[derive(Debug, Clone)]
pub(crate) struct Reqwest(ClientWithMiddleware);

impl Reqwest {
    /// The plain client, without middleware.
    pub(crate) fn plain(client: reqwest::Client) -> Self {
        Self(ClientBuilder::new(client).build())
    }

    /// The client with the governed stack as its middleware; `meter` counts every attempt
    /// that leaves the stack for the rest of the chain (the network).
    pub(crate) fn governed(
        client: reqwest::Client,
        stack: &QuotaStack,
        meter: std::sync::Arc<Meter>,
    ) -> Self {
        let governed = stack.layer(Metered::new(RestOfChain::new(), meter));
        Self(
            ClientBuilder::new(client)
                .with(QuotaMiddleware::from_service(governed))
                .build(),
        )
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl Service<Request<Full<Bytes>>> for Reqwest {
    type Response = Response<reqwest::Body>;
    type Error = BoxError;
    type Future = BoxFuture<Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> Self::Future {
        let client = self.0.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let body = body.collect().await?.to_bytes();
            let url = reqwest::Url::parse(&parts.uri.to_string())?;
            let mut request = reqwest::Request::new(parts.method, url);
            *request.headers_mut() = parts.headers;
            *request.body_mut() = Some(body.into());
            // The item's priority travels in the extensions, to the stack's queue.
            let mut extensions = parts.extensions;
            let response = client
                .execute_with_extensions(request, &mut extensions)
                .await?;
            Ok(Response::from(response))
        })
    }
}
