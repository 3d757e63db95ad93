//! RetryAfterLayer under tokio's paused clock: what is retried, when, how often, and what a 429
//! does to everyone sharing the budget.

use tower_llm_quota_test_support as support;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use support::{budget, limit, tokens_10_per_sec};
use tokio::time::{self, Instant};
use tower::util::BoxCloneService;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::retry::{GaveUp, Jitter, Permanent, RetryBody, Transient};
use tower_llm_quota::{
    Cost, Dimension, Error, Priority, PriorityQueueLayer, QueueConfig, ReconcileLayer,
    RetryAfterLayer, RetryPolicy, TokenBudgetLayer,
    retry::{FailureClass, RetryReport},
};

const SEC: Duration = Duration::from_secs(1);

/// Always the same fraction: exact waits.
struct Fixed(f64);

impl Jitter for Fixed {
    fn fraction(&self) -> f64 {
        self.0
    }
}

/// One scripted answer of the provider.
#[derive(Clone)]
enum Answer {
    Status(u16, &'static [(&'static str, &'static str)], &'static str),
    Reset,
}

fn ok() -> Answer {
    Answer::Status(200, &[], "ok")
}

type Log = Arc<Mutex<Vec<(String, Duration)>>>;

/// A provider that answers from a script (the last answer repeats) and logs each call's label
/// and time.
type Provider = BoxCloneService<Request<String>, Response<Full<Bytes>>, std::io::Error>;

fn provider(script: Vec<Answer>, start: Instant) -> (Provider, Log) {
    let script = Arc::new(Mutex::new(VecDeque::from(script)));
    let log: Log = Default::default();
    let calls = log.clone();
    let service = service_fn(move |request: Request<String>| {
        let answer = {
            let mut script = script.lock().unwrap();
            if script.len() > 1 {
                script.pop_front().unwrap()
            } else {
                script.front().cloned().unwrap()
            }
        };
        calls
            .lock()
            .unwrap()
            .push((request.body().clone(), start.elapsed()));
        async move {
            match answer {
                Answer::Reset => Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "reset",
                )),
                Answer::Status(status, headers, body) => {
                    let mut response =
                        Response::new(Full::new(Bytes::from_static(body.as_bytes())));
                    *response.status_mut() = StatusCode::from_u16(status).unwrap();
                    for (name, value) in headers {
                        response.headers_mut().insert(*name, value.parse().unwrap());
                    }
                    Ok(response)
                }
            }
        }
    });
    (BoxCloneService::new(service), log)
}

fn request(label: &str, priority: Priority) -> Request<String> {
    let mut request = Request::new(label.to_owned());
    request.extensions_mut().insert(priority);
    request.extensions_mut().insert(Cost::new(10, 0));
    request
}

fn times(log: &Log) -> Vec<f64> {
    log.lock()
        .unwrap()
        .iter()
        .map(|(_, at)| at.as_secs_f64())
        .collect()
}

type Client = BoxCloneService<Request<String>, Response<RetryBody<Full<Bytes>>>, Error>;

fn retrying(policy: RetryPolicy, fraction: f64, script: Vec<Answer>) -> (Client, Log) {
    let (provider, log) = provider(script, Instant::now());
    let layer = RetryAfterLayer::new(policy).jitter(Fixed(fraction));
    (BoxCloneService::new(layer.layer(provider)), log)
}

use tower::Layer;

fn report_of<B>(response: &Response<B>) -> RetryReport {
    *response
        .extensions()
        .get::<RetryReport>()
        .expect("a report")
}

#[tokio::test(start_paused = true)]
async fn the_providers_wait_is_a_minimum_and_the_retry_succeeds() {
    let answers = vec![Answer::Status(429, &[("retry-after", "2")], "{}"), ok()];
    let (client, log) = retrying(RetryPolicy::new(), 0.25, answers);
    let response = client.oneshot(request("a", Priority::Async)).await.unwrap();
    assert_eq!(response.status(), 200);
    // 2 s, then a quarter of twice the larger of the hint and the 0.5 s window: 1 s.
    assert_eq!(times(&log), [0.0, 3.0]);
    let report = report_of(&response);
    assert_eq!((report.attempts(), report.waited()), (2, 3 * SEC));
    assert_eq!(report.gave_up(), None);
    assert_eq!(report.asked_wait(), Some(2 * SEC));
}

#[tokio::test(start_paused = true)]
async fn permanent_failures_are_never_retried() {
    for (answer, class) in [
        (Answer::Status(400, &[], "{}"), Permanent::Client),
        (Answer::Status(401, &[], "{}"), Permanent::Auth),
        (
            Answer::Status(429, &[], r#"{"error":{"code":"insufficient_quota"}}"#),
            Permanent::QuotaExhausted,
        ),
        (
            Answer::Status(503, &[("x-should-retry", "false")], "{}"),
            Permanent::Client,
        ),
    ] {
        let (client, log) = retrying(RetryPolicy::new(), 0.0, vec![answer, ok()]);
        let response = client.oneshot(request("a", Priority::Batch)).await.unwrap();
        assert_eq!(times(&log), [0.0]);
        let report = report_of(&response);
        assert_eq!(report.last_class(), Some(FailureClass::Permanent(class)));
        assert_eq!(report.gave_up(), Some(GaveUp::Permanent));
        // The error body is handed back, read but intact.
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert!(body.starts_with(b"{"));
    }
}

#[tokio::test(start_paused = true)]
async fn the_providers_should_retry_header_wins_over_the_status() {
    let answers = vec![
        Answer::Status(400, &[("x-should-retry", "true")], "{}"),
        ok(),
    ];
    let (client, log) = retrying(RetryPolicy::new(), 0.0, answers);
    let response = client.oneshot(request("a", Priority::Batch)).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(times(&log).len(), 2);
}

#[tokio::test(start_paused = true)]
async fn each_class_stops_at_its_attempts_and_its_time() {
    // Interactive: 3 attempts. Full jitter at fraction 1: waits 0.5 s, then 1 s.
    let answers = vec![Answer::Status(503, &[], "busy")];
    let (client, log) = retrying(RetryPolicy::new(), 1.0, answers.clone());
    let response = client
        .oneshot(request("i", Priority::Interactive))
        .await
        .unwrap();
    assert_eq!(times(&log), [0.0, 0.5, 1.5]);
    let report = report_of(&response);
    assert_eq!(report.gave_up(), Some(GaveUp::Attempts));
    assert_eq!(report.last_status(), Some(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!(
        report.last_class(),
        Some(FailureClass::Transient(Transient::Server))
    );

    // Batch: 8 attempts, but no more than 10 s in all: waits 0.5, 1, 2, 4 (7.5 s); the next
    // (8 s) would end past 10 s, so it is not started.
    let policy = RetryPolicy::new().max_total(Priority::Batch, 10 * SEC);
    let (client, log) = retrying(policy, 1.0, answers);
    let response = client.oneshot(request("b", Priority::Batch)).await.unwrap();
    assert_eq!(times(&log), [0.0, 0.5, 1.5, 3.5, 7.5]);
    assert_eq!(report_of(&response).gave_up(), Some(GaveUp::Time));
}

#[tokio::test(start_paused = true)]
async fn a_wait_beyond_the_honoured_maximum_is_permanent() {
    let answers = vec![Answer::Status(
        429,
        &[("retry-after", "86400")],
        "Please retry after 86400 seconds.",
    )];
    let (client, log) = retrying(RetryPolicy::new(), 0.0, answers);
    let response = client.oneshot(request("a", Priority::Batch)).await.unwrap();
    assert_eq!(times(&log), [0.0]);
    let report = report_of(&response);
    assert_eq!(report.gave_up(), Some(GaveUp::WaitTooLong));
    assert_eq!(report.asked_wait(), Some(86_400 * SEC));
    assert_eq!(
        report.last_class(),
        Some(FailureClass::Permanent(Permanent::WaitTooLong))
    );
    // The final 429 is also described as one normalized rate-limit failure.
    let rate_limit = response
        .extensions()
        .get::<tower_llm_quota::provider::RateLimitError>()
        .unwrap();
    assert_eq!(
        rate_limit.decision(),
        tower_llm_quota::provider::Decision::Provider
    );
    assert_eq!(rate_limit.retry_after(), Some(86_400 * SEC));
    assert!(!rate_limit.is_transient());
}

#[tokio::test(start_paused = true)]
async fn transport_failures_are_retried_then_reported() {
    let (client, log) = retrying(RetryPolicy::new(), 0.0, vec![Answer::Reset]);
    // A reset before the head may have been processed: retried only with a key.
    let mut keyed = request("a", Priority::Interactive);
    keyed
        .headers_mut()
        .insert("idempotency-key", http::HeaderValue::from_static("op-a"));
    let error = client.oneshot(keyed).await.unwrap_err();
    assert_eq!(times(&log).len(), 3);
    assert!(error.is_retries_exhausted() && !error.is_local());
    let report = error.retry_report().unwrap();
    assert_eq!(
        (report.attempts(), report.gave_up()),
        (3, Some(GaveUp::Attempts))
    );
    let source = std::error::Error::source(&error).unwrap();
    assert!(source.downcast_ref::<std::io::Error>().is_some());
}

#[tokio::test(start_paused = true)]
async fn a_request_deadline_stops_waits_that_would_cross_it() {
    let answers = vec![Answer::Status(429, &[("retry-after", "3")], "{}")];
    let (client, log) = retrying(RetryPolicy::new(), 0.0, answers);
    let mut request = request("a", Priority::Batch);
    request
        .extensions_mut()
        .insert(tower_llm_quota::Deadline::after(2 * SEC));
    let response = client.oneshot(request).await.unwrap();
    assert_eq!(times(&log), [0.0]);
    assert_eq!(report_of(&response).gave_up(), Some(GaveUp::Deadline));
}

#[tokio::test(start_paused = true)]
async fn a_streamed_success_is_never_retried() {
    // The body fails after the response was handed over: the error reaches the caller.
    let (provider, log) = provider(vec![ok()], Instant::now());
    let failing = provider.map_response(|response: Response<Full<Bytes>>| {
        response.map(|body| {
            body.map_err(|never| match never {}).with_trailers(async {
                Some(Err::<http::HeaderMap, _>(std::io::Error::other("cut")))
            })
        })
    });
    let client = RetryAfterLayer::new(RetryPolicy::new()).layer(failing);
    let response = client.oneshot(request("a", Priority::Batch)).await.unwrap();
    assert!(response.into_body().collect().await.is_err());
    assert_eq!(times(&log), [0.0]);
}

#[tokio::test(start_paused = true)]
async fn a_429_pauses_everyone_sharing_the_budget_until_the_reset() {
    let budget = budget([
        limit(Dimension::Requests, 100, SEC, 100),
        limit(Dimension::TotalTokens, 10_000, SEC, 10_000),
    ]);
    let start = Instant::now();
    let answers = vec![
        Answer::Status(
            429,
            &[
                ("retry-after", "2"),
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "2s"),
            ],
            "{}",
        ),
        ok(),
    ];
    let (provider, log) = provider(answers, start);
    let client = ServiceBuilder::new()
        .layer(
            RetryAfterLayer::new(RetryPolicy::new())
                .jitter(Fixed(0.0))
                .pause_on_rate_limit(budget.clone()),
        )
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::new())
        .service(provider);
    let client = BoxCloneService::new(client);

    let first = tokio::spawn(client.clone().oneshot(request("first", Priority::Async)));
    time::sleep(SEC / 10).await;
    let mut others = Vec::new();
    for i in 0..5 {
        others.push(tokio::spawn(
            client
                .clone()
                .oneshot(request(&format!("other {i}"), Priority::Async)),
        ));
        time::sleep(SEC / 10).await;
    }
    first.await.unwrap().unwrap();
    for other in others {
        other.await.unwrap().unwrap();
    }
    let times = times(&log);
    // Only the first call went out before the reset; after it, all six at once (100 RPM is
    // plenty once the bucket refills: one per 10 ms).
    assert_eq!(times[0], 0.0);
    assert!(times[1..].iter().all(|&t| t >= 2.0), "{times:?}");
    assert!(times[1..].iter().all(|&t| t <= 2.1), "{times:?}");
    assert_eq!(times.len(), 7);
}

#[tokio::test(start_paused = true)]
async fn a_retry_queues_again_behind_higher_priority_work_keeping_its_place() {
    let budget = tokens_10_per_sec();
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    let start = Instant::now();
    let answers = vec![Answer::Status(503, &[], "busy"), ok()];
    let (provider, log) = provider(answers, start);
    let client = ServiceBuilder::new()
        .layer(RetryAfterLayer::new(RetryPolicy::new()).jitter(Fixed(0.0)))
        .layer(PriorityQueueLayer::new(
            QueueConfig::new().max_wait(Priority::Interactive, 10 * SEC),
        ))
        .layer(TokenBudgetLayer::new(budget.clone()))
        .service(provider);
    let client = BoxCloneService::new(client);

    let x = tokio::spawn(client.clone().oneshot(request("x", Priority::Batch)));
    time::sleep(SEC * 3 / 2).await;
    let i = tokio::spawn(client.clone().oneshot(request("i", Priority::Interactive)));
    time::sleep(SEC / 10).await;
    let b = tokio::spawn(client.clone().oneshot(request("b", Priority::Batch)));
    for task in [x, i, b] {
        task.await.unwrap().unwrap();
    }
    let log = log.lock().unwrap().clone();
    let order: Vec<(&str, f64)> = log
        .iter()
        .map(|(label, at)| (label.as_str(), at.as_secs_f64()))
        .collect();
    // x fails at 1 s and queues again at once keeping its place from 0 s: behind i
    // (interactive, 1.5 s), ahead of b (batch, 1.6 s).
    assert_eq!(order, [("x", 1.0), ("i", 2.0), ("x", 3.0), ("b", 4.0)]);
}

/// 1,000 clients get the same failure at the same instant; when do they come back?
async fn herd(
    status: u16,
    headers: &'static [(&'static str, &'static str)],
) -> (Vec<Duration>, usize) {
    let start = Instant::now();
    let seen = Arc::new(Mutex::new(std::collections::HashSet::new()));
    let log: Log = Default::default();
    let calls = log.clone();
    // Every first attempt fails; every later one succeeds.
    let provider = service_fn(move |request: Request<String>| {
        let first = seen.lock().unwrap().insert(request.body().clone());
        calls
            .lock()
            .unwrap()
            .push((request.body().clone(), start.elapsed()));
        let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
        if first {
            *response.status_mut() = StatusCode::from_u16(status).unwrap();
            for (name, value) in headers {
                response.headers_mut().insert(*name, value.parse().unwrap());
            }
        }
        async move { Ok::<_, Infallible>(response) }
    });
    let policy = RetryPolicy::new().retry_budget(1.0, 0).unwrap();
    let client = RetryAfterLayer::new(policy)
        .jitter(tower_llm_quota::retry::SeededJitter::new(7))
        .layer(provider);
    let client = BoxCloneService::new(client);
    let tasks: Vec<_> = (0..1_000)
        .map(|i| {
            tokio::spawn(
                client
                    .clone()
                    .oneshot(request(&format!("{i}"), Priority::Batch)),
            )
        })
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    let retries: Vec<Duration> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, at)| !at.is_zero())
        .map(|(_, at)| *at)
        .collect();
    let busiest = retries
        .iter()
        .map(|&from| {
            retries
                .iter()
                .filter(|&&at| at >= from && at < from + SEC / 10)
                .count()
        })
        .max()
        .unwrap_or(0);
    (retries, busiest)
}

#[tokio::test(start_paused = true)]
async fn a_herd_told_the_same_instant_comes_back_spread() {
    let (retries, busiest) = herd(429, &[("retry-after", "2")]).await;
    assert_eq!(retries.len(), 1_000);
    assert!(
        retries.iter().all(|&at| at >= 2 * SEC),
        "no retry before 2 s"
    );
    assert!(busiest < 50, "{busiest} retries in one 100 ms window");
    eprintln!("herd with retry-after 2: at most {busiest} of 1000 retries in any 100 ms");

    let (retries, busiest) = herd(503, &[]).await;
    assert_eq!(retries.len(), 1_000);
    eprintln!("herd without a hint: at most {busiest} of 1000 retries in any 100 ms");
    assert!(busiest < 250);
}

#[tokio::test(start_paused = true)]
async fn the_retry_budget_bounds_amplification_against_a_naive_loop() {
    // The provider fails everything for a minute, then recovers.
    let start = Instant::now();
    // Counts (all calls, calls during the outage).
    let outage = |start: Instant| {
        let calls = Arc::new(Mutex::new((0u64, 0u64)));
        let counted = calls.clone();
        let service = service_fn(move |_request: Request<String>| {
            let down = start.elapsed() < 60 * SEC;
            {
                let mut calls = counted.lock().unwrap();
                calls.0 += 1;
                calls.1 += u64::from(down);
            }
            async move {
                let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
                if down {
                    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                }
                Ok::<_, Infallible>(response)
            }
        });
        (service, calls)
    };
    // 20 requests a second for two minutes.
    let originals = 2_400u64;
    let (service, calls) = outage(start);
    let client = BoxCloneService::new(RetryAfterLayer::new(RetryPolicy::new()).layer(service));
    let mut tasks = Vec::new();
    for i in 0..originals {
        time::sleep_until(start + SEC * (i as u32) / 20).await;
        tasks.push(tokio::spawn(
            client.clone().oneshot(request("r", Priority::Batch)),
        ));
    }
    let mut succeeded = 0;
    for task in tasks {
        succeeded += u64::from(task.await.unwrap().unwrap().status().is_success());
    }
    let (all, down) = *calls.lock().unwrap();
    let governed = (
        all as f64 / originals as f64,
        down as f64 / (originals / 2) as f64,
    );

    // The same traffic through a plain loop of 3 immediate retries.
    let start = Instant::now();
    let (service, calls) = outage(start);
    let mut tasks = Vec::new();
    for i in 0..originals {
        time::sleep_until(start + SEC * (i as u32) / 20).await;
        let mut service = service.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..4 {
                let response = service
                    .ready()
                    .await?
                    .call(request("r", Priority::Batch))
                    .await?;
                if response.status().is_success() {
                    break;
                }
            }
            Ok::<_, Infallible>(())
        }));
    }
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    let (all, down) = *calls.lock().unwrap();
    let naive = (
        all as f64 / originals as f64,
        down as f64 / (originals / 2) as f64,
    );
    eprintln!(
        "attempts per request, whole run / during the outage: governed {:.3} / {:.3}, \
         naive 3-retry loop {:.3} / {:.3}",
        governed.0, governed.1, naive.0, naive.1
    );
    assert!(governed.0 <= 1.2 && governed.1 <= 1.2, "{governed:?}");
    assert!(naive.1 >= 3.9, "{naive:?}");
    // Every request sent after the recovery succeeded.
    assert!(succeeded >= originals / 2);
}

#[tokio::test(start_paused = true)]
async fn an_overloaded_answer_is_retried_but_pauses_nobody() {
    let budget = budget([limit(Dimension::Requests, 100, SEC, 100)]);
    let answers = vec![
        Answer::Status(
            529,
            &[("retry-after", "2")],
            r#"{"type":"error","error":{"type":"overloaded_error"}}"#,
        ),
        ok(),
    ];
    let (provider, log) = provider(answers, Instant::now());
    let client = ServiceBuilder::new()
        .layer(
            RetryAfterLayer::new(RetryPolicy::new())
                .jitter(Fixed(0.0))
                .pause_on_rate_limit(budget.clone()),
        )
        .layer(TokenBudgetLayer::new(budget.clone()))
        .service(provider);
    let client = BoxCloneService::new(client);
    let first = tokio::spawn(client.clone().oneshot(request("first", Priority::Async)));
    time::sleep(SEC / 10).await;
    client
        .clone()
        .oneshot(request("other", Priority::Async))
        .await
        .unwrap();
    let response = first.await.unwrap().unwrap();
    assert_eq!(
        report_of(&response).last_class(),
        Some(FailureClass::Transient(Transient::Overloaded))
    );
    // The other request went at once: no cooldown for an overloaded provider.
    assert_eq!(times(&log), [0.0, 0.1, 2.0]);
}

#[tokio::test(start_paused = true)]
async fn a_daily_quotas_429_is_not_retried_and_pauses_the_budget_only_up_to_the_cap() {
    let budget = budget([limit(Dimension::Requests, 100, SEC, 100)]);
    let answers = vec![
        Answer::Status(
            429,
            &[("retry-after", "86400")],
            "Please retry after 86400 seconds.",
        ),
        ok(),
    ];
    let (provider, log) = provider(answers, Instant::now());
    let client = ServiceBuilder::new()
        .layer(
            RetryAfterLayer::new(RetryPolicy::new())
                .jitter(Fixed(0.0))
                .pause_on_rate_limit(budget.clone()),
        )
        .layer(TokenBudgetLayer::new(budget.clone()))
        .service(provider);
    let client = BoxCloneService::new(client);
    let response = client
        .clone()
        .oneshot(request("daily", Priority::Batch))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(report_of(&response).gave_up(), Some(GaveUp::WaitTooLong));
    // The pause stops at the honoured maximum (60 s), not a day later.
    let snapshot = budget.snapshot();
    let available = snapshot.limits()[0].available_at() - snapshot.taken_at();
    assert_eq!(available, 60 * SEC);
    client
        .oneshot(request("next", Priority::Batch))
        .await
        .unwrap();
    assert_eq!(times(&log), [0.0, 60.0]);
}

#[tokio::test(start_paused = true)]
async fn an_error_body_over_the_read_limit_is_retried_by_its_status() {
    use futures::stream;
    use http_body::Frame;
    use http_body_util::StreamBody;

    type Chunks = stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, std::io::Error>>>;
    let calls = Arc::new(Mutex::new(0u32));
    let counted = calls.clone();
    let service = service_fn(move |_request: Request<String>| {
        let first = {
            let mut calls = counted.lock().unwrap();
            *calls += 1;
            *calls == 1
        };
        async move {
            // 100 KiB streamed, with no length announced.
            let chunks: Vec<Result<Frame<Bytes>, std::io::Error>> = if first {
                (0..100)
                    .map(|_| Ok(Frame::data(Bytes::from(vec![b'x'; 1_024]))))
                    .collect()
            } else {
                vec![Ok(Frame::data(Bytes::from_static(b"ok")))]
            };
            let mut response = Response::new(StreamBody::new(stream::iter(chunks) as Chunks));
            if first {
                *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            }
            Ok::<_, Infallible>(response)
        }
    });
    let client = RetryAfterLayer::new(RetryPolicy::new())
        .jitter(Fixed(0.0))
        .layer(service);
    let response = client
        .oneshot(request("big", Priority::Batch))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let report = report_of(&response);
    assert_eq!(report.attempts(), 2);
    assert_eq!(
        report.last_status(),
        Some(StatusCode::INTERNAL_SERVER_ERROR)
    );
    assert_eq!(
        report.last_class(),
        Some(FailureClass::Transient(Transient::Server))
    );
    assert_eq!(*calls.lock().unwrap(), 2);
}

/// Every duration the stack accepts may be `Duration::MAX` (or a provider's wait of
/// centuries): each is capped at `MAX_DURATION`, so it is a very long time, never an
/// overflow. A limit per `Duration::MAX`, a queue and a retry policy whose every bound is
/// `Duration::MAX`, and a provider asking for 300 years: the request waits, nothing panics.
#[tokio::test(start_paused = true)]
async fn durations_of_any_length_mean_a_very_long_time() {
    let budget = support::budget([limit(Dimension::TotalTokens, 10, Duration::MAX, 20)]);
    let policy = RetryPolicy::new()
        .max_total(Priority::Batch, Duration::MAX)
        .backoff(Duration::MAX, Duration::MAX)
        .unwrap()
        .max_honored_delay(Duration::MAX);
    let queue = QueueConfig::new()
        .max_wait(Priority::Batch, Duration::MAX)
        .promote_after(Priority::Batch, Some(Duration::MAX));
    let answers = vec![
        Answer::Status(429, &[("retry-after", "9999999999")], "{}"),
        Answer::Status(503, &[], "busy"),
        ok(),
    ];
    let (provider, log) = provider(answers, Instant::now());
    let client = ServiceBuilder::new()
        .layer(
            RetryAfterLayer::new(policy)
                .jitter(Fixed(0.5))
                .pause_on_rate_limit(budget.clone()),
        )
        .layer(PriorityQueueLayer::new(queue))
        .layer(TokenBudgetLayer::new(budget.clone()))
        .service(provider);
    let client = BoxCloneService::new(client);
    // The first is answered 429 (300 years): it waits, and the budget pauses for the
    // longest wait honoured.
    let first = tokio::spawn(client.clone().oneshot(request("a", Priority::Batch)));
    time::sleep(Duration::from_secs(3_600)).await;
    assert!(!first.is_finished());
    assert_eq!(times(&log), [0.0]);
    // The second waits in the queue (the budget holds 10 more, but it is paused).
    let second = tokio::spawn(client.clone().oneshot(request("b", Priority::Batch)));
    time::sleep(Duration::from_secs(3_600)).await;
    assert!(!second.is_finished());
    assert!(budget.snapshot().limits()[0].level() >= 0);
    first.abort();
    second.abort();
    assert!(tower_llm_quota::MAX_DURATION >= Duration::from_secs(100 * 365 * 86_400));
}

/// A retry keeps its place in the budget's ordering while it waits out `Retry-After`: A is
/// answered 429 (retry after 1 s) at 0 s; B, C and D arrive at 0.5 s; one request a second:
/// A again at 1 s, then B, C, D. Its wait is the provider's, without jitter (the budget
/// spaces the retries that come back to their places); before, A slept 2 s (half the
/// jitter) outside the ordering and B went first, at 1 s.
#[tokio::test(start_paused = true)]
async fn a_retry_keeps_its_place_while_it_waits_out_retry_after() {
    let budget = support::budget([limit(Dimension::Requests, 1, SEC, 1)]);
    let start = Instant::now();
    let answers = vec![Answer::Status(429, &[("retry-after", "1")], "{}"), ok()];
    let (provider, log) = provider(answers, start);
    let client = ServiceBuilder::new()
        .layer(RetryAfterLayer::new(RetryPolicy::new()).jitter(Fixed(0.5)))
        .layer(PriorityQueueLayer::new(QueueConfig::new()))
        .layer(TokenBudgetLayer::new(budget.clone()))
        .service(provider);
    let client = BoxCloneService::new(client);
    let a = tokio::spawn(client.clone().oneshot(request("a", Priority::Async)));
    time::sleep(SEC / 2).await;
    let mut rest = Vec::new();
    for label in ["b", "c", "d"] {
        rest.push(tokio::spawn(
            client.clone().oneshot(request(label, Priority::Async)),
        ));
        tokio::task::yield_now().await;
    }
    for task in std::iter::once(a).chain(rest) {
        task.await.unwrap().unwrap();
    }
    let log = log.lock().unwrap().clone();
    let order: Vec<(&str, f64)> = log
        .iter()
        .map(|(label, at)| (label.as_str(), at.as_secs_f64()))
        .collect();
    assert_eq!(
        order,
        [("a", 0.0), ("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0)]
    );
}

/// The provider's 429 reports a limit below the request's cost: the budget learns it, and
/// refuses the retry as too large. The request ends with the provider's 429 (its report
/// saying why retrying stopped), not with the budget's local error: one call in all.
#[tokio::test(start_paused = true)]
async fn a_retry_the_budget_refuses_after_a_429_ends_with_the_429() {
    use tower_llm_quota::provider::{Profile, ProviderUsage};
    let per_minute = tower_llm_quota::Limit::per_minute(
        Dimension::TotalTokens,
        std::num::NonZeroU64::new(1_000).unwrap(),
    );
    let budget = budget([per_minute]);
    let answers = vec![Answer::Status(
        429,
        &[
            ("retry-after", "1"),
            ("x-ratelimit-limit-tokens", "5"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "1s"),
        ],
        r#"{"error":{"message":"Rate limit reached","type":"tokens","code":"rate_limit_exceeded"}}"#,
    )];
    let (provider, log) = provider(answers, Instant::now());
    let client = ServiceBuilder::new()
        .layer(
            RetryAfterLayer::new(RetryPolicy::new())
                .jitter(Fixed(0.0))
                .pause_on_rate_limit(budget.clone()),
        )
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::with_extractor(ProviderUsage::new(
            Profile::openai(),
        )))
        .service(provider);
    let response = client
        .oneshot(request("first", Priority::Interactive))
        .await
        .expect("the provider's answer, not a local error");
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let report = report_of(&response);
    assert_eq!(report.gave_up(), Some(GaveUp::Permanent));
    assert_eq!(report.last_status(), Some(StatusCode::TOO_MANY_REQUESTS));
    assert_eq!(
        log.lock().unwrap().len(),
        1,
        "one call: the retry was refused locally"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(body.starts_with(b"{\"error\""));
}

/// `MaxAttempts(1)` sends once and hands the provider's 429 back, even for batch work, whose
/// rate-limited retries are otherwise bounded only by time.
#[tokio::test(start_paused = true)]
async fn a_request_bounding_its_attempts_is_sent_that_many_times() {
    use tower_llm_quota::retry::MaxAttempts;
    let answers = vec![Answer::Status(429, &[("retry-after", "1")], "{}"), ok()];
    let (client, log) = retrying(RetryPolicy::new(), 0.0, answers);
    let mut once = request("once", Priority::Batch);
    once.extensions_mut()
        .insert(MaxAttempts(std::num::NonZeroU32::MIN));
    let response = client.clone().oneshot(once).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(report_of(&response).gave_up(), Some(GaveUp::Attempts));
    assert_eq!(log.lock().unwrap().len(), 1);
    // Without it, the same failure is retried.
    let response = client
        .oneshot(request("again", Priority::Batch))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

const FLEX_UNAVAILABLE: &str = r#"{"error":{"message":"Resource Unavailable: the flex tier has no capacity","type":"resource_unavailable","param":null,"code":"resource_unavailable"}}"#;

/// A flex 429 "Resource Unavailable" is retried later for batch work, past the class's
/// attempt count (bounded by its time), and pauses nobody: another request sharing the budget
/// goes at once. The same answer hands interactive work the 429 at once.
#[tokio::test(start_paused = true)]
async fn a_tier_without_capacity_is_retried_later_for_batch_and_handed_back_to_interactive() {
    let budget = budget([limit(Dimension::Requests, 100, SEC, 100)]);
    // Ten refusals (more than batch's eight attempts), then an answer.
    let mut answers = vec![Answer::Status(429, &[], FLEX_UNAVAILABLE); 10];
    answers.push(ok());
    let (provider, log) = provider(answers, Instant::now());
    let client = ServiceBuilder::new()
        .layer(
            RetryAfterLayer::new(RetryPolicy::new())
                .jitter(Fixed(0.5))
                .pause_on_rate_limit(budget.clone()),
        )
        .layer(TokenBudgetLayer::new(budget.clone()))
        .service(provider);
    let client = BoxCloneService::new(client);
    let batch = tokio::spawn(client.clone().oneshot(request("batch", Priority::Batch)));
    time::sleep(SEC / 10).await;
    // Interactive: one attempt, the provider's 429 handed back.
    let response = client
        .clone()
        .oneshot(request("interactive", Priority::Interactive))
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    let report = report_of(&response);
    assert_eq!(report.gave_up(), Some(GaveUp::TierUnavailable));
    assert_eq!(
        report.last_class(),
        Some(FailureClass::Transient(Transient::TierUnavailable))
    );
    assert_eq!(report.attempts(), 1);
    let response = batch.await.unwrap().unwrap();
    assert_eq!(response.status(), 200);
    let calls = log.lock().unwrap().clone();
    let batch_calls = calls.iter().filter(|(label, _)| label == "batch").count();
    assert_eq!(batch_calls, 10, "batch gave up before the tier came back");
    // The interactive request went at 0.1 s, not after a pause.
    let interactive: Vec<f64> = calls
        .iter()
        .filter(|(label, _)| label == "interactive")
        .map(|(_, at)| at.as_secs_f64())
        .collect();
    assert_eq!(interactive, [0.1]);
    // Within batch's five minutes: backoff, no pause of the budget.
    assert!(calls.last().unwrap().1 < Duration::from_secs(300));
}

/// The class's choice is the policy's: interactive work told to retry does.
#[tokio::test(start_paused = true)]
async fn a_class_may_choose_to_retry_a_tier_without_capacity() {
    use tower_llm_quota::retry::TierUnavailable;
    let policy =
        RetryPolicy::new().on_tier_unavailable(Priority::Interactive, TierUnavailable::Retry);
    let answers = vec![Answer::Status(429, &[], FLEX_UNAVAILABLE), ok()];
    let (client, log) = retrying(policy, 0.5, answers);
    let response = client
        .oneshot(request("a", Priority::Interactive))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(times(&log).len(), 2);
    // And batch work told to give up does.
    let policy = RetryPolicy::new().on_tier_unavailable(Priority::Batch, TierUnavailable::GiveUp);
    let answers = vec![Answer::Status(429, &[], FLEX_UNAVAILABLE), ok()];
    let (client, log) = retrying(policy, 0.5, answers);
    let response = client.oneshot(request("b", Priority::Batch)).await.unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(times(&log).len(), 1);
}
