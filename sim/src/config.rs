//! How a simulated provider behaves: its wire style, quota, latency, keys and faults.

use std::time::Duration;

use tower_llm_quota::Dimension;

const MINUTE: Duration = Duration::from_secs(60);

/// Which provider's API the simulator speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Style {
    /// OpenAI Chat Completions: `POST /v1/chat/completions`, `Authorization: Bearer <key>`,
    /// `x-ratelimit-*` headers, RPM and TPM (input plus output).
    OpenAi,
    /// Anthropic Messages: `POST /v1/messages`, `x-api-key: <key>`, `anthropic-ratelimit-*`
    /// headers, RPM, input TPM and output TPM.
    Anthropic,
    /// Google Gemini's native API: `POST /v1beta/models/{model}:generateContent` (and
    /// `:streamGenerateContent`, `:countTokens`, `:embedContent`, `:batchEmbedContents`),
    /// `GET /v1beta/models`, `x-goog-api-key: <key>` (or `?key=`), no rate-limit headers,
    /// a 429 `RESOURCE_EXHAUSTED` with `RetryInfo` and `QuotaFailure`; RPM and input TPM.
    Gemini,
}

/// The period a limit counts over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Period {
    /// The simulated minute ([`SimConfig::minute`]).
    Minute,
    /// A fixed length of (simulated) time.
    Fixed(Duration),
}

/// One configured limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LimitSpec {
    pub(crate) dimension: Dimension,
    pub(crate) amount: u64,
    pub(crate) period: Period,
    /// 1 for a whole period; `n` for a sub-window of `1/n` of the period holding `amount / n`.
    pub(crate) parts: u32,
}

/// A quota lowered without notice at a given instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QuotaChange {
    pub(crate) at: Duration,
    pub(crate) dimension: Dimension,
    pub(crate) amount: u64,
}

/// Another client on an organisation's quota, invisible to the simulator's clients.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NeighbourSpec {
    pub(crate) organization: String,
    pub(crate) share: f64,
    pub(crate) tokens_per_request: u64,
    /// When it stops spending, if it does.
    pub(crate) until: Option<Duration>,
}

/// Faults injected on demand, drawn from the simulator's seeded generator: the same seed and
/// the same sequence of requests give the same faults.
///
/// Each share is the probability, per valid authenticated request, of that fault; a request
/// answered with a server error or a reset is not charged to the quota. Shares are clamped to
/// `[0, 1]`.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_llm_quota_sim::Faults;
///
/// let faults = Faults::none()
///     .server_errors(0.05)
///     .connection_resets(0.01)
///     .latency_spikes(0.02, Duration::from_secs(5));
/// # let _ = faults;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Faults {
    pub(crate) server_errors: f64,
    pub(crate) connection_resets: f64,
    pub(crate) latency_spikes: f64,
    pub(crate) spike: Duration,
    pub(crate) error_body_bytes: usize,
    pub(crate) flex_unavailable: f64,
}

impl Faults {
    /// No faults (the default).
    pub fn none() -> Self {
        Self::default()
    }

    /// Answers `share` of the requests with a server error: 500 or 503 for OpenAI, 500 or 529
    /// (`overloaded_error`) for Anthropic, half each.
    pub fn server_errors(self, share: f64) -> Self {
        Self {
            server_errors: clamp_share(share),
            ..self
        }
    }

    /// Resets the connection of `share` of the requests: the in-process service fails with an
    /// [`std::io::Error`] of kind [`ConnectionReset`](std::io::ErrorKind::ConnectionReset);
    /// the HTTP server closes the connection without answering.
    pub fn connection_resets(self, share: f64) -> Self {
        Self {
            connection_resets: clamp_share(share),
            ..self
        }
    }

    /// Streams the body of every injected server error padded to `bytes` (its JSON followed
    /// by spaces), in chunks of 8 KiB with no length announced, as a proxy or a provider's
    /// HTML error page may. Off (0) by default: error bodies are small and whole.
    pub fn streamed_error_bodies(self, bytes: usize) -> Self {
        Self {
            error_body_bytes: bytes,
            ..self
        }
    }

    /// Answers `share` of the OpenAI requests asking for `service_tier: "flex"` with a 429
    /// "Resource Unavailable" (`code: resource_unavailable`), charging nothing, as OpenAI's
    /// flex tier does when it has no capacity. The answers of other tiers name the tier that
    /// served them (`service_tier`: `flex`, `priority`, else `default`) when asked for one.
    pub fn flex_unavailable(self, share: f64) -> Self {
        Self {
            flex_unavailable: clamp_share(share),
            ..self
        }
    }

    /// Adds `extra` latency before the first token of `share` of the admitted requests.
    pub fn latency_spikes(self, share: f64, extra: Duration) -> Self {
        Self {
            latency_spikes: clamp_share(share),
            spike: extra,
            ..self
        }
    }
}

/// Faults in the answers to grouped prompts (prompts whose items are marked
/// `<item id="...">`, as [`TextTemplate`](tower_llm_quota::group::TextTemplate)'s default renders them).
/// Each share is drawn per answer or per item from the simulator's seeded generator; shares
/// are clamped to `[0, 1]`. None by default.
///
/// # Example
///
/// ```
/// use tower_llm_quota_sim::GroupFaults;
///
/// // 2 % of the answers malformed; per item 1 % left out, 1 % under a wrong id; and an
/// // answer error growing with the group: 0.5 % per item beyond the first (4.5 % at 10,
/// // 19.5 % at 40).
/// let faults = GroupFaults::none()
///     .malformed(0.02)
///     .missing(0.01)
///     .wrong_id(0.01)
///     .per_extra_item(0.005);
/// # let _ = faults;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GroupFaults {
    pub(crate) malformed: f64,
    pub(crate) missing: f64,
    pub(crate) wrong_id: f64,
    pub(crate) invalid: f64,
    pub(crate) per_extra_item: f64,
}

impl GroupFaults {
    /// No faults (the default).
    pub fn none() -> Self {
        Self::default()
    }

    /// The share of grouped answers that are not valid JSON (the array cut in the middle).
    pub fn malformed(self, share: f64) -> Self {
        Self {
            malformed: clamp_share(share),
            ..self
        }
    }

    /// The share of items left out of the answer.
    pub fn missing(self, share: f64) -> Self {
        Self {
            missing: clamp_share(share),
            ..self
        }
    }

    /// The share of items answered under an id that is not theirs (an id of no item).
    pub fn wrong_id(self, share: f64) -> Self {
        Self {
            wrong_id: clamp_share(share),
            ..self
        }
    }

    /// The share of items whose answer is `null` (an answer that fails validation).
    pub fn invalid(self, share: f64) -> Self {
        Self {
            invalid: clamp_share(share),
            ..self
        }
    }

    /// An answer error that grows with the group: each item's answer is `null` with a
    /// probability of `share` times the number of other items in its group (on top of
    /// [`invalid`](Self::invalid)). A group of one is spared.
    pub fn per_extra_item(self, share: f64) -> Self {
        Self {
            per_extra_item: clamp_share(share),
            ..self
        }
    }
}

fn clamp_share(share: f64) -> f64 {
    if share.is_nan() {
        0.0
    } else {
        share.clamp(0.0, 1.0)
    }
}

/// The configuration of a [`Simulator`](super::Simulator), built in steps.
///
/// Start from [`SimConfig::openai`] or [`SimConfig::anthropic`] with the per-minute quota,
/// then adjust. A zero amount disables that limit. Every organisation gets its own buckets,
/// each with the same quota.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_llm_quota::Dimension;
/// use tower_llm_quota_sim::SimConfig;
///
/// let config = SimConfig::openai(60, 10_000)
///     .minute(Duration::from_secs(2)) // a minute lasts 2 s of (simulated) time
///     .limit(Dimension::Requests, 10_000, Duration::from_secs(2 * 60 * 24)) // per "day"
///     .sub_window(Dimension::Requests, 60) // RPM also enforced per 1/60 of the minute
///     .latency(Duration::from_millis(200), Duration::from_millis(10))
///     .key("sk-a", "org-1")
///     .key("sk-b", "org-1")
///     .seed(7);
/// # let _ = config;
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    pub(crate) style: Style,
    pub(crate) minute: Duration,
    pub(crate) limits: Vec<LimitSpec>,
    pub(crate) sub_windows: Vec<(Dimension, u32)>,
    pub(crate) changes: Vec<QuotaChange>,
    pub(crate) base_latency: Duration,
    pub(crate) per_output_token: Duration,
    pub(crate) completion_share: (f64, f64),
    pub(crate) default_max_tokens: u64,
    pub(crate) max_output_tokens: u64,
    pub(crate) seed: u64,
    pub(crate) keys: Vec<(String, String)>,
    pub(crate) faults: Faults,
    pub(crate) group_faults: GroupFaults,
    pub(crate) series_interval: Option<Duration>,
    pub(crate) idempotency_ttl: Option<Duration>,
    pub(crate) neighbour: Option<NeighbourSpec>,
}

impl SimConfig {
    fn new(style: Style, limits: &[(Dimension, u64)]) -> Self {
        Self {
            style,
            minute: MINUTE,
            limits: limits
                .iter()
                .map(|&(dimension, amount)| LimitSpec {
                    dimension,
                    amount,
                    period: Period::Minute,
                    parts: 1,
                })
                .collect(),
            sub_windows: Vec::new(),
            changes: Vec::new(),
            base_latency: Duration::from_millis(300),
            per_output_token: Duration::from_millis(10),
            completion_share: (0.1, 1.0),
            default_max_tokens: 1_024,
            max_output_tokens: 128_000,
            seed: 0,
            keys: Vec::new(),
            faults: Faults::none(),
            group_faults: GroupFaults::none(),
            series_interval: None,
            idempotency_ttl: None,
            neighbour: None,
        }
    }

    /// An OpenAI-style provider: `requests_per_minute` (RPM) and `tokens_per_minute` (TPM,
    /// [`Dimension::TotalTokens`]).
    ///
    /// TPM is charged `prompt + max_tokens` at admission and corrected to
    /// `prompt + completion` when the completion ends (the unused part is refunded).
    pub fn openai(requests_per_minute: u64, tokens_per_minute: u64) -> Self {
        Self::new(
            Style::OpenAi,
            &[
                (Dimension::Requests, requests_per_minute),
                (Dimension::TotalTokens, tokens_per_minute),
            ],
        )
    }

    /// An Anthropic-style provider: `requests_per_minute`, `input_tokens_per_minute` (ITPM)
    /// and `output_tokens_per_minute` (OTPM).
    ///
    /// Input is charged the prompt at admission. Output is charged `max_tokens` at admission
    /// and corrected to the real output when the completion ends, as Anthropic describes its
    /// OTPM estimate.
    pub fn anthropic(
        requests_per_minute: u64,
        input_tokens_per_minute: u64,
        output_tokens_per_minute: u64,
    ) -> Self {
        Self::new(
            Style::Anthropic,
            &[
                (Dimension::Requests, requests_per_minute),
                (Dimension::InputTokens, input_tokens_per_minute),
                (Dimension::OutputTokens, output_tokens_per_minute),
            ],
        )
    }

    /// A Gemini-style provider: `requests_per_minute` (RPM) and `input_tokens_per_minute`
    /// (TPM, which Google counts over the input), per model as Google keeps them when one
    /// simulator serves one model. Add requests per day with [`limit`](Self::limit).
    pub fn gemini(requests_per_minute: u64, input_tokens_per_minute: u64) -> Self {
        Self::new(
            Style::Gemini,
            &[
                (Dimension::Requests, requests_per_minute),
                (Dimension::InputTokens, input_tokens_per_minute),
            ],
        )
    }

    /// How long a simulated minute lasts (default 60 s). Per-minute limits refill over it;
    /// under tokio's paused clock any length runs in no real time.
    ///
    /// At least a millisecond.
    pub fn minute(self, minute: Duration) -> Self {
        Self {
            minute: minute.max(Duration::from_millis(1)),
            ..self
        }
    }

    /// Adds a limit of `amount` of `dimension` per `period` (for example per day), on top of
    /// the per-minute quota. Its period is not scaled by [`minute`](Self::minute).
    ///
    /// Request costs per dimension: [`Dimension::Requests`] 1, [`Dimension::InputTokens`] the
    /// prompt, [`Dimension::OutputTokens`] `max_tokens` then the completion,
    /// [`Dimension::TotalTokens`] the sum of both.
    pub fn limit(mut self, dimension: Dimension, amount: u64, period: Duration) -> Self {
        self.limits.push(LimitSpec {
            dimension,
            amount,
            period: Period::Fixed(period),
            parts: 1,
        });
        self
    }

    /// Also enforces the per-minute limit of `dimension` over `1/parts` of the minute, holding
    /// `amount / parts` (at least 1) at once, as Azure counts RPM per second or per 10 seconds.
    /// Off by default; `parts` below 2 is ignored.
    pub fn sub_window(mut self, dimension: Dimension, parts: u32) -> Self {
        if parts >= 2 {
            self.sub_windows.push((dimension, parts));
        }
        self
    }

    /// From `at` (simulated time since the simulator was created), the per-minute limit of
    /// `dimension` (and its sub-windows) is `amount` (at least 1), without notice: the level
    /// is cut to the new capacity and refills at the new rate. Headers report the new limit
    /// from then on.
    pub fn lower_limit_at(mut self, at: Duration, dimension: Dimension, amount: u64) -> Self {
        self.changes.push(QuotaChange {
            at,
            dimension,
            amount,
        });
        self
    }

    /// Another client spends `share` (clamped to `[0, 1]`) of `organization`'s per-minute
    /// token limit (TPM for OpenAI, input TPM for Anthropic), unseen by the simulator's
    /// clients: one request of `tokens_per_request` prompt tokens (at least 1) and no output
    /// at a steady pace, each charged to every limit of the organisation (one request, its
    /// tokens), dropped rather than retried when the quota cannot pay it (counted as its
    /// 429). Its requests are counted apart ([`SimStats::neighbour_admitted`],
    /// [`SimStats::neighbour_rate_limited`]), not in the other statistics. With no key
    /// configured, the organisation is `default`. Off by default.
    ///
    /// [`SimStats::neighbour_admitted`]: super::SimStats::neighbour_admitted
    /// [`SimStats::neighbour_rate_limited`]: super::SimStats::neighbour_rate_limited
    pub fn neighbour(
        self,
        organization: impl Into<String>,
        share: f64,
        tokens_per_request: u64,
    ) -> Self {
        Self {
            neighbour: Some(NeighbourSpec {
                organization: organization.into(),
                share: clamp_share(share),
                tokens_per_request: tokens_per_request.max(1),
                until: None,
            }),
            ..self
        }
    }

    /// The [neighbour](Self::neighbour) stops spending `at` from the start (a job of theirs
    /// ends). Without a neighbour, nothing.
    pub fn neighbour_until(self, at: Duration) -> Self {
        Self {
            neighbour: self.neighbour.map(|spec| NeighbourSpec {
                until: Some(at),
                ..spec
            }),
            ..self
        }
    }

    /// The latency of a completion: `base` until the first token, then `per_output_token` for
    /// each token generated. Defaults: 300 ms and 10 ms.
    pub fn latency(self, base: Duration, per_output_token: Duration) -> Self {
        Self {
            base_latency: base,
            per_output_token,
            ..self
        }
    }

    /// The completion length, as a share of `max_tokens`: uniform between `min` and `max`
    /// (clamped to `[0, 1]`, swapped if reversed), chosen by a hash of the prompt. Defaults to
    /// `0.1` and `1.0`; `(1.0, 1.0)` always uses the whole `max_tokens`. At least one token.
    pub fn completion_share(self, min: f64, max: f64) -> Self {
        let (min, max) = (clamp_share(min), clamp_share(max));
        Self {
            completion_share: (min.min(max), min.max(max)),
            ..self
        }
    }

    /// The `max_tokens` assumed for an OpenAI request that sets neither `max_tokens` nor
    /// `max_completion_tokens` (default 1024; at least 1).
    pub fn default_max_tokens(self, max_tokens: u64) -> Self {
        Self {
            default_max_tokens: max_tokens.max(1),
            ..self
        }
    }

    /// The model's largest `max_tokens` (default 128,000): a request asking for more is
    /// refused with 400, as providers do. It also bounds the completion text generated.
    pub fn max_output_tokens(self, max_tokens: u64) -> Self {
        Self {
            max_output_tokens: max_tokens.max(1),
            ..self
        }
    }

    /// The seed of the fault generator and of the completion lengths (default 0).
    pub fn seed(self, seed: u64) -> Self {
        Self { seed, ..self }
    }

    /// Accepts the API key `key`, charged to `organization`'s quota; keys of one organisation
    /// share its buckets. With no key configured, any non-empty key is accepted, all sharing
    /// one organisation named `default`.
    pub fn key(mut self, key: impl Into<String>, organization: impl Into<String>) -> Self {
        self.keys.push((key.into(), organization.into()));
        self
    }

    /// Honours the `idempotency-key` request header for `ttl` (off by default), as providers
    /// that support one do: a request whose key was billed within `ttl` is not billed again;
    /// it gets the same completion (header `idempotent-replayed: true`) once generated, or a
    /// 409 while it is being generated. Calls billed per key are counted either way
    /// ([`Simulator::calls_by_idempotency_key`](super::Simulator::calls_by_idempotency_key)).
    pub fn honour_idempotency_keys(self, ttl: Duration) -> Self {
        Self {
            idempotency_ttl: Some(ttl),
            ..self
        }
    }

    /// The faults to inject (none by default).
    pub fn faults(self, faults: Faults) -> Self {
        Self { faults, ..self }
    }

    /// The faults of the answers to grouped prompts (none by default). A prompt whose items
    /// are marked `<item id="...">` (see [`tower_llm_quota::group`]) is answered with a JSON array of
    /// one `{"id", "answer"}` object per item, within its `max_tokens`.
    pub fn group_faults(self, group_faults: GroupFaults) -> Self {
        Self {
            group_faults,
            ..self
        }
    }

    /// The width of one point of the statistics' time series (default: 1/60 of the minute;
    /// at least a millisecond).
    pub fn series_interval(self, interval: Duration) -> Self {
        Self {
            series_interval: Some(interval.max(Duration::from_millis(1))),
            ..self
        }
    }

    /// The wire style.
    pub fn style(&self) -> Style {
        self.style
    }

    /// The length of the simulated minute.
    pub fn minute_length(&self) -> Duration {
        self.minute
    }
}
