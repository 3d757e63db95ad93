//! A `reqwest_middleware` client governed by the stack, against a loopback HTTP server: the
//! budget is debited and settled, retries run the rest of the middleware chain again, the
//! request's priority reaches the queue, and errors keep their types.

use tower_llm_quota_test_support as support;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Extensions;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use tower_llm_quota::estimate::{Defaults, estimate};
use tower_llm_quota::middleware::{AttemptError, QuotaMiddleware};
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{
    Budget, Cost, Dimension, Error, Priority, Quota, RetryPolicy, estimate::CharEstimator,
    retry::RetryReport,
};

const CHAT: &str = r#"{"model":"gpt-4o-mini","max_tokens":50,"messages":[{"role":"user","content":"Hello there"}]}"#;

/// A loopback provider: answers `rate_limited` requests with a 429 (`retry-after-ms: 1`),
/// then every other with a usage of 20 + 10 tokens, and logs the `x-name` of each request.
#[derive(Clone)]
struct Provider {
    addr: SocketAddr,
    names: Arc<Mutex<Vec<String>>>,
    rate_limited: Arc<AtomicUsize>,
    /// The budget's level when each request arrived.
    levels: Arc<Mutex<Vec<i64>>>,
    /// The length of each request's body, as received.
    bodies: Arc<Mutex<Vec<usize>>>,
}

impl Provider {
    async fn start(budget: &Budget, rate_limited: usize) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let provider = Self {
            addr: listener.local_addr().unwrap(),
            names: Arc::default(),
            rate_limited: Arc::new(AtomicUsize::new(rate_limited)),
            levels: Arc::default(),
            bodies: Arc::default(),
        };
        let serving = provider.clone();
        let budget = budget.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (serving, budget) = (serving.clone(), budget.clone());
                let service = hyper::service::service_fn(
                    move |request: http::Request<hyper::body::Incoming>| {
                        let response = serving.answer(&request, &budget);
                        let bodies = serving.bodies.clone();
                        async move {
                            use http_body_util::BodyExt;
                            let body = request.into_body().collect().await;
                            let length = body.map_or(0, |body| body.to_bytes().len());
                            bodies.lock().unwrap().push(length);
                            Ok::<_, Infallible>(response)
                        }
                    },
                );
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        provider
    }

    fn answer<B>(
        &self,
        request: &http::Request<B>,
        budget: &Budget,
    ) -> http::Response<Full<Bytes>> {
        let name = request
            .headers()
            .get("x-name")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        self.names.lock().unwrap().push(name.to_owned());
        self.levels
            .lock()
            .unwrap()
            .push(budget.snapshot().limits()[0].level());
        let limited = self
            .rate_limited
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if limited {
            return http::Response::builder()
                .status(429)
                .header("retry-after-ms", "1")
                .body(Full::new(Bytes::from(
                    r#"{"error":{"message":"slow down"}}"#,
                )))
                .unwrap();
        }
        let body = r#"{"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":10,"total_tokens":30}}"#;
        http::Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap()
    }

    fn url(&self) -> String {
        format!("http://{}/v1/chat/completions", self.addr)
    }

    fn names(&self) -> Vec<String> {
        self.names.lock().unwrap().clone()
    }

    fn levels(&self) -> Vec<i64> {
        self.levels.lock().unwrap().clone()
    }
}

/// A middleware placed after the quota middleware: records the priority each attempt carries,
/// and fails every attempt with `fail` when set.
#[derive(Clone, Default)]
struct Recorder {
    attempts: Arc<Mutex<Vec<Option<Priority>>>>,
    fail: Option<std::io::ErrorKind>,
}

impl Recorder {
    fn attempts(&self) -> Vec<Option<Priority>> {
        self.attempts.lock().unwrap().clone()
    }
}

impl Middleware for Recorder {
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        request: reqwest::Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> Pin<
        Box<
            dyn Future<Output = reqwest_middleware::Result<reqwest::Response>>
                + Send
                + 'async_trait,
        >,
    >
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        self.attempts
            .lock()
            .unwrap()
            .push(extensions.get::<Priority>().copied());
        let fail = self.fail;
        Box::pin(async move {
            match fail {
                Some(kind) => Err(reqwest_middleware::Error::middleware(std::io::Error::new(
                    kind,
                    "refused by a later middleware",
                ))),
                None => next.run(request, extensions).await,
            }
        })
    }
}

/// Total tokens that never refill during a test: `burst` of them.
fn tokens(burst: u64) -> Budget {
    let period = Duration::from_secs(100 * 86_400);
    support::budget([support::limit(Dimension::TotalTokens, burst, period, burst)])
}

/// Total tokens refilling at 1,000 a second, 1,000 at once: a pause is over in milliseconds.
fn fast_tokens() -> Budget {
    support::budget([support::limit(
        Dimension::TotalTokens,
        1_000,
        Duration::from_secs(1),
        1_000,
    )])
}

/// The preset over `budget`, retrying at once.
fn stack(budget: &Budget) -> QuotaStack {
    let fast = Duration::from_millis(1);
    QuotaStack::openai(Quota::new())
        .with_budget(budget.clone())
        .retry(RetryPolicy::new().backoff(fast, fast * 10).unwrap())
}

fn client(stack: QuotaStack, recorder: &Recorder) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(QuotaMiddleware::new(stack))
        .with(recorder.clone())
        .build()
}

/// Waits, at most five seconds, until `done` holds.
async fn until(mut done: impl FnMut() -> bool) {
    for _ in 0..5_000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("timed out");
}

/// The crate's error in a middleware error.
fn quota_error(error: &reqwest_middleware::Error) -> &Error {
    match error {
        reqwest_middleware::Error::Middleware(error) => error.downcast_ref::<Error>().unwrap(),
        reqwest_middleware::Error::Reqwest(error) => panic!("not a quota error: {error}"),
    }
}

/// The first error of type `E` in `error`'s source chain.
fn find<E: std::error::Error + 'static>(error: &Error) -> Option<&E> {
    let mut link = std::error::Error::source(error);
    while let Some(error) = link {
        if let Some(found) = error.downcast_ref::<E>() {
            return Some(found);
        }
        link = error.source();
    }
    None
}

#[tokio::test]
async fn requests_are_estimated_debited_and_settled() {
    let budget = tokens(1_000);
    let provider = Provider::start(&budget, 0).await;
    let recorder = Recorder::default();
    let client = client(stack(&budget), &recorder);

    let response = client
        .post(provider.url())
        .header("content-type", "application/json")
        .body(CHAT)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.url().as_str(), provider.url());
    let estimated = estimate(CHAT.as_bytes(), &CharEstimator::new(), &Defaults::new()).unwrap();
    assert_eq!(estimated.output_tokens(), 50);
    assert_eq!(provider.levels(), [1_000 - estimated.total_tokens() as i64]);
    response.text().await.unwrap();
    assert_eq!(budget.snapshot().limits()[0].level(), 1_000 - 30);
    // The request carried no class: the queue placed it in its default class without writing
    // one into the request.
    assert_eq!(recorder.attempts(), [None]);
}

#[tokio::test]
async fn a_429_is_retried_through_the_rest_of_the_chain() {
    // The 429 pauses the budget, which then refills from zero.
    let budget = fast_tokens();
    let provider = Provider::start(&budget, 1).await;
    let recorder = Recorder::default();
    let client = client(stack(&budget), &recorder);

    let response = client
        .post(provider.url())
        .body(CHAT)
        .with_extension(Priority::Batch)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // The stack's response extensions reach the caller.
    let report = response.extensions().get::<RetryReport>().unwrap();
    assert_eq!(report.attempts(), 2);
    response.text().await.unwrap();
    assert_eq!(provider.names().len(), 2);
    assert_eq!(recorder.attempts(), [Some(Priority::Batch); 2]);
    // Both attempts carried the whole body.
    assert_eq!(*provider.bodies.lock().unwrap(), [CHAT.len(); 2]);
}

#[tokio::test]
async fn the_request_priority_orders_the_queue() {
    let budget = tokens(300);
    let provider = Provider::start(&budget, 0).await;
    let stack = stack(&budget);
    let queue = stack.queue_handle();
    let client = client(stack, &Recorder::default());
    let cost = Cost::new(100, 0);
    // The whole budget, held in three parts, released one by one.
    let mut held: Vec<_> = (0..3).map(|_| budget.try_reserve(cost).unwrap()).collect();

    let send = |name: &'static str, priority: Priority| {
        let request = client
            .post(provider.url())
            .header("x-name", name)
            .body(CHAT)
            .with_extension(cost)
            .with_extension(priority);
        tokio::spawn(async move { request.send().await.unwrap().text().await.unwrap() })
    };
    let mut tasks = vec![send("batch-1", Priority::Batch)];
    until(|| budget.waiters() == 1).await;
    tasks.push(send("batch-2", Priority::Batch));
    until(|| budget.waiters() == 2).await;
    tasks.push(send("interactive", Priority::Interactive));
    until(|| queue.snapshot().depth() == 3).await;
    // All three wait in the budget's ordering, by class.
    assert_eq!(queue.snapshot().class(Priority::Interactive).depth(), 1);
    assert_eq!(queue.snapshot().class(Priority::Batch).depth(), 2);

    for sent in 1..=3 {
        drop(held.pop());
        until(|| provider.names().len() >= sent).await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    // The interactive request goes first, although both batch requests waited before it came.
    assert_eq!(provider.names(), ["interactive", "batch-1", "batch-2"]);
}

#[tokio::test]
async fn a_local_refusal_is_a_downcastable_error_and_sends_nothing() {
    let budget = tokens(1_000);
    let provider = Provider::start(&budget, 0).await;
    let recorder = Recorder::default();
    let client = client(stack(&budget), &recorder);

    let error = client
        .post(provider.url())
        .body(CHAT)
        .with_extension(Cost::new(5_000, 0))
        .send()
        .await
        .unwrap_err();
    assert!(error.is_middleware());
    let error = quota_error(&error);
    assert!(error.is_too_large() && error.is_local());
    assert_eq!(error.insufficient_capacity().unwrap().capacity(), 1_000);
    assert_eq!((provider.names().len(), recorder.attempts().len()), (0, 0));
}

#[tokio::test]
async fn an_error_of_the_rest_of_the_chain_comes_back_unchanged() {
    let budget = tokens(1_000);
    let provider = Provider::start(&budget, 0).await;
    let recorder = Recorder {
        fail: Some(std::io::ErrorKind::PermissionDenied),
        ..Recorder::default()
    };
    let client = client(stack(&budget), &recorder);

    let error = client
        .post(provider.url())
        .body(CHAT)
        .send()
        .await
        .unwrap_err();
    let reqwest_middleware::Error::Middleware(error) = error else {
        panic!("not a middleware error: {error}");
    };
    let io = error.downcast_ref::<std::io::Error>().unwrap();
    assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
    // Not worth a retry: one attempt, and nothing reached the provider.
    assert_eq!((recorder.attempts().len(), provider.names().len()), (1, 0));
    // The stack cannot tell that nothing was sent: the estimate stays charged.
    let estimated = estimate(CHAT.as_bytes(), &CharEstimator::new(), &Defaults::new()).unwrap();
    assert_eq!(
        budget.snapshot().limits()[0].level(),
        1_000 - estimated.total_tokens() as i64
    );
}

#[tokio::test]
async fn a_refused_connection_is_retried_then_reported() {
    let budget = tokens(1_000);
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let recorder = Recorder::default();
    let fast = Duration::from_millis(1);
    let policy = RetryPolicy::new()
        .backoff(fast, fast * 10)
        .unwrap()
        .max_attempts(Priority::Async, std::num::NonZeroU32::new(2).unwrap());
    let client = client(stack(&budget).retry(policy), &recorder);

    let error = client
        .post(format!("http://{closed}/v1/chat/completions"))
        .body(CHAT)
        .send()
        .await
        .unwrap_err();
    let error = quota_error(&error);
    assert!(error.is_retries_exhausted());
    assert_eq!(error.retry_report().unwrap().attempts(), 2);
    let reqwest = find::<reqwest::Error>(error).unwrap();
    assert!(reqwest.is_connect());
    assert_eq!(recorder.attempts().len(), 2);
}

#[tokio::test]
async fn a_streaming_body_is_sent_once() {
    let budget = fast_tokens();
    let provider = Provider::start(&budget, 1).await;
    let recorder = Recorder::default();
    let client = client(stack(&budget), &recorder);

    let body = reqwest::Body::wrap(Full::new(Bytes::from(CHAT)));
    let error = client
        .post(provider.url())
        .body(body)
        .with_extension(Cost::new(100, 50))
        .send()
        .await
        .unwrap_err();
    let error = quota_error(&error);
    assert!(error.is_retries_exhausted());
    assert_eq!(
        find::<AttemptError>(error),
        Some(&AttemptError::BodyNotReplayable)
    );
    assert_eq!((provider.names().len(), recorder.attempts().len()), (1, 1));
}

/// A middleware after the quota middleware that takes 300 ms before passing the request on,
/// and records, per attempt, how long it ran before it was dropped (or `None` if it ended).
#[derive(Clone, Default)]
struct Slow {
    runs: Arc<Mutex<Vec<Option<Duration>>>>,
}

struct Running {
    runs: Arc<Mutex<Vec<Option<Duration>>>>,
    index: usize,
    started: tokio::time::Instant,
    finished: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.finished {
            self.runs.lock().unwrap()[self.index] = Some(self.started.elapsed());
        }
    }
}

impl Middleware for Slow {
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        request: reqwest::Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> Pin<
        Box<
            dyn Future<Output = reqwest_middleware::Result<reqwest::Response>>
                + Send
                + 'async_trait,
        >,
    >
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        let running = {
            let mut runs = self.runs.lock().unwrap();
            runs.push(None);
            Running {
                runs: self.runs.clone(),
                index: runs.len() - 1,
                started: tokio::time::Instant::now(),
                finished: false,
            }
        };
        Box::pin(async move {
            let mut running = running; // the whole guard, not only its flag
            tokio::time::sleep(Duration::from_millis(300)).await;
            running.finished = true;
            next.run(request, extensions).await
        })
    }
}

#[tokio::test]
async fn an_attempt_the_stack_gave_up_on_stops_at_once() {
    use std::num::NonZeroU32;
    use tower::ServiceBuilder;
    use tower::timeout::TimeoutLayer;
    use tower_llm_quota::RetryAfterLayer;

    let policy = RetryPolicy::new()
        .max_attempts(Priority::Async, NonZeroU32::new(2).unwrap())
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .unwrap();
    // Each attempt may take 100 ms; the one after it is tried once more.
    let layer = ServiceBuilder::new()
        .layer(RetryAfterLayer::new(policy))
        .layer(TimeoutLayer::new(Duration::from_millis(100)));
    let slow = Slow::default();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(QuotaMiddleware::new(layer))
        .with(slow.clone())
        .build();
    // A timed-out attempt may have been processed: it is retried only with a key.
    let error = client
        .post("http://127.0.0.1:9/v1/chat/completions")
        .header("idempotency-key", "op-1")
        .body(CHAT)
        .send()
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains("retr") || error.is_middleware(),
        "{error}"
    );
    let runs = slow.runs.lock().unwrap().clone();
    println!("attempts ran {runs:?}");
    assert_eq!(runs.len(), 2, "two attempts");
    // The first attempt is dropped when its timeout fires, not when the whole request ends.
    let first = runs[0].expect("dropped, never finished");
    assert!(
        first < Duration::from_millis(180),
        "the first attempt ran {first:?}"
    );
}
