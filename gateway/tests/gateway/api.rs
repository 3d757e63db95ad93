//! Forwarding: keys, refusals, bodies, streaming and metrics.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use http::HeaderMap;
use serde_json::Value;

use crate::support::{GLOBEX, REPORTS, Running, SEARCH, chat, demo, json, messages};

#[tokio::test]
async fn demo_keys_work_on_both_styles() {
    let gateway = Running::start(&demo()).await;
    for key in [SEARCH, REPORTS, GLOBEX] {
        let (status, _, body) = json(
            gateway
                .post("/v1/chat/completions", Some(key), &chat(20))
                .await,
        )
        .await;
        assert_eq!(status, 200, "{key}: {body}");
        assert_eq!(body["object"], "chat.completion");
        let (status, _, body) =
            json(gateway.post("/v1/messages", Some(key), &messages(20)).await).await;
        assert_eq!(status, 200, "{key}: {body}");
        assert_eq!(body["type"], "message");
    }
    // No account serves the Responses API in the demo.
    let (status, _, body) = json(
        gateway
            .post("/v1/responses", Some(SEARCH), r#"{"input":"hi"}"#)
            .await,
    )
    .await;
    assert_eq!(
        (status, body["error"]["limit"].as_str()),
        (404, Some("route"))
    );
    let mut admitted = Vec::new();
    for account in ["openai-sim", "anthropic-sim", "gemini-sim"] {
        admitted.push(gateway.simulator(account).await.1);
    }
    assert_eq!(admitted, [3, 3, 0]);
    gateway.stop().await;
}

#[tokio::test]
async fn an_unknown_key_gets_401_and_touches_no_quota() {
    let gateway = Running::start(&demo()).await;
    let levels = |status: Value| {
        let nodes = status["tenants"].as_array().unwrap().clone();
        let accounts = nodes
            .into_iter()
            .flat_map(|n| n["accounts"].as_array().unwrap().clone());
        accounts
            .map(|a| {
                let levels = a["levels"].as_array().unwrap().iter();
                (
                    a["used"].clone(),
                    levels.map(|l| l["level"].clone()).collect::<Vec<_>>(),
                )
            })
            .collect::<Vec<_>>()
    };
    let before = levels(gateway.status().await);
    for key in [Some("demo-key-acme-searcH"), Some(""), None] {
        let (status, _, body) =
            json(gateway.post("/v1/chat/completions", key, &chat(20)).await).await;
        assert_eq!(status, 401);
        // OpenAI's schema, which its SDK reads as an `AuthenticationError`.
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["code"], "invalid_api_key");
        assert_eq!(body["error"]["gateway_type"], "authentication");
        assert_eq!(body["error"]["gateway_decision"], "local");
    }
    // On the Messages API, Anthropic's schema.
    let (status, _, body) = json(gateway.post("/v1/messages", None, &messages(20)).await).await;
    assert_eq!(status, 401);
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "authentication_error");
    assert_eq!(body["error"]["gateway_decision"], "local");
    assert_eq!(levels(gateway.status().await), before);
    for account in gateway.status().await["accounts"].as_array().unwrap() {
        if let Some(received) = account["simulator"]["received"].as_u64() {
            assert_eq!(received, 0, "{account}");
        }
        let levels = account["levels"].as_array().unwrap();
        assert!(
            levels.iter().all(|l| l["level"] == l["capacity"]),
            "{account}"
        );
    }
    gateway.stop().await;
}

#[tokio::test]
async fn an_over_limit_tenant_gets_the_normalized_429_and_the_others_go_on() {
    let gateway = Running::start(&demo()).await;
    // globex: 20 requests a minute, all of them at once (a node's burst is its amount).
    let burst = 20;
    for _ in 0..burst {
        let response = gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await;
        assert_eq!(response.status(), 200);
    }
    let (status, retry_after, body) = json(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await,
    )
    .await;
    assert_eq!(status, 429);
    let error = &body["error"];
    // OpenAI's rate-limit schema (its SDK raises `RateLimitError`), the gateway's fields beside.
    assert_eq!(error["type"], "requests");
    assert_eq!(error["code"], "rate_limit_exceeded");
    assert_eq!(error["param"], serde_json::Value::Null);
    assert_eq!(error["gateway_type"], "rate_limit");
    assert_eq!(error["gateway_decision"], "local");
    assert_eq!(error["limit"], "requests_per_minute");
    assert_eq!(error["dimension"], "requests");
    assert_eq!(error["scope"], "tenant:globex");
    let wait = error["retry_after"].as_f64().unwrap();
    assert!(wait > 0.0 && wait <= 3.0, "one request every 3 s: {wait}");
    assert_eq!(retry_after, Some(format!("{}", wait.ceil() as u64)));
    // The other tenants keep their 200s; the provider saw only what was admitted.
    for key in [SEARCH, REPORTS] {
        assert_eq!(
            gateway
                .post("/v1/chat/completions", Some(key), &chat(20))
                .await
                .status(),
            200
        );
    }
    let (_, admitted, rate_limited) = gateway.simulator("openai-sim").await;
    assert_eq!((admitted, rate_limited), (burst + 2, 0));
    let usage = gateway.usage("globex").await;
    assert_eq!(
        (&usage["requests"], &usage["local_refusals"]),
        (&burst.into(), &1.into())
    );
    gateway.stop().await;
}

#[tokio::test]
async fn bad_bodies_are_refused_before_anything_is_reserved() {
    let gateway = Running::start(&demo()).await;
    let cases = [
        ("{not json".to_owned(), 400, "body"),
        (r#"{"model":"m"}"#.to_owned(), 400, "body"),
        (
            format!(
                r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
                "x".repeat(1 << 20)
            ),
            413,
            "body_size",
        ),
    ];
    for (body, expected, limit) in cases {
        let (status, _, json) = json(
            gateway
                .post("/v1/chat/completions", Some(SEARCH), &body)
                .await,
        )
        .await;
        assert_eq!(
            (status, json["error"]["limit"].as_str()),
            (expected, Some(limit))
        );
    }
    let status = gateway.status().await;
    let search = (status["tenants"].as_array().unwrap().iter())
        .find(|n| n["path"] == "acme/search")
        .unwrap();
    let accounts = search["accounts"].as_array().unwrap().iter();
    let levels = accounts.flat_map(|a| a["levels"].as_array().unwrap());
    assert!(levels.clone().all(|l| l["level"] == l["capacity"]));
    // A level per account (the Gemini account's model scopes hold no tenant levels).
    assert_eq!(levels.count(), 3);
    assert_eq!(gateway.simulator("openai-sim").await.0, 0);
    gateway.stop().await;
}

/// The events a fixed upstream streams, 20 ms apart.
pub(crate) const EVENTS: [&str; 4] = [
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo!\"}}],\"usage\":null}\n\n",
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\n",
    "data: [DONE]\n\n",
];

/// An upstream on loopback that records the headers it gets and streams [`EVENTS`].
pub(crate) async fn fixed_upstream(pause: Duration) -> (String, Arc<Mutex<Vec<HeaderMap>>>) {
    let (app, seen) = fixed_app(pause);
    let url = crate::support::serve_upstream(app).await;
    (url, seen)
}

/// The fixed upstream's routes, and the headers it got.
pub(crate) fn fixed_app(pause: Duration) -> (axum::Router, Arc<Mutex<Vec<HeaderMap>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    // Its answer on the Messages path too: the head is what some tests read.
    let handler = move |headers: HeaderMap| {
        record.lock().unwrap().push(headers);
        async move {
            let stream = futures::stream::unfold(0, move |i| async move {
                let event = EVENTS.get(i)?;
                tokio::time::sleep(pause).await;
                Some((
                    Ok::<_, std::io::Error>(Bytes::from_static(event.as_bytes())),
                    i + 1,
                ))
            });
            (
                [("content-type", "text/event-stream")],
                Body::from_stream(stream),
            )
        }
    };
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(handler.clone()))
        .route("/v1/messages", post(handler));
    (app, seen)
}

/// A gateway with one tenant and one key in front of `upstream`, one call in flight at most.
pub(crate) fn fixed_config(upstream: &str) -> String {
    format!(
        r#"
        [server]
        admin_token = "admin"
        [[accounts]]
        name = "fixed"
        base_url = "{upstream}"
        key = "sk-upstream-secret"
        profile = "openai"
        apis = ["chat"]
        quota = {{ requests_per_minute = 600, tokens_per_minute = 600000, max_in_flight = 1 }}
        [[keys]]
        name = "team-key"
        key = "caller-secret"
        tenant = "team"
        "#
    )
}

#[tokio::test]
async fn a_stream_passes_byte_for_byte_with_the_gateway_key_upstream() {
    let (upstream, seen) = fixed_upstream(Duration::from_millis(20)).await;
    let gateway = Running::start(&fixed_config(&upstream)).await;
    let body = r#"{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Hi"}]}"#;
    let response = gateway
        .post("/v1/chat/completions", Some("caller-secret"), body)
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert_eq!(response.bytes().await.unwrap(), EVENTS.concat().as_bytes());
    let headers = seen.lock().unwrap().clone();
    assert_eq!(headers.len(), 1);
    assert_eq!(headers[0]["authorization"], "Bearer sk-upstream-secret");
    assert!(
        headers[0]
            .values()
            .all(|v| !v.as_bytes().windows(6).any(|w| w == b"caller"))
    );
    let usage = gateway.usage("team").await;
    assert_eq!(
        (
            &usage["requests"],
            &usage["input_tokens"],
            &usage["output_tokens"]
        ),
        (&1.into(), &9.into(), &2.into())
    );
    gateway.stop().await;
}

/// `promtool check metrics` finds nothing to say of `exposition` (every series has its `HELP`
/// and `TYPE`, names and units follow the conventions). Skipped without promtool, unless
/// `PROMTOOL_REQUIRED` is set (`.ci/run` installs it and sets it).
fn promtool_accepts(exposition: &str) {
    use std::io::Write;
    let spawned = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = spawned else {
        assert!(
            std::env::var_os("PROMTOOL_REQUIRED").is_none(),
            "PROMTOOL_REQUIRED is set but promtool does not run"
        );
        println!("skipped: no promtool (Debian's `prometheus` package provides it)");
        return;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(exposition.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}"
    );
}

/// The check above, on a planted violation: a counter without its `HELP`.
#[test]
fn the_promtool_check_sees_a_series_without_help() {
    let promtool = std::process::Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok();
    if !promtool {
        return;
    }
    let planted =
        std::panic::catch_unwind(|| promtool_accepts("# TYPE x_total counter\nx_total 1\n"));
    assert!(planted.is_err(), "a series without HELP passed the check");
}

/// The gateway's and the crate's series on `/metrics`, each with its `HELP` and `TYPE`
/// (`promtool check metrics` clean), latencies as histograms.
#[tokio::test]
async fn metrics_carry_per_tenant_series() {
    let gateway = Running::start(&demo()).await;
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(SEARCH), &chat(20))
            .await
            .status(),
        200
    );
    assert_eq!(
        gateway
            .post("/v1/messages", Some(REPORTS), &messages(20))
            .await
            .status(),
        200
    );
    let (status, text) = gateway.get("/metrics").await;
    assert_eq!(status, 200);
    for series in [
        r#"gateway_requests_total{tenant="acme/search",api="chat",class="interactive",status="200"}"#,
        r#"gateway_requests_total{tenant="acme/reports",api="messages",class="batch",status="200"}"#,
        r#"gateway_tokens_total{tenant="acme/reports",kind="output",service_tier="unknown"}"#,
        r#"gateway_tenant_level{tenant="globex",account="openai-sim",limit="requests_per_minute"}"#,
        r#"gateway_tenant_guaranteed_tokens_per_minute{tenant="acme",account="anthropic-sim"}"#,
        r#"gateway_account_queued{account="openai-sim",class="batch"}"#,
    ] {
        assert!(text.contains(series), "{series} missing from\n{text}");
    }
    // The crate's own series (the gateway builds it with its `metrics` feature).
    for series in ["llm_requests_total", "llm_tenant_tokens_total"] {
        assert!(text.contains(series), "{series} missing");
    }
    // Each account's budget keeps series of its own (before, one series for all).
    for account in ["openai-sim", "anthropic-sim"] {
        let label = format!("queue=\"{account}\"");
        assert!(
            text.lines()
                .any(|l| l.starts_with("llm_budget_level{") && l.contains(&label)),
            "no llm_budget_level of {account} in\n{text}"
        );
    }
    // Latencies add up across replicas: histograms, not summaries.
    assert!(
        text.contains("# TYPE llm_call_seconds histogram"),
        "llm_call_seconds is not a histogram"
    );
    assert!(!text.contains(" summary\n"), "a summary is rendered");
    // End to end, and the gateway's own time (finer buckets: from 50 µs).
    for series in [
        "# TYPE gateway_request_duration_seconds histogram",
        r#"gateway_request_duration_seconds_bucket{api="messages",decision="admitted",le="0.005"}"#,
        "# TYPE gateway_added_seconds histogram",
        r#"gateway_added_seconds_bucket{api="chat",le="0.00005"}"#,
    ] {
        assert!(text.contains(series), "{series} missing from\n{text}");
    }
    promtool_accepts(&text);
    assert_eq!(gateway.get("/healthz").await, (200, "ok".to_owned()));
    gateway.stop().await;
}

#[tokio::test]
async fn x_priority_chooses_the_class_only_where_the_key_allows_it() {
    let (upstream, _) = fixed_upstream(Duration::ZERO).await;
    let config = fixed_config(&upstream).replace("tenant = \"team\"", "tenant = \"prio\"")
        + r#"
        [[keys]]
        name = "prio-free"
        key = "free-secret"
        tenant = "prio"
        default_class = "interactive"
        allow_priority_header = true
        "#;
    let gateway = Running::start(&config).await;
    let body = r#"{"model":"m","messages":[{"role":"user","content":"Hi"}]}"#;
    for (key, header) in [
        ("caller-secret", "interactive"),
        ("free-secret", "batch"),
        ("free-secret", "bogus"),
    ] {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", gateway.url))
            .bearer_auth(key)
            .header("x-priority", header)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
    let (_, text) = gateway.get("/metrics").await;
    let count = |class: &str| {
        let series = format!(
            r#"gateway_requests_total{{tenant="prio",api="chat",class="{class}",status="200"}} "#
        );
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .map(str::to_owned)
    };
    // The first key may not choose: its default (async) stands; the second may: batch, then
    // its default (interactive) for a value it does not know.
    assert_eq!(count("async").as_deref(), Some("1"));
    assert_eq!(count("batch").as_deref(), Some("1"));
    assert_eq!(count("interactive").as_deref(), Some("1"));
    gateway.stop().await;
}

/// Unknown routes and methods answer JSON in OpenAI's schema; a body without a `model` is a
/// 400 naming it, before anything is reserved.
#[tokio::test]
async fn unknown_routes_methods_and_models_get_json_errors() {
    let gateway = Running::start(&demo()).await;
    let (status, _, body) = json(gateway.post("/v1/nothing", Some(SEARCH), "{}").await).await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/nothing")
    );
    let (status, body) = gateway.get("/v1/chat/completions").await;
    assert_eq!(status, 405);
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["error"]["limit"], "method");
    let no_model = r#"{"messages":[{"role":"user","content":"Hi"}]}"#;
    let (status, _, body) = json(
        gateway
            .post("/v1/chat/completions", Some(SEARCH), no_model)
            .await,
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`model`"),
        "{body}"
    );
    gateway.stop().await;
}

/// A request the account's queue gives up on (its class's wait passed) is a 429 that says
/// when to come back.
#[tokio::test]
async fn a_queue_wait_refusal_carries_retry_after() {
    let (upstream, _seen) = fixed_upstream(Duration::ZERO).await;
    // One request a minute, interactive keys (a 5 s wait at most).
    let config = fixed_config(&upstream)
        .replace("requests_per_minute = 600", "requests_per_minute = 1")
        .replace(
            "tenant = \"team\"",
            "tenant = \"team\"\n        default_class = \"interactive\"",
        );
    let gateway = Running::start(&config).await;
    let body = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hi"}]}"#;
    let first = gateway
        .post("/v1/chat/completions", Some("caller-secret"), body)
        .await;
    assert_eq!(first.status(), 200);
    let (status, retry_after, body) = json(
        gateway
            .post("/v1/chat/completions", Some("caller-secret"), body)
            .await,
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["limit"], "queue_wait", "{body}");
    assert!(
        body["error"]["retry_after"]
            .as_f64()
            .is_some_and(|w| w > 0.0),
        "{body}"
    );
    assert!(retry_after.is_some(), "a Retry-After header");
    gateway.stop().await;
}

/// A stream the caller cuts before its usage is charged in the ledger what was streamed, as
/// the budget charges it: the estimate's input, the output streamed, not `max_tokens`.
#[tokio::test]
async fn a_cut_stream_is_charged_what_it_streamed_in_the_ledger() {
    let (upstream, _seen) = fixed_upstream(Duration::from_millis(300)).await;
    let gateway = Running::start(&fixed_config(&upstream)).await;
    let body = r#"{"model":"gpt-4o-mini","stream":true,"max_tokens":500,"messages":[{"role":"user","content":"Hi"}]}"#;
    let mut response = gateway
        .post("/v1/chat/completions", Some("caller-secret"), body)
        .await;
    assert_eq!(response.status(), 200);
    // The first event ("Hel"), then the caller goes.
    let first = response.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    drop(response);
    let started = std::time::Instant::now();
    let usage = loop {
        let usage = gateway.usage("team").await;
        if usage["output_tokens"] != 0 || usage["input_tokens"] != 0 {
            break usage;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "never counted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // "Hel": 3 characters streamed, a token; far below the 500 reserved.
    assert_eq!(usage["output_tokens"], 1, "{usage}");
    assert!(usage["input_tokens"].as_u64().unwrap() > 0);
    gateway.stop().await;
}

/// Each caller sees its own scope's rate-limit headers, never the account's: globex its 20
/// requests and 6,000 tokens a minute, in each API's names.
#[tokio::test]
async fn each_tenant_sees_its_own_rate_limit_headers() {
    let gateway = Running::start(&demo()).await;
    let response = gateway
        .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
        .await;
    assert_eq!(response.status(), 200);
    let headers = response.headers();
    assert_eq!(headers["x-ratelimit-limit-requests"], "20");
    // What may go at once now: the node's bucket (its whole minute, unless it sets a burst)
    // less the one just sent.
    let remaining: u64 = headers["x-ratelimit-remaining-requests"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(remaining, 20 - 1);
    assert_eq!(headers["x-ratelimit-limit-tokens"], "6000");
    assert!(headers.contains_key("x-ratelimit-reset-tokens"));
    let response = gateway
        .post("/v1/messages", Some(GLOBEX), &messages(20))
        .await;
    assert_eq!(response.status(), 200);
    let headers = response.headers();
    assert_eq!(headers["anthropic-ratelimit-requests-limit"], "20");
    assert!(
        headers
            .keys()
            .filter(|name| name.as_str().starts_with("anthropic-ratelimit-"))
            .all(|name| name.as_str().contains("-requests-") || name.as_str().contains("-tokens-")),
        "{headers:?}"
    );
    // acme/search: its node's 60,000 tokens; the account's 600 requests never show.
    let response = gateway
        .post("/v1/chat/completions", Some(SEARCH), &chat(20))
        .await;
    let headers = response.headers();
    assert_eq!(headers["x-ratelimit-limit-tokens"], "60000");
    assert!(
        !headers.contains_key("x-ratelimit-limit-requests"),
        "{headers:?}"
    );
    gateway.stop().await;
}

/// `--check-config`: a valid configuration is summarized; an invalid one is refused with its
/// reason (a guarantee out of range, here), before anything starts.
#[test]
fn a_configuration_is_checked_without_starting() {
    use tower_llm_quota_gateway::Config;
    let summary = Config::from_toml(&demo()).unwrap().summary();
    assert!(
        summary.starts_with("configuration OK: 3 account(s)"),
        "{summary}"
    );
    assert!(summary.contains("3 key(s), 4 tenant node(s)"), "{summary}");
    let bad = demo().replace("guarantee = 0.6", "guarantee = 1.6");
    let error = Config::from_toml(&bad).unwrap_err().to_string();
    assert!(error.contains("a guarantee outside [0, 1]"), "{error}");
}

/// The binary's `--check-config` on the README's example configuration, through the one
/// validation start and reload use: valid with the variables it names set; without them,
/// exit status 1 and every unset variable named once, with its line (start would fail on
/// them); a bad value named; `otlp_endpoint` refused by a binary built without OpenTelemetry.
#[test]
fn the_binary_checks_the_reference_example() {
    let readme = include_str!("../../README.md");
    let example = readme
        .split("### An example\n\n```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the README has an example configuration");
    let dir = std::env::temp_dir();
    let file = |name: &str, text: &str| {
        let path = dir.join(format!(
            "llm-quota-gateway-{name}-{}.toml",
            std::process::id()
        ));
        std::fs::write(&path, text).unwrap();
        path
    };
    let good = file("example", example);
    let bad = file(
        "bad",
        &example.replace("idle_timeout_seconds = 60", "idle_timeout_seconds = -1"),
    );
    let otel = file(
        "otel",
        &example.replace(
            "[server]\n",
            "[server]\notlp_endpoint = \"http://127.0.0.1:4318\"\n",
        ),
    );
    let variables = [
        "GATEWAY_ADMIN_TOKEN",
        "OPENAI_API_KEY",
        "AZURE_OPENAI_KEY",
        "ANTHROPIC_API_KEY",
        "ACME_SEARCH_KEY",
    ];
    let run = |path: &std::path::Path, set: bool| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_llm-quota-gateway"));
        command.arg("--check-config").arg(path);
        for var in variables {
            if set {
                command.env(var, format!("value-of-{var}"));
            } else {
                command.env_remove(var);
            }
        }
        command.output().unwrap()
    };
    let (ok, unset, refused, otel_run) = (
        run(&good, true),
        run(&good, false),
        run(&bad, true),
        run(&otel, true),
    );
    for path in [&good, &bad, &otel] {
        let _ = std::fs::remove_file(path);
    }
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(
        stdout.starts_with("configuration OK: 3 account(s) (openai-main, azure-east, anthropic-main), 1 key(s), 2 tenant node(s)"),
        "{stdout}"
    );
    assert_eq!(unset.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&unset.stderr);
    assert!(
        stderr.contains("5 problems in the configuration"),
        "{stderr}"
    );
    for var in variables {
        assert_eq!(stderr.matches(var).count(), 1, "{var}: {stderr}");
    }
    let line = |needle: &str| example.lines().position(|l| l.contains(needle)).unwrap() + 1;
    let admin = line("GATEWAY_ADMIN_TOKEN");
    assert!(
        stderr.contains(&format!("line {admin}: the admin token")),
        "{stderr}"
    );
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("idle_timeout_seconds"), "{stderr}");
    let stderr = String::from_utf8_lossy(&otel_run.stderr);
    if cfg!(feature = "otel") {
        assert!(otel_run.status.success(), "{stderr}");
    } else {
        assert_eq!(otel_run.status.code(), Some(1));
        assert!(stderr.contains("without the `otel` feature"), "{stderr}");
    }
}

/// A tenant's limits hold over every account it uses: globex's 20 requests a minute are 20
/// over the OpenAI and the Anthropic accounts together (before, each account held a copy of
/// the tree, and globex got 20 on each).
#[tokio::test]
async fn a_tenant_s_limit_holds_over_both_accounts() {
    let gateway = Running::start(&demo()).await;
    for _ in 0..10 {
        let chat = gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await;
        assert_eq!(chat.status(), 200);
        let messages = gateway
            .post("/v1/messages", Some(GLOBEX), &messages(20))
            .await;
        assert_eq!(messages.status(), 200);
    }
    for (path, body) in [
        ("/v1/chat/completions", chat(20)),
        ("/v1/messages", messages(20)),
    ] {
        let response = gateway.post(path, Some(GLOBEX), &body).await;
        assert_eq!(response.status(), 429, "{path}");
        assert!(response.headers().contains_key("retry-after"));
    }
    gateway.stop().await;
}

/// `GET /v1/models` lists the models the caller's key may use, in OpenAI's format or, with
/// `anthropic-version`, Anthropic's; a model not configured, or not for this key, or not on
/// this API, is a 404 naming it (`model_not_found`), and nothing is reserved; an alias is
/// renamed upstream.
#[tokio::test]
async fn models_are_listed_per_key_and_an_unknown_one_is_a_404() {
    let gateway = Running::start(&demo()).await;
    let list = |key: &'static str, anthropic: bool| {
        let url = format!("{}/v1/models", gateway.url);
        async move {
            let mut request = reqwest::Client::new().get(url).bearer_auth(key);
            if anthropic {
                request = request.header("anthropic-version", "2023-06-01");
            }
            json(request.send().await.unwrap()).await
        }
    };
    let ids = |body: &serde_json::Value| -> Vec<String> {
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let (status, _, body) = list(SEARCH, false).await;
    assert_eq!((status, body["object"].as_str()), (200, Some("list")));
    assert_eq!(
        ids(&body),
        [
            "gpt-4o-mini",
            "gpt-4o",
            "text-embedding-3-small",
            "claude-sonnet",
            "gemini-2.5-flash"
        ]
    );
    assert_eq!(body["data"][0]["owned_by"], "openai-sim");
    let (_, _, body) = list(GLOBEX, true).await;
    assert_eq!(ids(&body), ["gpt-4o-mini", "claude-sonnet"]);
    assert_eq!(body["data"][0]["type"], "model");
    assert_eq!(
        (body["first_id"].as_str(), body["has_more"].as_bool()),
        (Some("gpt-4o-mini"), Some(false))
    );
    let (status, _, _) = list("not-a-key", false).await;
    assert_eq!(status, 401);

    let with_model = |model: &str| chat(20).replace("gpt-4o-mini", model);
    let before = gateway.simulator("openai-sim").await.1;
    for (key, model, why) in [
        (SEARCH, "gpt-5-unknown", "not configured"),
        (GLOBEX, "gpt-4o", "not for this key"),
        (SEARCH, "claude-sonnet", "not on this API"),
    ] {
        let (status, _, body) = json(
            gateway
                .post("/v1/chat/completions", Some(key), &with_model(model))
                .await,
        )
        .await;
        assert_eq!(status, 404, "{why}: {body}");
        assert_eq!(body["error"]["code"], "model_not_found", "{why}: {body}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(model),
            "{why}: {body}"
        );
    }
    let (status, _, body) = json(
        gateway
            .post(
                "/v1/messages",
                Some(SEARCH),
                &messages(20).replace("claude-sonnet", "nope"),
            )
            .await,
    )
    .await;
    assert_eq!(
        (status, body["error"]["type"].as_str()),
        (404, Some("not_found_error"))
    );
    let after = gateway.simulator("openai-sim").await.1;
    assert_eq!(after, before, "nothing reached the provider");
    // `claude-sonnet` is `claude-sonnet-4-5` upstream: the simulator answers with that name.
    let (status, _, body) = json(
        gateway
            .post("/v1/messages", Some(SEARCH), &messages(20))
            .await,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "claude-sonnet-4-5", "{body}");
    // One model by its id.
    let one = reqwest::Client::new()
        .get(format!("{}/v1/models/gpt-4o", gateway.url))
        .bearer_auth(GLOBEX)
        .send()
        .await
        .unwrap();
    assert_eq!(one.status(), 404);
    gateway.stop().await;
}

/// Each provider's own key header upstream: `authorization: Bearer` for OpenAI, `api-key`
/// for Azure, `x-api-key` for Anthropic; never the caller's key.
#[tokio::test]
async fn the_provider_key_goes_in_the_provider_s_header() {
    for (profile, header, value) in [
        ("openai", "authorization", "Bearer sk-upstream-secret"),
        ("azure_openai", "api-key", "sk-upstream-secret"),
        ("anthropic", "x-api-key", "sk-upstream-secret"),
    ] {
        let (upstream, seen) = fixed_upstream(Duration::ZERO).await;
        let (api, path, body) = match profile {
            "anthropic" => ("messages", "/v1/messages", messages(20)),
            _ => ("chat", "/v1/chat/completions", chat(20)),
        };
        let config = fixed_config(&upstream)
            .replace("profile = \"openai\"", &format!("profile = \"{profile}\""))
            .replace("apis = [\"chat\"]", &format!("apis = [\"{api}\"]"));
        let gateway = Running::start(&config).await;
        gateway.post(path, Some("caller-secret"), &body).await;
        let headers = seen.lock().unwrap().clone();
        assert_eq!(headers.len(), 1, "{profile}");
        assert_eq!(headers[0][header], value, "{profile}");
        let others = ["authorization", "api-key", "x-api-key"];
        for other in others.iter().filter(|name| **name != header) {
            assert!(!headers[0].contains_key(*other), "{profile}: {other} sent");
        }
        gateway.stop().await;
    }
}

/// A spent daily cap is a 429 that says when the day turns (midnight UTC), as every 429 the
/// gateway sends says when to come back.
#[tokio::test]
async fn a_spent_daily_cap_says_when_the_day_turns() {
    let (upstream, _) = fixed_upstream(Duration::ZERO).await;
    let config = fixed_config(&upstream).replace(
        "[[keys]]",
        "[tenants.nodes.team]\n        daily = [{ dimension = \"requests\", amount = 1, window = \"calendar_utc\" }]\n        [[keys]]",
    );
    let gateway = Running::start(&config).await;
    let first = gateway
        .post("/v1/chat/completions", Some("caller-secret"), &chat(20))
        .await;
    assert_eq!(first.status(), 200);
    first.bytes().await.unwrap();
    let (status, retry_after, body) = json(
        gateway
            .post("/v1/chat/completions", Some("caller-secret"), &chat(20))
            .await,
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["limit"], "requests_per_day");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let to_midnight = 86_400 - now % 86_400;
    let told: u64 = retry_after.expect("a Retry-After").parse().unwrap();
    assert!(
        told.abs_diff(to_midnight) <= 2,
        "told {told}, midnight in {to_midnight}"
    );
    gateway.stop().await;
}

/// An upstream answering every chat completion with one JSON body, framed by its
/// `Content-Length` or, with `chunked`, sent in two chunks of no announced length: its URL and
/// the calls it answered.
async fn json_upstream(chunked: bool) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = calls.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move || {
            let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            async move {
                let body = format!(
                    r#"{{"id":"chatcmpl-{n}","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"answer {n}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}}}"#
                );
                let body = match chunked {
                    false => Body::from(body),
                    true => {
                        let (head, tail) = body.split_at(body.len() / 2);
                        let parts = [head.to_owned(), tail.to_owned()]
                            .map(|part| Ok::<_, std::io::Error>(Bytes::from(part)));
                        Body::from_stream(futures::stream::iter(parts))
                    }
                };
                ([("content-type", "application/json")], body)
            }
        }),
    );
    let url = crate::support::serve_upstream(app).await;
    (url, calls)
}

/// The same `Idempotency-Key` three times in a row, each after the last completed, on a
/// non-streamed answer of an HTTP upstream, framed by its length or chunked, with records in
/// memory or in Redis: one upstream call, the same answer three times.
#[tokio::test]
async fn a_completed_answer_is_replayed_for_its_key() {
    let redis = crate::redis_server::RedisServer::start();
    for chunked in [false, true] {
        for shared in [false, true] {
            let (upstream, calls) = json_upstream(chunked).await;
            let gateway = match shared {
                false => Running::start(&fixed_config(&upstream)).await,
                true => Running::start_shared(&fixed_config(&upstream), &redis.url()).await,
            };
            replays_once(&gateway, &calls, &format!("job-{chunked}-{shared}")).await;
            gateway.stop().await;
        }
    }
}

/// Three requests with `key`, then one with `key` and another body: one upstream call in all.
async fn replays_once(gateway: &Running, calls: &std::sync::atomic::AtomicUsize, key: &str) {
    let body =
        r#"{"model":"gpt-4o-mini","max_tokens":20,"messages":[{"role":"user","content":"Hi"}]}"#;
    let mut answers = Vec::new();
    for _ in 0..3 {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", gateway.url))
            .bearer_auth("caller-secret")
            .header("idempotency-key", key)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{key}");
        answers.push(response.text().await.unwrap());
    }
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "{key}: {answers:?}"
    );
    assert!(answers.iter().all(|a| a == &answers[0]), "{answers:?}");
    // The same key for another body: a 422 naming the key, nothing sent.
    let other = body.replace("Hi", "Bye");
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .bearer_auth("caller-secret")
        .header("idempotency-key", key)
        .body(other)
        .send()
        .await
        .unwrap();
    let (status, _, refusal) = crate::support::json(response).await;
    assert_eq!(status, 422, "{key}: {refusal}");
    assert!(
        refusal["error"]["message"].as_str().unwrap().contains(key),
        "{refusal}"
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1, "{key}");
    // A header that cannot be a key (a space, a byte past ASCII, over 255 bytes): a 400
    // naming the header, not a provider's failure, and nothing sent.
    let long = "k".repeat(256);
    let bad: [&[u8]; 3] = [b"a b", &[b'k', 0xE9], long.as_bytes()];
    for value in bad {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", gateway.url))
            .bearer_auth("caller-secret")
            .header(
                "idempotency-key",
                http::HeaderValue::from_bytes(value).unwrap(),
            )
            .body(body)
            .send()
            .await
            .unwrap();
        let (status, _, refusal) = crate::support::json(response).await;
        assert_eq!(status, 400, "{value:?}: {refusal}");
        assert_eq!(refusal["error"]["limit"], "idempotency_key", "{refusal}");
        assert_eq!(refusal["error"]["gateway_decision"], "local", "{refusal}");
        let message = refusal["error"]["message"].as_str().unwrap();
        assert!(message.contains("Idempotency-Key header"), "{message}");
    }
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1, "{key}");
}

/// An upstream answering embeddings, legacy completions and Anthropic's token counting: the
/// paths it was asked.
async fn more_apis_upstream() -> (String, Arc<Mutex<Vec<String>>>) {
    let paths = Arc::new(Mutex::new(Vec::new()));
    let seen = paths.clone();
    let app = axum::Router::new().fallback(move |uri: http::Uri| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(uri.path().to_owned());
            let body = match uri.path() {
                "/v1/embeddings" => {
                    r#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1]}],"model":"text-embedding-3-small","usage":{"prompt_tokens":3,"total_tokens":3}}"#
                }
                "/v1/completions" => {
                    r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" world","finish_reason":"stop"}],"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}"#
                }
                _ => r#"{"input_tokens":14}"#,
            };
            ([("content-type", "application/json")], body)
        }
    });
    let url = crate::support::serve_upstream(app).await;
    (url, paths)
}

/// `/v1/embeddings`, `/v1/completions` and `/v1/messages/count_tokens` are served under the
/// account's admission, each answered as the provider answered it.
#[tokio::test]
async fn embeddings_completions_and_token_counting_are_served() {
    let (upstream, paths) = more_apis_upstream().await;
    let config = format!(
        r#"
        [server]
        admin_token = "admin"
        [[accounts]]
        name = "openai"
        base_url = "{upstream}"
        key = "sk-openai"
        profile = "openai"
        apis = ["embeddings", "completions"]
        quota = {{ requests_per_minute = 600, tokens_per_minute = 600000 }}
        [[accounts]]
        name = "anthropic"
        base_url = "{upstream}"
        key = "sk-anthropic"
        profile = "anthropic"
        apis = ["count_tokens"]
        quota = {{ requests_per_minute = 600, input_tokens_per_minute = 600000, output_tokens_per_minute = 100000 }}
        [[keys]]
        name = "team-key"
        key = "caller-secret"
        tenant = "team"
        "#
    );
    let gateway = Running::start(&config).await;
    let calls = [
        (
            "/v1/embeddings",
            r#"{"model":"text-embedding-3-small","input":["a cat","a mat"]}"#,
            "embedding",
        ),
        (
            "/v1/completions",
            r#"{"model":"gpt-3.5-turbo-instruct","prompt":"Hello","max_tokens":5}"#,
            "text_completion",
        ),
        (
            "/v1/messages/count_tokens",
            r#"{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}"#,
            "input_tokens",
        ),
    ];
    for (path, body, expected) in calls {
        let response = gateway.post(path, Some("caller-secret"), body).await;
        let status = response.status();
        let text = response.text().await.unwrap();
        assert_eq!(status, 200, "{path}: {text}");
        assert!(text.contains(expected), "{path}: {text}");
    }
    assert_eq!(
        *paths.lock().unwrap(),
        [
            "/v1/embeddings",
            "/v1/completions",
            "/v1/messages/count_tokens"
        ]
    );
    gateway.stop().await;
}

/// A tenant's tokens of the last minute are counted per account: 60-odd tokens sent to the
/// OpenAI account only show there, not on the Anthropic one too (before, each account
/// repeated the tenant's total), in `/status.json` and in the gauge.
#[tokio::test]
async fn a_tenant_s_minute_is_counted_per_account() {
    let gateway = Running::start(&demo()).await;
    let response = gateway
        .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
        .await;
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    let (_, text) = gateway.get("/status.json").await;
    let status: serde_json::Value = serde_json::from_str(&text).unwrap();
    let globex = (status["tenants"].as_array().unwrap().iter())
        .find(|t| t["node"]["path"] == "globex" || t["path"] == "globex")
        .unwrap_or_else(|| panic!("no globex in {status}"))
        .clone();
    let node = if globex["node"].is_object() {
        &globex["node"]
    } else {
        &globex
    };
    let used = |account: &str| {
        (node["accounts"].as_array().unwrap().iter())
            .find(|a| a["account"] == account)
            .unwrap()["used"]
            .as_u64()
            .unwrap()
    };
    assert!(used("openai-sim") > 0, "{node}");
    assert_eq!(used("anthropic-sim"), 0, "{node}");
    let (_, metrics) = gateway.get("/metrics").await;
    let gauge = |account: &str| {
        let series = format!(
            r#"gateway_tenant_used_tokens_per_minute{{tenant="globex",account="{account}"}} "#
        );
        (metrics.lines())
            .find_map(|l| l.strip_prefix(series.as_str()))
            .map(str::to_owned)
    };
    assert_eq!(gauge("anthropic-sim").as_deref(), Some("0"), "{metrics}");
    assert_ne!(gauge("openai-sim").as_deref(), Some("0"));
    gateway.stop().await;
}

/// The demo serves every endpoint its README lists, embeddings too: the simulator answers a
/// vector per input with its usage, and the gateway settles it.
#[tokio::test]
async fn the_demo_serves_embeddings() {
    let gateway = Running::start(&demo()).await;
    let body = r#"{"model":"text-embedding-3-small","input":["Hello there","General Kenobi"]}"#;
    let (status, _, answer) = json(gateway.post("/v1/embeddings", Some(SEARCH), body).await).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["object"], "list");
    let data = answer["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "a vector per input");
    assert_eq!(data[1]["index"], 1);
    assert_eq!(data[0]["embedding"].as_array().unwrap().len(), 8);
    let prompt = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 0, "{answer}");
    let account = gateway.status().await["accounts"][0].clone();
    assert_eq!(account["in_flight"], 0, "settled: {account}");
    gateway.stop().await;
}

/// `[server] metrics = false`: nothing recorded, `/metrics` a 404 that says why; requests
/// are served as before.
#[tokio::test]
async fn metrics_can_be_turned_off() {
    let (upstream, _) = fixed_upstream(Duration::ZERO).await;
    let config =
        fixed_config(&upstream).replace("[server]\n", "[server]\n        metrics = false\n");
    let gateway = Running::start(&config).await;
    let response = gateway
        .post("/v1/chat/completions", Some("caller-secret"), &chat(20))
        .await;
    assert_eq!(response.status(), 200);
    let (status, body) = gateway.get("/metrics").await;
    assert_eq!(status, 404);
    assert!(body.contains("metrics = false"), "{body}");
    gateway.stop().await;
}
