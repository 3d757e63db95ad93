//! The state's failures: a database out of reach at start stops the gateway with its URL
//! (password hidden) and status 1; a schema newer than the gateway's is refused; writes the
//! database refuses at run time (a full disk, a read-only database) are refused whole, and the
//! gateway answers by its failure policy until they are taken again.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use tower_llm_quota_test_support::port::free_port;
use tower_llm_quota_test_support::postgres_server::{PostgresServer, TestDatabase};

use crate::support::Running;
use tower_llm_quota_gateway::Persistence;

/// A configuration with one simulated account, a key, and a spend cap on the key's tenant
/// (its counts are what the state must make durable before a request is sent);
/// `fail_closed` as given.
fn config(fail_closed: bool) -> String {
    format!(
        r#"
        [server]
        admin_token = "admin"
        fail_closed = {fail_closed}
        [[accounts]]
        name = "sim"
        base_url = "sim"
        profile = "openai"
        apis = ["chat"]
        quota = {{ requests_per_minute = 60000, tokens_per_minute = 60000000 }}
        [prices]
        unpriced = "refuse"
        [prices.models."gpt-4o-mini"]
        input = "0.15"
        output = "0.60"
        [tenants.nodes."team"]
        caps = [{{ dimension = "spend", amount = 1000000000, window = "calendar_month_utc" }}]
        [[keys]]
        name = "key"
        key = "secret"
        tenant = "team"
        "#
    )
}

const BODY: &str =
    r#"{"model":"gpt-4o-mini","max_tokens":20,"messages":[{"role":"user","content":"Hello"}]}"#;

/// Runs the binary with `config` and `args`, which must stop it at start: its status and
/// stderr. A binary still running after 60 s is killed, and the test fails.
fn start_failing(dir: &Path, config: &str, args: &[&str]) -> (Option<i32>, String) {
    use std::io::Read;
    let path = dir.join("gateway.toml");
    std::fs::write(&path, config).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_llm-quota-gateway"))
        .arg("--config")
        .arg(&path)
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the gateway started with {args:?} instead of stopping");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    (status.code(), stderr)
}

fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gateway-state-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_state_out_of_reach_stops_the_start_naming_it_without_its_password() {
    let dir = folder("unreachable");
    let url = format!("postgres://bob:hunter2@127.0.0.1:{}/quota", free_port());
    let (status, stderr) = start_failing(&dir, &config(true), &["--state", &url]);
    assert_eq!(status, Some(1), "{stderr}");
    let shown = url.replace("hunter2", "***");
    assert!(stderr.contains(&shown), "{stderr}");
    assert!(!stderr.contains("hunter2"), "the password shown: {stderr}");
    assert!(stderr.contains("out of reach"), "{stderr}");
    // An SQLite file whose folder cannot be made (a file is in its way).
    let missing = dir.join("gateway.toml/state.db");
    let state = format!("sqlite:{}", missing.display());
    let (status, stderr) = start_failing(&dir, &config(true), &["--state", &state]);
    assert_eq!(status, Some(1), "{stderr}");
    assert!(stderr.contains(&state), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_schema_newer_than_the_gateway_s_is_refused() {
    let dir = folder("newer");
    // SQLite: the version is the file's user_version.
    let file = dir.join("gateway.state.db");
    rusqlite::Connection::open(&file)
        .unwrap()
        .execute_batch("PRAGMA user_version = 99")
        .unwrap();
    let (status, stderr) = start_failing(&dir, &config(true), &[]);
    assert_eq!(status, Some(1), "{stderr}");
    assert!(stderr.contains("newer than this gateway's"), "{stderr}");
    assert!(stderr.contains("version 99"), "{stderr}");
    // Postgres: the versions applied are rows of llm_gateway.schema_migrations.
    let database = TestDatabase::create();
    database.psql(
        "CREATE SCHEMA llm_gateway; \
         CREATE TABLE llm_gateway.schema_migrations (version bigint PRIMARY KEY, \
             applied_at timestamptz NOT NULL DEFAULT now()); \
         INSERT INTO llm_gateway.schema_migrations (version) VALUES (1), (99)",
    );
    let (status, stderr) = start_failing(&dir, &config(true), &["--state", database.url()]);
    assert_eq!(status, Some(1), "{stderr}");
    assert!(stderr.contains("newer than this gateway's"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// What the state file counts for the tenant's cap now.
fn counted(file: &Path) -> i64 {
    let connection = rusqlite::Connection::open(file).unwrap();
    connection
        .query_row(
            "SELECT coalesce(sum(used), 0) FROM caps WHERE scope = 'team'",
            [],
            |row| row.get(0),
        )
        .unwrap()
}

/// Makes the state file refuse (`true`) or take (`false`) every write of the caps' counts,
/// as a full disk or a read-only database refuses them.
fn refuse_writes(file: &Path, refused: bool) {
    let connection = rusqlite::Connection::open(file).unwrap();
    let sql = if refused {
        "CREATE TRIGGER full_insert BEFORE INSERT ON caps \
             BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END; \
         CREATE TRIGGER full_update BEFORE UPDATE ON caps \
             BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END;"
    } else {
        "DROP TRIGGER full_insert; DROP TRIGGER full_update;"
    };
    connection.execute_batch(sql).unwrap();
}

/// What the status page counts for the tenant's cap.
async fn shown(gateway: &Running) -> i64 {
    let status: Value = serde_json::from_str(
        &reqwest::get(format!("{}/status.json", gateway.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    )
    .unwrap();
    let team = status["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["path"] == "team")
        .unwrap();
    team["accounts"][0]["caps"][0]["used"].as_i64().unwrap()
}

/// Waits (up to 30 s) until the file's count is the gateway's (settlements are committed a
/// tenth of a second after they are made): that count.
async fn settled(gateway: &Running, file: &Path) -> i64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let used = shown(gateway).await;
        if counted(file) == used {
            return used;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the file counts {}, the gateway {used}",
            counted(file)
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn refused_writes_are_refused_whole_and_the_gateway_answers_by_its_policy() {
    for fail_closed in [true, false] {
        let dir = folder(&format!("refused-{fail_closed}"));
        let file = dir.join("state.db");
        let gateway =
            Running::serve(&config(fail_closed), &Persistence::Sqlite(file.clone())).await;
        let send = || gateway.post("/v1/chat/completions", Some("secret"), BODY);
        assert_eq!(send().await.status(), 200);
        let before = settled(&gateway, &file).await;
        assert!(before > 0, "the answer's spend is counted in the file");

        refuse_writes(&file, true);
        let response = send().await;
        let status = response.status().as_u16();
        let answer: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
        if fail_closed {
            assert_eq!(status, 503, "{answer}");
            assert_eq!(answer["error"]["limit"], "state", "{answer}");
            let message = answer["error"]["message"].as_str().unwrap();
            assert!(message.contains("database or disk is full"), "{message}");
        } else {
            assert_eq!(status, 200, "fail-open sends it: {answer}");
        }
        // Past the next commits of what no request waits for: still refused whole.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert_eq!(counted(&file), before, "nothing half-written");

        // The writes are taken again: the count in the file catches up with the gateway's.
        refuse_writes(&file, false);
        assert_eq!(send().await.status(), 200);
        let used = settled(&gateway, &file).await;
        assert!(used > before, "fail_closed {fail_closed}");
        gateway.stop().await;
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Two replicas keeping their state in a Postgres that turns read-only: each request is
/// answered by the failure policy (refused with the store's reason when failing closed),
/// and served again once writes are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_postgres_is_answered_by_the_failure_policy() {
    let server = PostgresServer::start();
    let persistence = Persistence::Postgres(server.url());
    let replicas = [
        Running::serve(&config(true), &persistence).await,
        Running::serve(&config(true), &persistence).await,
    ];
    for replica in &replicas {
        let response = replica
            .post("/v1/chat/completions", Some("secret"), BODY)
            .await;
        assert_eq!(response.status(), 200);
    }
    server.refuse_writes(true);
    for replica in &replicas {
        let response = replica
            .post("/v1/chat/completions", Some("secret"), BODY)
            .await;
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        assert_eq!(status, 503, "{text}");
        assert!(text.contains("store"), "{text}");
    }
    server.refuse_writes(false);
    for replica in &replicas {
        // The breaker asks the store again within a second.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let response = replica
                .post("/v1/chat/completions", Some("secret"), BODY)
                .await;
            if response.status() == 200 {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "never served again");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    for replica in replicas {
        replica.stop().await;
    }
}

/// Runs the binary with `config` and `args` until it listens, then stops it: what it wrote
/// on stderr meanwhile.
fn started_saying(dir: &Path, config: &str, args: &[&str]) -> String {
    use std::io::{BufRead, Read};
    let path = dir.join("gateway.toml");
    std::fs::write(&path, config).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_llm-quota-gateway"))
        .arg("--config")
        .arg(&path)
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let listening = stdout
        .lines()
        .map_while(Result::ok)
        .any(|line| line.starts_with("gateway listening on "));
    let _ = child.kill();
    let _ = child.wait();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(listening, "the gateway did not start: {stderr}");
    stderr
}

/// With caps kept in Redis, the gateway says at start whether Redis keeps its data.
#[test]
fn the_gateway_says_whether_redis_keeps_the_caps() {
    let dir = folder("redis-keeps");
    let forgetful = crate::redis_server::RedisServer::start();
    let said = started_saying(&dir, &config(true), &["--state", &forgetful.url()]);
    assert!(said.contains("Redis keeps nothing on disk"), "{said}");
    let persistent = crate::redis_server::RedisServer::start_persistent();
    let said = started_saying(&dir, &config(true), &["--state", &persistent.url()]);
    assert!(!said.contains("Redis keeps"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}
