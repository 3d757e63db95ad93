//! The audit log: a JSON line per request (admitted, refused locally, refused by the provider)
//! and per admin change, with who, what, the decision and the figures; the key's name, never
//! the key.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use axum::response::IntoResponse;
use http::{Method, StatusCode};
use serde_json::{Value, json};

use crate::api::fixed_config;
use crate::support::{Running, SEARCH, chat, demo};

/// A fresh file for a test's audit log.
pub(crate) fn log_file(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("audit-{name}-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path
}

/// The log's lines once it holds `count` of them (the writer is a thread of its own: wait
/// for them, up to ten seconds).
pub(crate) async fn lines(path: &std::path::Path, count: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<Value> = text
            .lines()
            .map(|line| serde_json::from_str(line).expect("a JSON line"))
            .collect();
        if lines.len() >= count {
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "{} lines of {count}:\n{text}",
            lines.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An admitted request, a local refusal, an unknown key, an admin pause and a paused
/// tenant's refusal: five request lines and one admin line, in order.
#[tokio::test]
async fn every_request_and_admin_change_is_one_line() {
    let path = log_file("demo");
    let config = demo().replace(
        "[server]\n",
        &format!("[server]\naudit_log = \"{}\"\n", path.display()),
    );
    let gateway = Running::start(&config).await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .bearer_auth(SEARCH)
        .header("x-request-id", "req-admitted")
        .body(chat(20))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-request-id"], "req-admitted");
    let bytes = response.bytes().await.unwrap().len();
    let unknown_model = chat(20).replace("gpt-4o-mini", "gpt-9");
    let refused = gateway
        .post("/v1/chat/completions", Some(SEARCH), &unknown_model)
        .await;
    assert_eq!(refused.status(), 404);
    let id = refused.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some("not-a-key"), &chat(20))
            .await
            .status(),
        401
    );
    // By acme's delegated admin: the line names its token.
    let paused = gateway
        .admin(
            Method::POST,
            "/pause",
            "demo-admin-acme",
            json!({"tenant": "acme/search"}),
        )
        .await;
    assert_eq!(paused.status(), 204);
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(SEARCH), &chat(20))
            .await
            .status(),
        429
    );
    let lines = lines(&path, 5).await;
    gateway.stop().await;
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains(SEARCH), "the key itself is in the log");

    let admitted = &lines[0];
    assert_eq!(admitted["request_id"], "req-admitted");
    assert_eq!(admitted["decision"], "admitted");
    assert_eq!(admitted["status"], 200);
    assert_eq!(admitted["tenant"], "acme/search");
    assert_eq!(admitted["key"], "acme-search-web");
    assert_eq!(admitted["api"], "chat");
    assert_eq!(admitted["model"], "gpt-4o-mini");
    assert_eq!(admitted["class"], "interactive");
    assert_eq!(admitted["account"], "openai-sim");
    assert_eq!(admitted["provider"], "openai");
    assert_eq!(admitted["route"], "openai-sim");
    assert_eq!(admitted["attempts"], 1);
    assert_eq!(admitted["bytes"], bytes);
    assert!(
        admitted["estimated"]["output"].as_u64() == Some(20),
        "{admitted}"
    );
    assert!(
        admitted["used"]["input"].as_u64().unwrap() > 0,
        "{admitted}"
    );
    assert!(
        admitted["used"]["output"].as_u64().unwrap() > 0,
        "{admitted}"
    );
    assert!(admitted["call_ms"].as_f64().is_some(), "{admitted}");
    assert!(admitted["queue_ms"].as_f64().is_some(), "{admitted}");
    assert!(
        admitted["duration_ms"].as_f64().unwrap() > 0.0,
        "{admitted}"
    );
    assert!(
        admitted["time"].as_str().unwrap().ends_with('Z'),
        "{admitted}"
    );

    let model = &lines[1];
    assert_eq!(model["request_id"], id.as_str());
    assert_eq!(
        (&model["decision"], &model["status"], &model["model"]),
        (&json!("local"), &json!(404), &json!("gpt-9"))
    );
    assert!(
        model["reason"].as_str().unwrap().contains("gpt-9"),
        "{model}"
    );

    let anonymous = &lines[2];
    assert_eq!(
        (&anonymous["status"], &anonymous["key"]),
        (&json!(401), &Value::Null)
    );

    let admin = &lines[3];
    assert_eq!(admin["action"], "pause", "{admin}");
    assert_eq!(admin["admin"], "acme-admin");
    assert_eq!(admin["target"], "acme/search");
    assert_eq!(
        (&admin["before"]["paused"], &admin["after"]["paused"]),
        (&json!(false), &json!(true))
    );

    let paused = &lines[4];
    assert_eq!(
        (&paused["decision"], &paused["limit"], &paused["scope"]),
        (
            &json!("local"),
            &json!("paused"),
            &json!("tenant:acme/search")
        )
    );
}

/// A provider's 429: its raw status, error type and rate-limit headers are in the line, with
/// the attempts the gateway made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_refusal_keeps_the_providers_words() {
    let app = axum::Router::new().fallback(|| async {
        let body = r#"{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
        let mut response = (
            StatusCode::TOO_MANY_REQUESTS,
            [("content-type", "application/json")],
            body,
        )
            .into_response();
        for (name, value) in [
            ("retry-after", "1"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-limit-requests", "600"),
        ] {
            response.headers_mut().insert(name, value.parse().unwrap());
        }
        response
    });
    let upstream = crate::support::serve_upstream(app).await;
    let path = log_file("provider");
    let config = fixed_config(&upstream)
        .replace(
            "admin_token = \"admin\"",
            &format!(
                "admin_token = \"admin\"\n        audit_log = \"{}\"",
                path.display()
            ),
        )
        .replace(
            "tenant = \"team\"",
            "tenant = \"team\"\n        default_class = \"interactive\"",
        );
    let gateway = Running::start(&config).await;
    let response = gateway
        .post("/v1/chat/completions", Some("caller-secret"), &chat(20))
        .await;
    assert_eq!(response.status(), 429);
    let lines = lines(&path, 1).await;
    gateway.stop().await;
    let line = &lines[0];
    assert_eq!(line["decision"], "provider", "{line}");
    assert_eq!(line["provider_status"], 429);
    assert_eq!(line["provider_error"], "requests");
    assert_eq!(
        line["rate_limit_headers"]["x-ratelimit-remaining-requests"],
        "0"
    );
    assert_eq!(line["rate_limit_headers"]["retry-after"], "1");
    assert!(line["attempts"].as_u64().unwrap() >= 1, "{line}");
    assert_eq!(line["key"], "team-key");
}
