//! A fleet on one Redis: 8 processes x 64 tasks reserving and settling against one account on
//! a private loopback `redis-server`, with leased shares
//! ([`RedisBudget::leased_shares`]) and with one script call per admission, side by side in one
//! run.
//!
//! ```sh
//! cargo bench --bench fleet
//! ```
//!
//! Two measures per mode:
//! - **throughput**: an account far above the offered load, so nothing waits: admissions a
//!   second over the fleet, and script calls per admission (the server's `INFO commandstats`);
//! - **a binding account** (100,000 tokens a second, a burst of a tenth of that): every
//!   process saturating it, the tokens admitted in every millisecond of the run, merged over the
//!   processes; the busiest window of any length against what the account's bucket allows
//!   in it (its burst and its rate over the window), and the account's rate used.
//!
//! Each process is this program again, started with `FLEET_BENCH_CHILD`, on a single-threaded
//! runtime; admissions are timed on the wall clock (shared by the processes of one machine).

use tower_llm_quota_test_support::redis_server;

use std::num::NonZeroU64;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis_server::RedisServer;
use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota};
use tower_llm_quota_redis::RedisBudget;

const PROCESSES: usize = 8;
const TASKS: usize = 64;
const RUN: Duration = Duration::from_secs(4);
const REFRESH: Duration = Duration::from_millis(100);
const BIN: Duration = Duration::from_millis(1);
/// The binding account: tokens a second, and its burst.
const RATE: u64 = 100_000;
const BURST: u64 = 10_000;
const COST: u64 = 100;

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).unwrap()
}

fn quota(binding: bool) -> Quota {
    if binding {
        let limit = Limit::per_second(Dimension::TotalTokens, nz(RATE))
            .with_headroom(1.0)
            .unwrap()
            .with_burst(nz(BURST));
        return Quota::new().with_limit(limit);
    }
    Quota::new()
        .with_limit(Limit::per_second(Dimension::Requests, nz(1_000_000_000)))
        .with_limit(Limit::per_second(
            Dimension::TotalTokens,
            nz(1_000_000_000_000),
        ))
}

fn micros_since_epoch() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// One process of the fleet: `TASKS` tasks reserve and settle from `start` (µs since the
/// epoch) for `RUN`; prints its admissions, then the tokens it admitted per bin.
fn child(url: &str, refresh_ms: u64, binding: bool, key: &str, start: u64) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut builder = RedisBudget::new(url, key).timeout(Duration::from_millis(500));
        if refresh_ms > 0 {
            builder = builder.leased_shares(Duration::from_millis(refresh_ms));
        }
        let budget: Budget = builder.connect(&quota(binding)).await.unwrap();
        let wait = start.saturating_sub(micros_since_epoch());
        tokio::time::sleep(Duration::from_micros(wait)).await;
        let end = Instant::now() + RUN;
        let bins = (RUN.as_micros() / BIN.as_micros()) as usize + 1;
        let workers: Vec<_> = (0..TASKS)
            .map(|_| {
                let budget = budget.clone();
                tokio::spawn(async move {
                    let mut admitted = vec![0u64; bins];
                    while Instant::now() < end {
                        let mut reservation = budget.reserve(Cost::new(COST, 0)).await.unwrap();
                        let at = micros_since_epoch().saturating_sub(start);
                        let bin = (at / BIN.as_micros() as u64) as usize;
                        if Instant::now() < end {
                            admitted[bin.min(bins - 1)] += COST;
                        }
                        reservation.mark_sent();
                        reservation.charge_estimate();
                        // Where a call would await its answer: the runtime's other tasks
                        // (the lease's renewal) get their turn.
                        tokio::task::consume_budget().await;
                    }
                    admitted
                })
            })
            .collect();
        let mut admitted = vec![0u64; bins];
        for worker in workers {
            for (total, bin) in admitted.iter_mut().zip(worker.await.unwrap()) {
                *total += bin;
            }
        }
        let count: u64 = admitted.iter().sum::<u64>() / COST;
        println!("admissions {count}");
        let bins: Vec<String> = admitted.iter().map(u64::to_string).collect();
        println!("bins {}", bins.join(","));
    });
}

struct Figures {
    admissions: u64,
    per_second: f64,
    calls_per_admission: f64,
    bins: Vec<u64>,
}

/// The fleet: `PROCESSES` children on `server`, started together.
fn fleet(server: &RedisServer, refresh_ms: u64, binding: bool, key: &str) -> Figures {
    server.command("CONFIG RESETSTAT");
    let start = micros_since_epoch() + 1_500_000;
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            Command::new(std::env::current_exe().unwrap())
                .env("FLEET_BENCH_CHILD", "1")
                .args([
                    server.url(),
                    refresh_ms.to_string(),
                    binding.to_string(),
                    key.to_owned(),
                    start.to_string(),
                ])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut admissions = 0;
    let mut bins: Vec<u64> = Vec::new();
    for child in children {
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "a process of the fleet failed");
        for line in String::from_utf8(output.stdout).unwrap().lines() {
            if let Some(n) = line.strip_prefix("admissions ") {
                admissions += n.parse::<u64>().unwrap();
            } else if let Some(list) = line.strip_prefix("bins ") {
                let theirs: Vec<u64> = list.split(',').map(|n| n.parse().unwrap()).collect();
                bins.resize(bins.len().max(theirs.len()), 0);
                for (total, bin) in bins.iter_mut().zip(theirs) {
                    *total += bin;
                }
            }
        }
    }
    let (calls, _) = server.script_stats();
    Figures {
        admissions,
        per_second: admissions as f64 / RUN.as_secs_f64(),
        calls_per_admission: calls as f64 / admissions.max(1) as f64,
        bins,
    }
}

/// The most tokens any window of whole bins holds beyond the account's burst and its rate
/// over the window (a bin's tokens may have been admitted anywhere in it: the window is
/// counted a bin shorter, to the bins' disadvantage); and the window.
fn busiest(bins: &[u64]) -> (i64, usize) {
    let mut worst = (i64::MIN, 0);
    for i in 0..bins.len() {
        let mut sum = 0i64;
        for (j, bin) in bins.iter().enumerate().skip(i) {
            sum += *bin as i64;
            let span = BIN.as_secs_f64() * (j - i) as f64;
            let allowed = BURST as f64 + RATE as f64 * span;
            let excess = sum - allowed.floor() as i64;
            if excess > worst.0 {
                worst = (excess, j - i + 1);
            }
        }
    }
    worst
}

fn main() {
    if std::env::var_os("FLEET_BENCH_CHILD").is_some() {
        let args: Vec<String> = std::env::args().skip(1).collect();
        child(
            &args[0],
            args[1].parse().unwrap(),
            args[2] == "true",
            &args[3],
            args[4].parse().unwrap(),
        );
        return;
    }
    let server = RedisServer::start();
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
                let free = fleet(&server, refresh, false, &format!("free-{key}-{refresh}"));
                println!(
                    "round {}, {mode}: {} admissions, {:.0}/s, {:.4} script calls per admission",
                    round + 1,
                    free.admissions,
                    free.per_second,
                    free.calls_per_admission
                );
            }
            let bound = fleet(&server, refresh, true, &format!("bound-{key}-{refresh}"));
            let (excess, window) = busiest(&bound.bins);
            let used: u64 = bound.bins.iter().sum();
            let offered = BURST as f64 + RATE as f64 * RUN.as_secs_f64();
            println!(
                "round {}, {mode}, binding account: busiest window {} ms, {excess:+} tokens \
                 against its bound ({:+.2} % of the burst); {:.1} % of the rate and burst used; \
                 {:.4} script calls per admission",
                round + 1,
                window * BIN.as_millis() as usize,
                excess as f64 / BURST as f64 * 100.0,
                used as f64 / offered * 100.0,
                bound.calls_per_admission
            );
        }
    }
}
