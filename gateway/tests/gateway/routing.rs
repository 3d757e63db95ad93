//! The crate's `Router` and `IdempotencyLayer` in the gateway, with simulated accounts: a
//! model's fallback takes what its primary would make wait or fails with 5xx, unless it lacks
//! a feature the request needs (the compatibility check), a ramp shows in
//! `/admin/routes`, the answer names its route; duplicates of one `Idempotency-Key` share one
//! upstream call in flight and after, per tenant.

use serde_json::Value;

use crate::support::{Running, json};

const CONFIG: &str = r#"
[server]
admin_token = "admin"

[[accounts]]
name = "sim-a"
base_url = "sim"
profile = "openai"
apis = ["chat"]
# A sixth of 6 a minute at once: one request, then the budget would make the next wait.
quota = { requests_per_minute = 6, tokens_per_minute = 1000000 }

[[accounts]]
name = "sim-b"
base_url = "sim"
profile = "openai"
apis = ["chat"]
quota = { requests_per_minute = 60000, tokens_per_minute = 100000000 }
sim = { base_ms = 150 }

[[accounts]]
name = "sim-flaky"
base_url = "sim"
profile = "openai"
apis = ["chat"]
quota = { requests_per_minute = 60000, tokens_per_minute = 100000000 }
sim = { server_error_share = 1.0 }

[[accounts]]
name = "sim-c"
base_url = "sim"
profile = "openai"
apis = ["chat"]
quota = { requests_per_minute = 60000, tokens_per_minute = 100000000 }

[[models]]
name = "fast"
account = "sim-a"
model = "gpt-4o-mini"
fallbacks = [{ account = "sim-b", model = "gpt-4o-mini-b", on = ["would_wait"], classes = ["interactive"], features = ["response_format"] }]

[[models]]
name = "flaky"
account = "sim-flaky"
fallbacks = [{ account = "sim-b", on = ["server_error"] }]

[[models]]
name = "steady"
account = "sim-b"

[[models]]
name = "migrating"
account = "sim-b"
ramp = { account = "sim-a", model = "gpt-5", start_percent = 5, percent_per_minute = 10 }

[[models]]
name = "tiered"
account = "sim-b"
context_window = 60
fallbacks = [
  { account = "sim-c", model = "cheap", on = ["degrade"], classes = ["batch"] },
  { account = "sim-c", model = "long", on = ["context_length"], context_window = 100000 },
]

[[keys]]
name = "k3"
key = "key-3"
tenant = "t3"
default_class = "batch"

[[keys]]
name = "k1"
key = "key-1"
tenant = "t1"
default_class = "interactive"

[[keys]]
name = "k2"
key = "key-2"
tenant = "t2"
default_class = "interactive"
"#;

fn chat(model: &str) -> String {
    format!(
        r#"{{"model":"{model}","max_tokens":20,"messages":[{{"role":"user","content":"Hello there"}}]}}"#
    )
}

/// Calls a simulated account has billed.
fn billed(gateway: &Running, account: &str) -> u64 {
    let status = gateway.gateway.status();
    let rows = status["accounts"].as_array().unwrap();
    let row = rows.iter().find(|a| a["name"] == account).unwrap();
    row["simulator"]["admitted"].as_u64().unwrap()
}

/// A request of `key` for `model`: its status, its route headers, its body.
async fn call(
    gateway: &Running,
    key: &str,
    model: &str,
    idempotency_key: Option<&str>,
) -> (u16, Option<String>, Option<String>, Value) {
    let mut request = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(chat(model));
    if let Some(id) = idempotency_key {
        request = request.header("idempotency-key", id);
    }
    let response = request.send().await.unwrap();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let (route, fallback) = (header("x-llm-quota-route"), header("x-llm-quota-fallback"));
    let (status, _, body) = json(response).await;
    (status, route, fallback, body)
}

#[tokio::test]
async fn a_fallback_takes_what_the_primary_would_make_wait() {
    let gateway = Running::start(CONFIG).await;
    let (status, route, fallback, body) = call(&gateway, "key-1", "fast", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(route.as_deref(), Some("sim-a:gpt-4o-mini"));
    assert_eq!(fallback, None);
    assert_eq!(body["model"], "gpt-4o-mini");
    for _ in 0..2 {
        let (status, route, fallback, body) = call(&gateway, "key-1", "fast", None).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(route.as_deref(), Some("sim-b:gpt-4o-mini-b"));
        assert_eq!(fallback.as_deref(), Some("would_wait"));
        // Renamed for the fallback's account.
        assert_eq!(body["model"], "gpt-4o-mini-b");
    }
    assert_eq!(
        (billed(&gateway, "sim-a"), billed(&gateway, "sim-b")),
        (1, 2)
    );
    // A request with tools: the fallback does not support them, so it stays on the primary,
    // whose burst is spent for longer than the class may wait: refused at once, naming the
    // primary's limit, with the wait; sent nowhere.
    let tools = chat("fast").replace(
        r#""max_tokens""#,
        r#""tools":[{"type":"function","function":{"name":"f"}}],"max_tokens""#,
    );
    let refused = gateway
        .post("/v1/chat/completions", Some("key-2"), &tools)
        .await;
    let (status, retry_after, body) = json(refused).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["scope"], "account:sim-a", "{body}");
    assert_eq!(body["error"]["limit"], "requests_per_minute", "{body}");
    let retry_after: f64 = retry_after.unwrap().parse().unwrap();
    assert!(retry_after > 1.0, "{retry_after}");
    assert_eq!(
        (billed(&gateway, "sim-a"), billed(&gateway, "sim-b")),
        (1, 2)
    );
    // Structured output, which the fallback supports, goes there.
    let structured = chat("fast").replace(
        r#""max_tokens""#,
        r#""response_format":{"type":"json_object"},"max_tokens""#,
    );
    let answer = gateway
        .post("/v1/chat/completions", Some("key-2"), &structured)
        .await;
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["x-llm-quota-route"], "sim-b:gpt-4o-mini-b");
    assert_eq!(
        (billed(&gateway, "sim-a"), billed(&gateway, "sim-b")),
        (1, 3)
    );
    // Nothing is left reserved on the primary by the requests it did not serve.
    assert_eq!(gateway.account("sim-a").await["in_flight"], 0);
    gateway.stop().await;
}

#[tokio::test]
async fn a_fallback_serves_when_the_primary_fails_with_5xx() {
    let gateway = Running::start(CONFIG).await;
    let (status, route, fallback, body) = call(&gateway, "key-1", "flaky", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(route.as_deref(), Some("sim-b"));
    assert_eq!(fallback.as_deref(), Some("provider_5xx"));
    assert_eq!(billed(&gateway, "sim-b"), 1);
    gateway.stop().await;
}

/// Batch work goes to the degraded route at once; a request longer than the primary's
/// context window goes to the fallback whose window fits it.
#[tokio::test]
async fn degraded_and_long_context_routes() {
    let gateway = Running::start(CONFIG).await;
    let (status, route, fallback, body) = call(&gateway, "key-3", "tiered", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (route.as_deref(), fallback.as_deref()),
        (Some("sim-c:cheap"), Some("degraded"))
    );
    let (status, route, fallback, _) = call(&gateway, "key-1", "tiered", None).await;
    assert_eq!(status, 200);
    assert_eq!((route.as_deref(), fallback), (Some("sim-b"), None));
    let long = chat("tiered").replace("Hello there", &"a long question ".repeat(100));
    let answer = gateway
        .post("/v1/chat/completions", Some("key-1"), &long)
        .await;
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["x-llm-quota-route"], "sim-c:long");
    assert_eq!(answer.headers()["x-llm-quota-fallback"], "context_length");
    gateway.stop().await;
}

#[tokio::test]
async fn routes_and_the_ramp_are_visible_in_the_admin_api() {
    let gateway = Running::start(CONFIG).await;
    let response = gateway
        .admin(reqwest::Method::GET, "/routes", "admin", Value::Null)
        .await;
    assert_eq!(response.status(), 200);
    let routes: Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    let models: Vec<&str> = routes
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["model"].as_str().unwrap())
        .collect();
    assert_eq!(models, ["fast", "flaky", "steady", "migrating", "tiered"]);
    assert_eq!(routes[0]["routes"][1]["route"], "sim-b:gpt-4o-mini-b");
    assert_eq!(routes[0]["routes"][1]["account"], "sim-b");
    let ramp = &routes[3]["ramp"];
    assert_eq!(ramp["share_percent"], 5.0, "{routes}");
    assert_eq!(ramp["ceiling_percent"], 100.0, "{routes}");
    assert_eq!(routes[3]["routes"][1]["route"], "sim-a:gpt-5");
    gateway.stop().await;
}

#[tokio::test]
async fn one_idempotency_key_is_one_upstream_call_per_tenant() {
    let gateway = Running::start(CONFIG).await;
    // Two at once with one key: one call, one answer for both.
    let (first, second) = tokio::join!(
        call(&gateway, "key-1", "steady", Some("op-1")),
        call(&gateway, "key-1", "steady", Some("op-1")),
    );
    assert_eq!((first.0, second.0), (200, 200));
    assert_eq!(first.3, second.3, "the duplicate gets the same answer");
    assert_eq!(billed(&gateway, "sim-b"), 1);
    // After it completed: replayed, not called again.
    let third = call(&gateway, "key-1", "steady", Some("op-1")).await;
    assert_eq!(third.3, first.3);
    assert_eq!(billed(&gateway, "sim-b"), 1);
    // Another tenant's same key is another operation.
    let other = call(&gateway, "key-2", "steady", Some("op-1")).await;
    assert_eq!(other.0, 200);
    assert_eq!(billed(&gateway, "sim-b"), 2);
    // Without a key, identical bodies are each called.
    call(&gateway, "key-1", "steady", None).await;
    call(&gateway, "key-1", "steady", None).await;
    assert_eq!(billed(&gateway, "sim-b"), 4);
    gateway.stop().await;
}
