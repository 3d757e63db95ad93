//! 120 concurrent calls, fired with `join_all`, through a governed client.
//!
//! The quota is compressed so the run takes seconds: a "minute" lasts one second. The fake
//! client records what reaches it and when, so the example can show that the quota was never
//! exceeded in any window, and that the run finished close to the theoretical minimum
//! (total tokens / rate). Run it with:
//!
//! ```sh
//! cargo run --release --example governed_calls
//! ```

use std::convert::Infallible;
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::join_all;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota, ServiceBuilderExt, Usage};

const CALLS: u64 = 120;
const MINUTE: Duration = Duration::from_secs(1);
const RPM: u64 = 500;
const TPM: u64 = 20_000;

#[tokio::main]
async fn main() -> Result<(), tower_llm_quota::BoxError> {
    let tpm = Limit::new(Dimension::TotalTokens, nz(TPM), MINUTE)?;
    let rpm = Limit::new(Dimension::Requests, nz(RPM), MINUTE)?;
    let budget = Budget::new(Quota::new().with_limit(rpm).with_limit(tpm));

    // The provider side: logs (instant, tokens) of every call it receives and answers with the
    // usage it "really" had: the prompt, plus an answer shorter than max_tokens.
    let log = Arc::new(Mutex::new(Vec::new()));
    let provider_log = log.clone();
    let client = service_fn(move |request: Request<String>| {
        let log = provider_log.clone();
        async move {
            let cost = *request.extensions().get::<Cost>().expect("a cost");
            let output = 20 + request.body().len() as u64 % 150;
            let usage = Usage::new(cost.input_tokens(), output);
            log.lock()
                .unwrap()
                .push((Instant::now(), usage.total_tokens()));
            tokio::time::sleep(Duration::from_millis(50)).await; // the call itself
            let mut response = Response::new(Full::new(Bytes::from("{\"label\":\"billing\"}")));
            response.extensions_mut().insert(usage);
            Ok::<_, Infallible>(response)
        }
    });
    let llm = ServiceBuilder::new()
        .token_budget(budget.clone())
        .reconcile()
        .service(client);

    let start = Instant::now();
    let calls = (0..CALLS).map(|i| {
        let mut llm = llm.clone();
        async move {
            let prompt = "ticket text ".repeat(30 + (i as usize * 37) % 60);
            // ~3.5 characters per token, plus max_tokens = 200.
            let cost = Cost::new(prompt.len() as u64 * 2 / 7, 200);
            let mut request = Request::new(prompt);
            request.extensions_mut().insert(cost);
            let response = llm.ready().await?.call(request).await?;
            response.into_body().collect().await?; // settles the reservation
            Ok::<_, tower_llm_quota::BoxError>(cost.total_tokens())
        }
    });
    let results = join_all(calls).await;
    let elapsed = start.elapsed();

    let estimated: u64 = results.iter().map(|r| *r.as_ref().unwrap()).sum();
    let log = log.lock().unwrap();
    let used: u64 = log.iter().map(|(_, tokens)| tokens).sum();
    let rate = tpm.effective_amount() as f64 / MINUTE.as_secs_f64();
    let minimum = used.saturating_sub(tpm.capacity()) as f64 / rate;
    let busiest = busiest_window(&log, MINUTE);

    println!("{CALLS} calls through TokenBudget + Reconcile; a \"minute\" lasts {MINUTE:?}");
    println!(
        "quota: {TPM} TPM nominal, {} effective (85 % headroom), burst {}",
        tpm.effective_amount(),
        tpm.capacity()
    );
    println!(
        "failed calls:           {}",
        results.iter().filter(|r| r.is_err()).count()
    );
    println!("tokens estimated:       {estimated}");
    println!(
        "tokens used:            {used} ({} refunded)",
        estimated - used
    );
    println!("busiest 1-minute window: {busiest} tokens (nominal limit {TPM})");
    println!("elapsed:                {:.2} s", elapsed.as_secs_f64());
    println!("theoretical minimum:    {minimum:.2} s (tokens beyond the burst / rate)");
    Ok(())
}

/// The most tokens received in any window of `length` starting at a call.
fn busiest_window(log: &[(Instant, u64)], length: Duration) -> u64 {
    log.iter()
        .map(|(start, _)| {
            log.iter()
                .filter(|(at, _)| *at >= *start && *at < *start + length)
                .map(|(_, tokens)| tokens)
                .sum()
        })
        .max()
        .unwrap_or(0)
}

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).expect("non-zero")
}
