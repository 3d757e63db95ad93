//! Running work items through a client, and what the run measured.
//!
//! Shared by the `batch` example and the `goodput` benchmark: both wrap the raw client
//! (the simulated provider, or an HTTP client) in [`Metered`], so every attempt and every 429
//! that reaches the provider is counted, whichever stack sits above it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::join_all;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{Service, ServiceExt};
use tower_llm_quota::{BoxError, Priority, Timings, retry::RetryReport};

use crate::workload::Item;

/// Where requests go: the URL and the API key, sent as a bearer token (or, for Google's
/// native API, in `x-goog-api-key`).
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) url: String,
    pub(crate) api_key: String,
}

/// The URL of the embedded Gemini provider's `generateContent` for the workload's model.
pub(crate) const GEMINI_URL: &str = "/v1beta/models/gemini-2.5-flash:generateContent";

impl Target {
    /// A fresh request for `item` (requests are rebuilt for every attempt). Its idempotency
    /// key is the item's id: a call cut before its answer (a reset) may then be retried on the
    /// same provider without the risk of billing the item twice.
    fn request(&self, item: &Item) -> Result<Request<Full<Bytes>>, http::Error> {
        let (name, key) = match self.url.as_str() {
            GEMINI_URL => ("x-goog-api-key", self.api_key.clone()),
            _ => ("authorization", format!("Bearer {}", self.api_key)),
        };
        Request::post(self.url.as_str())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(name, key)
            .header("idempotency-key", item.id.as_str())
            .extension(item.priority)
            .body(Full::new(item.body.clone()))
    }
}

/// The naive client's retry loop: a fixed number of attempts, a fixed wait after a 429.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FixedRetry {
    pub(crate) attempts: u32,
    pub(crate) wait: Duration,
}

/// Counts what reaches the provider: attempts, and the instant of every 429.
#[derive(Debug)]
pub(crate) struct Meter {
    start: Instant,
    attempts: AtomicU64,
    rate_limited_at: Mutex<Vec<Duration>>,
}

impl Meter {
    /// A meter whose instants are measured from `start`.
    pub(crate) fn new(start: Instant) -> Arc<Self> {
        Arc::new(Self {
            start,
            attempts: AtomicU64::new(0),
            rate_limited_at: Mutex::new(Vec::new()),
        })
    }

    /// Calls that reached the provider.
    pub(crate) fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }

    /// When each 429 arrived, from the start.
    pub(crate) fn rate_limited_at(&self) -> Vec<Duration> {
        let mut at = self
            .rate_limited_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        at.sort();
        at
    }

    fn record_429(&self) {
        let at = self.start.elapsed();
        self.rate_limited_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(at);
    }
}

/// When the call that produced a response was sent, in the response's extensions.
#[derive(Debug, Clone, Copy)]
struct CallStarted(Instant);

/// The raw client, counted by a [`Meter`]; it marks each response with when it was sent.
#[derive(Debug, Clone)]
pub(crate) struct Metered<S> {
    inner: S,
    meter: Arc<Meter>,
}

impl<S> Metered<S> {
    pub(crate) fn new(inner: S, meter: Arc<Meter>) -> Self {
        Self { inner, meter }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Metered<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let meter = Arc::clone(&self.meter);
        meter.attempts.fetch_add(1, Ordering::Relaxed);
        let sent = Instant::now();
        let call = self.inner.call(request);
        Box::pin(async move {
            let mut response = call.await?;
            if response.status() == StatusCode::TOO_MANY_REQUESTS {
                meter.record_429();
            }
            response.extensions_mut().insert(CallStarted(sent));
            Ok(response)
        })
    }
}

/// A successful item.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Done {
    /// Total tokens the provider reported in the body's `usage`.
    pub(crate) tokens: u64,
    /// Of which input (prompt) and output tokens.
    pub(crate) input: u64,
    pub(crate) output: u64,
    /// Time from arrival to the successful call: queue and budget wait for the governed
    /// client (its `Timings`), every earlier attempt and retry wait for the others.
    pub(crate) waited: Duration,
    /// When the successful call was sent, from the start of the run.
    pub(crate) sent_at: Duration,
}

/// How one item ended.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) id: String,
    pub(crate) priority: Priority,
    pub(crate) result: Result<Done, String>,
}

/// Runs every item through `client`, all at once (each item waits for its arrival offset),
/// with `retry` as a loop around each call if given. `on_done` sees each outcome as it ends.
pub(crate) async fn run_all<S, B>(
    client: S,
    items: &[Item],
    target: &Target,
    retry: Option<FixedRetry>,
    start: Instant,
    on_done: &(dyn Fn(&Outcome) + Sync),
) -> Vec<Outcome>
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let runs = items.iter().map(|item| {
        let client = client.clone();
        async move {
            let outcome = run_item(client, item, target, retry, start).await;
            on_done(&outcome);
            outcome
        }
    });
    join_all(runs).await
}

async fn run_item<S, B>(
    client: S,
    item: &Item,
    target: &Target,
    retry: Option<FixedRetry>,
    start: Instant,
) -> Outcome
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    tokio::time::sleep_until(start + item.arrive).await;
    let arrived = Instant::now();
    let retry = retry.unwrap_or(FixedRetry {
        attempts: 1,
        wait: Duration::ZERO,
    });
    let attempts = retry.attempts.max(1);
    let mut attempt = 1;
    let result = loop {
        match call_once(client.clone(), target, item, arrived, start).await {
            Ok(Answer::Refused(StatusCode::TOO_MANY_REQUESTS, _)) if attempt < attempts => {
                tokio::time::sleep(retry.wait).await;
                attempt += 1;
            }
            Ok(Answer::Done(done)) => break Ok(done),
            // The governed stack says how many attempts it made and why it stopped.
            Ok(Answer::Refused(status, Some(report))) => {
                let why = report
                    .gave_up()
                    .map_or_else(String::new, |why| format!(": {why}"));
                break Err(format!(
                    "HTTP {status} after {} attempt(s){why}",
                    report.attempts()
                ));
            }
            Ok(Answer::Refused(status, None)) => {
                break Err(format!("HTTP {status} after {attempt} attempt(s)"));
            }
            Err(error) => break Err(error.to_string()),
        }
    };
    Outcome {
        id: item.id.clone(),
        priority: item.priority,
        result,
    }
}

enum Answer {
    Done(Done),
    Refused(StatusCode, Option<RetryReport>),
}

async fn call_once<S, B>(
    client: S,
    target: &Target,
    item: &Item,
    arrived: Instant,
    start: Instant,
) -> Result<Answer, BoxError>
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let request = target.request(item)?;
    let response = client.oneshot(request).await.map_err(Into::into)?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.map_err(Into::into)?.to_bytes();
    if parts.status != StatusCode::OK {
        let report = parts.extensions.get::<RetryReport>().copied();
        return Ok(Answer::Refused(parts.status, report));
    }
    let sent = parts
        .extensions
        .get::<CallStarted>()
        .map_or(arrived, |started| started.0);
    let waited = match parts.extensions.get::<Timings>() {
        Some(timings) => timings.waited(),
        None => sent.saturating_duration_since(arrived),
    };
    let (input, output) = usage_tokens(&body);
    Ok(Answer::Done(Done {
        tokens: input + output,
        input,
        output,
        waited,
        sent_at: sent.saturating_duration_since(start),
    }))
}

/// `usage.prompt_tokens` and `usage.completion_tokens` of an OpenAI body (Gemini's
/// `usageMetadata`, its thoughts counted as output), 0 when absent.
pub(crate) fn usage_tokens(body: &[u8]) -> (u64, u64) {
    let value = serde_json::from_slice::<serde_json::Value>(body).unwrap_or_default();
    let gemini = &value["usageMetadata"];
    if gemini.is_object() {
        let count = |name: &str| gemini[name].as_u64().unwrap_or(0);
        let output = count("candidatesTokenCount") + count("thoughtsTokenCount");
        return (count("promptTokenCount"), output);
    }
    let count = |name: &str| value["usage"][name].as_u64().unwrap_or(0);
    (count("prompt_tokens"), count("completion_tokens"))
}

/// The nearest-rank `q` quantile (0 to 1) of `values`, sorted in place; zero when empty.
pub(crate) fn quantile(values: &mut [Duration], q: f64) -> Duration {
    if values.is_empty() {
        return Duration::ZERO;
    }
    values.sort_unstable();
    let rank = (q * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// The per-minute quota of one provider account, with the length of its minute.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QuotaSpec {
    pub(crate) rpm: u64,
    pub(crate) tpm: u64,
    pub(crate) minute: Duration,
}

/// Which dimension bounds a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Binding {
    Requests,
    Tokens,
}

impl Binding {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Binding::Requests => "requests",
            Binding::Tokens => "tokens",
        }
    }
}

/// What a run consumed of the quota.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Consumption {
    /// Calls the provider admitted (charged to the RPM).
    pub(crate) requests: u64,
    /// Tokens the provider charged in the end (prompt + completion).
    pub(crate) tokens: u64,
    /// Of which input (prompt) and output tokens.
    pub(crate) input: u64,
    pub(crate) output: u64,
}

impl Consumption {
    /// What the served calls report: their count and tokens.
    pub(crate) fn of<'a>(done: impl Iterator<Item = &'a Done>) -> Self {
        done.fold(Self::default(), |used, d| Self {
            requests: used.requests + 1,
            tokens: used.tokens + d.tokens,
            input: used.input + d.input,
            output: used.output + d.output,
        })
    }
}

impl QuotaSpec {
    fn rate(&self, binding: Binding) -> f64 {
        let amount = match binding {
            Binding::Requests => self.rpm,
            Binding::Tokens => self.tpm,
        };
        amount as f64 / self.minute.as_secs_f64()
    }

    /// The theoretical minimum time of `work`: the binding dimension's total divided by its
    /// nominal rate (`tokens / TPM` or `requests / RPM`, whichever is longer).
    pub(crate) fn theoretical_minimum(&self, work: Consumption) -> (Duration, Binding) {
        let by_requests = work.requests as f64 / self.rate(Binding::Requests);
        let by_tokens = work.tokens as f64 / self.rate(Binding::Tokens);
        if by_tokens >= by_requests {
            (Duration::from_secs_f64(by_tokens), Binding::Tokens)
        } else {
            (Duration::from_secs_f64(by_requests), Binding::Requests)
        }
    }

    /// The shortest time the work can take when the provider's bucket starts full (a whole
    /// minute of quota, spendable at once): for each dimension, what the work consumed beyond
    /// that bucket at the nominal rate; the longest of them.
    pub(crate) fn burst_bound(&self, work: Consumption) -> Duration {
        let beyond = |used: u64, binding| {
            let bucket = self.rate(binding) * self.minute.as_secs_f64();
            (used as f64 - bucket).max(0.0) / self.rate(binding)
        };
        let requests = beyond(work.requests, Binding::Requests);
        let tokens = beyond(work.tokens, Binding::Tokens);
        Duration::from_secs_f64(requests.max(tokens))
    }

    /// The share of the quota a run used: what it consumed of `binding` divided by the
    /// nominal rate × its wall time.
    pub(crate) fn utilisation(&self, used: Consumption, binding: Binding, wall: Duration) -> f64 {
        let consumed = match binding {
            Binding::Requests => used.requests,
            Binding::Tokens => used.tokens,
        };
        let capacity = self.rate(binding) * wall.as_secs_f64();
        if capacity > 0.0 {
            consumed as f64 / capacity
        } else {
            0.0
        }
    }
}
