//! What to do with a request: refuse it, reset it, or admit it (charging the quota).

use std::sync::{Arc, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method};

use super::*;
use crate::config::Style;
use crate::stats::{Entry, Rejection};
use crate::wire::{self, ChatRequest, Completion, RateLimited, Refusal};
use crate::{anthropic, gemini, openai};

impl Engine {
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
        let embeddings = style == Style::OpenAi && path.ends_with("/embeddings");
        let gemini = gemini::route(path);
        let routed = match style {
            Style::OpenAi => path.ends_with("/chat/completions") || embeddings,
            Style::Anthropic => path.ends_with("/messages"),
            Style::Gemini => gemini.is_some(),
        };
        if !routed {
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
            Style::Gemini => gemini::api_key(headers),
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
                Style::OpenAi if embeddings => openai::parse_embeddings(&body),
                Style::OpenAi => openai::parse(&body, self.config.default_max_tokens),
                Style::Anthropic => anthropic::parse(&body),
                Style::Gemini => {
                    let (model, method) = gemini.unwrap_or(("", gemini::Method::Generate));
                    gemini::parse(model, method, &body, self.config.default_max_tokens)
                }
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
        if let Some((_, gemini::Method::CountTokens)) = gemini {
            // Counting tokens bills nothing and draws on no limit here.
            let mut headers = HeaderMap::new();
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            return Outcome::Answer {
                status: http::StatusCode::OK,
                headers,
                body: gemini::token_count(&request),
            };
        }
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
        // Drawn from the same number as server errors: requests that are not flex see the
        // same faults whatever this share.
        let flex = request.service_tier.as_deref() == Some("flex");
        if flex && error < faults.server_errors + faults.flex_unavailable {
            state.counters.tier_unavailable += 1;
            return self.refuse(
                &mut state,
                Some(organization),
                now,
                Refusal::TierUnavailable,
            );
        }
        let key = crate::keys::key_of(headers);
        if let (Some(ttl), Some(key)) = (self.config.idempotency_ttl, key) {
            if let Some(replay) = self.idempotency_keys.replay(key, now, style) {
                return Outcome::Answer {
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
    pub(super) fn keep(
        &self,
        outcome: Outcome,
        key: &str,
        now: u64,
        ttl: Option<Duration>,
    ) -> Outcome {
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
    pub(super) fn admit(
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
            if let Outcome::Answer { headers, .. } = &mut outcome {
                let wait = Duration::from_nanos(wait);
                let secs = wait.as_nanos().div_ceil(1_000_000_000);
                let millis = wait.as_nanos().div_ceil(1_000_000);
                // Google sends its wait in the body only (`RetryInfo`).
                if self.config.style != Style::Gemini {
                    headers.insert(http::header::RETRY_AFTER, HeaderValue::from(secs as u64));
                }
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
        let (text, completion_tokens) = if request.embeddings.is_some() {
            (None, 0)
        } else if request.group.is_empty() {
            let tokens = wire::completion_tokens(
                request.max_tokens,
                self.config.completion_share,
                request.prompt_hash,
                self.config.seed,
            );
            (None, tokens)
        } else {
            state.counters.grouped_answers += 1;
            let (text, tokens) = crate::group::answer(
                &request.group,
                request.max_tokens,
                self.config.completion_share,
                self.config.seed,
                self.config.group_faults,
                &mut state.rng,
            );
            (Some(text), tokens)
        };
        drop(state);
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
            text,
            service_tier: request.service_tier.as_deref().map(openai::served_tier),
            embeddings: request.embeddings,
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

    pub(super) fn next_id(&self, state: &mut State) -> String {
        state.next_id += 1;
        match self.config.style {
            Style::OpenAi => format!("chatcmpl-sim{:08}", state.next_id),
            Style::Anthropic => format!("msg_sim{:08}", state.next_id),
            Style::Gemini => format!("sim{:08}", state.next_id),
        }
    }

    /// A refusal's response; with the rate-limit headers when the organisation is known.
    pub(super) fn refuse(
        &self,
        state: &mut State,
        organization: Option<usize>,
        now: u64,
        refusal: Refusal,
    ) -> Outcome {
        let (status, body) = match self.config.style {
            Style::OpenAi => openai::refusal(&refusal),
            Style::Anthropic => anthropic::refusal(&refusal),
            Style::Gemini => gemini::refusal(&refusal),
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
        Outcome::Answer {
            status,
            headers,
            body,
        }
    }
}
