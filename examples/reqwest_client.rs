//! A `reqwest_middleware` client with the governed stack as its middleware, against the
//! simulated provider over HTTP: 60 requests fired at once at a quota that takes a few
//! seconds to pay for them. The application keeps writing reqwest calls.
//!
//! ```sh
//! cargo run --example reqwest_client
//! ```

use std::num::NonZeroU64;
use std::time::{Duration, Instant};

use futures::future::join_all;
use reqwest_middleware::ClientBuilder;
use tower_llm_quota::middleware::QuotaMiddleware;
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{BoxError, Dimension, Limit, Priority, Quota};
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

    let nz = |n| NonZeroU64::new(n).expect("non-zero");
    let quota = Quota::new()
        .with_limit(Limit::new(Dimension::Requests, nz(300), MINUTE)?)
        .with_limit(Limit::new(Dimension::TotalTokens, nz(20_000), MINUTE)?);
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(QuotaMiddleware::new(QuotaStack::openai(quota).concurrency(
            std::num::NonZeroUsize::new(16).expect("non-zero"),
        )))
        .build();

    let start = Instant::now();
    let calls = (0..60).map(|i| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let body = serde_json::json!({
                "model": "gpt-4o-mini",
                "max_tokens": 150,
                "messages": [{"role": "user", "content": format!("Ticket {i}: ").repeat(200)}],
            });
            let response = client
                .post(url)
                .bearer_auth("sk-example")
                .header("content-type", "application/json")
                .with_extension(if i % 10 == 0 {
                    Priority::Interactive
                } else {
                    Priority::Batch
                })
                .body(body.to_string())
                .send()
                .await?;
            let ok = response.status().is_success();
            response.bytes().await?; // the end of the body settles the reservation
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
        "60 requests through a reqwest_middleware client in {:.1?}",
        start.elapsed()
    );
    println!("done: {ok}, provider 429s: {}", stats.rate_limited);
    println!(
        "busiest 1-minute window at the provider: {} tokens of {}",
        tokens.max_in_window, tokens.amount
    );
    Ok(())
}
