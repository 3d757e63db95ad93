//! Durable batch jobs survive a worker killed mid-run: 500 jobs (apalis) in a private
//! `redis-server`, or in a Postgres database of their own, two worker processes of the batch
//! example sharing one quota (in the same store) against the simulator over HTTP, one killed
//! with SIGKILL and restarted. Every job completes exactly once (the simulator bills no
//! idempotency key twice), nothing is lost, the provider never answers 429, the jobs that can
//! never succeed are dead with their error, and those whose call failed transiently (injected
//! 5xx, one attempt per call) were rescheduled and done later.

use tower_llm_quota_test_support as support;
use tower_llm_quota_test_support::redis_server;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use redis_server::RedisServer;
use tower_llm_quota_sim::{Faults, GroupFaults, SimConfig, Simulator};
use tower_llm_quota_test_support::postgres_server::TestDatabase;

const JOBS: usize = 500;
/// Jobs whose `max_tokens` no quota can ever pay: permanent failures.
const POISONED: usize = 5;
const RPM: u64 = 3_000;
const TPM: u64 = 20_000;
const MINUTE: Duration = Duration::from_secs(1);
const QUEUE: &str = "tickets";
/// The worker killed once this many jobs are done.
const KILL_AFTER: u64 = 120;
const DEADLINE: Duration = Duration::from_secs(50);

/// A fresh directory for the input and the logs.
fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tower-llm-quota-durable-{}-{}",
        std::process::id(),
        fastrand::u64(..)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `jobs` short tickets, of which `poisoned` ask for more output than any quota holds.
fn input(dir: &Path, jobs: usize, poisoned: usize) -> PathBuf {
    let path = dir.join("tickets.jsonl");
    let mut file = std::fs::File::create(&path).unwrap();
    for i in 0..jobs {
        let poisoned = poisoned > 0 && i % (jobs / poisoned) == jobs / poisoned - 1;
        let max_tokens = if poisoned { 5_000_000 } else { 40 };
        let prompt = format!(
            "Ticket {i}: the invoice for order {} was charged twice; please classify this \
             ticket as billing, shipping, account or other, and answer with one word.",
            1_000 + i
        );
        let line = serde_json::json!({
            "id": format!("t{i}"),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "priority": "batch",
        });
        writeln!(file, "{line}").unwrap();
    }
    path
}

/// A child killed when dropped, so that a failed assertion leaves no process behind.
struct Worker(Option<Child>);

impl Worker {
    fn kill(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill(); // SIGKILL
            let _ = child.wait();
        }
    }

    /// Waits for the child to exit by itself (no polling: a blocking wait on a thread of the
    /// runtime's) until `until`; whether it exited with success. Past `until` it is killed.
    async fn wait(&mut self, until: Instant) -> bool {
        let Some(mut child) = self.0.take() else {
            return false;
        };
        let pid = child.id();
        let exited = tokio::task::spawn_blocking(move || child.wait());
        match tokio::time::timeout_at(until.into(), exited).await {
            Ok(status) => status.unwrap().is_ok_and(|status| status.success()),
            Err(_) => {
                // Still running at the deadline: SIGKILL it, so that nothing is left behind.
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
                false
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The batch example in durable mode: `role` (`enqueue` or `work`) as worker `name`, with
/// `args` (separated by spaces) after it, the simulator's key in its environment, its output
/// in `<dir>/<name>.log`.
fn durable(binary: &Path, dir: &Path, role: &str, name: &str, args: &str) -> Worker {
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    let child = Command::new(binary)
        .args(["--durable", "--role", role, "--worker-name", name])
        .args(args.split_whitespace())
        .env("SIM_API_KEY", "sk-durable")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .stdin(Stdio::null())
        .spawn()
        .expect("the example starts");
    Worker(Some(child))
}

/// The processes of one durable run: the example's binary, their directory (each process
/// logs to `<name>.log` there) and their shared arguments.
struct Fleet<'a> {
    binary: &'a Path,
    dir: &'a Path,
    args: &'a str,
}

impl Fleet<'_> {
    /// Starts the process `name` in `role` (`enqueue`, `work`).
    fn start(&self, role: &str, name: &str) -> Worker {
        durable(self.binary, self.dir, role, name, self.args)
    }

    /// What the process `name` has logged so far.
    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default()
    }
}

fn count(redis: &RedisServer, command: &str) -> u64 {
    redis
        .command(command)
        .trim_start_matches(':')
        .parse()
        .unwrap_or(0)
}

/// Where a durable run keeps its jobs (and its quota and idempotency records), as the tests
/// read it.
trait JobStore {
    /// The example's argument naming the store.
    fn arg(&self) -> String;
    /// Jobs of `queue` waiting for a worker.
    fn queued(&self, queue: &str) -> u64;
    /// Jobs of `queue` done.
    fn done(&self, queue: &str) -> u64;
    /// Jobs of `queue` dead.
    fn dead(&self, queue: &str) -> u64;
    /// Every ended job of `queue`: whether it is done, the result apalis stored, and how
    /// many attempts it took.
    fn ended(&self, queue: &str) -> Vec<(bool, serde_json::Value, u64)>;
}

impl JobStore for RedisServer {
    fn arg(&self) -> String {
        format!("--redis-url {}", self.url())
    }

    fn queued(&self, queue: &str) -> u64 {
        count(self, &format!("LLEN {queue}:active"))
            + count(self, &format!("ZCARD {queue}:scheduled"))
    }

    fn done(&self, queue: &str) -> u64 {
        count(self, &format!("SCARD {queue}:done"))
    }

    fn dead(&self, queue: &str) -> u64 {
        count(self, &format!("SCARD {queue}:dead"))
    }

    fn ended(&self, queue: &str) -> Vec<(bool, serde_json::Value, u64)> {
        let mut conn = redis::Client::open(self.url())
            .unwrap()
            .get_connection()
            .unwrap();
        let mut ended = Vec::new();
        for (set, done) in [("done", true), ("dead", false)] {
            let ids: Vec<String> = redis::cmd("SMEMBERS")
                .arg(format!("{queue}:{set}"))
                .query(&mut conn)
                .unwrap();
            for id in ids {
                let mut meta = |field: &str| -> String {
                    redis::cmd("HGET")
                        .arg(format!("{queue}:meta:{id}"))
                        .arg(field)
                        .query(&mut conn)
                        .unwrap()
                };
                let result = serde_json::from_str(&meta("result")).unwrap();
                let attempts = meta("attempts").parse().unwrap();
                ended.push((done, result, attempts));
            }
        }
        ended
    }
}

impl JobStore for TestDatabase {
    fn arg(&self) -> String {
        format!("--postgres-url {}", self.url())
    }

    fn queued(&self, queue: &str) -> u64 {
        let sql = format!(
            "SELECT count(*) FROM apalis.jobs WHERE job_type = '{queue}' AND status = 'Pending'"
        );
        self.psql(&sql).parse().unwrap_or(0)
    }

    fn done(&self, queue: &str) -> u64 {
        let sql = format!(
            "SELECT count(*) FROM apalis.jobs WHERE job_type = '{queue}' AND status = 'Done'"
        );
        self.psql(&sql).parse().unwrap_or(0)
    }

    fn dead(&self, queue: &str) -> u64 {
        let sql = format!(
            "SELECT count(*) FROM apalis.jobs WHERE job_type = '{queue}' AND (status = 'Killed' \
             OR (status = 'Failed' AND attempts >= max_attempts))"
        );
        self.psql(&sql).parse().unwrap_or(0)
    }

    fn ended(&self, queue: &str) -> Vec<(bool, serde_json::Value, u64)> {
        let sql = format!(
            "SELECT json_build_array(status = 'Done', last_result, attempts) FROM apalis.jobs \
             WHERE job_type = '{queue}' AND status IN ('Done', 'Killed', 'Failed')"
        );
        self.psql(&sql)
            .lines()
            .map(|line| {
                let row: serde_json::Value = serde_json::from_str(line).unwrap();
                (
                    row[0].as_bool().unwrap(),
                    row[1].clone(),
                    row[2].as_u64().unwrap(),
                )
            })
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_in_redis_survive_a_worker_killed_mid_run_and_none_is_billed_twice() {
    jobs_survive_a_worker_killed_mid_run_and_none_is_billed_twice(&RedisServer::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_in_postgres_survive_a_worker_killed_mid_run_and_none_is_billed_twice() {
    jobs_survive_a_worker_killed_mid_run_and_none_is_billed_twice(&TestDatabase::create()).await;
}

async fn jobs_survive_a_worker_killed_mid_run_and_none_is_billed_twice(store: &impl JobStore) {
    let binary = support::batch_example();
    let (simulator, _server, url) = support::serve_chat(
        SimConfig::openai(RPM, TPM)
            .minute(MINUTE)
            .latency(Duration::from_millis(20), Duration::from_micros(500))
            .honour_idempotency_keys(Duration::from_secs(600))
            .faults(Faults::none().server_errors(0.05))
            .seed(5),
    )
    .await;
    let dir = tempdir();
    let input = input(&dir, JOBS, POISONED);
    let args = format!(
        "--queue {QUEUE} --lease-ms 2000 --heartbeat-secs 1 --instances 2 --concurrency 16 \
         --retry-attempts 1 --rpm {RPM} --tpm {TPM} --minute-ms {} --quota-key shared \
         --url {url} --api-key-env SIM_API_KEY {} --input {}",
        MINUTE.as_millis(),
        store.arg(),
        input.display()
    );
    let fleet = Fleet {
        binary: &binary,
        dir: &dir,
        args: &args,
    };
    let start = |role: &str, name: &str| fleet.start(role, name);
    let log = |name: &str| fleet.log(name);

    let began = Instant::now();
    let deadline = began + DEADLINE;
    {
        let mut enqueue = start("enqueue", "enqueuer");
        assert!(
            enqueue.wait(deadline).await,
            "enqueue failed: {}",
            log("enqueuer")
        );
        assert_eq!(store.queued(QUEUE), JOBS as u64);

        let mut first = start("work", "w1");
        let mut second = start("work", "w2");
        // Kill the first mid-run: another process's progress, read from the store every 20 ms.
        while store.done(QUEUE) < KILL_AFTER {
            assert!(Instant::now() < deadline, "no progress: {}", log("w1"));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        first.kill();
        let done_at_kill = store.done(QUEUE);
        assert!(
            done_at_kill < (JOBS - POISONED) as u64,
            "killed mid-run, not after it ({done_at_kill} done)"
        );
        // Restarted under another name; the dead worker's jobs are re-enqueued once its
        // heartbeats have stopped.
        let mut restarted = start("work", "w1-restarted");
        assert!(second.wait(deadline).await, "w2 failed: {}", log("w2"));
        assert!(
            restarted.wait(deadline).await,
            "the restarted worker failed: {}",
            log("w1-restarted")
        );
        println!(
            "{JOBS} jobs, worker killed at {done_at_kill} done, all settled in {:?}",
            began.elapsed()
        );
    }

    // Nothing lost: every job done or dead.
    let (done, dead) = (store.done(QUEUE), store.dead(QUEUE));
    assert_eq!((done, dead), ((JOBS - POISONED) as u64, POISONED as u64));
    // Every completed job has its result stored, every dead one its error.
    let mut rescheduled = 0;
    for (done, result, attempts) in store.ended(QUEUE) {
        if done {
            assert!(result["Ok"]["tokens"].as_u64().unwrap() > 0, "{result}");
            rescheduled += u64::from(attempts > 1);
        } else {
            let error = result["Err"].as_str().unwrap_or_default();
            assert!(error.contains("exceeds the capacity"), "{result}");
        }
    }
    // Injected server errors failed some calls: their jobs were rescheduled, then done.
    let server_errors = simulator.stats().server_errors;
    println!("{server_errors} injected server errors, {rescheduled} jobs done after a reschedule");
    assert!(server_errors > 0 && rescheduled > 0);

    // Exactly once at the provider: each job's key billed once, no 429.
    let stats = simulator.stats();
    let keys = simulator.calls_by_idempotency_key();
    let twice: Vec<_> = keys.iter().filter(|&(_, &n)| n > 1).collect();
    println!(
        "provider: {} keys billed, {} billed twice, {} replays of an honoured key, {} 429s",
        keys.len(),
        twice.len(),
        simulator.idempotent_replays(),
        stats.rate_limited
    );
    assert!(twice.is_empty(), "billed twice: {twice:?}");
    assert_eq!(keys.len(), JOBS - POISONED);
    assert_eq!(stats.rate_limited, 0, "no provider 429");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A simulated provider of 10,000 requests and 1,000,000 tokens a (one-second) minute that
/// honours idempotency keys, served over HTTP: the simulator, its server (serving while
/// held) and its chat URL.
async fn simulated(seed: u64) -> (Simulator, tower_llm_quota_sim::SimServer, String) {
    support::serve_chat(
        SimConfig::openai(10_000, 1_000_000)
            .minute(MINUTE)
            .latency(Duration::from_millis(20), Duration::from_micros(500))
            .honour_idempotency_keys(Duration::from_secs(600))
            .seed(seed),
    )
    .await
}

/// The crash: 300 jobs, two workers on one queue and one quota, one SIGKILLed after
/// 4 s and not restarted. With the default lease (two heartbeats, renewed while a call is
/// alive) the other finishes within the work left at the quota's rate plus three heartbeats
/// (with a fixed 60 s lease it took 60 s); nothing lost, no key billed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_costs_heartbeats_not_a_lease_in_redis() {
    a_killed_worker_costs_heartbeats_not_a_lease(&RedisServer::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_costs_heartbeats_not_a_lease_in_postgres() {
    a_killed_worker_costs_heartbeats_not_a_lease(&TestDatabase::create()).await;
}

async fn a_killed_worker_costs_heartbeats_not_a_lease(store: &impl JobStore) {
    const CRASH_JOBS: usize = 300;
    /// Requests a second, for both workers together: the rate that binds.
    const RATE: u64 = 20;
    const HEARTBEAT: Duration = Duration::from_secs(1);
    let binary = support::batch_example();
    let (simulator, _server, url) = simulated(7).await;
    let dir = tempdir();
    let input = input(&dir, CRASH_JOBS, 0);
    let args = format!(
        "--queue crash --heartbeat-secs 1 --concurrency 16 --rpm {RATE} --tpm 1000000 \
         --minute-ms 1000 --quota-key crash \
         --url {url} --api-key-env SIM_API_KEY {} --input {}",
        store.arg(),
        input.display()
    );
    let fleet = Fleet {
        binary: &binary,
        dir: &dir,
        args: &args,
    };
    let start = |role: &str, name: &str| fleet.start(role, name);
    let log = |name: &str| fleet.log(name);
    let deadline = Instant::now() + Duration::from_secs(60);
    assert!(
        start("enqueue", "enqueuer").wait(deadline).await,
        "{}",
        log("enqueuer")
    );
    let began = Instant::now();
    let mut first = start("work", "c1");
    let mut second = start("work", "c2");
    tokio::time::sleep(Duration::from_secs(4)).await;
    first.kill();
    let killed = Instant::now();
    let left = CRASH_JOBS as u64 - store.done("crash");
    assert!(second.wait(deadline).await, "c2 failed: {}", log("c2"));
    let took = killed.elapsed();
    let bound = Duration::from_secs_f64(left as f64 / RATE as f64) + HEARTBEAT * 3;
    println!(
        "{CRASH_JOBS} jobs, one worker killed after 4 s with {left} left: the other finished \
         {took:.1?} later, against (work left / rate) + three heartbeats = {bound:.1?} \
         ({:.2}x); {:.1?} in all",
        took.as_secs_f64() / bound.as_secs_f64(),
        began.elapsed()
    );
    assert_eq!(store.done("crash"), CRASH_JOBS as u64);
    let keys = simulator.calls_by_idempotency_key();
    assert_eq!(keys.len(), CRASH_JOBS);
    assert!(keys.values().all(|&n| n == 1), "a key billed twice");
    assert!(
        took <= bound,
        "took {took:?}, bound {bound:?}: {}",
        log("c2")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--durable --group 10`: each worker groups the jobs it holds; each job ends on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_groups_the_jobs_it_holds_and_each_job_ends_on_its_own() {
    const GROUPED_JOBS: usize = 100;
    let binary = support::batch_example();
    let redis = RedisServer::start();
    let (simulator, _server, url) = support::serve_chat(
        SimConfig::openai(RPM, 200_000)
            .minute(MINUTE)
            .latency(Duration::from_millis(20), Duration::from_micros(100))
            .honour_idempotency_keys(Duration::from_secs(600))
            .group_faults(GroupFaults::none().missing(0.05))
            .seed(9),
    )
    .await;
    let dir = tempdir();
    let path = dir.join("tickets.jsonl");
    let mut file = std::fs::File::create(&path).unwrap();
    for i in 0..GROUPED_JOBS {
        let line = serde_json::json!({
            "id": format!("g{i}"),
            "prompt": format!("Ticket {i}: my invoice for order {} is wrong.", 2_000 + i),
            "max_tokens": 40,
            "priority": "batch",
        });
        writeln!(file, "{line}").unwrap();
    }
    drop(file);
    // One Redis call per admission at a fixed 85 %: the budget holds the jobs back, so that
    // the worker holds many at once and groups them (a leased share's whole burst at the
    // start would send the first jobs alone).
    let args = format!(
        "--queue grouped --group 10 --heartbeat-secs 1 --rpm {RPM} --tpm 200000 \
         --minute-ms {} --quota-key grouped --call-per-admission \
         --url {url} --api-key-env SIM_API_KEY --redis-url {} --input {}",
        MINUTE.as_millis(),
        redis.url(),
        path.display()
    );
    let mut worker = durable(&binary, &dir, "both", "grouped", &args);
    let finished = worker.wait(Instant::now() + DEADLINE).await;
    let log = std::fs::read_to_string(dir.join("grouped.log")).unwrap_or_default();
    assert!(finished, "the grouped worker failed: {log}");

    let done = count(&redis, "SCARD grouped:done");
    let dead = count(&redis, "SCARD grouped:dead");
    // Nothing lost: every job done, or dead-lettered with its reason. An item that three
    // answers in a row left out (5 % each, resent alone after the first: about one run in a
    // hundred has one) fails its job, as the planner's `max_attempts` says.
    assert_eq!(done + dead, GROUPED_JOBS as u64, "{log}");
    assert!(
        dead <= 2 && (dead == 0 || log.contains("the answer left the item out")),
        "{dead} dead: {log}"
    );
    let stats = simulator.stats();
    // Groups of up to ten, and the items an answer left out sent again alone.
    assert!(stats.grouped_answers >= 10, "{stats:?}");
    assert!(
        stats.admitted < GROUPED_JOBS as u64 / 2,
        "{} calls for {GROUPED_JOBS} jobs",
        stats.admitted
    );
    assert_eq!(stats.rate_limited, 0);
    let twice: Vec<_> = simulator
        .calls_by_idempotency_key()
        .into_iter()
        .filter(|&(_, n)| n > 1)
        .collect();
    assert!(twice.is_empty(), "a group billed twice: {twice:?}");
    println!(
        "{GROUPED_JOBS} jobs in {} calls ({} grouped answers)",
        stats.admitted, stats.grouped_answers
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A worker taken for dead while alive (its heartbeat late on a stalled machine: another
/// worker's sweep re-enqueues its jobs and unregisters it) registers again and goes on: every
/// job done, none billed twice. Here the sweep is made by hand: the worker is removed from
/// the queue's workers after its first jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_taken_for_dead_registers_again_and_finishes() {
    const LATE_JOBS: usize = 120;
    let binary = support::batch_example();
    let redis = RedisServer::start();
    let (simulator, _server, url) = simulated(11).await;
    let dir = tempdir();
    let input = input(&dir, LATE_JOBS, 0);
    let args = format!(
        "--queue late --heartbeat-secs 1 --concurrency 8 --rpm 30 --tpm 1000000 \
         --minute-ms 1000 --quota-key late \
         --url {url} --api-key-env SIM_API_KEY --redis-url {} --input {}",
        redis.url(),
        input.display()
    );
    let fleet = Fleet {
        binary: &binary,
        dir: &dir,
        args: &args,
    };
    let start = |role: &str, name: &str| fleet.start(role, name);
    let log = |name: &str| fleet.log(name);
    let deadline = Instant::now() + Duration::from_secs(120);
    assert!(
        start("enqueue", "enqueuer").wait(deadline).await,
        "{}",
        log("enqueuer")
    );
    let mut worker = start("work", "w1");
    while count(&redis, "SCARD late:done") < 10 {
        assert!(Instant::now() < deadline, "no job done: {}", log("w1"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // What another worker's sweep does to a worker it takes for dead (apalis's
    // `reenqueue_orphaned`, in one script): its jobs back to the queue, itself unregistered.
    let sweep = "EVAL \"local jobs = redis.call('smembers', KEYS[1]); \
        if #jobs > 0 then redis.call('rpush', KEYS[2], unpack(jobs)); \
        redis.call('del', KEYS[1]) end; redis.call('zrem', KEYS[3], ARGV[1]); \
        return #jobs\" 3 late:inflight:w1 late:active late:workers w1";
    let swept = redis.command(sweep);
    println!("w1 taken for dead: {swept} of its jobs re-enqueued");
    assert!(swept.starts_with(':'), "{swept}");
    assert!(worker.wait(deadline).await, "w1 failed: {}", log("w1"));
    assert!(log("w1").contains("registering again"), "{}", log("w1"));
    assert_eq!(count(&redis, "SCARD late:done"), LATE_JOBS as u64);
    let keys = simulator.calls_by_idempotency_key();
    assert_eq!(keys.len(), LATE_JOBS);
    assert!(keys.values().all(|&n| n == 1), "a key billed twice");
    let _ = std::fs::remove_dir_all(&dir);
}
