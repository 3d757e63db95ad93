//! `--durable`: the batch as jobs, through apalis, in Redis (`--redis-url`) or Postgres
//! (`--postgres-url`), worked by one or several processes.
//!
//! `--role enqueue` pushes one job per item into the apalis queue `--queue` (in Redis, adding
//! their number to `<queue>:total`; in Postgres, the queue's rows of `apalis.jobs` are its
//! total); `--role work` works the queue until every enqueued job is done or dead; `--role
//! both` (the default) does one, then the other. Each worker's calls go through
//! [`IdempotencyLayer`] (records in the same store) around the governed stack, whose budget
//! is the shared budget of `--quota-key` in that store, so any number of workers spend one
//! quota:
//!
//! - the **job id is the idempotency key**: a job run again after its worker died is answered
//!   from the record, or waits for the dead claim's lease to lapse (a live worker renews its
//!   claims; a dead one's lapse within two heartbeats, or `--lease-ms`) and is sent with the
//!   same key, which a provider honouring keys answers without billing again;
//! - a **permanent failure** (a 4xx, a cost that can never fit, an answer too large to replay)
//!   fails the job with apalis's `AbortError`: it goes to the dead-letter set, its error in
//!   its stored result;
//! - a **transient failure** the stack's retry layer gave up on is returned as a
//!   `RetryAfterError`: apalis-redis reschedules the job in its scheduled set with a
//!   not-before time (its own backoff: the attempt number in seconds), apalis-postgres sets it
//!   pending again with its attempt counted;
//! - a **result** (tokens, waits) is stored with each job by apalis (`<queue>:meta:<id>` in
//!   Redis, `apalis.jobs.last_result` in Postgres).
//!
//! A worker killed mid-run loses nothing: the jobs it held are re-enqueued by the other
//! workers (or by itself, restarted under another `--worker-name`) once its heartbeats have
//! stopped for two intervals (`--heartbeat-secs`).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use apalis::prelude::*;
use apalis_postgres::{PgPool, PostgresStorage};
use apalis_redis::{Config, ConnectionManager, RedisStorage};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::time::Instant;
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt};
use tower_llm_quota::group::{ApiFormat, GroupConfig, GroupItem, GroupQueue, Grouper};
use tower_llm_quota::idempotency::{
    IdempotencyError, IdempotencyLayer, IdempotentBody, Operation, Suppressed,
};
use tower_llm_quota::retry::{Failure as Failed, FailureClass, ProviderErrors};
use tower_llm_quota::{BoxError, Priority, Timings, retry::Classify};
use tower_llm_quota_postgres::PostgresIdempotencyStore;
use tower_llm_quota_redis::RedisIdempotencyStore;
use tower_llm_quota_sim::Simulator;

use crate::cli::{Args, Role};
use crate::report::{Frame, RunFigures};
use crate::run::{Consumption, Done, Meter, Metered, Outcome};
use crate::workload::Item;
use crate::{Failure, Provider, Settings};

/// A job: one item's request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Job {
    item: String,
    priority: String,
    body: String,
}

/// The governed client every job calls through.
type Llm =
    BoxCloneSyncService<Request<Full<Bytes>>, Response<IdempotentBody>, tower_llm_quota::Error>;

/// What a job handler needs.
struct Worker {
    llm: Llm,
    /// With `--group`: the jobs' items go in groups, formed from the jobs this worker holds.
    group: Option<GroupQueue<Value>>,
    url: String,
    api_key: String,
    queue: String,
    start: Instant,
}

/// A provider honouring keys forgets them after this.
const KEY_TTL: Duration = Duration::from_secs(24 * 3600);

pub(crate) async fn run(
    args: &Args,
    settings: &Settings,
    provider: &Provider,
    items: &[Item],
) -> Result<ExitCode, Failure> {
    let mut jobs = Jobs::open(args).await?;
    if matches!(args.role, Role::Enqueue | Role::Both) {
        let batch: Vec<Job> = items
            .iter()
            .map(|item| Job {
                item: item.id.clone(),
                priority: item.priority.as_str().to_owned(),
                body: String::from_utf8_lossy(&item.body).into_owned(),
            })
            .collect();
        let count = batch.len();
        let total = jobs.enqueue(batch).await?;
        println!("enqueued {count} jobs in `{}` ({total} in all)", args.queue);
    }
    if matches!(args.role, Role::Work | Role::Both) {
        return work(args, settings, provider, jobs).await;
    }
    Ok(ExitCode::SUCCESS)
}

/// Where the jobs live: apalis's Redis backend, or its Postgres one.
#[derive(Clone)]
enum Jobs {
    Redis {
        storage: RedisStorage<Job>,
        connection: ConnectionManager,
        config: Config,
        queue: String,
    },
    Postgres {
        storage: PostgresStorage<Job>,
        pool: PgPool,
        queue: String,
    },
}

impl Jobs {
    /// The queue `--queue` in the store `--redis-url` or `--postgres-url` names (apalis's
    /// schema migrated in Postgres).
    async fn open(args: &Args) -> Result<Self, Failure> {
        let heartbeat = Duration::from_secs(args.heartbeat_secs.max(1));
        if let Some(url) = &args.redis_url {
            let connection = apalis_redis::connect(url.as_str())
                .await
                .map_err(|error| format!("cannot reach Redis at {url}: {error}"))?;
            let config = Config::default()
                .queue(&args.queue)
                .heartbeat_interval(heartbeat)
                .missed_heartbeats(2);
            let storage = RedisStorage::<Job>::new(connection.clone()).with_config(config.clone());
            return Ok(Jobs::Redis {
                storage,
                connection,
                config,
                queue: args.queue.clone(),
            });
        }
        let url = args
            .postgres_url
            .as_deref()
            .ok_or("--durable needs --redis-url or --postgres-url")?;
        let pool = PgPool::connect(url)
            .await
            .map_err(|error| format!("cannot reach Postgres: {error}"))?;
        PostgresStorage::<()>::setup(&pool).await?;
        let config = apalis_postgres::Config::default()
            .queue(&args.queue)
            .heartbeat_interval(heartbeat)
            .missed_heartbeats(2)
            .persist_results(true);
        let storage = PostgresStorage::<Job>::new(&pool).with_config(config);
        Ok(Jobs::Postgres {
            storage,
            pool,
            queue: args.queue.clone(),
        })
    }

    /// Pushes `batch`: how many jobs the queue has had in all.
    async fn enqueue(&mut self, batch: Vec<Job>) -> Result<u64, Failure> {
        let count = batch.len();
        match self {
            Jobs::Redis {
                storage,
                connection,
                queue,
                ..
            } => {
                storage
                    .push_bulk(batch)
                    .await
                    .map_err(|error| format!("cannot enqueue: {error}"))?;
                Ok(redis::cmd("INCRBY")
                    .arg(total_key(queue))
                    .arg(count)
                    .query_async(connection)
                    .await?)
            }
            Jobs::Postgres { storage, .. } => {
                storage
                    .push_bulk(batch)
                    .await
                    .map_err(|error| format!("cannot enqueue: {error}"))?;
                self.total().await
            }
        }
    }

    /// How many jobs the queue has had in all.
    async fn total(&self) -> Result<u64, Failure> {
        match self {
            Jobs::Redis {
                connection, queue, ..
            } => Ok(redis::cmd("GET")
                .arg(total_key(queue))
                .query_async::<Option<u64>>(&mut connection.clone())
                .await?
                .unwrap_or(0)),
            Jobs::Postgres { pool, queue, .. } => {
                let (total,): (i64,) =
                    sqlx::query_as("SELECT count(*) FROM apalis.jobs WHERE job_type = $1")
                        .bind(queue)
                        .fetch_one(pool)
                        .await?;
                Ok(u64::try_from(total).unwrap_or(0))
            }
        }
    }

    /// How many jobs are in each state.
    async fn counts(&self) -> Result<JobCounts, Failure> {
        match self {
            Jobs::Redis {
                connection, config, ..
            } => Ok(redis_counts(&mut connection.clone(), config).await?),
            Jobs::Postgres { pool, queue, .. } => {
                // Failed, below its attempts, is fetched again: queued. Killed (an
                // `AbortError`), or failed at its last attempt, is dead.
                let (queued, delayed, done, dead): (i64, i64, i64, i64) = sqlx::query_as(
                    "SELECT \
                       count(*) FILTER (WHERE (status IN ('Pending', 'Queued', 'Running') \
                         OR (status = 'Failed' AND attempts < max_attempts)) AND run_at <= now()), \
                       count(*) FILTER (WHERE (status = 'Pending' \
                         OR (status = 'Failed' AND attempts < max_attempts)) AND run_at > now()), \
                       count(*) FILTER (WHERE status = 'Done'), \
                       count(*) FILTER (WHERE status = 'Killed' \
                         OR (status = 'Failed' AND attempts >= max_attempts)) \
                     FROM apalis.jobs WHERE job_type = $1",
                )
                .bind(queue)
                .fetch_one(pool)
                .await?;
                let n = |v: i64| u64::try_from(v).unwrap_or(0);
                Ok(JobCounts {
                    queued: n(queued),
                    delayed: n(delayed),
                    done: n(done),
                    dead: n(dead),
                })
            }
        }
    }

    /// Every ended job: its id, whether it is done (else dead), and the result apalis stored
    /// (`{"Ok": ...}` or `{"Err": "..."}`).
    async fn ended(&self) -> Result<Vec<(String, bool, Value)>, Failure> {
        let mut ended = Vec::new();
        match self {
            Jobs::Redis {
                connection, config, ..
            } => {
                let mut connection = connection.clone();
                for (set, done) in [
                    (config.done_jobs_set(), true),
                    (config.dead_jobs_set(), false),
                ] {
                    let ids: Vec<String> = redis::cmd("SMEMBERS")
                        .arg(set)
                        .query_async(&mut connection)
                        .await?;
                    for id in ids {
                        let result: Option<String> = redis::cmd("HGET")
                            .arg(format!("{}:{id}", config.job_meta_hash()))
                            .arg("result")
                            .query_async(&mut connection)
                            .await?;
                        let value = result
                            .and_then(|r| serde_json::from_str(&r).ok())
                            .unwrap_or(Value::Null);
                        ended.push((id, done, value));
                    }
                }
            }
            Jobs::Postgres { pool, queue, .. } => {
                let rows: Vec<(String, String, Option<sqlx::types::JsonValue>)> = sqlx::query_as(
                    "SELECT id, status, last_result FROM apalis.jobs WHERE job_type = $1 \
                     AND (status IN ('Done', 'Killed') \
                       OR (status = 'Failed' AND attempts >= max_attempts))",
                )
                .bind(queue)
                .fetch_all(pool)
                .await?;
                for (id, status, result) in rows {
                    ended.push((id, status == "Done", result.unwrap_or(Value::Null)));
                }
            }
        }
        Ok(ended)
    }

    /// An idempotency store in the same place as the jobs.
    fn idempotency(&self, args: &Args) -> Result<IdempotencyLayer, Failure> {
        Ok(match self {
            Jobs::Redis { .. } => IdempotencyLayer::new(RedisIdempotencyStore::open(
                args.redis_url.as_deref().unwrap_or_default(),
                &args.queue,
            )?),
            Jobs::Postgres { .. } => IdempotencyLayer::new(PostgresIdempotencyStore::open(
                args.postgres_url.as_deref().unwrap_or_default(),
            )?),
        })
    }

    /// Works the queue as `name` until `until` resolves (every job ended).
    async fn work_until(
        &self,
        name: &str,
        worker: &Arc<Worker>,
        concurrency: usize,
        until: impl std::future::Future<Output = Result<(), WorkerError>> + Send + 'static,
    ) -> Result<(), WorkerError> {
        match self {
            Jobs::Redis { storage, .. } => {
                WorkerBuilder::new(name)
                    .backend(storage.clone())
                    .data(Arc::clone(worker))
                    .concurrency(concurrency)
                    .build(work_job)
                    .run_until(until)
                    .await
            }
            Jobs::Postgres { storage, .. } => {
                WorkerBuilder::new(name)
                    .backend(storage.clone())
                    .data(Arc::clone(worker))
                    .concurrency(concurrency)
                    .build(work_job)
                    .run_until(until)
                    .await
            }
        }
    }
}

fn total_key(queue: &str) -> String {
    format!("{queue}:total")
}

/// How many jobs are in each state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct JobCounts {
    /// Ready, waiting for a worker.
    queued: u64,
    /// Waiting for a not-before time (a transient failure rescheduled).
    delayed: u64,
    /// Completed, with a stored result.
    done: u64,
    /// Failed permanently, in the dead-letter set with their error.
    dead: u64,
}

impl JobCounts {
    /// Whether every one of `enqueued` jobs has ended, done or dead.
    fn settled(&self, enqueued: u64) -> bool {
        self.done + self.dead >= enqueued
    }

    /// Sets the gauge `llm_jobs{state}` to each count, beside the quota's own series.
    fn record(&self) {
        for (state, count) in [
            ("queued", self.queued),
            ("delayed", self.delayed),
            ("done", self.done),
            ("dead", self.dead),
        ] {
            metrics::gauge!("llm_jobs", "state" => state).set(count as f64);
        }
    }
}

/// Jobs by state, read from apalis-redis's keys: its scheduled set holds every job pushed
/// (due now, or later), its active list the jobs due and fetched for a worker.
async fn redis_counts(
    connection: &mut ConnectionManager,
    config: &Config,
) -> Result<JobCounts, redis::RedisError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let (active, due, delayed, done, dead): (u64, u64, u64, u64, u64) = redis::pipe()
        .cmd("LLEN")
        .arg(config.active_jobs_list())
        .cmd("ZCOUNT")
        .arg(config.scheduled_jobs_set())
        .arg("-inf")
        .arg(now)
        .cmd("ZCOUNT")
        .arg(config.scheduled_jobs_set())
        .arg(format!("({now}"))
        .arg("+inf")
        .cmd("SCARD")
        .arg(config.done_jobs_set())
        .cmd("SCARD")
        .arg(config.dead_jobs_set())
        .query_async(connection)
        .await?;
    Ok(JobCounts {
        queued: active + due,
        delayed,
        done,
        dead,
    })
}

/// How many times a worker taken for dead registers again before it gives up.
const MAX_REJOINS: u32 = 5;

async fn work(
    args: &Args,
    settings: &Settings,
    provider: &Provider,
    jobs: Jobs,
) -> Result<ExitCode, Failure> {
    let total = jobs.total().await?;
    let start = Instant::now();
    let meter = Meter::new(start);
    let stack = crate::governed_stack(args, settings).await?;
    // Claims live as long as their worker: renewed while a call is alive, lapsing within two
    // heartbeats of the worker dying; a job waiting on a dead claim looks again every half
    // heartbeat.
    let heartbeat = Duration::from_secs(args.heartbeat_secs.max(1));
    let lease = args
        .lease_ms
        .map_or(heartbeat * 2, Duration::from_millis)
        .max(Duration::from_millis(1));
    let idempotency = jobs.idempotency(args)?.lease(lease).recheck(heartbeat / 2);
    let mut simulator = None;
    let llm: Llm = match provider {
        Provider::Embedded(config) => {
            let sim = Simulator::new(config.as_ref().clone().honour_idempotency_keys(KEY_TTL));
            let client = Metered::new(sim.service(), Arc::clone(&meter));
            simulator = Some(sim);
            BoxCloneSyncService::new(idempotency.layer(stack.layer(client)))
        }
        Provider::Remote(_) => {
            let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
            let client = Metered::new(client, Arc::clone(&meter));
            BoxCloneSyncService::new(idempotency.layer(stack.layer(client)))
        }
    };
    let group = match args.group {
        Some(size) => {
            let (instructions, template) = crate::grouped::prompt_parts(args)?;
            let config = GroupConfig::new()
                .max_items(usize::from(size))?
                .fit_budget(stack.budget());
            let (queue, grouper) = Grouper::new(llm.clone(), ApiFormat::OpenAiChat, instructions)
                .uri(settings.target.url.parse()?)
                .header(
                    http::header::AUTHORIZATION,
                    format!("Bearer {}", settings.target.api_key).parse()?,
                )
                .template(template)
                .config(config)
                .queue();
            // It ends once the handlers' queue handles are dropped, after the run.
            tokio::spawn(grouper.run());
            Some(queue)
        }
        None => None,
    };
    let worker = Arc::new(Worker {
        llm,
        group,
        url: settings.target.url.clone(),
        api_key: settings.target.api_key.clone(),
        queue: args.queue.clone(),
        start,
    });
    println!(
        "worker `{}`: working `{}` ({total} jobs enqueued), at most {} calls in flight",
        args.worker_name, args.queue, settings.concurrency
    );

    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "durable [{elapsed_precise}] {wide_bar} {pos}/{len} jobs {msg}",
    ) {
        bar.set_style(style);
    }
    let watch = || {
        let (bar, jobs) = (bar.clone(), jobs.clone());
        async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                tick.tick().await;
                let Ok(counts) = jobs.counts().await else {
                    continue;
                };
                counts.record();
                bar.set_position(counts.done + counts.dead);
                bar.set_message(format!(
                    "(queued {}, delayed {}, done {}, dead {})",
                    counts.queued, counts.delayed, counts.done, counts.dead
                ));
                if counts.settled(total) {
                    return Ok::<(), WorkerError>(());
                }
            }
        }
    };
    // A worker whose heartbeat came late (a stalled machine) is taken for dead by the others:
    // its jobs go back to the queue (their idempotency keys keep each billed once) and its
    // next heartbeat finds it unregistered. It registers again and goes on, a few times at
    // most, rather than leaving its share of the queue to the others.
    let mut rejoined = 0;
    loop {
        let run = jobs
            .work_until(
                &args.worker_name,
                &worker,
                settings.concurrency.get(),
                watch(),
            )
            .await;
        match run {
            Ok(()) => break,
            Err(error) if rejoined < MAX_REJOINS => {
                rejoined += 1;
                eprintln!("worker `{}`: {error}; registering again", args.worker_name);
            }
            Err(error) => return Err(format!("the worker failed: {error}").into()),
        }
    }
    bar.finish();

    let figures = report(&jobs, settings, &meter, start, simulator.as_ref()).await?;
    let frame = Frame::of(settings.quota, &figures);
    crate::report::print_table(&frame, None, &figures);
    crate::write_outputs(args, settings, &frame, None, &figures)?;
    println!(
        "this worker: {} calls reached the provider, {} provider 429s",
        meter.attempts(),
        meter.rate_limited_at().len()
    );
    Ok(ExitCode::SUCCESS)
}

/// One job: the call, through the idempotency layer and the governed stack.
async fn work_job(job: Job, id: TaskId, worker: Data<Arc<Worker>>) -> Result<Value, BoxDynError> {
    let priority = Priority::ALL
        .into_iter()
        .find(|p| p.as_str() == job.priority)
        .unwrap_or(Priority::Batch);
    if let Some(queue) = &worker.group {
        return grouped_job(queue, job, id, priority, worker.start).await;
    }
    let request = Request::post(worker.url.as_str())
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(
            http::header::AUTHORIZATION,
            format!("Bearer {}", worker.api_key),
        )
        // The job id is the operation's key: a re-run after a crash is the same operation.
        .header("idempotency-key", id.to_string())
        .extension(priority)
        .extension(Operation::new(worker.queue.clone(), "classify"))
        .body(Full::new(Bytes::from(job.body)))
        .map_err(AbortError::new)?;
    let arrived = worker.start.elapsed();
    let response = worker
        .llm
        .clone()
        .oneshot(request)
        .await
        .map_err(|error| job_error(error.into()))?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.map_err(job_error)?.to_bytes();
    if !parts.status.is_success() {
        let class = ProviderErrors.classify(&Failed::Response {
            status: parts.status,
            headers: &parts.headers,
            body: &body,
        });
        let message = format!("HTTP {} for {}", parts.status, job.item);
        return Err(match class {
            FailureClass::Transient(_) => {
                Box::new(RetryAfterError::new(message, Duration::from_secs(1)))
            }
            FailureClass::Permanent(_) => Box::new(AbortError::new(message)),
        });
    }
    let waited = parts
        .extensions
        .get::<Timings>()
        .map_or(Duration::ZERO, Timings::waited);
    let (input, output) = crate::run::usage_tokens(&body);
    Ok(json!({
        "item": job.item,
        "priority": job.priority,
        "status": parts.status.as_u16(),
        "tokens": input + output,
        "input": input,
        "output": output,
        "waited_ms": waited.as_millis() as u64,
        "sent_at_ms": (arrived + waited).as_millis() as u64,
        "replayed": parts.extensions.get::<Suppressed>().is_some(),
    }))
}

/// A failed call as apalis sees it: permanent (dead letter) or transient (rescheduled).
/// A job whose item goes in a group: done with its validated answer, rescheduled when its
/// calls failed, dead when its answers were rejected on every attempt.
async fn grouped_job(
    queue: &GroupQueue<Value>,
    job: Job,
    id: TaskId,
    priority: Priority,
    start: Instant,
) -> Result<Value, BoxDynError> {
    let body: Value = serde_json::from_str(&job.body).map_err(AbortError::new)?;
    let text = body["messages"][0]["content"].as_str().unwrap_or_default();
    let item = GroupItem::new(job.item.clone(), text)
        .key(id.to_string())
        .priority(priority);
    let arrived = start.elapsed();
    let outcome = queue
        .submit(item)
        .await
        .map_err(|closed| RetryAfterError::new(closed, Duration::from_secs(1)))?;
    match outcome.result {
        Ok(answer) => Ok(json!({
            "item": job.item,
            "priority": job.priority,
            "status": 200,
            "tokens": outcome.usage.total(),
            "input": outcome.usage.input_tokens,
            "output": outcome.usage.output_tokens,
            "waited_ms": 0,
            "sent_at_ms": arrived.as_millis() as u64,
            "replayed": false,
            "answer": answer,
            "attempts": outcome.attempts,
        })),
        Err(failure) if failure.is_call_failed() => Err(Box::new(RetryAfterError::new(
            failure,
            Duration::from_secs(1),
        ))),
        Err(failure) => Err(Box::new(AbortError::new(failure))),
    }
}

fn job_error(error: BoxError) -> BoxDynError {
    // The layer's decision: the call's `Error` names it; a body's error is it.
    let idempotency = error.downcast_ref::<IdempotencyError>().or_else(|| {
        error
            .downcast_ref::<tower_llm_quota::Error>()
            .and_then(tower_llm_quota::Error::idempotency_error)
    });
    let permanent = idempotency.is_some_and(|e| e.is_not_replayable() || e.is_invalid_key())
        || matches!(
            ProviderErrors.classify(&Failed::Error(&*error)),
            FailureClass::Permanent(_)
        ) && !error
            .downcast_ref::<tower_llm_quota::Error>()
            .is_some_and(|e| e.is_deadline_exceeded() || e.is_store_unavailable());
    if permanent {
        Box::new(AbortError::new(error))
    } else {
        Box::new(RetryAfterError::new(error, Duration::from_secs(1)))
    }
}

/// The same report as the other modes, over every job of the queue (each worker's results,
/// read back from the store).
async fn report(
    jobs: &Jobs,
    settings: &Settings,
    meter: &Meter,
    start: Instant,
    simulator: Option<&Simulator>,
) -> Result<RunFigures, Failure> {
    let mut outcomes = Vec::new();
    for (id, ok, value) in jobs.ended().await? {
        // apalis stores `Result<Value, String>` as {"Ok": ...} or {"Err": "..."}.
        let outcome = if ok {
            let done = &value["Ok"];
            let priority = done["priority"].as_str().unwrap_or("batch");
            Outcome {
                id: done["item"].as_str().unwrap_or(&id).to_owned(),
                priority: Priority::ALL
                    .into_iter()
                    .find(|p| p.as_str() == priority)
                    .unwrap_or(Priority::Batch),
                result: Ok(Done {
                    tokens: done["tokens"].as_u64().unwrap_or(0),
                    input: done["input"].as_u64().unwrap_or(0),
                    output: done["output"].as_u64().unwrap_or(0),
                    waited: Duration::from_millis(done["waited_ms"].as_u64().unwrap_or(0)),
                    sent_at: Duration::from_millis(done["sent_at_ms"].as_u64().unwrap_or(0)),
                }),
            }
        } else {
            Outcome {
                id,
                priority: Priority::Batch,
                result: Err(value["Err"].as_str().unwrap_or("failed").to_owned()),
            }
        };
        outcomes.push(outcome);
    }
    let served = || outcomes.iter().filter_map(|o| o.result.as_ref().ok());
    let used = Consumption::of(served());
    let provider_429 = match simulator {
        Some(sim) => sim.stats().rate_limited,
        None => meter.rate_limited_at().len() as u64,
    };
    // Sending instants are this worker's own: the plot is meant for a single-process run.
    let panel = crate::plot::Panel::from_events(
        "durable: jobs through IdempotencyLayer and QuotaStack".to_owned(),
        served().map(|d| (d.sent_at, d.tokens)),
        &meter.rate_limited_at(),
        settings.second(),
        settings.quota.tpm as f64 / 60.0,
    );
    Ok(RunFigures::from_outcomes(
        &outcomes,
        meter.attempts(),
        provider_429,
        start.elapsed(),
        used,
        panel,
    ))
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}
