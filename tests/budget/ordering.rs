//! One ordering at every place a request waits: an in-flight slot (see also
//! `tests/layers/in_flight.rs`), a class floor, a shared store, and deadline arithmetic that
//! never overflows.

use tower_llm_quota_test_support as support;
use tower_llm_quota_test_support::redis_server;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response};
use tokio::time::{self, Instant};
use tower::util::BoxCloneService;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::{
    Cost, Dimension, Error, Priority, PriorityQueueLayer, QueueConfig, Quota, TokenBudgetLayer,
    queue::EnqueuedAt,
};
use tower_llm_quota_redis::RedisBudget;

use redis_server::RedisServer;
use support::{budget, limit};

const SEC: Duration = Duration::from_secs(1);

type Log = Arc<Mutex<Vec<(String, Instant)>>>;
type Llm = BoxCloneService<Request<String>, Response<String>, Error>;

/// A governed client over `budget`; the provider logs each call's label and instant.
fn governed(config: QueueConfig, budget: TokenBudgetLayer) -> (Llm, Log) {
    let log: Log = Default::default();
    let calls = log.clone();
    let client = service_fn(move |request: Request<String>| {
        calls
            .lock()
            .unwrap()
            .push((request.into_body(), Instant::now()));
        async { Ok::<_, Infallible>(Response::new(String::from("ok"))) }
    });
    let llm = ServiceBuilder::new()
        .layer(PriorityQueueLayer::new(config))
        .layer(budget)
        .service(client);
    (BoxCloneService::new(llm), log)
}

fn request(label: &str, priority: Priority, tokens: u64) -> Request<String> {
    let mut request = Request::new(label.to_owned());
    request.extensions_mut().insert(Cost::new(tokens, 0));
    request.extensions_mut().insert(priority);
    request
}

fn labels(log: &Log) -> Vec<String> {
    log.lock().unwrap().iter().map(|(l, _)| l.clone()).collect()
}

/// A batch request that has aged to the top of the ordering waits only to keep its class
/// floor; an interactive request that the floor can pay is admitted at once, not after it.
#[tokio::test(start_paused = true)]
async fn a_head_blocked_only_by_its_floor_does_not_block_a_higher_class() {
    // 1,000 tokens at once, refilling by one a second: levels stay put during the test.
    let budget = budget([limit(Dimension::TotalTokens, 1, SEC, 1_000)]);
    budget
        .try_reserve(Cost::new(400, 0))
        .unwrap()
        .charge_estimate();
    // Batch keeps half of the bucket for higher classes, and ages fast.
    let config = QueueConfig::new()
        .promote_after(Priority::Batch, Some(SEC))
        .promote_after(Priority::Async, Some(SEC));
    let layer = TokenBudgetLayer::new(budget.clone()).class_floor(Priority::Batch, 0.5);
    let (llm, log) = governed(config, layer);

    // 600 left: 200 batch tokens would leave 400, under the floor of 500. It waits, and by
    // 2 s it ranks as interactive (entered at 2 s).
    let batch = tokio::spawn(llm.clone().oneshot(request("batch", Priority::Batch, 200)));
    time::sleep(3 * SEC).await;
    assert_eq!(budget.waiters(), 1);
    let arrived = Instant::now();
    let interactive = llm
        .clone()
        .oneshot(request("interactive", Priority::Interactive, 500))
        .await
        .unwrap();
    drop(interactive);
    assert_eq!(arrived.elapsed(), Duration::ZERO, "admitted at once");
    assert_eq!(labels(&log), ["interactive"]);
    assert_eq!(
        budget.waiters(),
        1,
        "the batch request still keeps the floor"
    );
    batch.abort();
}

/// `Duration::MAX` as a class's maximum wait means no limit, also for a retried request that
/// carries its first enqueue time.
#[tokio::test(start_paused = true)]
async fn an_unbounded_maximum_wait_never_overflows() {
    let budget = budget([limit(Dimension::TotalTokens, 10, SEC, 100)]);
    let config = QueueConfig::new()
        .max_wait(Priority::Batch, Duration::MAX)
        .max_wait(Priority::Interactive, Duration::MAX);
    let (llm, log) = governed(config, TokenBudgetLayer::new(budget.clone()));
    time::sleep(10 * SEC).await;
    let mut retried = request("retried", Priority::Batch, 100);
    retried
        .extensions_mut()
        .insert(EnqueuedAt::at(Instant::now() - 5 * SEC));
    llm.clone().oneshot(retried).await.unwrap();
    // Waits 10 s for its tokens, unbounded: no deadline passes.
    let late = tokio::spawn(llm.clone().oneshot(request("late", Priority::Batch, 100)));
    let mut deadline = request("own", Priority::Interactive, 1);
    deadline
        .extensions_mut()
        .insert(tower_llm_quota::Deadline::after(Duration::MAX));
    let own = tokio::spawn(llm.clone().oneshot(deadline));
    own.await.unwrap().unwrap();
    late.await.unwrap().unwrap();
    assert_eq!(labels(&log), ["retried", "own", "late"]);
}

/// With a Redis-shared budget: one batch request in flight, five batch requests waiting, then
/// one interactive request. Only the head of the ordering asks the store while it refuses, so
/// the interactive request is served right after the request in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_redis_budget_interactive_goes_right_after_the_call_in_flight() {
    let server = RedisServer::start();
    // Five requests a second, one at a time: a request every 200 ms.
    let quota = Quota::new().with_limit(limit(Dimension::Requests, 5, SEC, 1));
    let budget = RedisBudget::new(server.url(), "ordering")
        .connect(&quota)
        .await
        .expect("connected");
    let (llm, log) = governed(
        QueueConfig::new().max_wait(Priority::Interactive, 30 * SEC),
        TokenBudgetLayer::new(budget.clone()),
    );

    let mut tasks = Vec::new();
    for k in 0..6 {
        tasks.push(tokio::spawn(llm.clone().oneshot(request(
            &format!("batch-{k}"),
            Priority::Batch,
            1,
        ))));
        // Each one reaches the ordering (or the store) before the next.
        until(|| budget.waiters() + labels(&log).len() == k + 1).await;
    }
    tasks.push(tokio::spawn(llm.clone().oneshot(request(
        "interactive",
        Priority::Interactive,
        1,
    ))));
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    let served = labels(&log);
    assert_eq!(served.len(), 7);
    let position = served.iter().position(|l| l == "interactive").unwrap();
    eprintln!(
        "redis ordering: the interactive request was served at position {position}: {served:?}"
    );
    assert!(position <= 1, "served at {position}: {served:?}");
    // The batch requests kept their order among themselves.
    let batch: Vec<_> = served.iter().filter(|l| l.starts_with("batch")).collect();
    assert!(batch.windows(2).all(|w| w[0] < w[1]), "{served:?}");
}

/// Waits (in real time, bounded) until `condition` holds.
async fn until(condition: impl Fn() -> bool) {
    let give_up = Instant::now() + 10 * SEC;
    while !condition() {
        assert!(Instant::now() < give_up, "condition never held");
        time::sleep(Duration::from_millis(2)).await;
    }
}

/// The saturation scenario of `tests/budget/saturation.rs` with a Redis-shared budget, in real time
/// and scaled down: a 100-item batch backlog saturates 2,000 tokens a second while an
/// interactive request of 500 tokens arrives every second. Each interactive request waits at
/// most its own refill plus one batch item (plus a margin for the round trips and timers of a
/// busy machine), and every item completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_redis_budget_interactive_work_keeps_its_latency_under_a_batch_backlog() {
    const RATE: u64 = 2_000;
    const BATCH: u64 = 100;
    const INTERACTIVE: u64 = 500;
    let server = RedisServer::start();
    let quota = Quota::new().with_limit(limit(Dimension::TotalTokens, RATE, SEC, RATE));
    let budget = RedisBudget::new(server.url(), "saturation")
        .connect(&quota)
        .await
        .expect("connected");
    let (llm, log) = governed(QueueConfig::new(), TokenBudgetLayer::new(budget.clone()));
    let send = |label: String, priority, tokens| {
        let call = llm.clone().oneshot(request(&label, priority, tokens));
        tokio::spawn(async move {
            let start = Instant::now();
            call.await.expect("every item completes");
            (priority, start.elapsed())
        })
    };
    let start = Instant::now();
    let mut tasks: Vec<_> = (0..100)
        .map(|k| send(format!("batch-{k}"), Priority::Batch, BATCH))
        .collect();
    for second in 0..6 {
        time::sleep_until(start + SEC * second + SEC / 2).await;
        tasks.push(send(
            format!("interactive-{second}"),
            Priority::Interactive,
            INTERACTIVE,
        ));
    }
    let mut interactive = Vec::new();
    for task in tasks {
        let (priority, waited) = task.await.unwrap();
        if priority == Priority::Interactive {
            interactive.push(waited);
        }
    }
    let refill = |tokens: u64| Duration::from_millis(tokens * 1_000 / RATE);
    let bound = refill(INTERACTIVE) + refill(BATCH) + Duration::from_millis(100);
    let worst = *interactive.iter().max().unwrap();
    eprintln!("redis saturation: worst interactive wait {worst:?} (bound {bound:?})");
    assert!(worst <= bound, "{worst:?} > {bound:?}: {interactive:?}");
    assert_eq!(labels(&log).len(), 106);
    assert_eq!(budget.waiters(), 0);
}

/// The floor case with a Redis-shared budget: the script says when only the floor keeps a cost
/// out, so a request with a lower floor behind the head asks at once instead of waiting for the
/// head's hint (here a hundred seconds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_redis_budget_a_head_blocked_only_by_its_floor_does_not_block_a_higher_class() {
    let server = RedisServer::start();
    // 1,000 tokens at once, refilling by one a second.
    let quota = Quota::new().with_limit(limit(Dimension::TotalTokens, 1, SEC, 1_000));
    let budget = RedisBudget::new(server.url(), "floors")
        .connect(&quota)
        .await
        .expect("connected");
    let mut spent = budget.reserve(Cost::new(400, 0)).await.unwrap();
    spent.mark_sent();
    let _ = spent.charge_estimate();
    let config = QueueConfig::new()
        .promote_after(Priority::Batch, Some(SEC / 2))
        .promote_after(Priority::Async, Some(SEC / 2));
    let layer = TokenBudgetLayer::new(budget.clone()).class_floor(Priority::Batch, 0.5);
    let (llm, log) = governed(config, layer);

    // 600 left: 200 batch tokens would leave 400, under the floor of 500. By 1 s the batch
    // request ranks as interactive.
    let batch = tokio::spawn(llm.clone().oneshot(request("batch", Priority::Batch, 200)));
    time::sleep(3 * SEC / 2).await;
    assert_eq!(budget.waiters(), 1);
    let arrived = Instant::now();
    llm.clone()
        .oneshot(request("interactive", Priority::Interactive, 500))
        .await
        .unwrap();
    let waited = arrived.elapsed();
    eprintln!("redis floor: the interactive request waited {waited:?}");
    assert!(
        waited < SEC / 2,
        "waited {waited:?} behind a head keeping its floor"
    );
    assert_eq!(labels(&log), ["interactive"]);
    batch.abort();
}

/// Aging can make another waiter the head while the old head sleeps until its cost fits: the
/// head looks again when the ranking may change, and hands over. (A 429 pause keeps everyone
/// waiting while aging goes on.)
#[tokio::test(start_paused = true)]
async fn aging_that_changes_the_head_wakes_the_new_head() {
    let t0 = Instant::now();
    let budget = budget([limit(Dimension::TotalTokens, 60, 60 * SEC, 60)]);
    budget.pause(&[Dimension::TotalTokens], t0 + 200 * SEC);
    let spawn = |priority: Priority| {
        let reserve = budget.reserve(Cost::new(1, 0)).priority(priority);
        tokio::spawn(async move { reserve.await.map(|r| (r.refund(), Instant::now())) })
    };
    let w = spawn(Priority::Async);
    time::sleep(SEC).await;
    let y = spawn(Priority::Batch);
    time::sleep(SEC).await;
    let x = spawn(Priority::Async);
    // At 125 s the async front leaves: the next async request starts aging only now, while the
    // batch request (enqueued at 1 s) reaches interactive at 151 s and becomes the head.
    time::sleep(123 * SEC).await;
    w.abort();
    assert!(w.await.is_err());
    let (_, y_at) = y.await.unwrap().unwrap();
    let (_, x_at) = x.await.unwrap().unwrap();
    assert_eq!((y_at - t0, x_at - t0), (200 * SEC, 200 * SEC));
    assert_eq!(budget.waiters(), 0);
}

/// Two waiters that each wait only to keep their own floor do not wake each other in a loop.
#[tokio::test(start_paused = true)]
async fn waiters_blocked_by_their_floors_do_not_spin() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    struct Counted<F> {
        inner: std::pin::Pin<Box<F>>,
        polls: Arc<AtomicUsize>,
    }
    impl<F: std::future::Future> std::future::Future for Counted<F> {
        type Output = F::Output;
        fn poll(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<F::Output> {
            self.polls.fetch_add(1, Ordering::Relaxed);
            self.inner.as_mut().poll(cx)
        }
    }
    let budget = budget([limit(Dimension::TotalTokens, 1, SEC, 1_000)]);
    budget
        .try_reserve(Cost::new(400, 0))
        .unwrap()
        .charge_estimate();
    let (a_polls, b_polls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    // A: batch aged to interactive, keeping 50 %: 600 - 200 = 400 < 500, blocked only by its
    // floor. B: async keeping 20 %: 600 - 500 = 100 < 200, blocked only by its floor too.
    let a = budget
        .reserve(Cost::new(200, 0))
        .priority(Priority::Batch)
        .enqueued_at(Instant::now() - 300 * SEC)
        .floor(0.5);
    let a = tokio::spawn(Counted {
        inner: Box::pin(a),
        polls: a_polls.clone(),
    });
    tokio::task::yield_now().await;
    let b = budget
        .reserve(Cost::new(500, 0))
        .priority(Priority::Async)
        .floor(0.2);
    let b = tokio::spawn(Counted {
        inner: Box::pin(b),
        polls: b_polls.clone(),
    });
    for _ in 0..1_000 {
        tokio::task::yield_now().await;
    }
    let polls = (
        a_polls.load(Ordering::Relaxed),
        b_polls.load(Ordering::Relaxed),
    );
    assert!(
        polls.0 <= 3 && polls.1 <= 3,
        "polls without time passing: {polls:?}"
    );
    a.abort();
    b.abort();
}

fn priced(tokens: u64) -> Request<String> {
    let mut request = Request::new(String::new());
    request.extensions_mut().insert(Cost::new(tokens, 0));
    request
}

/// Readiness a `TokenBudget` took for a request admitted at once is given back when the
/// request must wait, so that its future can take it once admitted (here the one permit of a
/// concurrency limit).
#[tokio::test(start_paused = true)]
async fn a_budget_that_must_wait_gives_back_the_inner_readiness_it_took() {
    let budget = budget([limit(Dimension::TotalTokens, 10, SEC, 100)]);
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    let client = service_fn(|_r: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    });
    let mut llm = ServiceBuilder::new()
        .layer(TokenBudgetLayer::new(budget.clone()))
        .concurrency_limit(1)
        .service(client);
    // Takes the one permit for the service; the bucket is empty, so the request waits.
    let call = llm.ready().await.unwrap().call(priced(10));
    let started = Instant::now();
    call.await.unwrap();
    assert_eq!(started.elapsed(), SEC, "sent once its 10 tokens refilled");
}

/// The same for a priority queue: readiness taken while nobody waited, then others queued, is
/// given back for the head.
#[tokio::test(start_paused = true)]
async fn a_queue_gives_back_readiness_it_cannot_use() {
    let client = service_fn(|_r: Request<String>| async {
        time::sleep(SEC).await;
        Ok::<_, Infallible>(Response::new(String::new()))
    });
    let llm = ServiceBuilder::new()
        .layer(PriorityQueueLayer::new(QueueConfig::new()))
        .concurrency_limit(1)
        .service(client);
    let mut p = llm.clone();
    p.ready().await.unwrap(); // takes the one permit
    let mut q = llm.clone();
    q.ready().await.unwrap(); // the inner service is not ready: q's request queues
    let start = Instant::now();
    let queued = tokio::spawn(q.call(priced(1)));
    tokio::task::yield_now().await;
    // Not empty any more: p's request waits behind it, and p gives its permit back.
    let behind = tokio::spawn(p.call(priced(1)));
    queued.await.unwrap().unwrap();
    behind.await.unwrap().unwrap();
    assert_eq!(start.elapsed(), 2 * SEC);
}

/// A waiter that stops being the queue's head gives up its place in the inner service's own
/// waiting list, so the released permit goes to the new head.
#[tokio::test(start_paused = true)]
async fn a_new_head_of_the_queue_gets_the_inner_readiness_first() {
    let log: Log = Default::default();
    let calls = log.clone();
    let client = service_fn(move |request: Request<String>| {
        calls
            .lock()
            .unwrap()
            .push((request.into_body(), Instant::now()));
        async {
            time::sleep(SEC).await;
            Ok::<_, Infallible>(Response::new(String::new()))
        }
    });
    let llm = ServiceBuilder::new()
        .layer(PriorityQueueLayer::new(QueueConfig::new()))
        .concurrency_limit(1)
        .service(client);
    let first = tokio::spawn(llm.clone().oneshot(request("first", Priority::Async, 1)));
    tokio::task::yield_now().await;
    let batch = tokio::spawn(llm.clone().oneshot(request("batch", Priority::Batch, 1)));
    tokio::task::yield_now().await;
    let interactive = tokio::spawn(llm.clone().oneshot(request(
        "interactive",
        Priority::Interactive,
        1,
    )));
    for task in [first, interactive, batch] {
        task.await.unwrap().unwrap();
    }
    assert_eq!(labels(&log), ["first", "interactive", "batch"]);
}

/// `QuotaStack::concurrency` holds whether the budget is given before or after it.
#[tokio::test(start_paused = true)]
async fn a_stack_caps_calls_in_flight_whatever_the_order_of_its_settings() {
    use tower_llm_quota::stack::QuotaStack;
    let quota = || Quota::new().with_limit(limit(Dimension::TotalTokens, 10, SEC, 100));
    let cap = |stack: &QuotaStack| stack.budget().snapshot().max_in_flight().map(|n| n.get());
    let shared = tower_llm_quota::Budget::new(quota());
    let before = QuotaStack::openai(quota())
        .concurrency(std::num::NonZeroUsize::new(3).unwrap())
        .with_budget(shared);
    assert_eq!(cap(&before), Some(3));
    let shared = tower_llm_quota::Budget::new(quota());
    let after = QuotaStack::openai(quota())
        .with_budget(shared)
        .concurrency(std::num::NonZeroUsize::new(5).unwrap());
    assert_eq!(cap(&after), Some(5));
    let shared = tower_llm_quota::Budget::new(quota());
    let default = QuotaStack::openai(quota()).with_budget(shared);
    assert_eq!(cap(&default), Some(QuotaStack::DEFAULT_CONCURRENCY));
}
