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
use tower_llm_quota::sim::{SimConfig, Simulator};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_share_one_quota_through_redis() {
    let binary = support::batch_example();
    let redis = RedisServer::start();
    let simulator = Simulator::new(
        SimConfig::openai(RPM, TPM)
            .minute(MINUTE)
            .latency(Duration::from_millis(40), Duration::from_micros(300))
            .completion_share(0.9, 1.0)
            .seed(11),
    );
    let server = simulator
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let url = format!("{}/v1/chat/completions", server.url());
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
        let output = tokio::task::spawn_blocking(move || child.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        assert!(
            output.status.success(),
            "a process failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
        let governed = report.get("governed").unwrap_or(&report);
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
