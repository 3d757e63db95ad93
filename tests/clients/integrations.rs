//! The governed stack around real HTTP clients (hyper-util's, and reqwest through
//! `reqwest_middleware`), against the simulated provider over loopback, with a quota far below
//! the demand: no 429 reaches the provider's counters, no window holds more than the quota,
//! every item is done.

use std::future::Future;
use std::num::NonZeroU64;
use std::time::Duration;

use bytes::Bytes;
use futures::future::join_all;
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt};
use tower_llm_quota::middleware::QuotaMiddleware;
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{Dimension, Limit, Quota};
use tower_llm_quota_sim::{SimConfig, SimServer, SimStats, Simulator};

/// The simulated provider's "minute".
const MINUTE: Duration = Duration::from_millis(3_000);
const RPM: u64 = 600;
const TPM: u64 = 40_000;
/// Items, each about 550 prompt tokens + 100 max_tokens: 65,000 tokens against 40,000 a
/// "minute", all sent at once.
const ITEMS: usize = 100;

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).unwrap()
}

/// The provider's quota, as the client configures it: the default burst (a sixth) and 80 %
/// headroom. The default 85 % keeps a token bucket's own bound (burst plus one window of
/// refill: 99 % of the quota), but a sliding window also sees the refunds of calls that were in
/// flight when it opened spent again inside it (estimates err high): 80 % leaves them room.
fn quota() -> Quota {
    let limit = |dimension, amount| {
        Limit::new(dimension, nz(amount), MINUTE)
            .and_then(|limit| limit.with_headroom(0.8))
            .unwrap()
    };
    Quota::new()
        .with_limit(limit(Dimension::Requests, RPM))
        .with_limit(limit(Dimension::TotalTokens, TPM))
}

async fn provider() -> (Simulator, SimServer) {
    let simulator = Simulator::new(
        SimConfig::openai(RPM, TPM)
            .minute(MINUTE)
            .latency(Duration::from_millis(20), Duration::from_micros(200))
            .seed(7),
    );
    let server = simulator
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    (simulator, server)
}

fn body(i: usize) -> String {
    let ticket =
        format!("Ticket {i}: my invoice was charged twice and the refund never came. ").repeat(30);
    serde_json::json!({
        "model": "gpt-4o-mini",
        "max_tokens": 100,
        "messages": [
            {"role": "system", "content": "Classify the ticket: billing, bug, account or other."},
            {"role": "user", "content": ticket}
        ]
    })
    .to_string()
}

/// Runs every call at once; counts those that succeeded.
async fn succeeded<E>(calls: impl Iterator<Item = impl Future<Output = Result<bool, E>>>) -> usize {
    join_all(calls)
        .await
        .into_iter()
        .filter(|r| matches!(r, Ok(true)))
        .count()
}

/// What every test asserts of the provider's counters.
fn assert_governed(stats: &SimStats, done: usize) {
    assert_eq!(done, ITEMS, "every item done");
    assert_eq!(stats.rate_limited, 0, "no provider 429");
    assert_eq!(stats.admitted, ITEMS as u64);
    for dimension in [Dimension::Requests, Dimension::TotalTokens] {
        let limit = stats.limit(dimension).unwrap();
        println!(
            "{dimension}: busiest window {} of {}",
            limit.max_in_window, limit.amount
        );
        assert!(
            limit.max_in_window <= limit.amount,
            "{dimension}: {} admitted in one window, above the quota {}",
            limit.max_in_window,
            limit.amount
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_client_governed_by_the_stack() {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let (simulator, server) = provider().await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    // No adapter: hyper-util's client is a tower service already.
    let llm = QuotaStack::openai(quota())
        .concurrency(std::num::NonZeroUsize::new(32).unwrap())
        .layer(client);
    let url = format!("{}/v1/chat/completions", server.url());
    let calls = (0..ITEMS).map(|i| {
        let (mut llm, url) = (llm.clone(), url.clone());
        async move {
            let request = http::Request::post(url)
                .header("authorization", "Bearer sk-test")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body(i))))
                .unwrap();
            let response = llm.ready().await?.call(request).await?;
            let status = response.status();
            response.into_body().collect().await?;
            Ok::<_, tower_llm_quota::BoxError>(status.is_success())
        }
    });
    let done = succeeded(calls).await;
    assert_governed(&simulator.stats(), done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reqwest_middleware_client_governed_by_the_stack() {
    let (simulator, server) = provider().await;
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(QuotaMiddleware::new(
            QuotaStack::openai(quota()).concurrency(std::num::NonZeroUsize::new(32).unwrap()),
        ))
        .build();
    let url = format!("{}/v1/chat/completions", server.url());
    let calls = (0..ITEMS).map(|i| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let response = client
                .post(url)
                .bearer_auth("sk-test")
                .header("content-type", "application/json")
                .body(body(i))
                .send()
                .await?;
            let ok = response.status().is_success();
            response.bytes().await?;
            Ok::<_, reqwest_middleware::Error>(ok)
        }
    });
    let done = succeeded(calls).await;
    assert_governed(&simulator.stats(), done);
}
