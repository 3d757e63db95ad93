use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response};
use tokio::task::JoinHandle;
use tokio::time::{self, Instant};
use tokio_test::{assert_pending, task};
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::{
    Budget, Cost, Deadline, Error, Priority, PriorityQueueLayer, QueueConfig, Timings,
    TokenBudgetLayer, queue::QueueHandle,
};

use crate::support::{levels, tokens_10_per_sec};

const SEC: Duration = Duration::from_secs(1);

type Log = Arc<Mutex<Vec<(String, Duration)>>>;
type Llm = BoxCloneService<Request<String>, Response<String>, Error>;

/// A governed client whose provider records each request's label and arrival time.
struct Stack {
    llm: Llm,
    queue: QueueHandle,
    log: Log,
}

impl Stack {
    fn new(budget: &Budget, config: QueueConfig) -> Self {
        Self::with_budget_layer(
            config,
            TokenBudgetLayer::new(budget.clone()),
            Duration::ZERO,
        )
    }

    fn with_budget_layer(config: QueueConfig, budget: TokenBudgetLayer, latency: Duration) -> Self {
        let log: Log = Default::default();
        let start = Instant::now();
        let provider_log = log.clone();
        let client = service_fn(move |request: Request<String>| {
            let log = provider_log.clone();
            async move {
                log.lock()
                    .unwrap()
                    .push((request.body().clone(), start.elapsed()));
                time::sleep(latency).await;
                Ok::<_, Infallible>(Response::new(String::from("ok")))
            }
        });
        let queue = PriorityQueueLayer::new(config);
        let handle = queue.handle().including(budget.budget());
        let llm = ServiceBuilder::new()
            .layer(queue)
            .layer(budget)
            .service(client);
        Self {
            llm: BoxCloneService::new(llm),
            queue: handle,
            log,
        }
    }

    fn request(label: &str, priority: Priority, tokens: u64) -> Request<String> {
        let mut request = Request::new(label.to_owned());
        request.extensions_mut().insert(Cost::new(tokens, 0));
        request.extensions_mut().insert(priority);
        request
    }

    /// Sends a request from its own task, and lets it reach the queue before returning.
    async fn spawn(&self, request: Request<String>) -> JoinHandle<Result<Response<String>, Error>> {
        let task = tokio::spawn(self.llm.clone().oneshot(request));
        tokio::task::yield_now().await;
        task
    }

    fn arrivals(&self) -> Vec<(String, f64)> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .map(|(label, at)| (label.clone(), at.as_secs_f64()))
            .collect()
    }
}

fn drained() -> Budget {
    let budget = tokens_10_per_sec();
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    budget
}

fn arrival(label: &str, at: f64) -> (String, f64) {
    (label.to_owned(), at)
}

#[tokio::test(start_paused = true)]
async fn budget_goes_by_class_then_arrival_not_by_arrival_alone() {
    let budget = drained();
    let stack = Stack::new(&budget, QueueConfig::new());
    // The first request finds nobody waiting and waits for its tokens; the others join the
    // same ordering, each by its class: the batch request that came first goes last but one.
    let mut tasks = vec![stack.spawn(Stack::request("b0", Priority::Batch, 10)).await];
    for (label, priority) in [
        ("b1", Priority::Batch),
        ("a1", Priority::Async),
        ("i1", Priority::Interactive),
        ("a2", Priority::Async),
        ("i2", Priority::Interactive),
    ] {
        tasks.push(stack.spawn(Stack::request(label, priority, 10)).await);
    }
    let snapshot = stack.queue.snapshot();
    assert_eq!(snapshot.depth(), 6);
    assert_eq!(snapshot.class(Priority::Interactive).depth(), 2);
    assert_eq!(snapshot.class(Priority::Batch).depth(), 2);
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(
        stack.arrivals(),
        [
            arrival("i1", 1.0),
            arrival("i2", 2.0),
            arrival("a1", 3.0),
            arrival("a2", 4.0),
            arrival("b0", 5.0),
            arrival("b1", 6.0),
        ]
    );
    assert_eq!(stack.queue.snapshot().depth(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_small_batch_request_does_not_slip_past_a_large_waiting_interactive_one() {
    let budget = drained();
    let config = QueueConfig::new().max_wait(Priority::Interactive, 10 * SEC);
    let stack = Stack::new(&budget, config);
    let head = stack
        .spawn(Stack::request("head", Priority::Batch, 10))
        .await;
    let large = stack
        .spawn(Stack::request("large", Priority::Interactive, 50))
        .await;
    let small = stack
        .spawn(Stack::request("small", Priority::Batch, 1))
        .await;
    for task in [head, large, small] {
        task.await.unwrap().unwrap();
    }
    // The interactive request outranks the batch request that was waiting before it came:
    // it goes first, and neither batch request slips past it.
    assert_eq!(
        stack.arrivals(),
        [
            arrival("large", 5.0),
            arrival("head", 6.0),
            arrival("small", 6.1)
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn the_front_of_a_starved_class_is_promoted_at_its_exact_thresholds() {
    let budget = drained();
    let config = QueueConfig::new()
        .promote_after(Priority::Batch, Some(2 * SEC))
        .promote_after(Priority::Async, Some(SEC));
    let stack = Stack::new(&budget, config);
    let mut tasks = vec![
        stack
            .spawn(Stack::request("head", Priority::Interactive, 10))
            .await,
    ];
    tasks.push(
        stack
            .spawn(Stack::request("batch", Priority::Batch, 10))
            .await,
    );
    // Interactive work enqueued every second at k + 0.5 s, each taking a second of budget:
    // enough to starve the batch request without aging.
    let start = Instant::now();
    for k in 0..6 {
        time::sleep_until(start + SEC * k + SEC / 2).await;
        tasks.push(
            stack
                .spawn(Stack::request(&format!("i{k}"), Priority::Interactive, 10))
                .await,
        );
    }
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    // The batch request is the front from 0 s: async at 2 s, interactive at 3 s. At 3 s, when
    // the budget frees, it is interactive and came first of all (at 0 s; i1 at 1.5 s): it is
    // admitted then, ahead of the interactive requests that came after it.
    assert_eq!(
        stack.arrivals(),
        [
            arrival("head", 1.0),
            arrival("i0", 2.0),
            arrival("batch", 3.0),
            arrival("i1", 4.0),
            arrival("i2", 5.0),
            arrival("i3", 6.0),
            arrival("i4", 7.0),
            arrival("i5", 8.0),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_deadline_fails_the_request_at_the_exact_time_in_the_queue_or_in_the_budget() {
    // Drained by a call still in flight: it may give all of its 100 tokens back, so the
    // budget cannot tell that the class's wait will not be met, and waits it out.
    let budget = tokens_10_per_sec();
    let in_flight = budget.try_reserve(Cost::new(100, 0)).unwrap();
    let config = QueueConfig::new().max_wait(Priority::Interactive, SEC * 3 / 10);
    let stack = Stack::new(&budget, config);
    let start = Instant::now();

    // Waiting in the budget (the queue handed it over at once): the budget gives up at 300 ms.
    let in_budget = stack
        .spawn(Stack::request("in budget", Priority::Interactive, 50))
        .await;
    // Waiting behind it, without a deadline (batch work waits as long as it takes).
    let in_queue = stack
        .spawn(Stack::request("queued", Priority::Batch, 1))
        .await;

    let error = in_budget.await.unwrap().unwrap_err();
    assert_eq!(start.elapsed(), SEC * 3 / 10);
    assert!(error.is_deadline_exceeded() && error.is_local());
    assert_eq!(error.priority(), Some(Priority::Interactive));
    assert_eq!(error.waited(), Some(SEC * 3 / 10));

    // The head left, so the request behind it went: its 1 token is there by then.
    in_queue.await.unwrap().unwrap();
    assert_eq!(stack.arrivals(), [arrival("queued", 0.3)]);
    // Nothing of the expired request was kept: 3 tokens refilled, 1 spent.
    assert_eq!((budget.waiters(), levels(&budget)), (0, vec![2]));

    // A request behind a head of its class that cannot be admitted before its own deadline
    // (31 tokens are 2.9 s away, its deadline 300 ms): refused at once, with the prediction.
    let head = stack
        .spawn(Stack::request("head", Priority::Batch, 30))
        .await;
    let queued_at = Instant::now();
    let mut late = Stack::request("late", Priority::Batch, 1);
    late.extensions_mut()
        .insert(Deadline::at(queued_at + SEC * 3 / 10));
    let late = stack.spawn(late).await;
    let error = late.await.unwrap().unwrap_err();
    assert_eq!(queued_at.elapsed(), Duration::ZERO);
    assert!(error.is_deadline_exceeded());
    assert_eq!(error.waited(), Some(Duration::ZERO));
    assert_eq!(error.predicted_wait(), Some(SEC * 29 / 10));
    assert_eq!(
        stack.queue.snapshot().depth(),
        1,
        "only the head still waits"
    );
    head.await.unwrap().unwrap();
    in_flight.charge_estimate();
}

/// A class's longest wait that cannot be met even if every call in flight gave back all it
/// holds: refused on arrival with the wait the budget predicts, not after waiting it out.
#[tokio::test(start_paused = true)]
async fn a_class_wait_that_cannot_be_met_is_refused_at_once_with_the_wait() {
    let budget = drained();
    let config = QueueConfig::new().max_wait(Priority::Interactive, SEC * 3 / 10);
    let stack = Stack::new(&budget, config);
    let start = Instant::now();
    let error = stack
        .spawn(Stack::request("spent", Priority::Interactive, 50))
        .await
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert!(error.is_deadline_exceeded() && error.is_local());
    assert_eq!(
        error.predicted_wait(),
        Some(SEC * 5),
        "50 tokens at 10 a second"
    );

    // 30 tokens held in flight might come back: the 20 left are still 2 s away.
    time::sleep(SEC * 10).await;
    budget
        .try_reserve(Cost::new(70, 0))
        .unwrap()
        .charge_estimate();
    let held = budget.try_reserve(Cost::new(30, 0)).unwrap();
    let error = stack
        .spawn(Stack::request("held", Priority::Interactive, 50))
        .await
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(error.predicted_wait(), Some(SEC * 2));
    // Held back, the 30 tokens make a 30-token request's wait unknowable: it waits its 300 ms.
    let waited = Instant::now();
    let error = stack
        .spawn(Stack::request("maybe", Priority::Interactive, 30))
        .await
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(waited.elapsed(), SEC * 3 / 10);
    assert_eq!(error.predicted_wait(), None);
    held.charge_estimate();
    assert_eq!(stack.arrivals(), Vec::<(String, f64)>::new());
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_sheds_at_the_exact_depth() {
    let budget = drained();
    let config = QueueConfig::new()
        .max_depth(std::num::NonZeroUsize::new(3).unwrap())
        .class_max_depth(Priority::Batch, std::num::NonZeroUsize::new(2).unwrap());
    let stack = Stack::new(&budget, config);
    // Every waiting request counts, the one at the head too.
    let _head = stack
        .spawn(Stack::request("head", Priority::Batch, 10))
        .await;
    let _b1 = stack.spawn(Stack::request("b1", Priority::Batch, 10)).await;
    let error = stack
        .spawn(Stack::request("b2", Priority::Batch, 10))
        .await
        .await
        .unwrap()
        .unwrap_err();
    assert!(error.is_queue_full() && error.is_local());
    assert_eq!(error.priority(), Some(Priority::Batch));
    let _i1 = stack
        // 4 s away: within the class's 5 s (a wait past it would be refused on arrival).
        .spawn(Stack::request("i1", Priority::Interactive, 40))
        .await;
    let error = stack
        .spawn(Stack::request("i2", Priority::Interactive, 10))
        .await
        .await
        .unwrap()
        .unwrap_err();
    assert!(error.is_queue_full());
    assert_eq!(stack.queue.snapshot().depth(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_request_dropped_while_queued_leaves_no_trace() {
    let budget = drained();
    let stack = Stack::new(&budget, QueueConfig::new());
    let head = stack
        .spawn(Stack::request("head", Priority::Batch, 10))
        .await;
    let mut queued = task::spawn(stack.llm.clone().oneshot(Stack::request(
        "gone",
        Priority::Async,
        10,
    )));
    assert_pending!(queued.poll());
    let next = stack
        .spawn(Stack::request("next", Priority::Batch, 10))
        .await;
    time::advance(SEC / 2).await;
    let snapshot = stack.queue.snapshot();
    assert_eq!(snapshot.depth(), 3);
    assert_eq!(snapshot.class(Priority::Async).oldest_wait(), SEC / 2);

    drop(queued);
    assert_eq!(stack.queue.snapshot().depth(), 2);
    assert_eq!((budget.waiters(), levels(&budget)), (2, vec![5]));
    head.await.unwrap().unwrap();
    next.await.unwrap().unwrap();
    assert_eq!(
        stack.arrivals(),
        [arrival("head", 1.0), arrival("next", 2.0)]
    );
}

#[tokio::test(start_paused = true)]
async fn queue_budget_and_call_times_are_told_apart() {
    let budget = drained();
    let stack = Stack::with_budget_layer(
        QueueConfig::new(),
        TokenBudgetLayer::new(budget.clone()),
        SEC / 2,
    );
    let head = stack
        .spawn(Stack::request("head", Priority::Batch, 10))
        .await;
    let timed = stack
        .spawn(Stack::request("timed", Priority::Batch, 20))
        .await;
    let response = timed.await.unwrap().unwrap();
    let timings = *response.extensions().get::<Timings>().unwrap();
    // It waits in the budget's ordering: behind the head (1 s), then 2 s for its 20 tokens,
    // then the call. The queue held neither request itself.
    assert_eq!(timings.queued(), Duration::ZERO);
    assert_eq!(timings.budget(), 3 * SEC);
    assert_eq!(timings.call(), SEC / 2);
    assert_eq!(timings.waited(), 3 * SEC);
    let head = head.await.unwrap().unwrap();
    let head = head.extensions().get::<Timings>().unwrap();
    assert_eq!((head.queued(), head.budget()), (Duration::ZERO, SEC));
}

#[tokio::test(start_paused = true)]
async fn class_floor_keeps_the_last_share_for_higher_classes() {
    let budget = tokens_10_per_sec();
    let layer = TokenBudgetLayer::new(budget.clone()).class_floor(Priority::Batch, 0.5);
    let stack = Stack::with_budget_layer(QueueConfig::new(), layer, Duration::ZERO);

    // More than the half batch may use: refused at once, naming the usable capacity.
    let error = stack
        .spawn(Stack::request("big batch", Priority::Batch, 60))
        .await
        .await
        .unwrap()
        .unwrap_err();
    assert!(error.is_too_large());
    assert_eq!(error.insufficient_capacity().unwrap().capacity(), 50);

    stack
        .spawn(Stack::request("batch 1", Priority::Batch, 40))
        .await
        .await
        .unwrap()
        .unwrap();
    // 60 left: batch may not go below 50, interactive may.
    stack
        .spawn(Stack::request("interactive", Priority::Interactive, 40))
        .await
        .await
        .unwrap()
        .unwrap();
    stack
        .spawn(Stack::request("batch 2", Priority::Batch, 40))
        .await
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        stack.arrivals(),
        [
            arrival("batch 1", 0.0),
            arrival("interactive", 0.0),
            // 20 left; batch 2 needs 40 + 50: 7 s of refill.
            arrival("batch 2", 7.0),
        ]
    );
}

/// Over an inner service that is not ready (here a mock allowing no call), requests wait in
/// the queue's own ordering, which expires each at its own deadline with one alarm.
#[tokio::test(start_paused = true)]
async fn one_alarm_expires_every_waiting_request_at_its_own_deadline() {
    let (client, mut handle) = tower_test::mock::pair::<Request<String>, Response<String>>();
    handle.allow(0);
    let config = QueueConfig::new().max_wait(Priority::Interactive, SEC * 3 / 10);
    let queue = PriorityQueueLayer::new(config);
    let snapshot = queue.handle();
    let llm = ServiceBuilder::new().layer(queue).service(client);
    let start = Instant::now();

    let with_deadline = |label, priority, millis| {
        let mut request = Stack::request(label, priority, 1);
        request
            .extensions_mut()
            .insert(Deadline::at(start + Duration::from_millis(millis)));
        request
    };
    let spawn = |request| tokio::spawn(llm.clone().oneshot(request));
    let mut waiting = vec![
        ("a", spawn(Stack::request("a", Priority::Interactive, 1))),
        ("b", spawn(with_deadline("b", Priority::Batch, 200))),
        ("c", spawn(with_deadline("c", Priority::Async, 500))),
    ];
    time::sleep(SEC / 10).await;
    waiting.push(("d", spawn(Stack::request("d", Priority::Interactive, 1))));
    tokio::task::yield_now().await;
    assert_eq!(snapshot.snapshot().depth(), 4);

    let mut expired = Vec::new();
    for (label, task) in waiting {
        let error = task.await.unwrap().unwrap_err();
        assert!(error.is_deadline_exceeded());
        expired.push((label, error.waited().unwrap().as_millis()));
    }
    // a: 300 ms class wait; b: its own 200 ms; c: its own 500 ms; d: enqueued at 100 ms.
    assert_eq!(expired, [("a", 300), ("b", 200), ("c", 500), ("d", 300)]);
    assert_eq!(start.elapsed(), SEC / 2);
    assert_eq!(snapshot.snapshot().depth(), 0);
}
