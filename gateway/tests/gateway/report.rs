//! `GET /admin/report`: the review of a period, per account, tenant and model, in JSON and
//! CSV; with `--redis-url`, every replica's traffic in one report that outlives them.

use std::time::Duration;

use serde_json::Value;

use crate::api::{fixed_config, fixed_upstream};
use crate::redis_server::RedisServer;
use crate::support::{ADMIN, GLOBEX, Running, SEARCH, chat, demo};

async fn report(gateway: &Running, token: &str, query: &str) -> (u16, String) {
    let response = reqwest::Client::new()
        .get(format!("{}/admin/report{query}", gateway.url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

fn row<'a>(review: &'a Value, tenant: &str, account: &str) -> &'a Value {
    review["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["tenant"] == tenant && r["account"] == account)
        .unwrap_or_else(|| panic!("no row {account}/{tenant} in {review}"))
}

#[tokio::test]
async fn the_report_counts_requests_tokens_estimates_and_refusals() {
    let gateway = Running::start(&demo()).await;
    for _ in 0..3 {
        let response = gateway
            .post("/v1/chat/completions", Some(SEARCH), &chat(20))
            .await;
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
    // globex: 20 requests a minute, then two local refusals.
    for _ in 0..22 {
        let response = gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await;
        response.bytes().await.unwrap();
    }
    let (status, text) = report(&gateway, ADMIN, "").await;
    assert_eq!(status, 200, "{text}");
    let review: Value = serde_json::from_str(&text).unwrap();
    let search = row(&review, "acme/search", "openai-sim");
    assert_eq!(search["model"], "gpt-4o-mini");
    assert_eq!(search["requests"], 3);
    assert_eq!(search["settled_requests"], 3);
    assert!(search["output_tokens"].as_u64().unwrap() > 0);
    // Output reserved at `max_tokens` (20), used less: the estimate is above 1.
    assert!(search["estimate_ratio"].as_f64().unwrap() > 1.0, "{search}");
    // Refused by the account's budget (the node's limit is the budget's): on its row.
    let globex = row(&review, "globex", "openai-sim");
    assert_eq!(globex["requests"], 20);
    assert_eq!(globex["local_refusals"], 2);
    assert_eq!(globex["refusals"]["tenant:globex requests_per_minute"], 2);
    // The accounts: capacity over the minutes served, what was used, what idled.
    let openai = review["accounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["account"] == "openai-sim")
        .unwrap();
    let requests = openai["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["limit"] == "requests_per_minute")
        .unwrap();
    assert_eq!(requests["used"], 23, "{openai}");
    assert!(requests["capacity"].as_u64().unwrap() >= 600, "{openai}");
    assert!(requests["idle_share"].as_f64().unwrap() > 0.9, "{openai}");

    // CSV, the same rows.
    let (status, csv) = report(&gateway, ADMIN, "?format=csv").await;
    assert_eq!(status, 200);
    let mut lines = csv.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("account,tenant,model,requests,")
    );
    assert!(
        csv.contains("openai-sim,acme/search,gpt-4o-mini,3,"),
        "{csv}"
    );
    assert!(csv.contains("tenant:globex requests_per_minute=2"), "{csv}");
    let (_, accounts) = report(&gateway, ADMIN, "?format=csv&table=accounts").await;
    assert!(accounts.contains("openai-sim,"), "{accounts}");

    // A delegated admin: acme's rows only, no accounts.
    let (status, text) = report(&gateway, "demo-admin-acme", "").await;
    assert_eq!(status, 200);
    let review: Value = serde_json::from_str(&text).unwrap();
    assert!(!text.contains("globex"), "{text}");
    assert!(review["accounts"].as_array().unwrap().is_empty());

    // Mistakes: 400 with the reason.
    for query in [
        "?since=yesterday",
        "?since=2026-12-03&until=2026-12-01",
        "?since=1000",
        "?format=xml",
    ] {
        let (status, text) = report(&gateway, ADMIN, query).await;
        assert_eq!(status, 400, "{query}: {text}");
        assert!(text.contains("invalid_request"), "{text}");
    }
    gateway.stop().await;
}

/// With `--redis-url`, the report on one replica counts the other's traffic too, and a replica
/// started after both stopped still reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_covers_every_replica_and_outlives_them() {
    let redis = RedisServer::start();
    let (upstream, _) = fixed_upstream(Duration::ZERO).await;
    let config = fixed_config(&upstream);
    let first = Running::start_shared(&config, &redis.url()).await;
    let second = Running::start_shared(&config, &redis.url()).await;
    let body = r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"Hi"}]}"#;
    for (replica, count) in [(&first, 3), (&second, 4)] {
        for _ in 0..count {
            let response = replica
                .post("/v1/chat/completions", Some("caller-secret"), body)
                .await;
            assert_eq!(response.status(), 200);
            response.bytes().await.unwrap();
        }
    }
    let requests = |text: &str| -> u64 {
        let review: Value = serde_json::from_str(text).unwrap();
        review["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["tenant"] == "team")
            .map(|r| r["requests"].as_u64().unwrap())
            .sum()
    };
    // The second replica's counters reach Redis at its next flush (every 2 s).
    let started = std::time::Instant::now();
    loop {
        let (status, text) = report(&first, "admin", "").await;
        assert_eq!(status, 200, "{text}");
        if requests(&text) == 7 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Both stop (a last flush each); a new replica reads the same report.
    first.stop().await;
    second.stop().await;
    let third = Running::start_shared(&config, &redis.url()).await;
    let (_, text) = report(&third, "admin", "").await;
    assert_eq!(requests(&text), 7, "{text}");
    third.stop().await;
}
