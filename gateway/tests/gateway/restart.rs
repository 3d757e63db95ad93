//! A gateway restarted under traffic forgets nothing: its state in an SQLite file beside its
//! configuration (the default), the binary stopped by SIGTERM and by SIGKILL in the middle of
//! a day and of a month, twelve callers sending all along.
//!
//! - After a SIGTERM, each cap's count (a tenant's day and month, the account's month) equals
//!   the audit log's total spend for the period, and the callers' (their answers' usage at the
//!   prices).
//! - After a SIGKILL, it is never under either total, and at most the estimates of the
//!   requests then in flight (one per caller) over the callers'.
//! - No spend alert is raised twice in its period; a key made through the admin API still
//!   serves; the spend export covers the requests from before the restarts.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{Restartable, json};

const ADMIN: &str = "admin-secret";
const KEY: &str = "acme-secret";
const CALLERS: usize = 12;
/// The prices: $0.15 and $0.60 per million input and output tokens, in nano-dollars a token.
const INPUT_NANO: u64 = 150;
const OUTPUT_NANO: u64 = 600;
/// The spend alert's amount: $0.004 a day, raised at every tenth of it (the test spends about twice it).
const ALERT: u64 = 4_000_000;

/// The configuration: a simulated account far above the load whose answers take a few tens of
/// milliseconds (calls are in flight when the gateway is killed), prices, `acme`'s caps over a
/// day and a month and the account's over a month (all above what the test spends), a spend
/// alert, the audit log in `dir`; `state` names the state (else the default).
pub(crate) fn config(dir: &Path, state: Option<&str>) -> String {
    let audit = dir.join("audit.log");
    let state = state.map_or_else(String::new, |s| format!("state = \"{s}\""));
    format!(
        r#"
        [server]
        admin_token = "{ADMIN}"
        audit_log = "{audit}"
        lease_refresh_ms = 50
        {state}
        [[accounts]]
        name = "sim"
        base_url = "sim"
        profile = "openai"
        apis = ["chat"]
        quota = {{ requests_per_minute = 1000000, tokens_per_minute = 1000000000 }}
        sim = {{ base_ms = 40, per_token_ms = 1 }}
        caps = [{{ dimension = "spend", amount = 900000000000, window = "calendar_month_utc" }}]
        [prices]
        unpriced = "refuse"
        [prices.models."gpt-4o-mini"]
        input = "0.15"
        output = "0.60"
        [tenants.nodes."acme"]
        caps = [
          {{ dimension = "spend", amount = 800000000000, window = "calendar_day_utc" }},
          {{ dimension = "spend", amount = 700000000000, window = "calendar_month_utc" }},
        ]
        [[keys]]
        name = "acme-key"
        key = "{KEY}"
        tenant = "acme"
        [[spend_alerts]]
        tenant = "acme"
        amount = {ALERT}
        window = "calendar_day_utc"
        thresholds = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
        "#,
        audit = audit.display()
    )
}

/// A request made different by `n`, its answer at most 40 tokens.
fn body(n: u64) -> String {
    format!(
        r#"{{"model":"gpt-4o-mini","max_tokens":40,"messages":[{{"role":"user","content":"{n} {}"}}]}}"#,
        "word ".repeat(10 + (n % 20) as usize)
    )
}

/// An answer's spend at the prices, from its usage: nano-dollars, rounded up once.
fn spend_of(answer: &Value) -> u64 {
    let usage = &answer["usage"];
    let input = usage["prompt_tokens"].as_u64().unwrap_or(0);
    let output = usage["completion_tokens"].as_u64().unwrap_or(0);
    (input * INPUT_NANO * 1_000 + output * OUTPUT_NANO * 1_000).div_ceil(1_000)
}

/// Callers sending all along to wherever the gateways listen now, counting what their
/// answers spent.
#[derive(Default)]
pub(crate) struct Traffic {
    urls: RwLock<Vec<String>>,
    stop: AtomicBool,
    paused: AtomicBool,
    in_flight: AtomicU64,
    spent: AtomicU64,
    answered: AtomicU64,
    next: AtomicU64,
}

impl Traffic {
    /// `callers` callers sending to `urls` in turn with `key`.
    pub(crate) fn start(urls: Vec<String>, callers: usize, key: &'static str) -> Arc<Self> {
        let traffic = Arc::new(Traffic {
            urls: RwLock::new(urls),
            ..Traffic::default()
        });
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap();
        for caller in 0..callers {
            let (traffic, client) = (Arc::clone(&traffic), client.clone());
            tokio::spawn(async move {
                while !traffic.stop.load(Ordering::Relaxed) {
                    if traffic.paused.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                    traffic.in_flight.fetch_add(1, Ordering::SeqCst);
                    if traffic.paused.load(Ordering::SeqCst) {
                        traffic.in_flight.fetch_sub(1, Ordering::SeqCst);
                        continue;
                    }
                    let n = traffic.next.fetch_add(1, Ordering::Relaxed);
                    let url = {
                        let urls = traffic.urls.read().unwrap();
                        urls[caller % urls.len()].clone()
                    };
                    let sent = client
                        .post(format!("{url}/v1/chat/completions"))
                        .bearer_auth(key)
                        .header("content-type", "application/json")
                        .body(body(n))
                        .send()
                        .await;
                    let answer = match sent {
                        Ok(response) if response.status() == 200 => response
                            .bytes()
                            .await
                            .map(|b| serde_json::from_slice::<Value>(&b)),
                        _ => {
                            traffic.in_flight.fetch_sub(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                    };
                    if let Ok(Ok(answer)) = answer {
                        traffic
                            .spent
                            .fetch_add(spend_of(&answer), Ordering::Relaxed);
                        traffic.answered.fetch_add(1, Ordering::Relaxed);
                    }
                    traffic.in_flight.fetch_sub(1, Ordering::SeqCst);
                }
            });
        }
        traffic
    }

    pub(crate) fn send_to(&self, urls: Vec<String>) {
        *self.urls.write().unwrap() = urls;
    }

    pub(crate) fn spent(&self) -> u64 {
        self.spent.load(Ordering::Relaxed)
    }

    pub(crate) fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    /// Waits until `n` more answers came.
    pub(crate) async fn wait_for(&self, n: u64) {
        let until = self.answered() + n;
        while self.answered() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops sending and waits for every call in flight to be answered.
    pub(crate) async fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
        while self.in_flight.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub(crate) fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// What the audit log says: the spend of `tenant`'s answers, the largest estimate of one of
/// its requests (at the prices), and each spend alert raised (tenant, window, period,
/// threshold).
pub(crate) struct Audit {
    pub(crate) spent: u64,
    pub(crate) largest_estimate: u64,
    pub(crate) alerts: Vec<(String, String, String, u64)>,
}

pub(crate) fn audit(path: &Path, tenant: &str) -> Audit {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut audit = Audit {
        spent: 0,
        largest_estimate: 0,
        alerts: Vec::new(),
    };
    for line in text.lines() {
        let Ok(entry) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if entry["event"] == "spend_threshold" {
            audit.alerts.push((
                entry["tenant"].as_str().unwrap_or_default().to_owned(),
                entry["window"].as_str().unwrap_or_default().to_owned(),
                entry["period_start"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                entry["threshold_percent"].as_u64().unwrap_or(0),
            ));
            continue;
        }
        if entry["tenant"]
            .as_str()
            .is_none_or(|t| t != tenant && !t.starts_with(&format!("{tenant}/")))
        {
            continue;
        }
        if entry["decision"] == "admitted" {
            audit.spent += entry["spend_nano_usd"].as_u64().unwrap_or(0);
        }
        let estimated = &entry["estimated"];
        let estimate = estimated["input"].as_u64().unwrap_or(0) * INPUT_NANO
            + estimated["output"].as_u64().unwrap_or(0) * OUTPUT_NANO;
        audit.largest_estimate = audit.largest_estimate.max(estimate);
    }
    audit
}

/// Each cap's count on `url` now: `acme`'s day and month, the account's month.
pub(crate) async fn caps(url: &str) -> (u64, u64, u64) {
    let (_, _, status) = json(reqwest::get(format!("{url}/status.json")).await.unwrap()).await;
    let used = |caps: &Value, window: &str| {
        caps.as_array()
            .into_iter()
            .flatten()
            .find(|cap| cap["window"].as_str().is_some_and(|w| w.contains(window)))
            .map_or(0, |cap| cap["used"].as_u64().unwrap_or(0))
    };
    let acme = status["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["path"] == "acme")
        .expect("acme on the status page");
    let node_caps = &acme["accounts"][0]["caps"];
    let account_caps = &status["accounts"][0]["caps"];
    (
        used(node_caps, "day"),
        used(node_caps, "month"),
        used(account_caps, "month"),
    )
}

/// The spend export's total for `tenant` today, on `url`.
pub(crate) async fn exported(url: &str, tenant: &str) -> u64 {
    let (_, _, review) = json(
        reqwest::Client::new()
            .get(format!("{url}/admin/report?table=spend"))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap(),
    )
    .await;
    review["spend"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|row| row["tenant"].as_str().is_some_and(|t| t == tenant))
        .map(|row| row["spend_nano_usd"].as_u64().unwrap_or(0))
        .sum()
}

/// The day (UTC) now, so that a run across midnight is told apart.
pub(crate) fn today() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        / 86_400
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_gateway_forgets_nothing() {
    let dir = std::env::temp_dir().join(format!("gateway-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let day = today();
    let mut gateway = Restartable::start(&dir.join("gateway.toml"), &config(&dir, None), &[]);
    assert!(
        dir.join("gateway.state.db").exists(),
        "the state beside the configuration"
    );

    // A key made through the admin API.
    let (_, _, made) = json(
        reqwest::Client::new()
            .post(format!("{}/admin/keys", gateway.url))
            .bearer_auth(ADMIN)
            .header("content-type", "application/json")
            .body(json!({"name": "made", "tenant": "acme"}).to_string())
            .send()
            .await
            .unwrap(),
    )
    .await;
    let made = made["key"].as_str().expect("a new key").to_owned();
    // An override of the file, with who made it.
    let weighed = reqwest::Client::new()
        .put(format!("{}/admin/limits", gateway.url))
        .bearer_auth(ADMIN)
        .header("content-type", "application/json")
        .body(json!({"tenant": "acme", "weight": 3}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(weighed.status(), 204);

    let traffic = Traffic::start(vec![gateway.url.clone()], CALLERS, KEY);
    traffic.wait_for(150).await;

    // SIGTERM under traffic: the calls in flight finish, then the process ends.
    gateway.stop("-TERM");
    gateway.restart();
    let (day_used, month_used, account_used) = caps(&gateway.url).await;
    let logged = audit(&dir.join("audit.log"), "acme");
    let answered = traffic.spent();
    println!(
        "after SIGTERM: acme's day {day_used}, month {month_used}, the account's month \
         {account_used}; the audit log {}, the callers {answered}",
        logged.spent
    );
    assert_eq!(day_used, logged.spent, "the day's count is the audit log's");
    assert_eq!(month_used, logged.spent);
    assert_eq!(account_used, logged.spent);
    assert_eq!(day_used, answered, "and the callers'");
    let exported_first = exported(&gateway.url, "acme").await;
    assert_eq!(exported_first, logged.spent, "the export");

    // SIGKILL under traffic.
    traffic.send_to(vec![gateway.url.clone()]);
    traffic.wait_for(150).await;
    gateway.stop("-KILL");
    gateway.restart();
    let (day_used, month_used, account_used) = caps(&gateway.url).await;
    // The override and its stamp outlive the kill.
    let (_, _, overrides) = json(
        reqwest::Client::new()
            .get(format!("{}/admin/overrides", gateway.url))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(overrides[0]["id"], "weight:acme", "{overrides}");
    assert_eq!(overrides[0]["value"], 3, "{overrides}");
    assert_eq!(overrides[0]["by"], "admin", "{overrides}");
    let logged = audit(&dir.join("audit.log"), "acme");
    let answered = traffic.spent();
    let bound = answered + CALLERS as u64 * logged.largest_estimate;
    println!(
        "after SIGKILL: acme's day {day_used}, month {month_used}, the account's month \
         {account_used}; the audit log {}, the callers {answered}, the bound {bound}",
        logged.spent
    );
    for used in [day_used, month_used, account_used] {
        assert!(
            used >= logged.spent,
            "{used} below the audit log's {}",
            logged.spent
        );
        assert!(used >= answered, "{used} below the callers' {answered}");
        assert!(
            used <= bound,
            "{used} above the callers' and the calls in flight {bound}"
        );
    }

    // Once more under traffic, then a last SIGTERM: everything adds up again.
    traffic.send_to(vec![gateway.url.clone()]);
    traffic.wait_for(100).await;
    traffic.stop();
    gateway.stop("-TERM");
    gateway.restart();
    let (day_used, ..) = caps(&gateway.url).await;
    let logged = audit(&dir.join("audit.log"), "acme");
    let export = exported(&gateway.url, "acme").await;
    println!(
        "at the end: acme's day {day_used}, the audit log {}, the export {export}",
        logged.spent
    );
    assert!(day_used >= logged.spent);
    // The export lost at most the rows not yet written when the gateway was killed; it
    // still holds every request from before the first restart.
    assert!(
        export <= day_used,
        "{export} over the day's count {day_used}"
    );
    assert!(
        export >= exported_first,
        "the export lost the requests of the first life"
    );

    // The key made before the restarts serves.
    let served = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .bearer_auth(&made)
        .header("content-type", "application/json")
        .body(body(1))
        .send()
        .await
        .unwrap();
    assert_eq!(served.status(), 200, "the key made through the API");

    // No alert raised twice in its period, and some were raised.
    let mut alerts = logged.alerts.clone();
    let raised = alerts.len();
    alerts.sort();
    alerts.dedup();
    println!("{raised} spend alerts raised: {alerts:?}");
    assert_eq!(alerts.len(), raised, "an alert raised twice");
    assert_eq!(raised, 10, "each threshold raised once");

    if today() != day {
        println!("the run crossed midnight UTC: the day's counts started again");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits (up to 30 s) until every cap's count on `url` is `total`, the replicas' leases
/// reported: the counts last seen.
async fn settled_at(url: &str, total: u64) -> (u64, u64, u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let counts = caps(url).await;
        if counts == (total, total, total) || std::time::Instant::now() > deadline {
            return counts;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two replicas keeping their state in Postgres (`--state postgres://...`), each restarted
/// under the traffic the other keeps serving: one by SIGTERM, then the other by SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_postgres_forget_nothing() {
    let database = tower_llm_quota_test_support::postgres_server::TestDatabase::create();
    let dir = std::env::temp_dir().join(format!("gateway-restart-pg-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let state = vec!["--state".to_owned(), database.url().to_owned()];
    let mut replicas = Vec::new();
    for name in ["a", "b"] {
        let home = dir.join(name);
        std::fs::create_dir_all(&home).unwrap();
        replicas.push(Restartable::start(
            &home.join("gateway.toml"),
            &config(&home, None),
            &state,
        ));
        assert!(
            !home.join("gateway.state.db").exists(),
            "no SQLite file beside Postgres"
        );
    }
    let logged = |tenant: &str| {
        let (a, b) = (
            audit(&dir.join("a/audit.log"), tenant),
            audit(&dir.join("b/audit.log"), tenant),
        );
        let mut alerts = a.alerts;
        alerts.extend(b.alerts);
        Audit {
            spent: a.spent + b.spent,
            largest_estimate: a.largest_estimate.max(b.largest_estimate),
            alerts,
        }
    };
    let urls =
        |replicas: &[Restartable]| replicas.iter().map(|r| r.url.clone()).collect::<Vec<_>>();

    let traffic = Traffic::start(urls(&replicas), CALLERS, KEY);
    traffic.wait_for(150).await;

    // Replica a drained by SIGTERM while b serves, then started again.
    replicas[0].stop("-TERM");
    traffic.wait_for(50).await;
    replicas[0].restart();
    traffic.send_to(urls(&replicas));
    traffic.pause().await;
    // The live replica writes its audit log every tenth of a second.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while logged("acme").spent < traffic.spent() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let total = logged("acme").spent;
    let counts = settled_at(&replicas[0].url, total).await;
    println!(
        "after a's SIGTERM: (acme's day, month, the account's month) {counts:?}; the audit logs \
         {total}, the callers {}",
        traffic.spent()
    );
    assert_eq!(
        counts,
        (total, total, total),
        "each cap's count is the audit logs'"
    );
    assert_eq!(total, traffic.spent(), "and the callers'");
    assert_eq!(
        settled_at(&replicas[1].url, total).await,
        counts,
        "both replicas say so"
    );
    let exported_first = exported(&replicas[1].url, "acme").await;
    assert_eq!(exported_first, total, "the export");

    // Replica b killed while a serves.
    traffic.resume();
    traffic.wait_for(150).await;
    replicas[1].stop("-KILL");
    traffic.wait_for(50).await;
    replicas[1].restart();
    traffic.send_to(urls(&replicas));
    traffic.wait_for(100).await;
    traffic.stop();
    traffic.pause().await;
    let logged = logged("acme");
    let answered = traffic.spent();
    let bound = answered + CALLERS as u64 * logged.largest_estimate;
    // Leases reported: the counts stop moving.
    let mut counts = caps(&replicas[0].url).await;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = caps(&replicas[0].url).await;
        if now == counts {
            break;
        }
        counts = now;
    }
    println!(
        "after b's SIGKILL: {counts:?}; the audit logs {}, the callers {answered}, the bound {bound}",
        logged.spent
    );
    for used in [counts.0, counts.1, counts.2] {
        assert!(
            used >= logged.spent,
            "{used} below the audit logs' {}",
            logged.spent
        );
        assert!(used >= answered, "{used} below the callers' {answered}");
        assert!(
            used <= bound,
            "{used} above the callers' and the calls in flight {bound}"
        );
    }
    let export = exported(&replicas[0].url, "acme").await;
    // The killed replica's last rows of the ledger, like its last lines of the audit log,
    // may be lost; every request from before the first restart is there.
    assert!(
        export >= exported_first && export <= counts.0,
        "the export {export}"
    );

    let mut alerts = logged.alerts.clone();
    let raised = alerts.len();
    alerts.sort();
    alerts.dedup();
    assert_eq!(
        alerts.len(),
        raised,
        "an alert raised twice: {:?}",
        logged.alerts
    );
    assert_eq!(raised, 10, "each threshold raised once");
    drop(replicas);
    let _ = std::fs::remove_dir_all(&dir);
}
