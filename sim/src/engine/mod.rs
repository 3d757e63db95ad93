//! Admission and accounting: the state both the in-process service and the HTTP server share.
//!
//! One mutex guards everything (buckets, generator, statistics); it is held only for
//! arithmetic, never across an await.
//!
//! This file holds the state and its clock; what the engine does with it is in one file per
//! concern: [`admission`] (decide, admit, refuse), [`headers`] (rate-limit headers), [`ledger`]
//! (settlements and statistics).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tokio::time::Instant;

use super::bucket::Bucket;
use super::config::{Period, SimConfig};
use super::stats::{Counters, Entry, Rejection};
use super::wire::Completion;
use tower_llm_quota::Dimension;

mod admission;
mod headers;
mod ledger;

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
    /// The neighbour's organisation, request cost, pace (nanoseconds between requests) and
    /// end (nanoseconds).
    neighbour: Option<(usize, u64, u64, u64)>,
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
    /// Answer at once with this status, headers and body (a refusal, a replay, a count of
    /// tokens).
    Answer {
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
            let until = spec.until.map_or(u64::MAX, nanos);
            Some((
                organization,
                spec.tokens_per_request,
                (every as u64).max(1),
                until,
            ))
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
                .filter(|&(.., until)| state.neighbour_next < until)
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
        let Some((organization, tokens, every, _)) = self.neighbour else {
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
}

/// A duration in nanoseconds, saturating.
pub(crate) fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// What a request costs in `dimension` at admission (the simulated provider prices nothing:
/// providers limit tokens and requests, not spend).
fn cost(dimension: Dimension, prompt_tokens: u64, max_tokens: u64) -> u64 {
    match dimension {
        Dimension::Requests => 1,
        Dimension::InputTokens => prompt_tokens,
        Dimension::OutputTokens => max_tokens,
        Dimension::TotalTokens => prompt_tokens.saturating_add(max_tokens),
        // Spend, and any dimension a later core adds.
        _ => 0,
    }
}
