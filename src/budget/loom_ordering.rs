//! Loom models of the budget's ordering: enqueue, cancel, wake and hand-over of an in-flight
//! slot, under every interleaving loom explores. Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib loom_`.
//!
//! The slot is a limit that does not refill with time, so the models need no clock or timer:
//! what they check is that a waiter is woken whenever it may go, whoever leaves or gives back.

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
        let joined = {
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
        };
        drop(held);
        joined.join().unwrap();
        let snapshot = budget.snapshot();
        assert_eq!((snapshot.in_flight(), snapshot.waiters()), (0, 0));
    });
}
