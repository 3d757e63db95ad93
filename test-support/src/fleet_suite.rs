//! The fleet suite: a fleet on leases never spends more than its account, whatever becomes of
//! its processes. Real processes (the calling test binary started again as children) and
//! budgets on a private store server, counted from outside; every store that leases runs it
//! (the Redis store and the Postgres store).
//!
//! - The scenarios where a design that reports spending only at the next renewal admitted
//!   twice the burst: a process spends the burst, then leaves, is SIGKILLed, loses its
//!   renewal's reply, fails to write, or has its connection cut; then a newcomer joins.
//!   Rolling restarts of short-lived processes, a process's overrun, a provider's report, and
//!   five processes each waiting for a unit of an account of four.
//! - A randomized churn: processes join, leave, are SIGKILLed, are stopped past their lease
//!   (SIGSTOP, then SIGCONT), see their renewals' replies delayed past the timeout or their
//!   connections cut (a loopback proxy), while the store refuses writes and restarts (killed,
//!   then started from what it wrote). Each child logs every admission with the instants just
//!   before and just after it; the oracle counts, for every window, the admissions certainly
//!   inside it and checks them against the account's burst plus its rate over the window. The
//!   oracle is checked on a planted violation (this module's unit tests).

use std::future::Future;
use std::io::{BufRead, BufReader, Write};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tower_llm_quota::budget::Observation;
use tower_llm_quota::{Budget, Cost, Dimension, Quota};

use crate::limit;
use crate::loopback_proxy::LoopbackProxy;

/// How often every budget of the suite renews its lease.
pub const REFRESH: Duration = Duration::from_millis(50);

/// Set in a child: its [`Spec`].
const CHILD: &str = "FLEET_SUITE_CHILD";

/// A boxed future of a budget.
pub type Connecting = Pin<Box<dyn Future<Output = Result<Budget, String>> + Send>>;

/// A store under test, its server private to the test.
pub trait Fleet {
    /// The server's port.
    fn port(&self) -> u16;
    /// The store's URL through a proxy on `port` (the server's own port: directly).
    fn url_via(&self, port: u16) -> String;
    /// Makes the store refuse writes (full, or read-only), or accept them again.
    fn refuse_writes(&self, refused: bool);
    /// Kills the store and starts it again from what it acknowledged.
    fn restart(&mut self);
    /// Every call's timeout: a loaded machine's round trip stays within it; the proxy delays
    /// replies past it.
    fn timeout(&self) -> Duration;
    /// A budget leasing `quota` under `key` at `url`, renewing every [`REFRESH`], its calls
    /// bounded by [`Fleet::timeout`], failing closed.
    fn leased(&self, url: &str, key: &str, quota: &Quota) -> Connecting;
    /// Where the calling test binary's child entry point is (`module::child_process`): a test
    /// that calls [`child`] first thing.
    fn child_test(&self) -> &'static str;
}

/// An account: `rate` tokens per `period`, `burst` at once.
#[derive(Debug, Clone, Copy)]
pub struct Account {
    /// Tokens per `period`.
    pub rate: u64,
    /// The period.
    pub period: Duration,
    /// The most at once.
    pub burst: u64,
}

impl Account {
    /// Its quota: one limit of total tokens.
    pub fn quota(self) -> Quota {
        Quota::new().with_limit(limit(
            Dimension::TotalTokens,
            self.rate,
            self.period,
            self.burst,
        ))
    }

    /// The most a fleet may admit over `window`: the burst and the rate over it.
    pub fn allows(self, window: Duration) -> f64 {
        self.burst as f64 + self.rate as f64 * window.as_secs_f64() / self.period.as_secs_f64()
    }
}

/// A burst of 1,000 tokens refilled at about 0.03 tokens a second: nothing more may be
/// admitted over a test.
pub const STILL: Account = Account {
    rate: 1_000,
    period: Duration::from_secs(9 * 3_600),
    burst: 1_000,
};

/// A leasing budget, asked again until the store answers (a store that refuses writes or
/// restarts at the moment a process starts).
pub async fn leased(fleet: &impl Fleet, url: &str, key: &str, account: Account) -> Budget {
    let quota = account.quota();
    loop {
        match fleet.leased(url, key, &quota).await {
            Ok(budget) => return budget,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Microseconds on the wall clock: every process of the test reads the same one.
pub fn micros() -> u64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    u64::try_from(since.as_micros()).unwrap()
}

/// Reserves `cost` now if the budget can (settled at its estimate): the instants just before
/// and just after, when admitted.
pub fn admit(budget: &Budget, cost: u64) -> Option<(u64, u64)> {
    let before = micros();
    let mut reservation = budget.try_reserve(Cost::new(cost, 0)).ok()?;
    let after = micros();
    reservation.mark_sent();
    reservation.charge_estimate();
    Some((before, after))
}

/// Reserves `amount` in requests of 100, each waiting its turn, settled at its estimate.
pub async fn spend_in_hundreds(budget: &Budget, amount: u64) -> u64 {
    for _ in 0..amount / 100 {
        let mut reservation = budget.reserve(Cost::new(100, 0)).await.unwrap();
        reservation.mark_sent();
        reservation.charge_estimate();
    }
    amount
}

/// Tries to admit `cost` every millisecond for `during`: the tokens admitted.
pub async fn spend_for(budget: &Budget, cost: u64, during: Duration) -> u64 {
    let end = tokio::time::Instant::now() + during;
    let mut spent = 0;
    while tokio::time::Instant::now() < end {
        match admit(budget, cost) {
            Some(_) => spent += cost,
            None => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
    spent
}

/// Tries to admit `cost` every millisecond until `enough` is admitted (however long a busy
/// machine takes to renew the lease, up to a minute), then for `more` beyond.
pub async fn spend_until(budget: &Budget, cost: u64, enough: u64, more: Duration) -> u64 {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut spent = 0;
    while spent < enough && tokio::time::Instant::now() < give_up {
        match admit(budget, cost) {
            Some(_) => spent += cost,
            None => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
    spent + spend_for(budget, cost, more).await
}

/// What a child does: its store's URL, the account's key, the account, and the cost of its
/// requests.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The store's URL (through a proxy, often).
    pub url: String,
    /// The account's key.
    pub key: String,
    /// The account.
    pub account: Account,
    /// The cost of each request.
    pub cost: u64,
}

impl Spec {
    fn encode(&self) -> String {
        let a = self.account;
        format!(
            "{} {} {}/{}/{} {}",
            self.url,
            self.key,
            a.rate,
            a.period.as_millis(),
            a.burst,
            self.cost
        )
    }

    /// The spec this process was started with as a child, if it was.
    pub fn of_child() -> Option<Self> {
        let spec = std::env::var(CHILD).ok()?;
        let parts: Vec<&str> = spec.split(' ').collect();
        let [url, key, account, cost] = parts[..] else {
            panic!("a child spec: {spec}")
        };
        let numbers: Vec<u64> = account.split('/').map(|n| n.parse().unwrap()).collect();
        Some(Self {
            url: url.to_owned(),
            key: key.to_owned(),
            account: Account {
                rate: numbers[0],
                period: Duration::from_millis(numbers[1]),
                burst: numbers[2],
            },
            cost: cost.parse().unwrap(),
        })
    }
}

/// The child's life, given its leasing budget: admits the spec's cost whenever it can,
/// printing `A <before> <after> <cost>` per admission, until its stdin closes (then it drops
/// its budget, giving back what it holds, and exits) or it is killed.
pub async fn child(budget: Budget, cost: u64) {
    println!("ready");
    let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = closed.clone();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        watcher.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let mut out = std::io::stdout();
    while !closed.load(std::sync::atomic::Ordering::Relaxed) {
        match admit(&budget, cost) {
            Some((before, after)) => {
                writeln!(out, "A {before} {after} {cost}").unwrap();
                out.flush().unwrap();
            }
            None => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
    drop(budget);
    // The renewal task gives back what the budget held before the runtime ends.
    tokio::time::sleep(Duration::from_millis(200)).await;
}

/// The calling test binary started again to run `test` alone, told its part by the
/// environment variable `var` set to `spec` (stdin piped, stderr dropped), returned once it
/// says it is ready: each line it prints `A x y z` is handed to `admitted` as `[x, y, z]`.
pub fn spawn_child(
    test: &str,
    (var, spec): (&str, &str),
    admitted: impl Fn([&str; 3]) + Send + 'static,
) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture"])
        .env(var, spec)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (ready, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line == "ready" {
                let _ = ready.send(());
            }
            let fields: Vec<&str> = line.split(' ').collect();
            if let ["A", x, y, z] = fields[..] {
                admitted([x, y, z]);
            }
        }
    });
    // Condition, not sleep: the child says when its budget is connected.
    ready_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a child connects");
    child
}

/// Every admission a child logged: before, after, tokens.
pub type Log = Arc<Mutex<Vec<(u64, u64, u64)>>>;

/// A child process of the fleet, its admissions logged into a [`Log`].
#[derive(Debug)]
pub struct Process {
    child: Child,
}

impl Process {
    /// Starts the calling test binary's `test` as a child doing `spec`, once it is connected.
    pub fn spawn(test: &str, spec: &Spec, log: &Log) -> Self {
        let log = log.clone();
        let child = spawn_child(
            test,
            (CHILD, &spec.encode()),
            move |[before, after, cost]| {
                let entry = (
                    before.parse().unwrap(),
                    after.parse().unwrap(),
                    cost.parse().unwrap(),
                );
                log.lock().unwrap().push(entry);
            },
        );
        Self { child }
    }

    /// Sends `signal` (`-STOP`, `-CONT`, ...).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal}");
    }

    /// Closes its stdin: it gives back what it holds and exits.
    pub fn leave(mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }

    /// SIGKILL.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The worst excess over `account` of `admissions` (before, after, tokens; microseconds) in
/// any window: for every window from an admission's `before` to another's `after`, the tokens
/// of the admissions certainly inside it (both instants within) less what the account allows
/// over it (lengthened by `slack`). Positive is a violation.
pub fn worst_excess(admissions: &[(u64, u64, u64)], account: Account, slack: Duration) -> f64 {
    let mut by_start = admissions.to_vec();
    by_start.sort_unstable();
    let mut worst = f64::MIN;
    let mut inside: Vec<(u64, u64)> = Vec::with_capacity(by_start.len());
    for (i, &(start, _, _)) in by_start.iter().enumerate() {
        inside.clear();
        inside.extend(
            by_start[i..]
                .iter()
                .map(|&(_, after, tokens)| (after, tokens)),
        );
        inside.sort_unstable();
        let mut sum = 0;
        for &(end, tokens) in &inside {
            sum += tokens;
            let window = Duration::from_micros(end.saturating_sub(start)) + slack;
            worst = worst.max(sum as f64 - account.allows(window));
        }
    }
    worst
}

/// Waits until `condition` holds, polling every 5 ms for at most `within` (the children are
/// real processes on the wall clock: a condition, not a fixed sleep, and a generous bound).
pub fn eventually(within: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + within;
    while std::time::Instant::now() < end {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    condition()
}

/// What may become of a process that spent the burst.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// It leaves cleanly.
    Leaves,
    /// SIGKILL.
    IsKilled,
    /// Its next renewal runs in the store and the reply comes too late.
    LosesItsRenewalsReply,
    /// The store refuses its writes for a while.
    FailsToWrite,
    /// Its connections are cut.
    IsCutOff,
}

/// The first process spends the burst in 100s, then `fate` happens to it; a newcomer then
/// tries for a second. What the two admitted.
pub async fn burst_then(fleet: &impl Fleet, fate: Fate) -> (u64, u64) {
    let proxy = LoopbackProxy::start(fleet.port());
    // An account of its own per fate.
    let key = &format!("scenario-{fate:?}");
    let log: Log = Arc::default();
    let spec = Spec {
        url: fleet.url_via(proxy.port()),
        key: key.to_owned(),
        account: STILL,
        cost: 100,
    };
    let first = Process::spawn(fleet.child_test(), &spec, &log);
    assert!(
        eventually(Duration::from_secs(30), || log.lock().unwrap().len() >= 10),
        "the first process spends the burst"
    );
    match fate {
        Fate::Leaves => first.leave(),
        Fate::IsKilled => first.kill(),
        Fate::LosesItsRenewalsReply => {
            proxy.delay_replies(fleet.timeout() * 4);
            tokio::time::sleep(REFRESH * 3).await;
            proxy.delay_replies(Duration::ZERO);
            drop(first);
        }
        Fate::FailsToWrite => {
            fleet.refuse_writes(true);
            tokio::time::sleep(Duration::from_millis(150)).await;
            fleet.refuse_writes(false);
            drop(first);
        }
        Fate::IsCutOff => {
            proxy.reset_connections();
            tokio::time::sleep(REFRESH * 3).await;
            drop(first);
        }
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let url = fleet.url_via(fleet.port());
    let newcomer = leased(fleet, &url, key, STILL).await;
    let second = spend_for(&newcomer, 100, Duration::from_secs(1)).await;
    let first: u64 = log.lock().unwrap().iter().map(|a| a.2).sum();
    (first, second)
}

/// Each fate in turn: the first process admitted the burst, the newcomer nothing.
pub async fn a_burst_is_spent_once_whatever_becomes_of_its_first_holder(fleet: &impl Fleet) {
    for fate in [
        Fate::Leaves,
        Fate::IsKilled,
        Fate::LosesItsRenewalsReply,
        Fate::FailsToWrite,
        Fate::IsCutOff,
    ] {
        let (first, second) = burst_then(fleet, fate).await;
        println!("the first process: {fate:?}; it admitted {first}, the newcomer {second}");
        assert_eq!(first, STILL.burst, "{fate:?}");
        assert_eq!(second, 0, "{fate:?}: the burst admitted twice");
    }
}

/// A process that leaves cleanly gives back what it holds beyond what it spent: the newcomer
/// spends the rest of the burst, and the two together spend it exactly.
pub async fn a_process_leaving_gives_back_what_it_holds(fleet: &impl Fleet) {
    let url = fleet.url_via(fleet.port());
    let first = leased(fleet, &url, "leaving", STILL).await;
    // Three requests of 100: the lease holds more than that (its part of the burst).
    let spent = spend_in_hundreds(&first, 300).await;
    tokio::time::sleep(REFRESH * 2).await;
    drop(first);
    tokio::time::sleep(REFRESH * 2).await;
    let newcomer = leased(fleet, &url, "leaving", STILL).await;
    let rest = STILL.burst - spent;
    let second = spend_until(&newcomer, 100, rest, Duration::from_millis(500)).await;
    println!("the first spent {spent} and left; the newcomer spent {second}");
    assert!(spent > 0);
    assert_eq!(spent + second, STILL.burst, "what the first held came back");
}

/// The provider reports less left than the fleet holds (an unseen client spent the rest):
/// what the leases hold unspent is part of that report, so the account's bucket keeps only
/// the rest and each wallet at most the report. After it, the holder and a newcomer (once the
/// holder has left and given its lease back) admit no more than the provider said was left.
pub async fn a_provider_report_counts_what_the_leases_hold_once(fleet: &impl Fleet) {
    const LEFT: u64 = 500;
    let url = fleet.url_via(fleet.port());
    let first = leased(fleet, &url, "reported", STILL).await;
    let spent = spend_in_hundreds(&first, 300).await;
    // Of the 700 the fleet holds, the provider has 500 left.
    let report = Observation::new(Dimension::TotalTokens, STILL.period).with_remaining(LEFT);
    first.observe(&report);
    tokio::time::sleep(REFRESH * 2).await;
    let before_leaving = spend_for(&first, 100, Duration::from_millis(200)).await;
    drop(first);
    tokio::time::sleep(REFRESH * 2).await;
    let newcomer = leased(fleet, &url, "reported", STILL).await;
    let after = spend_for(&newcomer, 100, Duration::from_millis(800)).await;
    println!(
        "spent {spent}; the provider reported {LEFT} left; then the holder admitted \
         {before_leaving} and the newcomer {after}"
    );
    assert!(
        before_leaving + after <= LEFT,
        "{} admitted after a report of {LEFT} left",
        before_leaving + after
    );
    assert!(before_leaving + after > 0, "what was left is spent");
}

/// A process reserves 100 and uses 1,000 (an overrun), staying alive: its debt reaches the
/// store, and a newcomer finds nothing.
pub async fn an_overrun_is_charged_to_the_account(fleet: &impl Fleet) {
    let url = fleet.url_via(fleet.port());
    let first = leased(fleet, &url, "overrun", STILL).await;
    let mut reservation = first.reserve(Cost::new(100, 0)).await.expect("admitted");
    reservation.mark_sent();
    reservation.settle_cost(Cost::new(1_000, 0));
    tokio::time::sleep(REFRESH * 3).await;
    let newcomer = leased(fleet, &url, "overrun", STILL).await;
    let second = spend_for(&newcomer, 100, Duration::from_secs(1)).await;
    let third = spend_for(&first, 100, Duration::from_millis(200)).await;
    println!(
        "used 1,000 of a reservation of 100; then the newcomer admitted {second}, the first {third}"
    );
    assert_eq!(second + third, 0);
}

/// Three fleets of short-lived processes, each replaced ten times over four seconds (every
/// incarnation spends what it can for its life, then leaves): the account's burst and rate
/// over the four seconds at most.
pub async fn rolling_restarts_never_admit_beyond_the_account(fleet: &impl Fleet) {
    // A burst of 1,000 and 100 a second: 1,400 over four seconds.
    let account = Account {
        rate: 100,
        period: Duration::from_secs(1),
        burst: 1_000,
    };
    let url = fleet.url_via(fleet.port());
    let start = tokio::time::Instant::now();
    let lines = (0..3u64).map(|line| {
        let url = url.clone();
        async move {
            let mut spent = 0;
            tokio::time::sleep(Duration::from_millis(line * 130)).await;
            for _ in 0..10 {
                let budget = leased(fleet, &url, "rolling", account).await;
                spent += spend_for(&budget, 10, Duration::from_millis(350)).await;
                drop(budget);
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            spent
        }
    });
    let admitted: u64 = futures_util::future::join_all(lines)
        .await
        .into_iter()
        .sum();
    let allowed = account.allows(start.elapsed());
    println!(
        "30 incarnations over {:?}: {admitted} admitted, {allowed:.0} allowed",
        start.elapsed()
    );
    assert!(admitted as f64 <= allowed, "{admitted} > {allowed}");
    assert!(
        admitted as f64 >= 0.8 * allowed,
        "only {admitted} of {allowed}"
    );
}

/// Twenty requests a minute (a burst of four), five processes each with a request waiting:
/// four are admitted at once, whole units, and the fifth when the account has refilled one.
pub async fn five_processes_share_an_account_of_four_units_in_turn(fleet: &impl Fleet) {
    let quota = Quota::new().with_limit(limit(Dimension::Requests, 20, Duration::from_secs(60), 4));
    let url = fleet.url_via(fleet.port());
    let start = tokio::time::Instant::now();
    let mut waiting = Vec::new();
    for _ in 0..5 {
        let budget = fleet.leased(&url, "units", &quota).await.unwrap();
        waiting.push(tokio::spawn(async move {
            let mut reservation = budget
                .reserve(Cost::default().with_requests(1))
                .await
                .unwrap();
            reservation.mark_sent();
            reservation.charge_estimate();
            start.elapsed()
        }));
    }
    let mut admitted = Vec::new();
    for request in waiting {
        admitted.push(request.await.unwrap());
    }
    admitted.sort();
    println!("admitted after {admitted:?}");
    assert!(
        admitted[3] <= Duration::from_secs(1),
        "four at once: {admitted:?}"
    );
    // The fifth when one unit has refilled (3 s), within a few refreshes.
    assert!(admitted[4] >= Duration::from_millis(2_900), "{admitted:?}");
    assert!(admitted[4] <= Duration::from_secs(5), "{admitted:?}");
}

/// What one churning run did, and what it measured.
#[derive(Debug, Default)]
pub struct Churned {
    /// Processes that joined.
    pub joined: u32,
    /// Processes that left cleanly.
    pub left: u32,
    /// Processes SIGKILLed.
    pub killed: u32,
    /// Processes stopped past their lease.
    pub stopped: u32,
    /// Spells of replies held past the timeout.
    pub delayed: u32,
    /// Spells of every connection cut.
    pub cut: u32,
    /// Spells of the store refusing writes.
    pub refused: u32,
    /// Restarts of the store.
    pub restarted: u32,
    /// Tokens admitted.
    pub admitted: u64,
    /// Tokens the account allows over the run.
    pub allowed: f64,
    /// The worst window's excess (positive: a violation).
    pub worst: f64,
}

/// One run of the churn, `seed` choosing what happens when, for about `seconds`, against a
/// store that restarts at most `restarts` times.
pub fn churn(fleet: &mut impl Fleet, seed: u64, seconds: u64, restarts: u32) -> Churned {
    let account = Account {
        rate: 1_000,
        period: Duration::from_secs(1),
        burst: 1_000,
    };
    let proxy = LoopbackProxy::start(fleet.port());
    let spec = Spec {
        url: fleet.url_via(proxy.port()),
        key: "churn".to_owned(),
        account,
        cost: 10,
    };
    let test = fleet.child_test();
    let log: Log = Arc::default();
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut done = Churned::default();
    let from = micros();
    let mut processes: Vec<Process> = (0..3).map(|_| Process::spawn(test, &spec, &log)).collect();
    // The faults' schedule: real processes and a real store run on the wall clock, and no
    // assertion rests on these intervals (the oracle reads the children's own instants).
    let pause = |rng: &mut fastrand::Rng, from: u64, to: u64| {
        std::thread::sleep(Duration::from_millis(rng.u64(from..to)));
    };
    let end = std::time::Instant::now() + Duration::from_secs(seconds);
    while std::time::Instant::now() < end {
        pause(&mut rng, 100, 300);
        match rng.u32(..10) {
            0 | 1 if processes.len() < 6 => {
                processes.push(Process::spawn(test, &spec, &log));
                done.joined += 1;
            }
            2 if processes.len() > 2 => {
                processes.swap_remove(rng.usize(..processes.len())).leave();
                done.left += 1;
            }
            3 if processes.len() > 2 => {
                processes.swap_remove(rng.usize(..processes.len())).kill();
                done.killed += 1;
            }
            4 => {
                // Stopped past its lease, then let go on.
                let process = &processes[rng.usize(..processes.len())];
                process.signal("-STOP");
                pause(&mut rng, 200, 500);
                process.signal("-CONT");
                done.stopped += 1;
            }
            5 => {
                // Every reply held past the renewals' timeout for a while.
                proxy.delay_replies(Duration::from_millis(rng.u64(200..400)));
                pause(&mut rng, 200, 400);
                proxy.delay_replies(Duration::ZERO);
                done.delayed += 1;
            }
            6 => {
                fleet.refuse_writes(true);
                pause(&mut rng, 150, 300);
                fleet.refuse_writes(false);
                done.refused += 1;
            }
            7 if done.restarted < restarts => {
                fleet.restart();
                done.restarted += 1;
            }
            8 => {
                proxy.reset_connections();
                done.cut += 1;
            }
            _ => {}
        }
    }
    for process in processes {
        process.leave();
    }
    let to = micros();
    let log = log.lock().unwrap().clone();
    done.admitted = log.iter().map(|a| a.2).sum();
    done.allowed = account.allows(Duration::from_micros(to - from));
    // Two milliseconds for the store's clock, read in whole milliseconds.
    done.worst = worst_excess(&log, account, Duration::from_millis(2));
    done
}

/// The randomized churn: no window of any length holds more than the account's burst and
/// rate over it, in every run. `LEASE_CHURN_RUNS` and `LEASE_CHURN_SECONDS` lengthen it;
/// `LEASE_CHURN_SEED` replays a run.
pub fn a_churning_fleet_never_admits_beyond_the_account(fleet: &mut impl Fleet, restarts: u32) {
    let runs: u64 = std::env::var("LEASE_CHURN_RUNS").map_or(2, |r| r.parse().unwrap());
    let seconds: u64 = std::env::var("LEASE_CHURN_SECONDS").map_or(8, |s| s.parse().unwrap());
    let first: u64 = std::env::var("LEASE_CHURN_SEED")
        .map_or_else(|_| fastrand::u64(..), |s| s.parse().unwrap());
    for run in 0..runs {
        let seed = first.wrapping_add(run);
        let churned = churn(fleet, seed, seconds, restarts);
        println!(
            "seed {seed}: {churned:?}; used {:.1} % of what the account allows",
            churned.admitted as f64 / churned.allowed * 100.0
        );
        assert!(
            churned.worst <= 0.0,
            "seed {seed}: a window {:.0} tokens over the account",
            churned.worst
        );
        assert!(churned.admitted > 0, "seed {seed}: nothing admitted");
    }
}

/// The suite's tests for a store, in the calling module: its children's entry point
/// (`child_process`, which [`Fleet::child_test`] names), each scenario on a fleet made by
/// `$start`, and the randomized churn with the store restarted `$restarts` times a run at
/// most. `$leased` connects a child's budget, as [`Fleet::leased`] does.
///
/// ```ignore
/// tower_llm_quota_test_support::fleet_tests!(OverRedis::start(), leased, restarts = 2);
/// ```
#[macro_export]
macro_rules! fleet_tests {
    ($start:expr, $leased:path, restarts = $restarts:expr) => {
        /// The entry point of the children: does nothing unless started as one.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn child_process() {
            use $crate::fleet_suite::Spec;
            if let Some(spec) = Spec::of_child() {
                let budget = loop {
                    match $leased(&spec.url, &spec.key, &spec.account.quota()).await {
                        Ok(budget) => break budget,
                        Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
                    }
                };
                $crate::fleet_suite::child(budget, spec.cost).await;
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_burst_is_spent_once_whatever_becomes_of_its_first_holder() {
            $crate::fleet_suite::a_burst_is_spent_once_whatever_becomes_of_its_first_holder(
                &$start,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_process_leaving_gives_back_what_it_holds() {
            $crate::fleet_suite::a_process_leaving_gives_back_what_it_holds(&$start).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_provider_report_counts_what_the_leases_hold_once() {
            $crate::fleet_suite::a_provider_report_counts_what_the_leases_hold_once(&$start).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn an_overrun_is_charged_to_the_account() {
            $crate::fleet_suite::an_overrun_is_charged_to_the_account(&$start).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn rolling_restarts_never_admit_beyond_the_account() {
            $crate::fleet_suite::rolling_restarts_never_admit_beyond_the_account(&$start).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn five_processes_share_an_account_of_four_units_in_turn() {
            $crate::fleet_suite::five_processes_share_an_account_of_four_units_in_turn(&$start)
                .await;
        }

        /// The randomized churn (see the fleet suite), the store restarted a few times a run.
        #[test]
        fn a_churning_fleet_never_admits_beyond_the_account() {
            $crate::fleet_suite::a_churning_fleet_never_admits_beyond_the_account(
                &mut $start,
                $restarts,
            );
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The oracle sees a violation planted in a log that holds none.
    #[test]
    fn the_oracle_finds_a_planted_violation() {
        let account = Account {
            rate: 1_000,
            period: Duration::from_secs(1),
            burst: 100,
        };
        // 10 tokens every 10 ms: exactly the rate, after the burst.
        let mut log: Vec<(u64, u64, u64)> = (1..=1_000)
            .map(|i| (i * 10_000, i * 10_000 + 5, 10))
            .collect();
        log.extend((0..10).map(|i| (i * 10, i * 10 + 5, 10)));
        let clean = worst_excess(&log, account, Duration::ZERO);
        assert!(clean <= 0.0, "{clean}");
        // Planted: another burst's worth at 5 s.
        log.extend((0..11).map(|i| (5_000_000 + i, 5_000_001 + i, 10)));
        let planted = worst_excess(&log, account, Duration::ZERO);
        assert!(planted > 0.0, "{planted}");
        // An admission whose instants straddle the window counts in no shorter one.
        let stalled = [(0, 0, 100), (0, 2_000_000, 100)];
        assert!(worst_excess(&stalled, account, Duration::ZERO) <= 0.0);
    }
}
