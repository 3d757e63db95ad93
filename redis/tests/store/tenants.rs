//! Tenants over a budget shared through Redis: three budgets (as three processes would) with
//! the same tenant tree, three tenants each: no node's limit is exceeded in any window, across
//! the budgets, and the account's never; a pause, a daily cap and a cap on calls in flight
//! hold over the three as over one. Real time against a private `redis-server`, and against a
//! private three-node Redis Cluster (every key of a path in the account's slot).

use tower_llm_quota_test_support as support;
use tower_llm_quota_test_support::redis_server;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis_server::RedisServer;
use redis_server::cluster::RedisCluster;
use support::limit;
use tokio::time::Instant;
use tower_llm_quota::tenant::{CapWindow, PeriodCap, Tenant, TenantNode, TenantTree};
use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota};
use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_test_support::store_suite::{
    account_cap, an_account_cap_holds_over_every_budget, capped_tree, caps_hold_over_every_budget,
    in_flight_caps_hold_over_every_budget, roomy_quota, slotted_tree,
};

const SECOND: Duration = Duration::from_secs(1);
/// The account: tokens a second, and at once.
const ACCOUNT: u64 = 3_000;
/// Tenant a's and b's own limits (a second, and at once); c has none.
const NODE_A: u64 = 500;
const NODE_B: u64 = 800;
const COST: u64 = 100;
const RUN: Duration = Duration::from_secs(3);
/// The most a test waits for something the processes do in the background (a reading every
/// half second, a write within its timeout): generous, so that a busy machine is slow, not
/// failing; the time it took is printed.
const PATIENCE: Duration = Duration::from_secs(30);
/// How late an admission may be recorded after the script made it (the reply's way back), at
/// least: a run measures more on a busy machine ([`Probe`]).
const SLACK: Duration = Duration::from_millis(25);

/// Every admission: when it was told, its tenant, its cost.
type Log = Arc<Mutex<Vec<(Instant, &'static str, u64)>>>;

fn per_second(amount: u64) -> Limit {
    limit(Dimension::TotalTokens, amount, SECOND, amount)
}

fn tree() -> TenantTree {
    TenantTree::new()
        .with_node(
            "a".parse().unwrap(),
            TenantNode::new().with_limit(per_second(NODE_A)),
        )
        .with_node(
            "b".parse().unwrap(),
            TenantNode::new().with_limit(per_second(NODE_B)),
        )
}

async fn budget(server: &RedisServer) -> Budget {
    RedisBudget::new(server.url(), "tenants")
        .timeout(Duration::from_millis(500))
        .connect(&Quota::new().with_limit(per_second(ACCOUNT)))
        .await
        .unwrap()
        .with_tenant_tree(tree())
        .unwrap()
}

/// The longest round trip to Redis seen by a task of the test's runtime while it runs: it
/// bounds how late an admission's reply (and the task that logs it) arrives after the script
/// made it, so a window check allows that much (a fixed margin from a quiet run would count
/// a reply delayed by a busy machine as an admission beyond the limit).
struct Probe(tokio::task::JoinHandle<Duration>);

impl Probe {
    fn start(url: &str, end: Instant) -> Self {
        let client = redis::Client::open(url).unwrap();
        Self(tokio::spawn(async move {
            let mut connection = client.get_multiplexed_async_connection().await.unwrap();
            let mut longest = SLACK;
            while Instant::now() < end {
                let sent = Instant::now();
                let _: String = redis::cmd("PING")
                    .query_async(&mut connection)
                    .await
                    .unwrap();
                longest = longest.max(sent.elapsed());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            longest
        }))
    }

    async fn longest(self) -> Duration {
        self.0.await.unwrap()
    }
}

/// Four callers per tenant on every budget, each reserving `COST` until `end` and logging
/// what it was admitted.
async fn drive(
    budgets: &[Budget],
    tenants: &[&'static str],
    end: Instant,
    expect: &'static str,
) -> Log {
    let log: Log = Arc::default();
    let mut tasks = Vec::new();
    for budget in budgets {
        for &tenant in tenants {
            for _ in 0..4 {
                let (budget, log) = (budget.clone(), Arc::clone(&log));
                let path: Tenant = tenant.parse().unwrap();
                tasks.push(tokio::spawn(async move {
                    while Instant::now() < end {
                        let mut reservation = budget
                            .reserve(Cost::new(COST, 0))
                            .tenant(path.clone())
                            .await
                            .expect(expect);
                        log.lock().unwrap().push((Instant::now(), tenant, COST));
                        reservation.mark_sent();
                        reservation.charge_estimate();
                    }
                }));
            }
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    log
}

/// The most that `admissions` (instant, amount) take in any window, beyond what a bucket of
/// `rate` a second holding `burst` allows, each logged at most `slack` after it was made:
/// positive is an excess.
fn worst_excess(admissions: &[(Instant, u64)], rate: u64, burst: u64, slack: Duration) -> i64 {
    let mut sorted = admissions.to_vec();
    sorted.sort_by_key(|(at, _)| *at);
    let mut worst = i64::MIN;
    for i in 0..sorted.len() {
        let mut sum = 0;
        for j in i..sorted.len() {
            sum += sorted[j].1;
            let span = sorted[j].0 - sorted[i].0 + slack;
            let allowed = burst as f64 + rate as f64 * span.as_secs_f64();
            worst = worst.max(sum as i64 - allowed.floor() as i64);
        }
    }
    worst
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_budgets_three_tenants_keep_every_node_and_the_account() {
    let server = RedisServer::start();
    let budgets = [
        budget(&server).await,
        budget(&server).await,
        budget(&server).await,
    ];
    let end = Instant::now() + RUN;
    let probe = Probe::start(&server.url(), end);
    let log = drive(&budgets, &["a", "b", "c"], end, "admitted").await;
    let slack = probe.longest().await;
    let log = log.lock().unwrap();
    let of = |tenant: &str| -> Vec<(Instant, u64)> {
        log.iter()
            .filter(|(_, t, _)| *t == tenant)
            .map(|&(at, _, cost)| (at, cost))
            .collect()
    };
    let all: Vec<(Instant, u64)> = log.iter().map(|&(at, _, cost)| (at, cost)).collect();
    assert!(
        worst_excess(&of("a"), NODE_A, NODE_A, slack) <= 0,
        "tenant a over its limit"
    );
    assert!(
        worst_excess(&of("b"), NODE_B, NODE_B, slack) <= 0,
        "tenant b over its limit"
    );
    assert!(
        worst_excess(&all, ACCOUNT, ACCOUNT, slack) <= 0,
        "the account over its limit"
    );
    // The node limits bind across the budgets (whatever each budget's local copy of the tree
    // would allow alone: three times them), and a denial by a node does not hold up the
    // others: a and b get most of their rate, c the rest of the account.
    let start = all.iter().map(|(at, _)| *at).min().unwrap();
    let span = |tenant| (of(tenant).iter().map(|(at, _)| *at).max().unwrap() - start).as_secs_f64();
    let total = |tenant| of(tenant).iter().map(|(_, c)| c).sum::<u64>() as f64;
    let bound = |rate: u64, tenant| rate as f64 * (1.0 + span(tenant));
    let (a, b, c) = (total("a"), total("b"), total("c"));
    let (bound_a, bound_b) = (bound(NODE_A, "a"), bound(NODE_B, "b"));
    // (The upper bound is the window check above, with the recording's slack.)
    assert!(a >= 0.8 * bound_a, "a {a} of {bound_a}");
    assert!(b >= 0.8 * bound_b, "b {b} of {bound_b}");
    // While every tenant saturates (until the end of the run; the queues drain after it).
    let before_end: u64 = all
        .iter()
        .filter(|(at, _)| *at <= end)
        .map(|(_, c)| c)
        .sum();
    let used = before_end as f64 / (ACCOUNT as f64 * (1.0 + (end - start).as_secs_f64()));
    eprintln!(
        "a {a} of {bound_a}, b {b} of {bound_b}, account {:.1} % used, worst excess: a {}, b {}, account {} (replies up to {slack:?})",
        used * 100.0,
        worst_excess(&of("a"), NODE_A, NODE_A, slack),
        worst_excess(&of("b"), NODE_B, NODE_B, slack),
        worst_excess(&all, ACCOUNT, ACCOUNT, slack)
    );
    eprintln!(
        "with a fixed slack of {SLACK:?} instead: a {}, b {}, account {}",
        worst_excess(&of("a"), NODE_A, NODE_A, SLACK),
        worst_excess(&of("b"), NODE_B, NODE_B, SLACK),
        worst_excess(&all, ACCOUNT, ACCOUNT, SLACK)
    );
    assert!(
        used >= 0.9,
        "the account {used:.3} used: a {a}, b {b}, c {c}"
    );
    assert!(
        total("c") > 0.0,
        "the tenant without a limit of its own gets the rest"
    );
}

/// The same over a three-node Redis Cluster: a path's buckets live in the account's slot, so
/// one script call reaches them all (a key in another slot would fail the call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_cluster_a_path_s_buckets_share_the_account_s_slot() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.urls();
    let mut budgets = Vec::new();
    for first in 0..2 {
        let mut seeds = urls.clone();
        seeds.rotate_left(first);
        let budget = RedisBudget::cluster(seeds, "tenants")
            .timeout(Duration::from_secs(1))
            .connect(&Quota::new().with_limit(per_second(ACCOUNT)))
            .await
            .unwrap()
            .with_tenant_tree(tree())
            .unwrap();
        budgets.push(budget);
    }
    let end = Instant::now() + Duration::from_secs(2);
    let probe = Probe::start(&urls[0], end);
    let log = drive(
        &budgets,
        &["a", "c"],
        end,
        "admitted: every key of the script in one slot",
    )
    .await;
    let slack = probe.longest().await;
    let log = log.lock().unwrap();
    let a: Vec<(Instant, u64)> = log
        .iter()
        .filter(|(_, t, _)| *t == "a")
        .map(|&(at, _, cost)| (at, cost))
        .collect();
    let all: Vec<(Instant, u64)> = log.iter().map(|&(at, _, cost)| (at, cost)).collect();
    assert!(
        worst_excess(&a, NODE_A, NODE_A, slack) <= 0,
        "tenant a over its limit"
    );
    assert!(
        worst_excess(&all, ACCOUNT, ACCOUNT, slack) <= 0,
        "the account over its limit"
    );
    assert!(
        a.len() as u64 * COST >= NODE_A * 2,
        "tenant a admitted {} items",
        a.len()
    );
}

/// A node with `max_wait` zero refuses across processes too: two budgets on one Redis quota,
/// tenant `a` allowed 5 requests a minute: 5 admitted in all, every other request refused at
/// once by the node as the store counts it, saying when it could pay; none queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_refuses_holds_across_processes() {
    let server = RedisServer::start();
    let per_minute = |n| limit(Dimension::Requests, n, Duration::from_secs(60), n);
    let tree = || {
        TenantTree::new().with_node(
            "a".parse().unwrap(),
            TenantNode::new()
                .with_limit(per_minute(5))
                .with_max_wait(Duration::ZERO),
        )
    };
    let mut budgets = Vec::new();
    for _ in 0..2 {
        let budget = RedisBudget::new(server.url(), "refusing")
            .timeout(Duration::from_millis(500))
            .connect(&Quota::new().with_limit(per_minute(1_000)))
            .await
            .unwrap()
            .with_tenant_tree(tree())
            .unwrap();
        budgets.push(budget);
    }
    let (mut admitted, mut refused) = (Vec::new(), 0);
    for round in 0..10 {
        let budget = &budgets[round % 2];
        match budget
            .reserve(Cost::requests_only(1))
            .tenant("a".parse().unwrap())
            .await
        {
            Ok(reservation) => admitted.push(reservation),
            Err(e) => {
                let refusal = e.tenant_refused().expect("refused by the node");
                assert!(refusal.is_rate_limited(), "{refusal}");
                assert!(refusal.retry_after().is_some_and(|d| d > Duration::ZERO));
                refused += 1;
            }
        }
        assert_eq!(budget.waiters(), 0);
    }
    assert_eq!((admitted.len(), refused), (5, 5));
}

/// A pause holds on every process sharing the store: three budgets (as three processes would
/// hold them); `acme` paused on the first refuses `acme/search` on the others at their next
/// admission, naming `acme`, while `globex` goes on; resumed on the third, all admit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_holds_on_every_process() {
    let server = RedisServer::start();
    let mut budgets = Vec::new();
    for _ in 0..3 {
        let budget = RedisBudget::new(server.url(), "pausing")
            .timeout(Duration::from_millis(500))
            .connect(&pause_quota())
            .await
            .unwrap()
            .with_tenant_tree(TenantTree::new())
            .unwrap();
        budgets.push(budget);
    }
    pause_and_resume_everywhere(&budgets).await;
}

/// The same over a three-node Redis Cluster: the paused set shares the account's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_holds_on_every_process_of_a_cluster() {
    let cluster = RedisCluster::start(3);
    let mut budgets = Vec::new();
    for first in 0..3 {
        let mut seeds = cluster.urls();
        seeds.rotate_left(first);
        let budget = RedisBudget::cluster(seeds, "pausing")
            .timeout(Duration::from_secs(1))
            .connect(&pause_quota())
            .await
            .unwrap()
            .with_tenant_tree(TenantTree::new())
            .unwrap();
        budgets.push(budget);
    }
    pause_and_resume_everywhere(&budgets).await;
}

fn pause_quota() -> Quota {
    let per_minute = limit(Dimension::Requests, 1_000, Duration::from_secs(60), 1_000);
    Quota::new().with_limit(per_minute)
}

/// `acme` paused on the first budget: refused on every one (naming `acme`), `globex` not;
/// every budget's snapshot shows it within a reading; resumed on the last, admitted again on
/// every one within a reading.
async fn pause_and_resume_everywhere(budgets: &[Budget]) {
    let reserve = |budget: &Budget, tenant: &str| {
        budget
            .reserve(Cost::requests_only(1))
            .tenant(tenant.parse().unwrap())
    };
    for budget in budgets {
        reserve(budget, "acme/search").await.unwrap().refund();
    }
    let acme: Tenant = "acme".parse().unwrap();
    budgets[0].tenants().unwrap().pause(&acme);
    // The pause reaches the store in the background, within its timeout (waited for up to
    // a generous bound: a busy machine is slow, not wrong).
    let by = Instant::now() + PATIENCE;
    while reserve(&budgets[1], "acme/search").await.is_ok() {
        assert!(
            Instant::now() < by,
            "the pause never reached the other process"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for budget in budgets {
        let error = reserve(budget, "acme/search").await.unwrap_err();
        let refusal = error.tenant_refused().expect("refused by the tenant tree");
        assert!(refusal.is_paused(), "{refusal}");
        assert_eq!(refusal.scope().as_str(), "acme");
        assert_eq!(budget.waiters(), 0);
        reserve(budget, "globex").await.unwrap().refund();
    }
    // Every process's own view follows the store within a reading (half a second): the
    // pause shows in their snapshots.
    let started = Instant::now();
    for budget in budgets {
        while !budget.tenants().unwrap().snapshot(&acme).is_paused() {
            assert!(
                started.elapsed() < PATIENCE,
                "a snapshot never showed the pause"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    println!("the pause shown everywhere within {:?}", started.elapsed());
    // Resumed on the last: every process admits again, the one that paused included,
    // within a reading.
    budgets[budgets.len() - 1].tenants().unwrap().resume(&acme);
    let started = Instant::now();
    let search: Tenant = "acme/search".parse().unwrap();
    for budget in budgets {
        admitted_within(budget, &search, started + PATIENCE, "resumed").await;
    }
    println!("resumed everywhere within {:?}", started.elapsed());
}

/// Reserves a request of `tenant` on `budget` until it is admitted (then refunds it), every
/// few milliseconds; refused still at `by`, fails naming `what`.
async fn admitted_within(budget: &Budget, tenant: &Tenant, by: Instant, what: &str) {
    loop {
        match budget
            .reserve(Cost::requests_only(1))
            .tenant(tenant.clone())
            .await
        {
            Ok(reservation) => {
                reservation.refund();
                return;
            }
            Err(error) => {
                assert!(Instant::now() < by, "{what}: still refused: {error}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
}

/// Two budgets on `server` (as two processes would hold them) with `quota` and `tree`, asking
/// Redis per admission or `leased` (renewed every 50 ms).
async fn two_processes(
    server: &RedisServer,
    name: &str,
    leased: bool,
    quota: &Quota,
    tree: impl Fn() -> TenantTree,
) -> Vec<Budget> {
    let mut budgets = Vec::new();
    for _ in 0..2 {
        let mut builder = RedisBudget::new(server.url(), name).timeout(Duration::from_millis(500));
        if leased {
            builder = builder.leased_shares(Duration::from_millis(50));
        }
        let budget = builder.connect(quota).await.unwrap();
        budgets.push(budget.with_tenant_tree(tree()).unwrap());
    }
    budgets
}

/// A pause made through one process and lifted through another before the first read the
/// store again: the process that paused admits again within a reading (half a second), in
/// both modes, and its snapshot no longer shows the pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_through_another_process_reaches_the_one_that_paused() {
    for leased in [false, true] {
        let server = RedisServer::start();
        let budgets =
            two_processes(&server, "resumed", leased, &pause_quota(), TenantTree::new).await;
        let acme: Tenant = "acme".parse().unwrap();
        budgets[0].tenants().unwrap().pause(&acme);
        // The pause reached the store: the other process refuses too (per admission at once;
        // leased, at its next reading).
        let refused = || async {
            let reserve = budgets[1]
                .reserve(Cost::requests_only(1))
                .tenant(acme.clone());
            reserve.await.is_err()
        };
        let started = Instant::now();
        while !refused().await {
            assert!(started.elapsed() < PATIENCE, "the pause never arrived");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        budgets[1].tenants().unwrap().resume(&acme);
        let resumed = Instant::now();
        // Half a second between readings, and a round trip (waited for up to PATIENCE).
        let by = resumed + PATIENCE;
        admitted_within(&budgets[0], &acme, by, &format!("leased {leased}: resumed")).await;
        assert!(!budgets[0].tenants().unwrap().snapshot(&acme).is_paused());
        println!(
            "leased {leased}: resumed on the first within {:?}",
            resumed.elapsed()
        );
    }
}

/// A tenant's day is counted over every process, and every process's snapshot shows the
/// fleet's day (not what it spent itself) within a reading, in both modes (a leasing budget
/// asks the store for a tenant with a daily cap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_process_shows_the_fleet_s_day() {
    use std::num::NonZeroU64;

    for leased in [false, true] {
        let server = RedisServer::start();
        let tree = || {
            TenantTree::new().with_node(
                "globex".parse().unwrap(),
                TenantNode::new().with_cap(PeriodCap::new(
                    Dimension::TotalTokens,
                    NonZeroU64::new(5_000).unwrap(),
                    CapWindow::CalendarDayUtc,
                )),
            )
        };
        let quota = Quota::new().with_limit(limit(
            Dimension::TotalTokens,
            1_000_000,
            Duration::from_secs(60),
            1_000_000,
        ));
        let budgets = two_processes(&server, "days", leased, &quota, tree).await;
        let globex: Tenant = "globex".parse().unwrap();
        for (budget, tokens) in budgets.iter().zip([1_000, 100]) {
            let mut reservation = budget
                .reserve(Cost::new(tokens, 0))
                .tenant(globex.clone())
                .await
                .unwrap();
            reservation.mark_sent();
            reservation.charge_estimate();
        }
        let used =
            |budget: &Budget| budget.tenants().unwrap().snapshot(&globex).used_in_period()[0].1;
        let started = Instant::now();
        while budgets.iter().any(|b| used(b) != 1_100) {
            assert!(
                started.elapsed() < PATIENCE,
                "leased {leased}: {} and {} of 1,100",
                used(&budgets[0]),
                used(&budgets[1])
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!(
            "leased {leased}: both show 1,100 within {:?}",
            started.elapsed()
        );
    }
}

/// A tenant's limit holds over every account it uses, across processes, when the accounts
/// share a tenant plane: two accounts' budgets (as two processes would hold them, each with
/// its own tree) and a tenant of 20 requests a minute: 20 in all, 10 through each account,
/// then the next waits on either. Accounts of no common plane keep a node's buckets each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_plane_holds_a_node_s_limit_over_every_account() {
    let server = RedisServer::start();
    let per_minute = |n| limit(Dimension::Requests, n, Duration::from_secs(60), n);
    let tree = || {
        TenantTree::new().with_node(
            "acme".parse().unwrap(),
            TenantNode::new().with_limit(per_minute(20)),
        )
    };
    let account = |key: &'static str, plane: Option<&'static str>| {
        let url = server.url();
        let tree = tree();
        async move {
            let mut budget = RedisBudget::new(url, key).timeout(Duration::from_millis(500));
            if let Some(plane) = plane {
                budget = budget.tenant_plane(plane);
            }
            budget
                .connect(&Quota::new().with_limit(per_minute(1_000)))
                .await
                .unwrap()
                .with_tenant_tree(tree)
                .unwrap()
        }
    };
    let acme: Tenant = "acme".parse().unwrap();
    let try_one = |budget: &Budget| {
        let reserve = budget.reserve(Cost::requests_only(1)).tenant(acme.clone());
        async move { tokio::time::timeout(Duration::from_millis(300), reserve).await }
    };
    for (plane, expected) in [(Some("gateway"), 20), (None, 40)] {
        let openai = account("openai", plane).await;
        let anthropic = account("anthropic", plane).await;
        let mut held = Vec::new();
        for round in 0..expected {
            let budget = if round % 2 == 0 { &openai } else { &anthropic };
            let reservation = try_one(budget).await.expect("within the minute").unwrap();
            held.push(reservation);
        }
        for budget in [&openai, &anthropic] {
            assert!(
                try_one(budget).await.is_err(),
                "plane {plane:?}: the tenant's minute is spent after {expected}"
            );
        }
        // The two cases name different keys: each starts from full buckets.
        drop(held);
    }
}

/// Three budgets (as three processes would) of the account `name` with `tree`, on `server`.
async fn three_on_server(
    server: &RedisServer,
    name: &str,
    tree: fn() -> TenantTree,
) -> Vec<Budget> {
    let mut budgets = Vec::new();
    for _ in 0..3 {
        budgets.push(with_tree(RedisBudget::new(server.url(), name), tree()).await);
    }
    budgets
}

/// Three budgets on `server` leasing from the account (renewed every 50 ms), each with
/// `tree`.
async fn three_leasing(server: &RedisServer, name: &str, tree: fn() -> TenantTree) -> Vec<Budget> {
    let mut budgets = Vec::new();
    for _ in 0..3 {
        let builder = RedisBudget::new(server.url(), name).leased_shares(Duration::from_millis(50));
        budgets.push(with_tree(builder, tree()).await);
    }
    budgets
}

/// The same on a three-node cluster, each budget first asking a different node.
async fn three_on_cluster(
    cluster: &RedisCluster,
    name: &str,
    tree: fn() -> TenantTree,
) -> Vec<Budget> {
    let mut budgets = Vec::new();
    for first in 0..3 {
        let mut seeds = cluster.urls();
        seeds.rotate_left(first);
        budgets.push(with_tree(RedisBudget::cluster(seeds, name), tree()).await);
    }
    budgets
}

async fn with_tree(builder: RedisBudget, tree: TenantTree) -> Budget {
    // A reply that misses its timeout leaves its admission counted in the store (the safe
    // side: capacity unused, never spent twice), which these exact counts would read as an
    // under-spend; a busy machine's stall must not pass for that.
    builder
        .timeout(Duration::from_secs(10))
        .connect(&roomy_quota())
        .await
        .unwrap()
        .with_tenant_tree(tree)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_holds_over_every_process() {
    let server = RedisServer::start();
    let budgets = three_on_server(&server, "capped", capped_tree).await;
    caps_hold_over_every_budget(&budgets).await;
}

/// The same over three leasing processes: a tenant with a daily cap is asked of Redis per
/// admission, so its day holds over the fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_holds_over_every_leasing_process() {
    let server = RedisServer::start();
    let budgets = three_leasing(&server, "capped", capped_tree).await;
    caps_hold_over_every_budget(&budgets).await;
}

/// The same over a three-node Redis Cluster: a node's days share the account's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_holds_over_every_process_of_a_cluster() {
    let cluster = RedisCluster::start(3);
    let budgets = three_on_cluster(&cluster, "capped", capped_tree).await;
    caps_hold_over_every_budget(&budgets).await;
}

async fn account_capped(builder: RedisBudget) -> Budget {
    builder
        .timeout(Duration::from_secs(10))
        .connect(&roomy_quota().with_cap(account_cap()))
        .await
        .unwrap()
}

/// An account's cap ([`Quota::with_cap`]) over three processes: its count is the store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_cap_holds_over_every_process() {
    let server = RedisServer::start();
    let mut budgets = Vec::new();
    for _ in 0..3 {
        budgets.push(account_capped(RedisBudget::new(server.url(), "capped")).await);
    }
    an_account_cap_holds_over_every_budget(&budgets, "capped").await;
}

/// The same over three leasing processes: a request of a capped account is asked of Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_cap_holds_over_every_leasing_process() {
    let server = RedisServer::start();
    let mut budgets = Vec::new();
    for _ in 0..3 {
        let builder =
            RedisBudget::new(server.url(), "capped").leased_shares(Duration::from_millis(50));
        budgets.push(account_capped(builder).await);
    }
    an_account_cap_holds_over_every_budget(&budgets, "capped").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_flight_cap_holds_over_every_process() {
    let server = RedisServer::start();
    let budgets = three_on_server(&server, "slotted", slotted_tree).await;
    in_flight_caps_hold_over_every_budget(&budgets).await;
    // Every slot was given back (the settlements are written in the background).
    let started = Instant::now();
    while server.command("HLEN llmq:{slotted}:t:acme:slots") != ":0" {
        assert!(started.elapsed() < PATIENCE, "slots left in the store");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The same over three leasing processes: a tenant with a cap on calls in flight is asked of
/// Redis per admission, so its slots hold over the fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_flight_cap_holds_over_every_leasing_process() {
    let server = RedisServer::start();
    let budgets = three_leasing(&server, "slotted", slotted_tree).await;
    in_flight_caps_hold_over_every_budget(&budgets).await;
}

/// The same over a three-node Redis Cluster: a node's slots and the processes' leases share
/// the account's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_flight_cap_holds_over_every_process_of_a_cluster() {
    let cluster = RedisCluster::start(3);
    let budgets = three_on_cluster(&cluster, "slotted", slotted_tree).await;
    in_flight_caps_hold_over_every_budget(&budgets).await;
}

/// The window check finds a planted excess: 600 tokens of a 500-a-second node within 100 ms,
/// beyond its burst and the slack's refill; and allows them spread over a second and more.
#[test]
fn the_window_check_finds_a_planted_excess() {
    let t0 = Instant::now();
    let bunched: Vec<(Instant, u64)> = (0..6)
        .map(|i| (t0 + Duration::from_millis(20 * i), COST))
        .collect();
    assert!(worst_excess(&bunched, NODE_A, NODE_A, SLACK) > 0);
    let spread: Vec<(Instant, u64)> = (0..6)
        .map(|i| (t0 + Duration::from_millis(250 * i), COST))
        .collect();
    assert!(worst_excess(&spread, NODE_A, NODE_A, SLACK) <= 0);
}
