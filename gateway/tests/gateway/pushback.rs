//! Provider pushback through the gateway, once the stack's retries gave up: every shape of
//! 429 from ../PROVIDERS (OpenAI, Azure, Anthropic; with rate-limit headers and without;
//! Azure's wait only in its message, its `-1` sentinels) is a 429 with `gateway_decision:
//! "provider"` and a `Retry-After`, in the caller's schema; an overloaded provider (Anthropic's
//! 529, a 503) is a 503 with `Retry-After` (Anthropic's 529 for an Anthropic caller); none is
//! a 502.

use std::time::{Duration, Instant};

use axum::response::IntoResponse;
use http::StatusCode;
use serde_json::Value;

use crate::api::fixed_config;
use crate::support::{Running, chat, json, messages};

/// One shape of pushback, and what the caller must get.
struct Case {
    name: &'static str,
    profile: &'static str,
    status: u16,
    headers: &'static [(&'static str, &'static str)],
    body: &'static str,
    answered: u16,
    /// The error `type` (OpenAI's schema) or `error.type` (Anthropic's).
    kind: &'static str,
    /// OpenAI's `code`, on OpenAI routes.
    code: Option<&'static str>,
}

const OPENAI_429: &str = r#"{"error":{"message":"Rate limit reached for gpt-4o-mini on requests per min (RPM): Limit 600, Used 600, Requested 1.","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
const AZURE_429: &str = r#"{"error":{"code":"429","message":"Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-10-21 have exceeded token rate limit of your current OpenAI S0 pricing tier. Please retry after 2 seconds. Please go here: https://aka.ms/oai/quotaincrease if you would like to further increase the default rate limit."}}"#;
const ANTHROPIC_429: &str = r#"{"type":"error","error":{"type":"rate_limit_error","message":"This request would exceed the rate limit for your organization of 50 requests per minute."}}"#;
const ANTHROPIC_529: &str =
    r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
const OPENAI_503: &str = r#"{"error":{"message":"The server is overloaded or not ready yet.","type":"server_error","param":null,"code":null}}"#;

const CASES: [Case; 9] = [
    Case {
        name: "OpenAI 429, retry-after, no rate-limit headers",
        profile: "openai",
        status: 429,
        headers: &[("retry-after", "2")],
        body: OPENAI_429,
        answered: 429,
        kind: "requests",
        code: Some("rate_limit_exceeded"),
    },
    Case {
        name: "OpenAI 429 with x-ratelimit headers",
        profile: "openai",
        status: 429,
        headers: &[
            ("retry-after", "2"),
            ("x-ratelimit-limit-requests", "600"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "2s"),
            ("x-ratelimit-limit-tokens", "200000"),
            ("x-ratelimit-remaining-tokens", "150000"),
            ("x-ratelimit-reset-tokens", "15s"),
        ],
        body: OPENAI_429,
        answered: 429,
        kind: "requests",
        code: Some("rate_limit_exceeded"),
    },
    Case {
        name: "OpenAI 429 with no header at all",
        profile: "openai",
        status: 429,
        headers: &[],
        body: OPENAI_429,
        answered: 429,
        kind: "requests",
        code: Some("rate_limit_exceeded"),
    },
    Case {
        name: "Azure 429, retry-after and retry-after-ms, remaining headers",
        profile: "azure_openai",
        status: 429,
        headers: &[
            ("retry-after", "2"),
            ("retry-after-ms", "1500"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-remaining-tokens", "0"),
        ],
        body: AZURE_429,
        answered: 429,
        kind: "tokens",
        code: Some("rate_limit_exceeded"),
    },
    Case {
        name: "Azure 429, the wait only in its message",
        profile: "azure_openai",
        status: 429,
        headers: &[],
        body: AZURE_429,
        answered: 429,
        kind: "tokens",
        code: Some("rate_limit_exceeded"),
    },
    Case {
        name: "Azure 429 with -1 sentinels",
        profile: "azure_openai",
        status: 429,
        headers: &[
            ("x-ratelimit-limit-tokens", "-1"),
            ("x-ratelimit-remaining-tokens", "-1"),
            ("x-ratelimit-reset-tokens", "0"),
        ],
        body: AZURE_429,
        answered: 429,
        kind: "tokens",
        code: Some("rate_limit_exceeded"),
    },
    Case {
        name: "Anthropic 429 with anthropic-ratelimit headers",
        profile: "anthropic",
        status: 429,
        headers: &[
            ("retry-after", "2"),
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-requests-reset", "2030-01-01T00:00:02Z"),
        ],
        body: ANTHROPIC_429,
        answered: 429,
        kind: "rate_limit_error",
        code: None,
    },
    Case {
        name: "Anthropic 529 overloaded",
        profile: "anthropic",
        status: 529,
        headers: &[("retry-after", "2")],
        body: ANTHROPIC_529,
        answered: 529,
        kind: "overloaded_error",
        code: None,
    },
    Case {
        name: "OpenAI 503 overloaded",
        profile: "openai",
        status: 503,
        headers: &[],
        body: OPENAI_503,
        answered: 503,
        kind: "server_error",
        code: None,
    },
];

/// Runs `case` against its own upstream and gateway: the caller's status, `Retry-After`,
/// body, and how long the answer took.
/// A loopback upstream answering every request as `case` says: its URL.
async fn serve_case(case: &'static Case) -> String {
    let app = axum::Router::new().fallback(move || async move {
        let mut response = (
            StatusCode::from_u16(case.status).unwrap(),
            [("content-type", "application/json")],
            case.body,
        )
            .into_response();
        for (name, value) in case.headers {
            response.headers_mut().insert(*name, value.parse().unwrap());
        }
        response
    });
    crate::support::serve_upstream(app).await
}

async fn run(case: &'static Case) -> (u16, Option<String>, Value, Duration) {
    let upstream = serve_case(case).await;
    let anthropic = case.profile == "anthropic";
    let mut config = fixed_config(&upstream)
        .replace(
            "profile = \"openai\"",
            &format!("profile = \"{}\"", case.profile),
        )
        // An interactive key: the stack gives up within its class's budget of retries.
        .replace(
            "tenant = \"team\"",
            "tenant = \"team\"\n        default_class = \"interactive\"",
        );
    if anthropic {
        config = config.replace("apis = [\"chat\"]", "apis = [\"messages\"]");
    }
    let gateway = Running::start(&config).await;
    let start = Instant::now();
    let response = if anthropic {
        gateway
            .post("/v1/messages", Some("caller-secret"), &messages(20))
            .await
    } else {
        gateway
            .post("/v1/chat/completions", Some("caller-secret"), &chat(20))
            .await
    };
    let (status, retry_after, body) = json(response).await;
    let took = start.elapsed();
    gateway.stop().await;
    (status, retry_after, body, took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_provider_pushback_shape_maps_to_429_or_503_with_retry_after() {
    let answers = futures::future::join_all(CASES.iter().map(run)).await;
    for (case, (status, retry_after, body, took)) in CASES.iter().zip(answers) {
        let name = case.name;
        assert_eq!(status, case.answered, "{name}: {body}");
        let error = &body["error"];
        assert_eq!(error["gateway_decision"], "provider", "{name}: {body}");
        assert_eq!(error["type"], case.kind, "{name}: {body}");
        if case.profile == "anthropic" {
            assert_eq!(body["type"], "error", "{name}: {body}");
        } else {
            assert_eq!(error["code"].as_str(), case.code, "{name}: {body}");
        }
        let wait = error["retry_after"].as_f64();
        let wait = wait.unwrap_or_else(|| panic!("{name}: no retry_after: {body}"));
        assert!(wait > 0.0, "{name}: {body}");
        assert_eq!(
            retry_after,
            Some(format!("{}", wait.ceil() as u64)),
            "{name}: the Retry-After header and the body's retry_after differ"
        );
        eprintln!("{name}: {status}, Retry-After {retry_after:?}, answered in {took:.1?}");
    }
}

/// A provider answering every call 429 with its rate-limit headers of `tokens_limit` tokens a
/// minute, none left.
fn learning_case(tokens_limit: &'static str) -> &'static Case {
    let headers: &'static [(&'static str, &'static str)] = Box::leak(Box::new([
        ("retry-after", "1"),
        ("x-ratelimit-limit-requests", "600"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "1s"),
        ("x-ratelimit-limit-tokens", tokens_limit),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "1s"),
    ]));
    Box::leak(Box::new(Case {
        name: "learnt",
        profile: "openai",
        status: 429,
        headers,
        body: OPENAI_429,
        answered: 429,
        kind: "requests",
        code: Some("rate_limit_exceeded"),
    }))
}

/// `config` with its key's requests interactive: the stack gives up within the class's budget
/// of retries (three attempts, eight seconds).
fn interactive(config: &str) -> String {
    config.replace(
        "tenant = \"team\"",
        "tenant = \"team\"\n        default_class = \"interactive\"",
    )
}

/// Posts a chat body for each of `models` in turn: each answer's status and `Retry-After`.
async fn ask(gateway: &Running, models: &[&str]) -> Vec<(u16, Option<String>)> {
    let mut answers = Vec::new();
    for model in models {
        let body = format!(
            r#"{{"model":"{model}","max_tokens":20,"messages":[{{"role":"user","content":"Hi"}}]}}"#
        );
        let start = Instant::now();
        let response = gateway
            .post("/v1/chat/completions", Some("caller-secret"), &body)
            .await;
        let (status, retry_after, body) = json(response).await;
        eprintln!("model {model}: {status} in {:.1?}: {body}", start.elapsed());
        answers.push((status, retry_after));
    }
    answers
}

/// A provider answering every call 429 with its rate-limit headers: the account learns its
/// limits from the first answer, and every request after, for whichever model, is still a
/// 429 with `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_stays_a_429_once_the_account_has_learnt_a_limit() {
    let upstream = serve_case(learning_case("30000")).await;
    let gateway = Running::start(&interactive(&fixed_config(&upstream))).await;
    let answers = ask(&gateway, &["a", "a", "b"]).await;
    gateway.stop().await;
    for (status, retry_after) in answers {
        assert_eq!(status, 429);
        assert!(retry_after.is_some(), "no Retry-After");
    }
}

/// The limit the provider's 429 reports is below the request's cost: the retry the budget
/// then refuses ends with the provider's 429 (before, a 502: "gave up after 2 attempts: the
/// failure is not transient").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_the_learnt_limit_refuses_ends_with_the_providers_429() {
    let upstream = serve_case(learning_case("10")).await;
    let gateway = Running::start(&interactive(&fixed_config(&upstream))).await;
    let answers = ask(&gateway, &["a"]).await;
    gateway.stop().await;
    assert_eq!(answers[0].0, 429);
    assert!(answers[0].1.is_some(), "no Retry-After");
}

/// Who retries, per key: the gateway by default (its attempts, then `x-should-retry: false`),
/// or the caller (`retries = "client"`: one upstream call, the provider's 429 handed back
/// with its `Retry-After`, and nothing telling the SDK not to retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_chooses_who_retries_the_provider() {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = calls.clone();
    let app = axum::Router::new().fallback(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move {
            (
                StatusCode::TOO_MANY_REQUESTS,
                [("content-type", "application/json"), ("retry-after", "1")],
                OPENAI_429,
            )
                .into_response()
        }
    });
    let upstream = crate::support::serve_upstream(app).await;
    let config = interactive(&fixed_config(&upstream)).replace(
        "[[keys]]",
        "[[keys]]\n        name = \"client-key\"\n        key = \"client-secret\"\n        \
         tenant = \"team\"\n        default_class = \"interactive\"\n        retries = \"client\"\n        \
         [[keys]]",
    );
    let gateway = Running::start(&config).await;
    let count = || calls.load(std::sync::atomic::Ordering::SeqCst);
    for (key, upstream_calls, should_retry) in [
        ("caller-secret", 3, Some("false")),
        ("client-secret", 1, None),
    ] {
        let before = count();
        let response = gateway
            .post("/v1/chat/completions", Some(key), &chat(20))
            .await;
        let header = response
            .headers()
            .get("x-should-retry")
            .map(|v| v.to_str().unwrap().to_owned());
        let (status, retry_after, body) = json(response).await;
        assert_eq!(status, 429, "{key}: {body}");
        assert!(retry_after.is_some(), "{key}: no Retry-After");
        assert_eq!(header.as_deref(), should_retry, "{key}");
        assert_eq!(count() - before, upstream_calls, "{key}");
    }
    gateway.stop().await;
}

/// The matrix around the issue's sequence: learnt token limits above and below a request's
/// cost, a provider wait within and beyond the interactive class's retry time, model mixes,
/// and accounts with and without per-model scopes. Every answer is a 429 with `Retry-After`
/// (never a 502), and no request makes more than the class's three upstream calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_learnt_limit_pause_and_model_mix_answers_429() {
    let mut runs = Vec::new();
    for limit in ["10", "30000"] {
        for wait in ["1", "20"] {
            for models in [&["a", "a", "b"][..], &["a", "b", "a", "b"][..]] {
                for scoped in [false, true] {
                    runs.push((limit, wait, models, scoped));
                }
            }
        }
    }
    let answers = futures::future::join_all(runs.iter().map(|&(limit, wait, models, scoped)| {
        async move {
            let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let counted = calls.clone();
            let headers: Vec<(&'static str, String)> = vec![
                ("retry-after", wait.to_owned()),
                ("x-ratelimit-limit-requests", "600".into()),
                ("x-ratelimit-remaining-requests", "0".into()),
                ("x-ratelimit-reset-requests", format!("{wait}s")),
                ("x-ratelimit-limit-tokens", limit.into()),
                ("x-ratelimit-remaining-tokens", "0".into()),
                ("x-ratelimit-reset-tokens", format!("{wait}s")),
            ];
            let app = axum::Router::new().fallback(move || {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let headers = headers.clone();
                async move {
                    let mut response = (
                        StatusCode::TOO_MANY_REQUESTS,
                        [("content-type", "application/json")],
                        OPENAI_429,
                    )
                        .into_response();
                    for (name, value) in headers {
                        response.headers_mut().insert(name, value.parse().unwrap());
                    }
                    response
                }
            });
            let upstream = crate::support::serve_upstream(app).await;
            let mut config = interactive(&fixed_config(&upstream));
            if scoped {
                config = config.replace(
                    "quota = { requests_per_minute = 600, tokens_per_minute = 600000, max_in_flight = 1 }",
                    "quota = { requests_per_minute = 600, max_in_flight = 1 }\n        \
                     model_quota = { requests_per_minute = 600, tokens_per_minute = 600000 }",
                );
            }
            let gateway = Running::start(&config).await;
            let mut answers = Vec::new();
            for model in models {
                let before = calls.load(std::sync::atomic::Ordering::SeqCst);
                let (status, retry_after) = ask(&gateway, &[model]).await[0].clone();
                let made = calls.load(std::sync::atomic::Ordering::SeqCst) - before;
                answers.push((status, retry_after, made));
            }
            gateway.stop().await;
            answers
        }
    }))
    .await;
    for (run, answers) in runs.iter().zip(answers) {
        for (status, retry_after, made) in answers {
            assert_eq!(status, 429, "{run:?}");
            assert!(retry_after.is_some(), "{run:?}: no Retry-After");
            assert!(made <= 3, "{run:?}: {made} upstream calls for one request");
        }
    }
}
