//! A simulated LLM provider that enforces quota like the real ones.
//!
//! Test a quota configuration, a retry policy or a whole batch job against a provider that
//! speaks the OpenAI Chat Completions, the Anthropic Messages or Google's Gemini API, counts tokens, answers
//! 429 when a bucket is empty, sends the providers' rate-limit headers, usage and error bodies,
//! and injects faults on demand. One engine serves two forms:
//!
//! - [`Simulator::service`]: an in-process tower [`Service`](tower::Service) over
//!   `http::Request`s. It only uses tokio's clock, so under a paused clock
//!   (`#[tokio::test(start_paused = true)]`) a day of traffic runs in milliseconds.
//! - [`Simulator::serve`]: an HTTP/1.1 server on a local socket, for clients that need a URL
//!   (`POST /v1/chat/completions` or `POST /v1/messages`).
//!
//! One simulator speaks one [`Style`], chosen by its configuration; its path must end with
//! `/chat/completions` or `/embeddings` (OpenAI: a vector of 8 numbers per input, the input
//! counted as the prompt, nothing generated) or `/messages` (Anthropic), or name a model and
//! its method, `/v1beta/models/{model}:generateContent` (Gemini: also
//! `:streamGenerateContent`, as events with `?alt=sse` or else one JSON array, `:countTokens`,
//! which bills nothing, `:embedContent`, `:batchEmbedContents`, and `GET /v1beta/models`).
//! For several providers, run several simulators.
//!
//! # The quota
//!
//! Every organisation has one token bucket per limit: capacity the amount per period,
//! refilling continuously at amount per period. A request is admitted only if every bucket
//! can pay its cost now; otherwise it gets a 429 with `retry-after` (whole seconds, rounded
//! up) and, OpenAI style only, `retry-after-ms`, blaming the limit with the longest wait. A
//! cost above a bucket's capacity can never be admitted: 400 (`request_too_large` for
//! OpenAI, `invalid_request_error` for Anthropic), not 429; nor can a `max_tokens` above
//! [`SimConfig::max_output_tokens`].
//!
//! | Dimension | Charged at admission | Corrected when the completion ends |
//! |---|---|---|
//! | requests | 1 | |
//! | input tokens (Anthropic ITPM) | the prompt | |
//! | output tokens (Anthropic OTPM) | `max_tokens` | to the completion (the rest refunded) |
//! | total tokens (OpenAI TPM) | prompt + `max_tokens` | to prompt + completion |
//!
//! # Tokens and latency
//!
//! - Prompt tokens: for each message (and the Anthropic `system` prompt), 4 plus a quarter of
//!   the characters of its text, rounded up (a string `content`, or the `text` of each block).
//! - Completion tokens: between 10 % and 100 % of `max_tokens` (see
//!   [`SimConfig::completion_share`]), picked by a hash of the prompt text and the seed, so the
//!   same request always gets the same length. OpenAI requests without `max_tokens` use
//!   [`SimConfig::default_max_tokens`]. Each token is four characters of text.
//! - Latency: [`SimConfig::latency`]'s base before the first token, then its per-token time
//!   for each token. A non-streamed response comes whole at the end; a stream
//!   (`"stream": true`) sends its head and first events after the base latency and its text
//!   over the generation time, in at most 16 content events.
//!
//! # Headers
//!
//! Every response to an authenticated request (admitted or refused) carries the rate-limit
//! headers of the per-minute limits as they stand when its head is sent: OpenAI
//! `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (resets as Go durations, the time
//! until the bucket is full, rounded up to the millisecond); Anthropic
//! `anthropic-ratelimit-{requests,input-tokens,output-tokens}-{limit,remaining,reset}`
//! (resets as RFC 3339 with milliseconds: the wall clock now plus the simulated time until
//! full). Remaining values are exact, not rounded. Both parse with
//! [`Profile::limits`](tower_llm_quota::provider::Profile::limits).
//!
//! # Errors and faults
//!
//! | Status | When | Body |
//! |---|---|---|
//! | 401 | no or unknown key (`Authorization: Bearer` / `x-api-key`) | `invalid_api_key` / `authentication_error` |
//! | 400 | bad JSON, no `messages`, a non-positive or (Anthropic) missing `max_tokens`, a cost above a limit | `invalid_request_error` |
//! | 404, 405 | another path, another method | |
//! | 429 | a bucket cannot pay now | `rate_limit_exceeded` with `type` `requests` or `tokens` / `rate_limit_error` |
//! | 500, 503, 529 | injected ([`Faults::server_errors`]) | `server_error` / `api_error`, `overloaded_error` |
//! | 429 "Resource Unavailable" | injected for OpenAI flex requests ([`Faults::flex_unavailable`]), not charged | `resource_unavailable` |
//!
//! Faults ([`SimConfig::faults`]) are drawn per valid, authenticated request from a generator
//! seeded with [`SimConfig::seed`]; a request answered with an injected error or reset is not
//! charged. [`Faults::streamed_error_bodies`] pads and streams their error bodies with no length.
//! [`SimConfig::lower_limit_at`] lowers a limit at a given instant, and
//! [`SimConfig::neighbour`] adds another client, unseen by the simulator's clients, spending a
//! share of an organisation's quota (its admissions and 429s counted apart).
//!
//! # Statistics
//!
//! [`Simulator::stats`] counts requests by outcome (admitted, 429 per limit, 400/401,
//! injected faults), tokens charged, the largest amount admitted in any sliding window of each
//! limit's period (each admission at its admission instant, with its final usage), and a time
//! series of admissions and 429s per interval. It keeps one record of 32 bytes per admission
//! and of 24 bytes per 429, so a run of a million requests holds a few tens of megabytes;
//! [`Simulator::reset_stats`] frees them.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tower::ServiceExt;
//! use tower_llm_quota::Dimension;
//! use tower_llm_quota_sim::{SimConfig, Simulator};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let simulator = Simulator::new(
//!     SimConfig::openai(60, 10_000)
//!         .minute(Duration::from_secs(2))
//!         .latency(Duration::from_millis(5), Duration::ZERO)
//!         .key("sk-a", "org-1"),
//! );
//! let request = http::Request::post("/v1/chat/completions")
//!     .header("authorization", "Bearer sk-a")
//!     .body(http_body_util::Full::new(bytes::Bytes::from(
//!         r#"{"model":"m","max_tokens":50,"messages":[{"role":"user","content":"Hello!"}]}"#,
//!     )))?;
//! let response = simulator.service().oneshot(request).await?;
//! assert_eq!(response.status(), 200);
//! assert_eq!(response.headers()["x-ratelimit-limit-requests"], "60");
//!
//! // The same engine over HTTP.
//! let server = simulator.serve("127.0.0.1:0".parse()?).await?;
//! let _url = format!("{}/v1/chat/completions", server.url());
//! server.shutdown().await;
//!
//! let stats = simulator.stats();
//! assert_eq!(stats.admitted, 1);
//! assert_eq!(stats.limit(Dimension::Requests).map(|l| l.max_in_window), Some(1));
//! # Ok(())
//! # }
//! ```

mod anthropic;
mod bucket;
mod config;
mod engine;
mod gemini;
mod group;
mod keys;
mod openai;
mod server;
mod service;
mod stats;
mod wire;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

pub use config::{Faults, GroupFaults, SimConfig, Style};
pub use server::SimServer;
pub use service::{SimBody, SimResponseFuture, SimService};
pub use stats::{LimitStats, SeriesPoint, SimStats};

use engine::Engine;

/// A simulated provider: a cheap, cloneable handle on one engine (its buckets, faults and
/// statistics), shared by its [services](Self::service) and [servers](Self::serve).
///
/// The service is generic over the request body, so call it with
/// [`oneshot`](tower::ServiceExt::oneshot), or name the request type when waiting for
/// readiness: `ServiceExt::<http::Request<Full<Bytes>>>::ready(&mut service)`.
#[derive(Debug, Clone)]
pub struct Simulator {
    engine: Arc<Engine>,
}

impl Simulator {
    /// A simulator of `config`. Its clock starts now (tokio's clock: call it inside the
    /// runtime whose clock the requests use).
    pub fn new(config: SimConfig) -> Self {
        Self {
            engine: Arc::new(Engine::new(config)),
        }
    }

    /// The in-process provider, as a tower service.
    pub fn service(&self) -> SimService {
        SimService::new(Arc::clone(&self.engine))
    }

    /// Serves the provider over HTTP/1.1 on `addr` (port 0 picks a free port), until the
    /// returned server is dropped or shut down. Must be called inside a tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes closes the listener, if it was bound: nothing
    /// is served until it returns.
    pub async fn serve(&self, addr: SocketAddr) -> io::Result<SimServer> {
        SimServer::bind(Arc::clone(&self.engine), addr).await
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> SimStats {
        self.engine.stats()
    }

    /// Zeroes the statistics (the buckets keep their levels).
    pub fn reset_stats(&self) {
        self.engine.reset_stats();
        self.engine.idempotency_keys.clear();
    }

    /// Admitted (billed) calls per `idempotency-key` request header: a key counted more than
    /// once is an operation billed more than once. Calls without the header are not counted
    /// here.
    pub fn calls_by_idempotency_key(&self) -> std::collections::HashMap<String, u64> {
        self.engine.idempotency_keys.snapshot()
    }

    /// Requests answered again from an honoured idempotency key, without billing (see
    /// [`SimConfig::honour_idempotency_keys`]).
    pub fn idempotent_replays(&self) -> u64 {
        self.engine.idempotency_keys.replayed()
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        self.engine.config()
    }
}

// The README's example runs as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
