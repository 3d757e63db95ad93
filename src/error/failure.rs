//! Failure classes: why an attempt is worth another, or not. Data, not booleans.

/// What a failure is: worth retrying, or not. Failure classes are data, not booleans, so the
/// final report and the metrics can say why.
///
/// The two variants are the whole dichotomy, so a match on them needs no wildcard; the reasons
/// inside ([`Transient`], [`Permanent`]) are `#[non_exhaustive]` and may grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureClass {
    /// Worth retrying.
    Transient(Transient),
    /// Never retried.
    Permanent(Permanent),
}

impl FailureClass {
    /// The `error_type` label of the retry counter.
    pub(crate) fn metric_label(self) -> &'static str {
        match self {
            Self::Transient(Transient::RateLimited) => "rate_limited",
            Self::Transient(Transient::Overloaded) => "overloaded",
            Self::Transient(Transient::Server) => "server",
            Self::Transient(Transient::Timeout) => "timeout",
            Self::Transient(Transient::Connection) => "connection",
            Self::Transient(Transient::TierUnavailable) => "tier_unavailable",
            Self::Permanent(_) => "other",
        }
    }
}

/// Why a failure is worth retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transient {
    /// A rate limit (429): the quota is spent for now, for everyone who shares it.
    RateLimited,
    /// The provider is overloaded (Anthropic's 529, a 503 saying so): not a quota hit.
    Overloaded,
    /// A server error (500, 502, 503, 504) or a conflict (409).
    Server,
    /// A timeout (408, a connect or read timeout).
    Timeout,
    /// The connection failed or was reset.
    Connection,
    /// The provider has no capacity for the request's service tier now: OpenAI flex's 429
    /// "Resource Unavailable" (not billed), Groq flex's 498 `capacity_exceeded`. Not a quota
    /// hit: the budget is not paused. Retried later or handed back at once, by class
    /// ([`RetryPolicy::on_tier_unavailable`](crate::RetryPolicy::on_tier_unavailable)).
    TierUnavailable,
}

/// Why a failure is not retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Permanent {
    /// The request is invalid (400 and other 4xx).
    Client,
    /// The credentials are refused (401, 403).
    Auth,
    /// The prompt does not fit the model's context.
    ContextLength,
    /// A policy refusal (content filter, safety).
    Policy,
    /// The quota is exhausted beyond this window: billing (`insufficient_quota`), a daily limit.
    QuotaExhausted,
    /// The provider asks for a wait beyond the configured maximum.
    WaitTooLong,
    /// A local decision of an inner layer (deadline, full queue, a cost that never fits):
    /// nothing was sent, and retrying would not change it.
    Local,
    /// An error nothing here knows how to classify.
    Unknown,
    /// Sent, and failed before the response head (a timeout, a reset) without an idempotency
    /// key: the provider may have processed it, and a retry could bill twice (see
    /// [`Ambiguity`](crate::retry::Ambiguity)).
    Ambiguous,
}
