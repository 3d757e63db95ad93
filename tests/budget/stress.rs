//! Stress of one shared [`Budget`] on a multi-threaded runtime: 200 tasks reserve, wait, give
//! up while waiting, refund, charge and settle at random (seeded, so only the scheduling
//! varies). Then every waiter of a full queue is served by wake-ups alone, nobody is left
//! waiting, every level is exactly the capacity minus the net charge (no capacity leaked or
//! created) and, with a short period, refills to capacity.

use tower_llm_quota_test_support as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::limit;
use tokio::time::{Instant, sleep, timeout};
use tower_llm_quota::{Budget, Cost, Dimension, Quota, Reservation, Usage};

const TASKS: u64 = 200;
const ROUNDS: u64 = 30;

/// What the tasks did, counted as they did it.
#[derive(Debug, Default)]
struct Tally {
    /// Net amount charged per limit, in the quota's order: estimates kept, actual usage
    /// settled; refunds count nothing.
    charged: Vec<AtomicU64>,
    admitted: AtomicUsize,
    gave_up: AtomicUsize,
    most_waiting: AtomicUsize,
}

impl Tally {
    fn new(limits: usize) -> Self {
        Self {
            charged: (0..limits).map(|_| AtomicU64::new(0)).collect(),
            ..Self::default()
        }
    }

    fn charge(&self, dimensions: &[Dimension], cost: &Cost) {
        for (total, dimension) in self.charged.iter().zip(dimensions) {
            total.fetch_add(cost.amount(*dimension), Ordering::Relaxed);
        }
    }

    fn charged(&self) -> Vec<u64> {
        self.charged
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

/// One task: `ROUNDS` times, reserve a small cost (giving up after a random patience), then
/// end the reservation a random way.
async fn worker(budget: Budget, tally: Arc<Tally>, seed: u64) {
    let dimensions: Vec<Dimension> = budget
        .snapshot()
        .limits()
        .iter()
        .map(|l| l.limit().dimension())
        .collect();
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..ROUNDS {
        // How the reservation will end, if admitted. Those that keep their charge are small,
        // so the budget (which barely refills in one test) lasts; the others hold a lot for a
        // while, so that many tasks queue behind them.
        let end = rng.random_range(0..10);
        let cost = if matches!(end, 5 | 6 | 9) {
            Cost::new(rng.random_range(1..=4), rng.random_range(0..=2))
        } else {
            Cost::new(rng.random_range(50..=250), rng.random_range(0..=100))
        };
        let patience = Duration::from_micros(match rng.random_range(0..10) {
            0..=2 => rng.random_range(0..=2_000),
            _ => rng.random_range(2_000..=30_000),
        });
        let admitted: Option<Reservation> = match rng.random_range(0..4) {
            // Poll it at most once: admitted at once or dropped from the queue.
            0 => {
                tokio::select! {
                    biased;
                    reservation = budget.reserve(cost) => Some(reservation.unwrap()),
                    () = std::future::ready(()) => None,
                }
            }
            1 => {
                tokio::select! {
                    reservation = budget.reserve(cost) => Some(reservation.unwrap()),
                    () = sleep(patience) => None,
                }
            }
            _ => timeout(patience, budget.reserve(cost))
                .await
                .ok()
                .map(Result::unwrap),
        };
        tally
            .most_waiting
            .fetch_max(budget.waiters(), Ordering::Relaxed);
        let Some(mut reservation) = admitted else {
            tally.gave_up.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        tally.admitted.fetch_add(1, Ordering::Relaxed);
        // Hold it a little, so that others queue behind.
        match rng.random_range(0..3) {
            0 => {}
            1 => tokio::task::yield_now().await,
            _ => sleep(Duration::from_micros(rng.random_range(0..=3_000))).await,
        }
        match end {
            // Dropped before it was sent: refunded.
            0..=2 => drop(reservation),
            3..=4 => {
                reservation.refund();
            }
            5 => {
                reservation.mark_sent();
                drop(reservation);
                tally.charge(&dimensions, &cost);
            }
            6 => {
                reservation.charge_estimate();
                tally.charge(&dimensions, &cost);
            }
            // A large estimate settled with a tiny usage: mostly refunded.
            7..=8 => {
                let usage = Usage::new(rng.random_range(0..=4), rng.random_range(0..=2));
                let settlement = reservation.settle(&usage);
                tally.charge(&dimensions, &settlement.actual());
            }
            // A small estimate settled with any usage, often above it: debt.
            _ => {
                let usage = Usage::new(
                    rng.random_range(0..=cost.input_tokens() + 8),
                    rng.random_range(0..=cost.output_tokens() + 4),
                );
                let settlement = reservation.settle(&usage);
                tally.charge(&dimensions, &settlement.actual());
            }
        }
    }
}

/// Runs every worker to completion against `budget`, then [`drain`]s it. Returns the tally.
async fn hammer(budget: &Budget, seed: u64) -> Arc<Tally> {
    let tally = Arc::new(Tally::new(budget.snapshot().limits().len()));
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| tokio::spawn(worker(budget.clone(), tally.clone(), seed * 1_000 + task)))
        .collect();
    for task in tasks {
        task.await.unwrap();
    }

    drain(budget).await;
    tally
}

/// Queues one waiter per task behind a reservation holding every token left, refunds it, and
/// expects all of them to be admitted one after the other while each still holds its
/// reservation: only the wake-ups passed down the queue can admit them, so a lost wake-up fails
/// here instead of being hidden by a later refund or a timeout. Everything is refunded.
async fn drain(budget: &Budget) {
    let waiters = usize::try_from(TASKS).unwrap();
    let level = |dimension| {
        budget
            .snapshot()
            .limits()
            .iter()
            .filter(|l| l.limit().dimension() == dimension)
            .map(|l| l.level())
            .min()
            .unwrap_or(i64::MAX)
    };
    // Costs of tokens only, so that the request limit plays no part.
    let tokens = u64::try_from(level(Dimension::TotalTokens).max(0)).unwrap();
    if tokens < TASKS {
        eprintln!("too little left to drain");
        return;
    }
    let blocker = budget
        .try_reserve(Cost::new(tokens, 0).with_requests(0))
        .expect("the tokens left fit");
    let cost = Cost::new(tokens / TASKS, 0).with_requests(0);
    let admitted = Arc::new(tokio::sync::Barrier::new(waiters));
    let early = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (budget, admitted, early) = (budget.clone(), admitted.clone(), early.clone());
            tokio::spawn(async move {
                let reservation = timeout(Duration::from_secs(5), budget.reserve(cost))
                    .await
                    .expect("every waiter is served")
                    .unwrap();
                early.fetch_add(1, Ordering::Relaxed);
                timeout(Duration::from_secs(5), admitted.wait())
                    .await
                    .expect("every waiter is served");
                drop(reservation);
            })
        })
        .collect();
    timeout(Duration::from_secs(5), async {
        // Refill may admit some before the refund (not with a period of a day).
        while budget.waiters() + early.load(Ordering::Relaxed) < waiters {
            sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("every task queues");
    blocker.refund();
    for task in tasks {
        task.await.unwrap();
    }
}

/// With a period of a day, refill during the test is below one unit, so waiters are served by
/// refunds only and each level is exactly the capacity minus the net charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn levels_match_the_net_charge() {
    const DAY: Duration = Duration::from_secs(86_400);
    // 1_000 per day: under one unit per 86 s.
    let quota = Quota::new()
        .with_limit(limit(Dimension::Requests, 1_000, DAY, 5_000))
        .with_limit(limit(Dimension::TotalTokens, 1_000, DAY, 8_000))
        .with_limit(limit(Dimension::OutputTokens, 1_000, DAY, 4_000));
    let start = Instant::now();
    let budget = Budget::new(quota);

    let tally = hammer(&budget, 1).await;

    let snapshot = budget.snapshot();
    let elapsed = snapshot.taken_at() - start;
    assert!(
        elapsed < Duration::from_secs(80),
        "the test took {elapsed:?}: refill may have reached one unit"
    );
    assert_eq!(budget.waiters(), 0);
    assert_eq!(snapshot.waiters(), 0);
    assert_eq!(snapshot.queued(), Cost::default());
    let charged = tally.charged();
    for (limit, charged) in snapshot.limits().iter().zip(&charged) {
        let expected = i64::try_from(limit.capacity()).unwrap() - i64::try_from(*charged).unwrap();
        assert_eq!(limit.level(), expected, "{:?}", limit.limit());
    }
    // Nothing is stuck in the queue: a cost that fits is admitted at once.
    let small = Cost::new(1, 0);
    if snapshot.limits().iter().all(|l| l.level() >= 1) {
        let reservation = timeout(Duration::from_secs(1), budget.reserve(small)).await;
        reservation.expect("admitted at once").unwrap().refund();
    }
    eprintln!(
        "levels_match_the_net_charge: {elapsed:?}, admitted {}, gave up {}, at most {} waiting, charged {charged:?}",
        tally.admitted.load(Ordering::Relaxed),
        tally.gave_up.load(Ordering::Relaxed),
        tally.most_waiting.load(Ordering::Relaxed),
    );
}

/// With a period of 100 ms, waiters are served by refill too; the levels stay between what the
/// net charge and the refill allow, nobody waits at the end, and a full refill restores every
/// capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn levels_refill_to_capacity() {
    const PERIOD: Duration = Duration::from_millis(100);
    let quota = Quota::new()
        .with_limit(limit(Dimension::Requests, 1_000, PERIOD, 100))
        .with_limit(limit(Dimension::TotalTokens, 30_000, PERIOD, 3_000));
    let start = Instant::now();
    let budget = Budget::new(quota);

    let tally = hammer(&budget, 2).await;

    assert_eq!(budget.waiters(), 0);
    let snapshot = budget.snapshot();
    assert_eq!(snapshot.queued(), Cost::default());
    // Refill adds at most `rate × elapsed`, and refunds never add more than they took.
    let elapsed = (snapshot.taken_at() - start).as_nanos();
    for (limit, charged) in snapshot.limits().iter().zip(tally.charged()) {
        let capacity = i128::from(limit.capacity());
        let rate = u128::from(limit.limit().effective_amount());
        let refill = i128::try_from((rate * elapsed).div_ceil(PERIOD.as_nanos())).unwrap();
        let level = i128::from(limit.level());
        let lowest = capacity - i128::from(charged);
        assert!(level <= capacity, "{limit:?}");
        assert!(level >= lowest, "{limit:?}: charged {charged}");
        assert!(level <= lowest + refill, "{limit:?}: charged {charged}");
    }

    // The bucket lacks less than `capacity - level + 1` units: wait for that to refill.
    let wait = snapshot
        .limits()
        .iter()
        .map(|l| {
            let missing = i64::try_from(l.capacity()).unwrap() - l.level() + 1;
            let rate = l.limit().effective_amount();
            PERIOD * u32::try_from(missing).unwrap() / u32::try_from(rate).unwrap()
        })
        .max()
        .unwrap();
    sleep(wait + Duration::from_millis(2)).await;
    let snapshot = budget.snapshot();
    for limit in snapshot.limits() {
        assert_eq!(
            limit.level(),
            i64::try_from(limit.capacity()).unwrap(),
            "{limit:?}"
        );
        assert!(limit.full_at() <= snapshot.taken_at());
    }
    assert_eq!(budget.waiters(), 0);
    eprintln!(
        "levels_refill_to_capacity: {:?} + {wait:?}, admitted {}, gave up {}, at most {} waiting",
        snapshot.taken_at() - start - wait,
        tally.admitted.load(Ordering::Relaxed),
        tally.gave_up.load(Ordering::Relaxed),
        tally.most_waiting.load(Ordering::Relaxed),
    );
}
