use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use futures::channel::mpsc;
use http::response::Parts;
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full, StreamBody};
use tokio_test::{assert_pending, assert_ready, task};
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::{
    Budget, Cost, Dimension, ReconcileLayer, TokenBudgetLayer, Usage,
    reconcile::{BodyEnd, ExtractUsage, Reconcile, ScanUsage},
};

use crate::support::{budget, levels, limit, request_with, tokens_10_per_sec};

type Chunk = Result<Frame<Bytes>, std::io::Error>;
type StreamingBody = StreamBody<mpsc::UnboundedReceiver<Chunk>>;

/// A client whose response body the test feeds chunk by chunk, with `usage` (if any) in the
/// response's extensions.
fn streaming_client(
    usage: Option<Usage>,
) -> (
    impl Service<Request<&'static str>, Response = Response<StreamingBody>, Error = Infallible> + Clone,
    mpsc::UnboundedSender<Chunk>,
) {
    let (tx, rx) = mpsc::unbounded();
    let rx = std::sync::Arc::new(std::sync::Mutex::new(Some(rx)));
    let client = service_fn(move |_request: Request<&'static str>| {
        let rx = rx.lock().unwrap().take().expect("one request per client");
        async move {
            let mut response = Response::new(StreamBody::new(rx));
            if let Some(usage) = usage {
                response.extensions_mut().insert(usage);
            }
            Ok::<_, Infallible>(response)
        }
    });
    (client, tx)
}

fn data(text: &'static str) -> Chunk {
    Ok(Frame::data(Bytes::from_static(text.as_bytes())))
}

/// Sends a request of `cost` through a budget and a reconcile layer to `client`.
async fn through_budget<C, B>(
    budget: &Budget,
    client: C,
    cost: Cost,
) -> Response<tower_llm_quota::reconcile::ReconcileBody<B, tower_llm_quota::reconcile::NoScan>>
where
    C: Service<Request<&'static str>, Response = Response<B>, Error = Infallible> + Clone,
{
    ServiceBuilder::new()
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::new())
        .service(client)
        .oneshot(request_with(cost))
        .await
        .unwrap()
}

/// Reads `usage=<input>,<output>` at the end of a body; records how the body ended.
#[derive(Clone, Default)]
struct TrailerUsage {
    ends: std::sync::Arc<std::sync::Mutex<Vec<BodyEnd>>>,
}

struct TrailerScan {
    text: Vec<u8>,
    ends: std::sync::Arc<std::sync::Mutex<Vec<BodyEnd>>>,
}

impl ExtractUsage for TrailerUsage {
    type Scanner = TrailerScan;

    fn start(&self, _head: &Parts, _budget: &Budget) -> TrailerScan {
        TrailerScan {
            text: Vec::new(),
            ends: self.ends.clone(),
        }
    }
}

impl ScanUsage for TrailerScan {
    fn data(&mut self, chunk: &[u8]) {
        self.text.extend_from_slice(chunk);
    }

    fn finish(self, end: BodyEnd, _reserved: Cost) -> Option<Usage> {
        self.ends.lock().unwrap().push(end);
        let text = String::from_utf8(self.text).ok()?;
        let (input, output) = text.rsplit_once("usage=")?.1.split_once(',')?;
        Some(Usage::new(input.parse().ok()?, output.parse().ok()?))
    }
}

#[tokio::test(start_paused = true)]
async fn settles_when_the_body_ends_not_when_the_headers_arrive() {
    let budget = tokens_10_per_sec();
    let (client, tx) = streaming_client(Some(Usage::new(20, 5)));
    let response = through_budget(&budget, client, Cost::new(20, 40)).await;
    assert_eq!(levels(&budget), [40], "headers arrived: still reserved");

    let mut body = response.into_body();
    tx.unbounded_send(data("first ")).unwrap();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "first ");
    assert!(body.is_pending());
    assert_eq!(levels(&budget), [40]);

    drop(tx);
    assert!(body.frame().await.is_none());
    assert!(!body.is_pending());
    assert_eq!(levels(&budget), [75], "settled at 25 tokens, 35 refunded");
}

#[tokio::test(start_paused = true)]
async fn a_body_scanner_reads_the_usage_and_sees_every_byte_unchanged() {
    let budget = tokens_10_per_sec();
    let (client, tx) = streaming_client(Some(Usage::new(999, 999)));
    let extract = TrailerUsage::default();
    let mut service = ServiceBuilder::new()
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::with_extractor(extract.clone()))
        .service(client);
    let call = service
        .ready()
        .await
        .unwrap()
        .call(request_with(Cost::new(10, 50)));
    for chunk in ["hello ", "world ", "usage=12,", "8"] {
        tx.unbounded_send(data(chunk)).unwrap();
    }
    drop(tx);
    let body = call.await.unwrap().into_body().collect().await.unwrap();
    assert_eq!(body.to_bytes(), "hello world usage=12,8");
    // The body's figure wins over the extension's.
    assert_eq!(levels(&budget), [80]);
    assert_eq!(*extract.ends.lock().unwrap(), [BodyEnd::Complete]);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_or_failed_body_settles_with_what_is_known() {
    let budget = tokens_10_per_sec();
    let extract = TrailerUsage::default();
    let stack = |client| {
        ServiceBuilder::new()
            .layer(TokenBudgetLayer::new(budget.clone()))
            .layer(ReconcileLayer::with_extractor(extract.clone()))
            .service(client)
    };

    // Dropped mid-stream, no usage seen, but the client knew it: the extension's usage.
    let (client, tx) = streaming_client(Some(Usage::new(10, 3)));
    let mut service = stack(client);
    let response = service
        .ready()
        .await
        .unwrap()
        .call(request_with(Cost::new(10, 30)))
        .await;
    tx.unbounded_send(data("partial")).unwrap();
    let mut body = response.unwrap().into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    assert_eq!(levels(&budget), [87]);

    // Failed mid-stream with no usage anywhere: the estimate is charged, never refunded blindly.
    let (client, tx) = streaming_client(None);
    let mut service = stack(client);
    let response = service
        .ready()
        .await
        .unwrap()
        .call(request_with(Cost::new(10, 30)))
        .await;
    tx.unbounded_send(Err(std::io::Error::other("reset")))
        .unwrap();
    let mut body = response.unwrap().into_body();
    assert!(body.frame().await.unwrap().is_err());
    assert!(!body.is_pending());
    assert_eq!(levels(&budget), [47]);
    assert_eq!(
        *extract.ends.lock().unwrap(),
        [BodyEnd::Dropped, BodyEnd::Error]
    );
}

#[tokio::test(start_paused = true)]
async fn a_body_that_says_it_ended_is_settled_without_another_poll() {
    let budget = tokens_10_per_sec();
    let client = service_fn(|_request: Request<&'static str>| async {
        let mut response = Response::new(Full::new(Bytes::from_static(b"whole answer")));
        response.extensions_mut().insert(Usage::new(5, 5));
        Ok::<_, Infallible>(response)
    });
    let response = through_budget(&budget, client, Cost::new(5, 45)).await;
    let mut body = task::spawn(response.into_body());
    let frame = assert_ready!(body.enter(|cx, body| body.poll_frame(cx)));
    assert_eq!(frame.unwrap().unwrap().into_data().unwrap(), "whole answer");
    assert!(
        !body.is_pending(),
        "settled as soon as the last frame passed"
    );
    assert_eq!(levels(&budget), [90]);
}

#[tokio::test(start_paused = true)]
async fn requests_without_a_reservation_pass_through() {
    let (client, tx) = streaming_client(Some(Usage::new(1, 1)));
    let mut service = ReconcileLayer::new().layer(client);
    let response = service
        .ready()
        .await
        .unwrap()
        .call(Request::new("plain"))
        .await
        .unwrap();
    drop(tx);
    let mut body = response.into_body();
    assert!(!body.is_pending());
    assert!(body.frame().await.is_none());
}

#[tokio::test(start_paused = true)]
async fn the_reservation_is_held_until_the_stream_ends_even_across_refill() {
    // A long stream: the reservation stays out for its whole life, and the settlement
    // accounts the real usage when it finally ends.
    let budget = budget([limit(
        Dimension::OutputTokens,
        10,
        Duration::from_secs(1),
        100,
    )]);
    let (client, tx) = streaming_client(Some(Usage::new(0, 100)));
    let mut service: tower_llm_quota::token_budget::TokenBudget<Reconcile<_, _>> =
        ServiceBuilder::new()
            .layer(TokenBudgetLayer::new(budget.clone()))
            .layer(ReconcileLayer::new())
            .service(client);
    let response = service
        .ready()
        .await
        .unwrap()
        .call(request_with(Cost::new(0, 60)))
        .await;
    let mut body = task::spawn(response.unwrap().into_body());
    assert_pending!(body.enter(|cx, body| body.poll_frame(cx)));
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(levels(&budget), [60]);
    drop(tx);
    assert!(assert_ready!(body.enter(|cx, body| body.poll_frame(cx))).is_none());
    // 100 used against 60 reserved: 40 of overrun.
    assert_eq!(levels(&budget), [20]);
}

#[tokio::test(start_paused = true)]
async fn an_error_response_without_usage_refunds_its_tokens_but_not_its_request() {
    let budget = crate::support::requests_and_tokens();
    let client = service_fn(|_request: Request<&'static str>| async {
        let mut response = Response::new(Full::new(Bytes::from_static(b"{\"error\":{}}")));
        *response.status_mut() = http::StatusCode::TOO_MANY_REQUESTS;
        Ok::<_, Infallible>(response)
    });
    let response = through_budget(&budget, client, Cost::new(40, 20)).await;
    assert_eq!(levels(&budget), [9, 40]);
    drop(response);
    assert_eq!(levels(&budget), [9, 100]);
}

#[tokio::test(start_paused = true)]
async fn the_caller_reads_the_usage_settled_without_scanning_again() {
    use tower_llm_quota::reconcile::UsageReport;
    let budget = tokens_10_per_sec();
    let stack = |client| {
        ServiceBuilder::new()
            .layer(TokenBudgetLayer::new(budget.clone()))
            .layer(ReconcileLayer::with_extractor(TrailerUsage::default()))
            .service(client)
    };
    let call = |report: &UsageReport| {
        let mut request = request_with(Cost::new(10, 30));
        request.extensions_mut().insert(report.clone());
        request
    };

    // Read to its end: the usage its scanner found.
    let report = UsageReport::new();
    let (client, tx) = streaming_client(None);
    let response = stack(client).oneshot(call(&report)).await.unwrap();
    assert_eq!(report.settled(), None, "the body has not ended");
    tx.unbounded_send(data("answer usage=10,4")).unwrap();
    drop(tx);
    response.into_body().collect().await.unwrap();
    assert_eq!(report.settled(), Some(Some(Usage::new(10, 4))));

    // Dropped before any usage: settled at its estimate, reported as no usage read.
    let report = UsageReport::new();
    let (client, tx) = streaming_client(None);
    let response = stack(client).oneshot(call(&report)).await.unwrap();
    tx.unbounded_send(data("partial")).unwrap();
    drop(response);
    assert_eq!(report.settled(), Some(None));
}
