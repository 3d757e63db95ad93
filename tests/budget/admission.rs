//! The budget's admission rules under tokio's paused clock: exact admission times, all or
//! nothing, FIFO, early wake-ups on refunds and limit changes, debt, and cancellation.

use tower_llm_quota_test_support as support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::{budget, levels, limit, requests_and_tokens, tokens_10_per_sec};
use tokio::time::{self, Instant};
use tokio_test::{assert_pending, assert_ready, assert_ready_ok, task};
use tower_llm_quota::{
    Budget, Cost, Dimension, Reservation, Usage, budget::Observation, error::TryReserveError,
};

const SEC: Duration = Duration::from_secs(1);

/// Reserves each cost in turn from its own task, recording (tokens, seconds since start) of
/// every admission.
async fn admit_all(budget: &Budget, costs: &[u64]) -> Vec<(u64, f64)> {
    let start = Instant::now();
    let admitted = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for &tokens in costs {
        let (budget, admitted) = (budget.clone(), admitted.clone());
        tasks.push(tokio::spawn(async move {
            let reservation = budget.reserve(Cost::new(tokens, 0)).await.unwrap();
            let at = start.elapsed().as_secs_f64();
            admitted.lock().unwrap().push((tokens, at));
            reservation.charge_estimate();
        }));
        // Let the task queue up before the next one, so arrival order is the list's order.
        tokio::task::yield_now().await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    Arc::try_unwrap(admitted).unwrap().into_inner().unwrap()
}

#[tokio::test(start_paused = true)]
async fn admission_times_follow_the_refill_rate() {
    let budget = tokens_10_per_sec();
    // The burst pays the first 100; then 10 tokens per second.
    let admitted = admit_all(&budget, &[100, 50, 30, 100]).await;
    assert_eq!(admitted, [(100, 0.0), (50, 5.0), (30, 8.0), (100, 18.0)]);
    assert_eq!(levels(&budget), [0]);
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_first_in_first_out() {
    let budget = tokens_10_per_sec();
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    // A large request at the head is not overtaken by small ones that would fit sooner.
    let admitted = admit_all(&budget, &[80, 1, 1, 1]).await;
    assert_eq!(admitted, [(80, 8.0), (1, 8.1), (1, 8.2), (1, 8.3)]);
}

#[tokio::test(start_paused = true)]
async fn admission_is_all_or_nothing() {
    let budget = requests_and_tokens();
    let _held = budget.try_reserve(Cost::new(100, 0)).unwrap();
    assert_eq!(levels(&budget), [9, 0]);
    // Tokens are short: the request slot that is free must not be spent.
    let Err(TryReserveError::NotYet(not_yet)) = budget.try_reserve(Cost::new(50, 0)) else {
        panic!("expected not yet");
    };
    assert_eq!(not_yet.dimension(), Dimension::TotalTokens);
    assert_eq!(not_yet.wait_time_from(Instant::now()), SEC / 2);
    assert_eq!(levels(&budget), [9, 0]);

    // The same while waiting: the waiter holds nothing until it is admitted whole.
    let mut waiting = task::spawn(budget.reserve(Cost::new(50, 0)));
    assert_pending!(waiting.poll());
    assert_eq!(levels(&budget), [9, 0]);
    time::advance(SEC / 2).await;
    assert!(waiting.is_woken());
    let _admitted = assert_ready_ok!(waiting.poll());
    // The request bucket refilled to its capacity meanwhile, then paid one.
    assert_eq!(levels(&budget), [9, 0]);
}

#[tokio::test(start_paused = true)]
async fn a_refund_wakes_the_head_at_once() {
    let budget = tokens_10_per_sec();
    let held = budget.try_reserve(Cost::new(100, 0)).unwrap();
    let mut waiting = task::spawn(budget.reserve(Cost::new(60, 0)));
    assert_pending!(waiting.poll());
    assert_eq!(budget.waiters(), 1);

    let settled = held.settle(&Usage::new(40, 0));
    assert_eq!(settled.refunded(Dimension::TotalTokens), 60);
    assert!(waiting.is_woken(), "woken by the refund, not by its timer");
    let reservation = assert_ready_ok!(waiting.poll());
    assert_eq!(reservation.cost(), Cost::new(60, 0));
    assert_eq!(budget.waiters(), 0);
    assert_eq!(levels(&budget), [0]);
}

#[tokio::test(start_paused = true)]
async fn debt_delays_the_next_admission_by_debt_over_rate() {
    let budget = tokens_10_per_sec();
    let reservation = budget.try_reserve(Cost::new(80, 20)).unwrap();
    // The provider reports 150 tokens: 50 beyond the estimate become debt.
    let settled = reservation.settle(&Usage::new(100, 50));
    assert_eq!(settled.overrun(Dimension::TotalTokens), 50);
    let snapshot = budget.snapshot();
    assert_eq!(snapshot.limits()[0].level(), -50);
    assert_eq!(snapshot.limits()[0].debt(), 50);
    assert_eq!(
        snapshot.limits()[0].available_at() - Instant::now(),
        5100 * SEC / 1000
    );

    let admitted = admit_all(&budget, &[10]).await;
    // 50 of debt then 10 of cost, at 10 per second.
    assert_eq!(admitted, [(10, 6.0)]);
}

#[tokio::test(start_paused = true)]
async fn a_cost_above_capacity_fails_at_once() {
    let budget = requests_and_tokens();
    let start = Instant::now();
    let error = budget.reserve(Cost::new(90, 11)).await.unwrap_err();
    let error = error.insufficient_capacity().expect("too large");
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(error.dimension(), Dimension::TotalTokens);
    assert_eq!((error.cost(), error.capacity()), (101, 100));
    assert!(matches!(
        budget.try_reserve(Cost::new(101, 0)),
        Err(TryReserveError::Never(_))
    ));
    assert_eq!(levels(&budget), [10, 100]);
}

#[tokio::test(start_paused = true)]
async fn try_reserve_counts_the_waiters_ahead() {
    let budget = tokens_10_per_sec();
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    let mut waiting = task::spawn(budget.reserve(Cost::new(30, 0)));
    assert_pending!(waiting.poll());
    // 20 tokens would fit in 2 s alone, but 30 are queued ahead of them.
    let Err(TryReserveError::NotYet(not_yet)) = budget.try_reserve(Cost::new(20, 0)) else {
        panic!("expected not yet");
    };
    assert_eq!(not_yet.wait_time_from(Instant::now()), 5 * SEC);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_head_hands_over_to_the_next_waiter() {
    let budget = tokens_10_per_sec();
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    let mut head = task::spawn(budget.reserve(Cost::new(90, 0)));
    let mut next = task::spawn(budget.reserve(Cost::new(10, 0)));
    assert_pending!(head.poll());
    assert_pending!(next.poll());
    assert_eq!(budget.waiters(), 2);

    time::advance(SEC).await;
    assert!(!next.is_woken());
    drop(head);
    assert!(next.is_woken(), "the new head looks again at once");
    assert_eq!(budget.waiters(), 1);
    assert_ready_ok!(next.poll()).charge_estimate();
    assert_eq!(budget.waiters(), 0);
    assert_eq!(levels(&budget), [0]);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_waiter_behind_the_head_leaves_no_trace() {
    let budget = tokens_10_per_sec();
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    let mut head = task::spawn(budget.reserve(Cost::new(10, 0)));
    let mut behind = task::spawn(budget.reserve(Cost::new(50, 0)));
    assert_pending!(head.poll());
    assert_pending!(behind.poll());
    drop(behind);
    assert_eq!(budget.snapshot().queued(), Cost::new(10, 0));
    time::advance(SEC).await;
    assert_ready_ok!(head.poll()).charge_estimate();
    assert_eq!(budget.snapshot().queued(), Cost::default());
    assert_eq!(levels(&budget), [0]);
}

#[tokio::test(start_paused = true)]
async fn a_raised_limit_wakes_the_head_early_and_a_lowered_one_can_refuse_it() {
    let budget = tokens_10_per_sec();
    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    let mut waiting = task::spawn(budget.reserve(Cost::new(50, 0)));
    assert_pending!(waiting.poll());
    // 100 per second, 200 at once: the level stays (0), but the waiter's 50 tokens now take
    // half a second instead of five.
    budget.set_limit(limit(Dimension::TotalTokens, 100, SEC, 200));
    assert!(waiting.is_woken());
    assert_pending!(waiting.poll());
    time::advance(SEC / 2).await;
    assert!(waiting.is_woken());
    assert_ready_ok!(waiting.poll()).charge_estimate();
    assert_eq!(levels(&budget), [0]);

    let mut too_big = task::spawn(budget.reserve(Cost::new(150, 0)));
    assert_pending!(too_big.poll());
    budget.set_limit(limit(Dimension::TotalTokens, 100, SEC, 100));
    assert!(too_big.is_woken());
    let error = assert_ready!(too_big.poll()).unwrap_err();
    assert_eq!(error.insufficient_capacity().unwrap().capacity(), 100);
    assert_eq!(budget.waiters(), 0);
}

#[tokio::test(start_paused = true)]
async fn observed_remaining_lowers_the_level_and_a_new_limit_rescales() {
    let budget = requests_and_tokens();
    budget.observe(
        &Observation::new(Dimension::TotalTokens, SEC)
            .with_remaining(30)
            .with_limit(std::num::NonZeroU64::new(100).unwrap()),
    );
    assert_eq!(levels(&budget), [10, 30]);
    // A report on another period leaves the buckets alone.
    budget.observe(&Observation::new(Dimension::Requests, 60 * SEC).with_remaining(0));
    assert_eq!(levels(&budget), [10, 30]);
    // Remaining above our level never raises it.
    budget.observe(&Observation::new(Dimension::TotalTokens, SEC).with_remaining(90));
    assert_eq!(levels(&budget), [10, 30]);
}

#[tokio::test(start_paused = true)]
async fn dropping_a_reservation_refunds_or_charges_by_the_sent_rule() {
    let budget = tokens_10_per_sec();
    let unsent = budget.try_reserve(Cost::new(40, 0)).unwrap();
    drop(unsent);
    assert_eq!(levels(&budget), [100], "never sent: refunded");

    let mut sent: Reservation = budget.try_reserve(Cost::new(40, 0)).unwrap();
    sent.mark_sent();
    drop(sent);
    assert_eq!(levels(&budget), [60], "sent: charged its estimate");

    budget.try_reserve(Cost::new(40, 0)).unwrap().refund();
    assert_eq!(levels(&budget), [60]);
}

#[tokio::test(start_paused = true)]
async fn the_snapshot_tells_when_capacity_returns() {
    let budget = tokens_10_per_sec();
    let now = Instant::now();
    let snapshot = budget.snapshot();
    let tokens = snapshot.limits()[0];
    assert_eq!(
        (tokens.capacity(), tokens.level(), tokens.debt()),
        (100, 100, 0)
    );
    assert_eq!((tokens.available_at(), tokens.full_at()), (now, now));

    budget
        .try_reserve(Cost::new(100, 0))
        .unwrap()
        .charge_estimate();
    let tokens = budget.snapshot().limits()[0];
    assert_eq!(tokens.available_at() - now, SEC / 10);
    assert_eq!(tokens.full_at() - now, 10 * SEC);
}

#[tokio::test(start_paused = true)]
async fn a_budget_with_several_periods_of_one_dimension_needs_them_all() {
    let budget = budget([
        limit(Dimension::Requests, 10, SEC, 10),
        limit(Dimension::Requests, 12, 60 * SEC, 12),
    ]);
    let admitted = Arc::new(Mutex::new(0u32));
    for _ in 0..12 {
        budget
            .reserve(Cost::requests_only(1))
            .await
            .unwrap()
            .charge_estimate();
        *admitted.lock().unwrap() += 1;
    }
    // Ten at once, two more a tenth of a second apart: then the per-minute limit binds.
    assert_eq!(levels(&budget), [0, 0]);
    let Err(TryReserveError::NotYet(not_yet)) = budget.try_reserve(Cost::requests_only(1)) else {
        panic!("expected not yet");
    };
    assert_eq!(not_yet.period(), 60 * SEC);
    assert_eq!(not_yet.wait_time_from(Instant::now()), 5 * SEC - SEC / 5);
}

#[test]
fn public_types_are_send_sync_and_unpin_where_it_matters() {
    fn send_sync<T: Send + Sync>() {}
    fn send_unpin<T: Send + Unpin>() {}
    send_sync::<Budget>();
    send_sync::<Reservation>();
    send_sync::<tower_llm_quota::budget::ReservationSlot>();
    send_sync::<tower_llm_quota::Error>();
    send_sync::<tower_llm_quota::budget::Reserve>();
    send_unpin::<Budget>();
    send_unpin::<Reservation>();
}

#[tokio::test(start_paused = true)]
async fn a_pause_holds_the_shortest_window_keeps_its_level_and_can_be_lifted() {
    let day = Duration::from_secs(86_400);
    let budget = budget([
        limit(Dimension::Requests, 10, SEC, 10),
        limit(Dimension::Requests, 1_000, day, 1_000),
    ]);
    budget.pause(&[Dimension::Requests], Instant::now() + 2 * SEC);
    // Held, not emptied: the level is what it was.
    assert_eq!(levels(&budget), vec![10, 1_000]);
    let start = Instant::now();
    budget
        .reserve(Cost::requests_only(1))
        .await
        .unwrap()
        .charge_estimate();
    // Admitted the moment the pause ends, from a full bucket.
    assert_eq!(start.elapsed(), 2 * SEC);
    assert_eq!(levels(&budget), vec![9, 999]);

    // A long pause, lifted by hand.
    budget.pause(&[Dimension::Requests], Instant::now() + 3_600 * SEC);
    let waiting = tokio::spawn({
        let budget = budget.clone();
        async move { budget.reserve(Cost::requests_only(1)).await.map(drop) }
    });
    tokio::time::sleep(SEC).await;
    assert!(!waiting.is_finished());
    assert_eq!(budget.waiters(), 1);
    budget.lift_pause(&[Dimension::Requests]);
    waiting.await.unwrap().unwrap();
    assert_eq!(
        start.elapsed(),
        3 * SEC,
        "admitted as soon as the pause was lifted"
    );
}

/// Several reservations polled by one task (`join!`, `join_all`, `select!`): each is admitted
/// at the instant its turn and the refill allow, whichever order the task polls them in.
#[tokio::test(start_paused = true)]
async fn reservations_polled_by_one_task_are_admitted_at_their_refill_instants() {
    // 1,000 tokens a second, 1,000 at once.
    let quota = || budget([limit(Dimension::TotalTokens, 1_000, SEC, 1_000)]);
    let drain = |budget: &Budget| {
        budget
            .try_reserve(Cost::new(1_000, 0))
            .unwrap()
            .charge_estimate();
    };
    let at = |start: Instant| start.elapsed().as_millis();
    // Admitted at this instant, and spent (a dropped reservation would be refunded).
    let spent = |reservation: Reservation, start: Instant| {
        reservation.charge_estimate();
        at(start)
    };

    let b = quota();
    drain(&b);
    let start = Instant::now();
    let (x, y) = tokio::join!(
        async { b.reserve(Cost::new(400, 0)).await.map(|r| spent(r, start)) },
        async { b.reserve(Cost::new(400, 0)).await.map(|r| spent(r, start)) },
    );
    assert_eq!((x.unwrap(), y.unwrap()), (400, 800));

    let b = quota();
    drain(&b);
    let start = Instant::now();
    let all = futures::future::join_all(
        (0..4).map(|_| async { b.reserve(Cost::new(250, 0)).await.map(|r| spent(r, start)) }),
    )
    .await;
    let all: Vec<u128> = all.into_iter().map(Result::unwrap).collect();
    assert_eq!(all, [250, 500, 750, 1_000]);

    let b = quota();
    drain(&b);
    let start = Instant::now();
    let first = b.reserve(Cost::new(300, 0));
    let second = b.reserve(Cost::new(300, 0));
    tokio::pin!(first, second);
    // A reservation takes its place when first polled: `biased` polls `first` first.
    tokio::select! {
        biased;
        first = &mut first => assert_eq!(spent(first.unwrap(), start), 300),
        _ = &mut second => panic!("the second waiter went first"),
    }
    second.await.unwrap().charge_estimate();
    assert_eq!(at(start), 600);
}

/// A request behind a waiter that waits only to keep its class floor, with a lower floor of
/// its own, goes first, in the same class too: nothing holds it.
#[tokio::test(start_paused = true)]
async fn a_waiter_kept_by_its_floor_does_not_block_a_lower_floor_behind_it() {
    let b = budget([limit(Dimension::TotalTokens, 1_000, SEC, 1_000)]);
    let start = Instant::now();
    let first = b.reserve(Cost::new(500, 0)).floor(0.5).await.unwrap();
    first.charge_estimate();
    // 500 left: another 500 keeping half of the bucket must wait for a full bucket.
    let kept = tokio::spawn({
        let b = b.clone();
        async move {
            let r = b.reserve(Cost::new(500, 0)).floor(0.5).await.unwrap();
            r.charge_estimate();
            start.elapsed()
        }
    });
    tokio::task::yield_now().await;
    assert_eq!(b.waiters(), 1);
    // A plain request of 100 behind it is admitted at once.
    let plain = b.reserve(Cost::new(100, 0)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    plain.charge_estimate();
    // The floor's waiter: 400 left, 1,000 needed: 600 ms of refill.
    assert_eq!(kept.await.unwrap(), Duration::from_millis(600));
}
