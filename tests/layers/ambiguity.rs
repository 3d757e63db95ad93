//! Ambiguous failures: a scripted client failing at connect, before the response head and
//! mid-body is retried, retried on the same provider with the key only, and not retried.

use std::io;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use tower::{Layer, ServiceExt, service_fn};
use tower_llm_quota::idempotency::{IdempotencyError, IdempotencyLayer};
use tower_llm_quota::retry::{Ambiguity, FailureClass, Interrupted, Permanent};
use tower_llm_quota::{BoxError, Priority, RetryAfterLayer, RetryPolicy};

/// How one call fails, or succeeds.
#[derive(Debug, Clone, Copy)]
enum Step {
    Refused,
    ResetBeforeHead,
    CutMidBody,
    Ok,
}

type Body = BoxBody<Bytes, io::Error>;

/// The idempotency key of each call, in order.
type Calls = Arc<Mutex<Vec<Option<String>>>>;

/// A client playing `steps` in order (the last one repeats), recording the idempotency key
/// each call carried.
fn client(
    steps: Vec<Step>,
) -> (
    impl tower::Service<
        Request<Full<Bytes>>,
        Response = Response<Body>,
        Error = io::Error,
        Future = impl Send,
    > + Clone
    + Send
    + 'static,
    Calls,
) {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&calls);
    let service = service_fn(move |request: Request<Full<Bytes>>| {
        let key = request
            .headers()
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let step = {
            let mut calls = log.lock().unwrap();
            calls.push(key);
            steps[(calls.len() - 1).min(steps.len() - 1)]
        };
        async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            match step {
                Step::Refused => Err(io::Error::new(io::ErrorKind::ConnectionRefused, "refused")),
                Step::ResetBeforeHead => {
                    Err(io::Error::new(io::ErrorKind::ConnectionReset, "reset"))
                }
                Step::CutMidBody => {
                    let frames = vec![
                        Ok(Frame::data(Bytes::from_static(b"data: {\"choices\":"))),
                        Err(io::Error::new(
                            io::ErrorKind::ConnectionReset,
                            "reset mid-body",
                        )),
                    ];
                    Ok(Response::new(BodyExt::boxed(StreamBody::new(
                        futures::stream::iter(frames),
                    ))))
                }
                Step::Ok => Ok(Response::new(BodyExt::boxed(
                    Full::new(Bytes::from_static(b"{\"ok\":true}")).map_err(|never| match never {}),
                ))),
            }
        }
    });
    (service, calls)
}

fn retry() -> RetryAfterLayer {
    RetryAfterLayer::new(
        RetryPolicy::new()
            .max_attempts(Priority::Async, NonZeroU32::new(4).unwrap())
            .backoff(Duration::from_millis(10), Duration::from_millis(20))
            .unwrap(),
    )
}

fn chat() -> Request<Full<Bytes>> {
    Request::post("/v1/chat/completions")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"m","max_tokens":5,"messages":[]}"#,
        )))
        .unwrap()
}

async fn body_of(
    response: Response<impl http_body::Body<Data = Bytes, Error = BoxError>>,
) -> Result<Bytes, BoxError> {
    Ok(response.into_body().collect().await?.to_bytes())
}

#[tokio::test(start_paused = true)]
async fn a_connect_failure_is_retried_even_without_a_key() {
    let (client, calls) = client(vec![Step::Refused, Step::Refused, Step::Ok]);
    let response = retry().layer(client).oneshot(chat()).await.unwrap();
    assert_eq!(body_of(response).await.unwrap(), "{\"ok\":true}");
    assert_eq!(calls.lock().unwrap().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_reset_before_the_head_is_retried_only_with_the_key() {
    // Without a key: one call, and the error says why it was not retried.
    let (plain, calls) = client(vec![Step::ResetBeforeHead, Step::Ok]);
    let error = retry().layer(plain).oneshot(chat()).await.unwrap_err();
    assert_eq!(calls.lock().unwrap().len(), 1);
    assert_eq!(Ambiguity::of_error(&error), Ambiguity::Uncertain);
    let classified = tower_llm_quota::retry::ProviderErrors;
    let class = tower_llm_quota::retry::Classify::classify(
        &classified,
        &tower_llm_quota::retry::Failure::Error(&error),
    );
    assert_eq!(
        class,
        FailureClass::Transient(tower_llm_quota::retry::Transient::Connection)
    );

    // With the idempotency layer outside: retried, on the same client, with the same key.
    let (keyed, calls) = client(vec![Step::ResetBeforeHead, Step::Ok]);
    let service = IdempotencyLayer::in_memory().layer(retry().layer(keyed));
    let response = service.oneshot(chat()).await.unwrap();
    assert_eq!(body_of(response).await.unwrap(), "{\"ok\":true}");
    let calls = calls.lock().unwrap();
    assert_eq!(calls.len(), 2);
    assert!(calls[0].is_some() && calls[0] == calls[1], "{calls:?}");
}

#[tokio::test(start_paused = true)]
async fn the_gave_up_report_names_the_ambiguity() {
    // A refused connect is retried; the reset that follows, without a key, stops the
    // retries, and the report says it was ambiguous.
    let (plain, calls) = client(vec![Step::Refused, Step::ResetBeforeHead, Step::Ok]);
    let error = retry().layer(plain).oneshot(chat()).await.unwrap_err();
    assert_eq!(calls.lock().unwrap().len(), 2);
    let report = error.retry_report().unwrap();
    assert_eq!(
        report.last_class(),
        Some(FailureClass::Permanent(Permanent::Ambiguous))
    );
}

#[tokio::test(start_paused = true)]
async fn a_failure_after_the_first_byte_is_never_retried() {
    let (cut, calls) = client(vec![Step::CutMidBody, Step::Ok]);
    let response = retry().layer(cut).oneshot(chat()).await.unwrap();
    let error = body_of(response).await.unwrap_err();
    assert!(error.downcast_ref::<Interrupted>().is_some(), "{error}");
    assert!(error.to_string().contains("interrupted"), "{error}");
    assert_eq!(Ambiguity::of_error(&*error), Ambiguity::Processed);
    assert_eq!(calls.lock().unwrap().len(), 1);

    // Through the idempotency layer as well: one call, the error says interrupted, and the
    // operation may be tried again explicitly.
    let (cut, calls) = client(vec![Step::CutMidBody, Step::Ok]);
    let service = IdempotencyLayer::in_memory().layer(retry().layer(cut));
    let response = service.clone().oneshot(chat()).await.unwrap();
    let error = body_of(response).await.unwrap_err();
    let error = error.downcast_ref::<IdempotencyError>().unwrap();
    assert!(error.is_interrupted(), "{error}");
    assert_eq!(calls.lock().unwrap().len(), 1);
    let again = service.oneshot(chat()).await.unwrap();
    assert_eq!(body_of(again).await.unwrap(), "{\"ok\":true}");
    assert_eq!(calls.lock().unwrap().len(), 2);
}
