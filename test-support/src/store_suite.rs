//! The shared-store suite: what every [`QuotaStore`](tower_llm_quota::budget::store::QuotaStore)
//! must give the budgets kept in it, checked through the public API of budgets made over one
//! store as separate processes would make them. It runs against Redis and Postgres (their
//! crates' tests) and against a store over a mutex written from the outside (the core's
//! tests), and it fails on a store that breaks a rule (each test binary plants one).
//!
//! [`run_controls`] adds what a store keeping a tenant's controls over every process must
//! hold (caps over a period, on a node or the whole account, and caps on calls in flight, a
//! dead process's slots coming back within their lease): Redis and Postgres run it.
//!
//! Real time, small amounts, slow refills: whatever is admitted at once was not refilled, so
//! the counts are exact; waits are on conditions with generous deadlines.

use std::future::Future;
use std::num::NonZeroU64;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tower_llm_quota::tenant::{CapWindow, PeriodCap, Tenant, TenantNode, TenantTree};
use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota, Usage};

use crate::limit;

/// Makes budgets over the store under test.
pub trait Processes {
    /// One more budget over the store, as another process would make it, spending
    /// `account`: every budget made for one account shares its quota in the store (each
    /// check of the suite uses an account of its own).
    fn budget(
        &self,
        account: &str,
        quota: Quota,
    ) -> Pin<Box<dyn Future<Output = Budget> + Send + '_>>;

    /// How long a process's slots outlive its last heartbeat in the budgets made (for
    /// [`run_controls`]).
    fn slot_lease(&self) -> Duration {
        Duration::from_secs(5)
    }
}

/// Every test of the suite, in turn.
pub async fn run(processes: &impl Processes) {
    split_never_over_admits(processes).await;
    refunds_reach_every_process(processes).await;
    too_large_is_refused(processes).await;
    tenant_limits_hold_across_processes(processes).await;
    a_pause_holds_for_every_process(processes).await;
}

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).expect("not zero")
}

/// `amount` a minute, all of it at once (a refill of `amount / 60` a second).
fn per_minute(dimension: Dimension, amount: u64) -> Limit {
    Limit::new(dimension, nz(amount), Duration::from_secs(60))
        .and_then(|l| l.with_headroom(1.0))
        .expect("a valid limit")
        .with_burst(nz(amount))
}

/// Whether `budget` admits `cost` (for `tenant`) within `within`; an admission is charged
/// what it reserved.
async fn admits(budget: &Budget, cost: Cost, tenant: Option<&Tenant>, within: Duration) -> bool {
    let reserve = budget.reserve(cost);
    let reserve = match tenant {
        Some(tenant) => reserve.tenant(tenant.clone()),
        None => reserve,
    };
    match tokio::time::timeout(within, reserve).await {
        Ok(Ok(mut reservation)) => {
            reservation.mark_sent();
            reservation.charge_estimate();
            true
        }
        Ok(Err(_)) | Err(_) => false,
    }
}

/// Whether `check` holds within 5 s, asked again until it does.
async fn eventually<F: Future<Output = bool>>(mut check: impl FnMut() -> F) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
    }
    false
}

/// Two processes asking for more than the account holds admit exactly what it holds between
/// them (60 requests a minute: a refill of one a second, at most one more in the test).
pub async fn split_never_over_admits(processes: &impl Processes) {
    let quota = Quota::new().with_limit(per_minute(Dimension::Requests, 60));
    let (a, b) = (
        processes.budget("split", quota.clone()).await,
        processes.budget("split", quota).await,
    );
    let short = Duration::from_millis(300);
    let mut admitted = 0;
    // Until a round where neither admits: the account is spent.
    for _ in 0..100 {
        let mut round = 0;
        for budget in [&a, &b] {
            round += u64::from(admits(budget, Cost::requests_only(1), None, short).await);
        }
        admitted += round;
        if round == 0 {
            break;
        }
    }
    assert!(
        (60..=62).contains(&admitted),
        "two processes admitted {admitted} of an account of 60 (and a refill of about one a second)"
    );
}

/// What one process refunds at settlement, another may spend.
pub async fn refunds_reach_every_process(processes: &impl Processes) {
    let quota = Quota::new().with_limit(per_minute(Dimension::TotalTokens, 600));
    let (a, b) = (
        processes.budget("refunds", quota.clone()).await,
        processes.budget("refunds", quota).await,
    );
    let mut reservation = a
        .reserve(Cost::new(300, 300))
        .await
        .expect("the whole account");
    reservation.mark_sent();
    assert!(
        !admits(&b, Cost::new(200, 0), None, Duration::from_millis(200)).await,
        "the account is spent"
    );
    // 400 of the 600 come back, sent to the store in the background: the other process
    // asks again until it finds them (a denial tells it to wait for the refill alone).
    reservation.settle(&Usage::new(100, 100));
    assert!(
        eventually(|| admits(&b, Cost::new(200, 200), None, Duration::from_millis(300))).await,
        "the refund reached the other process"
    );
}

/// A cost above a limit's capacity is refused at once, never waited for.
pub async fn too_large_is_refused(processes: &impl Processes) {
    let quota = Quota::new().with_limit(per_minute(Dimension::TotalTokens, 100));
    let budget = processes.budget("too-large", quota).await;
    let answer = tokio::time::timeout(Duration::from_secs(5), budget.reserve(Cost::new(80, 80)))
        .await
        .expect("answered, not waited for");
    let error = answer.expect_err("160 tokens never fit 100");
    assert!(error.insufficient_capacity().is_some(), "{error}");
}

/// A tenant node's limit holds over every process: two processes admit its 5 requests a
/// minute between them, though the account holds more.
pub async fn tenant_limits_hold_across_processes(processes: &impl Processes) {
    let acme = Tenant::parse("acme").expect("a valid path");
    let tree = TenantTree::new().with_node(
        acme.clone(),
        TenantNode::new().with_limit(per_minute(Dimension::Requests, 5)),
    );
    let quota = Quota::new().with_limit(per_minute(Dimension::Requests, 600));
    let make = || async {
        processes
            .budget("tenants", quota.clone())
            .await
            .with_tenant_tree(tree.clone())
            .expect("a valid tree")
    };
    let (a, b) = (make().await, make().await);
    let short = Duration::from_millis(300);
    let mut admitted = 0;
    for _ in 0..5 {
        for budget in [&a, &b] {
            admitted += u64::from(admits(budget, Cost::requests_only(1), Some(&acme), short).await);
        }
    }
    assert_eq!(admitted, 5, "the tenant's 5 a minute, over two processes");
    assert!(
        admits(&a, Cost::requests_only(1), None, short).await,
        "the account itself still admits"
    );
}

/// A provider's pause seen by one process holds the limit for every process, until it is
/// lifted.
pub async fn a_pause_holds_for_every_process(processes: &impl Processes) {
    let quota = Quota::new().with_limit(per_minute(Dimension::Requests, 600));
    let (a, b) = (
        processes.budget("pause", quota.clone()).await,
        processes.budget("pause", quota).await,
    );
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    a.pause(&[Dimension::Requests], until);
    let short = Duration::from_millis(300);
    assert!(
        eventually(|| async { !admits(&b, Cost::requests_only(1), None, short).await }).await,
        "the other process saw the pause"
    );
    a.lift_pause(&[Dimension::Requests]);
    assert!(
        eventually(|| admits(&b, Cost::requests_only(1), None, short)).await,
        "the lift reached the other process"
    );
}

/// How long a check waits for what a store writes in the background.
const PATIENCE: Duration = Duration::from_secs(30);

/// Every check of a tenant's controls over every process, in turn, on three budgets each.
pub async fn run_controls(processes: &(impl Processes + Sync)) {
    let three = |account: &'static str, quota: Quota, tree: Option<TenantTree>| async move {
        let mut budgets = Vec::new();
        for _ in 0..3 {
            let budget = processes.budget(account, quota.clone()).await;
            budgets.push(match &tree {
                Some(tree) => budget.with_tenant_tree(tree.clone()).expect("a valid tree"),
                None => budget,
            });
        }
        budgets
    };
    caps_hold_over_every_budget(&three("capped", roomy_quota(), Some(capped_tree())).await).await;
    let account_capped = roomy_quota().with_cap(account_cap());
    let budgets = three("capped-account", account_capped, None).await;
    an_account_cap_holds_over_every_budget(&budgets, "capped-account").await;
    in_flight_caps_hold_over_every_budget(
        &three("slotted", roomy_quota(), Some(slotted_tree())).await,
    )
    .await;
    a_dead_process_s_slots_come_back_within_their_lease(processes).await;
}

/// The account of the control tests: far above what they spend, so only the tenants'
/// controls bind.
pub fn roomy_quota() -> Quota {
    let per_minute = limit(
        Dimension::TotalTokens,
        1_000_000,
        Duration::from_secs(60),
        1_000_000,
    );
    Quota::new().with_limit(per_minute)
}

/// `acme` may spend 2,000 tokens a calendar day (UTC), `globex` 1,000 in any 24 hours,
/// `initech` 1,500 nano-dollars a calendar month (UTC).
pub fn capped_tree() -> TenantTree {
    let cap = |amount, window| {
        PeriodCap::new(
            Dimension::TotalTokens,
            std::num::NonZeroU64::new(amount).unwrap(),
            window,
        )
    };
    let spend = PeriodCap::new(
        Dimension::Spend,
        std::num::NonZeroU64::new(1_500).unwrap(),
        CapWindow::CalendarMonthUtc,
    );
    TenantTree::new()
        .with_node(
            "acme".parse().unwrap(),
            TenantNode::new().with_cap(cap(2_000, CapWindow::CalendarDayUtc)),
        )
        .with_node(
            "globex".parse().unwrap(),
            TenantNode::new().with_cap(cap(1_000, CapWindow::Rolling)),
        )
        .with_node(
            "initech".parse().unwrap(),
            TenantNode::new().with_cap(spend),
        )
}

/// Three budgets each spend 100 tokens (and 100 nano-dollars) at a time for each tenant until
/// refused: together exactly each tenant's cap, whatever each budget's own count (a third of
/// it); every refusal names the cap and what the store counted. A reservation of 300 settled
/// at 100 first: the refund gives 200 back to the period, for every budget.
pub async fn caps_hold_over_every_budget(budgets: &[Budget]) {
    use tower_llm_quota::tenant::Refusal;
    let cost = |units| Cost::new(units, 0).with_spend(units);
    for (tenant, cap) in [("acme", 2_000), ("globex", 1_000), ("initech", 1_500)] {
        let mut first = budgets[0]
            .reserve(cost(300))
            .tenant(tenant.parse().unwrap())
            .await
            .unwrap();
        first.mark_sent();
        first.settle_cost(cost(100));
        // The settlement is written in the background: the store's count shows it. Every
        // budget must read 100: the others' figure is the store's alone (they spent nothing
        // of it here), so the refund has reached the store; the first budget's own count
        // says 100 at once, before the store has it.
        let path: Tenant = tenant.parse().unwrap();
        let started = Instant::now();
        let used =
            |budget: &Budget| budget.tenants().unwrap().snapshot(&path).used_in_period()[0].1;
        while !budgets.iter().all(|budget| used(budget) == 100) {
            assert!(
                started.elapsed() < PATIENCE,
                "the settlement never reached the store"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut tasks = Vec::new();
        for budget in budgets {
            for _ in 0..4 {
                let budget = budget.clone();
                tasks.push(tokio::spawn(async move {
                    let mut spent = 0;
                    loop {
                        let reserved = budget
                            .reserve(cost(100))
                            .tenant(tenant.parse().unwrap())
                            .await;
                        match reserved {
                            Ok(mut reservation) => {
                                reservation.mark_sent();
                                reservation.charge_estimate();
                                spent += 100;
                            }
                            Err(error) => {
                                let refused = error.tenant_refused().expect("a tenant refusal");
                                assert_eq!(refused.scope().as_str(), tenant);
                                let Refusal::PeriodCap {
                                    cap: told, used, ..
                                } = refused.reason()
                                else {
                                    panic!("refused for {:?}", refused.reason());
                                };
                                assert_eq!(told, cap);
                                assert!(used + 100 > cap, "refused at {used} of {cap}");
                                return spent;
                            }
                        }
                    }
                }));
            }
        }
        let mut total = 100;
        for task in tasks {
            total += task.await.unwrap();
        }
        assert_eq!(total, cap, "{tenant}: spent over every budget");
    }
}

/// The account's own spend cap: 1,500 nano-dollars a calendar month (UTC).
pub fn account_cap() -> PeriodCap {
    PeriodCap::new(
        Dimension::Spend,
        std::num::NonZeroU64::new(1_500).unwrap(),
        CapWindow::CalendarMonthUtc,
    )
}

/// Three budgets of an account with a monthly spend cap and no tenant tree, four callers
/// each (tenants or none, alike to the account): together exactly the cap, every refusal
/// naming the account and what the store counted; each budget's snapshot shows the month's
/// spend over every process.
pub async fn an_account_cap_holds_over_every_budget(budgets: &[Budget], account: &'static str) {
    use tower_llm_quota::tenant::Refusal;
    let cost = Cost::new(10, 0).with_spend(100);
    let mut tasks = Vec::new();
    for budget in budgets {
        for caller in 0..4 {
            let budget = budget.clone();
            tasks.push(tokio::spawn(async move {
                let mut spent = 0;
                loop {
                    let reserve = budget.reserve(cost);
                    let reserved = match caller {
                        0 | 1 => reserve.await,
                        _ => reserve.tenant("acme".parse().unwrap()).await,
                    };
                    match reserved {
                        Ok(mut reservation) => {
                            reservation.mark_sent();
                            reservation.charge_estimate();
                            spent += 100;
                        }
                        Err(error) => {
                            let refused = error.tenant_refused().expect("the account's cap");
                            assert_eq!(refused.account(), Some(account), "{error}");
                            let Refusal::PeriodCap { cap, used, .. } = refused.reason() else {
                                panic!("refused for {:?}", refused.reason());
                            };
                            assert_eq!(cap, 1_500);
                            assert!(used + 100 > cap, "refused at {used} of {cap}");
                            return spent;
                        }
                    }
                }
            }));
        }
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }
    assert_eq!(total, 1_500, "spent over every budget");
    // Each process reads the fleet's month from the store (in the background).
    for budget in budgets {
        let started = Instant::now();
        while budget.snapshot().used_in_period() != [(account_cap(), 1_500)] {
            assert!(
                started.elapsed() < PATIENCE,
                "{:?}",
                budget.snapshot().used_in_period()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// `acme` may have three calls in flight over every process; a call that cannot have a slot
/// within two seconds is refused.
pub fn slotted_tree() -> TenantTree {
    TenantTree::new().with_node(
        "acme".parse().unwrap(),
        TenantNode::new()
            .with_max_in_flight(std::num::NonZeroUsize::new(3).unwrap())
            .with_max_wait(Duration::from_secs(2)),
    )
}

/// Three budgets, four callers each, every call 20 ms in flight: never more than three in
/// flight over the budgets (each budget alone would allow three), and every call served.
pub async fn in_flight_caps_hold_over_every_budget(budgets: &[Budget]) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for budget in budgets {
        for _ in 0..4 {
            let (budget, in_flight, most) = (budget.clone(), in_flight.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..8 {
                    let mut reservation = budget
                        .reserve(Cost::new(10, 0))
                        .tenant("acme".parse().unwrap())
                        .await
                        .expect("a slot within the node's max_wait");
                    reservation.mark_sent();
                    let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    reservation.charge_estimate();
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 3, "{most} calls in flight over the budgets");
    assert!(most >= 2, "the cap is used: {most} at most");
}

/// A process takes two of `acme`'s three slots and dies holding them (it stops renewing its
/// lease and never settles): another process finds the third slot and no fourth, then the
/// dead one's two within the slot lease (and a heartbeat), and no more.
pub async fn a_dead_process_s_slots_come_back_within_their_lease(
    processes: &(impl Processes + Sync),
) {
    let tree = TenantTree::new().with_node(
        "acme".parse().expect("a valid path"),
        TenantNode::new().with_max_in_flight(std::num::NonZeroUsize::new(3).unwrap()),
    );
    let make = || async {
        processes
            .budget("dead-slots", roomy_quota())
            .await
            .with_tenant_tree(tree.clone())
            .expect("a valid tree")
    };
    let slot = |budget: Budget| async move {
        let mut reservation = tokio::time::timeout(
            Duration::from_millis(200),
            budget
                .reserve(Cost::new(1, 0))
                .tenant("acme".parse().unwrap()),
        )
        .await
        .ok()?
        .ok()?;
        reservation.mark_sent();
        Some(reservation)
    };
    // The dying process: a runtime of its own, shut down with its slots held (no
    // settlement, no heartbeat again), as SIGKILL would.
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async {
                let dying = make().await;
                let held = [
                    slot(dying.clone()).await.expect("a slot"),
                    slot(dying.clone()).await.expect("a slot"),
                ];
                std::mem::forget(held);
            });
            runtime.shutdown_background();
        });
    });
    let died = Instant::now();
    let living = make().await;
    let third = slot(living.clone()).await.expect("the third slot");
    assert!(slot(living.clone()).await.is_none(), "a fourth slot");
    let mut back = Vec::new();
    while back.len() < 2 {
        assert!(
            died.elapsed() < processes.slot_lease() * 3 + Duration::from_secs(2),
            "the dead process's slots never came back"
        );
        if let Some(reservation) = slot(living.clone()).await {
            back.push(reservation);
        }
    }
    let waited = died.elapsed();
    assert!(
        slot(living.clone()).await.is_none(),
        "beyond the three slots"
    );
    println!("a dead process's slots came back after {waited:?}");
    // Its lease ended a slot lease after its last heartbeat (every third of the lease).
    assert!(
        waited * 3 + Duration::from_millis(300) >= processes.slot_lease() * 2,
        "its slots came back before its lease ended: {waited:?}"
    );
    drop((third, back));
}

/// The account of [`local_shares_follow_the_live_fleet`]: 2,000 tokens a second, 2,000 at
/// once.
pub const OUTAGE_ACCOUNT: crate::fleet_suite::Account = crate::fleet_suite::Account {
    rate: 2_000,
    period: Duration::from_secs(1),
    burst: 2_000,
};

/// `budgets` share [`OUTAGE_ACCOUNT`] (`OUTAGE_ACCOUNT.quota()`) under
/// [`FailurePolicy::LiveShare`] (each made with `live_share(2)`, heartbeating often): once
/// each counts them all, the store is stopped (`stop`) and every budget admits requests of 10
/// tokens as fast as its local share lets it for `outage`. What they admitted over what the
/// account allows over the outage (its burst and its rate) is at most 1 when each holds
/// `1 / n` (a fixed half let `n / 2` through), and at least half of `1 / n`; returned.
///
/// [`FailurePolicy::LiveShare`]: tower_llm_quota::budget::FailurePolicy::LiveShare
pub async fn local_shares_follow_the_live_fleet(
    budgets: &[Budget],
    stop: impl FnOnce(),
    outage: Duration,
) -> f64 {
    let n = u32::try_from(budgets.len()).expect("a few budgets");
    let counted = Instant::now() + Duration::from_secs(30);
    for budget in budgets {
        while budget.snapshot().live_processes() != Some(n) {
            assert!(
                Instant::now() < counted,
                "the store counted {:?} processes, not {n}",
                budget.snapshot().live_processes()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    stop();
    let end = Instant::now() + outage;
    let tasks: Vec<_> = budgets
        .iter()
        .map(|budget| {
            let budget = budget.clone();
            tokio::spawn(async move {
                let mut admitted = 0u64;
                while Instant::now() < end {
                    let wait = end.saturating_duration_since(Instant::now());
                    match tokio::time::timeout(wait, budget.reserve(Cost::new(10, 0))).await {
                        Ok(Ok(mut reservation)) => {
                            reservation.mark_sent();
                            reservation.charge_estimate();
                            admitted += 10;
                        }
                        Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(5)).await,
                        Err(_) => break,
                    }
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.expect("a caller");
    }
    let used = admitted as f64 / OUTAGE_ACCOUNT.allows(outage);
    println!("{n} processes, the store down: {used:.3} of what the account allows");
    assert!(
        used <= 1.0,
        "{n} processes let {used:.3}x the account through"
    );
    assert!(
        used >= 0.5 / f64::from(n),
        "{n} processes admitted only {used:.3}"
    );
    used
}
