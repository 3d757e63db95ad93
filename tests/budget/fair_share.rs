//! Fair share decided at admission time, on a paused clock: a guarantee never starves a
//! heavier tenant, a tenant's requests of one class are admitted in the order they came
//! whatever its standing, and a request refused by a shared store's turn moves no clock.

use tower_llm_quota_test_support as support;

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::limit;
use tokio::time::Instant;
use tower_llm_quota::tenant::{Tenant, TenantNode, TenantTree};
use tower_llm_quota::{Budget, Cost, Dimension, Priority, Quota};

fn tenant(path: &str) -> Tenant {
    path.parse().unwrap()
}

/// 1,000 tokens a second, `burst` at once.
fn quota(burst: u64) -> Quota {
    Quota::new().with_limit(limit(
        Dimension::TotalTokens,
        60_000,
        Duration::from_secs(60),
        burst,
    ))
}

type Log = Arc<Mutex<Vec<(&'static str, usize)>>>;

/// Spawns `count` batch reservations of `cost` for `who`, each logging `(who, n)` when
/// admitted and giving its tokens back at once, unused tokens refunded as a settled call
/// would.
fn submit(
    budget: &Budget,
    log: &Log,
    who: &'static str,
    n: usize,
    cost: u64,
) -> tokio::task::JoinHandle<()> {
    let (budget, log) = (budget.clone(), log.clone());
    tokio::spawn(async move {
        let reservation = budget
            .reserve(Cost::new(cost, 0))
            .priority(Priority::Batch)
            .tenant(tenant(who))
            .await
            .unwrap();
        log.lock().unwrap().push((who, n));
        reservation.charge_estimate();
    })
}

/// Tenant `small` (weight 1, guaranteed 25 %) and `big` (weight 3, no guarantee) submit 300
/// batch items each, together. Before, `small`'s guarantee was frozen into its items when
/// they joined the ordering: it got 295 of the first 300 admissions. Now the guarantee is
/// judged at each admission from what the class served, and `small` gets its quarter.
#[tokio::test(start_paused = true)]
async fn a_guarantee_never_starves_a_heavier_tenant() {
    let tree = TenantTree::new()
        .with_node(tenant("small"), TenantNode::new().with_guarantee(0.25))
        .with_node(
            tenant("big"),
            TenantNode::new().with_weight(NonZeroU32::new(3).unwrap()),
        );
    let budget = Budget::with_tenants(quota(100), tree).unwrap();
    let log = Log::default();
    let mut tasks = Vec::new();
    for n in 0..300 {
        tasks.push(submit(&budget, &log, "small", n, 100));
        tasks.push(submit(&budget, &log, "big", n, 100));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let log = log.lock().unwrap();
    let small = log[..300].iter().filter(|(who, _)| *who == "small").count();
    eprintln!(
        "of the first 300 admissions: small {small}, big {}",
        300 - small
    );
    // A quarter of 300, within one request of each tenant.
    assert!((74..=77).contains(&small), "small got {small} of 300");
}

/// Two tenants of equal weight, the first guaranteed half of the account: its standing
/// against the guarantee changes all the time, and its requests are still admitted in the
/// order they came (before, one that came 5 s later could go 4 s earlier).
#[tokio::test(start_paused = true)]
async fn a_tenant_s_requests_of_one_class_go_in_arrival_order() {
    let tree = TenantTree::new()
        .with_node(tenant("a"), TenantNode::new().with_guarantee(0.5))
        .with_node(tenant("b"), TenantNode::new());
    let budget = Budget::with_tenants(quota(1_000), tree).unwrap();
    let log = Log::default();
    let mut tasks = Vec::new();
    // b keeps a backlog; a's requests arrive over time, of very different sizes (a small one
    // would have a smaller tag than a large one before it).
    for n in 0..200 {
        tasks.push(submit(&budget, &log, "b", n, 400));
    }
    for n in 0..60 {
        let cost = if n % 3 == 0 { 900 } else { 20 };
        tasks.push(submit(&budget, &log, "a", n, cost));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    let log = log.lock().unwrap();
    let order: Vec<usize> = log
        .iter()
        .filter(|(who, _)| *who == "a")
        .map(|(_, n)| *n)
        .collect();
    assert_eq!(order, (0..60).collect::<Vec<_>>());
    let order: Vec<usize> = log
        .iter()
        .filter(|(who, _)| *who == "b")
        .map(|(_, n)| *n)
        .collect();
    assert_eq!(order, (0..200).collect::<Vec<_>>());
}

/// A tenant returning after the others kept the account busy is served first (it is owed
/// its guarantee), then at its share: within one refill of its own cost, not behind the
/// others' backlog.
#[tokio::test(start_paused = true)]
async fn a_returning_guaranteed_tenant_goes_first_then_at_its_share() {
    let tree = TenantTree::new()
        .with_node(tenant("a"), TenantNode::new().with_guarantee(0.5))
        .with_node(tenant("b"), TenantNode::new().with_guarantee(0.5));
    let budget = Budget::with_tenants(quota(1_000), tree).unwrap();
    let log = Log::default();
    let mut tasks = Vec::new();
    for n in 0..400 {
        tasks.push(submit(&budget, &log, "b", n, 500));
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
    let back = Instant::now();
    let first = {
        let budget = budget.clone();
        tokio::spawn(async move {
            budget
                .reserve(Cost::new(500, 0))
                .priority(Priority::Batch)
                .tenant(tenant("a"))
                .await
                .unwrap()
                .charge_estimate();
            back.elapsed()
        })
    };
    let waited = first.await.unwrap();
    // b's head takes what refilled first only if it was already due: a waits for its own
    // cost's refill at most (500 tokens at 1,000 a second).
    assert!(waited <= Duration::from_millis(500), "a waited {waited:?}");
    let before = log.lock().unwrap().len();
    for n in 0..100 {
        tasks.push(submit(&budget, &log, "a", n, 500));
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
    let log = log.lock().unwrap();
    let a = log[before..].iter().filter(|(who, _)| *who == "a").count();
    let all = log.len() - before;
    eprintln!(
        "a back after a minute of b alone: first admitted after {waited:?}, then {a} of {all}"
    );
    assert!(a.abs_diff(all / 2) <= 1, "a got {a} of {all}");
    drop(log);
    for task in tasks {
        task.abort();
    }
}
