//! A multi-tenant OpenAI- and Anthropic-compatible gateway on axum, governed by this crate's
//! stack: per-tenant limits, one budget per provider account, normalized refusals, a quota
//! API, Prometheus metrics and a live status page.
//!
//! ```sh
//! cargo install --path gateway                  # from the repository's root
//! llm-quota-gateway                             # the demo: simulated providers
//! llm-quota-gateway --config gateway.toml                 # its state in gateway.state.db
//! llm-quota-gateway --config gateway.toml --state postgres://gw@db/quota   # a fleet's
//! llm-quota-gateway --check-config gateway.toml # validate, then exit
//! ```
//!
//! Without `--config` it runs `demo.toml` (in the crate's folder) against the crate's simulated
//! provider in process, and prints the demo keys and two `curl` lines to try. The
//! configuration reference is the crate's README.

// No function longer than the workspace's `too-many-lines-threshold` (clippy.toml).
#![warn(clippy::too_many_lines)]

/// mimalloc: a request makes many small allocations, and the system's allocator spent a tenth
/// of the gateway's CPU on them; mimalloc takes 9 % less CPU a request at 3,000 requests a
/// second (`gateway/bench/audit_cpu.py --against`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Prints a line on stdout; a closed stdout (`| head`) is not an error worth a panic.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use tokio::net::TcpListener;
use tower_llm_quota_gateway::{Config, Gateway, Persistence, serve};

/// The gateway's command line.
#[derive(Debug, Parser)]
#[command(about = "A quota-aware LLM gateway")]
struct Args {
    /// The configuration (TOML); the demo when absent.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The address to listen on, over the configuration's.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Where the gateway's state lives, over the configuration's `state`: `sqlite:FILE`,
    /// `postgres://...` or `redis://...` (shared with the other replicas, every account's
    /// quota with them), or `memory`. By default an SQLite file beside the configuration
    /// (`gateway.toml`: `gateway.state.db`); the demo's is memory.
    #[arg(long, value_name = "URL")]
    state: Option<String>,
    /// Share every account's quota and the state with the other replicas through this Redis
    /// (`--state redis://...`).
    #[arg(long, conflicts_with = "state")]
    redis_url: Option<String>,
    /// Validate this configuration (TOML: every key, limit and tenant node) and exit, without
    /// starting: status 0 and a summary when it is valid, 1 and the reason otherwise.
    #[arg(long, value_name = "FILE")]
    check_config: Option<PathBuf>,
}

/// Completes on SIGTERM or Ctrl-C. The handlers are installed by this call, before the
/// future is first polled: a signal sent once the address is printed is never the default
/// action's (the process's end without a drain).
fn stop_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let handlers = {
        use tokio::signal::unix::{SignalKind, signal};
        [SignalKind::terminate(), SignalKind::interrupt()].map(|kind| signal(kind).ok())
    };
    async move {
        #[cfg(unix)]
        {
            let [term, interrupt] = handlers;
            let wait = |handler: Option<tokio::signal::unix::Signal>| async move {
                match handler {
                    Some(mut handler) => {
                        handler.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                () = wait(term) => {}
                () = wait(interrupt) => {}
            }
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Reads the configuration file again on every SIGHUP and applies what a reload can (keys,
/// admin tokens, tenant nodes); an invalid file changes nothing, and the demo (no file) has
/// nothing to reload. The outcome goes to stderr.
/// The handler is installed by this call, before the address is printed (a SIGHUP that came
/// before it would stop the process).
#[cfg(unix)]
fn reload_on_hangup(
    gateway: std::sync::Arc<Gateway>,
) -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = signal(SignalKind::hangup())?;
    Ok(async move {
        while hangups.recv().await.is_some() {
            if gateway.config_file().is_none() {
                tracing::warn!("SIGHUP: the gateway runs the built-in demo: nothing to reload");
                continue;
            }
            // The outcome is logged by the reload, as an admin API's is.
            let _ = gateway.reload_file();
        }
    })
}

/// Where the state lives: `--redis-url`, else as [`Persistence::choose`] says.
fn persistence(args: &Args, config: &Config) -> Result<Persistence, Box<dyn std::error::Error>> {
    if let Some(url) = &args.redis_url {
        return Ok(Persistence::Redis(url.clone()));
    }
    let configured = config.state();
    Ok(Persistence::choose(
        args.state.as_deref(),
        (args.config.as_deref(), configured),
    )?)
}

/// Runs the gateway; an error that stops it (a configuration refused, a state out of
/// reach) is printed on stderr as one line, and the process exits with status 1.
#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("llm-quota-gateway: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    // Warnings and errors on stderr (accept failures, a lowered connection cap); more with
    // `LLM_QUOTA_GATEWAY_LOG=debug` (or `trace`), none with `off`.
    let level = std::env::var("LLM_QUOTA_GATEWAY_LOG")
        .ok()
        .and_then(|level| level.parse().ok())
        .unwrap_or(tracing::level_filters::LevelFilter::WARN);
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .init();
    if let Some(path) = &args.check_config {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let config = Config::from_toml(&text)?;
        say!("{}", config.summary());
        return Ok(());
    }
    let demo = args.config.is_none();
    let config = match &args.config {
        Some(path) => Config::from_toml(
            &std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?,
        )?,
        None => Config::from_toml(include_str!("../demo.toml"))?,
    };
    let listen = args.listen.unwrap_or(config.listen());
    let persistence = persistence(&args, &config)?;
    let gateway = Gateway::new(&config, &persistence).await?;
    if let Some(path) = &args.config {
        gateway.reloads_from(path.clone());
    }
    // The demo too: a SIGHUP says there is nothing to reload instead of ending the process.
    #[cfg(unix)]
    tokio::spawn(reload_on_hangup(gateway.clone())?);
    let stop = stop_signal();
    let listener = TcpListener::bind(listen).await?;
    let url = format!("http://{}", listener.local_addr()?);
    say!("state: {persistence}");
    if persistence.is_shared() {
        say!("quotas, tenant limits, caps and pauses shared with the other replicas");
    }
    say!("gateway listening on {url} (status page at {url}/, metrics at {url}/metrics)");
    if demo {
        print_demo(&config, &url);
    }
    serve(gateway, listener, stop).await?;
    say!("gateway stopped");
    Ok(())
}

/// The demo's keys and a few `curl` lines to try it.
fn print_demo(config: &Config, url: &str) {
    say!("demo keys (tenant, default class):");
    for (secret, tenant, class) in config.inline_keys() {
        say!("  {secret:<24} {tenant} ({})", class.as_str());
    }
    let admin = config.inline_admin_token().unwrap_or("");
    say!("try:");
    say!(
        "  curl -s {url}/v1/chat/completions -H 'authorization: Bearer demo-key-acme-search' \
         -H 'content-type: application/json' \
         -d '{{\"model\":\"gpt-4o-mini\",\"max_tokens\":50,\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}]}}'"
    );
    say!(
        "  curl -s {url}/v1/embeddings -H 'authorization: Bearer demo-key-acme-search' \
         -H 'content-type: application/json' \
         -d '{{\"model\":\"text-embedding-3-small\",\"input\":\"Hello\"}}'"
    );
    say!("  curl -s {url}/admin/tenants -H 'authorization: Bearer {admin}'");
}
