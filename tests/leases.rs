//! Leased shares ([`RedisBudget::leased_shares`]): several budgets (as several processes would)
//! admit from shares of one account that Redis divides between them. Real time against a
//! private `redis-server`: the account's bucket holds over them all in every window, the
//! shares follow demand and tenants' weights over the fleet, a dead process's share comes
//! back when its lease ends, and Redis is called a few times a second per process rather
//! than once per admission.

mod redis_server;
mod support;

use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis_server::RedisServer;
use redis_server::cluster::RedisCluster;
use support::limit;
use tokio::time::Instant;
use tower_llm_quota::budget::redis::RedisBudget;
use tower_llm_quota::tenant::{Tenant, TenantNode, TenantTree};
use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota};

const SECOND: Duration = Duration::from_secs(1);
const REFRESH: Duration = Duration::from_millis(50);
/// The account: tokens a second, and at once.
const ACCOUNT: u64 = 30_000;
const COST: u64 = 20;
/// How late an admission may be recorded after it was made.
const SLACK: Duration = Duration::from_millis(10);

/// Every admission: when, by which budget, for which tenant, how much.
type Log = Arc<Mutex<Vec<(Instant, usize, &'static str, u64)>>>;

fn account() -> Limit {
    limit(Dimension::TotalTokens, ACCOUNT, SECOND, ACCOUNT)
}

async fn leased(server: &RedisServer, key: &str) -> Budget {
    RedisBudget::new(server.url(), key)
        .timeout(Duration::from_millis(500))
        .leased_shares(REFRESH)
        .connect(&Quota::new().with_limit(account()))
        .await
        .unwrap()
}

/// `callers` tasks per (budget, tenant) pair, each reserving `COST` until `end` and logging
/// what it was admitted (after `from`).
async fn drive(
    budgets: &[(usize, Budget, &'static str)],
    callers: usize,
    (from, end): (Instant, Instant),
) -> Log {
    let log: Log = Arc::default();
    let mut tasks = Vec::new();
    for (index, budget, tenant) in budgets {
        for _ in 0..callers {
            let (budget, log, index, tenant) = (budget.clone(), log.clone(), *index, *tenant);
            tasks.push(tokio::spawn(async move {
                while Instant::now() < end {
                    let mut reservation = match tenant {
                        "" => budget.reserve(Cost::new(COST, 0)).await,
                        _ => {
                            let path: Tenant = tenant.parse().unwrap();
                            budget.reserve(Cost::new(COST, 0)).tenant(path).await
                        }
                    }
                    .expect("admitted");
                    let now = Instant::now();
                    if now >= from && now < end {
                        log.lock().unwrap().push((now, index, tenant, COST));
                    }
                    reservation.mark_sent();
                    reservation.charge_estimate();
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    log
}

/// The most that `admissions` take in any window beyond what a bucket of `rate` a second
/// holding `burst` allows (its burst, and its rate over the window): positive is an excess.
fn worst_excess(mut admissions: Vec<(Instant, u64)>, rate: u64, burst: u64) -> i64 {
    admissions.sort_by_key(|(at, _)| *at);
    let mut worst = i64::MIN;
    for i in 0..admissions.len() {
        let mut sum = 0;
        for admission in &admissions[i..] {
            sum += admission.1;
            let span = admission.0 - admissions[i].0 + SLACK;
            let allowed = burst as f64 + rate as f64 * span.as_secs_f64();
            worst = worst.max(sum as i64 - allowed.floor() as i64);
        }
    }
    worst
}

/// The tokens each key of `log` was admitted, as a share of all.
fn shares<K: std::hash::Hash + Eq>(
    log: &Log,
    key: impl Fn(usize, &'static str) -> K,
) -> HashMap<K, f64> {
    let log = log.lock().unwrap();
    let total: u64 = log.iter().map(|e| e.3).sum();
    let mut by = HashMap::new();
    for &(_, index, tenant, amount) in log.iter() {
        *by.entry(key(index, tenant)).or_insert(0.0) += amount as f64 / total as f64;
    }
    by
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_leasing_processes_keep_the_account_and_share_it_evenly() {
    let server = RedisServer::start();
    let budgets = [
        leased(&server, "even").await,
        leased(&server, "even").await,
        leased(&server, "even").await,
    ];
    server.command("CONFIG RESETSTAT");
    let count = keep_the_account_and_share_it_evenly(&budgets).await;
    let (calls, _) = server.script_stats();
    println!(
        "{calls} script calls for {count} admissions ({:.4} a call)",
        calls as f64 / count as f64
    );
    assert!(
        (calls as f64) / (count as f64) <= 0.1,
        "{calls} calls for {count} admissions"
    );
}

/// The same on a three-node Redis Cluster: the shares live in the account's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_leasing_processes_of_a_cluster_keep_the_account() {
    let cluster = RedisCluster::start(3);
    let mut budgets = Vec::new();
    for first in 0..3 {
        let mut seeds = cluster.urls();
        seeds.rotate_left(first);
        let budget = RedisBudget::cluster(seeds, "even")
            .timeout(Duration::from_secs(1))
            .leased_shares(REFRESH)
            .connect(&Quota::new().with_limit(account()))
            .await
            .unwrap();
        budgets.push(budget);
    }
    keep_the_account_and_share_it_evenly(&budgets).await;
}

/// Eight callers on each of three leasing `budgets` for four seconds: no window above the
/// account, at least nine tenths of its rate used from the second second, a third each.
/// Returns the admissions.
async fn keep_the_account_and_share_it_evenly(budgets: &[Budget]) -> u64 {
    let start = Instant::now();
    let (from, end) = (start + SECOND, start + Duration::from_secs(4));
    let pairs: Vec<_> = budgets
        .iter()
        .enumerate()
        .map(|(i, b)| (i, b.clone(), ""))
        .collect();
    let log = drive(&pairs, 8, (start, end)).await;
    let admissions: Vec<(Instant, u64)> = log.lock().unwrap().iter().map(|e| (e.0, e.3)).collect();
    let count = admissions.len() as u64;
    let excess = worst_excess(admissions.clone(), ACCOUNT, ACCOUNT);
    // Over the whole run: the burst and four seconds of refill at most.
    let spent: u64 = admissions.iter().map(|a| a.1).sum();
    let most = ACCOUNT * 5;
    let measured: u64 = admissions.iter().filter(|a| a.0 >= from).map(|a| a.1).sum();
    let used = measured as f64 / (ACCOUNT as f64 * 3.0);
    let by_process = {
        let log = log.lock().unwrap();
        let mut by = [0u64; 3];
        for e in log.iter().filter(|e| e.0 >= from) {
            by[e.1] += e.3;
        }
        by.map(|b| b as f64 / measured as f64)
    };
    println!(
        "{count} admissions, worst excess {excess} tokens, {used:.3} of the rate used, shares \
         {by_process:.3?}"
    );
    assert!(spent <= most, "{spent} > {most}");
    assert!(excess <= 0, "an excess of {excess} tokens");
    assert!(used >= 0.9, "only {used:.3} of the rate used");
    for share in by_process {
        assert!((share - 1.0 / 3.0).abs() <= 0.05, "{by_process:?}");
    }
    count
}

fn weighted(a: u32, b: u32) -> TenantTree {
    TenantTree::new()
        .with_node(
            "a".parse().unwrap(),
            TenantNode::new().with_weight(NonZeroU32::new(a).unwrap()),
        )
        .with_node(
            "b".parse().unwrap(),
            TenantNode::new().with_weight(NonZeroU32::new(b).unwrap()),
        )
}

/// Tenant a on the first process only, tenant b on both, both saturating: their token shares
/// over the fleet.
async fn fleet_shares(weights: (u32, u32), key: &str) -> (f64, f64) {
    shares_of(|| weighted(weights.0, weights.1), key).await
}

/// Tenant a on the first process only, tenant b on both, both saturating, under `tree`: their
/// token shares over the fleet.
async fn shares_of(tree: impl Fn() -> TenantTree, key: &str) -> (f64, f64) {
    let server = RedisServer::start();
    let first = leased(&server, key).await.with_tenant_tree(tree()).unwrap();
    let second = leased(&server, key).await.with_tenant_tree(tree()).unwrap();
    let start = Instant::now();
    let pairs = [(0, first.clone(), "a"), (0, first, "b"), (1, second, "b")];
    let log = drive(&pairs, 6, (start + SECOND, start + Duration::from_secs(5))).await;
    let by = shares(&log, |_, tenant| tenant);
    let by_process = shares(&log, |index, _| index);
    println!("{key}: tenants {by:.3?}, processes {by_process:.3?}");
    (by["a"], by["b"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_on_one_process_and_one_on_two_share_the_fleet_evenly() {
    let (a, b) = fleet_shares((1, 1), "spread-1-1").await;
    assert!(
        (a - 0.5).abs() <= 0.05 && (b - 0.5).abs() <= 0.05,
        "{a:.3} / {b:.3}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_three_to_one_hold_over_the_fleet() {
    let (a, b) = fleet_shares((3, 1), "spread-3-1").await;
    assert!(
        (a - 0.75).abs() <= 0.05 && (b - 0.25).abs() <= 0.05,
        "{a:.3} / {b:.3}"
    );
}

/// Tenant a (weight 1) guaranteed `guarantee` of the account, on the first process only; b
/// (weight 3) on both: their token shares over the fleet.
async fn guaranteed_shares(guarantee: f64, key: &str) -> (f64, f64) {
    let tree = || {
        TenantTree::new()
            .with_node(
                "a".parse().unwrap(),
                TenantNode::new().with_guarantee(guarantee),
            )
            .with_node(
                "b".parse().unwrap(),
                TenantNode::new().with_weight(NonZeroU32::new(3).unwrap()),
            )
    };
    shares_of(tree, key).await
}

/// A guarantee holds over the fleet as in memory (a's weighted share alone is 25 %): at 60 %
/// the first process's weighted part (62.5 %) covers it, and its own fair share serves a
/// its guarantee as a share of that part; at 80 % the store lifts the first process to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarantee_holds_over_the_fleet() {
    for (guarantee, key) in [(0.6, "guaranteed-60"), (0.8, "guaranteed-80")] {
        let (a, b) = guaranteed_shares(guarantee, key).await;
        assert!(
            (a - guarantee).abs() <= 0.05 && (b - (1.0 - guarantee)).abs() <= 0.05,
            "guaranteed {guarantee}: {a:.3} / {b:.3}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_process_s_share_comes_back_when_its_lease_ends() {
    let server = RedisServer::start();
    // A process that died holding the whole account, its lease ending in 600 ms.
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let time: Vec<String> = redis::cmd("TIME")
        .query_async(&mut connection)
        .await
        .unwrap();
    let now_ms = time[0].parse::<u64>().unwrap() * 1000 + time[1].parse::<u64>().unwrap() / 1000;
    let _: () = redis::cmd("HSET")
        .arg("llmq:{dead}:shares")
        .arg("dead")
        .arg(format!("1000000|1.000000|{}|1.0|0=1", now_ms + 600))
        .query_async(&mut connection)
        .await
        .unwrap();
    let budget = leased(&server, "dead").await;
    let start = Instant::now();
    let mut reservation = budget.reserve(Cost::new(COST, 0)).await.unwrap();
    let waited = start.elapsed();
    reservation.mark_sent();
    reservation.charge_estimate();
    println!("first admission after {waited:?}");
    // Nothing while the dead lease holds the account; then at the next renewal.
    assert!(waited >= Duration::from_millis(500), "{waited:?}");
    assert!(
        waited <= Duration::from_millis(600) + REFRESH * 2,
        "{waited:?}"
    );
}

/// The lease script alone, with the clock argument only tests pass, against the crate's book
/// of leases ([`tower_llm_quota::budget::fleet::Ledger`]) over generated sequences of
/// renewals, departures and time: the same grants and spreads, and the shares held never
/// above one.
mod script_against_the_model {
    use proptest::prelude::*;
    use redis::Script;
    use tower_llm_quota::budget::fleet::{Claim, Ledger};

    use super::redis_server::RedisServer;

    const SHARES: &str = "t:{q}:shares";
    const HOLD: &str = "t:{q}:total_tokens:60000:held";
    const PLAN: &str = "t:{q}:total_tokens:60000:plan";
    const BUCKET: &str = "t:{q}:total_tokens:60000";
    const LEASE_MS: i64 = 300;
    /// How often the account is divided anew (ms).
    const EVERY: i64 = 50;

    #[derive(Debug, Clone)]
    enum Op {
        /// A process renews: what it wants (twentieths), its waiting flows and weights, its
        /// waiting guarantees and their shares (millionths).
        Lease(u8, u8, Vec<(u64, u32)>, Vec<(u64, u32)>),
        Leave(u8),
        Advance(i64),
    }

    fn op() -> impl Strategy<Value = Op> {
        let flows = proptest::collection::btree_map(1u64..5, 1u32..5, 0..3)
            .prop_map(|flows| flows.into_iter().collect::<Vec<_>>());
        let guarantees = proptest::collection::btree_map(1u64..4, 0u32..=700_000, 0..2)
            .prop_map(|guarantees| guarantees.into_iter().collect::<Vec<_>>());
        prop_oneof![
            6 => (0u8..5, 0u8..=20, flows, guarantees)
                .prop_map(|(p, w, f, g)| Op::Lease(p, w, f, g)),
            1 => (0u8..5).prop_map(Op::Leave),
            2 => (0i64..200).prop_map(Op::Advance),
        ]
    }

    fn script() -> Script {
        Script::new(&format!(
            "{}{}",
            include_str!("../src/budget/redis/bucket.lua"),
            include_str!("../src/budget/redis/lease.lua")
        ))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn the_script_grants_what_the_model_divides(ops in proptest::collection::vec(op(), 1..80)) {
            thread_local! {
                static SERVER: RedisServer = RedisServer::start();
            }
            let url = SERVER.with(RedisServer::url);
            let mut connection = redis::Client::open(url).unwrap().get_connection().unwrap();
            let _: () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
            let lease = script();
            let mut now: i64 = 1_000_000;
            let mut model = Ledger::new(LEASE_MS as u64, EVERY as u64);
            for op in ops {
                match op {
                    Op::Advance(ms) => now += ms,
                    Op::Leave(process) => {
                        let reply: Vec<i64> = lease
                            .key(SHARES)
                            .arg(now)
                            .arg(format!("p{process}"))
                            .arg(LEASE_MS)
                            .arg("-1.000000")
                            .arg(EVERY)
                            .invoke(&mut connection)
                            .unwrap();
                        prop_assert_eq!(reply, vec![0, 0]);
                        model.leave(u64::from(process));
                    }
                    Op::Lease(process, twentieths, flows, guarantees) => {
                        let want = f64::from(twentieths) / 20.0;
                        let mut invocation = lease.key(SHARES);
                        invocation.key(HOLD).key(PLAN).key(BUCKET);
                        invocation
                            .arg(now)
                            .arg(format!("p{process}"))
                            .arg(LEASE_MS)
                            .arg(format!("{want:.6}"))
                            .arg(EVERY)
                            // A fixed share: its plan never climbs.
                            .arg(0)
                            .arg(60_000)
                            // Its bucket: a unit a millisecond, 60,000 at most; nothing spent.
                            .arg(1)
                            .arg(1)
                            .arg(60_000)
                            .arg(0);
                        for (key, weight) in &flows {
                            invocation.arg(format!("{key:x}")).arg(weight);
                        }
                        for (key, share) in &guarantees {
                            invocation.arg(format!("g{key:x}")).arg(share);
                        }
                        let reply: Vec<i64> = invocation.invoke(&mut connection).unwrap();
                        let claim = flows
                            .iter()
                            .fold(Claim::new(want), |c, &(key, weight)| c.with_flow(key, weight));
                        let claim = guarantees
                            .iter()
                            .fold(claim, |c, &(key, share)| c.with_guarantee(key, share));
                        let granted = model.lease(u64::from(process), claim, now as u64);
                        let (granted, spread) = (granted.share, granted.spread);
                        // Parts are sums of floating-point fractions, added in another order.
                        prop_assert!(
                            reply[0].abs_diff(granted as i64) <= 1,
                            "granted {} by the script, {} by the model", reply[0], granted
                        );
                        prop_assert_eq!(reply[1], LEASE_MS);
                        prop_assert_eq!(reply[2], 0, "no hold");
                        prop_assert_eq!(reply[3], 1_000_000, "the whole amount planned");
                        prop_assert_eq!(reply[4], 60_000, "the bucket full");
                        let told: Vec<i64> = spread.into_iter().map(i64::from).collect();
                        prop_assert_eq!(&reply[5..], &told[..]);
                        prop_assert!(model.held() <= 1_000_000, "the shares held add up to {}", model.held());
                    }
                }
            }
        }
    }
}

/// Requests larger than each process's share of the burst (750 tokens, where four processes
/// hold 200 each of a burst of 800), settled below their estimate: each is admitted once its
/// process's share is full, into debt that its refill repays, none of it forgiven. The excess
/// in any window stays within one request beyond its share per process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_larger_than_a_share_of_the_burst_go_into_debt() {
    const RATE: u64 = 20_000;
    const BURST: u64 = 800;
    const PROCESSES: u64 = 4;
    let (estimate, actual) = (750, 500);
    let server = RedisServer::start();
    let limit = limit(Dimension::TotalTokens, RATE, SECOND, BURST);
    let mut budgets = Vec::new();
    for _ in 0..PROCESSES {
        let budget = RedisBudget::new(server.url(), "debt")
            .timeout(Duration::from_millis(500))
            .leased_shares(REFRESH)
            .connect(&Quota::new().with_limit(limit))
            .await
            .unwrap();
        budgets.push(budget);
    }
    let log: Arc<Mutex<Vec<(Instant, u64)>>> = Arc::default();
    let start = Instant::now();
    let end = start + Duration::from_secs(4);
    let mut tasks = Vec::new();
    for budget in &budgets {
        for _ in 0..8 {
            let (budget, log) = (budget.clone(), log.clone());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < end {
                    let mut reservation = budget.reserve(Cost::new(estimate, 0)).await.unwrap();
                    let at = Instant::now();
                    reservation.mark_sent();
                    tokio::time::sleep(Duration::from_millis(40)).await;
                    reservation.settle_cost(Cost::new(actual, 0));
                    log.lock().unwrap().push((at, actual));
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let admissions = log.lock().unwrap().clone();
    let worst = worst_excess(admissions.clone(), RATE, BURST);
    let used: u64 = admissions.iter().map(|a| a.1).sum();
    let bound = (PROCESSES * (estimate - BURST / PROCESSES)) as i64;
    println!(
        "{} admissions, {used} tokens used, worst excess {worst} tokens (bound {bound})",
        admissions.len()
    );
    assert!(worst <= bound, "an excess of {worst} tokens");
    // Four seconds at the rate (less the startup's first division) at least two thirds used.
    assert!(
        used as f64 >= RATE as f64 * 4.0 * 0.66,
        "{used} tokens used"
    );
}

/// The adaptive share of a fleet on leased shares: a 429 seen by one process (its pause)
/// lowers the plan once for every process, which climbs back by its increase per period; a
/// second 429 while the first holds lowers nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_seen_by_one_process_lowers_the_fleet_s_plan_once() {
    let server = RedisServer::start();
    // Adaptive (the default share): decrease 0.8, back up by half the amount per second.
    let adaptive = Limit::per_second(Dimension::TotalTokens, NonZeroU64::new(10_000).unwrap());
    let quota = Quota::new().with_limit(adaptive);
    let mut budgets = Vec::new();
    for _ in 0..2 {
        let budget = RedisBudget::new(server.url(), "plan")
            .timeout(Duration::from_millis(500))
            .leased_shares(REFRESH)
            .connect(&quota)
            .await
            .unwrap();
        budgets.push(budget);
    }
    let planned = |budget: &Budget| {
        budget
            .snapshot()
            .limit(Dimension::TotalTokens, SECOND)
            .map(|l| l.limit().headroom())
            .unwrap()
    };
    tokio::time::sleep(REFRESH * 3).await;
    assert_eq!(
        planned(&budgets[1]),
        1.0,
        "the whole amount, alone on the key"
    );
    let paused = Instant::now();
    budgets[0].pause(
        &[Dimension::TotalTokens],
        paused + Duration::from_millis(200),
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    budgets[0].pause(
        &[Dimension::TotalTokens],
        paused + Duration::from_millis(200),
    );
    tokio::time::sleep(REFRESH * 2).await;
    let lowered = planned(&budgets[1]);
    let climbed = paused.elapsed().as_secs_f64() * 0.5;
    println!(
        "planned {lowered:.3} by the other process {:?} after the 429",
        paused.elapsed()
    );
    // 0.8, climbing half the amount a second since: once, not twice (0.64).
    assert!(
        lowered >= 0.8 && lowered <= 0.8 + climbed + 0.01,
        "{lowered}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(planned(&budgets[1]), 1.0, "back to the whole amount");
    assert_eq!(planned(&budgets[0]), 1.0);
}
