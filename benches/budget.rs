//! Cost of admitting a request: [`Budget`] against `governor`'s direct rate limiter.
//!
//! Run with `cargo bench --bench budget` (criterion; extra options after `--`, e.g.
//! `cargo bench --bench budget -- --warm-up-time 1 --measurement-time 3`).
//!
//! Groups, peers side by side:
//!
//! - `uncontended`: one thread. Ours is `try_reserve` + `settle_cost` of a 3-dimension cost
//!   (requests, input tokens, output tokens), plus the same through the `reserve()` future
//!   when it is ready at once. Peers: one `governor` `check_n`, and three `check_n` on three
//!   limiters (one per dimension).
//! - `contended_2_threads`: the same operations, two threads hammering one shared `Budget` /
//!   one shared `governor` limiter.
//! - `denied`: the answer "not yet" on an exhausted budget / limiter.
//! - `waiting`: ours only: joining the wait queue behind a sleeping head and leaving it.
//! - `spend`: ours only, the cost of spend limits: reserve + settle with a provider's `Usage`
//!   on the 3-dimension budget, unpriced, against the same on a budget that also limits
//!   spend, each request priced as the estimation layer prices it (its model looked up in a
//!   table of 24 models, its estimate's spend reserved, its usage's spend settled).
//!
//! Printed first: the memory a waiting request holds (data segment growth over 10,000
//! waiters queued behind a taken in-flight slot, the futures themselves counted apart).
//!
//! Every limit is sized so the benchmarks never run out (a denial would panic), except in
//! `denied` where it is the point. `governor`'s cost does not depend on `n` (GCRA does one
//! multiplication); its finest replenish interval is 1 ns, so a tight loop can only sustain a
//! small `n` without draining: it checks `GOV_N` cells.

#[path = "support/memory.rs"]
mod memory;

use std::hint::black_box;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll, Waker};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use governor::{DefaultDirectRateLimiter, Quota as GovQuota, RateLimiter};
use memory::data_segment;
use tower_llm_quota::pricing::{ModelPrices, PriceTable, TokenPrices, Unpriced};
use tower_llm_quota::provider::Profile;
use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota, Usage, error::TryReserveError};

/// Reserved per request: 1 request, 1 200 input tokens, 200 output tokens.
const ESTIMATE: Cost = Cost::new(1_200, 200);
/// Settled with: 150 output tokens unused, refunded.
const ACTUAL: Cost = Cost::new(1_200, 50);
/// Cells per `governor` check.
const GOV_N: NonZeroU32 = NonZeroU32::new(8).unwrap();

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).unwrap()
}

/// A limit of `dimension` of 10^12 per second with a 10^15 burst: never runs out.
fn huge(dimension: Dimension) -> Limit {
    Limit::per_second(dimension, nz(1_000_000_000_000))
        .with_headroom(1.0)
        .unwrap()
        .with_burst(nz(1_000_000_000_000_000))
}

/// Requests, input and output tokens, each [`huge`].
fn huge_budget() -> Budget {
    let quota = Quota::new()
        .with_limit(huge(Dimension::Requests))
        .with_limit(huge(Dimension::InputTokens))
        .with_limit(huge(Dimension::OutputTokens));
    Budget::new(quota)
}

/// The same with a [`huge`] limit of spend.
fn huge_budget_with_spend() -> Budget {
    let quota = Quota::new()
        .with_limit(huge(Dimension::Requests))
        .with_limit(huge(Dimension::InputTokens))
        .with_limit(huge(Dimension::OutputTokens))
        .with_limit(huge(Dimension::Spend));
    Budget::new(quota)
}

/// 24 models, a dozen exact and a dozen prefixes, the one asked for among the last.
fn price_table() -> PriceTable {
    let prices = TokenPrices::per_million_usd("2.50", "1.25", "2.50", "10").unwrap();
    (0..12).fold(PriceTable::new(Unpriced::Refuse), |table, i| {
        table
            .with_model(format!("model-{i}"), ModelPrices::new(prices))
            .with_model(format!("family-{i}*"), ModelPrices::new(prices))
    })
}

/// Settled with: 1,200 input tokens of which 1,024 from the cache, 50 output tokens.
const USAGE: Usage = Usage::new(1_200, 50).with_cache_read_tokens(1_024);

/// 10^9 cells per second (1 ns each, governor's finest), burst 10^9: never runs out at
/// `GOV_N` cells per check.
fn huge_governor() -> DefaultDirectRateLimiter {
    RateLimiter::direct(GovQuota::per_second(
        NonZeroU32::new(1_000_000_000).unwrap(),
    ))
}

#[inline]
fn ours(budget: &Budget) {
    let reservation = budget.try_reserve(black_box(ESTIMATE)).unwrap();
    black_box(reservation.settle_cost(black_box(ACTUAL)));
}

#[inline]
fn ours_future(budget: &Budget, cx: &mut Context<'_>) {
    let reserve = std::pin::pin!(budget.reserve(black_box(ESTIMATE)));
    let Poll::Ready(Ok(reservation)) = reserve.poll(cx) else {
        panic!("the budget ran out");
    };
    black_box(reservation.settle_cost(black_box(ACTUAL)));
}

#[inline]
fn gov(limiter: &DefaultDirectRateLimiter) {
    assert!(matches!(limiter.check_n(black_box(GOV_N)), Ok(Ok(()))));
}

fn uncontended(c: &mut Criterion) {
    let mut group = c.benchmark_group("uncontended");
    group.throughput(Throughput::Elements(1));

    let budget = huge_budget();
    group.bench_function("budget_try_reserve_settle_3dim", |b| {
        b.iter(|| ours(&budget))
    });

    let budget = huge_budget();
    let mut cx = Context::from_waker(Waker::noop());
    group.bench_function("budget_reserve_future_ready_settle_3dim", |b| {
        b.iter(|| ours_future(&budget, &mut cx))
    });

    let limiter = huge_governor();
    group.bench_function("governor_check_n", |b| b.iter(|| gov(&limiter)));

    let limiters = [huge_governor(), huge_governor(), huge_governor()];
    group.bench_function("governor_check_n_x3", |b| {
        b.iter(|| limiters.iter().for_each(gov))
    });

    group.finish();
}

/// Runs `op` `iters` times on each of 2 threads, started together; returns the wall time from
/// the start until both finish. Thread spawning is outside the timed span.
///
/// So the reported time per iteration is the wall time for *each* of the 2 threads to complete
/// one operation while the other competes for the same state (2 operations done per reported
/// time; the throughput, set to 2 elements, is the total operations per second).
fn two_threads<S: Clone + Send + 'static>(iters: u64, shared: &S, op: fn(&S)) -> Duration {
    let start = Arc::new(Barrier::new(3));
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (start, shared) = (Arc::clone(&start), shared.clone());
            thread::spawn(move || {
                start.wait();
                for _ in 0..iters {
                    op(&shared);
                }
            })
        })
        .collect();
    start.wait();
    let began = Instant::now();
    for worker in workers {
        worker.join().unwrap();
    }
    began.elapsed()
}

fn contended(c: &mut Criterion) {
    let mut group = c.benchmark_group("contended_2_threads");
    group.throughput(Throughput::Elements(2));

    let budget = huge_budget();
    group.bench_function("budget_try_reserve_settle_3dim", |b| {
        b.iter_custom(|iters| two_threads(iters, &budget, ours))
    });

    let limiter = Arc::new(huge_governor());
    group.bench_function("governor_check_n", |b| {
        b.iter_custom(|iters| two_threads(iters, &limiter, |l| gov(l)))
    });

    group.finish();
}

fn denied(c: &mut Criterion) {
    let mut group = c.benchmark_group("denied");
    group.throughput(Throughput::Elements(1));

    // One request a day, taken and held: every later request is told "not yet".
    let budget = Budget::new(Quota::new().with_limit(Limit::per_day(Dimension::Requests, nz(1))));
    let held = budget.try_reserve(Cost::requests_only(1)).unwrap();
    group.bench_function("budget_try_reserve_not_yet", |b| {
        b.iter(|| {
            let denied = budget.try_reserve(black_box(Cost::requests_only(1)));
            assert!(matches!(denied, Err(TryReserveError::NotYet(_))));
            black_box(denied)
        })
    });
    drop(held);

    let limiter = RateLimiter::direct(GovQuota::per_hour(NonZeroU32::MIN));
    assert!(limiter.check().is_ok());
    group.bench_function("governor_check_n_not_until", |b| {
        b.iter(|| {
            let denied = limiter.check_n(black_box(NonZeroU32::MIN));
            assert!(matches!(denied, Ok(Err(_))));
            black_box(denied)
        })
    });

    group.finish();
}

fn waiting(c: &mut Criterion) {
    let mut group = c.benchmark_group("waiting");
    group.throughput(Throughput::Elements(1));

    // A head waits (on the runtime's timer, real clock) for tomorrow's request; each iteration
    // polls a second request once, which queues behind it, then drops it, which leaves the
    // queue. No time passes and nothing is woken: the queue bookkeeping alone.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _entered = runtime.enter();
    let budget = Budget::new(Quota::new().with_limit(Limit::per_day(Dimension::Requests, nz(1))));
    let held = budget.try_reserve(Cost::requests_only(1)).unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    let mut head = Box::pin(budget.reserve(Cost::requests_only(1)));
    assert!(head.as_mut().poll(&mut cx).is_pending());
    group.bench_function("budget_queue_behind_head_then_cancel", |b| {
        b.iter(|| {
            let waiter = std::pin::pin!(budget.reserve(black_box(Cost::requests_only(1))));
            assert!(waiter.poll(&mut cx).is_pending());
        })
    });
    assert_eq!(budget.waiters(), 1);
    drop(head);
    drop(held);

    group.finish();
}

/// Bytes held per waiting request: the budget's side (its place in the ordering, its fair
/// share's record), and the `reserve()` future itself.
fn memory_per_waiter() -> (usize, usize) {
    const WAITERS: usize = 10_000;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _context = runtime.enter();
    let budget = Budget::new(
        Quota::new()
            .with_limit(Limit::per_minute(Dimension::Requests, nz(u64::MAX / 4)))
            .with_max_in_flight(std::num::NonZeroUsize::MIN),
    );
    let held = budget.try_reserve(Cost::requests_only(1)).unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    let mut futures = Vec::with_capacity(WAITERS);
    for _ in 0..WAITERS {
        futures.push(Box::pin(budget.reserve(Cost::requests_only(1))));
    }
    let before = data_segment();
    for future in &mut futures {
        assert!(future.as_mut().poll(&mut cx).is_pending());
    }
    let after = data_segment();
    assert_eq!(budget.waiters(), WAITERS);
    drop(futures);
    drop(held);
    let future = std::mem::size_of::<tower_llm_quota::budget::Reserve>();
    (after.saturating_sub(before) / WAITERS, future)
}

fn spend(c: &mut Criterion) {
    let mut group = c.benchmark_group("spend");
    group.throughput(Throughput::Elements(1));

    let budget = huge_budget();
    group.bench_function("budget_try_reserve_settle_usage_3dim", |b| {
        b.iter(|| {
            let reservation = budget.try_reserve(black_box(ESTIMATE)).unwrap();
            black_box(reservation.settle(black_box(&USAGE)));
        })
    });

    let budget = huge_budget_with_spend();
    let table = price_table();
    let counting = Profile::openai().cache_counting();
    group.bench_function("budget_priced_try_reserve_settle_usage_4dim", |b| {
        b.iter(|| {
            let priced = table
                .priced(black_box("family-11-mini"), None, counting)
                .unwrap();
            let cost = ESTIMATE.with_spend(priced.estimate(&ESTIMATE));
            let mut reservation = budget.try_reserve(black_box(cost)).unwrap();
            reservation.set_priced(priced);
            black_box(reservation.settle(black_box(&USAGE)));
        })
    });

    group.finish();
}

// What `criterion_group!`/`criterion_main!` expand to, without their undocumented `pub fn`.
fn main() {
    let (budget, future) = memory_per_waiter();
    println!("memory per waiting request: {budget} B in the budget, the future itself {future} B");
    let mut c = Criterion::default().configure_from_args();
    uncontended(&mut c);
    contended(&mut c);
    denied(&mut c);
    spend(&mut c);
    // Last: it enters a tokio runtime.
    waiting(&mut c);
    c.final_summary();
}
