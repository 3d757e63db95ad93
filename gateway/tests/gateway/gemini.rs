//! Gemini accounts: Google's native API as its SDKs call it (the model and method in the
//! path, the key in `x-goog-api-key` or `?key=`), admitted and settled as the other providers'
//! requests, Google's pushback (`RESOURCE_EXHAUSTED` with `RetryInfo`, `UNAVAILABLE`) and
//! Google's error shape; Gemini's OpenAI-compatible endpoint as a fallback of an OpenAI
//! model; the official `google-genai` SDK (`gemini_sdk.py`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::response::IntoResponse;
use bytes::Bytes;
use http::StatusCode;
use serde_json::{Value, json};

use crate::audit::{lines, log_file};
use crate::support::{Binary, Running, serve_upstream};
use tower_llm_quota_gateway::Config;

/// A gateway with one Gemini account on the in-process simulator, two public models on it,
/// and one key.
fn sim_config(audit: &std::path::Path) -> String {
    format!(
        r#"
        [server]
        admin_token = "admin"
        audit_log = "{}"
        [[accounts]]
        name = "gemini-sim"
        base_url = "sim"
        key = "g-upstream"
        profile = "gemini"
        apis = ["generate_content", "embed_content", "gemini_count_tokens"]
        quota = {{ requests_per_minute = 600, input_tokens_per_minute = 1000000, requests_per_day = 10000 }}
        [[models]]
        name = "gemini-2.5-flash"
        account = "gemini-sim"
        [[models]]
        name = "text-embedding-004"
        account = "gemini-sim"
        [[keys]]
        name = "team-key"
        key = "caller-secret"
        tenant = "team"
        "#,
        audit.display()
    )
}

async fn google(
    gateway: &Running,
    path: &str,
    header_key: Option<&str>,
    body: &str,
) -> reqwest::Response {
    let mut request = reqwest::Client::new()
        .post(format!("{}{path}", gateway.url))
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(key) = header_key {
        request = request.header("x-goog-api-key", key);
    }
    request.send().await.unwrap()
}

/// A response's body as JSON.
async fn read<T: serde::de::DeserializeOwned>(response: reqwest::Response) -> T {
    serde_json::from_slice(&response.bytes().await.unwrap()).unwrap()
}

const ASK: &str = r#"{"contents":[{"role":"user","parts":[{"text":"Hello there"}]}],
    "systemInstruction":{"parts":[{"text":"Be brief."}]},
    "generationConfig":{"maxOutputTokens":24}}"#;

/// Every native method through the simulator, with the key in the header or the query, the
/// usage settled from `usageMetadata`, and Google's error shape for refusals.
#[tokio::test]
async fn the_native_api_is_served_with_its_keys_usage_and_errors() {
    let audit = log_file("gemini-native");
    let gateway = Running::start(&sim_config(&audit)).await;
    let path = |method: &str| format!("/v1beta/models/gemini-2.5-flash:{method}");

    let answer = google(
        &gateway,
        &path("generateContent"),
        Some("caller-secret"),
        ASK,
    )
    .await;
    assert_eq!(answer.status(), 200);
    let answer: Value = read(answer).await;
    assert_eq!(answer["candidates"][0]["content"]["role"], "model");
    let output = answer["usageMetadata"]["candidatesTokenCount"]
        .as_u64()
        .unwrap();
    assert!((1..=24).contains(&output), "{answer}");

    // A stream as events (the SDKs' `alt=sse`), the key in the query.
    let events = google(
        &gateway,
        &format!(
            "{}?alt=sse&key=caller-secret",
            path("streamGenerateContent")
        ),
        None,
        ASK,
    )
    .await;
    assert_eq!(events.status(), 200);
    assert!(
        events.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = events.text().await.unwrap();
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    assert!(chunks.len() > 1, "{text}");
    assert_eq!(
        chunks.last().unwrap()["candidates"][0]["finishReason"],
        "STOP"
    );
    let events_output = chunks.last().unwrap()["usageMetadata"]["candidatesTokenCount"].clone();
    // And as one JSON array.
    let array = google(
        &gateway,
        &path("streamGenerateContent"),
        Some("caller-secret"),
        ASK,
    )
    .await;
    let chunks: Vec<Value> = read(array).await;
    let array_output = chunks.last().unwrap()["usageMetadata"]["candidatesTokenCount"].clone();
    assert!(array_output.as_u64() > Some(0));

    let count = google(&gateway, &path("countTokens"), Some("caller-secret"), ASK).await;
    assert_eq!(count.status(), 200);
    let count: Value = read(count).await;
    assert!(count["totalTokens"].as_u64().unwrap() > 0, "{count}");

    let embed = |method: &'static str, body: &'static str| {
        let gateway = &gateway;
        async move {
            let path = format!("/v1beta/models/text-embedding-004:{method}");
            let response = google(gateway, &path, Some("caller-secret"), body).await;
            assert_eq!(response.status(), 200);
            read::<Value>(response).await
        }
    };
    let one = embed(
        "embedContent",
        r#"{"content":{"parts":[{"text":"a cat"}]}}"#,
    )
    .await;
    assert_eq!(one["embedding"]["values"].as_array().unwrap().len(), 8);
    let batch = embed(
        "batchEmbedContents",
        r#"{"requests":[{"content":{"parts":[{"text":"a"}]}},{"content":{"parts":[{"text":"b"}]}}]}"#,
    )
    .await;
    assert_eq!(batch["embeddings"].as_array().unwrap().len(), 2);

    // The models this key may use, in Google's shape.
    let (status, list) = gateway.get("/v1beta/models?key=caller-secret").await;
    assert_eq!(status, 200);
    let list: Value = serde_json::from_str(&list).unwrap();
    let names: Vec<&str> = list["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["models/gemini-2.5-flash", "models/text-embedding-004"]
    );
    let methods = &list["models"][0]["supportedGenerationMethods"];
    assert!(
        methods
            .as_array()
            .unwrap()
            .contains(&json!("streamGenerateContent"))
    );
    let (status, one) = gateway
        .get("/v1beta/models/gemini-2.5-flash?key=caller-secret")
        .await;
    assert_eq!(status, 200, "{one}");

    // Refusals in Google's shape.
    let google_error = |status: u16, name: &str| {
        let name = name.to_owned();
        move |body: Value| {
            assert_eq!(body["error"]["code"], status, "{body}");
            assert_eq!(body["error"]["status"], name.as_str(), "{body}");
            assert!(body["error"]["message"].as_str().is_some(), "{body}");
            assert_eq!(
                body["error"]["details"][0]["@type"],
                "type.googleapis.com/google.rpc.ErrorInfo"
            );
        }
    };
    let unknown_key = google(&gateway, &path("generateContent"), Some("nope"), ASK).await;
    assert_eq!(unknown_key.status(), 401);
    google_error(401, "UNAUTHENTICATED")(read(unknown_key).await);
    let unknown_model = google(
        &gateway,
        "/v1beta/models/gemini-9:generateContent",
        Some("caller-secret"),
        ASK,
    )
    .await;
    assert_eq!(unknown_model.status(), 404);
    google_error(404, "NOT_FOUND")(read(unknown_model).await);
    let no_contents = google(
        &gateway,
        &path("generateContent"),
        Some("caller-secret"),
        "{}",
    )
    .await;
    assert_eq!(no_contents.status(), 400);
    google_error(400, "INVALID_ARGUMENT")(read(no_contents).await);
    let no_method = google(
        &gateway,
        "/v1beta/models/gemini-2.5-flash:explode",
        Some("caller-secret"),
        ASK,
    )
    .await;
    assert_eq!(no_method.status(), 404);

    // Settled with the answer's usage, as the audit line says.
    let lines = lines(&audit, 3).await;
    let first = &lines[0];
    assert_eq!(first["api"], "generate_content", "{first}");
    assert_eq!(first["provider"], "gemini", "{first}");
    assert_eq!(first["model"], "gemini-2.5-flash", "{first}");
    assert_eq!(first["estimated"]["output"], 24, "{first}");
    assert_eq!(first["used"]["output"], output, "{first}");
    assert!(first["used"]["input"].as_u64().unwrap() > 0, "{first}");
    // Both stream forms settled with their last chunk's usage.
    assert_eq!(lines[1]["used"]["output"], events_output, "{}", lines[1]);
    assert_eq!(lines[2]["used"]["output"], array_output, "{}", lines[2]);
    gateway.stop().await;
}

/// What a fake Gemini upstream saw: each call's path and query, and its key header.
#[derive(Debug, Default)]
struct Seen {
    calls: Vec<(String, Option<String>)>,
}

/// A fake upstream in Gemini's wire format: `thinker` answers with thinking and cached
/// tokens; `always-limited` answers 429 `RESOURCE_EXHAUSTED` (retry in 30 s, its
/// `QuotaFailure` naming the model); `flaky` answers 503 `UNAVAILABLE` every other call.
async fn google_upstream() -> (String, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let record = seen.clone();
    let flaky = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = axum::Router::new().fallback(
        move |uri: http::Uri, headers: http::HeaderMap, _body: Bytes| {
            let (record, flaky) = (record.clone(), flaky.clone());
            async move {
                let key = headers
                    .get("x-goog-api-key")
                    .map(|k| k.to_str().unwrap().to_owned());
                let target = uri.path_and_query().unwrap().to_string();
                record.lock().unwrap().calls.push((target, key));
                let json = |status: StatusCode, body: Value| {
                    (status, [("content-type", "application/json")], body.to_string())
                        .into_response()
                };
                let path = uri.path();
                if path.contains("always-limited") {
                    return json(
                        StatusCode::TOO_MANY_REQUESTS,
                        json!({"error": {"code": 429, "status": "RESOURCE_EXHAUSTED",
                            "message": "You exceeded your current quota. Please retry in 30s.",
                            "details": [
                              {"@type": "type.googleapis.com/google.rpc.QuotaFailure",
                               "violations": [{
                                 "quotaMetric": "generativelanguage.googleapis.com/generate_content_requests",
                                 "quotaId": "GenerateRequestsPerMinutePerProjectPerModel",
                                 "quotaDimensions": {"location": "global", "model": "always-limited"},
                                 "quotaValue": "10"}]},
                              {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "30s"}]}}),
                    );
                }
                if path.contains("flaky")
                    && flaky.fetch_add(1, std::sync::atomic::Ordering::SeqCst) % 2 == 0
                {
                    return json(
                        StatusCode::SERVICE_UNAVAILABLE,
                        json!({"error": {"code": 503, "status": "UNAVAILABLE",
                            "message": "The model is overloaded. Please try again later."}}),
                    );
                }
                let mut answer = json(
                    StatusCode::OK,
                    json!({
                        "candidates": [{"content": {"parts": [{"text": "Thought about it."}],
                                        "role": "model"}, "finishReason": "STOP", "index": 0}],
                        "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5,
                                          "thoughtsTokenCount": 20, "cachedContentTokenCount": 4,
                                          "totalTokenCount": 35},
                        "modelVersion": "thinker"
                    }),
                );
                // The tier that served it, as Google names it.
                answer.headers_mut().insert(
                    "x-gemini-service-tier",
                    http::HeaderValue::from_static("flex"),
                );
                answer
            }
        },
    );
    (serve_upstream(app).await, seen)
}

fn upstream_config(upstream: &str, audit: &std::path::Path) -> String {
    format!(
        r#"
        [server]
        admin_token = "admin"
        audit_log = "{}"
        [[accounts]]
        name = "google"
        base_url = "{upstream}"
        key = "upstream-secret"
        profile = "gemini"
        apis = ["generate_content"]
        quota = {{ requests_per_minute = 600 }}
        model_quota = {{ requests_per_minute = 100, input_tokens_per_minute = 100000, requests_per_day = 1000 }}
        [[keys]]
        name = "team-key"
        key = "caller-secret"
        tenant = "team"
        default_class = "interactive"
        "#,
        audit.display()
    )
}

/// Thinking tokens settle as output; a 429 `RESOURCE_EXHAUSTED` pauses its model's scope for
/// its `retryDelay` and reaches the caller in Google's shape with `Retry-After`, the next
/// request for that model refused without a call while another model is served; a 503
/// `UNAVAILABLE` is retried; the caller's key never goes upstream, the account's does.
#[tokio::test]
async fn google_pushback_pauses_the_model_it_names_and_thinking_counts_as_output() {
    let (upstream, seen) = google_upstream().await;
    let audit = log_file("gemini-pushback");
    let gateway = Running::start(&upstream_config(&upstream, &audit)).await;
    let call = |model: &str, query: &str| {
        let path = format!("/v1beta/models/{model}:generateContent{query}");
        let gateway = &gateway;
        async move { google(gateway, &path, None, ASK).await }
    };

    let thought = call("thinker", "?key=caller-secret").await;
    assert_eq!(thought.status(), 200);
    thought.bytes().await.unwrap();
    let line = &lines(&audit, 1).await[0];
    assert_eq!(line["used"]["input"], 10, "{line}");
    assert_eq!(line["used"]["output"], 25, "thinking is output: {line}");
    assert_eq!(line["service_tier"], "flex", "the tier is read: {line}");

    let limited = call("always-limited", "?key=caller-secret").await;
    assert_eq!(limited.status(), 429);
    let retry_after: u64 = limited.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (29..=30).contains(&retry_after),
        "Retry-After {retry_after}"
    );
    let body: Value = read(limited).await;
    assert_eq!(body["error"]["status"], "RESOURCE_EXHAUSTED", "{body}");
    let details = body["error"]["details"].as_array().unwrap();
    assert!(
        details
            .iter()
            .any(|d| d["@type"] == "type.googleapis.com/google.rpc.RetryInfo"),
        "{body}"
    );
    assert_eq!(
        details[0]["metadata"]["gateway_decision"], "provider",
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("GenerateRequestsPerMinutePerProjectPerModel"),
        "the provider's quota is named: {body}"
    );
    let calls = |model: &str| {
        let seen = seen.lock().unwrap();
        seen.calls
            .iter()
            .filter(|(path, _)| path.contains(model))
            .count()
    };
    let limited_calls = calls("always-limited");
    // Paused: refused here, at once, with the wait left; another model goes on.
    let again = call("always-limited", "?key=caller-secret").await;
    assert_eq!(again.status(), 429);
    let body: Value = read(again).await;
    assert_eq!(
        body["error"]["details"][0]["metadata"]["gateway_decision"], "local",
        "{body}"
    );
    assert_eq!(
        calls("always-limited"),
        limited_calls,
        "no call while paused"
    );
    assert_eq!(call("thinker", "?key=caller-secret").await.status(), 200);

    // A 503 is transient: retried, then served.
    assert_eq!(call("flaky", "?key=caller-secret").await.status(), 200);
    assert_eq!(calls("flaky"), 2);

    let calls = std::mem::take(&mut seen.lock().unwrap().calls);
    for (path, key) in &calls {
        assert_eq!(key.as_deref(), Some("upstream-secret"), "{path}");
        assert!(
            !path.contains("key="),
            "the caller's key went upstream: {path}"
        );
        assert!(path.starts_with("/v1beta/models/"), "{path}");
    }
    gateway.stop().await;
}

/// A chat model on an OpenAI account falls back to Gemini's OpenAI-compatible endpoint
/// (`/v1beta/openai/chat/completions`) when the primary would make it wait, and comes back
/// to the primary once it has room again.
#[tokio::test]
async fn a_chat_model_falls_back_to_gemini_through_its_openai_endpoint_and_back() {
    let paths = Arc::new(Mutex::new(Vec::<String>::new()));
    let record = paths.clone();
    let app = axum::Router::new().fallback(move |uri: http::Uri, headers: http::HeaderMap| {
        let record = record.clone();
        async move {
            let bearer = headers["authorization"].to_str().unwrap().to_owned();
            record
                .lock()
                .unwrap()
                .push(format!("{} {bearer}", uri.path()));
            let answer = json!({"id": "g", "object": "chat.completion", "created": 0,
                "model": "gemini-2.5-flash",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}});
            ([("content-type", "application/json")], answer.to_string())
        }
    });
    let google = serve_upstream(app).await;
    let config = format!(
        r#"
        [server]
        admin_token = "admin"
        [[accounts]]
        name = "openai"
        base_url = "sim"
        key = "o-upstream"
        profile = "openai"
        apis = ["chat"]
        quota = {{ requests_per_minute = 2, minute_ms = 1500, tokens_per_minute = 1000000 }}
        [[accounts]]
        name = "gemini-compat"
        base_url = "{google}"
        key = "g-upstream"
        profile = "gemini_openai"
        apis = ["chat"]
        quota = {{ requests_per_minute = 600, tokens_per_minute = 1000000 }}
        [[models]]
        name = "smart"
        account = "openai"
        model = "gpt-4o-mini"
        fallbacks = [{{ account = "gemini-compat", model = "gemini-2.5-flash", on = ["would_wait"], would_wait_seconds = 0.05 }}]
        [[keys]]
        name = "team-key"
        key = "caller-secret"
        tenant = "team"
        default_class = "interactive"
        "#
    );
    let gateway = Running::start(&config).await;
    let body = r#"{"model":"smart","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;
    let route = || async {
        let response = gateway
            .post("/v1/chat/completions", Some("caller-secret"), body)
            .await;
        assert_eq!(response.status(), 200);
        response.headers()["x-llm-quota-route"]
            .to_str()
            .unwrap()
            .to_owned()
    };
    // The primary's burst, then Gemini.
    assert_eq!(route().await, "openai:gpt-4o-mini");
    let mut routes = Vec::new();
    while routes.last().is_none_or(|r| r == "openai:gpt-4o-mini") {
        routes.push(route().await);
        assert!(routes.len() <= 3, "{routes:?}");
    }
    assert_eq!(routes.last().unwrap(), "gemini-compat:gemini-2.5-flash");
    assert_eq!(
        paths.lock().unwrap().as_slice(),
        ["/v1beta/openai/chat/completions Bearer g-upstream"]
    );
    // Back on the primary once it refills (a request every 0.75 s of its "minute").
    let back = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if route().await == "openai:gpt-4o-mini" {
            break;
        }
        assert!(
            tokio::time::Instant::now() < back,
            "never back on the primary"
        );
    }
    gateway.stop().await;
}

/// A route between formats the gateway cannot translate, or an account serving an API its
/// profile does not speak, is a configuration error naming the reason.
#[test]
fn routes_and_apis_across_formats_are_configuration_errors() {
    let config = |profile: &str, apis: &str| {
        format!(
            r#"
            [server]
            admin_token = "admin"
            [[accounts]]
            name = "openai"
            base_url = "sim"
            profile = "openai"
            apis = ["chat"]
            quota = {{ requests_per_minute = 10 }}
            [[accounts]]
            name = "google"
            base_url = "sim"
            profile = "{profile}"
            apis = {apis}
            quota = {{ requests_per_minute = 10 }}
            [[models]]
            name = "smart"
            account = "openai"
            fallbacks = [{{ account = "google", on = ["rate_limited"] }}]
            [[keys]]
            name = "k"
            key = "k"
            tenant = "team"
            "#
        )
    };
    let error = Config::from_toml(&config("gemini", r#"["generate_content"]"#))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        error.contains("the fallback account `google` speaks Gemini's native API")
            && error.contains("translates no format")
            && error.contains("gemini_openai"),
        "{error}"
    );
    let error = Config::from_toml(&config("gemini", r#"["chat"]"#))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        error.contains(
            "account `google`: its profile speaks Gemini's native API and cannot serve `chat`"
        ),
        "{error}"
    );
    let compatible = Config::from_toml(&config("gemini_openai", r#"["chat"]"#));
    assert!(
        compatible.is_ok(),
        "{:?}",
        compatible.err().map(|e| e.to_string())
    );
}

/// Google's official Python SDK (`google-genai`) against the gateway binary: generate,
/// stream, count tokens, embed, list and get models; a provider's 429 raised as the SDK's
/// own `ClientError` (code 429) and the SDK's retries not multiplying upstream calls.
/// `gemini_sdk.py` holds the checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn googles_sdk_speaks_to_the_gateway() {
    let Some(python) = crate::support::sdk_python("google.genai") else {
        return;
    };
    let (upstream, seen) = google_upstream().await;
    let config = format!(
        r#"
        [server]
        admin_token = "admin"
        [[accounts]]
        name = "gemini-sim"
        base_url = "sim"
        key = "g-upstream"
        profile = "gemini"
        apis = ["generate_content", "embed_content", "gemini_count_tokens"]
        quota = {{ requests_per_minute = 600, input_tokens_per_minute = 1000000 }}
        [[accounts]]
        name = "google"
        base_url = "{upstream}"
        key = "upstream-secret"
        profile = "gemini"
        apis = ["generate_content"]
        quota = {{ requests_per_minute = 600, input_tokens_per_minute = 1000000 }}
        [[models]]
        name = "gemini-2.5-flash"
        account = "gemini-sim"
        [[models]]
        name = "text-embedding-004"
        account = "gemini-sim"
        [[models]]
        name = "always-limited"
        account = "google"
        [[keys]]
        name = "team-key"
        key = "caller-secret"
        tenant = "team"
        default_class = "interactive"
        "#
    );
    let gateway = Binary::start(&config, None);
    let calls = axum::Router::new().route(
        "/calls",
        axum::routing::get(move || {
            let seen = seen.clone();
            async move { seen.lock().unwrap().calls.len().to_string() }
        }),
    );
    let counter = serve_upstream(calls).await;
    let env = vec![
        ("GATEWAY_URL", gateway.url.clone()),
        ("CALLS_URL", format!("{counter}/calls")),
        ("GATEWAY_KEY", "caller-secret".to_owned()),
    ];
    crate::support::run_sdk_checks(python, "gemini_sdk.py", env, 9).await;
    drop(gateway);
}
