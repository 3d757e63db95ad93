//! A 1,000-item batch backlog saturates a budget while interactive requests keep arriving:
//! interactive work never waits behind the backlog, batch work keeps its bound, and everything
//! completes — whether the binding resource is the token bucket or the in-flight slot. Runs in
//! virtual time (a few minutes of traffic in milliseconds). The same with a Redis-shared budget
//! runs in real time, scaled down, in `tests/budget/ordering.rs`.

use tower_llm_quota_test_support as support;

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response};
use support::{budget, limit};
use tokio::time::{self, Instant};
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::{
    Budget, Cost, Dimension, Error, Priority, PriorityQueueLayer, QueueConfig, Quota, Timings,
    TokenBudgetLayer,
};

const RATE: u64 = 1_000; // tokens per second
const BATCH_ITEMS: u64 = 1_000;
const BATCH_COST: u64 = 100;
const INTERACTIVE_COST: u64 = 500; // one per second: half the quota
const INTERACTIVE_SECONDS: u64 = 250;

type Llm = BoxCloneService<Request<()>, Response<()>, Error>;

fn refill(tokens: u64) -> Duration {
    Duration::from_millis(tokens * 1_000 / RATE)
}

async fn send(llm: Llm, priority: Priority, tokens: u64) -> (Priority, Duration, Timings) {
    let mut request = Request::new(());
    request.extensions_mut().insert(priority);
    request.extensions_mut().insert(Cost::new(tokens, 0));
    let start = Instant::now();
    let response = llm.oneshot(request).await.expect("every item completes");
    let timings = *response.extensions().get::<Timings>().unwrap();
    (priority, start.elapsed(), timings)
}

#[tokio::test(start_paused = true)]
async fn interactive_work_keeps_its_latency_while_batch_work_saturates_the_quota() {
    let budget = budget([limit(
        Dimension::TotalTokens,
        RATE,
        Duration::from_secs(1),
        RATE,
    )]);
    // Interactive: at most its own refill plus one batch item ahead of it in the budget.
    let bound = refill(INTERACTIVE_COST) + refill(BATCH_COST);
    saturate(budget, Duration::ZERO, bound).await;
}

/// The same backlog when calls take longer than the quota's refill and one call at a time may
/// be in flight: the slot binds, and interactive requests wait for the one call in flight only.
#[tokio::test(start_paused = true)]
async fn interactive_work_keeps_its_latency_while_batch_work_holds_every_slot() {
    const CALL: Duration = Duration::from_millis(150);
    let budget = Budget::new(
        Quota::new()
            .with_limit(limit(
                Dimension::TotalTokens,
                RATE * 10,
                Duration::from_secs(1),
                RATE * 10,
            ))
            .with_max_in_flight(std::num::NonZeroUsize::new(1).unwrap()),
    );
    // Plenty of tokens: an interactive request waits for the call in flight (one batch item)
    // and for nothing else.
    saturate(budget, CALL, CALL).await;
}

/// 1,000 batch items at once, then an interactive request every second for 250 s, through a
/// queue and `budget`, against a client taking `call` per request; every interactive request
/// must wait at most `interactive_bound`.
async fn saturate(budget: Budget, call: Duration, interactive_bound: Duration) {
    let queue = PriorityQueueLayer::new(QueueConfig::new());
    let handle = queue.handle().including(&budget);
    let client = service_fn(move |_request: Request<()>| async move {
        time::sleep(call).await;
        Ok::<_, Infallible>(Response::new(()))
    });
    let llm: Llm = BoxCloneService::new(
        ServiceBuilder::new()
            .layer(queue)
            .layer(TokenBudgetLayer::new(budget.clone()))
            .service(client),
    );

    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..BATCH_ITEMS {
        tasks.push(tokio::spawn(send(llm.clone(), Priority::Batch, BATCH_COST)));
    }
    for second in 0..INTERACTIVE_SECONDS {
        time::sleep_until(start + Duration::from_secs(second) + Duration::from_millis(500)).await;
        tasks.push(tokio::spawn(send(
            llm.clone(),
            Priority::Interactive,
            INTERACTIVE_COST,
        )));
    }

    let mut batch_waits = Vec::new();
    let mut interactive_waits = Vec::new();
    for task in tasks {
        let (priority, elapsed, timings) = task.await.unwrap();
        // Nothing else takes time in this stack: the wait and the call are all of it, and both
        // were measured.
        assert_eq!(timings.waited() + timings.call(), elapsed);
        match priority {
            Priority::Batch => batch_waits.push(timings.waited()),
            _ => interactive_waits.push(timings.waited()),
        }
    }

    let worst_interactive = *interactive_waits.iter().max().unwrap();
    eprintln!(
        "worst interactive wait {worst_interactive:?} (bound {interactive_bound:?}), worst batch \
         wait {:?}",
        batch_waits.iter().max().unwrap()
    );
    assert!(
        worst_interactive <= interactive_bound,
        "{worst_interactive:?} > {interactive_bound:?}"
    );
    assert_eq!(interactive_waits.len(), INTERACTIVE_SECONDS as usize);

    // Batch: the k-th in line within the documented bound (k × 150 s under saturation); here
    // interactive work leaves half the quota, so the whole backlog clears at half the rate.
    for (k, wait) in batch_waits.iter().enumerate() {
        assert!(*wait <= Duration::from_secs(150) * (k as u32 + 1));
    }
    let worst_batch = *batch_waits.iter().max().unwrap();
    let half_rate = (refill(BATCH_ITEMS * BATCH_COST) * 2).max(call * BATCH_ITEMS as u32 * 2);
    assert!(
        worst_batch <= half_rate + refill(INTERACTIVE_COST),
        "{worst_batch:?}"
    );
    assert!(
        batch_waits.windows(2).all(|w| w[0] <= w[1]),
        "FIFO within the class"
    );

    // Nothing left behind.
    assert_eq!(handle.snapshot().depth(), 0);
    assert_eq!(budget.waiters(), 0);
}
