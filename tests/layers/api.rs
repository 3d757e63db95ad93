//! The public surface as a new user meets it: spawnable bodies, one error story, the stack's
//! settings, validation at construction.

use tower_llm_quota_test_support::redis_server;

use std::error::Error as _;
use std::num::NonZeroU64;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use tower::{BoxError, Layer, Service, ServiceExt, service_fn};
use tower_llm_quota::budget::{FailurePolicy, StoreUnavailable};
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{Dimension, Error, Limit, Quota};
use tower_llm_quota_redis::RedisBudget;

fn tpm(amount: u64) -> Quota {
    Quota::new().with_limit(Limit::per_minute(
        Dimension::TotalTokens,
        NonZeroU64::new(amount).unwrap(),
    ))
}

fn chat() -> http::Request<Full<Bytes>> {
    http::Request::post("http://provider/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"Hi"}]}"#,
        )))
        .unwrap()
}

const ANSWER: &str =
    r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;

/// A client whose body errors are `BoxError`, as tower-http's decompression produces.
fn boxed_body_client() -> impl Service<
    http::Request<Full<Bytes>>,
    Response = http::Response<BoxBody<Bytes, BoxError>>,
    Error = BoxError,
    Future = impl Send + 'static,
> + Clone
+ Send
+ 'static {
    service_fn(|_request: http::Request<Full<Bytes>>| async {
        let body = Full::new(Bytes::from_static(ANSWER.as_bytes()))
            .map_err(|never| match never {})
            .boxed();
        Ok::<_, BoxError>(http::Response::new(body))
    })
}

#[tokio::test(start_paused = true)]
async fn a_body_over_a_box_error_client_can_be_spawned() {
    let stack = QuotaStack::openai(tpm(30_000));
    let budget = stack.budget().clone();
    let mut llm = stack.layer(boxed_body_client());
    let response = llm.ready().await.unwrap().call(chat()).await.unwrap();
    let collected = tokio::spawn(response.into_body().collect()).await.unwrap();
    assert_eq!(collected.unwrap().to_bytes(), ANSWER);
    assert_eq!(budget.snapshot().limits()[0].level(), 5_000 - 12);
}

#[tokio::test(start_paused = true)]
async fn a_call_and_its_body_can_be_spawned_together() {
    let stack = QuotaStack::openai(tpm(30_000));
    let llm = stack.layer(boxed_body_client());
    let task = tokio::spawn(async move {
        let response = llm.oneshot(chat()).await?;
        let body = response.into_body().collect().await?;
        Ok::<_, BoxError>(body.to_bytes())
    });
    assert_eq!(task.await.unwrap().unwrap(), ANSWER);
}

/// An error of the client nothing here knows how to classify: not retried.
#[derive(Debug)]
struct Refused;

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("refused by the client")
    }
}

impl std::error::Error for Refused {}

#[tokio::test(start_paused = true)]
async fn the_client_error_is_the_source_of_the_stack_error() {
    let stack = QuotaStack::openai(tpm(30_000));
    let client = service_fn(|_request: http::Request<Full<Bytes>>| async {
        Err::<http::Response<Full<Bytes>>, _>(Refused)
    });
    let error: Error = stack.layer(client).oneshot(chat()).await.unwrap_err();
    assert!(!error.is_local());
    let source = error.source().expect("the client's error");
    assert!(source.is::<Refused>(), "{source:?}");
}

#[tokio::test]
async fn a_store_that_does_not_answer_is_the_source_of_the_refusal() {
    let mut redis = redis_server::RedisServer::start();
    let quota = tpm(30_000);
    let budget = RedisBudget::new(redis.url(), "api-store-unavailable")
        .failure_policy(FailurePolicy::FailClosed)
        .timeout(Duration::from_millis(50))
        .connect(&quota)
        .await
        .unwrap();
    redis.kill();
    let stack = QuotaStack::openai(quota).with_budget(budget);
    let error = stack
        .layer(boxed_body_client())
        .oneshot(chat())
        .await
        .unwrap_err();
    assert!(
        error.is_store_unavailable() && error.is_local(),
        "{error:?}"
    );
    let source = error.source().expect("the store's refusal");
    assert!(source.is::<StoreUnavailable>(), "{source:?}");
    assert!(error.to_string().contains("unavailable"), "{error}");
}

#[test]
fn out_of_range_settings_are_refused_when_built() {
    use tower_llm_quota::{RetryPolicy, estimate::LearnedOutput};
    let refused = RetryPolicy::new().retry_budget(1.5, 1).unwrap_err();
    assert_eq!(
        refused.to_string(),
        "the retry budget's percent must be in [0, 1]"
    );
    assert!(RetryPolicy::new().retry_budget(f32::NAN, 1).is_err());
    assert!(RetryPolicy::new().retry_budget(0.2, 1).is_ok());
    let refused = LearnedOutput::new().with_quantile(-0.1).unwrap_err();
    assert_eq!(refused.to_string(), "the quantile must be in [0, 1]");
    assert!(LearnedOutput::new().with_quantile(f64::NAN).is_err());
    let limit = Limit::per_minute(Dimension::Requests, NonZeroU64::new(10).unwrap());
    assert!(limit.with_headroom(0.0).is_err() && limit.with_burst_fraction(1.5).is_err());
    assert!(Limit::new(Dimension::Requests, NonZeroU64::MIN, Duration::ZERO).is_err());
}

#[tokio::test(start_paused = true)]
async fn the_core_layers_by_hand_have_a_short_type() {
    use tower::ServiceBuilder;
    use tower_llm_quota::stack::Governed;
    use tower_llm_quota::{Cost, ServiceBuilderExt, Usage};

    let budget = tower_llm_quota::Budget::new(tpm(30_000));
    let client = service_fn(|_request: http::Request<Full<Bytes>>| async {
        let mut response = http::Response::new(Full::new(Bytes::from_static(b"ok")));
        response.extensions_mut().insert(Usage::new(10, 5));
        Ok::<_, std::convert::Infallible>(response)
    });
    let governed: Governed<_> = ServiceBuilder::new()
        .token_budget(budget.clone())
        .reconcile()
        .service(client);
    let mut request = chat();
    request.extensions_mut().insert(Cost::new(10, 90));
    let response = governed.oneshot(request).await.unwrap();
    response.into_body().collect().await.unwrap();
    assert_eq!(budget.snapshot().limits()[0].level(), 5_000 - 15);
}

/// A queue's snapshot counts everyone waiting by default: the requests waiting in the budget
/// below it, found through the requests themselves; the queue's own ordering is the narrower
/// view.
#[tokio::test(start_paused = true)]
async fn a_queue_snapshot_counts_the_budget_s_waiters_by_default() {
    use tower_llm_quota::{Budget, Cost, Priority, PriorityQueueLayer, TokenBudgetLayer};
    let budget = Budget::new(
        Quota::new().with_limit(
            Limit::per_second(Dimension::TotalTokens, NonZeroU64::new(100).unwrap())
                .with_burst(NonZeroU64::new(100).unwrap()),
        ),
    );
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    let queue = PriorityQueueLayer::default();
    let client = service_fn(|_request: http::Request<Full<Bytes>>| async {
        Ok::<_, BoxError>(http::Response::new(Full::new(Bytes::new())))
    });
    let llm = tower::ServiceBuilder::new()
        .layer(queue.clone())
        .layer(TokenBudgetLayer::new(budget.clone()))
        .service(client);
    let waiting: Vec<_> = (0..5)
        .map(|_| {
            let request = http::Request::post("/v1/chat/completions")
                .extension(Cost::new(50, 0))
                .extension(Priority::Batch)
                .body(Full::new(Bytes::new()))
                .unwrap();
            tokio::spawn(llm.clone().oneshot(request))
        })
        .collect();
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    let handle = queue.handle();
    assert_eq!(handle.snapshot().class(Priority::Batch).depth(), 5);
    assert_eq!(handle.own_snapshot().depth(), 0);
    assert_eq!(
        handle.clone().including(&budget).snapshot().depth(),
        5,
        "not twice"
    );
    for task in waiting {
        task.abort();
    }
}
