//! Reserve + settle against a private loopback `redis-server` and a private three-node Redis
//! Cluster, beside the in-memory budget in the same run: admissions per second and latency
//! percentiles from 1 and 64 concurrent tasks, and Redis round trips per admission (counted by
//! the server's `INFO commandstats`; on the cluster, by the node holding the quota's slot).
//!
//! ```sh
//! cargo bench --bench redis
//! ```
//!
//! The quota is far above the offered load, so nothing waits: this measures the cost of an
//! admission, not the quota. The tasks run on one thread, leaving the other core of a 2-core
//! machine to Redis.

use std::time::Duration;

use tower_llm_quota::{Budget, budget::FailurePolicy};
use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_test_support::bench::{far_above as quota, measure};
use tower_llm_quota_test_support::redis_server::{RedisServer, cluster::RedisCluster};

const RUN: Duration = Duration::from_secs(3);

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let server = RedisServer::start();
    let redis_budget = RedisBudget::new(server.url(), "bench")
        .failure_policy(FailurePolicy::FailClosed)
        .connect(&quota())
        .await
        .expect("connected");
    let cluster = RedisCluster::start(3);
    let cluster_budget = RedisBudget::cluster(cluster.urls(), "bench")
        .failure_policy(FailurePolicy::FailClosed)
        .connect(&quota())
        .await
        .expect("connected to the cluster");
    // Every key of the quota is on one node: the one serving its hash tag's slot.
    let slot_owner = cluster.node(cluster.owner("llmq:{bench}:probe"));
    let memory = Budget::new(quota());

    println!("reserve + settle, 3 dimensions, {RUN:?} per row, nothing waits");
    println!(
        "{:<10} {:>6} {:>12} {:>14} {:>10} {:>10}",
        "store", "tasks", "admissions", "admissions/s", "p50", "p99"
    );
    let mut rows = Vec::new();
    for tasks in [1, 64] {
        for (store, budget, server) in [
            ("redis", &redis_budget, &server),
            ("cluster", &cluster_budget, slot_owner),
        ] {
            let before = server.script_stats();
            let figures = measure(budget, tasks, RUN).await;
            tokio::time::sleep(Duration::from_millis(200)).await; // settlements drain
            let after = server.script_stats();
            let (calls, usec) = (after.0 - before.0, after.1 - before.1);
            println!(
                "{store}, {tasks} tasks: the server spent {:.1} µs per script call, {:.1} µs per reservation",
                usec as f64 / calls as f64,
                usec as f64 / figures.admissions as f64
            );
            let round_trips = calls as f64 / figures.admissions as f64;
            rows.push((store, tasks, figures, Some(round_trips)));
        }
        let figures = measure(&memory, tasks, RUN).await;
        rows.push(("memory", tasks, figures, None));
    }
    for (store, tasks, f, round_trips) in &rows {
        println!(
            "{store:<10} {tasks:>6} {:>12} {:>14.0} {:>10.1?} {:>10.1?}{}",
            f.admissions,
            f.per_second,
            f.p50,
            f.p99,
            round_trips.map_or(String::new(), |r| format!(
                "   {r:.3} script calls per reservation (one to admit, settlements batched)"
            ))
        );
    }
    for tasks in [1, 64] {
        let find = |store: &str| {
            rows.iter()
                .find(|(s, t, _, _)| *s == store && *t == tasks)
                .map(|(_, _, f, _)| f.per_second)
                .unwrap()
        };
        println!(
            "{tasks} tasks: memory / redis admissions per second = {:.0}x, \
             cluster / single node = {:.2}x",
            find("memory") / find("redis"),
            find("cluster") / find("redis")
        );
    }
}
