use std::time::Duration;

use http::{Request, Response};
use tokio::time;
use tokio_test::{assert_pending, assert_ready, assert_ready_ok, task};
use tower::{Layer, Service, ServiceExt};
use tower_llm_quota::{
    Cost, MissingCost, Priority, TokenBudgetLayer, budget::ReservationSlot,
    token_budget::TokenBudget,
};
use tower_test::mock;

use crate::support::{CountReady, levels, request_with, tokens_10_per_sec};

type Mock = mock::Mock<Request<&'static str>, Response<&'static str>>;
type Handle = mock::Handle<Request<&'static str>, Response<&'static str>>;

const SEC: Duration = Duration::from_secs(1);

fn governed(budget: &tower_llm_quota::Budget) -> (TokenBudget<CountReady<Mock>>, Handle) {
    let (mock, handle) = mock::pair();
    let service = TokenBudgetLayer::new(budget.clone()).layer(CountReady::new(mock));
    (service, handle)
}

#[tokio::test(start_paused = true)]
async fn admitted_requests_carry_their_reservation() {
    let budget = tokens_10_per_sec();
    let (mut service, mut handle) = governed(&budget);
    let mut call = task::spawn(
        service
            .ready()
            .await
            .unwrap()
            .call(request_with(Cost::new(30, 10))),
    );
    assert_pending!(call.poll());

    let (request, send) = handle.next_request().await.unwrap();
    let reservation = request
        .extensions()
        .get::<ReservationSlot>()
        .and_then(ReservationSlot::take)
        .expect("a reservation in the extensions");
    assert_eq!(reservation.cost(), Cost::new(30, 10));
    assert!(reservation.is_sent());
    assert_eq!(levels(&budget), [60]);

    send.send_response(Response::new("answer"));
    assert_eq!(assert_ready_ok!(call.poll()).into_body(), "answer");
    reservation.refund();
    assert_eq!(levels(&budget), [100]);
}

#[tokio::test(start_paused = true)]
async fn an_unclaimed_reservation_is_charged_its_estimate() {
    let budget = tokens_10_per_sec();
    let (mut service, mut handle) = governed(&budget);
    let call = service
        .ready()
        .await
        .unwrap()
        .call(request_with(Cost::new(30, 10)));
    let respond = async move {
        let (request, send) = handle.next_request().await.unwrap();
        send.send_response(Response::new("answer"));
        // The request (and the slot in its extensions) outlives the call.
        request
    };
    let (response, request) = tokio::join!(call, respond);
    response.unwrap();
    assert!(
        request
            .extensions()
            .get::<ReservationSlot>()
            .unwrap()
            .take()
            .is_none()
    );
    assert_eq!(levels(&budget), [60]);
}

#[tokio::test(start_paused = true)]
async fn waiting_for_budget_holds_no_inner_readiness() {
    let budget = tokens_10_per_sec();
    let (mut service, mut handle) = governed(&budget);
    budget
        .try_reserve(Cost::new(95, 0))
        .unwrap()
        .charge_estimate();

    let mut call = task::spawn(
        service
            .ready()
            .await
            .unwrap()
            .call(request_with(Cost::new(25, 0))),
    );
    assert_pending!(call.poll());
    // The service asked once, when it was polled ready; the waiting request asks nothing.
    assert_eq!(
        service.get_ref().polls(),
        1,
        "inner readiness untouched while waiting"
    );
    assert_eq!(budget.waiters(), 1);

    time::advance(2 * SEC).await;
    assert!(call.is_woken());
    assert_pending!(call.poll());
    assert_eq!(
        service.get_ref().polls(),
        2,
        "readiness taken right before the call"
    );
    let (request, send) = handle.next_request().await.unwrap();
    assert_eq!(*request.body(), "prompt");
    send.send_response(Response::new("ok"));
    assert_ready_ok!(call.poll());
}

#[tokio::test(start_paused = true)]
async fn readiness_stays_ready_while_requests_wait_in_the_budgets_ordering() {
    let budget = tokens_10_per_sec();
    let (service, mut handle) = governed(&budget);
    handle.allow(u64::MAX);
    let mut service = mock::Spawn::new(service);
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();

    assert_ready_ok!(service.poll_ready());
    let mut first = task::spawn(service.call(request_with(Cost::new(10, 0))));
    assert_pending!(first.poll());
    // Requests wait in the budget's ordering, not in readiness: a second one is taken at once
    // and waits behind the first.
    assert_ready_ok!(service.poll_ready());
    let mut second = task::spawn(service.call(request_with(Cost::new(10, 0))));
    assert_pending!(second.poll());
    assert_eq!(budget.waiters(), 2);

    time::advance(SEC).await;
    assert!(first.is_woken());
    assert_pending!(first.poll(), "admitted, waiting for the mock's answer");
    assert_eq!(budget.waiters(), 1);
    assert!(second.is_woken(), "the new head is told to look");
    assert_pending!(second.poll());
    let _ = &mut handle;
}

#[tokio::test(start_paused = true)]
async fn a_missing_cost_is_rejected_or_charged_as_configured() {
    let budget = tokens_10_per_sec();
    let (mut service, _handle) = governed(&budget);
    let error = service
        .ready()
        .await
        .unwrap()
        .call(Request::new("no cost"))
        .await
        .unwrap_err();
    assert!(error.is_missing_cost() && error.is_local());
    // Only the service's own readiness (for requests admitted at once) was asked.
    assert_eq!(service.get_ref().polls(), 1);

    let (mock, mut handle) = mock::pair::<Request<&'static str>, Response<&'static str>>();
    let mut charging = TokenBudgetLayer::new(budget.clone())
        .missing_cost(MissingCost::Charge(Cost::new(7, 0)))
        .layer(mock);
    let call = charging
        .ready()
        .await
        .unwrap()
        .call(Request::new("no cost"));
    let respond = async {
        let (request, send) = handle.next_request().await.unwrap();
        let reservation = request
            .extensions()
            .get::<ReservationSlot>()
            .unwrap()
            .take();
        assert_eq!(reservation.map(|r| r.cost()), Some(Cost::new(7, 0)));
        send.send_response(Response::new("ok"));
    };
    let (response, ()) = tokio::join!(call, respond);
    response.unwrap();
    assert_eq!(levels(&budget), [93]);
}

#[tokio::test(start_paused = true)]
async fn a_cost_that_can_never_fit_fails_before_anything_is_sent() {
    let budget = tokens_10_per_sec();
    let (mut service, _handle) = governed(&budget);
    let error = service
        .ready()
        .await
        .unwrap()
        .call(request_with(Cost::new(100, 1)))
        .await
        .unwrap_err();
    assert!(error.is_too_large() && error.is_local());
    assert_eq!(error.insufficient_capacity().unwrap().cost(), 101);
    // Only the service's own readiness (for requests admitted at once) was asked.
    assert_eq!(service.get_ref().polls(), 1);
    assert_eq!(levels(&budget), [100]);
}

#[tokio::test(start_paused = true)]
async fn cancelling_at_every_await_point_leaks_nothing() {
    let budget = tokens_10_per_sec();
    let (mut service, mut handle) = governed(&budget);
    budget
        .try_reserve(Cost::new(80, 0))
        .unwrap()
        .charge_estimate();

    // 1. While waiting for the budget: leaves the queue, nothing reserved.
    let mut waiting = task::spawn(service.call(request_with(Cost::new(50, 0))));
    assert_pending!(waiting.poll());
    assert_eq!(budget.waiters(), 1);
    drop(waiting);
    assert_eq!((budget.waiters(), levels(&budget)), (0, vec![20]));

    // 2. Admitted, waiting for the inner service's readiness: refunded in full.
    handle.allow(0);
    let mut readying = task::spawn(service.call(request_with(Cost::new(15, 0))));
    assert_pending!(readying.poll());
    assert_eq!(levels(&budget), [5]);
    drop(readying);
    assert_eq!(levels(&budget), [20]);

    // 3. Sent, waiting for the response: charged its estimate.
    handle.allow(1);
    let mut calling = task::spawn(service.call(request_with(Cost::new(15, 0))));
    assert_pending!(calling.poll());
    let (request, _send) = handle.next_request().await.unwrap();
    drop(calling);
    assert_eq!(levels(&budget), [5]);
    assert!(
        request
            .extensions()
            .get::<ReservationSlot>()
            .unwrap()
            .take()
            .is_none()
    );
    assert_eq!(budget.waiters(), 0);
}

#[tokio::test(start_paused = true)]
async fn inner_failures_are_told_apart_from_local_decisions() {
    let budget = tokens_10_per_sec();
    let (mut service, mut handle) = governed(&budget);

    // The inner call fails after sending: charged, reported as an inner error.
    let call = service
        .ready()
        .await
        .unwrap()
        .call(request_with(Cost::new(10, 0)));
    let fail = async {
        let (_request, send) = handle.next_request().await.unwrap();
        send.send_error(std::io::Error::other("connection reset"));
    };
    let (result, ()) = tokio::join!(call, fail);
    let error = result.unwrap_err();
    assert!(error.is_inner() && !error.is_local());
    assert_eq!(levels(&budget), [90]);

    // The inner service fails its readiness: nothing was sent, refunded.
    handle.send_error(std::io::Error::other("pool closed"));
    let mut call = task::spawn(service.call(request_with(Cost::new(10, 0))));
    let error = assert_ready!(call.poll()).unwrap_err();
    assert!(error.is_inner());
    assert_eq!(levels(&budget), [90]);
}

#[test]
fn futures_and_services_are_send() {
    fn send<T: Send>(_: &T) {}
    let budget = tokens_10_per_sec();
    let (mock, _handle) = mock::pair::<Request<&'static str>, Response<&'static str>>();
    let mut service = TokenBudgetLayer::new(budget).layer(mock);
    send(&service);
    send(&service.call(request_with(Cost::new(1, 0))));
}

#[tokio::test(start_paused = true)]
async fn a_deadline_bounds_the_wait_for_budget_and_for_inner_readiness() {
    let budget = tokens_10_per_sec();
    let (mut service, mut handle) = governed(&budget);
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    let start = time::Instant::now();

    // Its own deadline cannot be met: 50 tokens at 10 a second are 5 s away. Refused at
    // once, with the predicted wait, never queued.
    let mut request = request_with(Cost::new(50, 0));
    request
        .extensions_mut()
        .insert(tower_llm_quota::Deadline::at(start + SEC));
    let error = service.call(request).await.unwrap_err();
    assert!(error.is_deadline_exceeded() && error.is_local());
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(
        (error.waited(), error.predicted_wait()),
        (Some(Duration::ZERO), Some(5 * SEC))
    );
    assert_eq!((budget.waiters(), levels(&budget)), (0, vec![0]));

    // Predicted in time (30 tokens, 3 s away, before its 4 s), then overtaken by an
    // interactive request of 20 tokens that arrives meanwhile: it gives up at its deadline,
    // exactly, and leaves the budget's queue.
    let mut request = request_with(Cost::new(30, 0));
    request
        .extensions_mut()
        .insert(tower_llm_quota::Deadline::at(start + 4 * SEC));
    request.extensions_mut().insert(Priority::Batch);
    let late = tokio::spawn(service.call(request));
    tokio::task::yield_now().await;
    let mut urgent = request_with(Cost::new(20, 0));
    urgent.extensions_mut().insert(Priority::Interactive);
    let urgent = tokio::spawn(service.call(urgent));
    tokio::task::yield_now().await;
    handle.allow(1);
    let (request, send) = handle.next_request().await.unwrap();
    send.send_response(Response::new("urgent"));
    assert_eq!(start.elapsed(), 2 * SEC);
    drop(request);
    urgent.await.unwrap().unwrap();
    let error = late.await.unwrap().unwrap_err();
    assert!(error.is_deadline_exceeded() && error.predicted_wait().is_none());
    assert_eq!(start.elapsed(), 4 * SEC);
    assert_eq!(error.waited(), Some(4 * SEC));
    assert_eq!((budget.waiters(), levels(&budget)), (0, vec![20]));

    // Admitted, but the inner service stays busy: the reservation is refunded at the deadline.
    let start = time::Instant::now();
    handle.allow(0);
    let mut request = request_with(Cost::new(10, 0));
    request
        .extensions_mut()
        .insert(tower_llm_quota::Deadline::at(start + SEC));
    let error = service.call(request).await.unwrap_err();
    assert!(error.is_deadline_exceeded());
    assert_eq!(start.elapsed(), SEC);
    assert_eq!(
        levels(&budget),
        [30],
        "refunded: 10 refilled, nothing spent"
    );
}

/// A request refused for its missing cost gives back the readiness its service took: an
/// inner `ConcurrencyLimit`'s permit is free for the next caller at once.
#[tokio::test(start_paused = true)]
async fn a_request_refused_for_its_missing_cost_gives_back_the_inner_readiness() {
    use tower::limit::ConcurrencyLimitLayer;
    let budget = tokens_10_per_sec();
    let client = tower::service_fn(|_request: Request<&'static str>| async {
        Ok::<_, std::convert::Infallible>(Response::new("ok"))
    });
    let limited = ConcurrencyLimitLayer::new(1).layer(client);
    let layer = TokenBudgetLayer::new(budget).missing_cost(MissingCost::Reject);
    let mut first = layer.layer(limited.clone());
    let mut second = layer.layer(limited);
    // The first takes the only permit in its readiness, then its request has no cost.
    first.ready().await.unwrap();
    let refused = first.call(Request::new("no cost")).await.unwrap_err();
    assert!(refused.is_missing_cost());
    // The permit is free: the other service's request is sent at once (it would wait for
    // the permit, while `first` lives, if the refused request had kept it).
    let request = Request::builder()
        .extension(Cost::new(1, 0))
        .body("priced")
        .unwrap();
    let call = second.ready().await.unwrap().call(request);
    let answered = time::timeout(Duration::from_secs(1), call).await;
    assert!(
        answered.is_ok_and(|r| r.is_ok()),
        "the permit was still held"
    );
    drop(first);
}
