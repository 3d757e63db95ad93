//! hyper-util's client, governed by the stack with no adapter, against the simulated provider
//! over HTTP: 60 requests fired at once at a quota that takes a few seconds to pay for them.
//!
//! ```sh
//! cargo run --example hyper_client
//! ```

use std::num::NonZeroU64;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::join_all;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{Layer, Service, ServiceExt};
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{BoxError, Dimension, Limit, Quota};
use tower_llm_quota_sim::{SimConfig, Simulator};

/// The simulated provider's "minute".
const MINUTE: Duration = Duration::from_secs(1);

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // The provider: 300 RPM, 20,000 TPM, a minute lasting a second, answers within 0.2 s.
    let simulator = Simulator::new(
        SimConfig::openai(300, 20_000)
            .minute(MINUTE)
            .latency(Duration::from_millis(50), Duration::from_millis(1)),
    );
    let server = simulator.serve("127.0.0.1:0".parse()?).await?;
    let url = format!("{}/v1/chat/completions", server.url());

    // The client: the same quota, and the stack around hyper-util's client as it is.
    let nz = |n| NonZeroU64::new(n).expect("non-zero");
    let quota = Quota::new()
        .with_limit(Limit::new(Dimension::Requests, nz(300), MINUTE)?)
        .with_limit(Limit::new(Dimension::TotalTokens, nz(20_000), MINUTE)?);
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let llm = QuotaStack::openai(quota)
        .concurrency(std::num::NonZeroUsize::new(16).expect("non-zero"))
        .layer(client);

    let start = Instant::now();
    let calls = (0..60).map(|i| {
        let (mut llm, url) = (llm.clone(), url.clone());
        async move {
            let body = serde_json::json!({
                "model": "gpt-4o-mini",
                "max_tokens": 150,
                "messages": [{"role": "user", "content": format!("Ticket {i}: ").repeat(200)}],
            });
            let request = http::Request::post(url)
                .header("authorization", "Bearer sk-example")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))?;
            let response = llm.ready().await?.call(request).await?;
            let ok = response.status().is_success();
            response.into_body().collect().await?; // settles the reservation
            Ok::<_, BoxError>(ok)
        }
    });
    let ok = join_all(calls)
        .await
        .into_iter()
        .filter(|r| matches!(r, Ok(true)))
        .count();

    let stats = simulator.stats();
    let tokens = stats.limit(Dimension::TotalTokens).expect("a TPM limit");
    println!(
        "60 requests through hyper-util's client in {:.1?}",
        start.elapsed()
    );
    println!("done: {ok}, provider 429s: {}", stats.rate_limited);
    println!(
        "busiest 1-minute window at the provider: {} tokens of {}",
        tokens.max_in_window, tokens.amount
    );
    Ok(())
}
