//! In-flight slots: a limit of the budget that does not refill, admitted with the tokens from
//! the head of the budget's ordering and held until the response body ends.

use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::channel::mpsc;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tokio::time::{self, Instant};
use tokio_test::{assert_pending, assert_ready_ok, task};
use tower::util::BoxCloneService;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::{
    Budget, Cost, Dimension, Priority, PriorityQueueLayer, Quota, ReconcileLayer, TokenBudgetLayer,
};

use crate::support::{limit, request_with, tokens_10_per_sec};

type Chunk = Result<Frame<Bytes>, Infallible>;
type Streaming = StreamBody<mpsc::UnboundedReceiver<Chunk>>;
/// The sender of every response body the client opened, in order.
type Opened = mpsc::UnboundedReceiver<mpsc::UnboundedSender<Chunk>>;

/// A client whose every response streams until the test closes its sender.
fn streaming_client() -> (
    impl Service<Request<&'static str>, Response = Response<Streaming>, Error = Infallible> + Clone,
    Opened,
) {
    let (senders, opened) = mpsc::unbounded();
    let client = service_fn(move |_request: Request<&'static str>| {
        let (tx, rx) = mpsc::unbounded();
        senders.unbounded_send(tx).unwrap();
        async move { Ok::<_, Infallible>(Response::new(StreamBody::new(rx))) }
    });
    (client, opened)
}

fn one(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap()
}

/// Plenty of tokens (1,000,000 at once, refilling by one a second so that levels show what is
/// reserved), `slots` calls in flight at most.
fn slots(slots: usize) -> Budget {
    Budget::new(
        Quota::new()
            .with_limit(limit(
                Dimension::TotalTokens,
                1,
                Duration::from_secs(1),
                1_000_000,
            ))
            .with_max_in_flight(one(slots)),
    )
}

fn in_flight(budget: &Budget) -> usize {
    budget.snapshot().in_flight()
}

#[tokio::test(start_paused = true)]
async fn a_slot_is_held_until_the_body_ends_not_until_the_head_arrives() {
    let budget = slots(1);
    let (client, mut opened) = streaming_client();
    let mut service = ServiceBuilder::new()
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::new())
        .service(client);

    let first = service
        .ready()
        .await
        .unwrap()
        .call(request_with(Cost::new(10, 0)))
        .await
        .unwrap();
    assert_eq!(in_flight(&budget), 1);

    // The head arrived, the stream goes on: a second call must wait for the slot.
    let mut second = task::spawn(
        service
            .ready()
            .await
            .unwrap()
            .call(request_with(Cost::new(10, 0))),
    );
    assert_pending!(second.poll());
    assert_eq!(budget.snapshot().waiters(), 1);
    let stream = opened.try_recv().unwrap();
    stream
        .unbounded_send(Ok(Frame::data(Bytes::from("tok"))))
        .unwrap();
    drop(stream);
    let body = first.into_body().collect().await.unwrap();
    assert_eq!(body.to_bytes(), "tok");
    // The slot went straight to the waiting call.
    assert!(second.is_woken());
    let _second = assert_ready_ok!(second.poll());
    assert_eq!(in_flight(&budget), 1);
    assert_eq!(budget.snapshot().waiters(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_body_or_failed_call_releases_its_slot() {
    let budget = slots(1);
    let (client, _opened) = streaming_client();
    let mut service = ServiceBuilder::new()
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::new())
        .service(client);
    let response = service
        .ready()
        .await
        .unwrap()
        .call(request_with(Cost::new(10, 0)))
        .await
        .unwrap();
    assert_eq!(in_flight(&budget), 1);
    drop(response);
    assert_eq!(in_flight(&budget), 0);

    let failing = service_fn(|_request: Request<&'static str>| async {
        Err::<Response<String>, _>(std::io::Error::other("refused"))
    });
    let mut service = ServiceBuilder::new()
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::new())
        .service(failing);
    let failed = service
        .ready()
        .await
        .unwrap()
        .call(request_with(Cost::new(10, 0)))
        .await;
    assert!(failed.is_err());
    assert_eq!(in_flight(&budget), 0);
}

#[tokio::test(start_paused = true)]
async fn a_request_waiting_for_quota_holds_no_slot() {
    let budget = Budget::new(
        Quota::new()
            .with_limit(limit(
                Dimension::TotalTokens,
                10,
                Duration::from_secs(1),
                100,
            ))
            .with_max_in_flight(one(1)),
    );
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    assert_eq!(
        in_flight(&budget),
        0,
        "a settled reservation gives its slot back"
    );
    let (client, _opened) = streaming_client();
    let mut service = ServiceBuilder::new()
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::new())
        .service(client);

    let mut call = task::spawn(
        service
            .ready()
            .await
            .unwrap()
            .call(request_with(Cost::new(20, 0))),
    );
    assert_pending!(call.poll());
    assert_eq!(in_flight(&budget), 0, "waiting for quota holds no slot");
    time::advance(Duration::from_secs(2)).await;
    let response = assert_ready_ok!(call.poll());
    assert_eq!(in_flight(&budget), 1);
    drop(response);
    assert_eq!(in_flight(&budget), 0);
}

type Log = Arc<Mutex<Vec<String>>>;

fn labelled(label: &str, priority: Priority, tokens: u64) -> Request<String> {
    let mut request = Request::new(label.to_owned());
    request.extensions_mut().insert(Cost::new(tokens, 0));
    request.extensions_mut().insert(priority);
    request
}

/// With the in-flight limit binding (one slot, calls of 100 ms), ten batch requests and then
/// one interactive request: the interactive request is served right after the call already
/// in flight, and the waiting requests hold no tokens.
#[tokio::test(start_paused = true)]
async fn with_the_slot_binding_interactive_goes_right_after_the_call_in_flight() {
    let budget = slots(1);
    let log: Log = Default::default();
    let calls = log.clone();
    // A client taking 100 ms per call, logging each call's label as it starts.
    let client = service_fn(move |request: Request<String>| {
        calls.lock().unwrap().push(request.into_body());
        async {
            time::sleep(Duration::from_millis(100)).await;
            Ok::<_, Infallible>(Response::new(String::from("done")))
        }
    });
    let llm = BoxCloneService::new(
        ServiceBuilder::new()
            .layer(PriorityQueueLayer::default())
            .layer(TokenBudgetLayer::new(budget.clone()))
            .layer(ReconcileLayer::new())
            .service(client),
    );
    let full = budget.snapshot().limits()[0].level();

    // Each task drops its response, ending the body and giving the slot back, at once.
    let send = |request: Request<String>| {
        let call = llm.clone().oneshot(request);
        tokio::spawn(async move { call.await.map(drop) })
    };
    let mut tasks = Vec::new();
    for _ in 0..10 {
        tasks.push(send(labelled("batch", Priority::Batch, 1_000)));
        tokio::task::yield_now().await;
    }
    time::advance(Duration::from_millis(10)).await;
    // One batch call in flight, nine waiting: they hold one call's tokens, not ten.
    let snapshot = budget.snapshot();
    assert_eq!((snapshot.in_flight(), snapshot.waiters()), (1, 9));
    assert_eq!(snapshot.limits()[0].level(), full - 1_000);
    tasks.push(send(labelled("interactive", Priority::Interactive, 1_000)));
    let started = Instant::now();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 11);
    let position = log.iter().position(|l| *l == "interactive").unwrap();
    assert_eq!(position, 1, "served second: {log:?}");
    // Eleven calls of 100 ms one after another.
    assert_eq!(started.elapsed(), Duration::from_millis(1_090));
}

#[tokio::test(start_paused = true)]
async fn tokens_and_slots_refill_independently() {
    let budget = tokens_10_per_sec();
    budget.set_max_in_flight(Some(one(2)));
    let a = budget.try_reserve(Cost::new(10, 0)).unwrap();
    let b = budget.try_reserve(Cost::new(10, 0)).unwrap();
    assert!(matches!(
        budget.try_reserve(Cost::new(10, 0)),
        Err(tower_llm_quota::error::TryReserveError::NoSlot)
    ));
    let _ = a.refund();
    let c = budget.try_reserve(Cost::new(10, 0)).unwrap();
    assert_eq!(budget.snapshot().in_flight(), 2);
    drop((b, c));
    assert_eq!(budget.snapshot().in_flight(), 0);
}
