use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use futures::channel::mpsc;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tokio_test::{assert_pending, assert_ready_ok, task};
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::{Cost, InFlightLimitLayer, TokenBudgetLayer};

use crate::support::{request_with, tokens_10_per_sec};

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

#[tokio::test(start_paused = true)]
async fn a_slot_is_held_until_the_body_ends_not_until_the_head_arrives() {
    let limit = InFlightLimitLayer::new(1);
    let (client, mut opened) = streaming_client();
    let mut service = limit.layer(client);

    let first = service
        .ready()
        .await
        .unwrap()
        .call(Request::new("a"))
        .await
        .unwrap();
    assert_eq!(limit.in_flight(), 1);
    assert!(first.body().holds_slot());

    // The head arrived, the stream goes on: a second call must wait for the slot.
    let mut second = task::spawn(service.ready());
    assert!(second.poll().is_pending());
    let stream = opened.try_recv().unwrap();
    stream
        .unbounded_send(Ok(Frame::data(Bytes::from("tok"))))
        .unwrap();
    drop(stream);
    let body = first.into_body().collect().await.unwrap();
    assert_eq!(body.to_bytes(), "tok");
    // The slot went straight to the waiting call.
    assert_eq!(limit.in_flight(), 1);
    assert!(second.is_woken());
    assert!(matches!(second.poll(), std::task::Poll::Ready(Ok(_))));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_body_or_failed_call_releases_its_slot() {
    let limit = InFlightLimitLayer::new(1);
    let (client, _opened) = streaming_client();
    let mut service = limit.layer(client);
    let response = service
        .ready()
        .await
        .unwrap()
        .call(Request::new("a"))
        .await
        .unwrap();
    assert_eq!(limit.in_flight(), 1);
    drop(response);
    assert_eq!(limit.in_flight(), 0);

    let failing = service_fn(|_request: Request<&'static str>| async {
        Err::<Response<String>, _>(std::io::Error::other("refused"))
    });
    let mut service = limit.layer(failing);
    assert!(
        service
            .ready()
            .await
            .unwrap()
            .call(Request::new("b"))
            .await
            .is_err()
    );
    assert_eq!(limit.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn inside_the_budget_the_slot_is_taken_only_after_admission() {
    let budget = tokens_10_per_sec();
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    let limit = InFlightLimitLayer::new(1);
    let (client, _opened) = streaming_client();
    let mut service = ServiceBuilder::new()
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(limit.clone())
        .service(client);

    let mut call = task::spawn(
        service
            .ready()
            .await
            .unwrap()
            .call(request_with(Cost::new(20, 0))),
    );
    assert_pending!(call.poll());
    assert_eq!(limit.in_flight(), 0, "waiting for quota holds no slot");
    tokio::time::advance(Duration::from_secs(2)).await;
    let response = assert_ready_ok!(call.poll());
    assert_eq!(limit.in_flight(), 1);
    drop(response);
    assert_eq!(limit.in_flight(), 0);
}
