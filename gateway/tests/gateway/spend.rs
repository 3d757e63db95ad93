//! Spend: a price table in the configuration, a key's monthly spend cap reserved before each
//! call, the spend export adding up to what was settled, and two replicas on one Redis that
//! never overshoot the cap.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;

use crate::redis_server::RedisServer;
use crate::support::Running;

/// The cap: $0.01 a calendar month on the key `team-key`.
const CAP: u64 = 10_000_000;

/// A simulated account far above the load, `gpt-4o-mini` at $2.50 per million input tokens
/// and $10 per million output (figures for the test's sake), and the key's monthly cap.
fn config() -> String {
    config_of(CAP, 100)
}

/// The same with a cap of `cap` nano-dollars, replicas renewing their leases every
/// `lease_ms` (0: asking Redis per admission).
fn config_of(cap: u64, lease_ms: u64) -> String {
    format!(
        r#"
        [server]
        admin_token = "admin"
        lease_refresh_ms = {lease_ms}
        [[accounts]]
        name = "sim"
        base_url = "sim"
        profile = "openai"
        apis = ["chat"]
        quota = {{ requests_per_minute = 60000, tokens_per_minute = 60000000 }}
        sim = {{ base_ms = 0, per_token_ms = 0 }}
        [prices]
        unpriced = "refuse"
        [prices.models."gpt-4o-mini"]
        input = "2.50"
        output = "10"
        [tenants.nodes."team/team-key"]
        caps = [{{ dimension = "spend", amount = {cap}, window = "calendar_month_utc" }}]
        [[keys]]
        name = "team-key"
        key = "caller-secret"
        tenant = "team"
        "#
    )
}

/// A request of a prompt made different by `n` (the simulator draws each answer's length
/// from its prompt), its answer at most 40 tokens.
fn body(n: u64) -> String {
    format!(
        r#"{{"model":"gpt-4o-mini","max_tokens":40,"messages":[{{"role":"user","content":"{n} {}"}}]}}"#,
        "word ".repeat(20 + (n % 30) as usize)
    )
}

/// The spend of an answer, from its usage (the test's own arithmetic): nano-dollars,
/// rounded up once.
fn spend_of(answer: &Value) -> u64 {
    let usage = &answer["usage"];
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    let output = usage["completion_tokens"].as_u64().unwrap();
    // Pico-dollars a token: 2,500,000 input (the cache priced as input: no price given),
    // 10,000,000 output.
    let pico = (prompt - cached) * 2_500_000 + cached * 2_500_000 + output * 10_000_000;
    pico.div_ceil(1_000)
}

/// What one caller saw: the spend of its answers, how many, the cap's refusal, and how many
/// times the shared store was out of reach (a Redis call past its timeout on a busy machine:
/// refused with a 503, retried as an SDK would).
struct Caller {
    spent: u64,
    answered: u64,
    refusal: Value,
    unreachable: u64,
}

/// One caller: requests until the cap refuses one.
async fn spend_until_refused(gateway: &Running, next: &AtomicU64) -> Caller {
    spend_until_refused_as(gateway, next, "caller-secret").await
}

/// The same with the caller key `key`.
async fn spend_until_refused_as(gateway: &Running, next: &AtomicU64, key: &str) -> Caller {
    let (mut spent, mut answered, mut unreachable) = (0, 0, 0);
    loop {
        let n = next.fetch_add(1, Ordering::Relaxed);
        let response = gateway
            .post("/v1/chat/completions", Some(key), &body(n))
            .await;
        let status = response.status().as_u16();
        let retry_after = response.headers().get("retry-after").cloned();
        let answer: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
        if status == 200 {
            spent += spend_of(&answer);
            answered += 1;
            continue;
        }
        if status == 503 && answer["error"]["limit"] == "store" {
            unreachable += 1;
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            continue;
        }
        assert_eq!(status, 429, "{answer}");
        let seconds: u64 = retry_after
            .expect("a refusal says when the month ends")
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(seconds > 0 && seconds <= 31 * 86_400, "{seconds}");
        return Caller {
            spent,
            answered,
            refusal: answer,
            unreachable,
        };
    }
}

async fn export(gateway: &Running, format: &str) -> String {
    reqwest::Client::new()
        .get(format!(
            "{}/admin/report?table=spend&format={format}",
            gateway.url
        ))
        .bearer_auth("admin")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The export's requests and spend, summed over its rows (JSON).
async fn reported(gateway: &Running) -> (u64, u64) {
    let review: Value = serde_json::from_str(&export(gateway, "json").await).unwrap();
    let rows = review["spend"].as_array().unwrap();
    let sum = |name: &str| rows.iter().map(|r| r[name].as_u64().unwrap()).sum::<u64>();
    (sum("requests"), sum("spend_nano_usd"))
}

/// The export's requests and spend, summed over its rows (JSON), checked against its CSV.
async fn exported(gateway: &Running) -> (u64, u64) {
    let review: Value = serde_json::from_str(&export(gateway, "json").await).unwrap();
    let rows = review["spend"].as_array().unwrap();
    let sum = |name: &str| rows.iter().map(|r| r[name].as_u64().unwrap()).sum::<u64>();
    for row in rows {
        assert_eq!(
            (row["tenant"].as_str(), row["key"].as_str()),
            (Some("team"), Some("team-key"))
        );
        assert_eq!(row["model"], "gpt-4o-mini");
        assert_eq!(row["tier"], "standard");
    }
    let csv = export(gateway, "csv").await;
    let mut lines = csv.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("day,tenant,key,model,tier,requests")
    );
    let csv_spend: u64 = lines
        .map(|line| line.split(',').nth(10).unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(csv_spend, sum("spend_nano_usd"));
    (sum("requests"), sum("spend_nano_usd"))
}

/// What the key's node has used of its month, as `/admin/tenants` shows it.
async fn month_used(gateway: &Running) -> u64 {
    let response = gateway
        .admin(reqwest::Method::GET, "/tenants", "admin", Value::Null)
        .await;
    let tenants: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
    let node = tenants
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["path"] == "team/team-key")
        .unwrap_or_else(|| panic!("no node team/team-key in {tenants}"));
    let cap = &node["accounts"][0]["caps"][0];
    assert_eq!(cap["limit"], "spend_per_month", "{node}");
    cap["used"].as_u64().unwrap()
}

#[tokio::test]
async fn a_key_spend_cap_refuses_at_the_cap_and_the_export_adds_up() {
    let gateway = Running::start(&config()).await;
    let next = AtomicU64::new(0);
    let Caller {
        spent,
        answered,
        refusal,
        ..
    } = spend_until_refused(&gateway, &next).await;
    assert_eq!(refusal["error"]["limit"], "spend_per_month", "{refusal}");
    assert_eq!(
        refusal["error"]["scope"], "tenant:team/team-key",
        "{refusal}"
    );
    // At the cap within one request's spend (its prompt and 40 output tokens).
    assert!(spent <= CAP, "{spent} over {CAP}");
    assert!(CAP - spent < 2_000_000, "{spent} of {CAP}");
    // The budget settled each answer's usage at its prices; the export counts the same.
    assert_eq!(month_used(&gateway).await, spent);
    assert_eq!(exported(&gateway).await, (answered, spent));
    // An unpriced model is refused before it is sent.
    let response = gateway
        .post(
            "/v1/chat/completions",
            Some("caller-secret"),
            &body(0).replace("gpt-4o-mini", "gpt-unpriced"),
        )
        .await;
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_client_error(), "{status} {text}");
    assert!(text.contains("gpt-unpriced"), "{text}");
    gateway.stop().await;
}

/// Two replicas on one Redis, 50 callers on each against the key's monthly cap ($0.10), every
/// caller sending until refused, the replicas leasing their shares of the account or asking
/// Redis per admission: the spend of every answer, counted from outside, never exceeds the
/// cap (the requests set `max_tokens`: the estimate is never below the real spend), and the
/// shared export adds up to it.
#[tokio::test]
async fn two_replicas_never_overshoot_a_key_spend_cap() {
    for lease_ms in [100, 0] {
        two_replicas_against_a_cap(lease_ms).await;
    }
}

async fn two_replicas_against_a_cap(lease_ms: u64) {
    const CAP: u64 = 100_000_000;
    let redis = RedisServer::start();
    let config = config_of(CAP, lease_ms);
    let first = Arc::new(Running::start_shared(&config, &redis.url()).await);
    let second = Arc::new(Running::start_shared(&config, &redis.url()).await);
    let next = Arc::new(AtomicU64::new(0));
    let mut callers = Vec::new();
    for replica in [&first, &second] {
        for _ in 0..50 {
            let (replica, next) = (Arc::clone(replica), Arc::clone(&next));
            callers.push(tokio::spawn(async move {
                spend_until_refused(&replica, &next).await
            }));
        }
    }
    let (mut spent, mut answered, mut unreachable) = (0, 0, 0);
    for caller in callers {
        let caller = caller.await.unwrap();
        let refusal = &caller.refusal;
        assert_eq!(refusal["error"]["limit"], "spend_per_month", "{refusal}");
        spent += caller.spent;
        answered += caller.answered;
        unreachable += caller.unreachable;
    }
    eprintln!(
        "two replicas (lease {lease_ms} ms), 100 callers: {answered} answers spent {spent} of \
         {CAP} nano-dollars ({:.4}x the cap); the store out of reach {unreachable} times",
        spent as f64 / CAP as f64
    );
    assert!(spent <= CAP, "overshoot: {spent} over {CAP}");
    // Within a request of the cap, but for what each call whose reply was lost may have
    // reserved in Redis (counted there, never answered: the safe side).
    let left = 2_000_000 * (1 + unreachable);
    assert!(
        CAP - spent < left,
        "{spent} of {CAP}: more than {left} left"
    );
    // Each replica adds its counters to the shared report every two seconds.
    let started = std::time::Instant::now();
    while reported(&first).await != (answered, spent) {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "the report never counted {answered} answers and {spent} spent"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(exported(&first).await, (answered, spent));
    for replica in [first, second] {
        Arc::into_inner(replica).unwrap().stop().await;
    }
}

/// A webhook receiver on loopback: it refuses its first `failing` posts with a 500, then
/// takes every event; its URL and what it took.
async fn webhook(failing: usize) -> (String, Arc<std::sync::Mutex<Vec<Value>>>) {
    use axum::routing::post;
    let taken = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::new(AtomicU64::new(0));
    let (store, count) = (taken.clone(), seen.clone());
    let app = axum::Router::new().route(
        "/hook",
        post(move |body: axum::body::Bytes| {
            let (store, count) = (store.clone(), count.clone());
            async move {
                if count.fetch_add(1, Ordering::Relaxed) < failing as u64 {
                    return http::StatusCode::INTERNAL_SERVER_ERROR;
                }
                store
                    .lock()
                    .unwrap()
                    .push(serde_json::from_slice::<Value>(&body).unwrap());
                http::StatusCode::NO_CONTENT
            }
        }),
    );
    let url = crate::support::serve_upstream(app).await;
    (format!("{url}/hook"), taken)
}

/// Waits until `taken` holds `n` events (at most 20 s).
async fn events(taken: &std::sync::Mutex<Vec<Value>>, n: usize) -> Vec<Value> {
    let started = std::time::Instant::now();
    loop {
        let events = taken.lock().unwrap().clone();
        if events.len() >= n || started.elapsed() > std::time::Duration::from_secs(20) {
            return events;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The configuration of the alert tests: prices, no cap, an alert of `amount` on `tenant` at
/// 50, 80 and 100 %, posted to `hook`; the audit log in `audit` when given.
fn alert_config(tenant: &str, amount: u64, hook: &str, audit: Option<&str>) -> String {
    let audit = audit.map_or_else(String::new, |path| format!("audit_log = \"{path}\""));
    config_of(CAP, 100)
        .replace(
            "admin_token = \"admin\"",
            &format!("admin_token = \"admin\"\n        alert_webhook = \"{hook}\"\n        {audit}"),
        )
        .replace(
            &format!(
                "[tenants.nodes.\"team/team-key\"]\n        caps = [{{ dimension = \"spend\", amount = {CAP}, window = \"calendar_month_utc\" }}]"
            ),
            &format!(
                "[[spend_alerts]]\n        tenant = \"{tenant}\"\n        amount = {amount}\n        window = \"calendar_month_utc\"\n        thresholds = [100, 50, 80]"
            ),
        )
        .replace("tenant = \"team\"", &format!("tenant = \"{tenant}\""))
}

/// An alert of $0.005 a month on a tenant without a cap (the warn-only mode): requests go on
/// past it, never refused; each threshold is raised once, when the answer that crossed it was
/// counted, as an audit line, a metric and a webhook post that the receiver refused once
/// (retried after half a second).
#[tokio::test]
async fn spend_alerts_fire_once_each_and_never_refuse() {
    const AMOUNT: u64 = 5_000_000;
    let (hook, taken) = webhook(1).await;
    let audit = std::env::temp_dir().join(format!("alerts-audit-{}.log", std::process::id()));
    let audit_path = audit.to_str().unwrap().to_owned();
    // Written in dollars: $0.005.
    let config = alert_config("alerts", AMOUNT, &hook, Some(&audit_path))
        .replace(&format!("amount = {AMOUNT}\n"), "amount_usd = \"0.005\"\n");
    assert!(config.contains("amount_usd = \"0.005\""), "{config}");
    let gateway = Running::start(&config).await;
    // Until 150 % of the amount: every request answered.
    let (mut spent, mut steps) = (0, Vec::new());
    for n in 0.. {
        let response = gateway
            .post("/v1/chat/completions", Some("caller-secret"), &body(n))
            .await;
        assert_eq!(response.status(), 200, "warn-only: never refused");
        let answer: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
        spent += spend_of(&answer);
        steps.push(spent);
        if spent * 2 >= AMOUNT * 3 {
            break;
        }
    }
    let events = events(&taken, 3).await;
    let thresholds: Vec<u64> = events
        .iter()
        .map(|e| e["threshold_percent"].as_u64().unwrap())
        .collect();
    assert_eq!(thresholds, [50, 80, 100], "{events:?}");
    for event in &events {
        assert_eq!(event["event"], "spend_threshold");
        assert_eq!(event["tenant"], "alerts");
        assert_eq!(event["window"], "calendar_month_utc");
        assert_eq!(event["amount_nano_usd"], AMOUNT);
        assert_eq!(event["amount_usd"], "0.005", "{event}");
        // Raised by the very answer that crossed it: the spend then is the first of the
        // running totals at or above the threshold.
        let level = AMOUNT * event["threshold_percent"].as_u64().unwrap() / 100;
        let first = *steps.iter().find(|&&s| s >= level).unwrap();
        assert_eq!(event["spent_nano_usd"], first, "{event}");
        assert!(
            event["period_start"]
                .as_str()
                .unwrap()
                .ends_with("-01T00:00:00.000Z")
        );
    }
    let (_, metrics) = gateway.get("/metrics").await;
    for threshold in ["50", "80", "100"] {
        let line =
            format!("gateway_spend_alerts_total{{tenant=\"alerts\",threshold=\"{threshold}\"}} 1");
        assert!(metrics.contains(&line), "{line} not in the metrics");
    }
    assert!(metrics.contains("gateway_alert_webhook_failures_total"));
    gateway.stop().await;
    let lines = std::fs::read_to_string(&audit).unwrap();
    std::fs::remove_file(&audit).unwrap();
    let raised = lines
        .lines()
        .filter(|line| line.contains("\"spend_threshold\""))
        .count();
    assert_eq!(raised, 3, "{lines}");
    // No more events came meanwhile.
    assert_eq!(taken.lock().unwrap().len(), 3);
}

/// Two replicas on one Redis, 20 callers each past an alert's amount: each threshold raised
/// once over both (the count is Redis's, and exactly one answer's addition crosses it).
#[tokio::test]
async fn a_spend_alert_fires_once_over_the_replicas() {
    const AMOUNT: u64 = 20_000_000;
    let redis = RedisServer::start();
    let (hook, taken) = webhook(0).await;
    let config = alert_config("fleet", AMOUNT, &hook, None);
    let first = Arc::new(Running::start_shared(&config, &redis.url()).await);
    let second = Arc::new(Running::start_shared(&config, &redis.url()).await);
    let (next, spent) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut callers = Vec::new();
    for replica in [&first, &second] {
        for _ in 0..20 {
            let (replica, next, spent) =
                (Arc::clone(replica), Arc::clone(&next), Arc::clone(&spent));
            callers.push(tokio::spawn(async move {
                while spent.load(Ordering::Relaxed) * 2 < AMOUNT * 3 {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let response = replica
                        .post("/v1/chat/completions", Some("caller-secret"), &body(n))
                        .await;
                    if response.status() != 200 {
                        continue; // a busy machine's unreachable store: asked again
                    }
                    let answer: Value =
                        serde_json::from_str(&response.text().await.unwrap()).unwrap();
                    spent.fetch_add(spend_of(&answer), Ordering::Relaxed);
                }
            }));
        }
    }
    for caller in callers {
        caller.await.unwrap();
    }
    let events = events(&taken, 3).await;
    let mut thresholds: Vec<u64> = events
        .iter()
        .map(|e| e["threshold_percent"].as_u64().unwrap())
        .collect();
    thresholds.sort_unstable();
    assert_eq!(thresholds, [50, 80, 100], "{events:?}");
    eprintln!(
        "a spend alert over two replicas: {} events for {} nano-dollars spent",
        events.len(),
        spent.load(Ordering::Relaxed)
    );
    for replica in [first, second] {
        Arc::into_inner(replica).unwrap().stop().await;
    }
    assert_eq!(taken.lock().unwrap().len(), 3, "each threshold once");
}

/// At the cap, degrade: `gpt-4o` falls back to `gpt-4o-mini` (a sixteenth of its price) for
/// the key's requests its cap can no longer pay, saying so in `x-llm-quota-fallback`, until
/// the cheaper one cannot be paid either; the cap holds over both.
#[tokio::test]
async fn at_the_cap_a_request_degrades_to_a_cheaper_model() {
    // $0.04 a month: a few requests of the dearer model.
    const CAP: u64 = 40_000_000;
    let config = config_of(CAP, 100).replace(
        "[prices.models.\"gpt-4o-mini\"]",
        "[prices.models.\"gpt-4o\"]\n        input = \"40\"\n        output = \"160\"\n        [prices.models.\"gpt-4o-mini\"]",
    ) + r#"
        [[models]]
        name = "gpt-4o"
        account = "sim"
        fallbacks = [{ account = "sim", model = "gpt-4o-mini", on = ["spend_capped"] }]
        [[models]]
        name = "gpt-4o-mini"
        account = "sim"
        "#;
    let gateway = Running::start(&config).await;
    let (mut primary, mut degraded, mut spent) = (0, 0, 0);
    for n in 0.. {
        let response = gateway
            .post(
                "/v1/chat/completions",
                Some("caller-secret"),
                &body(n).replace("gpt-4o-mini", "gpt-4o"),
            )
            .await;
        let status = response.status().as_u16();
        let fallback = response
            .headers()
            .get("x-llm-quota-fallback")
            .map(|v| v.to_str().unwrap().to_owned());
        let answer: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
        if status == 429 {
            assert_eq!(answer["error"]["limit"], "spend_per_month", "{answer}");
            break;
        }
        assert_eq!(status, 200, "{answer}");
        match fallback.as_deref() {
            None => {
                assert_eq!(degraded, 0, "the primary again after a degraded answer");
                primary += 1;
                // $40 and $160 a million: sixteen times the cheaper model's prices.
                spent += spend_of(&answer) * 16;
            }
            Some("spend_capped") => {
                degraded += 1;
                spent += spend_of(&answer);
            }
            Some(other) => panic!("fallback for {other}"),
        }
    }
    eprintln!(
        "at the cap: {primary} answers of the primary, then {degraded} degraded; \
         {spent} of {CAP} nano-dollars"
    );
    assert!(primary > 0 && degraded > 0, "{primary} then {degraded}");
    assert!(spent <= CAP, "{spent} over {CAP}");
    gateway.stop().await;
}

/// A simulated account with a cap of its own ($0.01 a calendar month), no tenant capped;
/// `scoped`: each model in buckets of its own behind the account's gate.
fn account_cap_config(scoped: bool) -> String {
    let limits = "{ requests_per_minute = 60000, tokens_per_minute = 60000000 }";
    let quota = if scoped {
        format!("quota = {{ requests_per_minute = 60000 }}\n        model_quota = {limits}")
    } else {
        format!("quota = {limits}")
    };
    format!(
        r#"
        [server]
        admin_token = "admin"
        [[accounts]]
        name = "sim"
        base_url = "sim"
        profile = "openai"
        apis = ["chat"]
        {quota}
        caps = [{{ dimension = "spend", amount = {CAP}, window = "calendar_month_utc" }}]
        sim = {{ base_ms = 0, per_token_ms = 0 }}
        [prices]
        unpriced = "refuse"
        [prices.models."gpt-4o-mini"]
        input = "2.50"
        output = "10"
        [[keys]]
        name = "team-key"
        key = "caller-secret"
        tenant = "team"
        [[keys]]
        name = "other-key"
        key = "other-secret"
        tenant = "other"
        [[spend_alerts]]
        account = "sim"
        amount = {CAP}
        window = "calendar_month_utc"
        thresholds = [50]
        "#
    )
}

/// An account's monthly spend cap (`caps` of `[[accounts]]`), with per-model scopes or
/// without: four callers of two tenants spend until refused; the spend counted from their
/// answers never exceeds the cap and stops within a request of it; each refusal is a 429
/// `spend_per_month` scoped to the account, with a `Retry-After` to the month's end; the
/// account's spend alert at half the cap is raised once.
#[tokio::test]
async fn an_account_spend_cap_refuses_at_the_cap_with_scopes_or_without() {
    for (run, scoped) in [false, true].into_iter().enumerate() {
        let gateway = Arc::new(Running::start(&account_cap_config(scoped)).await);
        let next = Arc::new(AtomicU64::new(0));
        let callers: Vec<_> = (0..4)
            .map(|i| {
                let (gateway, next) = (Arc::clone(&gateway), Arc::clone(&next));
                tokio::spawn(async move {
                    if i % 2 == 0 {
                        spend_until_refused(&gateway, &next).await
                    } else {
                        spend_until_refused_as(&gateway, &next, "other-secret").await
                    }
                })
            })
            .collect();
        let mut spent = 0;
        for caller in callers {
            let caller = caller.await.unwrap();
            let error = &caller.refusal["error"];
            assert_eq!(error["limit"], "spend_per_month", "{error}");
            assert_eq!(error["scope"], "account:sim", "{error}");
            spent += caller.spent;
        }
        eprintln!(
            "account cap (scoped: {scoped}): {spent} of {CAP} nano-dollars ({:.4}x)",
            spent as f64 / CAP as f64
        );
        assert!(spent <= CAP, "{spent} over {CAP}");
        assert!(CAP - spent < 2_000_000, "{spent} of {CAP}");
        // The status shows the account's month: what its answers spent, at their prices.
        let status = reqwest::get(format!("{}/status.json", gateway.url))
            .await
            .unwrap();
        let status: Value = serde_json::from_str(&status.text().await.unwrap()).unwrap();
        let account = status["accounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["name"] == "sim")
            .unwrap();
        let cap = &account["caps"][0];
        assert_eq!(cap["limit"], "spend_per_month", "{account}");
        assert_eq!(
            (cap["amount"].as_u64(), cap["used"].as_u64()),
            (Some(CAP), Some(spent))
        );
        // Once in each run (the process's recorder counts both).
        let (_, metrics) = gateway.get("/metrics").await;
        let alert = format!(
            "gateway_spend_alerts_total{{account=\"sim\",threshold=\"50\"}} {}",
            run + 1
        );
        assert!(metrics.contains(&alert), "{alert} missing");
        Arc::into_inner(gateway).unwrap().stop().await;
    }
}

/// Money in dollars: a cap written `amount_usd = "0.01"` is the same cap as 10,000,000
/// nano-dollars; `/status.json` shows it and its use in dollars beside the integers; the
/// admin API takes a spend limit as `amount_usd`.
#[tokio::test]
async fn spend_is_written_and_shown_in_dollars() {
    let config = config().replace(
        &format!("amount = {CAP}, window"),
        "amount_usd = \"0.01\", window",
    );
    assert!(config.contains("amount_usd"), "{config}");
    let gateway = Running::start(&config).await;
    let response = gateway
        .post("/v1/chat/completions", Some("caller-secret"), &body(1))
        .await;
    assert_eq!(response.status(), 200);
    let answer: Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    let spent = spend_of(&answer);
    let (_, text) = gateway.get("/status.json").await;
    let status: Value = serde_json::from_str(&text).unwrap();
    let key = (status["tenants"].as_array().unwrap().iter())
        .find(|t| t["path"] == "team/team-key")
        .unwrap_or_else(|| panic!("{status}"));
    let cap = &key["accounts"][0]["caps"][0];
    assert_eq!(cap["amount"], CAP, "{cap}");
    assert_eq!(cap["amount_usd"], "0.01", "{cap}");
    let used = cap["used"].as_u64().unwrap();
    assert_eq!(used, spent, "{cap}");
    // Exact: as many decimals as it needs, at least two.
    let fraction = format!("{:09}", used % 1_000_000_000);
    let kept = fraction.trim_end_matches('0');
    let kept = if kept.len() < 2 { &fraction[..2] } else { kept };
    let dollars = format!("{}.{kept}", used / 1_000_000_000);
    assert_eq!(cap["used_usd"], dollars.as_str(), "{cap}");
    // A spend limit through the admin API, in dollars.
    let change = serde_json::json!({"tenant": "team", "limits": [
        {"dimension": "spend", "amount_usd": "0.50", "period_seconds": 3600}]});
    let response = gateway
        .admin(reqwest::Method::PUT, "/limits", "admin", change)
        .await;
    assert_eq!(response.status(), 204, "{}", response.text().await.unwrap());
    let (_, text) = gateway.get("/status.json").await;
    let status: Value = serde_json::from_str(&text).unwrap();
    let team = (status["tenants"].as_array().unwrap().iter())
        .find(|t| t["path"] == "team")
        .unwrap();
    let level = &team["accounts"][0]["levels"][0];
    assert_eq!(level["limit"], "spend_per_hour", "{level}");
    assert_eq!(level["amount"], 500_000_000u64, "{level}");
    gateway.stop().await;
}
