//! Load on the gateway example, on loopback, with the simulated provider answering at once.
//!
//! ```sh
//! cargo run --release -p tower-llm-quota-gateway --example gateway_load
//! cargo run --release -p tower-llm-quota-gateway --example gateway_load -- --saturated-secs 30 --phase-secs 10
//! ```
//!
//! One process runs the simulator's HTTP server, the gateway (in front of it, as of a real
//! upstream: one more loopback hop) and the clients, in three parts:
//!
//! 1. **1,000 requests a second**, open loop (at most 256 connections; a request due while
//!    all are busy waits, and its latency counts from when it was due), for `--phase-secs`:
//!    the simulator called directly, then the same requests through the gateway; the
//!    gateway's added latency is the difference of the two at p50 and p99.
//! 2. **the highest sustained rate**: `--workers` clients each sending its next request when
//!    the last one ends, through the gateway (its capacity); then open loop from 1,500
//!    requests a second, 500 more each step, while the gateway keeps up (a p99 within 50 ms,
//!    nothing failed), and the simulator directly at the last rate kept: the added latency
//!    there.
//! 3. **a saturated account** shared by three tenants weighing 3, 2 and 1, each with
//!    `--workers` clients, for `--saturated-secs` after a warm-up of `--warmup-secs`: each
//!    tenant's share of the tokens, against its weight, and the provider's 429s.
//!
//! `GATEWAY_LOAD_TAIL=1` also prints each phase's tail (p90 to the maximum) and every failure.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tower_llm_quota_sim::{SimConfig, Simulator};

use tower_llm_quota_gateway::{Config, Gateway, Persistence, serve};

#[derive(Debug, Parser)]
struct Args {
    /// Seconds of each latency phase.
    #[arg(long, default_value_t = 10)]
    phase_secs: u64,
    /// Concurrent clients of the closed-loop phase, and of each tenant when saturated.
    #[arg(long, default_value_t = 32)]
    workers: usize,
    /// Seconds of the saturated run that are measured.
    #[arg(long, default_value_t = 30)]
    saturated_secs: u64,
    /// Seconds of the saturated run before measuring (the buckets' first burst).
    #[arg(long, default_value_t = 10)]
    warmup_secs: u64,
}

const SIM_KEY: &str = "sk-load";
/// The open-loop clients' connections at most (each request in flight holds one).
const MAX_CONNECTIONS: usize = 256;
/// The p99 (ms) under which the gateway counts as keeping up with an open-loop rate.
const SUSTAINED_P99: f64 = 50.0;
const BODY: &str = r#"{"model":"gpt-4o-mini","max_tokens":100,"messages":[{"role":"user","content":"Classify this support ticket: the invoice total is wrong."}]}"#;

type Http = Client<HttpConnector, Full<Bytes>>;

/// One request and its latency; `None` if it failed or was refused.
async fn call(http: &Http, url: &str, key: &str) -> Option<Duration> {
    let started = Instant::now();
    let request = http::Request::post(url)
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .ok()?;
    let response = match http.request(request).await {
        Ok(response) => response,
        Err(error) => {
            if std::env::var_os("GATEWAY_LOAD_TAIL").is_some() {
                eprintln!("failed: {error:?}");
            }
            return None;
        }
    };
    let status = response.status();
    let body = response.into_body().collect().await.ok()?.to_bytes();
    if status != 200 && std::env::var_os("GATEWAY_LOAD_TAIL").is_some() {
        eprintln!("refused: {status} {}", String::from_utf8_lossy(&body));
    }
    (status == 200).then(|| started.elapsed())
}

/// Latencies at a fixed rate for `secs`, and the failures.
async fn open_loop(
    http: &Http,
    url: &str,
    key: &str,
    rate: u64,
    secs: u64,
) -> (Vec<Duration>, u64) {
    let mut tick = tokio::time::interval(Duration::from_nanos(1_000_000_000 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    // At most this many connections: a request due while all are busy waits for one, and its
    // latency counts from when it was due.
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut tasks = Vec::with_capacity((rate * secs) as usize);
    for _ in 0..rate * secs {
        tick.tick().await;
        let due = Instant::now();
        let (http, url, key) = (http.clone(), url.to_owned(), key.to_owned());
        let connections = connections.clone();
        tasks.push(tokio::spawn(async move {
            let _connection = connections.acquire_owned().await.ok()?;
            let sent = Instant::now();
            call(&http, &url, &key)
                .await
                .map(|latency| latency + (sent - due))
        }));
    }
    collect(tasks).await
}

/// Latencies of `workers` closed-loop clients for `secs`, and the failures.
async fn closed_loop(
    http: &Http,
    url: &str,
    key: &str,
    workers: usize,
    secs: u64,
) -> (Vec<Duration>, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let (http, url, key, stop) =
                (http.clone(), url.to_owned(), key.to_owned(), stop.clone());
            tokio::spawn(async move {
                let mut results = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    results.push(call(&http, &url, &key).await);
                }
                results
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut latencies, mut failures) = (Vec::new(), 0);
    for task in tasks {
        for result in task.await.expect("a client task") {
            match result {
                Some(latency) => latencies.push(latency),
                None => failures += 1,
            }
        }
    }
    (latencies, failures)
}

async fn collect(tasks: Vec<tokio::task::JoinHandle<Option<Duration>>>) -> (Vec<Duration>, u64) {
    let (mut latencies, mut failures) = (Vec::new(), 0);
    for task in tasks {
        match task.await.expect("a request task") {
            Some(latency) => latencies.push(latency),
            None => failures += 1,
        }
    }
    (latencies, failures)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// p50 and p99 of a phase, in milliseconds.
fn summary(mut latencies: Vec<Duration>) -> (f64, f64, usize) {
    latencies.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    if std::env::var_os("GATEWAY_LOAD_TAIL").is_some() {
        let tail = [0.9, 0.95, 0.98, 0.99, 0.999, 1.0]
            .map(|p| format!("{:.2}", ms(percentile(&latencies, p))));
        eprintln!("p90 p95 p98 p99 p99.9 max: {}", tail.join(" "));
    }
    (
        ms(percentile(&latencies, 0.5)),
        ms(percentile(&latencies, 0.99)),
        latencies.len(),
    )
}

/// A gateway in front of `upstream`, one account of `tpm` tokens a minute, three tenants.
fn config(upstream: &str, tpm: u64) -> String {
    format!(
        r#"
        [server]
        admin_token = "load"
        [[accounts]]
        name = "sim"
        base_url = "{upstream}"
        key = "{SIM_KEY}"
        profile = "openai"
        apis = ["chat"]
        quota = {{ requests_per_minute = 10000000, tokens_per_minute = {tpm}, max_in_flight = 256 }}
        [tenants.nodes.a]
        weight = 3
        [tenants.nodes.b]
        weight = 2
        [tenants.nodes.c]
        weight = 1
        [[keys]]
        name = "ka"
        key = "key-a"
        tenant = "a"
        [[keys]]
        name = "kb"
        key = "key-b"
        tenant = "b"
        [[keys]]
        name = "kc"
        key = "key-c"
        tenant = "c"
        "#
    )
}

async fn start(upstream: &str, tpm: u64) -> (Arc<Gateway>, String) {
    let config = Config::from_toml(&config(upstream, tpm)).expect("a valid configuration");
    let gateway = Gateway::new(&config, &Persistence::Memory)
        .await
        .expect("the gateway starts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let url = format!(
        "http://{}/v1/chat/completions",
        listener.local_addr().expect("bound")
    );
    tokio::spawn(serve(gateway.clone(), listener, std::future::pending()));
    (gateway, url)
}

fn simulator(tpm: u64) -> Simulator {
    Simulator::new(
        SimConfig::openai(10_000_000, tpm)
            .latency(Duration::ZERO, Duration::ZERO)
            .key(SIM_KEY, "org"),
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let http: Http = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build_http();

    // 1 and 2: an account that never binds.
    let open = simulator(u64::MAX / 4);
    let upstream = open.serve("127.0.0.1:0".parse()?).await?;
    let direct = format!("{}/v1/chat/completions", upstream.url());
    let (_gateway, through) = start(&upstream.url(), u64::MAX / 4).await;
    println!("| load | path | requests/s | p50 ms | p99 ms | failed |");
    println!("|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for (label, url, key) in [("direct", &direct, SIM_KEY), ("gateway", &through, "key-a")] {
        let (latencies, failed) = open_loop(&http, url, key, 1_000, args.phase_secs).await;
        let (p50, p99, n) = summary(latencies);
        println!(
            "| 1,000/s | {label} | {:.0} | {p50:.3} | {p99:.3} | {failed} |",
            n as f64 / args.phase_secs as f64
        );
        rows.push((p50, p99));
    }
    println!(
        "added at 1,000/s: p50 {:.3} ms, p99 {:.3} ms",
        rows[1].0 - rows[0].0,
        rows[1].1 - rows[0].1
    );
    let (latencies, failed) =
        closed_loop(&http, &through, "key-a", args.workers, args.phase_secs).await;
    let (p50, p99, n) = summary(latencies);
    let highest = n as f64 / args.phase_secs as f64;
    println!(
        "| {} clients, closed loop | gateway | {highest:.0} | {p50:.3} | {p99:.3} | {failed} |",
        args.workers
    );
    // Open loop through the gateway, 500/s more each step, while it keeps up (p99 within
    // SUSTAINED_P99, nothing failed); then the simulator directly at the last rate it kept.
    let mut sustained = None;
    let mut rate = 1_500;
    while (rate as f64) < highest {
        let (latencies, failed) = open_loop(&http, &through, "key-a", rate, args.phase_secs).await;
        let (p50, p99, _) = summary(latencies);
        println!("| {rate}/s | gateway | {rate} | {p50:.3} | {p99:.3} | {failed} |");
        if failed > 0 || p99 > SUSTAINED_P99 {
            break;
        }
        sustained = Some((rate, p50, p99));
        rate += 500;
    }
    if let Some((rate, p50, p99)) = sustained {
        let (latencies, failed) = open_loop(&http, &direct, SIM_KEY, rate, args.phase_secs).await;
        let (direct_p50, direct_p99, _) = summary(latencies);
        println!("| {rate}/s | direct | {rate} | {direct_p50:.3} | {direct_p99:.3} | {failed} |");
        println!(
            "highest sustained through the gateway: {rate}/s (closed loop: {highest:.0}/s); added there: p50 {:.3} ms, p99 {:.3} ms",
            p50 - direct_p50,
            p99 - direct_p99
        );
    }
    upstream.shutdown().await;

    // 3: a saturated account, three tenants.
    let tpm = 1_200_000;
    let busy = simulator(tpm);
    let upstream = busy.serve("127.0.0.1:0".parse()?).await?;
    let (gateway, url) = start(&upstream.url(), tpm).await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for key in ["key-a", "key-b", "key-c"] {
        for _ in 0..args.workers {
            let (http, url, stop) = (http.clone(), url.clone(), stop.clone());
            clients.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    call(&http, &url, key).await;
                }
            }));
        }
    }
    let tokens = |gateway: &Gateway| {
        let status = gateway.status();
        let tenants = status["tenants"].as_array().cloned().unwrap_or_default();
        ["a", "b", "c"].map(|t| {
            let node = tenants.iter().find(|n| n["path"] == t);
            let counts = |name: &str| {
                node.and_then(|n| n["usage"][name].as_u64())
                    .unwrap_or_default()
            };
            (
                counts("input_tokens") + counts("output_tokens"),
                counts("requests"),
                counts("local_refusals"),
            )
        })
    };
    tokio::time::sleep(Duration::from_secs(args.warmup_secs)).await;
    let before = tokens(&gateway);
    let limited_before = busy.stats().rate_limited;
    tokio::time::sleep(Duration::from_secs(args.saturated_secs)).await;
    let after = tokens(&gateway);
    let provider_429s = busy.stats().rate_limited - limited_before;
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await?;
    }
    let spent: Vec<u64> = (0..3).map(|i| after[i].0 - before[i].0).collect();
    let total: u64 = spent.iter().sum();
    println!(
        "\nsaturated account ({tpm} tokens a minute), {} s measured after {} s:",
        args.saturated_secs, args.warmup_secs
    );
    println!("| tenant | weight share | token share | requests | local refusals |");
    println!("|---|---|---|---|---|");
    for (i, (name, weight)) in [("a", 3.0), ("b", 2.0), ("c", 1.0)].into_iter().enumerate() {
        println!(
            "| {name} | {:.1} % | {:.1} % | {} | {} |",
            weight / 6.0 * 100.0,
            spent[i] as f64 / total.max(1) as f64 * 100.0,
            after[i].1 - before[i].1,
            after[i].2 - before[i].2
        );
    }
    println!(
        "tokens a minute admitted: {:.0} of {tpm}; provider 429s: {provider_429s}",
        total as f64 * 60.0 / args.saturated_secs as f64
    );
    upstream.shutdown().await;
    Ok(())
}
