//! Reserve + settle with a statement per admission, on Postgres beside Redis and the
//! in-memory budget, in one run: admissions a second and latency percentiles from 1 and 64
//! concurrent tasks of one process, and the transactions the database committed per
//! admission (`pg_stat_database`).
//!
//! ```sh
//! cargo bench -p tower-llm-quota-postgres --bench postgres
//! ```
//!
//! Postgres is the machine's server (`TEST_POSTGRES_URL`, by default
//! `postgres://postgres@127.0.0.1:5432/postgres`), a database of the run's own, with the
//! server's durability settings (on a default server: `fsync` and `synchronous_commit` on,
//! each admission's commit waiting for the write-ahead log to reach the disk); Redis a private
//! loopback `redis-server` without persistence (its default). The quota is far above the
//! offered load, so nothing waits: this measures the cost of an admission, not the quota. The
//! tasks run on one thread, leaving the other core of a 2-core machine to the database.

use std::time::Duration;

use tower_llm_quota::Budget;
use tower_llm_quota::budget::FailurePolicy;
use tower_llm_quota_postgres::PostgresBudget;
use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_test_support::bench::{far_above as quota, measure};
use tower_llm_quota_test_support::postgres_server::TestDatabase;
use tower_llm_quota_test_support::redis_server::RedisServer;

const RUN: Duration = Duration::from_secs(3);

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let database = TestDatabase::create();
    tower_llm_quota_postgres::migrate(database.url())
        .await
        .expect("migrated");
    let postgres = PostgresBudget::new(database.url(), "bench")
        .failure_policy(FailurePolicy::FailClosed)
        .connect(&quota())
        .await
        .expect("connected to Postgres");
    // The same with a pool four times the default: more commits wait for the log together.
    let pooled = PostgresBudget::new(database.url(), "bench-32")
        .failure_policy(FailurePolicy::FailClosed)
        .connections(32)
        .connect(&quota())
        .await
        .expect("connected to Postgres");
    let server = RedisServer::start();
    let redis = RedisBudget::new(server.url(), "bench")
        .failure_policy(FailurePolicy::FailClosed)
        .connect(&quota())
        .await
        .expect("connected to Redis");
    let memory = Budget::new(quota());

    println!("reserve + settle, 3 dimensions, {RUN:?} per row, one process, nothing waits");
    println!(
        "{:<10} {:>6} {:>12} {:>14} {:>10} {:>10}",
        "store", "tasks", "admissions", "admissions/s", "p50", "p99"
    );
    let mut rows = Vec::new();
    for tasks in [1, 64] {
        let before = database.transactions();
        let figures = measure(&postgres, tasks, RUN).await;
        // The settlements sent in the background are done.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let after = database.transactions();
        let per_admission = (after - before) as f64 / figures.admissions as f64;
        rows.push(("postgres", tasks, figures, Some(per_admission)));
        if tasks > 1 {
            rows.push((
                "pg, 32 con",
                tasks,
                measure(&pooled, tasks, RUN).await,
                None,
            ));
        }
        rows.push(("redis", tasks, measure(&redis, tasks, RUN).await, None));
        rows.push(("memory", tasks, measure(&memory, tasks, RUN).await, None));
    }
    for (store, tasks, f, statements) in &rows {
        println!(
            "{store:<10} {tasks:>6} {:>12} {:>14.0} {:>10.1?} {:>10.1?}{}",
            f.admissions,
            f.per_second,
            f.p50,
            f.p99,
            statements.map_or(String::new(), |s| format!(
                "   {s:.3} transactions per admission (the reservation, its settlement, the \
                 process's background calls)"
            ))
        );
    }
    for tasks in [1, 64] {
        let find = |store: &str| {
            rows.iter()
                .find(|(s, t, _, _)| *s == store && *t == tasks)
                .map(|(_, _, f, _)| f)
                .unwrap()
        };
        let (postgres, redis) = (find("postgres"), find("redis"));
        println!(
            "{tasks} tasks: postgres / redis admissions per second = {:.2}x, p99 {:.2}x",
            postgres.per_second / redis.per_second,
            postgres.p99.as_secs_f64() / redis.p99.as_secs_f64()
        );
    }
}
