//! rig's OpenAI models made quota-aware: rig sends through a `reqwest_middleware` client, and
//! [`QuotaMiddleware`] is a middleware. Against the simulated provider over HTTP: 120
//! completions fired at once (batch work, the class set for every request of the client) at
//! a quota that takes a few seconds to pay for them, then one streamed completion, with the
//! budget's levels after each.
//!
//! ```sh
//! cargo run --example rig --features reqwest,sim
//! ```

use std::num::NonZeroU64;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::join_all;
use reqwest_middleware::{ClientBuilder, Extension};
use rig_core::completion::CompletionRequest;
use rig_core::providers::openai::OpenAIConfig;
use rig_reqwest::ReqwestMiddlewareClient;
use tower_llm_quota::middleware::QuotaMiddleware;
use tower_llm_quota::{BoxError, Budget, Dimension, Limit, Priority, Quota, QuotaStack};
use tower_llm_quota_sim::{SimConfig, Simulator};

/// The simulated provider's "minute".
const MINUTE: Duration = Duration::from_secs(1);
const CALLS: usize = 120;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // The provider: 600 RPM, 4,000 TPM, a minute lasting a second.
    let simulator = Simulator::new(
        SimConfig::openai(600, 4_000)
            .minute(MINUTE)
            .latency(Duration::from_millis(50), Duration::from_micros(500)),
    );
    let server = simulator.serve("127.0.0.1:0".parse()?).await?;

    // The stack as a middleware of the client rig sends through.
    let nz = |n| NonZeroU64::new(n).expect("non-zero");
    let quota = Quota::new()
        .with_limit(Limit::new(Dimension::Requests, nz(600), MINUTE)?)
        .with_limit(Limit::new(Dimension::TotalTokens, nz(4_000), MINUTE)?);
    let stack = QuotaStack::openai(quota);
    let budget = stack.budget().clone();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with_init(Extension(Priority::Batch))
        .with(QuotaMiddleware::new(stack))
        .build();
    let openai = OpenAIConfig::new("sk-example")
        .with_base_url(format!("{}/v1", server.url()))
        .connect(ReqwestMiddlewareClient::from(client));
    let model = openai.chat("gpt-4o-mini");

    let start = Instant::now();
    let calls = (0..CALLS).map(|i| {
        let request =
            CompletionRequest::new(format!("Ticket {i}: classify this complaint. ").repeat(10))
                .max_tokens(40);
        model.call(request)
    });
    let answers = join_all(calls).await;
    let ok = answers.iter().filter(|a| a.is_ok()).count();
    println!(
        "{CALLS} rig completions at once through QuotaMiddleware in {:.1?}",
        start.elapsed()
    );
    println!("  answered: {ok} of {CALLS}");
    print_levels(&budget, &simulator);

    let mut stream =
        model.stream(CompletionRequest::new("Explain a token bucket.").max_tokens(60))?;
    let mut items = 0;
    while let Some(item) = stream.next().await {
        item?;
        items += 1;
    }
    println!("one streamed completion: {items} items, settled at its end");
    print_levels(&budget, &simulator);

    let stats = simulator.stats();
    if ok < CALLS || stats.rate_limited > 0 || budget.snapshot().in_flight() > 0 {
        return Err("CHECK FAILED: a call failed, met a provider 429 or was left unsettled".into());
    }
    println!("check: every call answered and settled without a provider 429");
    Ok(())
}

/// The budget's levels beside what the provider served.
fn print_levels(budget: &Budget, simulator: &Simulator) {
    let stats = simulator.stats();
    let snapshot = budget.snapshot();
    let levels: Vec<String> = snapshot
        .limits()
        .iter()
        .map(|limit| {
            format!(
                "{} {} of {}",
                limit.limit().dimension(),
                limit.level(),
                limit.capacity()
            )
        })
        .collect();
    println!(
        "  budget: {}; in flight {}; provider: {} tokens served, {} 429s",
        levels.join(", "),
        snapshot.in_flight(),
        stats.prompt_tokens + stats.completion_tokens,
        stats.rate_limited
    );
}
