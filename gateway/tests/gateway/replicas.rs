//! `--redis-url`: two gateway replicas spend one account quota.

use std::time::Duration;

use crate::api::{fixed_config, fixed_upstream};
use crate::redis_server::RedisServer;
use crate::support::{Restartable, Running};

const BODY: &str = r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"Hi"}]}"#;

#[tokio::test]
async fn two_replicas_share_the_account_through_redis() {
    let redis = RedisServer::start();
    let (upstream, seen) = fixed_upstream(Duration::ZERO).await;
    // Six requests a minute: a burst of one, then one every 10 s, for both replicas together.
    let config =
        fixed_config(&upstream).replace("requests_per_minute = 600", "requests_per_minute = 6");
    let first = Running::start_shared(&config, &redis.url()).await;
    let second = Running::start_shared(&config, &redis.url()).await;
    assert_eq!(
        first
            .post("/v1/chat/completions", Some("caller-secret"), BODY)
            .await
            .status(),
        200
    );
    // The other replica's request waits for the shared bucket's refill.
    let waiting = second.post("/v1/chat/completions", Some("caller-secret"), BODY);
    assert!(
        tokio::time::timeout(Duration::from_secs(2), waiting)
            .await
            .is_err()
    );
    assert_eq!(seen.lock().unwrap().len(), 1);
    first.stop().await;
    second.stop().await;
}

#[tokio::test]
async fn two_replicas_share_a_tenant_limit_through_redis() {
    let redis = RedisServer::start();
    let (upstream, seen) = fixed_upstream(Duration::ZERO).await;
    // The account is wide; the tenant may send six requests a minute, one at once.
    let tree = "[tenants.nodes.team]\nlimits = [{ dimension = \"requests\", amount = 6, period_seconds = 60, burst = 1 }]\n";
    let config = format!("{tree}{}", fixed_config(&upstream));
    let first = Running::start_shared(&config, &redis.url()).await;
    let second = Running::start_shared(&config, &redis.url()).await;
    assert_eq!(
        first
            .post("/v1/chat/completions", Some("caller-secret"), BODY)
            .await
            .status(),
        200
    );
    // The other replica finds the node's minute spent in Redis: refused at once, told when.
    let refused = second
        .post("/v1/chat/completions", Some("caller-secret"), BODY)
        .await;
    assert_eq!(refused.status(), 429);
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((9..=10).contains(&retry_after), "{retry_after}");
    let body: serde_json::Value = serde_json::from_str(&refused.text().await.unwrap()).unwrap();
    assert_eq!(body["error"]["scope"], "tenant:team");
    assert_eq!(body["error"]["limit"], "requests_per_minute");
    assert_eq!(seen.lock().unwrap().len(), 1);
    first.stop().await;
    second.stop().await;
}

#[tokio::test]
async fn an_unreachable_store_fails_closed_with_503() {
    let mut redis = RedisServer::start();
    let (upstream, seen) = fixed_upstream(Duration::ZERO).await;
    let gateway = Running::start_shared(&fixed_config(&upstream), &redis.url()).await;
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some("caller-secret"), BODY)
            .await
            .status(),
        200
    );
    redis.kill();
    // What the replica was granted before the store went away it may still spend, until its
    // lease ends (three refreshes of 100 ms); then every request is refused.
    let started = std::time::Instant::now();
    let (status, retry_after, body) = loop {
        let answer = crate::support::json(
            gateway
                .post("/v1/chat/completions", Some("caller-secret"), BODY)
                .await,
        )
        .await;
        if answer.0 != 200 || started.elapsed() > Duration::from_secs(2) {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["limit"], "store");
    assert_eq!(body["error"]["scope"], "account:fixed");
    assert_eq!(body["error"]["gateway_decision"], "local");
    assert_eq!(retry_after.as_deref(), Some("1"));
    assert!(!seen.lock().unwrap().is_empty());
    gateway.stop().await;
}

/// With `--redis-url`, idempotency records are shared: a request completed on one replica is
/// replayed by the other for the same key and tenant, without a second upstream call.
#[tokio::test]
async fn an_idempotency_key_holds_across_replicas() {
    let redis = RedisServer::start();
    let (upstream, seen) = fixed_upstream(Duration::ZERO).await;
    let config = fixed_config(&upstream);
    let first = Running::start_shared(&config, &redis.url()).await;
    let second = Running::start_shared(&config, &redis.url()).await;
    let send = |replica: &Running| {
        reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", replica.url))
            .bearer_auth("caller-secret")
            .header("idempotency-key", "job-7")
            .body(BODY)
            .send()
    };
    let answer = send(&first).await.unwrap();
    assert_eq!(answer.status(), 200);
    let body = answer.bytes().await.unwrap();
    let again = send(&second).await.unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.bytes().await.unwrap(), body);
    assert_eq!(seen.lock().unwrap().len(), 1, "one upstream call for both");
    first.stop().await;
    second.stop().await;
}

/// With `--redis-url`, a pause from one replica's admin API holds on the others at their next
/// admission, shows in their own views within a second, and a resume from another replica
/// lifts it everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_from_one_replica_holds_on_every_replica() {
    use reqwest::Method;
    let redis = RedisServer::start();
    let (upstream, _) = fixed_upstream(Duration::ZERO).await;
    let config = fixed_config(&upstream);
    let replicas = [
        Running::start_shared(&config, &redis.url()).await,
        Running::start_shared(&config, &redis.url()).await,
        Running::start_shared(&config, &redis.url()).await,
    ];
    async fn status(replica: &Running) -> u16 {
        let response = replica
            .post("/v1/chat/completions", Some("caller-secret"), BODY)
            .await;
        let status = response.status().as_u16();
        response.bytes().await.unwrap();
        status
    }
    for replica in &replicas {
        assert_eq!(status(replica).await, 200);
    }
    let paused = replicas[0]
        .admin(
            Method::POST,
            "/pause",
            "admin",
            serde_json::json!({"tenant": "team"}),
        )
        .await;
    assert_eq!(paused.status(), 204);
    // The store has it once the pause is written (in the background, within its timeout).
    let started = std::time::Instant::now();
    for replica in &replicas {
        while status(replica).await != 429 {
            assert!(started.elapsed() < Duration::from_secs(2), "not paused");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let refused_everywhere = started.elapsed();
    // Each replica's own view shows the pause within a reading of the store.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for replica in &replicas {
        let tenants = replica
            .admin(Method::GET, "/tenants", "admin", serde_json::Value::Null)
            .await;
        let tenants: serde_json::Value =
            serde_json::from_slice(&tenants.bytes().await.unwrap()).unwrap();
        let team = tenants
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["path"] == "team")
            .unwrap();
        assert_eq!(team["paused"], true, "{team}");
    }
    let resumed = replicas[2]
        .admin(
            Method::POST,
            "/resume",
            "admin",
            serde_json::json!({"tenant": "team"}),
        )
        .await;
    assert_eq!(resumed.status(), 204);
    let started = std::time::Instant::now();
    for replica in &replicas {
        while status(replica).await != 200 {
            assert!(started.elapsed() < Duration::from_secs(3), "not resumed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    println!(
        "paused on every replica within {refused_everywhere:?}, resumed within {:?}",
        started.elapsed()
    );
    for replica in replicas {
        replica.stop().await;
    }
}

/// Two replicas of the gateway binary on one Redis saturate an account of 6,000 requests a
/// minute (100 a second; its burst, a sixth of it, spent in the three seconds' warm-up): sixteen clients of
/// tenant `a` on the first, eight of tenant `b` on each, `a` weighing `weight_a` and `b` one,
/// for `window` after a warm-up. The answers each tenant got, and each replica. `lease`: the
/// server's `lease_refresh_ms` line (none: the default, leases renewed every 100 ms; `= 0`:
/// one Redis call per admission).
async fn served_by_each_tenant(
    lease: &str,
    weight_a: u32,
    window: Duration,
) -> ((u64, u64), (u64, u64)) {
    let redis = RedisServer::start();
    let (upstream, _seen) = fixed_upstream(Duration::ZERO).await;
    let config = format!(
        r#"
        [server]
        admin_token = "admin"
        audit_log = "off"
        {lease}
        [[accounts]]
        name = "busy"
        base_url = "{upstream}"
        key = "sk-upstream-secret"
        profile = "openai"
        apis = ["chat"]
        quota = {{ requests_per_minute = 6000, tokens_per_minute = 100000000 }}
        [tenants.nodes.a]
        weight = {weight_a}
        [tenants.nodes.b]
        weight = 1
        [[keys]]
        name = "a-key"
        key = "key-a"
        tenant = "a"
        [[keys]]
        name = "b-key"
        key = "key-b"
        tenant = "b"
        "#
    );
    let dir = std::env::temp_dir().join(format!(
        "llm-quota-fair-{}-{weight_a}-{}",
        std::process::id(),
        lease.len()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let args = ["--state".to_owned(), redis.url()];
    let first = Restartable::start(&dir.join("first.toml"), &config, &args);
    let second = Restartable::start(&dir.join("second.toml"), &config, &args);
    // The burst (1,000) goes in the warm-up: the window measures the saturated account.
    let start = tokio::time::Instant::now();
    let (from, end) = (
        start + Duration::from_secs(3),
        start + Duration::from_secs(3) + window,
    );
    let client = reqwest::Client::new();
    let mut clients = Vec::new();
    let spread = [
        (first.url.clone(), "key-a", 16, 0),
        (first.url.clone(), "key-b", 8, 1),
        (second.url.clone(), "key-b", 8, 2),
    ];
    for (url, key, count, slot) in spread {
        for _ in 0..count {
            let (client, url) = (client.clone(), url.clone());
            clients.push(tokio::spawn(async move {
                let mut served = 0u64;
                while tokio::time::Instant::now() < end {
                    let response = client
                        .post(format!("{url}/v1/chat/completions"))
                        .bearer_auth(key)
                        .header("content-type", "application/json")
                        .body(BODY)
                        .send()
                        .await;
                    let now = tokio::time::Instant::now();
                    if response.is_ok_and(|r| r.status() == 200) && now >= from && now < end {
                        served += 1;
                    }
                }
                (slot, served)
            }));
        }
    }
    let mut served = [0u64; 3];
    for client in clients {
        let (slot, n) = client.await.unwrap();
        served[slot] += n;
    }
    drop((first, second));
    let _ = std::fs::remove_dir_all(&dir);
    (
        (served[0], served[1] + served[2]),
        (served[0] + served[1], served[2]),
    )
}

/// Tenants share a saturated account by their weights whatever the spread of their clients
/// over the replicas, leased (the default) and asking per admission (`lease_refresh_ms =
/// 0`): `a` on the first replica only, `b` on both; 50 / 50 for equal weights, 75 / 25 for
/// 3 : 1, within 3 points over 30 seconds (about 3,000 answers), and neither replica starved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_a_saturated_account_by_their_tenants_not_their_clients() {
    let _timed = crate::support::TIMED.lock().await;
    let share = |(a, b): (u64, u64)| a as f64 / (a + b).max(1) as f64;
    let window = Duration::from_secs(30);
    for (lease, mode) in [
        ("", "leased"),
        ("lease_refresh_ms = 0", "a call per admission"),
    ] {
        for (weight, expected) in [(1, 0.5), (3, 0.75)] {
            let (tenants, replicas) = served_by_each_tenant(lease, weight, window).await;
            println!(
                "{mode}, weights {weight}:1: {} / {} answers ({:.1} % to `a`), replicas {} / {}",
                tenants.0,
                tenants.1,
                share(tenants) * 100.0,
                replicas.0,
                replicas.1
            );
            // 100 a second for both: about 3,000 in the window.
            assert!(tenants.0 + tenants.1 >= 2_400, "{mode}: {tenants:?}");
            assert!(
                (share(tenants) - expected).abs() <= 0.03,
                "{mode}: {tenants:?}: the tenants' weights {weight}:1, not their clients' spread"
            );
            assert!(
                replicas.0 > 0 && replicas.1 > 0,
                "{mode}: a replica starved: {replicas:?}"
            );
        }
    }
}

/// A model's own scope is shared through Redis too: six requests a minute for model `m` over
/// both replicas (a burst of one); the second replica's `m` waits, its `n` is served at once.
#[tokio::test]
async fn two_replicas_share_a_models_scope_through_redis() {
    let redis = RedisServer::start();
    let (upstream, seen) = fixed_upstream(Duration::ZERO).await;
    let config = fixed_config(&upstream).replace(
        "quota = { requests_per_minute = 600, tokens_per_minute = 600000, max_in_flight = 1 }",
        "quota = { requests_per_minute = 600, max_in_flight = 4 }\n        \
         model_quota = { requests_per_minute = 6, tokens_per_minute = 600000 }",
    );
    let first = Running::start_shared(&config, &redis.url()).await;
    let second = Running::start_shared(&config, &redis.url()).await;
    let post = |gateway: &Running, model: &str| {
        let body = BODY.replace("\"m\"", &format!("\"{model}\""));
        let gateway = gateway.url.clone();
        async move {
            reqwest::Client::new()
                .post(format!("{gateway}/v1/chat/completions"))
                .bearer_auth("caller-secret")
                .body(body)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(post(&first, "m").await, 200);
    assert!(
        tokio::time::timeout(Duration::from_secs(2), post(&second, "m"))
            .await
            .is_err(),
        "model m's scope admitted a second request within its burst of one"
    );
    assert_eq!(post(&second, "n").await, 200);
    assert_eq!(seen.lock().unwrap().len(), 2);
    first.stop().await;
    second.stop().await;
}

/// With `--redis-url`, the admin API's changes hold on every replica: a limit and a weight set
/// on one replica show on the other within its sync, a key made on one serves on the other,
/// a key revoked on the other is refused on the first; a third replica started later reads
/// them all at its start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_changes_hold_on_every_replica() {
    use reqwest::Method;
    let redis = RedisServer::start();
    let (upstream, _) = fixed_upstream(Duration::ZERO).await;
    let config = fixed_config(&upstream).replace(
        "admin_token = \"admin\"",
        "admin_token = \"admin\"\n        admin_sync_ms = 50",
    );
    let first = Running::start_shared(&config, &redis.url()).await;
    let second = Running::start_shared(&config, &redis.url()).await;
    async fn json(response: reqwest::Response) -> (u16, serde_json::Value) {
        let status = response.status().as_u16();
        let body = response.bytes().await.unwrap();
        (status, serde_json::from_slice(&body).unwrap_or_default())
    }
    async fn call(replica: &Running, key: &str) -> u16 {
        let response = replica.post("/v1/chat/completions", Some(key), BODY).await;
        let status = response.status().as_u16();
        response.bytes().await.unwrap();
        status
    }
    /// `team`'s configured weight and its limits' names on `replica`.
    async fn team(replica: &Running) -> (u64, Vec<String>) {
        let (_, tree) = json(
            replica
                .admin(Method::GET, "/tenants", "admin", serde_json::Value::Null)
                .await,
        )
        .await;
        let team = tree
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["path"] == "team")
            .unwrap()
            .clone();
        let limits = team["accounts"][0]["levels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| format!("{}={}", l["limit"].as_str().unwrap(), l["amount"]))
            .collect();
        (team["weight"].as_u64().unwrap(), limits)
    }
    /// Waits (on the condition, at most 5 s) until `check` holds on `replica`.
    async fn eventually<F: AsyncFn() -> bool>(what: &str, check: F) -> Duration {
        let started = std::time::Instant::now();
        while !check().await {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{what}: not within 5 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        started.elapsed()
    }

    let change = serde_json::json!({"tenant": "team", "weight": 4,
        "limits": [{"dimension": "requests", "amount": 7, "period_seconds": 10}]});
    let (status, _) = json(first.admin(Method::PUT, "/limits", "admin", change).await).await;
    assert_eq!(status, 204);
    let limits = eventually("the limit on the second replica", async || {
        team(&second).await == (4, vec!["requests_per_10_seconds=7".to_owned()])
    })
    .await;

    let (status, made) = json(
        first
            .admin(
                Method::POST,
                "/keys",
                "admin",
                serde_json::json!({"name": "etl", "tenant": "team"}),
            )
            .await,
    )
    .await;
    assert_eq!(status, 201);
    let secret = made["key"].as_str().unwrap().to_owned();
    let made = eventually("the key on the second replica", async || {
        call(&second, &secret).await == 200
    })
    .await;
    let revoked = second
        .admin(
            Method::DELETE,
            "/keys/etl",
            "admin",
            serde_json::Value::Null,
        )
        .await;
    assert_eq!(revoked.status(), 204);
    assert_eq!(call(&second, &secret).await, 401, "at once where revoked");
    let gone = eventually("the revocation on the first replica", async || {
        call(&first, &secret).await == 401
    })
    .await;
    println!(
        "seen on the other replica after: limit {limits:?}, key {made:?}, revocation {gone:?}"
    );

    // A replica started now reads the state at its start.
    let third = Running::start_shared(&config, &redis.url()).await;
    assert_eq!(
        team(&third).await,
        (4, vec!["requests_per_10_seconds=7".to_owned()])
    );
    assert_eq!(call(&third, &secret).await, 401);
    assert_eq!(call(&third, "caller-secret").await, 200);
    for replica in [first, second, third] {
        replica.stop().await;
    }
}

/// Three replicas with `fail_closed = false` share 60 requests a second (a burst of 10);
/// Redis is killed and every replica's clients ask for more than the account until three
/// seconds after every replica says it falls back (`store_reachable` in `/status.json`). Each replica falls back to a third of the account (the live replicas Redis last
/// counted, shown in `/status.json`), so together they answer no more than the account allows
/// over the outage (its burst and its rate), where a fixed half let 1.5x through; and serve
/// at least 0.4 of the account's rate over three seconds once every replica falls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_fall_back_to_their_share_of_the_live_fleet() {
    let _timed = crate::support::TIMED.lock().await;
    let mut redis = RedisServer::start();
    let (upstream, _seen) = fixed_upstream(Duration::ZERO).await;
    let config = format!(
        r#"
        [server]
        admin_token = "admin"
        fail_closed = false
        [[accounts]]
        name = "busy"
        base_url = "{upstream}"
        key = "sk-upstream-secret"
        profile = "openai"
        apis = ["chat"]
        quota = {{ requests_per_minute = 60, minute_ms = 1000, tokens_per_minute = 10000000 }}
        [[keys]]
        name = "team-key"
        key = "caller-secret"
        tenant = "team"
        "#
    );
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(std::sync::Arc::new(
            Running::start_shared(&config, &redis.url()).await,
        ));
    }
    let counted = tokio::time::Instant::now() + Duration::from_secs(30);
    for replica in &replicas {
        loop {
            let (_, status) = replica.get("/status.json").await;
            let status: serde_json::Value = serde_json::from_str(&status).unwrap();
            if status["accounts"][0]["live_replicas"] == 3 {
                break;
            }
            assert!(tokio::time::Instant::now() < counted, "{status}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    redis.kill();
    let killed = tokio::time::Instant::now();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for replica in &replicas {
        for _ in 0..8 {
            let (replica, stop) = (replica.clone(), stop.clone());
            clients.push(tokio::spawn(async move {
                // When each answer came.
                let mut answers = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let post = replica.post("/v1/chat/completions", Some("caller-secret"), BODY);
                    match tokio::time::timeout(Duration::from_secs(10), post).await {
                        Ok(response) if response.status() == 200 => {
                            answers.push(tokio::time::Instant::now());
                        }
                        _ => tokio::time::sleep(Duration::from_millis(5)).await,
                    }
                }
                answers
            }));
        }
    }
    // Every replica says it admits from its share (also on a busy machine, where it sees
    // Redis gone later), then two seconds of it.
    for replica in &replicas {
        loop {
            let (_, status) = replica.get("/status.json").await;
            let status: serde_json::Value = serde_json::from_str(&status).unwrap();
            if status["accounts"][0]["store_reachable"] == false {
                break;
            }
            assert!(killed.elapsed() < Duration::from_secs(30), "{status}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let fallen = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let end = tokio::time::Instant::now();
    let mut answers = Vec::new();
    for client in clients {
        answers.extend(client.await.unwrap());
    }
    // Answers that came after the clients were told to stop were admitted before: counted.
    let outage = answers.iter().max().map_or(end, |last| end.max(*last)) - killed;
    let allowed = 10.0 + 60.0 * outage.as_secs_f64();
    let ratio = answers.len() as f64 / allowed;
    let fallen_answers = answers
        .iter()
        .filter(|at| **at >= fallen && **at < end)
        .count();
    let fallen_ratio = fallen_answers as f64 / (60.0 * (end - fallen).as_secs_f64());
    let figures = format!(
        "three replicas, Redis down for {outage:?}: {} answers, {ratio:.3}x the account; \
         every replica on its share after {:?}, then {fallen_answers} answers in {:?}, \
         {fallen_ratio:.3}x its rate",
        answers.len(),
        fallen - killed,
        end - fallen
    );
    println!("{figures}");
    assert!(ratio <= 1.0, "over the account: {figures}");
    // Liveness, with room for a machine busy with other tests (alone: 0.97-1.0).
    assert!(
        fallen_ratio >= 0.4,
        "too few on the local shares: {figures}"
    );
    for replica in replicas {
        std::sync::Arc::into_inner(replica).unwrap().stop().await;
    }
}

/// Four processes spinning on a two-core machine (dropped: killed).
struct BusyLoops(Vec<std::process::Child>);

impl BusyLoops {
    fn start(count: usize) -> Self {
        Self(
            (0..count)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .unwrap()
                })
                .collect(),
        )
    }
}

impl Drop for BusyLoops {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Two replicas on a healthy Redis, failing closed, beside four busy loops: eight clients on
/// each saturate the account for five seconds. A healthy store never refuses: no `503`
/// (the store's timeout is 250 ms, one late answer asks again, and only three in a row open
/// the breaker), per admission (`lease_refresh_ms = 0`) and leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_store_under_a_busy_machine_refuses_nothing() {
    let _timed = crate::support::TIMED.lock().await;
    for lease in ["lease_refresh_ms = 0", ""] {
        let redis = RedisServer::start();
        let (upstream, _seen) = fixed_upstream(Duration::ZERO).await;
        let config = format!(
            r#"
            [server]
            admin_token = "admin"
            {lease}
            [[accounts]]
            name = "busy"
            base_url = "{upstream}"
            key = "sk-upstream-secret"
            profile = "openai"
            apis = ["chat"]
            quota = {{ requests_per_minute = 100, minute_ms = 1000, tokens_per_minute = 10000000 }}
            [[keys]]
            name = "team-key"
            key = "caller-secret"
            tenant = "team"
            "#
        );
        let replicas = [
            std::sync::Arc::new(Running::start_shared(&config, &redis.url()).await),
            std::sync::Arc::new(Running::start_shared(&config, &redis.url()).await),
        ];
        let busy = BusyLoops::start(4);
        let end = tokio::time::Instant::now() + Duration::from_secs(5);
        let mut clients = Vec::new();
        for replica in &replicas {
            for _ in 0..8 {
                let replica = replica.clone();
                clients.push(tokio::spawn(async move {
                    let mut counts = std::collections::BTreeMap::<u16, u64>::new();
                    while tokio::time::Instant::now() < end {
                        let response = replica
                            .post("/v1/chat/completions", Some("caller-secret"), BODY)
                            .await;
                        *counts.entry(response.status().as_u16()).or_default() += 1;
                    }
                    counts
                }));
            }
        }
        let mut counts = std::collections::BTreeMap::<u16, u64>::new();
        for client in clients {
            for (status, n) in client.await.unwrap() {
                *counts.entry(status).or_default() += n;
            }
        }
        drop(busy);
        println!("four busy loops, `{lease}`: answers by status {counts:?}");
        assert_eq!(
            counts.keys().copied().collect::<Vec<_>>(),
            [200],
            "{counts:?}"
        );
        for replica in replicas {
            std::sync::Arc::into_inner(replica).unwrap().stop().await;
        }
    }
}
