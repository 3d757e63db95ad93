//! The preset stack: admission, priority, settlement from the body, retries and pauses, in the
//! documented order.

use tower_llm_quota_test_support as support;

use std::convert::Infallible;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};
use tower_llm_quota::estimate::{Defaults, estimate};
use tower_llm_quota::stack::{QuotaBody, QuotaStack};
use tower_llm_quota::{
    Budget, Cost, Dimension, Error, Limit, Priority, QueueConfig, Quota, RetryAfterLayer,
    RetryPolicy, estimate::CharEstimator, retry::SeededJitter,
};

/// What the provider saw of one call.
#[derive(Debug, Clone, PartialEq)]
struct Call {
    name: String,
    /// Since the test's start.
    at: Duration,
    cost: Option<Cost>,
    /// The budget's first level when the call arrived.
    level: i64,
}

#[derive(Clone)]
struct Provider {
    budget: Budget,
    start: Instant,
    calls: Arc<Mutex<Vec<Call>>>,
    /// How many calls are answered 429 (`retry-after: 2`) before the others.
    rate_limited: Arc<AtomicUsize>,
    /// The usage reported; `None`: the request's cost, exactly.
    usage: Option<(u64, u64)>,
}

impl Provider {
    fn new(budget: &Budget) -> Self {
        Self {
            budget: budget.clone(),
            start: Instant::now(),
            calls: Arc::default(),
            rate_limited: Arc::default(),
            usage: None,
        }
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn answer(&self, request: &Request<Full<Bytes>>) -> Response<Full<Bytes>> {
        let cost = request.extensions().get::<Cost>().copied();
        self.calls.lock().unwrap().push(Call {
            name: request.headers()["x-name"].to_str().unwrap().to_owned(),
            at: self.start.elapsed(),
            cost,
            level: self.budget.snapshot().limits()[0].level(),
        });
        let limited = self
            .rate_limited
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if limited {
            let body = r#"{"error":{"type":"requests","message":"Rate limit reached"}}"#;
            return Response::builder()
                .status(StatusCode::TOO_MANY_REQUESTS)
                .header("retry-after", "2")
                .body(Full::new(Bytes::from(body)))
                .unwrap();
        }
        let (input, output) = self.usage.unwrap_or_else(|| {
            let cost = cost.unwrap_or_default();
            (cost.input_tokens(), cost.output_tokens())
        });
        let body = format!(
            r#"{{"id":"chatcmpl-1","choices":[],"usage":{{"prompt_tokens":{input},"completion_tokens":{output},"total_tokens":{}}}}}"#,
            input + output
        );
        Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap()
    }

    fn service(
        &self,
    ) -> impl Service<
        Request<Full<Bytes>>,
        Response = Response<Full<Bytes>>,
        Error = Infallible,
        Future = impl Send,
    > + Clone
    + Send
    + 'static {
        let provider = self.clone();
        service_fn(move |request: Request<Full<Bytes>>| {
            let response = provider.answer(&request);
            async move { Ok::<_, Infallible>(response) }
        })
    }
}

const CHAT: &str = r#"{"model":"gpt-4o-mini","max_tokens":100,"messages":[{"role":"user","content":"What is a token bucket?"}]}"#;

/// A chat request named `name`.
fn chat(name: &str) -> Request<Full<Bytes>> {
    Request::post("https://api.openai.com/v1/chat/completions")
        .header("content-type", "application/json")
        .header("x-name", name)
        .body(Full::new(Bytes::from(CHAT)))
        .unwrap()
}

/// The same, with its cost and priority given.
fn priced(name: &str, cost: Cost, priority: Priority) -> Request<Full<Bytes>> {
    let mut request = chat(name);
    request.extensions_mut().insert(cost);
    request.extensions_mut().insert(priority);
    request
}

fn tpm(amount: u64) -> Quota {
    Quota::new().with_limit(Limit::per_minute(
        Dimension::TotalTokens,
        NonZeroU64::new(amount).unwrap(),
    ))
}

fn level(budget: &Budget) -> i64 {
    budget.snapshot().limits()[0].level()
}

fn secs(secs: u64) -> Duration {
    Duration::from_secs(secs)
}

/// Sends `request` and reads the whole answer: the stack's error is the crate's [`Error`].
async fn send<S>(mut service: S, request: Request<Full<Bytes>>) -> Result<StatusCode, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<QuotaBody<Full<Bytes>>>, Error = Error>,
{
    let response = service.ready().await?.call(request).await?;
    let status = response.status();
    response.into_body().collect().await.expect("the body");
    Ok(status)
}

#[tokio::test(start_paused = true)]
async fn estimates_admits_and_settles_from_the_body_usage() {
    let stack = QuotaStack::openai(tpm(30_000));
    let budget = stack.budget().clone();
    let provider = Provider {
        usage: Some((12, 30)),
        ..Provider::new(&budget)
    };
    let mut llm = stack.layer(provider.service());

    let estimated = estimate(CHAT.as_bytes(), &CharEstimator::new(), &Defaults::new()).unwrap();
    assert_eq!(estimated.output_tokens(), 100);
    let response = llm.ready().await.unwrap().call(chat("a")).await.unwrap();
    let reserved = 5_000 - estimated.total_tokens() as i64;
    assert_eq!(
        provider.calls(),
        [Call {
            name: "a".into(),
            at: Duration::ZERO,
            cost: Some(estimated),
            level: reserved,
        }]
    );
    // The body has not ended: the slot and the reservation are still held.
    assert_eq!((stack.in_flight(), level(&budget)), (1, reserved));
    response.into_body().collect().await.unwrap();
    assert_eq!((stack.in_flight(), level(&budget)), (0, 5_000 - 42));
}

#[tokio::test(start_paused = true)]
async fn waiting_requests_get_the_budget_by_priority() {
    // 10 tokens a second, 100 at once: one request of 100 tokens every 10 s.
    let budget = support::budget([support::limit(Dimension::TotalTokens, 10, secs(1), 100)]);
    let stack = QuotaStack::openai(Quota::new())
        .with_budget(budget.clone())
        .queue(QueueConfig::new().max_wait(Priority::Interactive, secs(60)));
    let queue = stack.queue_handle();
    let provider = Provider::new(&budget);
    let llm = stack.layer(provider.service());
    let cost = Cost::new(100, 0);

    send(llm.clone(), priced("first", cost, Priority::Async))
        .await
        .unwrap();
    let mut waiting = Vec::new();
    for (name, priority) in [
        ("batch-1", Priority::Batch),
        ("batch-2", Priority::Batch),
        ("interactive", Priority::Interactive),
    ] {
        let request = priced(name, cost, priority);
        waiting.push(tokio::spawn(send(llm.clone(), request)));
        tokio::task::yield_now().await;
    }
    // All three wait in the budget's ordering, by class.
    let snapshot = queue.snapshot();
    assert_eq!(budget.waiters(), 3);
    assert_eq!(
        (
            snapshot.class(Priority::Interactive).depth(),
            snapshot.class(Priority::Batch).depth()
        ),
        (1, 2)
    );
    for task in waiting {
        assert_eq!(task.await.unwrap().unwrap(), StatusCode::OK);
    }
    let calls: Vec<(String, Duration)> = provider
        .calls()
        .into_iter()
        .map(|call| (call.name, call.at))
        .collect();
    assert_eq!(
        calls,
        [
            ("first".to_owned(), secs(0)),
            ("interactive".to_owned(), secs(10)),
            ("batch-1".to_owned(), secs(20)),
            ("batch-2".to_owned(), secs(30)),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_cost_that_never_fits_never_reaches_the_client() {
    let stack = QuotaStack::openai(tpm(30_000));
    let provider = Provider::new(stack.budget());
    let llm = stack.layer(provider.service());

    let error = send(llm, priced("huge", Cost::new(6_000, 0), Priority::Async))
        .await
        .unwrap_err();
    assert!(error.is_too_large() && error.is_local());
    assert_eq!(error.insufficient_capacity().unwrap().capacity(), 5_000);
    assert_eq!(provider.calls(), []);
}

#[tokio::test(start_paused = true)]
async fn a_request_without_an_estimate_is_refused_before_it_is_sent() {
    let stack = QuotaStack::openai(tpm(30_000));
    let provider = Provider::new(stack.budget());
    let llm = stack.layer(provider.service());

    let mut request = chat("plain");
    request
        .headers_mut()
        .insert("content-type", http::HeaderValue::from_static("text/plain"));
    let error = send(llm, request).await.unwrap_err();
    assert!(error.is_missing_cost());
    assert_eq!(provider.calls(), []);
}

#[tokio::test(start_paused = true)]
async fn a_429_is_retried_after_its_wait_and_pauses_the_budget_for_everyone() {
    let retry = RetryAfterLayer::new(RetryPolicy::new()).jitter(SeededJitter::new(7));
    let stack = QuotaStack::openai(tpm(30_000)).retry_layer(retry);
    let budget = stack.budget().clone();
    let provider = Provider::new(&budget);
    provider.rate_limited.store(1, Ordering::SeqCst);
    let llm = stack.layer(provider.service());

    let limited = tokio::spawn(send(llm.clone(), chat("limited")));
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The budget has room, but the provider said to wait: a new request waits too.
    let other = tokio::spawn(send(llm, chat("other")));
    assert_eq!(limited.await.unwrap().unwrap(), StatusCode::OK);
    assert_eq!(other.await.unwrap().unwrap(), StatusCode::OK);

    let calls = provider.calls();
    let estimated = estimate(CHAT.as_bytes(), &CharEstimator::new(), &Defaults::new());
    let names: Vec<&str> = calls.iter().map(|call| call.name.as_str()).collect();
    assert_eq!(names.iter().filter(|name| **name == "limited").count(), 2);
    assert_eq!(names.iter().filter(|name| **name == "other").count(), 1);
    assert_eq!((names[0], calls[0].at), ("limited", Duration::ZERO));
    for call in &calls[1..] {
        // Not before the provider's wait; the retry within its jitter window.
        assert!(call.at >= secs(2), "{call:?}");
        assert!(call.at <= secs(6), "{call:?}");
        // The estimate is made once, outside the retries: every attempt carries it.
        assert_eq!(call.cost, estimated);
    }
}

#[tokio::test(start_paused = true)]
async fn an_absurd_usage_report_delays_the_next_request_by_one_refill_at_most() {
    let stack = QuotaStack::openai(tpm(30_000));
    let budget = stack.budget().clone();
    let provider = Provider {
        usage: Some((12, 1_000_000_000_000)),
        ..Provider::new(&budget)
    };
    let llm = stack.layer(provider.service());
    let capacity = budget.snapshot().limits()[0].capacity();
    send(llm.clone(), chat("absurd")).await.unwrap();
    // Charged the bucket's capacity, not 10^12 tokens: no debt of 27,000 days.
    let after = level(&budget);
    assert!(after > -(capacity as i64), "level {after}");
    send(llm, chat("next")).await.unwrap();
    // One refill of the bucket: its capacity at 30,000 per minute.
    let refill = Duration::from_secs(60).mul_f64(capacity as f64 / 30_000.0);
    let calls = provider.calls();
    assert!(
        calls[1].at <= refill,
        "the next call went after {:?} (one refill: {refill:?})",
        calls[1].at
    );
}

#[tokio::test(start_paused = true)]
async fn usage_the_stack_asked_a_stream_for_is_hidden_from_the_caller() {
    let stream = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"total_tokens\":42}}\n\n",
        "data: [DONE]\n\n",
    );
    let asked = Arc::new(Mutex::new(String::new()));
    let seen = asked.clone();
    let client = service_fn(move |request: Request<Full<Bytes>>| {
        let seen = seen.clone();
        async move {
            let body = request.into_body().collect().await.unwrap().to_bytes();
            *seen.lock().unwrap() = String::from_utf8(body.to_vec()).unwrap();
            let mut response = Response::new(Full::new(Bytes::from_static(stream.as_bytes())));
            response
                .headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            Ok::<_, Infallible>(response)
        }
    });
    let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(60_000).unwrap())
        .with_headroom(1.0)
        .unwrap()
        .with_burst(NonZeroU64::new(60_000).unwrap());
    let stack = QuotaStack::openai(Quota::new().with_limit(tpm))
        .estimate(tower_llm_quota::EstimateLayer::new().include_stream_usage(true));
    let budget = stack.budget().clone();
    let body = r#"{"model":"gpt-4o","stream":true,"max_tokens":500,"messages":[{"role":"user","content":"Hi"}]}"#;
    let request = Request::post("http://provider/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    let response = stack.layer(client).oneshot(request).await.unwrap();
    let received = response.into_body().collect().await.unwrap().to_bytes();

    assert!(
        asked
            .lock()
            .unwrap()
            .contains(r#""stream_options":{"include_usage":true}"#)
    );
    assert_eq!(
        received,
        concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n",
            "data: [DONE]\n\n",
        )
    );
    // Settled with the usage the caller never saw.
    assert_eq!(budget.snapshot().limits()[0].level(), 60_000 - 42);
}
