//! A job bigger than the quota, with the crate's defaults: 500 tickets sent at once with
//! `join_all` through `QuotaStack::openai`, and through the grouper, at 10,000 tokens a minute
//! (about an hour of quota) against the simulated provider, in virtual time. Nothing is lost
//! to a default wait; a deadline that cannot be met is refused at once with the predicted
//! wait, never after waiting it out.

use std::num::NonZeroU64;
use std::time::Duration;

use bytes::Bytes;
use futures::future::join_all;
use http::Request;
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{Layer, ServiceExt};
use tower_llm_quota::group::{ApiFormat, GroupItem, Grouper};
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{Deadline, Dimension, Limit, Priority, Quota};
use tower_llm_quota_sim::{SimConfig, Simulator};

const TICKETS: usize = 500;
const RPM: u64 = 500;
const TPM: u64 = 10_000;

/// Ticket `i`: 1,000 to 4,000 characters, as the batch story's.
fn ticket(i: usize) -> String {
    let chars = 1_000 + (i * 7_919) % 3_000;
    let sentence = "My invoice shows a charge I do not recognise, please check it. ";
    sentence.repeat(chars / sentence.len() + 1)[..chars].to_owned()
}

fn request(i: usize) -> Request<Full<Bytes>> {
    let body = serde_json::json!({
        "model": "gpt-4o-mini",
        "max_tokens": 200,
        "messages": [
            {"role": "system", "content": "Classify the support ticket."},
            {"role": "user", "content": ticket(i)},
        ],
    });
    Request::post("https://api.openai.com/v1/chat/completions")
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-test")
        .extension(Priority::Batch)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

fn quota() -> Quota {
    let nz = |n| NonZeroU64::new(n).unwrap();
    Quota::new()
        .with_limit(Limit::per_minute(Dimension::Requests, nz(RPM)))
        .with_limit(Limit::per_minute(Dimension::TotalTokens, nz(TPM)))
}

fn simulator() -> Simulator {
    Simulator::new(
        SimConfig::openai(RPM, TPM)
            .latency(Duration::from_millis(500), Duration::ZERO)
            .seed(7),
    )
}

#[tokio::test(start_paused = true)]
async fn a_job_of_an_hour_sent_at_once_loses_nothing_with_the_defaults() {
    let sim = simulator();
    let llm = QuotaStack::openai(quota()).layer(sim.service());
    let start = Instant::now();
    let calls = (0..TICKETS).map(|i| {
        let llm = llm.clone();
        async move {
            let response = llm.oneshot(request(i)).await?;
            response.into_body().collect().await?;
            Ok::<_, tower_llm_quota::BoxError>(())
        }
    });
    let results = join_all(calls).await;
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(ToString::to_string))
        .collect();
    let elapsed = start.elapsed();
    let stats = sim.stats();
    println!(
        "{} of {TICKETS} done, {} failed, in {:.1} min of virtual time, {} provider 429s",
        TICKETS - failed.len(),
        failed.len(),
        elapsed.as_secs_f64() / 60.0,
        stats.rate_limited
    );
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        &failed[..1]
    );
    assert_eq!(stats.rate_limited, 0);
    assert_eq!(stats.completed, TICKETS as u64);
    // The job needs over half an hour of this quota: far past the former 20-minute default.
    assert!(elapsed > Duration::from_secs(30 * 60), "{elapsed:?}");
}

#[tokio::test(start_paused = true)]
async fn a_deadline_that_cannot_be_met_is_refused_at_once_with_the_predicted_wait() {
    let sim = simulator();
    let llm = QuotaStack::openai(quota()).layer(sim.service());
    let start = Instant::now();
    // Every ticket must be sent within 20 minutes: the first ones can be, the rest not.
    let deadline = Deadline::at(start + Duration::from_secs(20 * 60));
    let calls = (0..TICKETS).map(|i| {
        let llm = llm.clone();
        async move {
            let mut request = request(i);
            request.extensions_mut().insert(deadline);
            let outcome = match llm.oneshot(request).await {
                Ok(response) => response
                    .into_body()
                    .collect()
                    .await
                    .map(|_| ())
                    .map_err(|e| {
                        panic!("a body failed: {e}");
                    }),
                Err(error) => Err(error),
            };
            (outcome, start.elapsed())
        }
    });
    let results = join_all(calls).await;
    let mut refused = 0;
    let mut predicted = Vec::new();
    for (outcome, at) in &results {
        if let Err(error) = outcome {
            assert!(error.is_deadline_exceeded(), "{error}");
            // At once, never after waiting it out.
            assert_eq!(*at, Duration::ZERO, "{error}");
            let wait = error.predicted_wait().expect("a predicted wait");
            assert!(wait > Duration::from_secs(20 * 60), "{wait:?}");
            // Read as a rate-limit failure, it says when to come back: that wait.
            let limited = error.rate_limit().expect("a local rate-limit refusal");
            assert_eq!(limited.retry_after(), Some(wait));
            assert!(error.to_string().contains("would wait about"), "{error}");
            predicted.push(wait);
            refused += 1;
        }
    }
    let done = TICKETS - refused;
    println!(
        "deadline 20 min: {done} done, {refused} refused at once (predicted waits {:.1} to {:.1} min)",
        predicted
            .iter()
            .min()
            .map_or(0.0, |w| w.as_secs_f64() / 60.0),
        predicted
            .iter()
            .max()
            .map_or(0.0, |w| w.as_secs_f64() / 60.0),
    );
    // About a third of the hour's job fits in 20 minutes; the rest is told at once.
    assert!((100..300).contains(&done), "{done} done");
    assert_eq!(sim.stats().rate_limited, 0);
    // Every request admitted met its deadline: the prediction counts the estimates, which
    // the real usage never exceeds here.
    assert!(
        results
            .iter()
            .all(|(outcome, at)| outcome.is_err() || *at <= Duration::from_secs(20 * 60 + 60))
    );
}

#[tokio::test(start_paused = true)]
async fn the_same_job_grouped_loses_nothing_with_the_defaults() {
    let sim = simulator();
    let llm = QuotaStack::openai(quota()).layer(sim.service());
    let items = (0..TICKETS)
        .map(|i| GroupItem::new(format!("t{i}"), ticket(i)))
        .collect();
    let start = Instant::now();
    let report = Grouper::new(llm, ApiFormat::OpenAiChat, "Classify each support ticket.")
        .header(
            http::header::AUTHORIZATION,
            "Bearer sk-test".parse().unwrap(),
        )
        .run(items)
        .await;
    let failed = report.outcomes.iter().filter(|o| o.result.is_err()).count();
    println!(
        "grouped: {} of {TICKETS} done in {:.1} min, {} calls, {} provider 429s",
        TICKETS - failed,
        start.elapsed().as_secs_f64() / 60.0,
        report.stats.calls,
        sim.stats().rate_limited
    );
    assert_eq!(
        failed,
        0,
        "{:?}",
        report.outcomes.iter().find(|o| o.result.is_err())
    );
    assert_eq!(sim.stats().rate_limited, 0);
    // A group of ten tickets is larger than the budget can ever admit (its burst is a sixth
    // of 10,000 tokens): the first refusal teaches the grouper the capacity, and the groups
    // are formed under it, one refusal rather than a bisection of every group.
    assert!(
        report.stats.calls < 2 * sim.stats().admitted,
        "{:?}",
        report.stats
    );
}

/// A batch job on OpenAI's flex tier while flex sheds 30 % of its calls (429 "Resource
/// Unavailable", not billed): every ticket is served, at flex, none at the dearer standard
/// tier, with no provider rate limit and no budget pause; the retries come back later.
#[tokio::test(start_paused = true)]
async fn a_flex_batch_job_loses_nothing_when_flex_sheds_calls() {
    const FLEX_TICKETS: usize = 200;
    let sim = Simulator::new(
        SimConfig::openai(RPM, 100_000)
            .latency(Duration::from_millis(500), Duration::ZERO)
            .faults(tower_llm_quota_sim::Faults::none().flex_unavailable(0.3))
            .seed(11),
    );
    let nz = |n| NonZeroU64::new(n).unwrap();
    let quota = Quota::new()
        .with_limit(Limit::per_minute(Dimension::Requests, nz(RPM)))
        .with_limit(Limit::per_minute(Dimension::TotalTokens, nz(100_000)));
    let llm = QuotaStack::openai(quota).layer(sim.service());
    let start = Instant::now();
    let calls = (0..FLEX_TICKETS).map(|i| {
        let llm = llm.clone();
        async move {
            let (parts, body) = request(i).into_parts();
            let mut body: serde_json::Value =
                serde_json::from_slice(&body.collect().await.unwrap().to_bytes()).unwrap();
            body["service_tier"] = "flex".into();
            let request = Request::from_parts(parts, Full::new(Bytes::from(body.to_string())));
            let response = llm.oneshot(request).await?;
            let status = response.status();
            let body = response.into_body().collect().await?.to_bytes();
            let answer: serde_json::Value = serde_json::from_slice(&body)?;
            Ok::<_, tower_llm_quota::BoxError>((status, answer["service_tier"].clone()))
        }
    });
    let results = join_all(calls).await;
    let stats = sim.stats();
    println!(
        "{FLEX_TICKETS} flex tickets: {} served, {} refused for capacity and retried, {} \
         provider 429s for a rate limit, in {:.1} min of virtual time",
        stats.completed,
        stats.tier_unavailable,
        stats.rate_limited,
        start.elapsed().as_secs_f64() / 60.0
    );
    for result in &results {
        let (status, tier) = result.as_ref().expect("a served ticket");
        assert_eq!(*status, 200);
        assert_eq!(tier, "flex");
    }
    assert_eq!(stats.completed, FLEX_TICKETS as u64);
    assert!(stats.tier_unavailable > 30, "{}", stats.tier_unavailable);
    assert_eq!(stats.rate_limited, 0);
}
