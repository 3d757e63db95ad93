//! Starting the gateway on a loopback port, and calling it.

use std::sync::Arc;

use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use tower_llm_quota_gateway::Config;
use tower_llm_quota_gateway::Persistence;
use tower_llm_quota_gateway::{Gateway, serve};

/// The demo configuration, with a simulator that answers at once.
/// `app` served on a free loopback port, as a fake upstream: its URL.
pub(crate) async fn serve_upstream(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

pub(crate) fn demo() -> String {
    include_str!("../../demo.toml").replace(
        "sim = { base_ms = 40, per_token_ms = 2 }",
        "sim = { base_ms = 0, per_token_ms = 0 }",
    )
}

pub(crate) const ADMIN: &str = "demo-admin-token";
pub(crate) const SEARCH: &str = "demo-key-acme-search";
pub(crate) const REPORTS: &str = "demo-key-acme-reports";
pub(crate) const GLOBEX: &str = "demo-key-globex";

/// A gateway serving on loopback until stopped.
pub(crate) struct Running {
    pub(crate) url: String,
    pub(crate) gateway: Arc<Gateway>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Running {
    /// Starts serving `config` on a free loopback port.
    pub(crate) async fn start(config: &str) -> Self {
        Self::serve(config, &Persistence::Memory).await
    }

    /// Starts serving `config`, its accounts' budgets shared through the Redis at `redis`.
    pub(crate) async fn start_shared(config: &str, redis: &str) -> Self {
        Self::serve(config, &Persistence::Redis(redis.to_owned())).await
    }

    /// Starts serving `config`, its state kept as `persistence` says.
    pub(crate) async fn serve(config: &str, persistence: &Persistence) -> Self {
        // The tests' output stays readable: the audit log only where a test asks for it.
        let mut table: toml::Table = config.parse().expect("TOML");
        let server = table
            .entry("server")
            .or_insert_with(|| toml::Table::new().into());
        if let Some(server) = server.as_table_mut() {
            server.entry("audit_log").or_insert_with(|| "off".into());
        }
        let config = Config::from_toml(&table.to_string()).expect("a valid configuration");
        let gateway = Gateway::new(&config, persistence)
            .await
            .expect("the gateway starts");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(gateway.clone(), listener, async {
            let _ = stopped.await;
        }));
        Self {
            url,
            gateway,
            stop: Some(stop),
            task,
        }
    }

    /// Signals the stop (as SIGTERM does) and returns at once.
    pub(crate) fn signal_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Stops and waits until every connection drained.
    pub(crate) async fn stop(mut self) {
        self.signal_stop();
        (&mut self.task).await.unwrap().unwrap();
    }

    /// `/status.json`, as the status page reads it.
    pub(crate) async fn status(&self) -> Value {
        self.gateway.status()
    }

    /// The status page's row of `account`.
    pub(crate) async fn account(&self, account: &str) -> Value {
        let status = self.status().await;
        let rows = status["accounts"].as_array().unwrap();
        let row = rows.iter().find(|row| row["name"] == account);
        row.unwrap_or_else(|| panic!("no account {account} in {status}"))
            .clone()
    }

    /// What the in-process simulator of `account` saw: received, admitted, rate_limited.
    pub(crate) async fn simulator(&self, account: &str) -> (u64, u64, u64) {
        let row = self.account(account).await;
        let field = |name: &str| row["simulator"][name].as_u64().unwrap();
        (field("received"), field("admitted"), field("rate_limited"))
    }

    /// Today's counts of the tenant node `path` and its subtree, as the status page shows.
    pub(crate) async fn usage(&self, path: &str) -> Value {
        let status = self.status().await;
        let tenants = status["tenants"].as_array().unwrap();
        let node = tenants.iter().find(|node| node["path"] == path);
        node.unwrap_or_else(|| panic!("no tenant {path} in {status}"))["usage"].clone()
    }

    /// `POST` of `body` to `path` with the caller key `key`.
    pub(crate) async fn post(
        &self,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> reqwest::Response {
        let mut request = reqwest::Client::new()
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        request.send().await.unwrap()
    }

    /// An admin call: `method` on `/admin{path}` with a JSON body.
    pub(crate) async fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Value,
    ) -> reqwest::Response {
        reqwest::Client::new()
            .request(method, format!("{}/admin{path}", self.url))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap()
    }

    /// `GET` of `path`, as text.
    pub(crate) async fn get(&self, path: &str) -> (u16, String) {
        let response = reqwest::get(format!("{}{path}", self.url)).await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    }
}

/// A chat completion body of `max_tokens`.
pub(crate) fn chat(max_tokens: u32) -> String {
    format!(
        r#"{{"model":"gpt-4o-mini","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"Hello there"}}]}}"#
    )
}

/// A Messages body of `max_tokens`.
pub(crate) fn messages(max_tokens: u32) -> String {
    format!(
        r#"{{"model":"claude-sonnet","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"Hello there"}}]}}"#
    )
}

/// A response's status and its body as JSON.
pub(crate) async fn json(response: reqwest::Response) -> (u16, Option<String>, Value) {
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.bytes().await.unwrap();
    (
        status,
        retry_after,
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    )
}

/// The gateway binary (`llm-quota-gateway`) in a child process, on a free loopback port,
/// killed on drop.
pub(crate) struct Binary {
    process: std::process::Child,
    pub(crate) url: String,
    config: std::path::PathBuf,
}

impl Binary {
    /// Runs the binary with `config`, under an open-file limit of `open_files` when given.
    pub(crate) fn start(config: &str, open_files: Option<u32>) -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static RUNS: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "llm-quota-gateway-{}-{}.toml",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, config).unwrap();
        let (process, url) = spawn(&path, &[], open_files);
        Self {
            process,
            url,
            config: path,
        }
    }
}

/// Starts the binary with the configuration file `path` and `args`, under an open-file
/// limit of `open_files` when given: the child, and the address it printed.
pub(crate) fn spawn(
    path: &std::path::Path,
    args: &[String],
    open_files: Option<u32>,
) -> (std::process::Child, String) {
    use std::io::BufRead;
    let limit = open_files.map_or_else(String::new, |n| format!("ulimit -n {n} && "));
    let mut process = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{limit}config=\"$1\"; shift; exec \"$0\" --config \"$config\" --listen 127.0.0.1:0 \"$@\""
        ))
        .arg(env!("CARGO_BIN_EXE_llm-quota-gateway"))
        .arg(path)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("the gateway binary starts");
    let stdout = process.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(stdout).lines();
    let url = loop {
        let line = lines
            .next()
            .expect("the gateway prints its address")
            .unwrap();
        if let Some(rest) = line.strip_prefix("gateway listening on ") {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    // Keep reading its output so that it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    (process, url)
}

/// The gateway binary with a configuration file and arguments of its own, stopped and
/// started again at will (its state, in a file beside the configuration by default, kept
/// between its lives).
pub(crate) struct Restartable {
    path: std::path::PathBuf,
    args: Vec<String>,
    process: Option<std::process::Child>,
    pub(crate) url: String,
}

impl Restartable {
    /// Writes `config` to `path` and starts the binary with it and `args`.
    pub(crate) fn start(path: &std::path::Path, config: &str, args: &[String]) -> Self {
        std::fs::write(path, config).unwrap();
        let (process, url) = spawn(path, args, None);
        Self {
            path: path.to_owned(),
            args: args.to_vec(),
            process: Some(process),
            url,
        }
    }

    /// Stops it with `signal` (`-TERM`: a drain; `-KILL`) and waits for its end.
    pub(crate) fn stop(&mut self, signal: &str) {
        let Some(mut process) = self.process.take() else {
            return;
        };
        let sent = std::process::Command::new("kill")
            .args([signal, &process.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let _ = process.wait();
    }

    /// Starts it again (a new address).
    pub(crate) fn restart(&mut self) {
        let (process, url) = spawn(&self.path, &self.args, None);
        self.process = Some(process);
        self.url = url;
    }
}

impl Drop for Restartable {
    fn drop(&mut self) {
        if let Some(mut process) = self.process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
    }
}

impl Binary {
    /// Writes `config` over the binary's configuration file and sends it SIGHUP.
    pub(crate) fn hangup(&self, config: &str) {
        std::fs::write(&self.config, config).unwrap();
        let sent = std::process::Command::new("kill")
            .args(["-HUP", &self.process.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    }

    /// Whether the process still runs.
    pub(crate) fn is_running(&mut self) -> bool {
        self.process.try_wait().unwrap().is_none()
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// A Python that imports `modules` (an official SDK): `SDK_PYTHON` (`.ci/run` sets it to the
/// virtual environment it installs them in, and `SDK_REQUIRED`), else `python3` if it has
/// them. `None` (the test skips) only where `SDK_REQUIRED` is unset.
pub(crate) fn sdk_python(modules: &str) -> Option<String> {
    let candidates = std::env::var("SDK_PYTHON")
        .into_iter()
        .chain(["python3".into()]);
    let found = candidates.into_iter().find(|python| {
        std::process::Command::new(python)
            .args(["-c", &format!("import {modules}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if found.is_none() {
        // `.ci/run` installs them: there, a missing SDK is a failure, not a skip.
        assert!(
            std::env::var_os("SDK_REQUIRED").is_none(),
            "SDK_REQUIRED is set but no Python imports `{modules}`"
        );
        println!("skipped: no Python imports `{modules}` (set SDK_PYTHON)");
    }
    found
}

/// Runs the SDK checks of `script` (in `tests/gateway`) with `python` and `env`; its output,
/// once it succeeded with `checks` lines `ok ...`.
pub(crate) async fn run_sdk_checks(
    python: String,
    script: &str,
    env: Vec<(&'static str, String)>,
    checks: usize,
) -> String {
    let script = format!("{}/tests/gateway/{script}", env!("CARGO_MANIFEST_DIR"));
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .arg(script)
            .envs(env)
            .output()
    })
    .await
    .unwrap()
    .expect("the Python interpreter runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    println!("{stdout}");
    assert!(
        output.status.success(),
        "the SDK's checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count(),
        checks
    );
    stdout
}

/// Held by the tests that measure shares or rates over wall-clock time and by the one that
/// loads the machine on purpose, so that they never run at once: each alone keeps its bounds
/// on a busy two-core machine, but the busy loops of one starve the processes another
/// measures.
pub(crate) static TIMED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
