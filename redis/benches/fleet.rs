//! A fleet on one Redis: 8 processes x 64 tasks reserving and settling against one account on
//! a private loopback `redis-server`, with leased shares
//! ([`RedisBudget::leased_shares`]) and with one script call per admission, side by side in one
//! run; the measures are the test support's `bench` (an account far above the load, and
//! a binding one), with the script calls per admission (the server's `INFO commandstats`).
//!
//! ```sh
//! cargo bench -p tower-llm-quota-redis --bench fleet
//! ```

use std::time::Duration;

use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_test_support::bench::{self, Asked, BIN, BURST, PROCESSES, RUN, TASKS};
use tower_llm_quota_test_support::redis_server::RedisServer;

const REFRESH: Duration = Duration::from_millis(100);

fn main() {
    if let Some((asked, start)) = bench::as_child() {
        bench::child(&asked, start, |asked, quota| async move {
            let mut builder =
                RedisBudget::new(&asked.url, &asked.key).timeout(Duration::from_millis(500));
            if asked.refresh_ms > 0 {
                builder = builder.leased_shares(Duration::from_millis(asked.refresh_ms));
            }
            builder.connect(&quota).await.unwrap()
        });
        return;
    }
    let server = RedisServer::start();
    let fleet = |refresh_ms: u64, binding: bool, key: String| {
        server.command("CONFIG RESETSTAT");
        let figures = bench::fleet(&Asked {
            url: server.url(),
            refresh_ms,
            binding,
            key,
        });
        let (calls, _) = server.script_stats();
        let per_admission = calls as f64 / figures.admissions.max(1) as f64;
        (figures, per_admission)
    };
    println!("{PROCESSES} processes x {TASKS} tasks, {RUN:?} each, one redis-server:");
    let leases = REFRESH.as_millis() as u64;
    // Leases renewed every 100 ms (both accounts), every 25 ms (the binding account: a
    // quarter of the time its burst takes to refill), and a call per admission.
    let modes = [
        (leases, "leases (100 ms)", true),
        (leases / 4, "leases (25 ms)", false),
        (0, "a call per admission", true),
    ];
    for (round, key) in ["a", "b"].into_iter().enumerate() {
        for (refresh, mode, free_too) in modes {
            if free_too {
                let (free, calls) = fleet(refresh, false, format!("free-{key}-{refresh}"));
                println!(
                    "round {}, {mode}: {} admissions, {:.0}/s, {calls:.4} script calls per \
                     admission",
                    round + 1,
                    free.admissions,
                    free.per_second,
                );
            }
            let (bound, calls) = fleet(refresh, true, format!("bound-{key}-{refresh}"));
            let (excess, window, used) = bound.against_the_bound();
            println!(
                "round {}, {mode}, binding account: busiest window {} ms, {excess:+} tokens \
                 against its bound ({:+.2} % of the burst); {:.1} % of the rate and burst used; \
                 {calls:.4} script calls per admission",
                round + 1,
                window * BIN.as_millis() as usize,
                excess as f64 / BURST as f64 * 100.0,
                used * 100.0,
            );
        }
    }
}
