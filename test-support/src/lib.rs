//! What the workspace's tests share: budgets and limits in a line, a service counting its
//! readiness polls, the simulated provider on a loopback port, a private `redis-server` (or
//! Redis Cluster) on a port of its own, a database of its own or a private Postgres cluster, a
//! loopback proxy that holds replies back or cuts connections, and the batch example's
//! binary; the suites every quota store must pass (and every store that leases), the plain models
//! their atomic calls are checked against, and the
//! benchmarks every shared store runs. Not published.

pub mod bench;
pub mod fair_suite;
pub mod fleet_suite;
pub mod loopback_proxy;
pub mod port;
pub mod postgres_server;
pub mod redis_server;
pub mod store_models;
pub mod store_suite;

use std::num::NonZeroU64;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use tower_llm_quota::{Budget, Dimension, Limit, Quota};

/// A limit of exactly `amount` per `period` (no headroom), holding `burst` at once.
pub fn limit(dimension: Dimension, amount: u64, period: Duration, burst: u64) -> Limit {
    Limit::new(dimension, NonZeroU64::new(amount).unwrap(), period)
        .unwrap()
        .with_headroom(1.0)
        .unwrap()
        .with_burst(NonZeroU64::new(burst).unwrap())
}

/// A budget over `limits`.
pub fn budget(limits: impl IntoIterator<Item = Limit>) -> Budget {
    Budget::new(limits.into_iter().fold(Quota::new(), Quota::with_limit))
}

/// 10 total tokens per second, 100 at once.
pub fn tokens_10_per_sec() -> Budget {
    budget([limit(
        Dimension::TotalTokens,
        10,
        Duration::from_secs(1),
        100,
    )])
}

/// 10 requests per second (burst 10) and 100 total tokens per second (burst 100).
pub fn requests_and_tokens() -> Budget {
    budget([
        limit(Dimension::Requests, 10, Duration::from_secs(1), 10),
        limit(Dimension::TotalTokens, 100, Duration::from_secs(1), 100),
    ])
}

/// The level of every limit, in the quota's order.
pub fn levels(budget: &Budget) -> Vec<i64> {
    budget
        .snapshot()
        .limits()
        .iter()
        .map(|l| l.level())
        .collect()
}

/// A service wrapper that counts how often its readiness was polled.
#[derive(Clone, Debug)]
pub struct CountReady<S> {
    /// The service wrapped.
    pub inner: S,
    /// How often `poll_ready` was called.
    pub polls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl<S> CountReady<S> {
    /// Wraps `inner`, no poll counted yet.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            polls: Default::default(),
        }
    }

    /// How often `poll_ready` was called so far.
    pub fn polls(&self) -> usize {
        self.polls.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl<S, R> tower::Service<R> for CountReady<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.polls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.inner.call(request)
    }
}

/// A request carrying `cost`.
pub fn request_with(cost: tower_llm_quota::Cost) -> http::Request<&'static str> {
    let mut request = http::Request::new("prompt");
    request.extensions_mut().insert(cost);
    request
}

/// The batch example's binary, built beside the calling test (same profile, same target
/// directory), for tests that run it as separate processes.
///
/// Built for the whole workspace with every feature, as the README's test command builds:
/// the same feature resolution, so the build reuses the core and its dependencies as the test
/// run compiled them (built for one package alone, they would be compiled again, with other
/// features, inside the first test that asks). It runs without the variables Cargo sets for
/// the running test (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`...): build scripts that watch them
/// (ring's does) would run again, and the test run's next build would compile their crates
/// and everything above them once more.
pub fn batch_example() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build.args([
        "build",
        "--quiet",
        "--workspace",
        "--all-features",
        "--example",
        "batch",
    ]);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(set_for_the_test) {
            build.env_remove(name);
        }
    }
    let status = build.status().expect("cargo runs");
    assert!(status.success(), "the example builds");
    let test = std::env::current_exe().unwrap();
    let profile_dir = test.parent().and_then(|deps| deps.parent()).unwrap();
    profile_dir.join("examples").join("batch")
}

/// Whether Cargo sets the variable `name` for the crate it runs (a test), rather than for
/// every build (`CARGO_HOME`, `CARGO_TARGET_DIR`, ... stay).
fn set_for_the_test(name: &str) -> bool {
    const SET: [&str; 8] = [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
    ];
    SET.contains(&name)
        || name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_BIN_EXE_")
        || name == "OUT_DIR"
}

/// `config`'s simulated provider served on a free loopback port: the simulator, its server
/// (it stops when dropped) and its chat URL.
pub async fn serve_chat(
    config: tower_llm_quota_sim::SimConfig,
) -> (
    tower_llm_quota_sim::Simulator,
    tower_llm_quota_sim::SimServer,
    String,
) {
    let simulator = tower_llm_quota_sim::Simulator::new(config);
    let server = simulator
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let url = format!("{}/v1/chat/completions", server.url());
    (simulator, server, url)
}
