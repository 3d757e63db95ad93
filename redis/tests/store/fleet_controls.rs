//! A tenant's controls hold over a fleet of processes: three processes on one private
//! `redis-server`, two of them this test binary started again as children. A daily cap is
//! counted once for all of them; a cap on calls in flight is a set of slots in Redis, and the
//! slots of a process killed with SIGKILL while holding them come back within its lease,
//! while a live process's slots outlive any number of leases.

use tower_llm_quota_test_support::redis_server;

use std::io::{BufRead, BufReader, Read};
use std::num::{NonZeroU64, NonZeroUsize};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use redis_server::RedisServer;
use tokio::time::Instant;
use tower_llm_quota::tenant::{CapWindow, PeriodCap, TenantNode, TenantTree};
use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota};
use tower_llm_quota_redis::RedisBudget;

/// Set in a child: the Redis URL to share.
const CHILD: &str = "FLEET_CONTROLS_CHILD";
/// How long a process's slots outlive its last heartbeat.
const SLOT_LEASE: Duration = Duration::from_secs(1);
/// `acme`'s cap on calls in flight over the fleet.
const SLOTS: usize = 4;
/// `globex`'s daily cap (tokens), spent 100 at a time.
const DAILY: u64 = 3_000;

/// The budget every process of the fleet builds: an account far above what the test
/// spends, so only the tenants' controls bind.
async fn budget(url: &str) -> Budget {
    let quota = Quota::new().with_limit(Limit::per_minute(
        Dimension::TotalTokens,
        NonZeroU64::new(10_000_000).unwrap(),
    ));
    let tree = TenantTree::new()
        .with_node(
            "acme".parse().unwrap(),
            TenantNode::new().with_max_in_flight(NonZeroUsize::new(SLOTS).unwrap()),
        )
        .with_node(
            "globex".parse().unwrap(),
            TenantNode::new().with_cap(PeriodCap::new(
                Dimension::TotalTokens,
                NonZeroU64::new(DAILY).unwrap(),
                CapWindow::CalendarDayUtc,
            )),
        );
    RedisBudget::new(url, "fleet")
        .timeout(Duration::from_secs(1))
        .slot_lease(SLOT_LEASE)
        .connect(&quota)
        .await
        .unwrap()
        .with_tenant_tree(tree)
        .unwrap()
}

/// Spends 100 tokens of `globex` at a time until its daily cap refuses; returns the tokens
/// spent.
async fn spend_the_day(budget: &Budget) -> u64 {
    let mut spent = 0;
    loop {
        match budget
            .reserve(Cost::new(100, 0))
            .tenant("globex".parse().unwrap())
            .await
        {
            Ok(mut reservation) => {
                reservation.mark_sent();
                reservation.charge_estimate();
                spent += 100;
            }
            Err(error) => {
                let refused = error.tenant_refused().expect("refused by the tenant");
                assert!(refused.is_capped(), "{refused}");
                return spent;
            }
        }
    }
}

/// One reservation of `acme` (a slot), sent.
async fn slot(budget: &Budget) -> tower_llm_quota::Reservation {
    let mut reservation = budget
        .reserve(Cost::new(1, 0))
        .tenant("acme".parse().unwrap())
        .await
        .unwrap();
    reservation.mark_sent();
    reservation
}

/// A child of the fleet (this test, started again with [`CHILD`] set): spends `globex`'s day
/// with its parent and siblings, prints what it spent, takes two of `acme`'s slots, prints
/// `held`, and holds them until its stdin closes (or it is killed).
async fn child(url: &str) {
    let budget = budget(url).await;
    println!("spent {}", spend_the_day(&budget).await);
    let held = [slot(&budget).await, slot(&budget).await];
    println!("held");
    tokio::task::spawn_blocking(|| std::io::stdin().read_to_end(&mut Vec::new()))
        .await
        .unwrap()
        .unwrap();
    drop(held);
}

/// This test binary again, as a child of the fleet sharing `url`; its stdout as lines.
fn spawn_child(url: &str) -> (Child, std::io::Lines<BufReader<ChildStdout>>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "fleet_controls::three_processes_share_a_day_and_a_killed_one_s_slots_come_back_within_its_lease",
            "--exact",
            "--nocapture",
        ])
        .env(CHILD, url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// What follows `word` in the next line of a child's output that holds it (the test
/// harness starts a line of its own before the child's first).
fn next_line(lines: &mut std::io::Lines<BufReader<ChildStdout>>, word: &str) -> String {
    lines
        .map_while(Result::ok)
        .find_map(|line| line.split_once(word).map(|(_, rest)| rest.to_owned()))
        .unwrap_or_else(|| panic!("the child ended before printing {word:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_share_a_day_and_a_killed_one_s_slots_come_back_within_its_lease() {
    if let Ok(url) = std::env::var(CHILD) {
        return child(&url).await;
    }
    let server = RedisServer::start();
    let url = server.url();
    let parent = budget(&url).await;
    let (mut killed, mut killed_out) = spawn_child(&url);
    let (mut alive, mut alive_out) = spawn_child(&url);

    // The day: the three processes spend it together, exactly once.
    let mine = spend_the_day(&parent).await;
    let (first, second, alive_out) = tokio::task::spawn_blocking(move || {
        let first: u64 = next_line(&mut killed_out, "spent ").parse().unwrap();
        let second: u64 = next_line(&mut alive_out, "spent ").parse().unwrap();
        next_line(&mut killed_out, "held");
        next_line(&mut alive_out, "held");
        (first, second, alive_out)
    })
    .await
    .unwrap();
    eprintln!("the day: {mine} + {first} + {second} tokens of {DAILY}");
    assert_eq!(mine + first + second, DAILY, "the day spent over the fleet");

    // The slots: the children hold all four. Live, they keep them past many leases.
    let waited = tokio::time::timeout(3 * SLOT_LEASE, slot(&parent)).await;
    assert!(waited.is_err(), "admitted beyond the fleet's four slots");

    // One child dies holding two: they come back within its lease (and a heartbeat).
    killed.kill().unwrap();
    let died = Instant::now();
    let one = slot(&parent).await;
    let back = died.elapsed();
    let two = tokio::time::timeout(Duration::from_millis(50), slot(&parent))
        .await
        .expect("both of the killed process's slots came back");
    eprintln!("a killed process's slots came back after {back:?} (lease {SLOT_LEASE:?})");
    assert!(
        back <= SLOT_LEASE + Duration::from_millis(300),
        "its slots came back after {back:?}"
    );
    // The live child still holds its two: the fleet's four are taken again.
    let third = tokio::time::timeout(2 * SLOT_LEASE, slot(&parent)).await;
    assert!(third.is_err(), "admitted beyond the fleet's four slots");

    drop((one, two));
    // The live child ends when told (its output still read, so that it can finish).
    drop(alive.stdin.take());
    let rest = tokio::task::spawn_blocking(move || alive_out.map_while(Result::ok).count());
    assert!(alive.wait().unwrap().success());
    rest.await.unwrap();
    killed.wait().unwrap();
}
