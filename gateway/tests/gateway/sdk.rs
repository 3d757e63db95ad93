//! The official Python SDKs (`openai`, `anthropic`) against the gateway binary: chat
//! completions and messages, streamed and not, with usage; the models each key may use; and
//! the errors each SDK raises for the gateway's refusals (an unknown key, a request without a
//! model, an unknown model, a tenant over its limit, whose `Retry-After` the SDK's own retry
//! honours, a paused tenant, a provider's 429 and how many upstream calls it costs, a stream
//! the provider cut, Anthropic's 529), embeddings and token counting, and a flex request
//! falling back to the standard tier.
//! `sdk_conformance.py` holds the checks.

use std::process::Command;

use futures::StreamExt;

use axum::response::IntoResponse;
use bytes::Bytes;
use http::StatusCode;

use crate::support::{ADMIN, Binary, GLOBEX, REPORTS, SEARCH, demo};

/// An OpenAI-style upstream that always answers 429 for the model `always-limited` (counting
/// those calls, read at `GET /calls`), and cuts the stream of `cut-stream` after two events;
/// Anthropic's 529 `overloaded_error` for `overloaded-claude`; flex without capacity for
/// `flex-model`.
async fn pushback_upstream() -> String {
    let limited = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = limited.clone();
    let calls = axum::routing::get(move || {
        let counted = counted.clone();
        async move {
            counted
                .load(std::sync::atomic::Ordering::SeqCst)
                .to_string()
        }
    });
    let app = axum::Router::new().route("/calls", calls).fallback(move |uri: http::Uri, body: Bytes| async move {
        let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let json = |body: &'static str| {
            ([("content-type", "application/json")], body).into_response()
        };
        match uri.path() {
            "/v1/embeddings" => {
                return json(
                    r#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]},{"object":"embedding","index":1,"embedding":[0.3,0.4]}],"model":"embed-model","usage":{"prompt_tokens":4,"total_tokens":4}}"#,
                );
            }
            "/v1/messages/count_tokens" => return json(r#"{"input_tokens":12}"#),
            _ => {}
        }
        if request["model"] == "overloaded-claude" {
            let error = r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
            return (
                StatusCode::from_u16(529).unwrap(),
                [("content-type", "application/json")],
                error,
            )
                .into_response();
        }
        if request["model"] == "flex-model" {
            // The flex tier has no capacity; the standard tier answers, naming itself.
            if request["service_tier"] == "flex" {
                let error = r#"{"error":{"message":"Resource Unavailable","type":"resource_unavailable","param":null,"code":"resource_unavailable"}}"#;
                return (
                    StatusCode::TOO_MANY_REQUESTS,
                    [("content-type", "application/json")],
                    error,
                )
                    .into_response();
            }
            let answer = r#"{"id":"c","object":"chat.completion","created":0,"model":"flex-model","service_tier":"default","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":8,"completion_tokens":2,"total_tokens":10}}"#;
            return ([("content-type", "application/json")], answer).into_response();
        }
        let body = String::from_utf8_lossy(&body);
        if body.contains("always-limited") {
            limited.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let error = r#"{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
            return (
                StatusCode::TOO_MANY_REQUESTS,
                [("content-type", "application/json"), ("retry-after", "1")],
                error,
            )
                .into_response();
        }
        let events = [
            r#"data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"cut-stream","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"}}]}"#,
            r#"data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"cut-stream","choices":[{"index":0,"delta":{"content":"lo"}}]}"#,
        ];
        let frames = futures::stream::iter(events)
            .map(|event| Ok::<_, std::io::Error>(Bytes::from(format!("{event}\n\n"))))
            .chain(futures::stream::once(async {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                Err(std::io::Error::other("the provider cut the stream"))
            }));
        (
            [("content-type", "text/event-stream")],
            axum::body::Body::from_stream(frames),
        )
            .into_response()
    });
    crate::support::serve_upstream(app).await
}

/// The demo, with two more accounts in front of [`pushback_upstream`] (an OpenAI one and an
/// Anthropic one) serving its models.
fn config(upstream: &str) -> String {
    let account = format!(
        r#"
[[accounts]]
name = "pushback"
base_url = "{upstream}"
key = "sk-pushback"
profile = "openai"
apis = ["chat", "embeddings"]
quota = {{ requests_per_minute = 600, tokens_per_minute = 600000 }}

[[models]]
name = "embed-model"
account = "pushback"

[[models]]
name = "always-limited"
account = "pushback"

[[models]]
name = "cut-stream"
account = "pushback"

[[accounts]]
name = "pushback-anthropic"
base_url = "{upstream}"
key = "sk-pushback-anthropic"
profile = "anthropic"
apis = ["messages", "count_tokens"]
quota = {{ requests_per_minute = 600, input_tokens_per_minute = 600000, output_tokens_per_minute = 100000 }}

[[models]]
name = "overloaded-claude"
account = "pushback-anthropic"

[[models]]
name = "flex-model"
account = "pushback"
fallbacks = [{{ account = "pushback", service_tier = "default", on = ["tier_unavailable"], classes = ["interactive"] }}]
"#
    );
    let demo = demo();
    let at = demo.find("[tenants]").expect("the demo has a tenant tree");
    format!("{}{account}\n{}", &demo[..at], &demo[at..])
}

/// A Python that imports both SDKs: `SDK_PYTHON` (`.ci/run` sets it to the virtual
/// environment it installs them in, and `SDK_REQUIRED`), else `python3` if it has them.
fn python() -> Option<String> {
    let candidates = std::env::var("SDK_PYTHON")
        .into_iter()
        .chain(["python3".into()]);
    candidates.into_iter().find(|python| {
        Command::new(python)
            .args(["-c", "import openai, anthropic"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdks_speak_to_the_gateway() {
    let Some(python) = python() else {
        // `.ci/run` installs them: there, a missing SDK is a failure, not a skip.
        assert!(
            std::env::var_os("SDK_REQUIRED").is_none(),
            "SDK_REQUIRED is set but no Python imports `openai` and `anthropic`"
        );
        println!(
            "skipped: no Python with the `openai` and `anthropic` packages (set SDK_PYTHON; \
             `.ci/run` installs them in a virtual environment)"
        );
        return;
    };
    let upstream = pushback_upstream().await;
    let gateway = Binary::start(&config(&upstream), None);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/gateway/sdk_conformance.py"
    );
    let url = gateway.url.clone();
    let upstream_url = upstream.clone();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .env("GATEWAY_URL", url)
            .env("UPSTREAM_URL", upstream_url)
            .env("SEARCH_KEY", SEARCH)
            .env("REPORTS_KEY", REPORTS)
            .env("GLOBEX_KEY", GLOBEX)
            .env("ADMIN_TOKEN", ADMIN)
            .output()
    })
    .await
    .unwrap()
    .expect("the Python interpreter runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "the SDKs' checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(stdout.lines().filter(|l| l.starts_with("ok ")).count(), 21);
    drop(gateway);
}
