//! rig's OpenAI models over [`QuotaMiddleware`], against the simulated provider over HTTP: a
//! completion and a streamed completion, each settled with its usage.

use std::num::NonZeroU64;
use std::time::Duration;

use futures::StreamExt;
use reqwest_middleware::ClientBuilder;
use rig_core::completion::CompletionRequest;
use rig_core::providers::openai::OpenAIConfig;
use rig_reqwest::ReqwestMiddlewareClient;
use tower_llm_quota::middleware::QuotaMiddleware;
use tower_llm_quota::{Budget, Dimension, Limit, Quota, QuotaStack};
use tower_llm_quota_sim::{SimConfig, Simulator};

const METER: u64 = 10_000_000;

#[tokio::test]
async fn a_rig_completion_and_stream_are_settled() {
    let simulator = Simulator::new(SimConfig::openai(600, 60_000).seed(3));
    let server = simulator
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let meter = Limit::new(
        Dimension::TotalTokens,
        NonZeroU64::new(METER).unwrap(),
        Duration::from_secs(100_000 * 86_400),
    )
    .unwrap()
    .with_headroom(1.0)
    .unwrap()
    .with_burst(NonZeroU64::new(METER).unwrap());
    let stack = QuotaStack::openai(Quota::new().with_limit(meter));
    let budget = stack.budget().clone();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(QuotaMiddleware::new(stack))
        .build();
    let openai = OpenAIConfig::new("sk-test")
        .with_base_url(format!("{}/v1", server.url()))
        .connect(ReqwestMiddlewareClient::from(client));
    let model = openai.chat("gpt-4o-mini");

    let response = model
        .call(CompletionRequest::new("What is a token bucket?").max_tokens(40))
        .await
        .unwrap();
    assert!(!response.text().is_empty());
    assert_eq!(
        metered(&budget),
        served(&simulator),
        "settled with its usage"
    );
    assert_eq!(budget.snapshot().in_flight(), 0);

    let mut stream = model
        .stream(CompletionRequest::new("And a leaky bucket?").max_tokens(40))
        .unwrap();
    let mut items = 0;
    while let Some(item) = stream.next().await {
        item.unwrap();
        items += 1;
    }
    assert!(items > 1);
    assert_eq!(
        metered(&budget),
        served(&simulator),
        "settled at the stream's end"
    );
    assert_eq!(budget.snapshot().in_flight(), 0);
    assert_eq!(simulator.stats().received, 2);
}

fn metered(budget: &Budget) -> u64 {
    let snapshot = budget.snapshot();
    METER - u64::try_from(snapshot.limits()[0].level()).unwrap()
}

fn served(simulator: &Simulator) -> u64 {
    let stats = simulator.stats();
    stats.prompt_tokens + stats.completion_tokens
}
