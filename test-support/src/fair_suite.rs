//! The fairness suite: tenants share a saturated account over a fleet by their weights and
//! guarantees, whichever processes their clients reach and however many clients each has.
//! Real processes (the calling test binary started again as children) on a private store,
//! counted from outside; every store runs it, asking per admission and leasing.
//!
//! A [`Case`] is generated from a seed: 2-4 tenants of weights 1-5, some with a guarantee;
//! 2-4 processes; each tenant's clients on a random subset of them, 1 to 32 on each; requests
//! of mixed sizes. Each child serves its clients (closed loops, each reserving a request of
//! its tenant, settled at its estimate, then the next) and prints every admission with its
//! tenant, instant and tokens. The oracle ([`Shares::check`]) compares each tenant's share of
//! the tokens admitted while every tenant is backlogged with the reference division
//! ([`reference()`]: weighted max-min with guarantees, computed from the weights, the
//! guarantees and the demand, not from the crate), and computes Jain's index among tenants of
//! equal weight. Then, in the same case, a process is SIGKILLed and replaced, and a tenant goes
//! idle and comes back: its share is reclaimed within two refreshes.
//!
//! The oracle is checked on a planted violation: children that ignore their tenants (each
//! request unattributed) give shares that follow the clients, and the check fails
//! ([`planted_violation_is_caught`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::process::{Child, ChildStdin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use std::time::Duration;

use tower_llm_quota::tenant::{Tenant, TenantNode, TenantTree};
use tower_llm_quota::{Budget, Cost, Dimension, Quota};

use crate::fleet_suite::{micros, spawn_child};
use crate::limit;

/// How often leasing children renew (and how often children asking per admission learn the
/// fleet's division).
pub const REFRESH: Duration = Duration::from_millis(50);

/// Set in a child: its [`Spec`].
const CHILD: &str = "FAIR_SUITE_CHILD";

/// The account by default: 200,000 tokens a second (about 500 admissions a second), a second
/// of it at once (each process's credit holds its part of the burst: a burst of a few
/// renewals of the rate keeps a late renewal from losing its part to the others).
pub const RATE: u64 = 200_000;

/// The request sizes, in tokens, drawn evenly.
const SIZES: [u64; 3] = [60, 240, 900];

/// A boxed future of a budget.
pub type Connecting = Pin<Box<dyn Future<Output = Result<Budget, String>> + Send>>;

/// How the children's budgets share the account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Each admission asks the store.
    PerAdmission,
    /// Leased shares renewed every [`REFRESH`].
    Leased,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::PerAdmission => "per-admission",
            Mode::Leased => "leased",
        }
    }

    fn parse(s: &str) -> Self {
        match s {
            "leased" => Mode::Leased,
            _ => Mode::PerAdmission,
        }
    }
}

/// The account's quota: `rate` tokens a second, a second of it at once.
pub fn quota(rate: u64) -> Quota {
    Quota::new().with_limit(limit(
        Dimension::TotalTokens,
        rate,
        Duration::from_secs(1),
        rate,
    ))
}

/// A tenant of a case.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TenantSpec {
    /// Its weight, 1 to 5.
    pub weight: u32,
    /// Its guarantee, a share of the account (0: none).
    pub guarantee: f64,
}

/// A generated topology.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    /// The seed it was generated from.
    pub seed: u64,
    /// The tenants.
    pub tenants: Vec<TenantSpec>,
    /// Per process, the clients of each tenant on it (0: none).
    pub clients: Vec<Vec<u32>>,
}

impl Case {
    /// The case of `seed`: 2-4 tenants of weights 1-5, a third of them with a guarantee of
    /// 10 to 40 % (60 % in all at most); 2-4 processes; each tenant on a random non-empty
    /// subset of them, with 1, 2, 4, 8, 16 or 32 clients on each.
    pub fn generate(seed: u64) -> Self {
        let mut rng = fastrand::Rng::with_seed(seed);
        let count = rng.usize(2..=4);
        let mut guaranteed = 0.0;
        let tenants = (0..count)
            .map(|_| {
                let weight = rng.u32(1..=5);
                let mut guarantee = 0.0;
                if rng.u32(0..3) == 0 {
                    let g = f64::from(rng.u32(1..=4)) / 10.0;
                    if guaranteed + g <= 0.6 + 1e-9 {
                        guaranteed += g;
                        guarantee = g;
                    }
                }
                TenantSpec { weight, guarantee }
            })
            .collect();
        let processes = rng.usize(2..=4);
        // Per tenant, its clients on each process.
        let columns: Vec<Vec<u32>> = (0..count)
            .map(|_| {
                let mut column = vec![0u32; processes];
                let mut on: Vec<usize> = (0..processes).filter(|_| rng.bool()).collect();
                if on.is_empty() {
                    on.push(rng.usize(0..processes));
                }
                for process in on {
                    column[process] = 1 << rng.u32(0..=5);
                }
                column
            })
            .collect();
        let clients = (0..processes)
            .map(|p| columns.iter().map(|column| column[p]).collect())
            .collect();
        Self {
            seed,
            tenants,
            clients,
        }
    }

    /// The tenant tree: `t0`, `t1`... with their weights and guarantees.
    pub fn tree(&self) -> TenantTree {
        self.tenants
            .iter()
            .enumerate()
            .fold(TenantTree::new(), |tree, (i, t)| {
                let mut node = TenantNode::new()
                    .with_weight(std::num::NonZeroU32::new(t.weight.max(1)).unwrap());
                if t.guarantee > 0.0 {
                    node = node.with_guarantee(t.guarantee);
                }
                tree.with_node(tenant(i), node)
            })
    }

    /// The reference division with every tenant of `busy` backlogged (the others idle).
    pub fn reference(&self, busy: &[bool]) -> Vec<f64> {
        reference(&self.tenants, busy)
    }
}

fn tenant(i: usize) -> Tenant {
    format!("t{i}").parse().expect("a valid path")
}

/// Weighted max-min fairness with guarantees among backlogged tenants: each gets its weight's
/// part of what is left, lifted to its guarantee when that part is less (the others sharing
/// the rest by weight); idle tenants get nothing. The shares add up to 1.
pub fn reference(tenants: &[TenantSpec], busy: &[bool]) -> Vec<f64> {
    let mut shares = vec![0.0; tenants.len()];
    let mut lifted = vec![false; tenants.len()];
    loop {
        let left = 1.0
            - (0..tenants.len())
                .filter(|&i| lifted[i])
                .map(|i| tenants[i].guarantee)
                .sum::<f64>();
        let weight: f64 = (0..tenants.len())
            .filter(|&i| busy[i] && !lifted[i])
            .map(|i| f64::from(tenants[i].weight))
            .sum();
        let mut changed = false;
        for i in 0..tenants.len() {
            if !busy[i] {
                continue;
            }
            shares[i] = match lifted[i] {
                true => tenants[i].guarantee,
                false => left * f64::from(tenants[i].weight) / weight,
            };
        }
        for i in 0..tenants.len() {
            if busy[i] && !lifted[i] && shares[i] + 1e-12 < tenants[i].guarantee {
                lifted[i] = true;
                changed = true;
            }
        }
        if !changed {
            return shares;
        }
    }
}

/// Jain's fairness index of `x`: 1 when all are equal, `1 / n` when one has everything.
pub fn jain(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    match squares > 0.0 {
        true => sum * sum / (x.len() as f64 * squares),
        false => 1.0,
    }
}

/// Each tenant's share of the tokens admitted in a window, against the reference.
#[derive(Debug, Clone)]
pub struct Shares {
    /// Measured, per tenant.
    pub measured: Vec<f64>,
    /// The reference, per tenant.
    pub expected: Vec<f64>,
    /// Measured, per process and tenant (how a tenant's share is split between its
    /// processes is not prescribed: printed to explain a deviation).
    pub by_process: Vec<Vec<f64>>,
    /// The tokens admitted in the window.
    pub tokens: u64,
}

impl Shares {
    /// The largest deviation from the reference, in points of the account.
    pub fn worst(&self) -> f64 {
        (self.measured.iter().zip(&self.expected))
            .map(|(m, e)| (m - e).abs() * 100.0)
            .fold(0.0, f64::max)
    }

    /// Jain's index among the tenants of equal weight and no guarantee (each measured share
    /// over its reference), the lowest over the groups of two or more; 1 without such a group.
    pub fn jain(&self, case: &Case) -> f64 {
        let mut groups: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
        for (i, t) in case.tenants.iter().enumerate() {
            if t.guarantee == 0.0 && self.expected[i] > 0.0 {
                let normalized = self.measured[i] / self.expected[i];
                groups.entry(t.weight).or_default().push(normalized);
            }
        }
        (groups.values())
            .filter(|g| g.len() >= 2)
            .map(|g| jain(g))
            .fold(1.0, f64::min)
    }

    /// Fails unless every share is within `points` of the reference and Jain's index among
    /// equal weights is at least 0.99.
    pub fn check(&self, case: &Case, points: f64, what: &str) -> Result<(), String> {
        let (worst, jain) = (self.worst(), self.jain(case));
        if worst > points || jain < 0.99 {
            return Err(format!(
                "{what}: case {case:?}: shares {:.3?} against {:.3?} ({} tokens): worst {worst:.1} \
                 points (at most {points}), Jain {jain:.4}",
                self.measured, self.expected, self.tokens
            ));
        }
        Ok(())
    }
}

/// What a child does.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The store's URL.
    pub url: String,
    /// The account's key.
    pub key: String,
    /// Per admission or leased.
    pub mode: Mode,
    /// The case (its tenants).
    pub case: Case,
    /// This process's index in the case.
    pub process: usize,
    /// Requests carry no tenant (the planted violation).
    pub plant: bool,
    /// The account's tokens a second ([`FairStore::rate`]).
    pub rate: u64,
}

impl Spec {
    fn encode(&self) -> String {
        let tenants: Vec<String> = (self.case.tenants.iter())
            .map(|t| format!("{}:{}", t.weight, t.guarantee))
            .collect();
        let clients: Vec<String> = (self.case.clients.iter())
            .map(|c| c.iter().map(u32::to_string).collect::<Vec<_>>().join(":"))
            .collect();
        format!(
            "{} {} {} {} {} {} {} {} {}",
            self.url,
            self.key,
            self.mode.as_str(),
            self.case.seed,
            tenants.join(","),
            clients.join(","),
            self.process,
            self.plant,
            self.rate
        )
    }

    /// The account's quota.
    pub fn quota(&self) -> Quota {
        quota(self.rate)
    }

    /// The spec this process was started with as a child, if it was.
    pub fn of_child() -> Option<Self> {
        let spec = std::env::var(CHILD).ok()?;
        let parts: Vec<&str> = spec.split(' ').collect();
        let [url, key, mode, seed, tenants, clients, process, plant, rate] = parts[..] else {
            panic!("a child spec: {spec}")
        };
        let tenants = (tenants.split(','))
            .map(|t| {
                let (weight, guarantee) = t.split_once(':').unwrap();
                TenantSpec {
                    weight: weight.parse().unwrap(),
                    guarantee: guarantee.parse().unwrap(),
                }
            })
            .collect();
        let clients = (clients.split(','))
            .map(|c| c.split(':').map(|n| n.parse().unwrap()).collect())
            .collect();
        Some(Self {
            url: url.to_owned(),
            key: key.to_owned(),
            mode: Mode::parse(mode),
            case: Case {
                seed: seed.parse().unwrap(),
                tenants,
                clients,
            },
            process: process.parse().unwrap(),
            plant: plant == "true",
            rate: rate.parse().unwrap(),
        })
    }
}

/// The child's life, given its budget (connected by the store's test): serves its clients,
/// printing `A <tenant> <micros> <tokens>` per admission; reads `idle <tenant>` and
/// `busy <tenant>` on its stdin, and exits when it closes.
pub async fn child(budget: Budget, spec: Spec) {
    let budget = match spec.plant {
        true => budget,
        false => budget
            .with_tenant_tree(spec.case.tree())
            .expect("a valid tree"),
    };
    let idle: Arc<Vec<AtomicBool>> = Arc::new(
        (0..spec.case.tenants.len())
            .map(|_| AtomicBool::new(false))
            .collect(),
    );
    // Admissions go to a thread that writes them: a client never blocks on the pipe.
    let (out, admissions) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        let mut stdout = std::io::BufWriter::new(std::io::stdout());
        while let Ok(line) = admissions.recv() {
            let _ = writeln!(stdout, "{line}");
            while let Ok(line) = admissions.try_recv() {
                let _ = writeln!(stdout, "{line}");
            }
            let _ = stdout.flush();
        }
    });
    let mut tasks = Vec::new();
    for (t, &count) in spec.case.clients[spec.process].iter().enumerate() {
        for c in 0..count {
            let (budget, idle, out, plant) =
                (budget.clone(), idle.clone(), out.clone(), spec.plant);
            let mut rng =
                fastrand::Rng::with_seed(spec.case.seed ^ ((t as u64) << 32) ^ u64::from(c));
            tasks.push(tokio::spawn(async move {
                loop {
                    if idle[t].load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        continue;
                    }
                    let tokens = SIZES[rng.usize(0..SIZES.len())];
                    let reserve = budget.reserve(Cost::new(tokens, 0));
                    let admitted = match plant {
                        true => reserve.await,
                        false => reserve.tenant(tenant(t)).await,
                    };
                    let Ok(mut reservation) = admitted else {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        continue;
                    };
                    let at = micros();
                    reservation.mark_sent();
                    reservation.charge_estimate();
                    let _ = out.send(format!("A {t} {at} {tokens}"));
                }
            }));
        }
    }
    let _ = out.send("ready".to_owned());
    let (lines, mut commands) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    while let Some(line) = commands.recv().await {
        if let Some((what, t)) = line.split_once(' ') {
            if let Ok(t) = t.parse::<usize>() {
                idle[t].store(what == "idle", Ordering::Relaxed);
            }
        }
    }
    for task in tasks {
        task.abort();
    }
    drop(budget);
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Every admission the children logged: tenant, process, micros, tokens.
type Log = Arc<Mutex<Vec<(usize, usize, u64, u64)>>>;

/// A child process serving its clients.
struct Process {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Process {
    fn spawn(test: &str, spec: &Spec, log: &Log) -> Self {
        let (log, process) = (log.clone(), spec.process);
        let mut child = spawn_child(test, (CHILD, &spec.encode()), move |[t, at, tokens]| {
            let entry = (
                t.parse().unwrap(),
                process,
                at.parse().unwrap(),
                tokens.parse().unwrap(),
            );
            log.lock().unwrap().push(entry);
        });
        let stdin = child.stdin.take();
        Self { child, stdin }
    }

    fn tell(&mut self, line: &str) {
        if let Some(stdin) = &mut self.stdin {
            let _ = writeln!(stdin, "{line}");
            let _ = stdin.flush();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The shares of the tokens `log` admitted between `from` and `to` (micros).
fn shares(log: &Log, case: &Case, (from, to): (u64, u64), expected: Vec<f64>) -> Shares {
    let mut by = vec![0u64; case.tenants.len()];
    let mut cells = vec![vec![0u64; case.tenants.len()]; case.clients.len()];
    for &(t, p, at, tokens) in log.lock().unwrap().iter() {
        if at >= from && at < to {
            by[t] += tokens;
            cells[p][t] += tokens;
        }
    }
    let tokens: u64 = by.iter().sum();
    let share = |b: &u64| *b as f64 / tokens.max(1) as f64;
    Shares {
        measured: by.iter().map(share).collect(),
        by_process: (cells.iter())
            .map(|row| row.iter().map(share).collect())
            .collect(),
        expected,
        tokens,
    }
}

/// A store under test: where its children connect, and the test that is their entry point.
pub trait FairStore {
    /// The store's URL.
    fn url(&self) -> String;
    /// The calling test binary's child entry point (`module::fair_child`).
    fn child_test(&self) -> &'static str;
    /// The account's tokens a second in `mode`: low enough that the account binds, not the
    /// store's round trips (asking per admission, every admission is one).
    fn rate(&self, mode: Mode) -> u64 {
        let _ = mode;
        RATE
    }
}

/// What a case measured: while everyone is backlogged, after a process was killed and
/// replaced, and once an idle tenant came back.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Everyone backlogged.
    pub steady: Shares,
    /// After a process was SIGKILLed and replaced.
    pub replaced: Option<Shares>,
    /// From two refreshes after a tenant came back from idle.
    pub reclaimed: Option<Shares>,
}

/// Runs `case` in `mode` on `store`: the steady shares over `measure` after a second's warm-up,
/// then (with `churn`) a process killed and replaced, and a tenant idle and back.
pub fn run_case(
    store: &impl FairStore,
    case: &Case,
    mode: Mode,
    (measure, churn, plant): (Duration, bool, bool),
) -> Outcome {
    let key = format!("fair-{}-{}-{plant}", case.seed, mode.as_str());
    let log: Log = Arc::default();
    let spec = |process| Spec {
        url: store.url(),
        key: key.clone(),
        mode,
        case: case.clone(),
        process,
        plant,
        rate: store.rate(mode),
    };
    let mut processes: Vec<Process> = (0..case.clients.len())
        .map(|p| Process::spawn(store.child_test(), &spec(p), &log))
        .collect();
    let n = case.tenants.len();
    let everyone = vec![true; n];
    let warm = Duration::from_secs(1);
    let window = |from: u64| (from, from + measure.as_micros() as u64);
    let from = micros() + warm.as_micros() as u64;
    std::thread::sleep(warm + measure);
    let steady = shares(&log, case, window(from), case.reference(&everyone));
    if !churn {
        return Outcome {
            steady,
            replaced: None,
            reclaimed: None,
        };
    }
    // A process killed and replaced by one with the same clients: measured from a warm-up
    // after the replacement's first answer (on a busy machine a process starts late: waited
    // on, not slept).
    let victim = fastrand::Rng::with_seed(case.seed).usize(0..processes.len());
    drop(processes.remove(victim));
    let spawned = micros();
    processes.insert(
        victim,
        Process::spawn(store.child_test(), &spec(victim), &log),
    );
    let first = first_answer(&log, spawned, |_, process| process == victim);
    let from = first + warm.as_micros() as u64;
    sleep_until_micros(from + measure.as_micros() as u64);
    let replaced = shares(&log, case, window(from), case.reference(&everyone));
    // A tenant idle for a second, then back.
    let idle = fastrand::Rng::with_seed(case.seed ^ 1).usize(0..n);
    for process in &mut processes {
        process.tell(&format!("idle {idle}"));
    }
    std::thread::sleep(warm);
    let told = micros();
    for process in &mut processes {
        process.tell(&format!("busy {idle}"));
    }
    // Its share over two seconds from two refreshes after its first answer back.
    let first = first_answer(&log, told, |tenant, _| tenant == idle);
    let from = first + 2 * REFRESH.as_micros() as u64;
    let back = Duration::from_secs(2);
    sleep_until_micros(from + back.as_micros() as u64);
    let reclaimed = shares(
        &log,
        case,
        (from, from + back.as_micros() as u64),
        case.reference(&everyone),
    );
    Outcome {
        steady,
        replaced: Some(replaced),
        reclaimed: Some(reclaimed),
    }
}

/// When the first answer logged from `since` on that `of(tenant, process)` picks came (in
/// [`micros`]), waited for up to a minute.
fn first_answer(log: &Log, since: u64, of: impl Fn(usize, usize) -> bool) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let first = (log.lock().unwrap().iter())
            .filter(|&&(tenant, process, at, _)| at >= since && of(tenant, process))
            .map(|&(_, _, at, _)| at)
            .min();
        if let Some(at) = first {
            return at;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no answer within a minute"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sleeps until [`micros`] reads `at`.
fn sleep_until_micros(at: u64) {
    let now = micros();
    if at > now {
        std::thread::sleep(Duration::from_micros(at - now));
    }
}

/// The first seed of a run unless `FAIR_SEED` says: a fixed sample, so that a run of the
/// default cases checks the same topologies every time (the figures run many more, from
/// other seeds).
const SEED: u64 = 1_000;

/// How many cases a run checks (`FAIR_CASES`, else `default`), from which seed (`FAIR_SEED`:
/// a number, or `random`; else 1,000), and how long each window is (`FAIR_SECONDS`, else
/// 3).
pub fn cases(default: u64) -> (Vec<Case>, Duration) {
    let count: u64 = std::env::var("FAIR_CASES").map_or(default, |c| c.parse().unwrap());
    let first: u64 = match std::env::var("FAIR_SEED").as_deref() {
        Ok("random") => fastrand::u64(..),
        Ok(seed) => seed.parse().unwrap(),
        Err(_) => SEED,
    };
    let seconds: f64 = std::env::var("FAIR_SECONDS").map_or(3.0, |s| s.parse().unwrap());
    let cases = (0..count)
        .map(|i| Case::generate(first.wrapping_add(i)))
        .collect();
    (cases, Duration::from_secs_f64(seconds))
}

/// The generated cases in `mode` on `store`, with churn: every window within 3 points of the
/// reference and Jain's index at least 0.99 among equal weights. Prints each case's worst
/// deviation, and the run's.
pub fn generated_cases_divide_fairly(store: &impl FairStore, mode: Mode, default: u64) {
    let (cases, measure) = cases(default);
    let churn = std::env::var("FAIR_CHURN").map_or(true, |c| c != "0");
    let mut worst = 0.0f64;
    let mut failures = Vec::new();
    for case in &cases {
        let outcome = run_case(store, case, mode, (measure, churn, false));
        let windows = [
            Some(("steady", &outcome.steady)),
            outcome.replaced.as_ref().map(|s| ("a process replaced", s)),
            outcome
                .reclaimed
                .as_ref()
                .map(|s| ("an idle tenant back", s)),
        ];
        for (what, shares) in windows.into_iter().flatten() {
            worst = worst.max(shares.worst());
            println!(
                "{} seed {} {what}: worst {:.2} points, Jain {:.4}, {} tokens; by process {:.3?}",
                mode.as_str(),
                case.seed,
                shares.worst(),
                shares.jain(case),
                shares.tokens,
                shares.by_process
            );
            if let Err(failure) = shares.check(case, 3.0, what) {
                failures.push(failure);
            }
        }
    }
    println!(
        "{} cases {}: worst deviation {worst:.2} points",
        cases.len(),
        mode.as_str()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// What the division by tenant costs in throughput, in `mode`: for each case (as
/// [`generated_cases_divide_fairly`] draws them), the tokens the fleet admits in the steady
/// window with its tenants divided, over what the same fleet admits when its requests carry
/// no tenant (one flow, as the planted violation runs), side by side in one run. Prints each
/// ratio and the lowest.
pub fn fairness_costs_in_throughput(store: &impl FairStore, mode: Mode, default: u64) {
    let (cases, measure) = cases(default);
    let mut lowest = f64::INFINITY;
    for case in &cases {
        let divided = run_case(store, case, mode, (measure, false, false)).steady;
        let one_flow = run_case(store, case, mode, (measure, false, true)).steady;
        let ratio = divided.tokens as f64 / one_flow.tokens.max(1) as f64;
        lowest = lowest.min(ratio);
        println!(
            "{} seed {}: {} tokens divided by tenant, {} as one flow: {ratio:.3}",
            mode.as_str(),
            case.seed,
            divided.tokens,
            one_flow.tokens
        );
    }
    println!(
        "{} cases {}: throughput divided over one flow, lowest {lowest:.3}",
        cases.len(),
        mode.as_str()
    );
}

/// The oracle on a planted violation: children whose requests carry no tenant divide the
/// account by process, not by tenant. Tenants of weights 3 and 1, each on a process of its
/// own, get about half each that way where the reference is 75 / 25: the check must fail.
pub fn planted_violation_is_caught(store: &impl FairStore, mode: Mode) {
    let case = Case {
        seed: 7,
        tenants: vec![
            TenantSpec {
                weight: 3,
                guarantee: 0.0,
            },
            TenantSpec {
                weight: 1,
                guarantee: 0.0,
            },
        ],
        clients: vec![vec![8, 0], vec![0, 8]],
    };
    let measure = Duration::from_secs(2);
    let planted = run_case(store, &case, mode, (measure, false, true));
    println!("planted: {:?}", planted.steady);
    assert!(
        planted.steady.check(&case, 3.0, "planted").is_err(),
        "the oracle missed a planted violation: {:?}",
        planted.steady
    );
}

/// Held by each of the suite's tests while it runs: their shares are timed, so they run one
/// at a time (and in a test binary of their own, away from the store's other tests).
pub fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ALONE: Mutex<()> = Mutex::new(());
    ALONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The suite's tests for a store, in the calling test binary (one of their own): the
/// children's entry point
/// (`fair_child`, which [`FairStore::child_test`] names), the generated cases in each mode
/// (`$cases` of them unless `FAIR_CASES` says), and the planted violation. `$connect(url, key,
/// quota, leased)` connects a child's budget, leasing every [`REFRESH`] when `leased`.
///
/// ```ignore
/// tower_llm_quota_test_support::fair_tests!(Store::start(), connect, cases = 2);
/// ```
#[macro_export]
macro_rules! fair_tests {
    ($start:expr, $connect:path, cases = $cases:expr) => {
        /// The entry point of the children: does nothing unless started as one.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn fair_child() {
            use $crate::fair_suite::{Mode, Spec};
            if let Some(spec) = Spec::of_child() {
                let leased = spec.mode == Mode::Leased;
                let budget = loop {
                    match $connect(&spec.url, &spec.key, &spec.quota(), leased).await {
                        Ok(budget) => break budget,
                        Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
                    }
                };
                $crate::fair_suite::child(budget, spec).await;
            }
        }

        #[test]
        #[ignore = "asking per admission, tenants are not yet within 3 points over a fleet"]
        fn generated_cases_divide_fairly_per_admission() {
            let _alone = $crate::fair_suite::alone();
            $crate::fair_suite::generated_cases_divide_fairly(
                &$start,
                $crate::fair_suite::Mode::PerAdmission,
                $cases,
            );
        }

        #[test]
        fn generated_cases_divide_fairly_leased() {
            let _alone = $crate::fair_suite::alone();
            $crate::fair_suite::generated_cases_divide_fairly(
                &$start,
                $crate::fair_suite::Mode::Leased,
                $cases,
            );
        }

        #[test]
        #[ignore = "a figure: run it with --ignored --nocapture (FAIR_CASES cases a mode)"]
        fn what_fairness_costs_in_throughput() {
            let _alone = $crate::fair_suite::alone();
            for mode in [
                $crate::fair_suite::Mode::Leased,
                $crate::fair_suite::Mode::PerAdmission,
            ] {
                $crate::fair_suite::fairness_costs_in_throughput(&$start, mode, $cases);
            }
        }

        #[test]
        fn the_fairness_oracle_catches_a_planted_violation() {
            let _alone = $crate::fair_suite::alone();
            $crate::fair_suite::planted_violation_is_caught(
                &$start,
                $crate::fair_suite::Mode::Leased,
            );
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(weight: u32, guarantee: f64) -> TenantSpec {
        TenantSpec { weight, guarantee }
    }

    #[test]
    fn the_reference_divides_by_weight_lifted_to_guarantees() {
        let shares = reference(&[spec(1, 0.0), spec(3, 0.0)], &[true, true]);
        assert!((shares[0] - 0.25).abs() < 1e-9 && (shares[1] - 0.75).abs() < 1e-9);
        // A guarantee of 60 % over a weighted 25 %: lifted, the other gets the rest.
        let shares = reference(&[spec(1, 0.6), spec(3, 0.0)], &[true, true]);
        assert!((shares[0] - 0.6).abs() < 1e-9 && (shares[1] - 0.4).abs() < 1e-9);
        // An idle tenant gets nothing; the others share all.
        let shares = reference(
            &[spec(1, 0.3), spec(1, 0.0), spec(2, 0.0)],
            &[false, true, true],
        );
        assert!(shares[0] == 0.0 && (shares[1] - 1.0 / 3.0).abs() < 1e-9);
        // A guarantee below the weighted part changes nothing.
        let shares = reference(&[spec(3, 0.1), spec(1, 0.0)], &[true, true]);
        assert!((shares[0] - 0.75).abs() < 1e-9);
    }

    #[test]
    fn jain_is_one_when_equal_and_low_when_one_takes_all() {
        assert!((jain(&[1.0, 1.0, 1.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[1.0, 0.0]) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn a_case_places_every_tenant_and_spreads_clients() {
        for seed in 0..200 {
            let case = Case::generate(seed);
            assert!((2..=4).contains(&case.tenants.len()));
            assert!((2..=4).contains(&case.clients.len()));
            for t in 0..case.tenants.len() {
                assert!(case.clients.iter().any(|p| p[t] > 0), "{case:?}");
            }
            let guaranteed: f64 = case.tenants.iter().map(|t| t.guarantee).sum();
            assert!(guaranteed <= 0.6 + 1e-9);
        }
    }

    #[test]
    fn the_check_fails_beyond_three_points() {
        let case = Case::generate(1);
        let n = case.tenants.len();
        let expected = case.reference(&vec![true; n]);
        let mut measured = expected.clone();
        measured[0] += 0.04;
        measured[1] -= 0.04;
        let shares = Shares {
            measured,
            expected,
            by_process: Vec::new(),
            tokens: 1,
        };
        assert!(shares.check(&case, 3.0, "planted").is_err());
    }
}
