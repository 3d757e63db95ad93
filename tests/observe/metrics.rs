//! With the `metrics` feature, a scripted scenario records exact values in every series:
//! 10 requests, 2 refused locally, 1 provider 429 then a successful retry, known usage.
#![cfg(feature = "metrics")]

use tower_llm_quota_test_support as support;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use support::{budget, limit};
use tower::{ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::provider::{Profile, ProviderUsage, Scope};
use tower_llm_quota::retry::Jitter;
use tower_llm_quota::{
    Cost, Dimension, PriorityQueueLayer, ReconcileLayer, RetryAfterLayer, RetryPolicy,
    TokenBudgetLayer,
};

const SEC: Duration = Duration::from_secs(1);

struct NoJitter;

impl Jitter for NoJitter {
    fn fraction(&self) -> f64 {
        0.0
    }
}

/// `name{label=value,...}` for every series, with its value.
fn series(
    snapshot: Vec<(
        CompositeKey,
        Option<metrics::Unit>,
        Option<metrics::SharedString>,
        DebugValue,
    )>,
) -> HashMap<String, DebugValue> {
    snapshot
        .into_iter()
        .map(|(key, _, _, value)| {
            let (kind, key) = key.into_parts();
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            let kind = match kind {
                MetricKind::Counter => "counter",
                MetricKind::Gauge => "gauge",
                MetricKind::Histogram => "histogram",
            };
            (
                format!("{kind} {}{{{}}}", key.name(), labels.join(",")),
                value,
            )
        })
        .collect()
}

fn counter(series: &HashMap<String, DebugValue>, name: &str) -> u64 {
    match series.get(&format!("counter {name}")) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{name}: {other:?}"),
    }
}

fn samples(series: &HashMap<String, DebugValue>, name: &str) -> Vec<f64> {
    match series.get(&format!("histogram {name}")) {
        Some(DebugValue::Histogram(values)) => values.iter().map(|v| v.into_inner()).collect(),
        other => panic!("{name}: {other:?}"),
    }
}

/// Runs `test` on a current-thread runtime with a paused clock, this thread recording into a
/// debugging recorder that `test` reads through its snapshotter.
fn on_paused_runtime<F: std::future::Future<Output = ()>>(test: impl FnOnce(Snapshotter) -> F) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(test(snapshotter));
    });
}

/// `n` tasks each waiting to reserve 10 tokens of `budget`.
fn waiting(
    budget: &tower_llm_quota::Budget,
    n: usize,
) -> Vec<
    tokio::task::JoinHandle<
        Result<tower_llm_quota::Reservation, tower_llm_quota::error::ReserveError>,
    >,
> {
    (0..n)
        .map(|_| {
            let budget = budget.clone();
            tokio::spawn(async move { budget.reserve(Cost::new(10, 0)).await })
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_scripted_scenario_records_every_series() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // This thread's recorder (the runtime runs every task on it): the binary's other tests
    // keep theirs.
    let _recording = metrics::set_default_local_recorder(&recorder);

    let budget = budget([limit(Dimension::TotalTokens, 60_000, 60 * SEC, 1_000)]);
    let calls = Arc::new(Mutex::new(0u32));
    let counted = calls.clone();
    let client = service_fn(move |_request: Request<String>| {
        let call = {
            let mut calls = counted.lock().unwrap();
            *calls += 1;
            *calls
        };
        async move {
            let mut response = if call == 3 {
                let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
                *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                let headers = response.headers_mut();
                headers.insert("retry-after", "1".parse().unwrap());
                headers.insert("x-ratelimit-remaining-tokens", "0".parse().unwrap());
                response
            } else {
                let body = r#"{"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":20,"total_tokens":120}}"#;
                Response::new(Full::new(Bytes::from_static(body.as_bytes())))
            };
            response
                .headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            tokio::time::sleep(SEC / 4).await;
            Ok::<_, Infallible>(response)
        }
    });
    let llm = ServiceBuilder::new()
        .layer(RetryAfterLayer::new(RetryPolicy::new()).jitter(NoJitter))
        .layer(PriorityQueueLayer::default())
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::with_extractor(ProviderUsage::new(
            Profile::openai(),
        )))
        .service(client);

    let scope = Scope {
        provider: Some("openai".into()),
        model: Some("gpt-4o".into()),
        key: None,
    };
    for i in 0..10 {
        let mut request = Request::new(String::new());
        // Two requests ask for more than the burst of 1,000 tokens: refused locally.
        let cost = if i == 5 || i == 7 {
            Cost::new(2_000, 50)
        } else {
            Cost::new(100, 50)
        };
        request.extensions_mut().insert(cost);
        request.extensions_mut().insert(scope.clone());
        match llm.clone().oneshot(request).await {
            Ok(response) => {
                assert_eq!(response.status(), StatusCode::OK);
                response.into_body().collect().await.unwrap();
            }
            Err(error) => assert!(error.is_too_large()),
        }
    }

    let series = series(snapshotter.snapshot().into_vec());
    let by = "model=gpt-4o,provider=openai";
    assert_eq!(
        counter(&series, &format!("llm_requests_total{{{by},status=200}}")),
        8
    );
    assert_eq!(
        counter(&series, &format!("llm_requests_total{{{by},status=429}}")),
        1
    );
    // 8 admitted requests and the one retried: 9 reservations; usage from the 8 answers.
    assert_eq!(
        counter(
            &series,
            &format!("llm_tokens_reserved_total{{dimension=input_tokens,{by}}}")
        ),
        900
    );
    assert_eq!(
        counter(
            &series,
            &format!("llm_tokens_reserved_total{{dimension=output_tokens,{by}}}")
        ),
        450
    );
    assert_eq!(
        counter(
            &series,
            &format!("llm_tokens_used_total{{dimension=input_tokens,{by},service_tier=unknown}}")
        ),
        800
    );
    assert_eq!(
        counter(
            &series,
            &format!("llm_tokens_used_total{{dimension=output_tokens,{by},service_tier=unknown}}")
        ),
        160
    );
    assert_eq!(
        counter(
            &series,
            &format!("llm_retries_total{{error_type=rate_limited,{by}}}")
        ),
        1
    );
    assert_eq!(
        counter(
            &series,
            "llm_rate_limit_hits_total{decision=local,limit_type=total_tokens}"
        ),
        2
    );
    assert_eq!(
        counter(
            &series,
            "llm_rate_limit_hits_total{decision=provider,limit_type=tokens}"
        ),
        1
    );
    assert!(!series.contains_key("counter llm_usage_missing_total{}"));
    // Reserved / used: 1.0 for input, 2.5 for output, once per settled answer.
    assert_eq!(
        samples(&series, "llm_estimate_error_ratio{dimension=input_tokens}"),
        [1.0; 8]
    );
    assert_eq!(
        samples(&series, "llm_estimate_error_ratio{dimension=output_tokens}"),
        [2.5; 8]
    );
    // Queue time and call time apart: 9 admissions from the budget's ordering (the 2 refused
    // ones never waited there), 9 calls of 250 ms.
    let queued = samples(&series, "llm_queue_wait_seconds{priority=async}");
    assert_eq!(queued.len(), 9);
    assert!(queued.iter().all(|&q| q < 0.001), "{queued:?}");
    assert_eq!(
        samples(&series, &format!("llm_call_seconds{{{by}}}")),
        [0.25; 9]
    );
    // The retry came back to its place in the ordering a millisecond before its time, and
    // left it admitted: the depth is back at 0.
    assert_eq!(
        series.get("gauge llm_queue_depth{priority=async,queue=default}"),
        Some(&DebugValue::Gauge(0.0.into()))
    );
    assert!(
        series.contains_key(
            "gauge llm_budget_level{dimension=total_tokens,queue=default,window_seconds=60}"
        ),
        "{:?}",
        series
            .keys()
            .filter(|k| k.contains("llm_budget"))
            .collect::<Vec<_>>()
    );
    // Alone on its key, the adaptive share plans for the whole quota.
    assert_eq!(
        series
            .get("gauge llm_budget_share{dimension=total_tokens,queue=default,window_seconds=60}"),
        Some(&DebugValue::Gauge(1.0.into()))
    );
}

#[test]
fn duplicates_suppressed_are_recorded() {
    use tower::Layer;
    use tower_llm_quota::idempotency::{IdempotencyLayer, Operation};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let client = service_fn(|_request: Request<Full<Bytes>>| async {
                tokio::time::sleep(SEC).await;
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
            });
            let llm = IdempotencyLayer::in_memory().layer(client);
            let request = || {
                Request::post("/v1/chat/completions")
                    .extension(Operation::new("acme", "classify"))
                    .body(Full::new(Bytes::from_static(b"{\"model\":\"m\"}")))
                    .unwrap()
            };
            // Four duplicates in flight with the first, then one after it completed.
            let calls: Vec<_> = (0..5).map(|_| llm.clone().oneshot(request())).collect();
            for response in futures::future::join_all(calls).await {
                response.unwrap().into_body().collect().await.unwrap();
            }
            let replayed = llm.clone().oneshot(request()).await.unwrap();
            replayed.into_body().collect().await.unwrap();
        });
    });
    let series = series(snapshotter.snapshot().into_vec());
    assert_eq!(
        counter(
            &series,
            "llm_duplicate_suppressed_total{task_type=classify}"
        ),
        5
    );
}

/// Every budget's ordering has its own depth gauge, labelled by its quota's name: two
/// accounts' queues no longer overwrite each other's depth.
#[test]
fn each_budget_s_depth_has_its_own_label() {
    on_paused_runtime(|snapshotter| async move {
        let account = |name: &str| {
            let quota = tower_llm_quota::Quota::new()
                .with_limit(limit(Dimension::TotalTokens, 1_000, SEC, 1_000))
                .with_name(name);
            let budget = tower_llm_quota::Budget::new(quota);
            budget
                .try_reserve(Cost::new(1_000, 0))
                .unwrap()
                .charge_estimate();
            budget
        };
        let (openai, anthropic) = (account("openai"), account("anthropic"));
        let (a, b) = (waiting(&openai, 3), waiting(&anthropic, 1));
        tokio::task::yield_now().await;
        let series = series(snapshotter.snapshot().into_vec());
        let depth = |queue: &str| {
            series.get(&format!(
                "gauge llm_queue_depth{{priority=async,queue={queue}}}"
            ))
        };
        assert_eq!(depth("openai"), Some(&DebugValue::Gauge(3.0.into())));
        assert_eq!(depth("anthropic"), Some(&DebugValue::Gauge(1.0.into())));
        for task in a.into_iter().chain(b) {
            task.abort();
        }
    });
}

/// Budgets nobody named share the `default` label: their depths add up (3 and 2 waiting read
/// 5), rather than the last one written winning; and a request leaving takes itself off.
#[test]
fn unnamed_budgets_add_up_in_one_depth_gauge() {
    on_paused_runtime(|snapshotter| async move {
        let spent = || {
            let quota = tower_llm_quota::Quota::new().with_limit(limit(
                Dimension::TotalTokens,
                1_000,
                SEC,
                1_000,
            ));
            let budget = tower_llm_quota::Budget::new(quota);
            budget
                .try_reserve(Cost::new(1_000, 0))
                .unwrap()
                .charge_estimate();
            budget
        };
        let (one, two) = (spent(), spent());
        let (a, b) = (waiting(&one, 3), waiting(&two, 2));
        tokio::task::yield_now().await;
        let depth = || {
            let series = series(snapshotter.snapshot().into_vec());
            match series.get("gauge llm_queue_depth{priority=async,queue=default}") {
                Some(DebugValue::Gauge(value)) => value.into_inner(),
                other => panic!("llm_queue_depth: {other:?}"),
            }
        };
        assert_eq!(depth(), 5.0);
        for task in b {
            task.abort();
        }
        tokio::task::yield_now().await;
        // The debugging recorder's snapshot resets a gauge to 0: what follows is the change.
        assert_eq!(depth(), -2.0);
        for task in a {
            task.abort();
        }
    });
}
