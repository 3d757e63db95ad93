//! Service tiers through the gateway: a caller's `service_tier` passes to the provider; the
//! tier that served a request is read from the answer and counted with the tenant's usage;
//! OpenAI flex's 429 "Resource Unavailable" (not billed) falls back at once to the standard
//! tier for interactive work, is retried on flex later for batch work, and is handed back as a
//! 429 naming the tier where neither applies, as each account's policy says per class.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::response::IntoResponse;
use http::StatusCode;
use serde_json::Value;

use crate::support::{Running, json};

const UNAVAILABLE: &str = r#"{"error":{"message":"Resource Unavailable: the flex tier has no capacity for this request now, and you were not charged.","type":"resource_unavailable","param":null,"code":"resource_unavailable"}}"#;

/// What the upstream saw: flex calls, other calls, and how many flex calls it still refuses.
#[derive(Debug, Default)]
struct Upstream {
    flex: AtomicUsize,
    other: AtomicUsize,
    refuse_flex: AtomicUsize,
}

/// An OpenAI-style upstream: a flex request is refused (429 "Resource Unavailable") while
/// `refuse_flex` lasts, then served at flex; any other request is served at `default`. Each
/// answer names its tier and its usage (10 tokens).
async fn upstream(refuse_flex: usize) -> (String, Arc<Upstream>) {
    let seen = Arc::new(Upstream::default());
    seen.refuse_flex.store(refuse_flex, Ordering::SeqCst);
    let state = seen.clone();
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
        let state = state.clone();
        async move {
            let request: Value = serde_json::from_slice(&body).unwrap_or_default();
            let flex = request["service_tier"] == "flex";
            let tier = if flex {
                state.flex.fetch_add(1, Ordering::SeqCst);
                let left = state.refuse_flex.load(Ordering::SeqCst);
                if left > 0 {
                    state.refuse_flex.store(left - 1, Ordering::SeqCst);
                    return (
                        StatusCode::TOO_MANY_REQUESTS,
                        [("content-type", "application/json")],
                        UNAVAILABLE,
                    )
                        .into_response();
                }
                "flex"
            } else {
                state.other.fetch_add(1, Ordering::SeqCst);
                "default"
            };
            let body = format!(
                r#"{{"id":"c","object":"chat.completion","model":"m","service_tier":"{tier}","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":8,"completion_tokens":2,"total_tokens":10,"prompt_tokens_details":{{"cached_tokens":6}}}}}}"#
            );
            ([("content-type", "application/json")], body).into_response()
        }
    });
    (crate::support::serve_upstream(app).await, seen)
}

/// One account over `url` serving model `m` (with a fallback to the standard tier for
/// interactive work) and model `plain` (none); an interactive key and a batch key.
fn config(url: &str, account_extra: &str) -> String {
    format!(
        r#"
        [server]
        admin_token = "admin"
        [[accounts]]
        name = "main"
        base_url = "{url}"
        key = "sk-upstream"
        profile = "openai"
        apis = ["chat"]
        quota = {{ requests_per_minute = 6000, tokens_per_minute = 1000000 }}
        {account_extra}
        [[models]]
        name = "m"
        account = "main"
        fallbacks = [{{ account = "main", service_tier = "default", on = ["tier_unavailable"], classes = ["interactive"] }}]
        [[models]]
        name = "plain"
        account = "main"
        [[keys]]
        name = "web"
        key = "interactive-secret"
        tenant = "team"
        default_class = "interactive"
        [[keys]]
        name = "nightly"
        key = "batch-secret"
        tenant = "team"
        default_class = "batch"
        "#
    )
}

/// Asks for `model` at flex with `key`: the status, the route headers, the body.
async fn flex(gateway: &Running, model: &str, key: &str) -> (u16, [Option<String>; 2], Value) {
    let body = format!(
        r#"{{"model":"{model}","service_tier":"flex","max_tokens":20,"messages":[{{"role":"user","content":"Hi"}}]}}"#
    );
    let response = gateway.post("/v1/chat/completions", Some(key), &body).await;
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let headers = [header("x-llm-quota-route"), header("x-llm-quota-fallback")];
    let (status, _, body) = json(response).await;
    eprintln!("{model} at flex with {key}: {status} {headers:?} {body}");
    (status, headers, body)
}

/// Interactive work falls back at once to the standard tier; batch work waits for flex; the
/// tenant's usage counts the tokens of each tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_without_capacity_falls_back_for_interactive_and_waits_for_batch() {
    let (url, seen) = upstream(1).await;
    let audit = std::env::temp_dir().join(format!("audit-flex-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&audit);
    let config = config(&url, "").replace(
        "admin_token = \"admin\"",
        &format!(
            "admin_token = \"admin\"\n        audit_log = {:?}",
            audit.display().to_string()
        ),
    );
    let gateway = Running::start(&config).await;
    let (status, [route, fallback], body) = flex(&gateway, "m", "interactive-secret").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["service_tier"], "default");
    assert_eq!(route.as_deref(), Some("main@default"));
    assert_eq!(fallback.as_deref(), Some("tier_unavailable"));
    assert_eq!(
        (
            seen.flex.load(Ordering::SeqCst),
            seen.other.load(Ordering::SeqCst)
        ),
        (1, 1)
    );
    // Its audit line counts both upstream calls (the flex one, then the fallback's).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let line = loop {
        let text = std::fs::read_to_string(&audit).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("tier_unavailable")) {
            break serde_json::from_str::<Value>(line).unwrap();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no audit line: {text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    assert_eq!(line["attempts"], 2, "{line}");
    assert_eq!(line["fallback"], "tier_unavailable", "{line}");
    // Batch: flex refuses three more times; the gateway keeps to flex until it answers.
    seen.refuse_flex.store(3, Ordering::SeqCst);
    let (status, [route, fallback], body) = flex(&gateway, "m", "batch-secret").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["service_tier"], "flex");
    assert_eq!((route.as_deref(), fallback), (Some("main"), None));
    assert_eq!(
        (
            seen.flex.load(Ordering::SeqCst),
            seen.other.load(Ordering::SeqCst)
        ),
        (5, 1),
        "batch work was sent at the standard tier"
    );
    // The tenant's usage by tier: 10 tokens at each.
    let (_, status) = gateway.get("/status.json").await;
    let status: Value = serde_json::from_str(&status).unwrap();
    let team = status["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["path"] == "team")
        .unwrap();
    assert_eq!(
        team["usage"]["tokens_by_tier"],
        serde_json::json!({"flex": 10, "standard": 10}),
        "{team}"
    );
    let metrics = gateway.get("/metrics").await.1;
    assert!(
        metrics.contains(r#"service_tier="flex""#),
        "no flex tokens in /metrics"
    );
    // Each answer read 6 of its 8 input tokens from the prompt cache: 12 for the two (the
    // process's other tests of this upstream add theirs).
    let cache_reads: u64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix(r#"gateway_cache_read_tokens_total{tenant="team"} "#))
        .unwrap_or_else(|| panic!("no cache reads in /metrics:\n{metrics}"))
        .parse()
        .unwrap();
    assert!(cache_reads >= 12 && cache_reads % 6 == 0, "{cache_reads}");
    gateway.stop().await;
}

/// Without a fallback, interactive work gets the provider's 429 at once, naming the tier
/// (one upstream call, not billed, nothing paused); an account may choose to retry instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_fallback_interactive_work_fails_fast_unless_its_policy_retries() {
    let (url, seen) = upstream(usize::MAX).await;
    let gateway = Running::start(&config(&url, "")).await;
    let (status, _, body) = flex(&gateway, "plain", "interactive-secret").await;
    assert_eq!(status, 429, "{body}");
    let error = &body["error"];
    assert_eq!(error["limit"], "service_tier", "{body}");
    assert_eq!(error["gateway_decision"], "provider", "{body}");
    assert_eq!(seen.flex.load(Ordering::SeqCst), 1);
    // Another request goes at once: a tier without capacity pauses nobody.
    let response = gateway
        .post(
            "/v1/chat/completions",
            Some("interactive-secret"),
            r#"{"model":"plain","max_tokens":20,"messages":[{"role":"user","content":"Hi"}]}"#,
        )
        .await;
    assert_eq!(response.status(), 200);
    gateway.stop().await;

    let (url, seen) = upstream(1).await;
    let policy = r#"tier_unavailable = { interactive = "retry" }"#;
    let gateway = Running::start(&config(&url, policy)).await;
    let (status, _, body) = flex(&gateway, "plain", "interactive-secret").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["service_tier"], "flex");
    assert_eq!(seen.flex.load(Ordering::SeqCst), 2);
    gateway.stop().await;
}
