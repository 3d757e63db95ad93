//! The quota API: its token, pause and resume, limits, the tree and usage.

use reqwest::Method;
use serde_json::{Value, json};

use crate::support::{ADMIN, GLOBEX, Running, SEARCH, chat, demo, json};

#[tokio::test]
async fn the_admin_api_needs_its_own_token() {
    let gateway = Running::start(&demo()).await;
    for token in ["wrong", SEARCH] {
        let response = gateway
            .admin(Method::GET, "/tenants", token, Value::Null)
            .await;
        assert_eq!(response.status(), 401);
    }
    let response = gateway
        .admin(Method::POST, "/pause", SEARCH, json!({"tenant": "globex"}))
        .await;
    assert_eq!(response.status(), 401);
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        200
    );
    gateway.stop().await;
}

#[tokio::test]
async fn pause_refuses_a_tenant_at_once_and_resume_restores_it() {
    let gateway = Running::start(&demo()).await;
    let paused = gateway
        .admin(Method::POST, "/pause", ADMIN, json!({"tenant": "acme"}))
        .await;
    assert_eq!(paused.status(), 204);
    // A child of a paused node is refused, naming the paused node; others go on. A pause
    // has no known end: the caller is told to look again in a minute.
    let (status, retry_after, body) = json(
        gateway
            .post("/v1/chat/completions", Some(SEARCH), &chat(20))
            .await,
    )
    .await;
    assert_eq!((status, retry_after.as_deref()), (429, Some("60")));
    assert_eq!(body["error"]["limit"], "paused");
    assert_eq!(body["error"]["scope"], "tenant:acme");
    assert_eq!(body["error"]["gateway_decision"], "local");
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        200
    );
    let resumed = gateway
        .admin(Method::POST, "/resume", ADMIN, json!({"tenant": "acme"}))
        .await;
    assert_eq!(resumed.status(), 204);
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(SEARCH), &chat(20))
            .await
            .status(),
        200
    );

    // A key alone.
    let paused = gateway
        .admin(Method::POST, "/pause", ADMIN, json!({"key": "globex-app"}))
        .await;
    assert_eq!(paused.status(), 204);
    let (status, _, body) = json(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await,
    )
    .await;
    assert_eq!(
        (status, body["error"]["scope"].as_str()),
        (429, Some("tenant:globex/globex-app"))
    );
    gateway
        .admin(Method::POST, "/resume", ADMIN, json!({"key": "globex-app"}))
        .await;
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        200
    );

    let unknown = gateway
        .admin(
            Method::POST,
            "/pause",
            ADMIN,
            json!({"tenant": "initech//x"}),
        )
        .await;
    assert_eq!(unknown.status(), 422);
    // The provider saw none of the refused requests.
    let stats = gateway.gateway.accounts[0]
        .simulator
        .as_ref()
        .unwrap()
        .stats();
    assert_eq!(stats.admitted, 3);
    gateway.stop().await;
}

#[tokio::test]
async fn limits_change_and_the_tree_shows_levels_and_usage() {
    let gateway = Running::start(&demo()).await;
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        200
    );
    // Down to one request a minute (a burst of one, the level kept but clamped), weight 5.
    let limits = json!([
        {"dimension": "requests", "amount": 1, "period_seconds": 60},
        {"dimension": "total_tokens", "amount": 6000, "period_seconds": 60},
    ]);
    let change = json!({"tenant": "globex", "limits": limits, "weight": 5});
    assert_eq!(
        gateway
            .admin(Method::PUT, "/limits", ADMIN, change)
            .await
            .status(),
        204
    );
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        200
    );
    let (status, _, body) = json(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await,
    )
    .await;
    assert_eq!(
        (status, body["error"]["scope"].as_str()),
        (429, Some("tenant:globex"))
    );

    let tree: Value = gateway
        .admin(Method::GET, "/tenants", ADMIN, Value::Null)
        .await
        .json_value()
        .await;
    let paths: Vec<&str> = tree
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths, ["acme", "acme/reports", "acme/search", "globex"]);
    let globex = &tree[3];
    assert_eq!(globex["weight"], 5);
    assert_eq!(
        globex["accounts"][0]["levels"][0]["limit"],
        "requests_per_minute"
    );
    assert_eq!(globex["accounts"][0]["levels"][0]["capacity"], 1);
    assert_eq!(globex["accounts"][0]["levels"][0]["level"], 0);
    assert_eq!(globex["usage"]["requests"], 2);
    assert_eq!(globex["usage"]["local_refusals"], 1);
    assert!(globex["usage"]["input_tokens"].as_u64().unwrap() > 0);

    let usage: Value = gateway
        .admin(Method::GET, "/usage", ADMIN, Value::Null)
        .await
        .json_value()
        .await;
    let globex = usage
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["tenant"] == "globex")
        .unwrap();
    assert_eq!(
        (
            globex["requests"].as_u64(),
            globex["local_refusals"].as_u64()
        ),
        (Some(2), Some(1))
    );
    let bad = json!({"tenant": "globex", "limits": [{"dimension": "requests", "amount": 0, "period_seconds": 60}]});
    assert_eq!(
        gateway
            .admin(Method::PUT, "/limits", ADMIN, bad)
            .await
            .status(),
        422
    );
    gateway.stop().await;
}

trait JsonValue {
    async fn json_value(self) -> Value;
}

impl JsonValue for reqwest::Response {
    async fn json_value(self) -> Value {
        serde_json::from_slice(&self.bytes().await.unwrap()).unwrap()
    }
}
