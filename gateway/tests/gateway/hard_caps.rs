//! A cap that is a cap: under a hard spend cap, a request without `max_tokens` reserves its
//! model's largest output, a request the cap cannot pay in full is sent with its
//! `max_tokens` lowered to what the cap has left (the answer says so in a header), and one
//! that would be lowered below a useful minimum is refused with the cap's reason. Two
//! replicas on one Redis, twenty callers sending a realistic mix until each is refused, never
//! spend more than the cap; a soft cap, with the same mix, is passed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;

use crate::redis_server::RedisServer;
use crate::support::Running;

/// The model's largest output, as the simulator answers it and the gateway's table says.
const LARGEST: u64 = 16_384;
/// Nano-dollars a token: $2.50 per million input tokens, $10 per million output.
const INPUT_NANO: u64 = 2_500;
const OUTPUT_NANO: u64 = 10_000;

/// A simulated account far above the load, answering each request between 10 % and 100 %
/// of its `max_tokens` (16,384 without one), `house-model` at the prices above, and the key
/// `key`'s cap of `cap` nano-dollars a month (`enforce` = `hard` or `soft`); replicas
/// lease every `lease_ms` (0: a store call per admission).
fn config(key: &str, cap: u64, enforce: &str, lease_ms: u64) -> String {
    format!(
        r#"
        [server]
        admin_token = "admin"
        lease_refresh_ms = {lease_ms}
        [[accounts]]
        name = "sim"
        base_url = "sim"
        profile = "openai"
        apis = ["chat"]
        quota = {{ requests_per_minute = 60000, tokens_per_minute = 600000000 }}
        sim = {{ base_ms = 5, default_max_tokens = {LARGEST}, max_output_tokens = {LARGEST} }}
        [prices]
        unpriced = "refuse"
        [prices.models."house-model"]
        input = "2.50"
        output = "10"
        [output]
        min_tokens = 64
        [output.largest]
        "house-model" = {LARGEST}
        [tenants.nodes."team/{key}"]
        caps = [{{ dimension = "spend", amount = {cap}, window = "calendar_month_utc", enforce = "{enforce}" }}]
        [[keys]]
        name = "{key}"
        key = "{key}-secret"
        tenant = "team"
        "#
    )
}

/// The `n`th request of the mix: a third bound their answer (`max_tokens` from 40 to 4,000),
/// a third set no bound, a third stream without a bound; prompts of different lengths.
fn body(n: u64) -> String {
    let prompt = "word ".repeat(20 + (n % 50) as usize);
    let messages = format!(r#""messages":[{{"role":"user","content":"{n} {prompt}"}}]"#);
    match n % 3 {
        0 => format!(
            r#"{{"model":"house-model","max_tokens":{},{messages}}}"#,
            40 + (n * 997) % 3_960
        ),
        1 => format!(r#"{{"model":"house-model",{messages}}}"#),
        _ => format!(
            r#"{{"model":"house-model","stream":true,"stream_options":{{"include_usage":true}},{messages}}}"#
        ),
    }
}

/// The spend of a usage object, at the prices (the test's own arithmetic).
fn spend_of(usage: &Value) -> u64 {
    let input = usage["prompt_tokens"].as_u64().expect("prompt_tokens");
    let output = usage["completion_tokens"]
        .as_u64()
        .expect("completion_tokens");
    input * INPUT_NANO + output * OUTPUT_NANO
}

/// The usage of an answer: its `usage`, or a stream's last chunk's.
fn usage_of(text: &str, streamed: bool) -> Value {
    if !streamed {
        let answer: Value = serde_json::from_str(text).expect("a JSON answer");
        return answer["usage"].clone();
    }
    text.lines()
        .rev()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .find_map(|chunk| chunk.get("usage").filter(|u| u.is_object()).cloned())
        .expect("a stream ends with its usage")
}

/// Sends `body` with `key`: the answer's status, its `x-llm-quota-output-bound`, its body.
async fn send(gateway: &Running, key: &str, body: &str) -> (u16, Option<String>, String) {
    let response = gateway.post("/v1/chat/completions", Some(key), body).await;
    let status = response.status().as_u16();
    let bound = response
        .headers()
        .get("x-llm-quota-output-bound")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, bound, response.text().await.unwrap())
}

/// What the callers of one run saw.
#[derive(Default)]
struct Seen {
    spent: AtomicU64,
    answered: AtomicU64,
    lowered: AtomicU64,
    refused_small: AtomicU64,
    /// Callers with a request on its way now.
    sending: AtomicU64,
}

/// One caller: sends the mix until the cap refuses it (a refusal for too little left, again
/// while other callers' requests are on their way); checks the header of each answer whose
/// bound was lowered, and that the answer holds no more than the bound.
async fn caller(replica: Arc<Running>, key: String, next: Arc<AtomicU64>, seen: Arc<Seen>) {
    loop {
        let n = next.fetch_add(1, Ordering::Relaxed);
        let body = body(n);
        seen.sending.fetch_add(1, Ordering::SeqCst);
        let (status, bound, text) = send(&replica, &format!("{key}-secret"), &body).await;
        seen.sending.fetch_sub(1, Ordering::SeqCst);
        if status == 200 {
            let usage = usage_of(&text, n % 3 == 2);
            seen.spent.fetch_add(spend_of(&usage), Ordering::Relaxed);
            seen.answered.fetch_add(1, Ordering::Relaxed);
            if let Some(bound) = bound {
                let to: u64 = bound.split(';').next().unwrap().parse().unwrap();
                assert!(bound.contains("lowered; limit=spend_per_month"), "{bound}");
                assert!(
                    bound.contains(&format!("scope=tenant:team/{key}")),
                    "{bound}"
                );
                assert!(to >= 64, "{bound}");
                let output = usage["completion_tokens"].as_u64().unwrap();
                assert!(output <= to, "{output} tokens answered over the bound {to}");
                seen.lowered.fetch_add(1, Ordering::Relaxed);
            }
            continue;
        }
        let refusal: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if status == 503 && refusal["error"]["limit"] == "store" {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            continue;
        }
        assert_eq!(status, 429, "{text}");
        assert_eq!(refusal["error"]["limit"], "spend_per_month", "{refusal}");
        if refusal["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("below the useful minimum"))
        {
            seen.refused_small.fetch_add(1, Ordering::Relaxed);
            // Too little left while others' calls are on their way: what they hold beyond
            // their answers comes back as they settle. A client tries again until nobody
            // else is sending (then what is left is left).
            if seen.sending.load(Ordering::SeqCst) > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                continue;
            }
        }
        return;
    }
}

/// One run: two replicas on `redis`, a cap of $1 on a key of its own, ten callers on each:
/// the spend of every answer, counted from outside, as a share of the cap; how many were
/// lowered, and how many callers were refused for too little left.
async fn run(redis: &str, run: usize, enforce: &str, lease_ms: u64) -> (f64, u64, u64, u64) {
    const CAP: u64 = 1_000_000_000;
    let key = format!("k{run}-{enforce}-{lease_ms}");
    let config = config(&key, CAP, enforce, lease_ms);
    let replicas = [
        Arc::new(Running::start_shared(&config, redis).await),
        Arc::new(Running::start_shared(&config, redis).await),
    ];
    let (next, seen) = (
        Arc::new(AtomicU64::new(run as u64 * 7)),
        Arc::new(Seen::default()),
    );
    let callers: Vec<_> = (0..20)
        .map(|i| {
            let replica = Arc::clone(&replicas[i % 2]);
            tokio::spawn(caller(replica, key.clone(), next.clone(), seen.clone()))
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    for replica in replicas {
        Arc::into_inner(replica).unwrap().stop().await;
    }
    (
        seen.spent.load(Ordering::Relaxed) as f64 / CAP as f64,
        seen.answered.load(Ordering::Relaxed),
        seen.lowered.load(Ordering::Relaxed),
        seen.refused_small.load(Ordering::Relaxed),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_never_pass_a_hard_cap_with_a_realistic_mix() {
    let runs: usize = std::env::var("HARD_CAP_RUNS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10);
    let redis = RedisServer::start();
    for (mode, lease_ms) in [("leased", 100), ("per admission", 0)] {
        let mut ratios = Vec::new();
        let (mut lowered, mut small) = (0, 0);
        for i in 0..runs {
            let (ratio, answered, lowered_now, small_now) =
                run(&redis.url(), i, "hard", lease_ms).await;
            eprintln!(
                "hard cap, {mode}, run {i}: {answered} answers spent {ratio:.4}x the cap \
                 ({lowered_now} lowered, {small_now} callers refused for too little left)"
            );
            assert!(ratio <= 1.0, "{mode}, run {i}: {ratio:.4}x the cap");
            ratios.push(ratio);
            lowered += lowered_now;
            small += small_now;
        }
        let (low, high) = ratios
            .iter()
            .fold((f64::MAX, 0f64), |(l, h), r| (l.min(*r), h.max(*r)));
        eprintln!("hard cap, {mode}: {low:.4}-{high:.4}x the cap in {runs} runs");
        assert!(lowered > 0, "{mode}: no request was lowered to fit");
        assert!(
            small > 0,
            "{mode}: no caller was refused for too little left"
        );
        assert!(low > 0.95, "{mode}: the cap left unused ({low:.4}x)");
    }
}

/// The same mix under a soft cap: requests are not reshaped, and answers longer than their
/// reservation (the 4,096 tokens reserved without `max_tokens`) pass it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_mix_passes_a_soft_cap() {
    let redis = RedisServer::start();
    let mut highest = 0f64;
    for i in 0..3 {
        let (ratio, answered, lowered, _) = run(&redis.url(), i, "soft", 0).await;
        eprintln!("soft cap, run {i}: {answered} answers spent {ratio:.4}x the cap");
        assert_eq!(lowered, 0, "a soft cap reshapes nothing");
        highest = highest.max(ratio);
    }
    assert!(
        highest > 1.0,
        "the mix never passed the soft cap ({highest:.4}x)"
    );
}

/// One gateway, a key's hard cap: a request without `max_tokens` reserves the model's
/// largest output (none written), one for a model the table does not know gets a bound
/// written in, and near the cap a request is lowered, then refused with the cap's reason.
#[tokio::test]
async fn a_request_is_bounded_lowered_and_then_refused() {
    let cap = 200_000_000;
    let config = config("one", cap, "hard", 0)
        .replace(
            "[prices.models.\"house-model\"]",
            "[prices.models.\"other-model\"]\n        input = \"2.50\"\n        output = \"10\"\n        [prices.models.\"house-model\"]",
        );
    let gateway = Running::start(&config).await;
    let send = |body: String| {
        let gateway = &gateway;
        async move {
            let (status, bound, text) = send(gateway, "one-secret", &body).await;
            let answer = serde_json::from_str::<Value>(&text).unwrap_or(Value::Null);
            (status, bound, answer)
        }
    };
    let unbounded = r#"{"model":"house-model","messages":[{"role":"user","content":"Hello"}]}"#;
    let (status, bound, answer) = send(unbounded.to_owned()).await;
    assert_eq!((status, bound), (200, None), "{answer}");
    let (status, bound, answer) = send(unbounded.replace("house-model", "other-model")).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(bound.as_deref(), Some("4096; written"));
    assert!(answer["usage"]["completion_tokens"].as_u64().unwrap() <= 4_096);
    // Spend until a request is lowered, then until one is refused.
    let mut lowered = None;
    let refusal = loop {
        let (status, bound, answer) = send(unbounded.to_owned()).await;
        if status != 200 {
            assert_eq!(status, 429, "{answer}");
            break answer;
        }
        if let Some(bound) = bound {
            lowered.get_or_insert(bound);
        }
    };
    let lowered = lowered.expect("a request lowered before the refusal");
    assert!(
        lowered.ends_with("; lowered; limit=spend_per_month; scope=tenant:team/one"),
        "{lowered}"
    );
    assert_eq!(refusal["error"]["limit"], "spend_per_month", "{refusal}");
    let message = refusal["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("below the useful minimum of 64"),
        "{message}"
    );
    gateway.stop().await;
}
