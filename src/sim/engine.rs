//! Admission and accounting: the state both the in-process service and the HTTP server share.
//!
//! One mutex guards everything (buckets, generator, statistics); it is held only for
//! arithmetic, never across an await.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use tokio::time::Instant;

use super::bucket::Bucket;
use super::config::{Period, SimConfig, Style};
use super::stats::{self, Counters, Entry, Rejection};
use super::wire::{self, ChatRequest, Completion, Level, RateLimited, Refusal};
use super::{SimStats, anthropic, openai};
use crate::quota::Dimension;

/// The organisation of every key when none is configured.
const DEFAULT_ORGANIZATION: &str = "default";

/// A limit as enforced: its bucket's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Enforced {
    pub(crate) dimension: Dimension,
    /// The window the limit counts over (the minute, a part of it, or a fixed period).
    pub(crate) window: Duration,
    /// 1 for a whole period, `n` for a sub-window of `1/n` of the minute.
    pub(crate) parts: u32,
    /// Whether the limit is per (simulated) minute: it is lowered by quota changes, and its
    /// whole-period form is reported in headers.
    pub(crate) per_minute: bool,
}

impl Enforced {
    /// Whether the headers report this limit.
    fn reported(&self) -> bool {
        self.per_minute && self.parts == 1
    }

    /// The capacity of this limit's bucket for a nominal per-period `amount`.
    fn capacity(&self, amount: u64) -> u64 {
        (amount / u64::from(self.parts)).max(1)
    }
}

/// The simulator's state, shared by every handle.
#[derive(Debug)]
pub(crate) struct Engine {
    config: SimConfig,
    epoch: Instant,
    limits: Vec<Enforced>,
    organizations: Vec<String>,
    keys: HashMap<String, usize>,
    /// The neighbour's organisation, request cost and pace (nanoseconds between requests).
    neighbour: Option<(usize, u64, u64)>,
    state: Mutex<State>,
    /// Admitted calls per idempotency key.
    pub(crate) idempotency_keys: super::keys::KeyCounts,
}

#[derive(Debug)]
struct State {
    /// Per organisation, one bucket per enforced limit.
    buckets: Vec<Vec<Bucket>>,
    /// The nominal per-period amount of each enforced limit (lowered by quota changes).
    amounts: Vec<u64>,
    /// How many quota changes (sorted by instant) are in effect.
    changes_applied: usize,
    /// When the neighbour sends its next request.
    neighbour_next: u64,
    rng: fastrand::Rng,
    next_id: u64,
    counters: Counters,
    entries: Vec<Entry>,
    rejections: Vec<Rejection>,
    /// Bumped by a statistics reset, so that settlements of older admissions leave the new
    /// log alone.
    generation: u64,
    stats_since: u64,
}

/// What to do with a request.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Answer at once with this status, headers and body.
    Refused {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
    /// Reset the connection.
    Reset,
    /// Admitted: generate the completion.
    Admitted(Admitted),
}

/// An admitted request: what to generate and when.
#[derive(Debug)]
pub(crate) struct Admitted {
    pub(crate) completion: Completion,
    pub(crate) stream: bool,
    /// The wait before the first token (base latency plus any spike).
    pub(crate) first_token: Duration,
    pub(crate) per_token: Duration,
    /// Settles the usage when dropped.
    pub(crate) settlement: Settlement,
}

/// The correction of an admission to the real usage, applied when dropped: the unused part
/// of `max_tokens` goes back to the output and total-token buckets.
#[derive(Debug)]
pub(crate) struct Settlement {
    engine: Arc<Engine>,
    organization: usize,
    max_tokens: u64,
    completion_tokens: u64,
    entry: (u64, usize),
}

impl Settlement {
    /// The organisation charged.
    pub(crate) fn organization(&self) -> usize {
        self.organization
    }
}

impl Drop for Settlement {
    fn drop(&mut self) {
        self.engine.settle(self);
    }
}

impl Engine {
    pub(crate) fn new(config: SimConfig) -> Self {
        let epoch = Instant::now();
        let mut organizations: Vec<String> = Vec::new();
        let mut keys = HashMap::new();
        for (key, organization) in &config.keys {
            let index = match organizations.iter().position(|o| o == organization) {
                Some(index) => index,
                None => {
                    organizations.push(organization.clone());
                    organizations.len() - 1
                }
            };
            keys.insert(key.clone(), index);
        }
        if organizations.is_empty() {
            organizations.push(DEFAULT_ORGANIZATION.to_owned());
        }
        let mut limits = Vec::new();
        let mut amounts = Vec::new();
        for spec in &config.limits {
            let (window, per_minute) = match spec.period {
                Period::Minute => (config.minute, true),
                Period::Fixed(period) => (period, false),
            };
            if spec.amount == 0 || window.is_zero() {
                continue;
            }
            limits.push(Enforced {
                dimension: spec.dimension,
                window,
                parts: 1,
                per_minute,
            });
            amounts.push(spec.amount);
            for &(dimension, parts) in &config.sub_windows {
                let window = config.minute / parts;
                if per_minute && dimension == spec.dimension && !window.is_zero() {
                    limits.push(Enforced {
                        dimension,
                        window,
                        parts,
                        per_minute,
                    });
                    amounts.push(spec.amount);
                }
            }
        }
        let buckets = organizations
            .iter()
            .map(|_| {
                limits
                    .iter()
                    .zip(&amounts)
                    .map(|(limit, &amount)| {
                        Bucket::full(limit.capacity(amount), nanos(limit.window), 0)
                    })
                    .collect()
            })
            .collect();
        let mut config = config;
        config.changes.sort_by_key(|change| change.at);
        let neighbour = config.neighbour.as_ref().and_then(|spec| {
            let organization = organizations.iter().position(|o| *o == spec.organization)?;
            let tokens = limits.iter().zip(&amounts).find(|(limit, _)| {
                limit.per_minute
                    && limit.parts == 1
                    && matches!(
                        limit.dimension,
                        Dimension::TotalTokens | Dimension::InputTokens
                    )
            })?;
            let per_minute = *tokens.1 as f64 * spec.share;
            if per_minute <= 0.0 {
                return None;
            }
            let every =
                config.minute.as_nanos() as f64 * spec.tokens_per_request as f64 / per_minute;
            Some((organization, spec.tokens_per_request, (every as u64).max(1)))
        });
        let state = State {
            buckets,
            amounts,
            changes_applied: 0,
            neighbour_next: 0,
            rng: fastrand::Rng::with_seed(config.seed),
            next_id: 0,
            counters: Counters::default(),
            entries: Vec::new(),
            rejections: Vec::new(),
            generation: 0,
            stats_since: 0,
        };
        Self {
            config,
            epoch,
            limits,
            organizations,
            keys,
            neighbour,
            state: Mutex::new(state),
            idempotency_keys: super::keys::KeyCounts::default(),
        }
    }

    pub(crate) fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Nanoseconds since the simulator started, on tokio's clock.
    fn now(&self) -> u64 {
        nanos(Instant::now().saturating_duration_since(self.epoch))
    }

    /// The state, with every quota change and neighbour request due by now in effect, and
    /// the instant: read under the lock, so instants are recorded in order.
    fn lock(&self) -> (MutexGuard<'_, State>, u64) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.now();
        loop {
            let change = self
                .config
                .changes
                .get(state.changes_applied)
                .map(|change| nanos(change.at))
                .filter(|&at| at <= now);
            let neighbour = self
                .neighbour
                .map(|_| state.neighbour_next)
                .filter(|&at| at <= now);
            match (change, neighbour) {
                (Some(change), Some(neighbour)) if neighbour < change => {
                    self.neighbour_request(&mut state, neighbour)
                }
                (Some(change), _) => self.apply_change(&mut state, change),
                (None, Some(neighbour)) => self.neighbour_request(&mut state, neighbour),
                (None, None) => break,
            }
        }
        (state, now)
    }

    /// Puts the next quota change, due at `at`, in effect.
    fn apply_change(&self, state: &mut State, at: u64) {
        let change = self.config.changes[state.changes_applied];
        for (i, limit) in self.limits.iter().enumerate() {
            if limit.per_minute && limit.dimension == change.dimension {
                let amount = change.amount.max(1);
                state.amounts[i] = amount;
                let capacity = limit.capacity(amount);
                for buckets in &mut state.buckets {
                    buckets[i].set_capacity(at, capacity);
                }
            }
        }
        state.changes_applied += 1;
    }

    /// The neighbour's request due at `at`: charged to every limit if they can all pay it,
    /// else refused.
    fn neighbour_request(&self, state: &mut State, at: u64) {
        let Some((organization, tokens, every)) = self.neighbour else {
            return;
        };
        state.neighbour_next = at.saturating_add(every);
        let buckets = &mut state.buckets[organization];
        let costs: Vec<u64> = self
            .limits
            .iter()
            .map(|limit| cost(limit.dimension, tokens, 0))
            .collect();
        let fits = buckets
            .iter_mut()
            .zip(&costs)
            .all(|(bucket, &cost)| bucket.wait_for(at, cost) == Some(0));
        if fits {
            for (bucket, &cost) in buckets.iter_mut().zip(&costs) {
                bucket.take(at, cost);
            }
            state.counters.neighbour_admitted += 1;
            state.counters.neighbour_tokens += tokens;
        } else {
            state.counters.neighbour_rate_limited += 1;
        }
    }

    /// Decides what to do with a request: refuse it, reset it, or admit it (charging the
    /// quota).
    pub(crate) fn decide(
        self: &Arc<Self>,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
        body: Result<Bytes, Refusal>,
    ) -> Outcome {
        let (mut state, now) = self.lock();
        state.counters.received += 1;
        let style = self.config.style;
        let route = match style {
            Style::OpenAi => "/chat/completions",
            Style::Anthropic => "/messages",
        };
        if !path.ends_with(route) {
            state.counters.bad_requests += 1;
            return self.refuse(&mut state, None, now, Refusal::NotFound(path.to_owned()));
        }
        if method != Method::POST {
            state.counters.bad_requests += 1;
            return self.refuse(&mut state, None, now, Refusal::MethodNotAllowed);
        }
        let key = match style {
            Style::OpenAi => openai::api_key(headers),
            Style::Anthropic => anthropic::api_key(headers),
        };
        let organization = match key {
            Some(_) if self.keys.is_empty() => Some(0),
            Some(key) => self.keys.get(key).copied(),
            None => None,
        };
        let Some(organization) = organization else {
            state.counters.unauthorized += 1;
            return self.refuse(&mut state, None, now, Refusal::Unauthorized);
        };
        let parsed = body.and_then(|body| {
            match style {
                Style::OpenAi => openai::parse(&body, self.config.default_max_tokens),
                Style::Anthropic => anthropic::parse(&body),
            }
            .map_err(Refusal::Invalid)
        });
        let parsed = parsed.and_then(|request| {
            if request.max_tokens > self.config.max_output_tokens {
                Err(Refusal::Invalid(format!(
                    "max_tokens is too large: {} (this model supports at most {})",
                    request.max_tokens, self.config.max_output_tokens
                )))
            } else {
                Ok(request)
            }
        });
        let request = match parsed {
            Ok(request) => request,
            Err(refusal) => {
                state.counters.bad_requests += 1;
                return self.refuse(&mut state, Some(organization), now, refusal);
            }
        };
        // Always four draws, so a request's faults do not depend on the previous outcomes.
        let faults = self.config.faults;
        let (reset, error, spike, which) = (
            state.rng.f64(),
            state.rng.f64(),
            state.rng.f64(),
            state.rng.bool(),
        );
        if reset < faults.connection_resets {
            state.counters.connection_resets += 1;
            return Outcome::Reset;
        }
        if error < faults.server_errors {
            state.counters.server_errors += 1;
            let refusal = if which {
                Refusal::ServerError
            } else {
                Refusal::Overloaded
            };
            return self.refuse(&mut state, Some(organization), now, refusal);
        }
        let key = super::keys::key_of(headers);
        if let (Some(ttl), Some(key)) = (self.config.idempotency_ttl, key) {
            if let Some(replay) = self.idempotency_keys.replay(key, now, style) {
                return Outcome::Refused {
                    status: replay.status,
                    headers: replay.headers,
                    body: replay.body,
                };
            }
            // The key is held from here (a duplicate meanwhile gets 409) until the outcome
            // is known.
            let outcome = self.admit(
                state,
                organization,
                now,
                request,
                spike < faults.latency_spikes,
            );
            return self.keep(outcome, key, now, Some(ttl));
        }
        let outcome = self.admit(
            state,
            organization,
            now,
            request,
            spike < faults.latency_spikes,
        );
        match key {
            Some(key) => self.keep(outcome, key, now, None),
            None => outcome,
        }
    }

    /// Counts an admission under its idempotency key, kept for `ttl` when keys are honoured.
    fn keep(&self, outcome: Outcome, key: &str, now: u64, ttl: Option<Duration>) -> Outcome {
        if let Outcome::Admitted(admitted) = &outcome {
            let kept =
                ttl.map(|ttl| {
                    let generation = admitted.first_token.saturating_add(
                        admitted.per_token.saturating_mul(
                            u32::try_from(admitted.completion.completion_tokens)
                                .unwrap_or(u32::MAX),
                        ),
                    );
                    let done_at = now.saturating_add(nanos(generation));
                    (
                        &admitted.completion,
                        admitted.stream,
                        done_at,
                        done_at.saturating_add(nanos(ttl)),
                    )
                });
            self.idempotency_keys.billed(key, kept);
        } else if ttl.is_some() {
            // Not admitted: nothing billed, the key is free again.
            self.idempotency_keys.forget(key);
        }
        outcome
    }

    /// Charges the request to every limit, or refuses it.
    fn admit(
        self: &Arc<Self>,
        mut state: MutexGuard<'_, State>,
        organization: usize,
        now: u64,
        request: ChatRequest,
        spike: bool,
    ) -> Outcome {
        let costs: Vec<u64> = self
            .limits
            .iter()
            .map(|limit| cost(limit.dimension, request.prompt_tokens, request.max_tokens))
            .collect();
        let mut refusing: Option<(usize, u64)> = None;
        for (i, &cost) in costs.iter().enumerate() {
            let bucket = &mut state.buckets[organization][i];
            match bucket.wait_for(now, cost) {
                None => {
                    let limit = &self.limits[i];
                    let message = format!(
                        "Request too large for {} in organization {} on {} {}: Limit {}, \
                         Requested {}. The input or output tokens must be reduced in order to \
                         run successfully.",
                        request.model,
                        self.organizations[organization],
                        limit.dimension,
                        wire::per(limit.dimension, limit.window, self.config.minute),
                        bucket.capacity(),
                        cost,
                    );
                    state.counters.bad_requests += 1;
                    return self.refuse(
                        &mut state,
                        Some(organization),
                        now,
                        Refusal::TooLarge(message),
                    );
                }
                Some(0) => {}
                Some(wait) if refusing.is_none_or(|(_, longest)| wait > longest) => {
                    refusing = Some((i, wait));
                }
                Some(_) => {}
            }
        }
        if let Some((i, wait)) = refusing {
            let limit = self.limits[i];
            let bucket = &mut state.buckets[organization][i];
            let limited = RateLimited {
                organization: self.organizations[organization].clone(),
                model: request.model,
                dimension: limit.dimension,
                per: wire::per(limit.dimension, limit.window, self.config.minute),
                limit: bucket.capacity(),
                remaining: bucket.remaining(now),
                requested: costs[i],
                wait: Duration::from_nanos(wait),
            };
            state.counters.rate_limited += 1;
            state.rejections.push(Rejection {
                at: now,
                organization,
                limit: i,
            });
            let mut outcome = self.refuse(
                &mut state,
                Some(organization),
                now,
                Refusal::RateLimited(limited),
            );
            if let Outcome::Refused { headers, .. } = &mut outcome {
                let wait = Duration::from_nanos(wait);
                let secs = wait.as_nanos().div_ceil(1_000_000_000);
                let millis = wait.as_nanos().div_ceil(1_000_000);
                headers.insert(http::header::RETRY_AFTER, HeaderValue::from(secs as u64));
                // Anthropic sends whole seconds only; OpenAI-compatible servers add milliseconds.
                if self.config.style == Style::OpenAi {
                    headers.insert("retry-after-ms", HeaderValue::from(millis as u64));
                }
            }
            return outcome;
        }
        for (i, &cost) in costs.iter().enumerate() {
            state.buckets[organization][i].take(now, cost);
        }
        state.counters.admitted += 1;
        state.counters.prompt_tokens += request.prompt_tokens;
        if spike {
            state.counters.latency_spikes += 1;
        }
        let entry = (state.generation, state.entries.len());
        state.entries.push(Entry {
            at: now,
            organization,
            input: request.prompt_tokens,
            output: request.max_tokens,
        });
        let id = self.next_id(&mut state);
        drop(state);
        let completion_tokens = wire::completion_tokens(
            request.max_tokens,
            self.config.completion_share,
            request.prompt_hash,
            self.config.seed,
        );
        let completion = Completion {
            id,
            model: request.model,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
            prompt_tokens: request.prompt_tokens,
            completion_tokens,
            max_tokens: request.max_tokens,
            include_usage: request.include_usage,
        };
        let extra = if spike {
            self.config.faults.spike
        } else {
            Duration::ZERO
        };
        Outcome::Admitted(Admitted {
            completion,
            stream: request.stream,
            first_token: self.config.base_latency.saturating_add(extra),
            per_token: self.config.per_output_token,
            settlement: Settlement {
                engine: Arc::clone(self),
                organization,
                max_tokens: request.max_tokens,
                completion_tokens,
                entry,
            },
        })
    }

    fn next_id(&self, state: &mut State) -> String {
        state.next_id += 1;
        match self.config.style {
            Style::OpenAi => format!("chatcmpl-sim{:08}", state.next_id),
            Style::Anthropic => format!("msg_sim{:08}", state.next_id),
        }
    }

    /// A refusal's response; with the rate-limit headers when the organisation is known.
    fn refuse(
        &self,
        state: &mut State,
        organization: Option<usize>,
        now: u64,
        refusal: Refusal,
    ) -> Outcome {
        let (status, body) = match self.config.style {
            Style::OpenAi => openai::refusal(&refusal),
            Style::Anthropic => anthropic::refusal(&refusal),
        };
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let id = format!("req_sim{:08}", {
            state.next_id += 1;
            state.next_id
        });
        self.common_headers(state, organization, now, id, &mut headers);
        Outcome::Refused {
            status,
            headers,
            body,
        }
    }

    /// The request id and, for a known organisation, the rate-limit headers.
    fn common_headers(
        &self,
        state: &mut State,
        organization: Option<usize>,
        now: u64,
        id: String,
        headers: &mut HeaderMap,
    ) {
        let id_header = match self.config.style {
            Style::OpenAi => "x-request-id",
            Style::Anthropic => "request-id",
        };
        if let Ok(id) = HeaderValue::try_from(id) {
            headers.insert(id_header, id);
        }
        let Some(organization) = organization else {
            return;
        };
        let levels: Vec<Level> = self
            .limits
            .iter()
            .enumerate()
            .filter(|(_, limit)| limit.reported())
            .map(|(i, limit)| {
                let bucket = &mut state.buckets[organization][i];
                Level {
                    dimension: limit.dimension,
                    limit: state.amounts[i],
                    remaining: bucket.remaining(now),
                    until_full: Duration::from_nanos(bucket.until_full(now)),
                }
            })
            .collect();
        match self.config.style {
            Style::OpenAi => openai::rate_limit_headers(&levels, headers),
            Style::Anthropic => anthropic::rate_limit_headers(&levels, headers),
        }
    }

    /// The headers of an admitted response, as the quota stands when its head is sent.
    pub(crate) fn response_headers(
        &self,
        organization: usize,
        stream: bool,
        completion_id: &str,
    ) -> HeaderMap {
        let (mut state, now) = self.lock();
        let mut headers = HeaderMap::new();
        let content_type = if stream {
            "text/event-stream; charset=utf-8"
        } else {
            "application/json"
        };
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static(content_type),
        );
        let id = completion_id
            .replace("chatcmpl-sim", "req_sim")
            .replace("msg_sim", "req_sim");
        self.common_headers(&mut state, Some(organization), now, id, &mut headers);
        headers
    }

    /// Replaces the admission's `max_tokens` with the real completion.
    fn settle(&self, settlement: &Settlement) {
        let (mut state, now) = self.lock();
        let unused = settlement
            .max_tokens
            .saturating_sub(settlement.completion_tokens);
        for (i, limit) in self.limits.iter().enumerate() {
            if matches!(
                limit.dimension,
                Dimension::OutputTokens | Dimension::TotalTokens
            ) {
                state.buckets[settlement.organization][i].give_back(now, unused);
            }
        }
        state.counters.completed += 1;
        state.counters.completion_tokens = state
            .counters
            .completion_tokens
            .saturating_add(settlement.completion_tokens);
        let (generation, index) = settlement.entry;
        if generation == state.generation {
            if let Some(entry) = state.entries.get_mut(index) {
                entry.output = settlement.completion_tokens;
            }
        }
    }

    /// A snapshot of the statistics.
    pub(crate) fn stats(&self) -> SimStats {
        let (mut state, now) = self.lock();
        let interval = self
            .config
            .series_interval
            .unwrap_or(self.config.minute / 60)
            .max(Duration::from_millis(1));
        let state = &mut *state;
        let limits = self
            .organizations
            .iter()
            .enumerate()
            .flat_map(|(o, name)| {
                self.limits
                    .iter()
                    .enumerate()
                    .map(move |(i, limit)| (o, name, i, limit))
            })
            .map(|(o, name, i, limit)| stats::LimitStats {
                organization: name.clone(),
                dimension: limit.dimension,
                window: limit.window,
                sub_window: (limit.parts > 1).then_some(limit.parts),
                amount: limit.capacity(state.amounts[i]),
                remaining: state.buckets[o][i].remaining(now),
                rate_limited: state
                    .rejections
                    .iter()
                    .filter(|r| r.organization == o && r.limit == i)
                    .count() as u64,
                max_in_window: stats::max_in_window(
                    &state.entries,
                    o,
                    limit.dimension,
                    nanos(limit.window),
                ),
            })
            .collect();
        stats::snapshot(
            &state.counters,
            limits,
            &state.entries,
            &state.rejections,
            state.stats_since,
            now,
            nanos(interval),
        )
    }

    /// Zeroes the statistics; the quota's state is kept.
    pub(crate) fn reset_stats(&self) {
        let (mut state, now) = self.lock();
        state.counters = Counters::default();
        state.entries.clear();
        state.rejections.clear();
        state.generation += 1;
        state.stats_since = now;
    }
}

/// What a request costs in `dimension` at admission.
fn cost(dimension: Dimension, prompt_tokens: u64, max_tokens: u64) -> u64 {
    match dimension {
        Dimension::Requests => 1,
        Dimension::InputTokens => prompt_tokens,
        Dimension::OutputTokens => max_tokens,
        Dimension::TotalTokens => prompt_tokens.saturating_add(max_tokens),
    }
}

/// A duration in nanoseconds, saturating.
pub(crate) fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}
