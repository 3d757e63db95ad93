//! Chaos soak: many callers through the whole stack against the simulated provider, with
//! random cancellations at every stage, provider faults (server errors, connection resets,
//! latency spikes, a quota cut without notice) and a shared Redis store killed, paused
//! (SIGSTOP) and flushed, checking throughout and at the end that:
//!
//! - the provider never counts more than a limit plus its burst in any sliding window (more
//!   only by what a lost store is documented to cost: one burst per process falling back, one
//!   for the store coming back empty);
//! - every request is accounted for: a response, the crate's typed error, or a cancellation;
//! - no task panics or hangs;
//! - once idle, every budget is full again and holds nothing in flight (no reservation leaked,
//!   in memory or in Redis).
//!
//! Real time, a simulated minute of one second, seeded. The run lasts `SOAK_SECS` seconds
//! (default 5, the CI run); the seed is `SOAK_SEED` (default 18). The long run:
//!
//! ```text
//! SOAK_SECS=180 cargo test --all-features --test layers soak:: -- --nocapture
//! ```

use tower_llm_quota_test_support::redis_server;

use std::num::NonZeroU64;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tokio::time::{Instant, sleep, timeout};
use tower::{Layer, ServiceExt};
use tower_llm_quota::budget::FailurePolicy;
use tower_llm_quota::stack::{QuotaService, QuotaStack};
use tower_llm_quota::{Budget, Deadline, Dimension, Error, Limit, Priority, Quota};
use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_sim::{Faults, SimConfig, Simulator};

use redis_server::RedisServer;

/// The simulated minute: every window of the quota lasts this long.
const MINUTE: Duration = Duration::from_secs(1);
/// The client's quota per minute and its bursts.
const RPM: u64 = 240;
const RPM_BURST: u64 = 40;
const TPM: u64 = 60_000;
const TPM_BURST: u64 = 10_000;
/// Callers per stack.
const CALLERS: usize = 24;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn quota() -> Quota {
    let nz = |n| NonZeroU64::new(n).unwrap();
    let limit = |dimension, amount, burst| {
        Limit::new(dimension, nz(amount), MINUTE)
            .unwrap()
            .with_burst(nz(burst))
    };
    Quota::new()
        .with_limit(limit(Dimension::Requests, RPM, RPM_BURST))
        .with_limit(limit(Dimension::TotalTokens, TPM, TPM_BURST))
}

/// A provider whose own limits are four times the client's, so that its count measures what
/// the client let through; `cut` lowers its token limit below the client's, without notice.
fn provider(seed: u64, cut: Option<Duration>) -> Simulator {
    let faults = Faults::none()
        .server_errors(0.04)
        .connection_resets(0.03)
        .latency_spikes(0.05, Duration::from_millis(300));
    let mut config = SimConfig::openai(4 * RPM, 4 * TPM)
        .minute(MINUTE)
        .latency(Duration::from_millis(15), Duration::from_micros(100))
        .max_output_tokens(400)
        .faults(faults)
        .seed(seed);
    if let Some(at) = cut {
        config = config.lower_limit_at(at, Dimension::TotalTokens, TPM / 4);
    }
    Simulator::new(config)
}

fn stack(quota: Quota) -> QuotaStack {
    QuotaStack::openai(quota.clone())
        .with_budget(Budget::new(quota))
        .estimate(tower_llm_quota::EstimateLayer::new().include_stream_usage(true))
}

type Llm = QuotaService<tower_llm_quota_sim::SimService>;

/// What became of the requests, counted once each.
#[derive(Debug, Default)]
struct Tally {
    sent: AtomicU64,
    ok: AtomicU64,
    /// A final error response (a 429 or 5xx the retry layer stopped retrying).
    error_status: AtomicU64,
    /// A body that failed after its head (a reset mid-stream).
    body_failed: AtomicU64,
    /// Refused or failed before anything was sent, by this crate.
    local: AtomicU64,
    retries_exhausted: AtomicU64,
    inner: AtomicU64,
    cancelled: AtomicU64,
}

impl Tally {
    fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    fn accounted(&self) -> u64 {
        [
            &self.ok,
            &self.error_status,
            &self.body_failed,
            &self.local,
            &self.retries_exhausted,
            &self.inner,
            &self.cancelled,
        ]
        .into_iter()
        .map(Self::get)
        .sum()
    }
}

fn request(rng: &mut fastrand::Rng) -> http::Request<Full<Bytes>> {
    let priority = [Priority::Interactive, Priority::Async, Priority::Batch][rng.usize(0..3)];
    let prompt = "word ".repeat(rng.usize(10..400));
    let body = serde_json::json!({
        "model": "gpt-sim",
        "max_tokens": rng.u64(20..300),
        "stream": rng.bool(),
        "messages": [{"role": "user", "content": prompt}],
    });
    http::Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-soak")
        .extension(priority)
        .extension(Deadline::after(Duration::from_millis(rng.u64(200..3_000))))
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

/// Counts an error of the stack: always the crate's typed error, and always one of its kinds.
fn count_error(tally: &Tally, error: &Error) {
    if error.is_local() {
        Tally::add(&tally.local);
    } else if error.is_retries_exhausted() {
        assert!(error.retry_report().is_some(), "{error:?}");
        Tally::add(&tally.retries_exhausted);
    } else {
        assert!(error.is_inner(), "an error of no kind: {error:?}");
        assert!(std::error::Error::source(error).is_some(), "{error:?}");
        Tally::add(&tally.inner);
    }
}

/// One caller: requests until `until`, each cancelled at a random stage or read to its end.
async fn caller(llm: Llm, seed: u64, until: Instant, tally: Arc<Tally>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    while Instant::now() < until {
        Tally::add(&tally.sent);
        let call = llm.clone().oneshot(request(&mut rng));
        let stage = rng.u8(0..10);
        let response = if stage == 0 {
            // Cancelled anywhere before the head: queued, waiting for the budget, sent.
            match timeout(Duration::from_millis(rng.u64(0..200)), call).await {
                Ok(response) => response,
                Err(_) => {
                    Tally::add(&tally.cancelled);
                    continue;
                }
            }
        } else {
            call.await
        };
        let response = match response {
            Ok(response) => response,
            Err(error) => {
                count_error(&tally, &error);
                continue;
            }
        };
        let success = response.status().is_success();
        let mut body = response.into_body();
        match stage {
            // Dropped with its head: the body is never read.
            1 => {
                drop(body);
                Tally::add(&tally.cancelled);
                continue;
            }
            // Dropped after a few frames.
            2 => {
                for _ in 0..rng.usize(1..4) {
                    if body.frame().await.is_none() {
                        break;
                    }
                }
                drop(body);
                Tally::add(&tally.cancelled);
                continue;
            }
            _ => {}
        }
        match body.collect().await {
            Ok(_) if success => Tally::add(&tally.ok),
            Ok(_) => Tally::add(&tally.error_status),
            Err(_) => Tally::add(&tally.body_failed),
        }
    }
}

/// Runs `CALLERS` callers on each of `stacks` until `until`; none may panic, and each must end
/// soon after `until` (its last request's deadline, at most 3 s, plus a margin).
async fn load(stacks: &[Llm], seed: u64, until: Instant, tally: &Arc<Tally>) {
    let mut tasks = Vec::new();
    for (s, llm) in stacks.iter().enumerate() {
        for c in 0..CALLERS {
            let seed = seed ^ ((s * CALLERS + c) as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            tasks.push(tokio::spawn(caller(
                llm.clone(),
                seed,
                until,
                tally.clone(),
            )));
        }
    }
    for task in tasks {
        let ended = timeout(
            until.saturating_duration_since(Instant::now()) + Duration::from_secs(10),
            task,
        )
        .await
        .expect("a caller hung");
        ended.expect("a caller panicked");
    }
}

/// Whether `budget` is full again and holds nothing: every limit at its capacity, no debt,
/// nothing in flight or waiting. Waits up to two minutes of refill.
async fn assert_full(name: &str, budget: &Budget) {
    let start = Instant::now();
    loop {
        let snapshot = budget.snapshot();
        let full = snapshot
            .limits()
            .iter()
            .all(|l| l.level() == l.capacity() as i64 && l.debt() == 0);
        if full && snapshot.in_flight() == 0 && snapshot.waiters() == 0 {
            return;
        }
        assert!(
            start.elapsed() < 2 * MINUTE + Duration::from_millis(500),
            "{name}: not full once idle: {snapshot:?}"
        );
        sleep(MINUTE / 20).await;
    }
}

/// The most the provider counted in a sliding window of `dimension`.
fn peak(provider: &Simulator, dimension: Dimension) -> u64 {
    let stats = provider.stats();
    stats
        .limit(dimension)
        .map(|l| l.max_in_window)
        .expect("the provider enforces the dimension")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_in_memory_survives_cancellations_and_provider_faults() {
    let secs = env("SOAK_SECS", 5);
    let seed = env("SOAK_SEED", 18);
    let started = std::time::Instant::now();
    let provider = provider(seed, Some(MINUTE * 2));
    let stack = stack(quota());
    let budget = stack.budget().clone();
    let llm = stack.layer(provider.service());
    let tally = Arc::new(Tally::default());
    let until = Instant::now() + Duration::from_secs(secs);
    load(&[llm], seed, until, &tally).await;
    assert_full("memory budget", &budget).await;

    let stats = provider.stats();
    let tokens = *budget.snapshot().limits()[1].limit();
    println!(
        "memory: {:.1} s, {} requests ({tally:?}); provider: {} received, {} admitted, {} \
         server errors, {} resets, {} latency spikes, {} 429s; peaks {} requests, {} tokens; \
         token limit after the cut {} (planned {})",
        started.elapsed().as_secs_f64(),
        Tally::get(&tally.sent),
        stats.received,
        stats.admitted,
        stats.server_errors,
        stats.connection_resets,
        stats.latency_spikes,
        stats.rate_limited,
        peak(&provider, Dimension::Requests),
        peak(&provider, Dimension::TotalTokens),
        tokens.amount(),
        tokens.effective_amount(),
    );
    assert_eq!(Tally::get(&tally.sent), tally.accounted(), "{tally:?}");
    assert!(Tally::get(&tally.ok) > 0, "{tally:?}");
    assert!(
        stats.server_errors + stats.connection_resets > 0,
        "no fault was injected"
    );
    assert!(peak(&provider, Dimension::Requests) <= RPM + RPM_BURST);
    assert!(peak(&provider, Dimension::TotalTokens) <= TPM + TPM_BURST);
    // The provider's cut, read from its headers, is the budget's limit now.
    assert_eq!(tokens.amount().get(), TPM / 4);
    // The share of it the budget plans for is not exact in real time. Alone on the key, the
    // adaptive share still sees a gap between what the provider would hold for this budget
    // alone and what it reports: a report is as old as its response's trip while the budget's
    // expectation is read on arrival (in this one-second minute, 20 ms of refill are the
    // default tolerance, 2 % of the limit, and a loaded machine delays responses by more), and
    // a stream dropped before its usage is settled with what was streamed while the simulator
    // charges the whole completion. While the buckets stay below full under load, that gap
    // grows past the tolerance and passes for someone else's spending (a 429 lowers the share
    // too); the share regains 10 % of the limit per period only while responses show the gap
    // closed, so the run may end before it is whole again. What holds: never more than the
    // cut, never less than the share's floor.
    let floor = tokens
        .adaptive_share()
        .map_or(1.0, |share| share.min_share());
    assert!(
        tokens.effective_amount() <= TPM / 4
            && tokens.effective_amount() as f64 >= (floor * (TPM / 4) as f64).floor(),
        "planned {} of the cut {}",
        tokens.effective_amount(),
        TPM / 4
    );
}

/// Kills, pauses and flushes `redis` in turn, one event every 1.2 windows, until `stop`.
async fn chaos(redis: &mut RedisServer, stop: &AtomicBool) -> [u64; 3] {
    let mut events = [0; 3];
    let mut turn = 0;
    while !stop.load(Ordering::Relaxed) {
        sleep(MINUTE * 6 / 5).await;
        if stop.load(Ordering::Relaxed) {
            break;
        }
        match turn % 3 {
            0 => {
                redis.kill();
                sleep(MINUTE / 4).await;
                redis.restart();
            }
            1 => {
                redis.pause();
                sleep(MINUTE / 4).await;
                redis.resume();
            }
            _ => assert_eq!(redis.command("FLUSHALL"), "+OK"),
        }
        events[turn % 3] += 1;
        turn += 1;
    }
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_shared_through_redis_survives_its_store_killed_paused_and_flushed() {
    let secs = env("SOAK_SECS", 5);
    let seed = env("SOAK_SEED", 18);
    let started = std::time::Instant::now();
    let mut redis = RedisServer::start();
    let provider = provider(seed ^ 1, None);
    let mut budgets = Vec::new();
    let mut stacks = Vec::new();
    for _ in 0..2 {
        let budget = RedisBudget::new(redis.url(), "soak")
            .timeout(Duration::from_millis(50))
            .failure_policy(FailurePolicy::local_share_of(2))
            .connect(&quota())
            .await
            .unwrap();
        budgets.push(budget.clone());
        stacks.push(stack(quota()).with_budget(budget).layer(provider.service()));
    }
    let tally = Arc::new(Tally::default());
    let stop = AtomicBool::new(false);
    let until = Instant::now() + Duration::from_secs(secs);
    let (events, ()) = tokio::join!(chaos(&mut redis, &stop), async {
        load(&stacks, seed, until, &tally).await;
        stop.store(true, Ordering::Relaxed);
    });
    for (i, budget) in budgets.iter().enumerate() {
        assert_full(&format!("process {i}"), budget).await;
    }

    let stats = provider.stats();
    println!(
        "redis: {:.1} s, {} requests ({tally:?}); store killed {}, paused {}, flushed {}; \
         provider: {} received, {} admitted, {} server errors, {} resets, {} latency spikes, \
         {} 429s; peaks {} requests, {} tokens",
        started.elapsed().as_secs_f64(),
        Tally::get(&tally.sent),
        events[0],
        events[1],
        events[2],
        stats.received,
        stats.admitted,
        stats.server_errors,
        stats.connection_resets,
        stats.latency_spikes,
        stats.rate_limited,
        peak(&provider, Dimension::Requests),
        peak(&provider, Dimension::TotalTokens),
    );
    assert_eq!(Tally::get(&tally.sent), tally.accounted(), "{tally:?}");
    assert!(Tally::get(&tally.ok) > 0, "{tally:?}");
    // At most one store event in any window: the processes' fallback shares add one burst
    // together, and a store back empty one more.
    assert!(peak(&provider, Dimension::Requests) <= RPM + 3 * RPM_BURST);
    assert!(peak(&provider, Dimension::TotalTokens) <= TPM + 3 * TPM_BURST);
    // No reservation left in the store, and its buckets full: a bucket's key expires once
    // it is full, a settled reservation leaves a tombstone (`d`) for 30 s, and one never
    // settled would keep its record for its ten-minute lease (the living processes' leases
    // on the account, their heartbeats, stay).
    let idle = Instant::now();
    loop {
        let left = live_keys(&redis.url()).await;
        if left.is_empty() {
            break;
        }
        assert!(
            idle.elapsed() < 2 * MINUTE + Duration::from_secs(1),
            "{} keys left in Redis besides tombstones, such as {:?}",
            left.len(),
            &left[..left.len().min(4)]
        );
        sleep(Duration::from_millis(100)).await;
    }
}

/// The keys of the store other than tombstones of settled reservations, with their values.
async fn live_keys(url: &str) -> Vec<(String, String)> {
    let client = redis::Client::open(url).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut connection)
        .await
        .unwrap();
    let mut live = Vec::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut connection)
            .await
            .unwrap();
        let value = if kind == "string" {
            redis::cmd("GET")
                .arg(&key)
                .query_async::<Option<String>>(&mut connection)
                .await
                .unwrap()
                .unwrap_or_default()
        } else {
            kind
        };
        // The processes' leases on the account (their heartbeats) last while they live.
        if value != "d" && !key.ends_with(":alive") {
            live.push((key, value));
        }
    }
    live
}
