//! An async-openai client made quota-aware with one line (`with_http_service`), against the
//! simulated provider over HTTP: 200 chat calls fired at once (a tenth of them interactive,
//! the rest batch, on a second client over the same budget) and one streamed call, at a
//! quota that takes a few seconds to pay for them. The application keeps writing
//! async-openai calls.
//!
//! ```sh
//! cargo run --example async_openai --features async-openai,sim
//! ```

use std::num::NonZeroU64;
use std::time::{Duration, Instant};

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::types::chat::{
    ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequest,
    CreateChatCompletionRequestArgs,
};
use futures::StreamExt;
use futures::future::join_all;
use tower_llm_quota::async_openai::QuotaTransport;
use tower_llm_quota::{BoxError, Dimension, Limit, Priority, Quota, QuotaStack};
use tower_llm_quota_sim::{SimConfig, Simulator};

/// The simulated provider's "minute".
const MINUTE: Duration = Duration::from_secs(1);
const CALLS: usize = 200;

fn chat(text: &str) -> Result<CreateChatCompletionRequest, BoxError> {
    Ok(CreateChatCompletionRequestArgs::default()
        .model("gpt-4o-mini")
        .max_tokens(60u32)
        .messages([ChatCompletionRequestUserMessageArgs::default()
            .content(text)
            .build()?
            .into()])
        .build()?)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // The provider: 600 RPM, 10,000 TPM, a minute lasting a second.
    let simulator = Simulator::new(
        SimConfig::openai(600, 10_000)
            .minute(MINUTE)
            .latency(Duration::from_millis(50), Duration::from_micros(500)),
    );
    let server = simulator.serve("127.0.0.1:0".parse()?).await?;
    let config = OpenAIConfig::new()
        .with_api_base(format!("{}/v1", server.url()))
        .with_api_key("sk-example");

    // The quota, the stack, and the transport: the only lines that are not async-openai's.
    let nz = |n| NonZeroU64::new(n).expect("non-zero");
    let quota = Quota::new()
        .with_limit(Limit::new(Dimension::Requests, nz(600), MINUTE)?)
        .with_limit(Limit::new(Dimension::TotalTokens, nz(10_000), MINUTE)?);
    let stack = QuotaStack::openai(quota);
    let budget = stack.budget().clone();
    let transport = QuotaTransport::new(stack);
    let client = Client::with_config(config.clone())
        .with_http_service(transport.clone().with_priority(Priority::Interactive));
    let batch =
        Client::with_config(config).with_http_service(transport.with_priority(Priority::Batch));

    let start = Instant::now();
    let calls = (0..CALLS).map(|i| {
        let client = if i % 10 == 0 { &client } else { &batch };
        async move {
            let text = format!("Ticket {i}: summarise this complaint in one line. ").repeat(8);
            client
                .chat()
                .create(chat(&text)?)
                .await
                .map_err(BoxError::from)
        }
    });
    let answers = join_all(calls).await;
    let ok = answers.iter().filter(|a| a.is_ok()).count();
    let elapsed = start.elapsed();

    let mut stream = client
        .chat()
        .create_stream(chat("Explain a token bucket in two sentences.")?)
        .await?;
    let mut chunks = 0;
    while let Some(chunk) = stream.next().await {
        chunk?;
        chunks += 1;
    }

    let stats = simulator.stats();
    println!("{CALLS} async-openai calls at once through QuotaTransport in {elapsed:.1?}");
    println!("  answered:              {ok} of {CALLS}");
    println!("  provider 429s:         {}", stats.rate_limited);
    println!("  one streamed call:     {chunks} chunks, settled at its end");
    println!(
        "  tokens served:         {} (prompt {} + completion {})",
        stats.prompt_tokens + stats.completion_tokens,
        stats.prompt_tokens,
        stats.completion_tokens
    );
    println!(
        "  in flight afterwards:  {} (every reservation settled)",
        budget.snapshot().in_flight()
    );
    if ok < CALLS || stats.rate_limited > 0 {
        return Err("CHECK FAILED: a call failed or met a provider 429".into());
    }
    println!("check: every call answered without a provider 429");
    Ok(())
}
