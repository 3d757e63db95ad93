//! Four processes of the main example share one quota through Redis, against one simulated
//! provider over HTTP, with a demand far above the quota: the provider never answers 429, no
//! window of its quota holds more than the quota, and the shared quota is used almost fully.
//!
//! The processes run `examples/batch` with `--url` (the simulator, served by this test) and
//! `--redis-url` (a private `redis-server`), exactly as a user would start them side by side.

mod redis_server;
mod support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use redis_server::RedisServer;
use tower_llm_quota::Dimension;
use tower_llm_quota::sim::{SimConfig, SimServer, Simulator};

const PROCESSES: usize = 4;
/// Tickets per process: about 850 tokens each, 4 x 40 x 850 = 136,000 tokens against 40,000
/// a "minute" of 2 s: all wanted at once, more than five windows of work.
const ITEMS: usize = 40;
const RPM: u64 = 300;
const TPM: u64 = 40_000;
const MINUTE: Duration = Duration::from_secs(2);
/// Plans for 95 % of the quota, with bursts of 4 % of that (the largest estimate fits):
/// the busiest window holds at most 98.8 % of the quota plus the refunds of the few calls in
/// flight when it opens.
const HEADROOM: &str = "0.95";
const BURST: &str = "0.04";

/// The tests measure real time on two cores: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_share_one_quota_through_redis() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let binary = support::batch_example();
    let redis = RedisServer::start();
    let (simulator, _server, url) = served_simulator(11).await;
    let reports = tempdir();

    let children: Vec<_> = (0..PROCESSES)
        .map(|i| {
            let report = reports.join(format!("report-{i}.json"));
            let child = Command::new(&binary)
                .args(["--url", &url, "--api-key-env", "SIM_API_KEY"])
                .args(["--redis-url", &redis.url(), "--quota-key", "shared-account"])
                .args(["--instances", &PROCESSES.to_string()])
                .args(["--rpm", &RPM.to_string(), "--tpm", &TPM.to_string()])
                .args(["--minute-ms", &MINUTE.as_millis().to_string()])
                .args(["--headroom", HEADROOM, "--burst", BURST])
                .args([
                    "--items",
                    &ITEMS.to_string(),
                    "--seed",
                    &(100 + i).to_string(),
                ])
                .args(["--concurrency", "16", "--governed-only"])
                .arg("--report")
                .arg(&report)
                .env("SIM_API_KEY", "sk-shared")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("the example starts");
            (child, report)
        })
        .collect();
    let mut done = 0;
    for (child, report) in children {
        let governed = governed_report(child, report).await;
        assert_eq!(governed["failed"], 0, "{governed}");
        done += governed["ok"].as_u64().unwrap();
    }

    let stats = simulator.stats();
    let tokens = stats.limit(Dimension::TotalTokens).unwrap();
    let requests = stats.limit(Dimension::Requests).unwrap();
    let used = stats.prompt_tokens + stats.completion_tokens;
    // Utilisation over the busy period: from the first admission to the last.
    let active: Vec<_> = stats
        .series
        .iter()
        .filter(|point| point.requests > 0)
        .collect();
    let busy = active.last().unwrap().start - active[0].start + stats.series_interval;
    let utilisation = used as f64 / (TPM as f64 * busy.as_secs_f64() / MINUTE.as_secs_f64());
    println!(
        "{PROCESSES} processes: {done} items, {} provider 429s, busiest window {} tokens of {} \
         and {} requests of {}, utilisation {:.1} % over {busy:?}",
        stats.rate_limited,
        tokens.max_in_window,
        tokens.amount,
        requests.max_in_window,
        requests.amount,
        utilisation * 100.0
    );
    assert_eq!(done, (PROCESSES * ITEMS) as u64, "every item done");
    assert_eq!(stats.rate_limited, 0, "no provider 429");
    assert!(
        tokens.max_in_window <= TPM,
        "{} tokens in one window",
        tokens.max_in_window
    );
    assert!(requests.max_in_window <= RPM);
    // The processes take turns at the store: with a burst of 4 % of the quota, each turn's
    // hand-over leaves a little of it idle (94.8 % before, when one process could take every
    // refill; 91.8-92.6 % with turns).
    assert!(utilisation >= 0.91, "utilisation {utilisation}");
}

/// One process of the main example with the crate's defaults against the simulator over
/// HTTP: it spends the provider's initial bucket (a whole "minute") as soon as the headers
/// show it, and finishes near the bound that allows (the work beyond that minute at the
/// rate), with no provider 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_spends_the_burst_the_provider_reports() {
    const ITEMS: usize = 200;
    let _alone = ONE_AT_A_TIME.lock().await;
    let binary = support::batch_example();
    let (simulator, _server, url) = served_simulator(12).await;
    let report = tempdir().join("report.json");
    let child = Command::new(&binary)
        .args(["--url", &url, "--api-key-env", "SIM_API_KEY"])
        .args(["--rpm", &RPM.to_string(), "--tpm", &TPM.to_string()])
        .args(["--minute-ms", &MINUTE.as_millis().to_string()])
        .args(["--items", &ITEMS.to_string(), "--governed-only"])
        .arg("--report")
        .arg(&report)
        .env("SIM_API_KEY", "sk-alone")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the example starts");
    let governed = governed_report(child, report).await;
    let (wall, bound, minimum) = (
        governed["wall_ms"].as_f64().unwrap(),
        governed["bound_ms"].as_f64().unwrap(),
        governed["theoretical_min_ms"].as_f64().unwrap(),
    );
    println!(
        "one process over HTTP, defaults: {} items, {} provider 429s, wall {:.0} ms = {:.3} × \
         the bound with the provider's full bucket ({bound:.0} ms), {:.3} × total / rate",
        governed["ok"],
        simulator.stats().rate_limited,
        wall,
        wall / bound,
        wall / minimum
    );
    assert_eq!(governed["failed"], 0, "{governed}");
    assert_eq!(simulator.stats().rate_limited, 0, "no provider 429");
    // Real time on a shared machine: a margin of a tenth, where the bound is several seconds.
    assert!(
        wall <= 1.1 * bound,
        "wall {wall} ms against a bound of {bound} ms"
    );
}

/// The simulated provider of these tests, served on a free loopback port: the simulator, its
/// server (it stops when dropped) and the URL the processes call.
async fn served_simulator(seed: u64) -> (Simulator, SimServer, String) {
    let simulator = Simulator::new(
        SimConfig::openai(RPM, TPM)
            .minute(MINUTE)
            .latency(Duration::from_millis(40), Duration::from_micros(300))
            .completion_share(0.9, 1.0)
            .seed(seed),
    );
    let server = simulator
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let url = format!("{}/v1/chat/completions", server.url());
    (simulator, server, url)
}

/// Waits for a process of the example, which must succeed, and reads its governed run's
/// figures from its JSON report.
async fn governed_report(child: std::process::Child, report: PathBuf) -> serde_json::Value {
    let output = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        output.status.success(),
        "a process failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    match report.get_mut("governed") {
        Some(governed) => governed.take(),
        None => report,
    }
}

/// A fresh directory for the reports.
fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tower-llm-quota-multi-process-{}-{}",
        std::process::id(),
        fastrand::u64(..)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
