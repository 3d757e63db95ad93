//! The benchmarks every shared store runs, beside the in-memory budget.
//!
//! **One process** ([`measure`]): tasks reserving and settling as fast as they can against an
//! account far above the load ([`far_above`]), so nothing waits: admissions a second and the
//! latency percentiles of one admission.
//!
//! **A fleet** ([`fleet`]): 8 processes × 64 tasks reserving and settling against one account,
//! with leased shares and with a store call per admission. Two measures per mode:
//! - **throughput**: an account far above the offered load, so nothing waits: admissions a
//!   second over the fleet;
//! - **a binding account** (100,000 tokens a second, a burst of a tenth of that): every
//!   process saturating it, the tokens admitted in every millisecond of the run, merged over
//!   the processes; the busiest window of any length against what the account's bucket
//!   allows in it (its burst and its rate over the window), and the account's rate used.
//!
//! Each process of a fleet is the benchmark's program again, started with
//! `FLEET_BENCH_CHILD` and the arguments [`fleet`] gives it, on a single-threaded runtime;
//! admissions are timed on the wall clock (shared by the processes of one machine). The
//! store's own counts (its calls) are the benchmark's to read.

use std::future::Future;
use std::num::NonZeroU64;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota};

/// Processes in the fleet.
pub const PROCESSES: usize = 8;
/// Tasks in each process.
pub const TASKS: usize = 64;
/// How long each process admits.
pub const RUN: Duration = Duration::from_secs(4);
/// The width of a bin of admissions.
pub const BIN: Duration = Duration::from_millis(1);
/// The binding account: tokens a second.
pub const RATE: u64 = 100_000;
/// The binding account's burst.
pub const BURST: u64 = 10_000;
/// Tokens each admission takes.
pub const COST: u64 = 100;

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).unwrap()
}

/// The binding account (`binding`), or one far above any load.
pub fn quota(binding: bool) -> Quota {
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

/// Three dimensions (requests, input and output tokens), far above any load.
pub fn far_above() -> Quota {
    Quota::new()
        .with_limit(Limit::per_second(Dimension::Requests, nz(1_000_000_000)))
        .with_limit(Limit::per_second(
            Dimension::InputTokens,
            nz(1_000_000_000_000),
        ))
        .with_limit(Limit::per_second(
            Dimension::OutputTokens,
            nz(1_000_000_000_000),
        ))
}

/// What one process admitted: in all, a second, and the latency percentiles of one
/// admission.
#[derive(Debug)]
pub struct Latencies {
    /// Admissions.
    pub admissions: usize,
    /// Admissions a second.
    pub per_second: f64,
    /// The median admission's time.
    pub p50: Duration,
    /// The 99th percentile admission's time.
    pub p99: Duration,
}

/// `tasks` tasks reserving (1,000 input and 200 output tokens) and settling (50 output) as
/// fast as they can for `run`, on the caller's runtime.
///
/// # Panics
///
/// When a reservation fails.
pub async fn measure(budget: &Budget, tasks: usize, run: Duration) -> Latencies {
    let start = Instant::now();
    let workers: Vec<_> = (0..tasks)
        .map(|_| {
            let budget = budget.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while start.elapsed() < run {
                    let asked = Instant::now();
                    let mut reservation = budget.reserve(Cost::new(1_000, 200)).await.unwrap();
                    latencies.push(asked.elapsed());
                    reservation.mark_sent();
                    reservation.settle_cost(Cost::new(1_000, 50).with_requests(1));
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for worker in workers {
        latencies.extend(worker.await.unwrap());
    }
    let elapsed = start.elapsed();
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    Latencies {
        admissions: latencies.len(),
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
    }
}

fn micros_since_epoch() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// What a child is asked: the store's URL, the lease refresh in milliseconds (0: a call per
/// admission), whether the account binds, the account's key.
#[derive(Debug, Clone)]
pub struct Asked {
    /// The store's URL.
    pub url: String,
    /// The lease refresh in milliseconds; 0 for a store call per admission.
    pub refresh_ms: u64,
    /// Whether the account binds ([`quota`]).
    pub binding: bool,
    /// The account's key in the store.
    pub key: String,
}

/// When this program runs as a child of [`fleet`]: what it is asked, and when to start (µs
/// since the epoch).
pub fn as_child() -> Option<(Asked, u64)> {
    std::env::var_os("FLEET_BENCH_CHILD")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    Some((
        Asked {
            url: args[0].clone(),
            refresh_ms: args[1].parse().unwrap(),
            binding: args[2] == "true",
            key: args[3].clone(),
        },
        args[4].parse().unwrap(),
    ))
}

/// One process of the fleet: connects with `connect`, then `TASKS` tasks reserve and settle
/// from `start` (µs since the epoch) for `RUN`; prints its admissions, then the tokens it
/// admitted per bin.
pub fn child<F, Fut>(asked: &Asked, start: u64, connect: F)
where
    F: FnOnce(Asked, Quota) -> Fut,
    Fut: Future<Output = Budget>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let budget = connect(asked.clone(), quota(asked.binding)).await;
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

/// What a fleet admitted: in all, a second, and per bin.
#[derive(Debug)]
pub struct Figures {
    /// Admissions over the fleet.
    pub admissions: u64,
    /// Admissions a second over the fleet.
    pub per_second: f64,
    /// Tokens admitted in each bin, over the fleet.
    pub bins: Vec<u64>,
}

impl Figures {
    /// The busiest window against the account's bound, and the account's rate and burst
    /// used (a share).
    pub fn against_the_bound(&self) -> (i64, usize, f64) {
        let (excess, window) = busiest(&self.bins);
        let used: u64 = self.bins.iter().sum();
        let offered = BURST as f64 + RATE as f64 * RUN.as_secs_f64();
        (excess, window, used as f64 / offered)
    }
}

/// Runs the fleet: `PROCESSES` copies of this program as children, asked `asked`, started
/// together.
///
/// # Panics
///
/// When a child fails.
pub fn fleet(asked: &Asked) -> Figures {
    let start = micros_since_epoch() + 1_500_000;
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            Command::new(std::env::current_exe().unwrap())
                .env("FLEET_BENCH_CHILD", "1")
                .args([
                    asked.url.clone(),
                    asked.refresh_ms.to_string(),
                    asked.binding.to_string(),
                    asked.key.clone(),
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
    Figures {
        admissions,
        per_second: admissions as f64 / RUN.as_secs_f64(),
        bins,
    }
}

/// The most tokens any window of whole bins holds beyond the account's burst and its rate
/// over the window (a bin's tokens may have been admitted anywhere in it: the window is
/// counted a bin shorter, to the bins' disadvantage); and the window, in bins.
pub fn busiest(bins: &[u64]) -> (i64, usize) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busiest_window_catches_a_planted_excess() {
        // The burst at once, then the rate, a bin's worth each bin.
        let mut bins = vec![RATE / 1_000; 100];
        bins[0] = BURST;
        assert_eq!(busiest(&bins).0, 0, "at the bound");
        bins[50] += COST;
        assert_eq!(busiest(&bins).0, COST as i64, "one admission too many");
    }
}
