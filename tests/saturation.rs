//! A 1,000-item batch backlog saturates a token budget while interactive requests keep
//! arriving: interactive work never waits behind the backlog, batch work keeps its bound, and
//! everything completes. Runs in virtual time (a few minutes of traffic in milliseconds).

mod support;

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response};
use support::{budget, limit};
use tokio::time::{self, Instant};
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::{
    Cost, Dimension, Error, Priority, PriorityQueueLayer, QueueConfig, Timings, TokenBudgetLayer,
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
    let queue = PriorityQueueLayer::new(QueueConfig::new());
    let handle = queue.handle();
    let client =
        service_fn(|_request: Request<()>| async { Ok::<_, Infallible>(Response::new(())) });
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
        // Nothing else takes time in this stack: the wait is all of it, and it was measured.
        assert_eq!(timings.waited(), elapsed);
        match priority {
            Priority::Batch => batch_waits.push(timings.waited()),
            _ => interactive_waits.push(timings.waited()),
        }
    }

    // Interactive: at most its own refill plus one batch item ahead of it in the budget.
    let interactive_bound = refill(INTERACTIVE_COST) + refill(BATCH_COST);
    let worst_interactive = *interactive_waits.iter().max().unwrap();
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
    let half_rate = refill(BATCH_ITEMS * BATCH_COST) * 2;
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
