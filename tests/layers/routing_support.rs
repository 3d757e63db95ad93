//! Helpers of the routing tests: two simulated providers, governed routes, one request sender.
#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use tokio::time::Instant;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};
use tower_llm_quota::retry::SeededJitter;
use tower_llm_quota::routing::{Route, Router, ServedBy};
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{BoxError, Dimension, Priority, Quota, RetryAfterLayer, RetryPolicy};
use tower_llm_quota_sim::{SimBody, SimConfig, Simulator};

use crate::support::limit;

pub type Body = UnsyncBoxBody<Bytes, BoxError>;
pub type Svc = BoxCloneSyncService<Request<Full<Bytes>>, Response<Body>, BoxError>;

pub const MINUTE: Duration = Duration::from_secs(60);

pub fn boxed<S, B>(service: S) -> Svc
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    BoxCloneSyncService::new(
        service
            .map_response(|r: Response<B>| r.map(|b| b.map_err(Into::into).boxed_unsync()))
            .map_err(Into::into),
    )
}

/// A simulated OpenAI-style provider with `latency` before each answer.
pub fn simulator(config: SimConfig, latency: Duration) -> Simulator {
    Simulator::new(config.key("sk", "org").latency(latency, Duration::ZERO))
}

/// A stack of `tokens` per minute, all at once, with seeded retries.
pub fn stack(tokens: u64) -> QuotaStack {
    QuotaStack::openai(Quota::new().with_limit(limit(
        Dimension::TotalTokens,
        tokens,
        MINUTE,
        tokens,
    )))
    .retry_layer(RetryAfterLayer::new(RetryPolicy::new()).jitter(SeededJitter::new(7)))
}

/// The models each route was asked for, in order.
pub type Models = Arc<Mutex<Vec<String>>>;

/// A route named `name`: `stack` around `client`, recording the model of every request.
pub fn route<C>(name: &str, stack: &QuotaStack, client: C, models: &Models) -> Route<Svc>
where
    C: Service<Request<Full<Bytes>>> + Clone + Send + Sync + 'static,
    C::Response: Into<Response<Body>>,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    let models = Arc::clone(models);
    let client = client.map_request(move |request: Request<Full<Bytes>>| {
        let body = request.body().clone().collect().now_or_never();
        let model = body
            .and_then(|b| b.ok())
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b.to_bytes()).ok())
            .and_then(|v| v["model"].as_str().map(str::to_owned))
            .unwrap_or_default();
        models.lock().unwrap().push(model);
        request
    });
    let client = client.map_response(Into::into).map_err(Into::into);
    let client = BoxCloneSyncService::<_, Response<Body>, BoxError>::new(client);
    Route::new(name, boxed(tower::Layer::layer(stack, client)))
        .provider(name)
        .budget(stack.budget().clone())
}

/// A simulator's service with boxed bodies, for [`route`].
pub fn sim_client(sim: &Simulator) -> Svc {
    let service =
        ServiceExt::<Request<Full<Bytes>>>::map_response(sim.service(), |r: Response<SimBody>| {
            r.map(|b| b.map_err(Into::into).boxed_unsync())
        });
    BoxCloneSyncService::new(ServiceExt::<Request<Full<Bytes>>>::map_err(
        service,
        Into::into,
    ))
}

pub fn request(class: Priority, max_tokens: u64, extra: &str) -> Request<Full<Bytes>> {
    let body = format!(
        r#"{{"model":"primary-model","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"Hello there"}}]{extra}}}"#
    );
    Request::post("/v1/chat/completions")
        .header("authorization", "Bearer sk")
        .header("content-type", "application/json")
        .extension(class)
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// Sends one request and reads its body to the end (which settles its reservation).
pub async fn send(
    router: &Router<Svc>,
    request: Request<Full<Bytes>>,
) -> (StatusCode, ServedBy, Duration) {
    let start = Instant::now();
    // The router's own future, not `oneshot`'s: spawned tasks hold it across awaits.
    let mut router = router.clone();
    let response = Service::call(&mut router, request)
        .await
        .expect("an answer");
    let elapsed = start.elapsed();
    let status = response.status();
    let served = response.extensions().get::<ServedBy>().cloned().unwrap();
    response.into_body().collect().await.expect("a whole body");
    (status, served, elapsed)
}

pub fn level(stack: &QuotaStack) -> i64 {
    stack.budget().snapshot().limits()[0].level()
}
