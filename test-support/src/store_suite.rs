//! The shared-store suite: what every [`QuotaStore`](tower_llm_quota::budget::store::QuotaStore)
//! must give the budgets kept in it, checked through the public API of budgets made over one
//! store as separate processes would make them. It runs against Redis (the Redis crate's
//! tests) and against a store over a mutex written from the outside (the core's tests), and it
//! fails on a store that breaks a rule (each test binary plants one).
//!
//! Real time, small amounts, slow refills: whatever is admitted at once was not refilled, so
//! the counts are exact; waits are on conditions with generous deadlines.

use std::future::Future;
use std::num::NonZeroU64;
use std::pin::Pin;
use std::time::Duration;

use tower_llm_quota::tenant::{Tenant, TenantNode, TenantTree};
use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota, Usage};

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
