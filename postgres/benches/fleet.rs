//! A fleet on one Postgres: 8 processes x 64 tasks reserving and settling against one
//! account, with leased shares ([`PostgresBudget::leased_shares`]) and with a statement per
//! admission, side by side in one run; the measures are the test support's `bench` (an
//! account far above the load, and a binding one), with the transactions the database
//! committed a second and per admission (`pg_stat_database`).
//!
//! ```sh
//! cargo bench -p tower-llm-quota-postgres --bench fleet
//! ```
//!
//! Postgres is the machine's server (`TEST_POSTGRES_URL`), a database of the run's own, with
//! the server's durability settings.

use std::time::Duration;

use tower_llm_quota_postgres::PostgresBudget;
use tower_llm_quota_test_support::bench::{self, Asked, BIN, BURST, PROCESSES, RUN, TASKS};
use tower_llm_quota_test_support::postgres_server::TestDatabase;

fn main() {
    if let Some((asked, start)) = bench::as_child() {
        bench::child(&asked, start, |asked, quota| async move {
            let mut builder =
                PostgresBudget::new(&asked.url, &asked.key).timeout(Duration::from_millis(500));
            if asked.refresh_ms > 0 {
                builder = builder.leased_shares(Duration::from_millis(asked.refresh_ms));
            }
            builder.connect(&quota).await.unwrap()
        });
        return;
    }
    let database = TestDatabase::create();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(tower_llm_quota_postgres::migrate(database.url()))
        .expect("migrated");
    let fleet = |refresh_ms: u64, binding: bool, key: String| {
        let before = database.transactions();
        let figures = bench::fleet(&Asked {
            url: database.url().to_owned(),
            refresh_ms,
            binding,
            key,
        });
        let run = database.transactions() - before;
        (figures, run)
    };
    println!("{PROCESSES} processes x {TASKS} tasks, {RUN:?} each, one Postgres:");
    // Leases renewed every 100 ms (both accounts), every 25 ms (the binding account: a
    // quarter of the time its burst takes to refill), and a statement per admission.
    let modes = [
        (100, "leases (100 ms)", true),
        (25, "leases (25 ms)", false),
        (0, "a statement per admission", true),
    ];
    for (round, key) in ["a", "b"].into_iter().enumerate() {
        for (refresh, mode, free_too) in modes {
            if free_too {
                let (free, run) = fleet(refresh, false, format!("free-{key}-{refresh}"));
                println!(
                    "round {}, {mode}: {} admissions, {:.0}/s, {:.0} transactions/s, {:.4} per \
                     admission",
                    round + 1,
                    free.admissions,
                    free.per_second,
                    run as f64 / RUN.as_secs_f64(),
                    run as f64 / free.admissions.max(1) as f64,
                );
            }
            let (bound, run) = fleet(refresh, true, format!("bound-{key}-{refresh}"));
            let (excess, window, used) = bound.against_the_bound();
            println!(
                "round {}, {mode}, binding account: busiest window {} ms, {excess:+} tokens \
                 against its bound ({:+.2} % of the burst); {:.1} % of the rate and burst used; \
                 {:.0} transactions/s, {:.4} per admission",
                round + 1,
                window * BIN.as_millis() as usize,
                excess as f64 / BURST as f64 * 100.0,
                used * 100.0,
                run as f64 / RUN.as_secs_f64(),
                run as f64 / bound.admissions.max(1) as f64,
            );
        }
    }
}
