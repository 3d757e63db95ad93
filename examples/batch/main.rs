//! The support-ticket story: 500 ticket classifications against a rate-limited provider, first
//! fired naively, then through the governed stack, with a before/after table.
//!
//! ```sh
//! cargo run --release --example batch
//! cargo run --release --example batch -- --help
//! ```
//!
//! With no arguments the example generates 500 ticket-classification prompts (1,000 to 4,000
//! characters, `max_tokens` 200, deterministic from `--seed`) and starts a simulated
//! OpenAI-style provider in-process with 500 RPM and 30,000 TPM, whose "minute" lasts 2 s of
//! real time (`--minute-ms`; latencies are scaled alike), so both runs take about half a
//! minute. Then:
//!
//! 1. **naive**: every item at once with `join_all`, each retrying a 429 after a fixed wait of
//!    one (simulated) second, at most 5 attempts: the burst empties the token bucket, the
//!    retries come back together, and most items fail;
//! 2. **governed**: the same items through [`QuotaStack`] (estimate, retry safety net,
//!    priority queue, token budget, in-flight limit, reconcile) over a budget for the same
//!    quota, with a progress bar. It must finish every item without a single provider 429;
//!    the example checks it and exits with an error otherwise.
//!
//! The governed budget keeps the crate's default, an adaptive share: the whole quota while the
//! provider's rate-limit headers show nobody else spending it, less when they do. With
//! `--redis-url`, each process leases its share of the quota from Redis and the fleet's plan
//! adapts once for all of them (a 429 seen by any lowers it for every process); with
//! `--call-per-admission` (a budget whose buckets live in Redis and do not adapt) it plans a
//! fixed 85 %. `--headroom SHARE` fixes the share in every mode (`--headroom 0.85` also runs
//! without 429s here, only slower).
//!
//! # The figures
//!
//! - **calls**: attempts that reached the provider, retries included.
//! - **provider 429s**: as counted by the provider (the simulator), or by the client with
//!   `--url`.
//! - **tokens used**: prompt + completion tokens the provider charged.
//! - **theoretical minimum**: the binding dimension's total consumption divided by its nominal
//!   rate: `tokens used / TPM` (or `requests / RPM` when that is longer), for the work of the
//!   governed run (every item once). No client can finish all the work faster at a sustained
//!   rate; a run can beat it slightly by spending the provider's initial burst (a full bucket).
//! - **bound (full bucket)**: the shortest time when the provider's bucket starts full (a
//!   whole minute of quota, as the simulator's does): for each dimension, what the governed
//!   run consumed beyond that minute divided by the nominal rate; the longest of them.
//! - **utilisation**: the binding dimension consumed by a run / (nominal rate × its wall
//!   time). The same definitions are used by the goodput benchmark
//!   (`cargo bench --bench goodput`).
//! - **queue wait**: for the governed run, the time queued plus the time waiting for the budget
//!   before the successful call (the `Timings` response extension), per priority class; for the
//!   naive run, the time from arrival to the successful attempt.
//!
//! # Other modes
//!
//! - `--provider gemini`: the embedded provider speaks Google's native Gemini API
//!   (`generateContent`, the key in `x-goog-api-key`, `usageMetadata`, a 429
//!   `RESOURCE_EXHAUSTED` with `RetryInfo`), its quota requests and input tokens a minute as
//!   Google counts them; the governed stack uses `Profile::gemini()`.
//! - `--url http://host/v1 --api-key-env VAR`: any OpenAI-compatible endpoint (its base URL, as
//!   OpenAI's SDKs take it, or the full `.../v1/chat/completions`) over plain HTTP instead of
//!   the embedded provider, through reqwest: the governed run puts
//!   the stack in a `reqwest_middleware` client (`QuotaMiddleware`); `--minute-ms` then
//!   defaults to 60000. The figures are those the client measured.
//! - `--input FILE.jsonl`: one object a line, `{"id": "t1", "prompt": "...", "max_tokens":
//!   200, "priority": "interactive", "arrive_ms": 1500}` (`arrive_ms` optional).
//! - `--redis-url redis://127.0.0.1/ --quota-key NAME --instances N`: the governed budget lives
//!   in Redis, so processes started side by side with the same key share one quota (with
//!   `--url`, all of them against one provider); `--instances` is each process's fallback share
//!   while Redis is out of reach. Each process admits from a share of the quota leased from
//!   Redis and renewed every 100 ms (`--leased-shares MS`), or with `--call-per-admission`
//!   asks Redis for every admission. `--postgres-url postgres://...` does the same through a
//!   Postgres database (its schema migrated at start).
//! - `--report FILE.json`, `--plot FILE.svg`: the figures as JSON; tokens admitted per
//!   simulated second against the quota, with the 429s marked.
//! - `--prices INPUT,OUTPUT`: dollars per million input and output tokens (your model's: none
//!   ships with the example), or `--prices-file FILE.toml`, a price table (the crate's
//!   `pricing` format) naming the workload's `gpt-4o-mini`; the tables and the JSON report
//!   gain the runs' spend.
//! - `--group N [--instructions FILE.txt] [--template FILE.toml] [--answer-errors SHARE]`:
//!   the tickets grouped N per call with shared instructions, against the same tickets one
//!   per call, side by side (calls, input and output tokens, wall time, provider 429s, items
//!   re-sent alone, items failed); see `grouped.rs`.
//! - `--durable --redis-url URL [--role enqueue|work|both] [--worker-name NAME]`: the items as
//!   jobs in Redis (apalis), worked by any number of processes through `IdempotencyLayer` and
//!   the governed stack; with `--postgres-url URL`, jobs, quota and idempotency records in
//!   Postgres (apalis-postgres); see `durable.rs`.

mod cli;
mod durable;
mod grouped;
mod input;
mod plot;
mod remote;
mod report;
mod run;
mod workload;

use std::error::Error;
use std::num::NonZeroU64;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Full;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::time::Instant;
use tower::{Layer, Service};
use tower_llm_quota::provider::Profile;
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{BoxError, Dimension, Limit, Priority, QueueConfig, Quota, RetryPolicy};
use tower_llm_quota_postgres::PostgresBudget;
use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_sim::{SimConfig, SimStats, Simulator};

use cli::Args;
use plot::Panel;
use report::{Frame, RunFigures};
use run::{Consumption, FixedRetry, Meter, Metered, Outcome, QuotaSpec, Target};
use workload::{Item, TicketShape};

type Failure = Box<dyn Error>;

/// The real-time minute of the embedded provider by default.
const EMBEDDED_MINUTE_MS: u64 = 2_000;
/// The naive retry loop: attempts per item.
const NAIVE_ATTEMPTS: u32 = 5;
/// Async items of an `--input` file wait as long as the job takes (batch work does by
/// default).
const LONG_WAIT: Duration = Duration::from_secs(24 * 3_600);

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Where the calls go.
enum Provider {
    /// A fresh in-process simulator per run, so each run starts with a full quota.
    Embedded(Box<SimConfig>),
    /// An OpenAI-compatible endpoint over HTTP.
    Remote(reqwest::Client),
}

async fn run(args: Args) -> Result<ExitCode, Failure> {
    let settings = Settings::from_args(&args)?;
    let items = match &args.input {
        Some(path) => input::read_items(path)?,
        None => workload::tickets(
            "ticket",
            args.items,
            TicketShape::SUPPORT,
            Priority::Batch,
            args.seed,
        ),
    };
    let items = match args.provider {
        cli::Api::Openai => items,
        cli::Api::Gemini => items
            .into_iter()
            .map(|item| Item {
                body: workload::gemini_body(&item.body),
                ..item
            })
            .collect(),
    };
    let provider = match &args.url {
        Some(_) => Provider::Remote(reqwest::Client::new()),
        None => Provider::Embedded(Box::new(simulator_config(
            settings.quota,
            args.seed,
            args.provider,
        ))),
    };
    settings.describe(&args, items.len());
    if args.durable {
        return durable::run(&args, &settings, &provider, &items).await;
    }
    if let Some(size) = args.group {
        return grouped::run(&args, &settings, &provider, usize::from(size)).await;
    }

    let naive = if args.governed_only {
        None
    } else {
        let figures = naive_run(&provider, &settings, &items).await;
        println!(
            "naive: {} of {} items done, {} provider 429s",
            figures.ok, figures.items, figures.provider_429
        );
        if matches!(provider, Provider::Remote(_)) {
            println!("waiting one quota minute for the provider's quota to refill...");
            tokio::time::sleep(settings.quota.minute).await;
        }
        Some(figures)
    };
    let stack = governed_stack(&args, &settings).await?;
    let governed = governed_run(&provider, &settings, &stack, &items).await;

    let frame = Frame::of(settings.quota, &governed).with_prices(args.prices());
    report::print_table(&frame, naive.as_ref(), &governed);
    write_outputs(&args, &settings, &frame, naive.as_ref(), &governed)?;
    Ok(verify(&provider, &governed))
}

/// The run's parameters, from the flags.
struct Settings {
    quota: QuotaSpec,
    /// A fixed share of the quota; `None`: the adaptive default.
    headroom: Option<f64>,
    concurrency: std::num::NonZeroUsize,
    target: Target,
    naive_retry: FixedRetry,
}

impl Settings {
    fn from_args(args: &Args) -> Result<Self, Failure> {
        let default_minute = if args.url.is_some() {
            60_000
        } else {
            EMBEDDED_MINUTE_MS
        };
        let minute = Duration::from_millis(args.minute_ms.unwrap_or(default_minute));
        let tpm = args.tpm.unwrap_or(if args.group.is_some() {
            120_000
        } else {
            30_000
        });
        if minute.is_zero() || args.rpm == 0 || tpm == 0 {
            return Err("--rpm, --tpm and --minute-ms must be positive".into());
        }
        // One call per admission plans a fixed share: its buckets in Redis do not adapt.
        let per_admission = args.shared_store().is_some() && args.call_per_admission;
        let headroom = args
            .headroom
            .or(per_admission.then_some(Limit::DEFAULT_HEADROOM));
        if headroom.is_some_and(|h| !(h > 0.0 && h <= 1.0)) {
            return Err("--headroom must be in (0, 1]".into());
        }
        let target = match &args.url {
            Some(url) => Target {
                url: url.clone(),
                api_key: std::env::var(&args.api_key_env).map_err(|_| {
                    format!(
                        "--url needs an API key in ${}, which is not set",
                        args.api_key_env
                    )
                })?,
            },
            None => Target {
                url: String::from(match args.provider {
                    cli::Api::Openai => "/v1/chat/completions",
                    cli::Api::Gemini => run::GEMINI_URL,
                }),
                api_key: String::from("sk-batch-example"),
            },
        };
        Ok(Self {
            quota: QuotaSpec {
                rpm: args.rpm,
                tpm,
                minute,
            },
            headroom,
            concurrency: args.concurrency,
            target,
            naive_retry: FixedRetry {
                attempts: NAIVE_ATTEMPTS,
                wait: minute / 60,
            },
        })
    }

    /// One simulated second: a sixtieth of the quota's minute.
    fn second(&self) -> Duration {
        self.quota.minute / 60
    }

    fn describe(&self, args: &Args, items: usize) {
        let provider = args
            .url
            .as_deref()
            .unwrap_or("the embedded simulated provider");
        println!(
            "{items} items against {provider}: {} RPM, {} TPM, a minute lasting {} ms",
            self.quota.rpm,
            self.quota.tpm,
            self.quota.minute.as_millis()
        );
        let share = match self.headroom {
            None => String::from(
                "an adaptive share of the quota (all of it while nobody else spends it)",
            ),
            Some(h) if h < 1.0 => format!(
                "{:.0} % of the quota (a margin for other users and accounting differences)",
                h * 100.0
            ),
            Some(_) => String::from("the whole quota (this client is its only user)"),
        };
        println!(
            "governed budget: {share}; at most {} calls in flight{}",
            self.concurrency,
            match args.shared_store() {
                Some((store, url)) =>
                    format!("; shared through {store} at {url} as `{}`", args.quota_key),
                None => String::new(),
            }
        );
        if args.shared_store().is_some() && args.url.is_none() {
            println!(
                "note: without --url each process calls its own embedded provider; give every \
                 process the same --url to share one provider"
            );
        }
    }
}

fn simulator_config(quota: QuotaSpec, seed: u64, api: cli::Api) -> SimConfig {
    // Latencies of a real minute (300 ms to the first token, 10 ms a token), scaled alike.
    let scale = quota.minute.as_secs_f64() / 60.0;
    let config = match api {
        cli::Api::Openai => SimConfig::openai(quota.rpm, quota.tpm),
        cli::Api::Gemini => SimConfig::gemini(quota.rpm, quota.tpm),
    };
    config
        .minute(quota.minute)
        .latency(
            Duration::from_secs_f64(0.3 * scale),
            Duration::from_secs_f64(0.01 * scale),
        )
        .seed(seed)
}

/// How often a process renews its leased share of a quota shared through Redis (ms).
const DEFAULT_REFRESH_MS: u64 = 100;

/// The governed stack for the quota, its budget in memory, in Redis or in Postgres.
async fn governed_stack(args: &Args, settings: &Settings) -> Result<QuotaStack, Failure> {
    let spec = settings.quota;
    let limit = |dimension, amount| -> Result<Limit, Failure> {
        let amount = NonZeroU64::new(amount).ok_or("a limit must be positive")?;
        let limit = Limit::new(dimension, amount, spec.minute)?;
        let limit = match settings.headroom {
            Some(headroom) => limit.with_headroom(headroom)?,
            None => limit,
        };
        Ok(match args.burst {
            Some(fraction) => limit.with_burst_fraction(fraction)?,
            None => limit,
        })
    };
    // Google counts its tokens a minute over the input.
    let (tokens, profile) = match args.provider {
        cli::Api::Openai => (Dimension::TotalTokens, Profile::openai()),
        cli::Api::Gemini => (Dimension::InputTokens, Profile::gemini()),
    };
    let quota = Quota::new()
        .with_limit(limit(Dimension::Requests, spec.rpm)?)
        .with_limit(limit(tokens, spec.tpm)?);
    let queue = QueueConfig::new().max_wait(Priority::Async, LONG_WAIT);
    // The provider's minute may be compressed: its headers are read with the quota's windows.
    let profile = profile.windows(spec.minute, spec.minute);
    let mut stack = QuotaStack::for_profile(profile, quota.clone())
        .concurrency(settings.concurrency)
        .queue(queue);
    if let Some(attempts) = args.retry_attempts {
        let policy = Priority::ALL
            .into_iter()
            .fold(RetryPolicy::new(), |policy, priority| {
                policy.max_attempts(priority, attempts)
            });
        stack = stack.retry(policy);
    }
    let refresh = (!args.call_per_admission).then(|| {
        std::time::Duration::from_millis(args.leased_shares.unwrap_or(DEFAULT_REFRESH_MS))
    });
    let instances = args.instances.max(1);
    if let Some(url) = &args.redis_url {
        let mut budget =
            RedisBudget::new(url.as_str(), args.quota_key.as_str()).expected_instances(instances);
        if let Some(refresh) = refresh {
            budget = budget.leased_shares(refresh);
        }
        let budget = budget
            .connect(&quota)
            .await
            .map_err(|error| format!("cannot use Redis at {url}: {error}"))?;
        return Ok(stack.with_budget(budget));
    }
    if let Some(url) = &args.postgres_url {
        tower_llm_quota_postgres::migrate(url).await?;
        let mut budget = PostgresBudget::new(url.as_str(), args.quota_key.as_str())
            .expected_instances(instances);
        if let Some(refresh) = refresh {
            budget = budget.leased_shares(refresh);
        }
        return Ok(stack.with_budget(budget.connect(&quota).await?));
    }
    Ok(stack)
}

/// What a run needs to know to drive a client.
enum Mode<'a> {
    Naive(FixedRetry),
    Governed(&'a QuotaStack, ProgressBar),
}

async fn naive_run(provider: &Provider, settings: &Settings, items: &[Item]) -> RunFigures {
    let mode = Mode::Naive(settings.naive_retry);
    let title = format!(
        "naive: join_all, {} attempts, a fixed wait of one simulated second",
        NAIVE_ATTEMPTS
    );
    measure(provider, settings, items, &mode, title).await
}

async fn governed_run(
    provider: &Provider,
    settings: &Settings,
    stack: &QuotaStack,
    items: &[Item],
) -> RunFigures {
    let bar = ProgressBar::new(items.len() as u64);
    if let Ok(style) = ProgressStyle::with_template(
        "governed [{elapsed_precise}] {wide_bar} {pos}/{len} items {msg}",
    ) {
        bar.set_style(style);
    }
    let mode = Mode::Governed(stack, bar.clone());
    let title = match settings.headroom {
        Some(headroom) => format!(
            "governed: QuotaStack at {:.0} % of the quota",
            headroom * 100.0
        ),
        None => String::from("governed: QuotaStack, adaptive share"),
    };
    let figures = measure(provider, settings, items, &mode, title).await;
    bar.finish();
    figures
}

/// Runs `items` in `mode` against `provider` and measures the run.
async fn measure(
    provider: &Provider,
    settings: &Settings,
    items: &[Item],
    mode: &Mode<'_>,
    title: String,
) -> RunFigures {
    let start = Instant::now();
    let meter = Meter::new(start);
    match provider {
        Provider::Embedded(config) => {
            let simulator = Simulator::new(SimConfig::clone(config));
            let client = Metered::new(simulator.service(), Arc::clone(&meter));
            let outcomes = drive(client, items, settings, mode, start).await;
            let stats = simulator.stats();
            // The tokens the quota's TPM counts: Google's, the input alone.
            let tokens = match config.style() {
                tower_llm_quota_sim::Style::Gemini => stats.prompt_tokens,
                _ => stats.prompt_tokens + stats.completion_tokens,
            };
            let used = Consumption {
                requests: stats.admitted,
                tokens,
                input: stats.prompt_tokens,
                output: stats.completion_tokens,
            };
            let panel = simulator_panel(title, &stats, settings.quota);
            RunFigures::from_outcomes(
                &outcomes,
                meter.attempts(),
                stats.rate_limited,
                start.elapsed(),
                used,
                panel,
            )
        }
        Provider::Remote(client) => {
            let outcomes = match mode {
                Mode::Naive(_) => {
                    let client =
                        Metered::new(remote::Reqwest::plain(client.clone()), Arc::clone(&meter));
                    drive(client, items, settings, mode, start).await
                }
                Mode::Governed(stack, bar) => {
                    // The stack runs inside the reqwest client, as its middleware.
                    let client =
                        remote::Reqwest::governed(client.clone(), stack, Arc::clone(&meter));
                    let target = &settings.target;
                    run::run_all(client, items, target, None, start, &progress(bar)).await
                }
            };
            let wall = start.elapsed();
            let rate_limited_at = meter.rate_limited_at();
            let done = || outcomes.iter().filter_map(|o| o.result.as_ref().ok());
            // What the provider served: the successful calls (a 429, a 5xx or a failed
            // connection consumed nothing of the quota, as far as the client can tell).
            let used = Consumption::of(done());
            let panel = Panel::from_events(
                title,
                done().map(|d| (d.sent_at, d.tokens)),
                &rate_limited_at,
                settings.second(),
                settings.quota.tpm as f64 / 60.0,
            );
            let provider_429 = rate_limited_at.len() as u64;
            RunFigures::from_outcomes(&outcomes, meter.attempts(), provider_429, wall, used, panel)
        }
    }
}

/// Sends `items` through `client`, naked with the naive retry loop or inside the stack.
async fn drive<S, B>(
    client: S,
    items: &[Item],
    settings: &Settings,
    mode: &Mode<'_>,
    start: Instant,
) -> Vec<Outcome>
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + Send + Sync + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let target = &settings.target;
    match mode {
        Mode::Naive(retry) => {
            run::run_all(client, items, target, Some(*retry), start, &|_| {}).await
        }
        Mode::Governed(stack, bar) => {
            let client = stack.layer(client);
            run::run_all(client, items, target, None, start, &progress(bar)).await
        }
    }
}

/// Advances the progress bar as items end.
fn progress(bar: &ProgressBar) -> impl Fn(&Outcome) + Sync + '_ {
    move |outcome: &Outcome| {
        bar.inc(1);
        if outcome.result.is_err() {
            bar.set_message(format!("(last failure: {})", outcome.id));
        }
    }
}

/// The simulator's own series: tokens admitted and 429s per simulated second.
fn simulator_panel(title: String, stats: &SimStats, quota: QuotaSpec) -> Panel {
    Panel {
        title,
        tokens: stats
            .series
            .iter()
            .map(|p| p.input_tokens + p.output_tokens)
            .collect(),
        rate_limited: stats.series.iter().map(|p| p.rate_limited).collect(),
        quota: quota.tpm as f64 / 60.0,
    }
}

fn write_outputs(
    args: &Args,
    settings: &Settings,
    frame: &Frame,
    naive: Option<&RunFigures>,
    governed: &RunFigures,
) -> Result<(), Failure> {
    if let Some(path) = &args.report {
        let provider = args.url.as_deref().unwrap_or("embedded simulator");
        let report = report::json_report(frame, provider, settings.headroom, naive, governed);
        std::fs::write(path, format!("{report:#}\n"))
            .map_err(|error| format!("cannot write {}: {error}", path.display()))?;
        println!("report written to {}", path.display());
    }
    if let Some(path) = &args.plot {
        let panels: Vec<Panel> = naive
            .into_iter()
            .chain([governed])
            .map(|run| run.panel.clone())
            .collect();
        std::fs::write(path, plot::svg(&panels))
            .map_err(|error| format!("cannot write {}: {error}", path.display()))?;
        println!("plot written to {}", path.display());
    }
    Ok(())
}

/// The governed run's promise against the embedded provider: every item done, no 429.
fn verify(provider: &Provider, governed: &RunFigures) -> ExitCode {
    let kept = governed.failed == 0 && governed.provider_429 == 0;
    match (provider, kept) {
        (_, true) => {
            println!("check: the governed run finished every item without a provider 429");
            ExitCode::SUCCESS
        }
        (Provider::Embedded(_), false) => {
            println!(
                "CHECK FAILED: the governed run had {} provider 429s and {} failed items",
                governed.provider_429, governed.failed
            );
            ExitCode::FAILURE
        }
        (Provider::Remote(_), false) => {
            println!(
                "note: {} provider 429s and {} failed items (another user of the quota, or a \
                 quota smaller than stated?)",
                governed.provider_429, governed.failed
            );
            ExitCode::SUCCESS
        }
    }
}
