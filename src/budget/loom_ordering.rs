//! Loom models of the budget's ordering: enqueue, cancel, wake and hand-over of an in-flight
//! slot, under every interleaving loom explores. Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib loom_`.
//!
//! The slot is a limit that does not refill with time, so the models need no clock or timer:
//! what they check is that a waiter is woken whenever it may go, whoever leaves or gives back.
//! The shared store's model asks a store that admits at once: what it checks is the hand-over
//! of the one question allowed in flight, whose answer must wake the next asker.

use std::num::NonZeroUsize;

use loom::future::block_on;
use loom::thread;

use super::Budget;
use crate::cost::Cost;
use crate::priority::Priority;
use crate::quota::Quota;

fn one_slot() -> Budget {
    Budget::new(Quota::new().with_max_in_flight(NonZeroUsize::MIN))
}

/// A thread whose one task polls two reservations of one unit (batch and interactive) with
/// `join`, as `join!` or `join_all` do: one waker for both. It ends once both were admitted.
fn two_reservations_of_one_task(budget: &Budget) -> thread::JoinHandle<()> {
    let budget = budget.clone();
    // The two futures and `join` outgrow a model thread's default stack.
    let thread = thread::Builder::new().stack_size(1 << 20);
    thread
        .spawn(move || {
            let one = |priority| {
                let reserve = budget.reserve(Cost::new(1, 0)).priority(priority);
                async move { drop(reserve.await.unwrap()) }
            };
            block_on(futures_util::future::join(
                Box::pin(one(Priority::Batch)),
                Box::pin(one(Priority::Interactive)),
            ));
        })
        .unwrap()
}

/// Two threads and the main one take the one slot in turn: each is admitted once the slot
/// is given back, none is left waiting (a lost wake-up is a deadlock loom reports).
#[test]
fn loom_a_given_back_slot_goes_to_a_waiter() {
    loom::model(|| {
        let budget = one_slot();
        let threads: Vec<_> = [Priority::Batch, Priority::Interactive]
            .into_iter()
            .map(|priority| {
                let budget = budget.clone();
                thread::spawn(move || {
                    let reservation =
                        block_on(budget.reserve(Cost::new(1, 0)).priority(priority)).unwrap();
                    drop(reservation);
                })
            })
            .collect();
        let reservation = block_on(budget.reserve(Cost::new(1, 0))).unwrap();
        drop(reservation);
        for thread in threads {
            thread.join().unwrap();
        }
        let snapshot = budget.snapshot();
        assert_eq!((snapshot.in_flight(), snapshot.waiters()), (0, 0));
    });
}

/// A waiter that gives up its place (its future dropped) while the slot is given back: the
/// other waiter is still admitted, and nothing is left behind.
#[test]
fn loom_a_cancelled_waiter_hands_over_its_turn() {
    loom::model(|| {
        let budget = one_slot();
        let held = budget.try_reserve(Cost::new(1, 0)).unwrap();
        let cancelling = {
            let budget = budget.clone();
            thread::spawn(move || {
                let mut reserve = Box::pin(
                    budget
                        .reserve(Cost::new(1, 0))
                        .priority(Priority::Interactive),
                );
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                // Pending (the slot is held) or admitted (it was given back first).
                let _ = reserve.as_mut().poll(&mut cx);
                drop(reserve);
            })
        };
        let waiting = {
            let budget = budget.clone();
            thread::spawn(move || {
                drop(block_on(budget.reserve(Cost::new(1, 0)).priority(Priority::Batch)).unwrap());
            })
        };
        drop(held);
        cancelling.join().unwrap();
        waiting.join().unwrap();
        let snapshot = budget.snapshot();
        assert_eq!((snapshot.in_flight(), snapshot.waiters()), (0, 0));
    });
}

/// Two reservations polled by one task (as `join!` or `join_all` poll them: one waker for
/// both) wait for the one slot another thread gives back: each is admitted in turn, the
/// second woken by the first's release although both share the waker the release wakes.
#[test]
fn loom_two_futures_of_one_task_are_both_admitted() {
    loom::model(|| {
        let budget = one_slot();
        let held = budget.try_reserve(Cost::new(1, 0)).unwrap();
        let joined = two_reservations_of_one_task(&budget);
        drop(held);
        joined.join().unwrap();
        let snapshot = budget.snapshot();
        assert_eq!((snapshot.in_flight(), snapshot.waiters()), (0, 0));
    });
}

/// A shared store that admits every question at once, counting them.
#[derive(Debug, Default)]
struct AdmittingStore {
    asked: std::sync::atomic::AtomicUsize,
}

impl crate::budget::store::QuotaStore for AdmittingStore {
    fn reserve(
        &self,
        _id: String,
        _cost: Cost,
        _floor: super::Floor,
        _class: Priority,
        _limits: std::sync::Arc<[crate::quota::Limit]>,
        _path: crate::budget::store::PathLimits,
        _tenant: Option<crate::tenant::Tenant>,
    ) -> crate::budget::store::StoreFuture<crate::budget::store::Decision> {
        self.asked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Box::pin(std::future::ready(Ok(
            crate::budget::store::Decision::Admitted,
        )))
    }

    fn settle(
        &self,
        _batch: Vec<crate::budget::store::Settle>,
    ) -> crate::budget::store::StoreFuture<()> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn set_paused(
        &self,
        _scope: crate::tenant::Tenant,
        _paused: bool,
    ) -> crate::budget::store::StoreFuture<()> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn paused(&self) -> crate::budget::store::StoreFuture<Option<Vec<crate::tenant::Tenant>>> {
        Box::pin(std::future::ready(Ok(None)))
    }

    fn lower(
        &self,
        _limit: crate::quota::Limit,
        _remaining: Option<u64>,
        _pause: std::time::Duration,
    ) -> crate::budget::store::StoreFuture<()> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn lift(&self, _limits: Vec<crate::quota::Limit>) -> crate::budget::store::StoreFuture<()> {
        Box::pin(std::future::ready(Ok(())))
    }
}

/// Three reservations on a shared budget that lets one question be in flight at a time: two
/// polled by one task (`join`), one by another thread. Whoever finds a question in flight
/// waits without a timer, so the answer must wake it, also when it is a future of the
/// answering task: all three are admitted under every interleaving, each after one question.
#[test]
fn loom_the_stores_answer_hands_the_question_over() {
    use std::sync::atomic::Ordering;

    use crate::budget::store::state::RemoteOptions;

    loom::model(|| {
        let store = std::sync::Arc::new(AdmittingStore::default());
        let options = RemoteOptions {
            policy: super::FailurePolicy::FailClosed,
            timeout: std::time::Duration::ZERO,
            breaker_threshold: 3,
            breaker_open_for: std::time::Duration::from_secs(1),
            pipeline: 1,
            leases: None,
            heartbeat: std::time::Duration::from_secs(1),
        };
        let quota = Quota::new().with_limit(crate::quota::Limit::per_minute(
            crate::quota::Dimension::Requests,
            std::num::NonZeroU64::new(1_000).unwrap(),
        ));
        let engine = super::handle::Engine::with_remote(&quota, store.clone(), options, true);
        let budget = Budget { engine };
        let other = {
            let budget = budget.clone();
            thread::spawn(move || drop(block_on(budget.reserve(Cost::new(1, 0))).unwrap()))
        };
        let joined = two_reservations_of_one_task(&budget);
        other.join().unwrap();
        joined.join().unwrap();
        assert_eq!(store.asked.load(Ordering::Relaxed), 3);
        assert_eq!(budget.waiters(), 0);
    });
}
