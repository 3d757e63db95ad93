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
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{BoxError, Cost, Deadline, Dimension, Limit, Priority, Quota};
use tower_llm_quota_sim::{GroupFaults, SimConfig, Simulator};

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
async fn a_malformed_answer_sends_its_items_again_regrouped_then_alone() {
    let sim = simulator(GroupFaults::none().malformed(1.0));
    let report = grouper(&sim, 5).run(items(5)).await;
    // One group, the same items regrouped, then each alone three times (its three
    // attempts: only calls alone count), every answer malformed.
    assert_eq!(report.stats.calls, 1 + 1 + 5 * 3);
    assert_eq!(report.stats.malformed_answers, 17);
    for outcome in &report.outcomes {
        let failure = outcome.result.as_ref().unwrap_err();
        assert!(failure.is_rejected());
        assert!(failure.reason().contains("JSON"), "{failure}");
        assert_eq!(outcome.attempts, 5);
        assert!(outcome.resent_alone);
    }
    assert_eq!(report.stats.items_failed, 5);
}

#[tokio::test(start_paused = true)]
async fn missing_items_fail_with_their_reason_after_their_attempts() {
    let sim = simulator(GroupFaults::none().missing(1.0));
    let report = grouper(&sim, 4).run(items(4)).await;
    assert_eq!(report.stats.calls, 1 + 1 + 4 * 3);
    for outcome in &report.outcomes {
        let failure = outcome.result.as_ref().unwrap_err();
        assert_eq!(failure.reason(), "the answer left the item out");
        assert_eq!(outcome.attempts, 5);
    }
}

#[tokio::test(start_paused = true)]
async fn a_wrong_id_is_an_unknown_answer_and_its_item_is_sent_again() {
    let sim = simulator(GroupFaults::none().wrong_id(1.0));
    let report = grouper(&sim, 4).run(items(4)).await;
    assert_eq!(report.stats.calls, 14);
    assert_eq!(report.stats.unknown_answers, 4 + 4 + 4 * 3);
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
    assert_eq!(report.stats.calls, 1 + 3, "t-1 alone three times");
    assert!(report.outcomes[0].result.is_ok() && !report.outcomes[0].resent);
    assert_eq!(
        report.outcomes[1].result.as_ref().unwrap_err().reason(),
        "the answer was rejected: not this one"
    );
}

#[tokio::test(start_paused = true)]
async fn errors_growing_with_the_group_spare_items_sent_alone() {
    // Every item of a group of ten is wrong (1/9 per other item); alone, none. Regrouped,
    // they fail again together, then go alone.
    let sim = simulator(GroupFaults::none().per_extra_item(1.0 / 9.0));
    let report = grouper(&sim, 10).run(items(10)).await;
    assert_eq!(report.stats.calls, 1 + 1 + 10);
    assert!(
        report
            .outcomes
            .iter()
            .all(|o| o.result.is_ok() && o.resent_alone && o.attempts == 3)
    );
    assert_eq!(report.stats.items_resent_alone, 10);
    // `Resend::Alone` skips the regrouped call.
    let sim = simulator(GroupFaults::none().per_extra_item(1.0 / 9.0));
    let report = grouper(&sim, 10)
        .config(GroupConfig::new().resend(Resend::Alone))
        .run(items(10))
        .await;
    assert_eq!(report.stats.calls, 1 + 10);
    assert!(report.outcomes.iter().all(|o| o.result.is_ok()));
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

/// What a scripted call answers: a status, or one answer per item id.
type Script = dyn Fn(&Call) -> Result<Vec<Value>, StatusCode> + Send + Sync;

/// What a scripted model sees of one call.
struct Call {
    /// The call's number, from 1.
    n: usize,
    ids: Vec<String>,
    /// The system prompt: the shared instructions.
    system: String,
}

impl Call {
    /// `{"id", "answer"}` for each item.
    fn answers(&self, answer: impl Fn(&str) -> Value) -> Vec<Value> {
        self.ids
            .iter()
            .map(|id| json!({"id": id, "answer": answer(id)}))
            .collect()
    }
}

impl Scripted {
    /// Answers "ok" for every item, or fails with the status `script` gives the call's number.
    fn service(&self, script: fn(usize) -> Option<StatusCode>) -> Llm {
        self.answering(move |call| match script(call.n) {
            Some(status) => Err(status),
            None => Ok(call.answers(|_| json!("ok"))),
        })
    }

    fn answering(
        &self,
        script: impl Fn(&Call) -> Result<Vec<Value>, StatusCode> + Send + Sync + 'static,
    ) -> Llm {
        let calls = Arc::clone(&self.calls);
        let script: Arc<Script> = Arc::new(script);
        boxed(service_fn(move |request: Request<Full<Bytes>>| {
            let (calls, script) = (Arc::clone(&calls), Arc::clone(&script));
            async move {
                let key = request.headers()["idempotency-key"].to_str()?.to_owned();
                let priority = request.extensions().get::<Priority>().copied();
                let cost = request.extensions().get::<Cost>().copied();
                let body = request.into_body().collect().await?.to_bytes();
                let body: Value = serde_json::from_slice(&body)?;
                let prompt = body["messages"][1]["content"].as_str().unwrap_or_default();
                let ids: Vec<String> = item_markers(prompt).map(|(id, _)| id.to_owned()).collect();
                let system = body["messages"][0]["content"].as_str().unwrap_or_default();
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
                let call = Call {
                    n,
                    ids,
                    system: system.to_owned(),
                };
                let response = match script(&call) {
                    Err(status) => {
                        Response::builder()
                            .status(status)
                            .body(Full::new(Bytes::from(
                                r#"{"error":{"message":"scripted"}}"#,
                            )))?
                    }
                    Ok(answers) => {
                        let body = json!({
                            "choices": [{"message": {"content": Value::Array(answers).to_string()}}],
                            "usage": {"prompt_tokens": 100, "completion_tokens": 10 * call.ids.len()},
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
async fn a_permanent_failure_bisects_the_group_with_new_keys() {
    let model = Scripted::default();
    let service = model.service(|n| (n == 1).then_some(StatusCode::BAD_REQUEST));
    let report = Grouper::new(service, ApiFormat::OpenAiChat, "Shared.")
        .run(items(3))
        .await;
    assert!(report.outcomes.iter().all(|o| o.result.is_ok() && o.resent));
    let seen = model.seen();
    let sizes: Vec<usize> = seen.iter().map(|s| s.ids.len()).collect();
    assert_eq!(sizes, [3, 2, 1], "the group, then its halves");
    let keys: std::collections::HashSet<&str> = seen.iter().map(|s| s.key.as_str()).collect();
    assert_eq!(keys.len(), 3);
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

/// The issue's case: one item makes every call holding it answer 400.
#[tokio::test(start_paused = true)]
async fn a_poisoned_item_fails_alone_and_its_neighbours_are_answered() {
    for attempts in [1, 3] {
        let model = Scripted::default();
        let service = model.answering(|call| {
            if call.ids.iter().any(|id| id == "t-7") {
                return Err(StatusCode::BAD_REQUEST);
            }
            Ok(call.answers(|_| json!("ok")))
        });
        let report = Grouper::new(service, ApiFormat::OpenAiChat, "Shared.")
            .config(GroupConfig::new().max_attempts(NonZeroU32::new(attempts).unwrap()))
            .run(items(10))
            .await;
        for outcome in &report.outcomes {
            match outcome.id.as_str() {
                "t-7" => {
                    let failure = outcome.result.as_ref().unwrap_err();
                    assert!(failure.is_call_failed());
                    assert!(failure.reason().contains("400"), "{failure}");
                }
                _ => assert!(outcome.result.is_ok(), "{outcome:?}"),
            }
        }
        // 10 (t-0..t-9), then 5 + 5, then 3 + 2 of the poisoned half (t-5..t-9), then 2 + 1
        // of (t-5, t-6, t-7): each failure halves the group holding the poisoned item, until
        // it stands alone.
        let sizes: Vec<usize> = model.seen().iter().map(|s| s.ids.len()).collect();
        assert_eq!(sizes, [10, 5, 5, 3, 2, 2, 1], "{attempts} attempts");
    }
}

#[tokio::test(start_paused = true)]
async fn keys_name_everything_the_model_sees() {
    let model = Scripted::default();
    let service = model.service(|_| None);
    let run = |instructions: &'static str, order: [usize; 2], keyed: bool| {
        let service = service.clone();
        async move {
            let items = order
                .map(|i| {
                    let item = GroupItem::new(format!("t-{i}"), "x");
                    if keyed {
                        item.key(format!("job-{i}"))
                    } else {
                        item
                    }
                })
                .to_vec();
            Grouper::new(service, ApiFormat::OpenAiChat, instructions)
                .run(items)
                .await;
        }
    };
    run("Classify.", [0, 1], false).await;
    run("Classify.", [0, 1], false).await;
    run("Translate.", [0, 1], false).await;
    run("Classify.", [1, 0], false).await;
    run("Classify.", [0, 1], true).await;
    let keys: Vec<String> = model.seen().into_iter().map(|s| s.key).collect();
    assert_eq!(keys[0], keys[1], "the same batch again: the same key");
    let distinct: std::collections::HashSet<&String> = keys[1..].iter().collect();
    assert_eq!(
        distinct.len(),
        4,
        "other instructions, another order, keys of their own"
    );
}

/// The issue's case: with `IdempotencyLayer` outermost, a batch whose prompt changed but whose
/// item ids did not got the earlier batch's stored answers.
#[tokio::test(start_paused = true)]
async fn another_batch_with_the_same_ids_never_gets_a_stored_answer() {
    use tower_llm_quota::idempotency::IdempotencyLayer;
    let model = Scripted::default();
    // The model answers each item with the first word of the instructions.
    let service = model.answering(|call| {
        let word = call.system.split('.').next().unwrap_or_default().to_owned();
        Ok(call.answers(|_| json!(word)))
    });
    let service = boxed(IdempotencyLayer::in_memory().layer(service));
    let batch = || vec![GroupItem::new("1", "Hello"), GroupItem::new("2", "World")];
    let run = |instructions: &'static str| {
        Grouper::new(service.clone(), ApiFormat::OpenAiChat, instructions).run(batch())
    };
    let classify = run("Classify.").await;
    let translate = run("Translate.").await;
    // Every item of a report answered `word`.
    let all = |report: &tower_llm_quota::group::GroupReport<Value>, word: &str| {
        report.outcomes.iter().all(|o| o.result == Ok(json!(word)))
    };
    assert!(all(&classify, "Classify"));
    assert!(all(&translate, "Translate"), "{:?}", translate.outcomes);
    assert_eq!(model.seen().len(), 2, "one model call per batch");
    // The same batch again: replayed, no call.
    let again = run("Classify.").await;
    assert!(all(&again, "Classify"));
    assert_eq!((again.stats.calls, again.stats.replayed_calls), (1, 1));
    assert_eq!(model.seen().len(), 2);
}

/// A worker restarted with the same idempotency records rebuilds the keys of its earlier
/// rounds: the answers stored for them (rejected before) are read again, and cost no attempt.
#[tokio::test(start_paused = true)]
async fn answers_replayed_after_a_restart_cost_no_attempt() {
    use tower_llm_quota::idempotency::IdempotencyLayer;
    let model = Scripted::default();
    let seen_bad = Arc::new(Mutex::new(0usize));
    // The model answers item "x" badly in the first four calls that hold it.
    let service = {
        let seen_bad = Arc::clone(&seen_bad);
        model.answering(move |call| {
            let mut bad = seen_bad.lock().unwrap();
            let holds_x = call.ids.iter().any(|id| id == "x");
            *bad += usize::from(holds_x);
            let x_bad = holds_x && *bad <= 4;
            Ok(call.answers(|id| {
                if id == "x" && x_bad {
                    Value::Null
                } else {
                    json!("ok")
                }
            }))
        })
    };
    let service = boxed(IdempotencyLayer::in_memory().layer(service));
    let batch = || vec![GroupItem::new("x", "first"), GroupItem::new("y", "second")];
    let run = || Grouper::new(service.clone(), ApiFormat::OpenAiChat, "Shared.").run(batch());
    // Before the restart: the pair, x regrouped (alone), then alone twice: three attempts.
    let before = run().await;
    assert!(before.outcomes[0].result.is_err());
    assert_eq!(before.outcomes[0].attempts, 4);
    assert_eq!(model.seen().len(), 4);
    // After it: the same four keys replay the same answers, at no attempt, then a fifth
    // round is a call of its own.
    let after = run().await;
    assert_eq!(
        after.outcomes[0].result,
        Ok(json!("ok")),
        "{:?}",
        after.outcomes[0]
    );
    assert_eq!(after.outcomes[0].attempts, 1);
    assert_eq!((after.stats.calls, after.stats.replayed_calls), (5, 4));
    assert_eq!(model.seen().len(), 5);
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

/// The reference model of a batch with poisoned items and transient faults, grouped in
/// chunks of `max_items`: each group fails transiently `faults(members)` times first (its
/// items fail with the provider's reason when that reaches `max_attempts`), then a group
/// holding a poisoned item is bisected until that item stands alone and fails; the others
/// are answered. Returns each item's outcome (`true`: answered) and the calls made.
fn poisoned_model(
    n: usize,
    max_items: usize,
    max_attempts: u32,
    poisoned: &[bool],
    faults: &dyn Fn(&[usize]) -> u32,
) -> (Vec<bool>, u64) {
    fn visit(
        members: &[usize],
        max_attempts: u32,
        poisoned: &[bool],
        faults: &dyn Fn(&[usize]) -> u32,
        out: &mut (Vec<bool>, u64),
    ) {
        let k = faults(members);
        if k >= max_attempts {
            out.1 += u64::from(max_attempts);
            return;
        }
        out.1 += u64::from(k) + 1;
        if !members.iter().any(|&i| poisoned[i]) {
            for &i in members {
                out.0[i] = true;
            }
        } else if members.len() > 1 {
            let half = members.len().div_ceil(2);
            visit(&members[..half], max_attempts, poisoned, faults, out);
            visit(&members[half..], max_attempts, poisoned, faults, out);
        }
    }
    let mut out = (vec![false; n], 0);
    let all: Vec<usize> = (0..n).collect();
    for chunk in all.chunks(max_items) {
        visit(chunk, max_attempts, poisoned, faults, &mut out);
    }
    out
}

/// The model's verdict on a report: each item as the model says, the calls it counts.
fn check_against_model(
    report: &tower_llm_quota::group::GroupReport<Value>,
    model: &(Vec<bool>, u64),
    poisoned: &[bool],
) -> Result<(), String> {
    for (i, outcome) in report.outcomes.iter().enumerate() {
        match (&outcome.result, model.0[i]) {
            (Ok(_), true) => {}
            (Err(failure), false) if failure.is_call_failed() => {
                // Its group failed transiently on every attempt, or it is poisoned and alone.
                let reason = failure.reason();
                if !(reason.contains("503") || (poisoned[i] && reason.contains("400"))) {
                    return Err(format!("{}: {failure}", outcome.id));
                }
            }
            (result, answered) => {
                return Err(format!(
                    "{}: {result:?}, the model says answered = {answered}",
                    outcome.id
                ));
            }
        }
    }
    if report.stats.calls != model.1 {
        return Err(format!(
            "{} calls, the model counts {}",
            report.stats.calls, model.1
        ));
    }
    Ok(())
}

/// How many times the group of `members` fails transiently before it is answered: none for
/// most groups, up to `max_attempts` (its items then fail) for some, chosen by a hash.
fn transient_faults(members: &[usize], seed: u64, max_attempts: u32) -> u32 {
    use std::hash::{Hash, Hasher};
    let mut hash = std::collections::hash_map::DefaultHasher::new();
    (members, seed).hash(&mut hash);
    let h = hash.finish();
    if h % 10 < 7 {
        0
    } else {
        1 + ((h >> 8) % u64::from(max_attempts)) as u32
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(150))]
    #[test]
    fn a_poisoned_item_never_fails_a_neighbour_whatever_the_faults(
        n in 1..40usize,
        max_items in 1..12usize,
        max_attempts in 1..4u32,
        poison in proptest::collection::vec(proptest::bool::weighted(0.15), 40),
        seed in proptest::prelude::any::<u64>(),
    ) {
        let poisoned: Vec<bool> = poison[..n].to_vec();
        let faults = move |members: &[usize]| transient_faults(members, seed, max_attempts);
        let model = poisoned_model(n, max_items, max_attempts, &poisoned, &faults);
        let failed_so_far: Arc<Mutex<std::collections::HashMap<Vec<usize>, u32>>> = Arc::default();
        let scripted = Scripted::default();
        let service = {
            let poisoned = poisoned.clone();
            scripted.answering(move |call| {
                let members: Vec<usize> =
                    call.ids.iter().map(|id| id[2..].parse().unwrap()).collect();
                let mut failed = failed_so_far.lock().unwrap();
                let so_far = failed.entry(members.clone()).or_default();
                if *so_far < faults(&members) {
                    *so_far += 1;
                    return Err(StatusCode::SERVICE_UNAVAILABLE);
                }
                if members.iter().any(|&i| poisoned[i]) {
                    return Err(StatusCode::BAD_REQUEST);
                }
                Ok(call.answers(|_| json!("ok")))
            })
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        let report = runtime.block_on(
            Grouper::new(service, ApiFormat::OpenAiChat, "Shared.")
                .config(
                    GroupConfig::new()
                        .max_items(max_items).unwrap()
                        .max_attempts(NonZeroU32::new(max_attempts).unwrap()),
                )
                .run(items(n)),
        );
        if let Err(violation) = check_against_model(&report, &model, &poisoned) {
            proptest::prop_assert!(false, "{}", violation);
        }
        // Without a group failing transiently on every attempt, every innocent item is
        // answered.
        let exhausted = model.0.iter().zip(&poisoned).any(|(&ok, &p)| !ok && !p);
        if !exhausted {
            for (outcome, &p) in report.outcomes.iter().zip(&poisoned) {
                proptest::prop_assert_eq!(outcome.result.is_ok(), !p);
            }
        }
    }
}

#[test]
fn the_poison_oracle_sees_a_planted_violation() {
    // A report in which an innocent neighbour failed with the poisoned item's 400.
    let poisoned = [false, true];
    let model = poisoned_model(2, 2, 3, &poisoned, &|_| 0);
    assert_eq!(model, (vec![true, false], 1 + 2));
    let failure = |id: &str| tower_llm_quota::group::ItemOutcome {
        id: id.to_owned(),
        result: Err(failed_call()),
        attempts: 1,
        resent: false,
        resent_alone: false,
        usage: Default::default(),
    };
    let mut report = tower_llm_quota::group::GroupReport {
        outcomes: vec![failure("t-0"), failure("t-1")],
        stats: Default::default(),
    };
    report.stats.calls = 3;
    assert!(check_against_model(&report, &model, &poisoned).is_err());
    report.outcomes[0].result = Ok(json!("ok"));
    assert!(check_against_model(&report, &model, &poisoned).is_ok());
    report.stats.calls = 2;
    assert!(check_against_model(&report, &model, &poisoned).is_err());
}

/// A real failure of a call (a 400 alone).
fn failed_call() -> tower_llm_quota::group::ItemFailure {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let service = Scripted::default().service(|_| Some(StatusCode::BAD_REQUEST));
    let report =
        runtime.block_on(Grouper::new(service, ApiFormat::OpenAiChat, "Shared.").run(items(1)));
    report.outcomes[0].result.clone().unwrap_err()
}

/// A batch of the keys property: instructions, model, format, items (id, text).
#[derive(Debug, Clone)]
struct BatchSpec {
    instructions: &'static str,
    model: &'static str,
    anthropic: bool,
    items: Vec<(usize, &'static str)>,
}

fn batch_spec() -> impl proptest::strategy::Strategy<Value = BatchSpec> {
    use proptest::prelude::*;
    (
        prop_oneof![Just("Classify."), Just("Translate.")],
        prop_oneof![Just("m1"), Just("m2")],
        proptest::bool::weighted(0.2),
        proptest::sample::subsequence(vec![1, 2, 3], 1..=3).prop_shuffle(),
        proptest::collection::vec(prop_oneof![Just("x"), Just("y")], 3),
    )
        .prop_map(|(instructions, model, anthropic, ids, texts)| BatchSpec {
            instructions,
            model,
            anthropic,
            items: ids.into_iter().zip(texts).collect(),
        })
}

/// A request's URI and body, and its idempotency key.
type Sent = ((String, Bytes), String);

/// The first request a batch sends.
fn first_request(spec: &BatchSpec) -> Sent {
    let seen: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let service = {
        let seen = Arc::clone(&seen);
        boxed(service_fn(move |request: Request<Full<Bytes>>| {
            let seen = Arc::clone(&seen);
            async move {
                let key = request.headers()["idempotency-key"].to_str()?.to_owned();
                let uri = request.uri().to_string();
                let body = request.into_body().collect().await?.to_bytes();
                seen.lock().unwrap().push(((uri, body), key));
                let refused = Response::builder().status(StatusCode::BAD_REQUEST);
                Ok::<_, BoxError>(refused.body(Full::new(Bytes::new()))?)
            }
        }))
    };
    let format = if spec.anthropic {
        ApiFormat::Anthropic
    } else {
        ApiFormat::OpenAiChat
    };
    let items = spec
        .items
        .iter()
        .map(|(id, text)| GroupItem::new(id.to_string(), *text))
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(
        Grouper::new(service, format, spec.instructions)
            .model(spec.model)
            .run(items),
    );
    seen.lock().unwrap()[0].clone()
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
    #[test]
    fn two_batches_share_a_key_if_and_only_if_they_send_the_same_request(
        a in batch_spec(),
        b in batch_spec(),
    ) {
        let (request_a, key_a) = first_request(&a);
        let (request_b, key_b) = first_request(&b);
        proptest::prop_assert_eq!(key_a == key_b, request_a == request_b, "{:?} / {:?}", a, b);
        // The same batch again: the same key.
        proptest::prop_assert_eq!(first_request(&a).1, key_a);
    }
}

/// Items whose deadline a budget can tell will not be met: their group is refused at once,
/// bisected so that the members that can still go do, and each item that cannot fails with
/// the predicted wait, at once, never sent.
#[tokio::test(start_paused = true)]
async fn a_deadline_the_budget_cannot_meet_fails_its_items_at_once() {
    let model = Scripted::default();
    let limit = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(6_000).unwrap());
    let stack = QuotaStack::openai(Quota::new().with_limit(limit));
    let service = boxed(stack.layer(model.service(|_| None)));
    let deadline = Deadline::after(Duration::from_secs(1));
    let batch: Vec<GroupItem> = (0..8)
        .map(|i| GroupItem::new(format!("t-{i}"), "word ".repeat(200)).deadline(deadline))
        .collect();
    let start = tokio::time::Instant::now();
    let report = Grouper::new(service, ApiFormat::OpenAiChat, "Shared.")
        .config(GroupConfig::new().max_items(4).unwrap())
        .run(batch)
        .await;
    // Nothing waited past its deadline: what was admitted was admitted before it.
    assert!(
        start.elapsed() <= Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    let done = report.outcomes.iter().filter(|o| o.result.is_ok()).count();
    assert!(done >= 1, "the burst pays for some: {:?}", report.outcomes);
    let seen = model.seen();
    for outcome in report.outcomes.iter().filter(|o| o.result.is_err()) {
        let failure = outcome.result.as_ref().unwrap_err();
        assert!(failure.reason().contains("would wait about"), "{failure}");
        // Never sent: the model saw no call holding it.
        assert!(
            !seen.iter().any(|s| s.ids.contains(&outcome.id)),
            "{outcome:?}"
        );
    }
    assert!(done < 8, "some could not make it: {done} done");
}
