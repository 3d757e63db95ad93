//! Grouping: many items per call against the simulated provider and a scripted model; each
//! fault kind of the answers; keys, classes, deadlines, costs and the queue's linger.

use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt, service_fn};
use tower_llm_quota::group::{
    ApiFormat, GroupConfig, GroupItem, Grouper, Resend, ValidateFn, item_markers,
};
use tower_llm_quota::provider::Profile;
use tower_llm_quota::sim::{GroupFaults, SimConfig, Simulator};
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{BoxError, Cost, Deadline, Dimension, Limit, Priority, Quota};

const MINUTE: Duration = Duration::from_secs(2);

/// Long shared instructions (about 1,800 tokens) and short items: where grouping pays.
fn instructions() -> String {
    "Classify the support ticket into billing, bug, account, feature or other. ".repeat(100)
}

fn items(n: usize) -> Vec<GroupItem> {
    (0..n)
        .map(|i| {
            GroupItem::new(
                format!("t-{i}"),
                format!("Ticket {i}: I was charged twice this month, please refund me."),
            )
            .expected_output(60)
        })
        .collect()
}

fn simulator(faults: GroupFaults) -> Simulator {
    Simulator::new(
        SimConfig::openai(500, 200_000)
            .minute(MINUTE)
            .latency(Duration::from_millis(10), Duration::ZERO)
            .group_faults(faults)
            .seed(3),
    )
}

fn stack() -> QuotaStack {
    let limit = |dimension, amount| {
        Limit::new(dimension, NonZeroU64::new(amount).unwrap(), MINUTE).unwrap()
    };
    let quota = Quota::new()
        .with_limit(limit(Dimension::Requests, 500))
        .with_limit(limit(Dimension::TotalTokens, 200_000));
    QuotaStack::for_profile(Profile::openai().windows(MINUTE, MINUTE), quota)
        .concurrency(NonZeroUsize::new(16).unwrap())
}

type Llm =
    BoxCloneService<Request<Full<Bytes>>, Response<UnsyncBoxBody<Bytes, BoxError>>, BoxError>;

/// Any client, boxed: the governed stack over the simulator, or a scripted model.
fn boxed<S, B>(service: S) -> Llm
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    BoxCloneService::new(
        service
            .map_response(|response: Response<B>| {
                response.map(|body| body.map_err(Into::into).boxed_unsync())
            })
            .map_err(Into::into),
    )
}

fn grouper(simulator: &Simulator, max_items: usize) -> Grouper<Llm> {
    let service = boxed(stack().layer(simulator.service()));
    Grouper::new(service, ApiFormat::OpenAiChat, instructions())
        .header(
            http::header::AUTHORIZATION,
            "Bearer sk-test".parse().unwrap(),
        )
        .config(GroupConfig::new().max_items(max_items).unwrap())
}

#[tokio::test(start_paused = true)]
async fn groups_of_ten_make_a_tenth_of_the_calls_and_their_usage_adds_up() {
    let sim = simulator(GroupFaults::none());
    let report = grouper(&sim, 10).run(items(100)).await;
    assert!(report.outcomes.iter().all(|o| o.result.is_ok()));
    assert_eq!(report.stats.calls, 10);
    let stats = sim.stats();
    assert_eq!((stats.admitted, stats.rate_limited), (10, 0));
    assert_eq!(stats.grouped_answers, 10);
    // Per-item usage adds up to what the provider charged.
    let input: u64 = report.outcomes.iter().map(|o| o.usage.input_tokens).sum();
    let output: u64 = report.outcomes.iter().map(|o| o.usage.output_tokens).sum();
    assert_eq!(input, stats.prompt_tokens);
    assert_eq!(output, stats.completion_tokens);
    assert_eq!(
        (report.stats.input_tokens, report.stats.output_tokens),
        (input, output)
    );
    // Every item of a group carries an equal part of the shared instructions: identical
    // items of one group are charged within a token of each other.
    let first: Vec<u64> = report.outcomes[..10]
        .iter()
        .map(|o| o.usage.input_tokens)
        .collect();
    assert!(
        first.iter().max().unwrap() - first.iter().min().unwrap() <= 1,
        "{first:?}"
    );

    // The same items one per call: ten times the calls, and far more tokens.
    let alone = simulator(GroupFaults::none());
    let single = grouper(&alone, 1).run(items(100)).await;
    assert_eq!(single.stats.calls, 100);
    let grouped = stats.prompt_tokens + stats.completion_tokens;
    let ungrouped = alone.stats().prompt_tokens + alone.stats().completion_tokens;
    assert!(
        grouped * 10 < ungrouped * 4,
        "{grouped} against {ungrouped}: not 60 % fewer"
    );
}

#[tokio::test(start_paused = true)]
async fn a_malformed_answer_sends_every_item_again_alone() {
    let sim = simulator(GroupFaults::none().malformed(1.0));
    let report = grouper(&sim, 5).run(items(5)).await;
    // One group, then each item alone twice (three attempts), every answer malformed.
    assert_eq!(report.stats.calls, 1 + 5 * 2);
    assert_eq!(report.stats.malformed_answers, 11);
    for outcome in &report.outcomes {
        let failure = outcome.result.as_ref().unwrap_err();
        assert!(failure.is_rejected());
        assert!(failure.reason().contains("JSON"), "{failure}");
        assert_eq!(outcome.attempts, 3);
        assert!(outcome.resent_alone);
    }
    assert_eq!(report.stats.items_failed, 5);
}

#[tokio::test(start_paused = true)]
async fn missing_items_fail_with_their_reason_after_their_attempts() {
    let sim = simulator(GroupFaults::none().missing(1.0));
    let report = grouper(&sim, 4).run(items(4)).await;
    assert_eq!(report.stats.calls, 1 + 4 * 2);
    for outcome in &report.outcomes {
        let failure = outcome.result.as_ref().unwrap_err();
        assert_eq!(failure.reason(), "the answer left the item out");
        assert_eq!(outcome.attempts, 3);
    }
}

#[tokio::test(start_paused = true)]
async fn a_wrong_id_is_an_unknown_answer_and_its_item_is_sent_again() {
    let sim = simulator(GroupFaults::none().wrong_id(1.0));
    let report = grouper(&sim, 4).run(items(4)).await;
    assert_eq!(report.stats.calls, 9);
    assert_eq!(report.stats.unknown_answers, 4 + 4 * 2);
    assert!(
        report
            .outcomes
            .iter()
            .all(|o| o.result.is_err() && o.resent_alone)
    );
}

#[tokio::test(start_paused = true)]
async fn answers_failing_validation_are_sent_again_and_the_validator_decides() {
    let sim = simulator(GroupFaults::none().invalid(1.0));
    let report = grouper(&sim, 4).run(items(4)).await;
    for outcome in &report.outcomes {
        let failure = outcome.result.as_ref().unwrap_err();
        assert!(
            failure.reason().starts_with("the answer was rejected: "),
            "{failure}"
        );
    }
    // A validator of one's own: reject every answer of item t-1.
    let sim = simulator(GroupFaults::none());
    let report = grouper(&sim, 4)
        .validator(ValidateFn::new(|item: &GroupItem, answer: &Value| {
            if item.id() == "t-1" {
                Err(String::from("not this one"))
            } else {
                Ok(answer["answer"].as_str().unwrap_or_default().len())
            }
        }))
        .run(items(4))
        .await;
    assert_eq!(report.stats.calls, 1 + 2, "t-1 alone twice");
    assert!(report.outcomes[0].result.is_ok() && !report.outcomes[0].resent);
    assert_eq!(
        report.outcomes[1].result.as_ref().unwrap_err().reason(),
        "the answer was rejected: not this one"
    );
}

#[tokio::test(start_paused = true)]
async fn errors_growing_with_the_group_spare_items_sent_alone() {
    // Every item of a group of ten is wrong (1/9 per other item); alone, none.
    let sim = simulator(GroupFaults::none().per_extra_item(1.0 / 9.0));
    let report = grouper(&sim, 10).run(items(10)).await;
    assert_eq!(report.stats.calls, 11);
    assert!(
        report
            .outcomes
            .iter()
            .all(|o| o.result.is_ok() && o.resent_alone && o.attempts == 2)
    );
    assert_eq!(report.stats.items_resent_alone, 10);
}

#[tokio::test(start_paused = true)]
async fn a_group_of_forty_loses_more_items_than_groups_of_ten() {
    let faults = GroupFaults::none().per_extra_item(0.005);
    let resent = |max_items| {
        let sim = simulator(faults);
        async move {
            let report = grouper(&sim, max_items).run(items(200)).await;
            assert!(report.outcomes.iter().all(|o| o.result.is_ok()));
            report.stats.items_resent
        }
    };
    let (ten, forty) = (resent(10).await, resent(40).await);
    assert!(forty > 2 * ten, "resent: {forty} at 40, {ten} at 10");
}

#[tokio::test(start_paused = true)]
async fn smaller_groups_halve_the_group_that_failed() {
    let sim = simulator(GroupFaults::none().per_extra_item(1.0 / 7.0));
    let report = grouper(&sim, 8)
        .config(
            GroupConfig::new()
                .max_items(8)
                .unwrap()
                .resend(Resend::Smaller)
                .max_attempts(NonZeroU32::new(5).unwrap()),
        )
        .run(items(8))
        .await;
    // 8 fail (7 others each), then two groups of 4 (error 3/7 each), then of 2, then alone.
    assert!(report.outcomes.iter().all(|o| o.result.is_ok()));
    assert!(report.stats.calls > 3, "{}", report.stats.calls);
    assert!(report.outcomes.iter().all(|o| o.attempts <= 5));
}

/// A model scripted per call: answers every marked item, or fails as `script` says for that
/// call's number. Records each request's key, class, cost and item ids.
#[derive(Clone, Default)]
struct Scripted {
    calls: Arc<Mutex<Vec<Seen>>>,
}

#[derive(Debug, Clone)]
struct Seen {
    key: String,
    priority: Option<Priority>,
    cost: Option<Cost>,
    ids: Vec<String>,
}

impl Scripted {
    fn service(&self, script: fn(usize) -> Option<StatusCode>) -> Llm {
        let calls = Arc::clone(&self.calls);
        boxed(service_fn(move |request: Request<Full<Bytes>>| {
            let calls = Arc::clone(&calls);
            async move {
                let key = request.headers()["idempotency-key"].to_str()?.to_owned();
                let priority = request.extensions().get::<Priority>().copied();
                let cost = request.extensions().get::<Cost>().copied();
                let body = request.into_body().collect().await?.to_bytes();
                let body: Value = serde_json::from_slice(&body)?;
                let prompt = body["messages"][1]["content"].as_str().unwrap_or_default();
                let ids: Vec<String> = item_markers(prompt).map(|(id, _)| id.to_owned()).collect();
                let n = {
                    let mut calls = calls.lock().unwrap();
                    calls.push(Seen {
                        key,
                        priority,
                        cost,
                        ids: ids.clone(),
                    });
                    calls.len()
                };
                let response = match script(n) {
                    Some(status) => {
                        Response::builder()
                            .status(status)
                            .body(Full::new(Bytes::from(
                                r#"{"error":{"message":"scripted"}}"#,
                            )))?
                    }
                    None => {
                        let answers: Vec<Value> = ids
                            .iter()
                            .map(|id| json!({"id": id, "answer": "ok"}))
                            .collect();
                        let body = json!({
                            "choices": [{"message": {"content": Value::Array(answers).to_string()}}],
                            "usage": {"prompt_tokens": 100, "completion_tokens": 10 * ids.len()},
                        });
                        Response::new(Full::new(Bytes::from(body.to_string())))
                    }
                };
                Ok::<_, BoxError>(response)
            }
        }))
    }

    fn seen(&self) -> Vec<Seen> {
        self.calls.lock().unwrap().clone()
    }
}

#[tokio::test(start_paused = true)]
async fn a_group_sent_again_after_a_transient_failure_keeps_its_key() {
    let model = Scripted::default();
    let service = model.service(|n| (n == 1).then_some(StatusCode::SERVICE_UNAVAILABLE));
    let report = Grouper::new(service, ApiFormat::OpenAiChat, "Shared.")
        .run(items(3))
        .await;
    assert!(
        report
            .outcomes
            .iter()
            .all(|o| o.result.is_ok() && o.attempts == 2)
    );
    let seen = model.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].key, seen[1].key, "the same group, the same key");
    assert_eq!(seen[0].ids, seen[1].ids);
    assert!(seen[0].key.starts_with("group-") && seen[0].key.len() == 38);
}

#[tokio::test(start_paused = true)]
async fn a_permanent_failure_sends_the_items_alone_with_new_keys() {
    let model = Scripted::default();
    let service = model.service(|n| (n == 1).then_some(StatusCode::BAD_REQUEST));
    let report = Grouper::new(service, ApiFormat::OpenAiChat, "Shared.")
        .run(items(3))
        .await;
    assert!(
        report
            .outcomes
            .iter()
            .all(|o| o.result.is_ok() && o.resent_alone)
    );
    let seen = model.seen();
    assert_eq!(seen.len(), 4);
    assert!(
        seen[1..]
            .iter()
            .all(|s| s.ids.len() == 1 && s.key != seen[0].key)
    );
    let keys: std::collections::HashSet<&str> = seen.iter().map(|s| s.key.as_str()).collect();
    assert_eq!(keys.len(), 4);
    // An item alone that fails permanently fails at once, with the reason.
    let model = Scripted::default();
    let service = model.service(|_| Some(StatusCode::BAD_REQUEST));
    let report = Grouper::new(service, ApiFormat::OpenAiChat, "Shared.")
        .run(items(1))
        .await;
    let failure = report.outcomes[0].result.as_ref().unwrap_err();
    assert!(failure.is_call_failed());
    assert_eq!(
        failure.reason(),
        "the call failed: HTTP 400 Bad Request: scripted"
    );
    assert_eq!(model.seen().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn keys_come_from_the_items_keys_whatever_their_order() {
    let model = Scripted::default();
    let service = model.service(|_| None);
    let keyed = |order: [usize; 2]| {
        order
            .map(|i| GroupItem::new(format!("t-{i}"), "x").key(format!("job-{i}")))
            .to_vec()
    };
    Grouper::new(service.clone(), ApiFormat::OpenAiChat, "S")
        .run(keyed([0, 1]))
        .await;
    Grouper::new(service, ApiFormat::OpenAiChat, "S")
        .run(keyed([1, 0]))
        .await;
    let seen = model.seen();
    assert_eq!(seen[0].key, seen[1].key);
}

#[tokio::test(start_paused = true)]
async fn groups_hold_one_class_and_carry_it_with_their_cost() {
    let model = Scripted::default();
    let service = model.service(|_| None);
    let mut batch = items(4);
    batch[1] = GroupItem::new("urgent", "now").priority(Priority::Interactive);
    let report = Grouper::new(service, ApiFormat::OpenAiChat, "Shared.")
        .config(GroupConfig::new().item_output(50).answer_overhead(10))
        .run(batch)
        .await;
    assert!(report.outcomes.iter().all(|o| o.result.is_ok()));
    let seen = model.seen();
    assert_eq!(seen.len(), 2);
    let urgent = seen
        .iter()
        .find(|s| s.ids == ["urgent"])
        .expect("alone in its class");
    assert_eq!(urgent.priority, Some(Priority::Interactive));
    assert_eq!(urgent.cost.unwrap().output_tokens(), 60);
    let rest = seen.iter().find(|s| s.ids.len() == 3).unwrap();
    assert_eq!(rest.priority, Some(Priority::Batch));
    // Items that set their output: 60 each, plus the overhead.
    assert_eq!(rest.cost.unwrap().output_tokens(), 3 * 70);
    assert!(rest.cost.unwrap().input_tokens() > urgent.cost.unwrap().input_tokens());
}

#[tokio::test(start_paused = true)]
async fn a_cost_cap_closes_groups_early_and_a_passed_deadline_is_never_sent() {
    let model = Scripted::default();
    let service = model.service(|_| None);
    let mut batch = items(6);
    batch.push(GroupItem::new("late", "x").deadline(Deadline::after(Duration::ZERO)));
    let grouper = Grouper::new(service, ApiFormat::OpenAiChat, "Shared.");
    // Measure one group of two, then cap groups there.
    let two = {
        let probe = Scripted::default();
        Grouper::new(probe.service(|_| None), ApiFormat::OpenAiChat, "Shared.")
            .run(items(2))
            .await;
        probe.seen()[0].cost.unwrap().total_tokens()
    };
    let report = grouper
        .config(GroupConfig::new().max_cost(NonZeroU64::new(two).unwrap()))
        .run(batch)
        .await;
    let seen = model.seen();
    assert_eq!(
        seen.iter().map(|s| s.ids.len()).collect::<Vec<_>>(),
        [2, 2, 2]
    );
    assert!(seen.iter().all(|s| s.cost.unwrap().total_tokens() <= two));
    let late = report.outcomes.last().unwrap();
    assert!(late.result.as_ref().unwrap_err().is_deadline_passed());
    assert_eq!(late.attempts, 0);
}

#[tokio::test(start_paused = true)]
async fn the_queue_groups_items_submitted_one_by_one_within_the_linger() {
    let model = Scripted::default();
    let service = model.service(|_| None);
    let (queue, worker) = Grouper::new(service, ApiFormat::OpenAiChat, "Shared.")
        .config(
            GroupConfig::new()
                .linger(Duration::from_millis(50))
                .unwrap(),
        )
        .queue();
    let worker = tokio::spawn(worker.run());
    let start = tokio::time::Instant::now();
    let mut answers = Vec::new();
    for item in items(3) {
        answers.push(tokio::spawn(queue.submit(item)));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for answer in answers {
        let outcome = answer.await.unwrap().unwrap();
        assert!(outcome.result.is_ok());
    }
    // One group of three, sent when the first had waited 50 ms.
    assert_eq!(start.elapsed(), Duration::from_millis(50));
    assert_eq!(model.seen().len(), 1);
    assert_eq!(model.seen()[0].ids.len(), 3);
    // Twelve at once: a full group of ten goes without waiting.
    let tens = tokio::time::Instant::now();
    let answers: Vec<_> = items(12).into_iter().map(|i| queue.submit(i)).collect();
    let first = futures::future::join_all(answers.into_iter().take(10)).await;
    assert!(first.iter().all(|o| o.as_ref().unwrap().result.is_ok()));
    assert_eq!(tens.elapsed(), Duration::ZERO);
    drop(queue);
    let stats = worker.await.unwrap();
    assert_eq!(stats.calls, 3);
}

#[tokio::test(start_paused = true)]
async fn groups_in_flight_are_bounded_so_a_large_batch_waits_in_the_grouper() {
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let model = {
        let (open, most) = (Arc::clone(&open), Arc::clone(&most));
        boxed(service_fn(move |request: Request<Full<Bytes>>| {
            let (open, most) = (Arc::clone(&open), Arc::clone(&most));
            async move {
                use std::sync::atomic::Ordering::SeqCst;
                let now = open.fetch_add(1, SeqCst) + 1;
                most.fetch_max(now, SeqCst);
                let body = request.into_body().collect().await?.to_bytes();
                let body: Value = serde_json::from_slice(&body)?;
                let prompt = body["messages"][1]["content"].as_str().unwrap_or_default();
                let answers: Vec<Value> = item_markers(prompt)
                    .map(|(id, _)| json!({"id": id, "answer": "ok"}))
                    .collect();
                tokio::time::sleep(Duration::from_millis(100)).await;
                open.fetch_sub(1, SeqCst);
                let body = json!({"choices": [{"message": {"content": Value::Array(answers).to_string()}}]});
                Ok::<_, BoxError>(Response::new(Full::new(Bytes::from(body.to_string()))))
            }
        }))
    };
    let start = tokio::time::Instant::now();
    let report = Grouper::new(model, ApiFormat::OpenAiChat, "Shared.")
        .config(
            GroupConfig::new()
                .max_items(5)
                .unwrap()
                .max_in_flight(NonZeroUsize::new(2).unwrap()),
        )
        .run(items(40))
        .await;
    assert!(report.outcomes.iter().all(|o| o.result.is_ok()));
    assert_eq!(report.stats.calls, 8);
    assert_eq!(most.load(std::sync::atomic::Ordering::SeqCst), 2);
    // Eight groups, two at a time, 100 ms each.
    assert_eq!(start.elapsed(), Duration::from_millis(400));
}
