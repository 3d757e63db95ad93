//! Postgres failing, and bad input: a database out of reach at start (an error naming it, the
//! password hidden, or a start on the local fallback that moves to Postgres when it answers),
//! killed in the middle (the local share, then back), stalled (no request waits past the
//! timeout), refusing writes (a clear refusal, nothing half written); a schema older or newer
//! than the crate's; migrations from many processes at once; names that are not SQL.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tower_llm_quota::budget::FailurePolicy;
use tower_llm_quota::error::ReserveError;
use tower_llm_quota::idempotency::{Claim, IdempotencyStore, Record};
use tower_llm_quota::tenant::{Tenant, TenantNode, TenantTree};
use tower_llm_quota::{Cost, Dimension, Quota};
use tower_llm_quota_postgres::{PostgresBudget, PostgresIdempotencyStore, SCHEMA_VERSION};
use tower_llm_quota_test_support::limit;
use tower_llm_quota_test_support::loopback_proxy::LoopbackProxy;
use tower_llm_quota_test_support::port::free_port;
use tower_llm_quota_test_support::postgres_server::{PostgresServer, TestDatabase};
use tower_llm_quota_test_support::store_suite::{
    OUTAGE_ACCOUNT, local_shares_follow_the_live_fleet,
};

use crate::support;

/// 20,000 tokens a second, and at once; 1,000 requests.
fn quota() -> Quota {
    Quota::new()
        .with_limit(limit(
            Dimension::TotalTokens,
            20_000,
            Duration::from_secs(1),
            20_000,
        ))
        .with_limit(limit(
            Dimension::Requests,
            1_000,
            Duration::from_secs(1),
            1_000,
        ))
}

/// A private cluster, migrated.
async fn migrated_cluster() -> PostgresServer {
    let server = PostgresServer::start();
    tower_llm_quota_postgres::migrate(&server.url())
        .await
        .unwrap();
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_fails_closed_naming_it_without_its_password() {
    let port = free_port();
    let url = format!("postgres://app:hunter2@127.0.0.1:{port}/quota");
    let error = PostgresBudget::new(&url, "down")
        .failure_policy(FailurePolicy::FailClosed)
        .connect(&quota())
        .await
        .unwrap_err();
    let text = error.to_string();
    println!("{text}");
    assert!(error.is_unreachable(), "{text}");
    assert!(text.contains(&format!("127.0.0.1:{port}/quota")), "{text}");
    assert!(!text.contains("hunter2"), "the password shown: {text}");
    let error = tower_llm_quota_postgres::migrate(&url).await.unwrap_err();
    assert!(error.is_unreachable() && !error.to_string().contains("hunter2"));
    // An address that is not one: a configuration error, before any connection.
    let error = PostgresBudget::new("postgres://[::1", "bad")
        .connect(&quota())
        .await
        .unwrap_err();
    assert!(error.is_config(), "{error}");
}

/// With a local fallback, a budget whose database is out of reach starts on its share, and
/// moves to Postgres once the database answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_started_without_its_database_moves_to_it_when_it_answers() {
    let server = migrated_cluster().await;
    server.kill();
    let budget = PostgresBudget::new(server.url(), "late")
        .expected_instances(2)
        .connect(&quota())
        .await
        .expect("a start on the fallback");
    assert!(!budget.is_store_reachable());
    let reservation = budget
        .reserve(Cost::new(100, 0))
        .await
        .expect("the local share");
    reservation.refund();
    server.start_again();
    let started = Instant::now();
    while !budget.is_store_reachable() {
        // An admission asks the store (the breaker's probe).
        if let Ok(Ok(reservation)) =
            tokio::time::timeout(Duration::from_secs(1), budget.reserve(Cost::new(1, 0))).await
        {
            let _ = reservation.refund();
        }
        assert!(started.elapsed() < Duration::from_secs(30), "never back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("on Postgres {:?} after it started", started.elapsed());
}

/// Postgres killed for five seconds under load (as a crash: `pg_ctl stop -m immediate`), then
/// started again: meanwhile the budget admits from its share of the quota and no more, no
/// request waits long for Postgres, and it goes back to Postgres within a few probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_database_falls_back_to_the_local_share_then_returns() {
    let server = migrated_cluster().await;
    let budget = PostgresBudget::new(server.url(), "outage")
        .failure_policy(FailurePolicy::local_share_of(4))
        .connect(&quota())
        .await
        .unwrap();
    assert!(budget.is_store_reachable());
    let cost = Cost::new(80, 20); // 100 tokens: 200 a second at a quarter of the quota
    let admitted = Arc::new(Mutex::new(Vec::new()));
    let slowest = Arc::new(Mutex::new(Duration::ZERO));
    let stop = Instant::now() + Duration::from_secs(9);
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let (budget, admitted, slowest) = (budget.clone(), admitted.clone(), slowest.clone());
            tokio::spawn(async move {
                while Instant::now() < stop {
                    let asked = Instant::now();
                    let Ok(Ok(mut reservation)) =
                        tokio::time::timeout_at(stop, budget.reserve(cost)).await
                    else {
                        break;
                    };
                    {
                        let mut slowest = slowest.lock().unwrap();
                        *slowest = (*slowest).max(asked.elapsed());
                    }
                    admitted.lock().unwrap().push(Instant::now());
                    reservation.mark_sent();
                    reservation.charge_estimate();
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.kill();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!budget.is_store_reachable(), "the breaker opened");
    server.start_again();
    let restarted = Instant::now();
    let mut back = None;
    while restarted.elapsed() < Duration::from_secs(30) {
        if budget.is_store_reachable() {
            back = Some(restarted.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for worker in workers {
        worker.await.expect("no panic");
    }
    let back = back.expect("back on Postgres");
    let outage = restarted - killed;
    let during = admitted
        .lock()
        .unwrap()
        .iter()
        .filter(|at| **at > killed + Duration::from_millis(250) && **at < restarted)
        .count() as f64;
    // A quarter of 20,000 tokens a second at 100 tokens a call, plus the share's burst.
    let share = 50.0 * outage.as_secs_f64() + 50.0;
    println!(
        "outage {outage:?}: {during} admitted locally (share {share:.0}), back on Postgres \
         {back:?} after its start, slowest admission {:?}",
        slowest.lock().unwrap()
    );
    assert!(during <= share, "{during} admitted during the outage");
    assert!(
        during >= 0.5 * (share - 50.0),
        "the fallback admitted {during}"
    );
    assert!(back <= Duration::from_secs(10), "back after {back:?}");
}

/// Every reply held back ten seconds (a stalled server or network): a budget failing closed
/// refuses within its timeout, one with a fallback admits from it, neither waits for Postgres.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_database_makes_no_request_wait_past_the_timeout() {
    let database = support::migrated().await;
    let server_port: u16 = database
        .url()
        .rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .and_then(|port| port.parse().ok())
        .unwrap_or(5432);
    let proxy = LoopbackProxy::start(server_port);
    let url = database
        .url()
        .replace(&format!(":{server_port}/"), &format!(":{}/", proxy.port()));
    let quota = quota();
    let connect = |policy| {
        PostgresBudget::new(&url, "stalled")
            .timeout(Duration::from_millis(200))
            .failure_policy(policy)
            .connect(&quota)
    };
    let closed = connect(FailurePolicy::FailClosed).await.unwrap();
    let fallback = connect(FailurePolicy::local_share_of(2)).await.unwrap();
    proxy.delay_replies(Duration::from_secs(10));
    for _ in 0..5 {
        let start = Instant::now();
        let error = closed.reserve(Cost::requests_only(1)).await.unwrap_err();
        assert!(matches!(error, ReserveError::Unavailable(_)), "{error}");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        let start = Instant::now();
        fallback
            .reserve(Cost::requests_only(1))
            .await
            .unwrap()
            .refund();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }
}

/// A read-only database (a full disk, a standby): a migration is refused with a clear error
/// and leaves nothing half applied; admissions follow the failure policy; once writable, all
/// is well again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_refusing_writes_is_refused_clearly_and_nothing_is_half_written() {
    let server = PostgresServer::start();
    server.refuse_writes(true);
    let error = tower_llm_quota_postgres::migrate(&server.url())
        .await
        .unwrap_err();
    println!("{error}");
    assert!(error.is_migration(), "{error}");
    assert!(error.to_string().contains("read-only"), "{error}");
    let tables = server.psql("SELECT count(*) FROM pg_tables WHERE schemaname = 'llm_quota'");
    assert_eq!(tables, "0", "nothing half written");
    server.refuse_writes(false);
    assert_eq!(
        tower_llm_quota_postgres::migrate(&server.url())
            .await
            .unwrap(),
        SCHEMA_VERSION
    );
    let quota = quota();
    let connect = |policy| {
        PostgresBudget::new(server.url(), "read-only")
            .timeout(Duration::from_millis(500))
            .failure_policy(policy)
            .connect(&quota)
    };
    let closed = connect(FailurePolicy::FailClosed).await.unwrap();
    let fallback = connect(FailurePolicy::local_share_of(2)).await.unwrap();
    server.refuse_writes(true);
    // The new setting reaches each connection at its next statement.
    let mut refused = None;
    for _ in 0..50 {
        match closed.reserve(Cost::requests_only(1)).await {
            Ok(reservation) => {
                let _ = reservation.refund();
            }
            Err(error) => {
                refused = Some(error);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = refused.expect("a read-only database refuses");
    println!("{refused}");
    assert!(refused.to_string().contains("read-only"), "{refused}");
    fallback
        .reserve(Cost::requests_only(1))
        .await
        .unwrap()
        .refund();
    server.refuse_writes(false);
    let mut admitted = false;
    for _ in 0..200 {
        if let Ok(reservation) = closed.reserve(Cost::requests_only(1)).await {
            reservation.refund();
            admitted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(admitted, "admitted again once writable");
}

/// A database never migrated, and one migrated by a newer version of the crate: each refused
/// at connection with what to do; the newer one refused by `migrate` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_older_or_newer_than_the_crate_s_is_refused_clearly() {
    let database = TestDatabase::create();
    let error = PostgresBudget::new(database.url(), "old")
        .connect(&quota())
        .await
        .unwrap_err();
    println!("{error}");
    assert!(error.is_schema(), "{error}");
    assert!(error.to_string().contains("migrate"), "{error}");
    tower_llm_quota_postgres::migrate(database.url())
        .await
        .unwrap();
    database.psql(&format!(
        "INSERT INTO llm_quota.schema_migrations (version, name) VALUES ({}, 'future')",
        SCHEMA_VERSION + 1
    ));
    let error = PostgresBudget::new(database.url(), "new")
        .connect(&quota())
        .await
        .unwrap_err();
    println!("{error}");
    assert!(
        error.is_schema() && error.to_string().contains("newer"),
        "{error}"
    );
    let error = tower_llm_quota_postgres::migrate(database.url())
        .await
        .unwrap_err();
    assert!(
        error.is_schema() && error.to_string().contains("newer"),
        "{error}"
    );
}

/// Eight processes migrating one database at once: each migration runs once, every call
/// answers the crate's version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_once_from_many_processes_at_once() {
    let database = TestDatabase::create();
    let url = database.url().to_owned();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { tower_llm_quota_postgres::migrate(&url).await })
        })
        .collect();
    for task in tasks {
        assert_eq!(task.await.unwrap().unwrap(), SCHEMA_VERSION);
    }
    let applied = database.psql(
        "SELECT string_agg(version::text, ',' ORDER BY version) FROM llm_quota.schema_migrations",
    );
    let expected: Vec<String> = (1..=SCHEMA_VERSION).map(|v| v.to_string()).collect();
    assert_eq!(applied, expected.join(","));
}

/// Account and tenant names that are SQL (quotes, a statement, a comment) are only names: they
/// reach the database as parameters, and the budgets of two such accounts stay apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_that_look_like_sql_are_only_names() {
    let database = support::migrated().await;
    let hostile = "x'); DROP TABLE llm_quota.buckets; --";
    let quota = ten_a_minute();
    let budget =
        |account: &'static str| PostgresBudget::new(database.url(), account).connect(&quota);
    let (a, b) = (budget(hostile).await.unwrap(), budget("x").await.unwrap());
    let tree = TenantTree::new().with_node(
        Tenant::parse("acme").unwrap(),
        TenantNode::new().with_limit(limit(Dimension::Requests, 3, Duration::from_secs(60), 3)),
    );
    let a = a.with_tenant_tree(tree).unwrap();
    for _ in 0..3 {
        let mut reservation = a
            .reserve(Cost::requests_only(1))
            .tenant(Tenant::parse("acme").unwrap())
            .await
            .unwrap();
        reservation.mark_sent();
        reservation.charge_estimate();
    }
    // The other account has its own 10.
    let mut spent = 0;
    for _ in 0..20 {
        let reserve = b.reserve(Cost::requests_only(1));
        if let Ok(Ok(mut reservation)) =
            tokio::time::timeout(Duration::from_millis(300), reserve).await
        {
            reservation.mark_sent();
            reservation.charge_estimate();
            spent += 1;
        }
    }
    assert_eq!(spent, 10);
    let tables = database.psql("SELECT count(*) FROM pg_tables WHERE schemaname = 'llm_quota'");
    assert_ne!(tables, "0");
    assert!(
        database
            .psql("SELECT count(*) FROM llm_quota.buckets")
            .parse::<u64>()
            .is_ok()
    );
}

/// Ten requests a minute, all at once.
fn ten_a_minute() -> Quota {
    Quota::new().with_limit(limit(Dimension::Requests, 10, Duration::from_secs(60), 10))
}

/// The idempotency store's listener survives Postgres restarting as after a crash: a waiter
/// is woken when it reconnects (it may have missed a notification), and a completion after it
/// wakes a waiter again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_waiters_survive_a_restart_of_postgres() {
    let server = migrated_cluster().await;
    let (first, other) = (
        PostgresIdempotencyStore::open(&server.url()).unwrap(),
        PostgresIdempotencyStore::open(&server.url()).unwrap(),
    );
    let lease = Duration::from_secs(60);
    assert_eq!(first.claim("k", "a", lease).await.unwrap(), Claim::Claimed);
    // Listening, then Postgres restarts: the waiter is woken (and would claim again).
    let started = Instant::now();
    let waiter = tokio::spawn(other.changed("k", Duration::from_secs(30)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.restart_immediate();
    tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("woken by the reconnection")
        .unwrap()
        .unwrap();
    println!("woken {:?} after it began waiting", started.elapsed());
    // The claim outlived the crash (committed), and a completion wakes the next waiter.
    let claimed = loop {
        match other.claim("k", "b", lease).await {
            Ok(claim) => break claim,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    assert_eq!(claimed, Claim::InFlight);
    let waiter = tokio::spawn(other.changed("k", Duration::from_secs(30)));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let record = Record::new(
        http::StatusCode::OK,
        &http::HeaderMap::new(),
        None,
        Some(bytes::Bytes::from("done")),
    );
    first.complete("k", "a", record, Duration::from_secs(60));
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("woken by the completion")
        .unwrap()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// `n` processes on one account, asking per admission or leasing (`leased`), each falling
/// back to `1 / n` of it as Postgres last counted them: Postgres killed, together they admit
/// no more than the account allows (a fixed half let 1.5x through with three).
async fn live_shares_hold_the_account(n: usize, leased: bool) {
    let server = migrated_cluster().await;
    let quota = OUTAGE_ACCOUNT.quota();
    let mut budgets = Vec::new();
    for _ in 0..n {
        let mut builder = PostgresBudget::new(server.url(), "live")
            .timeout(Duration::from_millis(250))
            .expected_instances(2)
            .slot_lease(Duration::from_millis(300));
        if leased {
            builder = builder.leased_shares(Duration::from_millis(50));
        }
        budgets.push(builder.connect(&quota).await.unwrap());
    }
    println!("leased: {leased}");
    local_shares_follow_the_live_fleet(&budgets, || server.kill(), Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_shares_follow_the_live_fleet_per_admission() {
    for n in [2, 3, 5] {
        live_shares_hold_the_account(n, false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_shares_follow_the_live_fleet_leased() {
    for n in [2, 3, 5] {
        live_shares_hold_the_account(n, true).await;
    }
}
