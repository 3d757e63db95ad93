//! Limits scoped as the provider scopes them: OpenAI's per model (`model_quota`), Anthropic's
//! per model class (`scopes`). A provider 429 for one model pauses its scope only; the
//! account-wide request limit still holds over every scope; a model that cannot have a scope
//! of its own is refused before anything is sent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::response::IntoResponse;
use http::StatusCode;
use serde_json::Value;

use crate::support::{Running, json};
use tower_llm_quota_gateway::Config;

/// The upstream calls by model.
type Calls = Arc<Mutex<HashMap<String, usize>>>;

const OPENAI_429: &str = r#"{"error":{"message":"Rate limit reached for a in organization org-x on tokens per min (TPM): Limit 30000, Used 30000, Requested 60.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;
const ANTHROPIC_429: &str = r#"{"type":"error","error":{"type":"rate_limit_error","message":"This request would exceed the rate limit for your organization of 30,000 input tokens per minute."}}"#;

/// An upstream answering 429 (with a 20 s wait and rate-limit headers saying nothing is left)
/// for the models named `limited`, and a small answer for the others: its URL and its calls.
async fn upstream(limited: &'static [&'static str], anthropic: bool) -> (String, Calls) {
    let calls = Calls::default();
    let counted = calls.clone();
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
        let counted = counted.clone();
        async move {
            let request: Value = serde_json::from_slice(&body).unwrap_or_default();
            let model = request["model"].as_str().unwrap_or("").to_owned();
            *counted.lock().unwrap().entry(model.clone()).or_default() += 1;
            if limited.contains(&model.as_str()) {
                let (body, headers): (&str, &[(&str, &str)]) = if anthropic {
                    (
                        ANTHROPIC_429,
                        &[
                            ("retry-after", "20"),
                            ("anthropic-ratelimit-input-tokens-limit", "30000"),
                            ("anthropic-ratelimit-input-tokens-remaining", "0"),
                            ("anthropic-ratelimit-input-tokens-reset", "2030-01-01T00:00:20Z"),
                        ],
                    )
                } else {
                    (
                        OPENAI_429,
                        &[
                            ("retry-after", "20"),
                            ("x-ratelimit-limit-tokens", "30000"),
                            ("x-ratelimit-remaining-tokens", "0"),
                            ("x-ratelimit-reset-tokens", "20s"),
                            ("x-ratelimit-limit-requests", "500"),
                            ("x-ratelimit-remaining-requests", "499"),
                            ("x-ratelimit-reset-requests", "120ms"),
                        ],
                    )
                };
                let mut response = (
                    StatusCode::TOO_MANY_REQUESTS,
                    [("content-type", "application/json")],
                    body,
                )
                    .into_response();
                for (name, value) in headers {
                    response.headers_mut().insert(*name, value.parse().unwrap());
                }
                return response;
            }
            let body = if anthropic {
                format!(
                    r#"{{"id":"m","type":"message","role":"assistant","model":"{model}","content":[{{"type":"text","text":"ok"}}],"stop_reason":"end_turn","usage":{{"input_tokens":8,"output_tokens":2}}}}"#
                )
            } else {
                format!(
                    r#"{{"id":"c","object":"chat.completion","model":"{model}","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":8,"completion_tokens":2,"total_tokens":10}}}}"#
                )
            };
            ([("content-type", "application/json")], body).into_response()
        }
    });
    (crate::support::serve_upstream(app).await, calls)
}

/// One account over `upstream` with `limits` (its quota and scopes), one interactive key.
fn config(upstream: &str, profile: &str, limits: &str) -> String {
    let api = if profile == "anthropic" {
        "messages"
    } else {
        "chat"
    };
    format!(
        r#"
        [server]
        admin_token = "admin"
        [[accounts]]
        name = "main"
        base_url = "{upstream}"
        key = "sk-upstream"
        profile = "{profile}"
        apis = ["{api}"]
        {limits}
        [[keys]]
        name = "team-key"
        key = "caller-secret"
        tenant = "team"
        default_class = "interactive"
        "#
    )
}

/// Asks for `model`: the status, the error's scope (if refused), the time it took.
async fn ask(gateway: &Running, model: &str, anthropic: bool) -> (u16, Value, Duration) {
    let (path, body) = if anthropic {
        (
            "/v1/messages",
            format!(
                r#"{{"model":"{model}","max_tokens":20,"messages":[{{"role":"user","content":"Hi"}}]}}"#
            ),
        )
    } else {
        (
            "/v1/chat/completions",
            format!(
                r#"{{"model":"{model}","max_tokens":20,"messages":[{{"role":"user","content":"Hi"}}]}}"#
            ),
        )
    };
    let start = Instant::now();
    let response = gateway.post(path, Some("caller-secret"), &body).await;
    let (status, _, body) = json(response).await;
    let took = start.elapsed();
    eprintln!("{model}: {status} in {took:.1?}: {body}");
    (status, body, took)
}

fn calls_of(calls: &Calls, model: &str) -> usize {
    calls.lock().unwrap().get(model).copied().unwrap_or(0)
}

/// The issue's sequence, OpenAI's per-model limits: a 429 for model `a` (its headers say no
/// token is left for 20 s), then model `b`. Before scopes, `b` waited behind `a`'s pause (5 s
/// in the issue's run) and then got a 429; now `b` is answered at once, and `a`'s next request, still paused,
/// reaches nobody upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_for_one_model_pauses_that_model_only() {
    let (url, calls) = upstream(&["a"], false).await;
    let limits = "quota = { requests_per_minute = 10000 }\n        \
                  model_quota = { requests_per_minute = 500, tokens_per_minute = 30000 }";
    let gateway = Running::start(&config(&url, "openai", limits)).await;
    let (status, body, _) = ask(&gateway, "a", false).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["gateway_decision"], "provider", "{body}");
    assert_eq!(body["error"]["scope"], "account:main/scope:a", "{body}");
    let a_calls = calls_of(&calls, "a");
    let (status, body, took) = ask(&gateway, "b", false).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        took < Duration::from_secs(2),
        "b waited {took:?} behind a's pause"
    );
    // `a` is still paused: refused by its scope's budget, nothing sent.
    let (status, body, _) = ask(&gateway, "a", false).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(calls_of(&calls, "a"), a_calls, "a paused request was sent");
    assert_eq!(calls_of(&calls, "b"), 1);
    // The status page lists the account-wide row and each model's.
    let (_, status) = gateway.get("/status.json").await;
    let status: Value = serde_json::from_str(&status).unwrap();
    let names: Vec<&str> = status["accounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["main", "main/*", "main/a", "main/b"]);
    gateway.stop().await;
}

/// The same sequence on an account without scopes, as before: `a`'s 429 pauses the whole
/// account, so `b` is refused without being sent (the check above fails on such an account).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_scopes_a_429_pauses_every_model() {
    let (url, calls) = upstream(&["a"], false).await;
    let limits = "quota = { requests_per_minute = 500, tokens_per_minute = 30000 }";
    let gateway = Running::start(&config(&url, "openai", limits)).await;
    let (status, _, _) = ask(&gateway, "a", false).await;
    assert_eq!(status, 429);
    let (status, body, _) = ask(&gateway, "b", false).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(calls_of(&calls, "b"), 0);
    gateway.stop().await;
}

/// Anthropic's pooling per model class: a 429 for one Opus 4 model holds every Opus 4 model
/// (their next request is not sent) and no Sonnet model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_for_one_model_class_pauses_the_class_only() {
    let (url, calls) = upstream(&["claude-opus-4-1"], true).await;
    let limits = r#"quota = { requests_per_minute = 4000 }
        scopes = [
          { name = "opus-4", models = ["claude-opus-4*"], quota = { input_tokens_per_minute = 30000, output_tokens_per_minute = 8000 } },
          { name = "sonnet-4", models = ["claude-sonnet-4*"], quota = { input_tokens_per_minute = 30000, output_tokens_per_minute = 8000 } },
        ]"#;
    let gateway = Running::start(&config(&url, "anthropic", limits)).await;
    let (status, body, _) = ask(&gateway, "claude-opus-4-1", true).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(
        body["error"]["scope"], "account:main/scope:opus-4",
        "{body}"
    );
    let (status, body, took) = ask(&gateway, "claude-sonnet-4-5", true).await;
    assert_eq!(status, 200, "{body}");
    assert!(took < Duration::from_secs(2), "sonnet waited {took:?}");
    // Another Opus 4 model shares the paused class: refused, not sent.
    let (status, body, _) = ask(&gateway, "claude-opus-4-5", true).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(calls_of(&calls, "claude-opus-4-5"), 0);
    // A model of no scope shares the account's limits alone.
    let (status, body, _) = ask(&gateway, "claude-haiku-4-5", true).await;
    assert_eq!(status, 200, "{body}");
    gateway.stop().await;
}

/// The account-wide request limit holds over every scope: six requests a minute for the
/// account (a burst of one), 500 for each model; the second request, for another model,
/// waits for the account (past the interactive class's wait) and is not sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_account_wide_request_limit_holds_over_every_scope() {
    let (url, calls) = upstream(&[], false).await;
    let limits = "quota = { requests_per_minute = 6 }\n        \
                  model_quota = { requests_per_minute = 500, tokens_per_minute = 30000 }";
    let gateway = Running::start(&config(&url, "openai", limits)).await;
    let (status, body, _) = ask(&gateway, "a", false).await;
    assert_eq!(status, 200, "{body}");
    let (status, body, _) = ask(&gateway, "b", false).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["gateway_decision"], "local", "{body}");
    assert_eq!(body["error"]["scope"], "account:main", "{body}");
    assert_eq!(
        calls_of(&calls, "b"),
        0,
        "the account's second request was sent"
    );
    gateway.stop().await;
}

/// A model kept apart must have a name fit for a store key, and an account keeps at most 256
/// models apart: past that, a new model is refused with a 400 before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_kept_apart_are_bounded() {
    let (url, calls) = upstream(&[], false).await;
    let limits = "quota = { requests_per_minute = 100000 }\n        \
                  model_quota = { requests_per_minute = 100000, tokens_per_minute = 10000000 }";
    let gateway = Running::start(&config(&url, "openai", limits)).await;
    let (status, body, _) = ask(&gateway, "a{b}", false).await;
    assert_eq!(status, 400, "{body}");
    for n in 0..256 {
        let response = gateway
            .post(
                "/v1/chat/completions",
                Some("caller-secret"),
                &format!(r#"{{"model":"m{n}","max_tokens":5,"messages":[]}}"#),
            )
            .await;
        assert_eq!(response.status(), 200, "model m{n}");
    }
    let (status, body, _) = ask(&gateway, "m256", false).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("256"),
        "{body}"
    );
    // A model already kept apart is still served.
    let (status, _, _) = ask(&gateway, "m7", false).await;
    assert_eq!(status, 200);
    assert_eq!(calls_of(&calls, "m256"), 0);
    assert_eq!(calls_of(&calls, "a{b}"), 0);
    gateway.stop().await;
}

#[test]
fn scopes_that_cannot_work_are_configuration_errors() {
    let error = |limits: &str| {
        Config::from_toml(&config("http://127.0.0.1:1", "openai", limits))
            .err()
            .map(|e| e.to_string())
    };
    let tokens_at_account = error(
        "quota = { requests_per_minute = 10, tokens_per_minute = 100 }\n        \
         model_quota = { tokens_per_minute = 100 }",
    );
    assert!(
        tokens_at_account
            .as_deref()
            .is_some_and(|e| e.contains("requests and calls in flight only")),
        "{tokens_at_account:?}"
    );
    let twice = error(
        r#"quota = { requests_per_minute = 10 }
        scopes = [{ name = "x", models = ["a"], quota = {} }, { name = "x", models = ["b"], quota = {} }]"#,
    );
    assert!(twice.is_some_and(|e| e.contains("twice")));
    let no_models = error(
        r#"scopes = [{ name = "x", models = [], quota = {} }]"#
            .replace("scopes", "quota = {}\n        scopes")
            .as_str(),
    );
    assert!(no_models.is_some_and(|e| e.contains("must name models")));
    let bad_name = error(
        r#"quota = {}
        scopes = [{ name = "a b", models = ["a"], quota = {} }]"#,
    );
    assert!(bad_name.is_some_and(|e| e.contains("scope name")));
    assert_eq!(
        error(
            r#"quota = { requests_per_minute = 10 }
        scopes = [{ name = "x", models = ["a*"], quota = { tokens_per_minute = 5 } }]"#
        ),
        None
    );
}

/// A model's scope of 2 requests a minute, spent: the third interactive request is refused
/// at once (not after the class's 5 s), with the wait until the scope frees as `Retry-After`
/// (about 30 s, not 1), naming the scope in its body, its `x-llm-quota-scope` header and its
/// audit line; nothing reaches the provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_scope_refuses_at_once_with_its_wait_and_its_name() {
    let (url, calls) = upstream(&[], false).await;
    let limits = "quota = { requests_per_minute = 10000 }\n        \
                  model_quota = { requests_per_minute = 2 }";
    let gateway = Running::start(&config(&url, "openai", limits)).await;
    let body = r#"{"model":"a","max_tokens":20,"messages":[{"role":"user","content":"Hi"}]}"#;
    // The scope's burst served, the next request finds it spent.
    let (mut response, mut took, mut served) = (None, Duration::ZERO, 0);
    for _ in 0..3 {
        let start = Instant::now();
        let answer = gateway
            .post("/v1/chat/completions", Some("caller-secret"), body)
            .await;
        took = start.elapsed();
        if answer.status() != 200 {
            response = Some(answer);
            break;
        }
        served += 1;
    }
    assert!(served >= 1, "the first request is served");
    let response = response.expect("the scope is spent within its 2 requests");
    let header = response.headers()["x-llm-quota-scope"].clone();
    let (status, retry_after, refusal) = json(response).await;
    assert_eq!(status, 429, "{refusal}");
    assert!(took < Duration::from_secs(2), "refused after {took:?}");
    assert_eq!(
        refusal["error"]["scope"], "account:main/scope:a",
        "{refusal}"
    );
    assert_eq!(
        refusal["error"]["limit"], "requests_per_minute",
        "{refusal}"
    );
    assert_eq!(refusal["error"]["dimension"], "requests", "{refusal}");
    assert_eq!(
        refusal["error"]["type"], "requests",
        "OpenAI's type: {refusal}"
    );
    assert_eq!(header, "account:main/scope:a");
    let retry_after: u64 = retry_after.unwrap().parse().unwrap();
    assert!(
        (20..=31).contains(&retry_after),
        "Retry-After {retry_after}"
    );
    assert_eq!(
        calls_of(&calls, "a"),
        served,
        "nothing sent for the refused one"
    );
    // The status page shows the spent scope: its row, its binding limit, nothing left.
    let status = reqwest::get(format!("{}/status.json", gateway.url))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let status: Value = serde_json::from_slice(&status).unwrap();
    let row = (status["accounts"].as_array().unwrap().iter())
        .find(|row| row["name"] == "main/a")
        .unwrap_or_else(|| panic!("no row for the scope: {status}"));
    assert_eq!(row["binding"], "requests_per_minute", "{row}");
    assert!(row["levels"][0]["level"].as_i64().unwrap() < 1, "{row}");
    // And when it frees: about the refusal's Retry-After.
    let frees = row["levels"][0]["frees_in_seconds"].as_f64().unwrap();
    assert!((15.0..=31.0).contains(&frees), "{row}");
    gateway.stop().await;
}
