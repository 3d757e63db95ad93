//! The official Python SDKs (`openai`, `anthropic`) against the gateway binary: chat
//! completions and messages, streamed and not, with usage; the models each key may use; and
//! the errors each SDK raises for the gateway's refusals (an unknown key, a request without a
//! model, an unknown model, a tenant over its limit, whose `Retry-After` the SDK's own retry
//! honours, a paused tenant, a provider's 429 and how many upstream calls it costs, a stream
//! the provider cut, Anthropic's 529), embeddings and token counting, and a flex request
//! falling back to the standard tier.
//! `sdk_conformance.py` holds the checks.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdks_speak_to_the_gateway() {
    let Some(python) = crate::support::sdk_python("openai, anthropic") else {
        return;
    };
    let upstream = pushback_upstream().await;
    let gateway = Binary::start(&config(&upstream), None);
    let env = vec![
        ("GATEWAY_URL", gateway.url.clone()),
        ("UPSTREAM_URL", upstream.clone()),
        ("SEARCH_KEY", SEARCH.to_owned()),
        ("REPORTS_KEY", REPORTS.to_owned()),
        ("GLOBEX_KEY", GLOBEX.to_owned()),
        ("ADMIN_TOKEN", ADMIN.to_owned()),
    ];
    crate::support::run_sdk_checks(python, "sdk_conformance.py", env, 21).await;
    drop(gateway);
}
