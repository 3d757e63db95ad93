//! One error type for every rate-limit failure, local or the provider's.

use std::fmt;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};

use super::classify::{Classify, Failure, ProviderErrors};
use crate::error::Error;
use crate::error::failure::FailureClass;
use crate::parse;
use crate::quota::Dimension;

use crate::scope::Scope;

/// Who refused the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Decision {
    /// Refused or timed out here, before anything was sent: intentional protection.
    Local,
    /// Refused by the provider after local admission: a calibration problem (another client
    /// shares the quota, the limit changed, the estimates are off).
    Provider,
}

/// Which limit was hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LimitedBy {
    /// Requests per window.
    Requests,
    /// Input tokens per window.
    InputTokens,
    /// Output tokens per window.
    OutputTokens,
    /// Tokens per window (total, or unspecified kind).
    Tokens,
    /// A daily quota.
    Daily,
    /// Calls in flight.
    Concurrency,
    /// The local queue (its depth, or the wait allowed in it).
    Queue,
    /// Not said.
    Unknown,
}

impl Error {
    /// The same failure as a normalized [`RateLimitError`], when it is a local rate-limit
    /// refusal (a cost that never fits, a deadline passed while waiting, a full queue).
    pub fn rate_limit(&self) -> Option<RateLimitError> {
        RateLimitError::from_local(self)
    }
}

/// A rate-limit failure, normalized: who decided, which limit, where, how long to wait, and
/// whether waiting helps. The provider's status, headers and body stay reachable.
///
/// Build one from a provider's 429 with [`RateLimitError::from_response`], or from this
/// crate's local refusals with [`Error::rate_limit`].
#[derive(Debug, Clone)]
pub struct RateLimitError {
    decision: Decision,
    limited_by: LimitedBy,
    scope: Scope,
    retry_after: Option<Duration>,
    exhausted: bool,
    status: Option<StatusCode>,
    headers: HeaderMap,
    body: Bytes,
}

impl RateLimitError {
    /// The rate-limit failure a provider's 429 response describes, with its body; `None` for
    /// any other status.
    pub fn from_response<B>(response: &Response<B>, body: &[u8]) -> Option<Self> {
        let status = response.status();
        if status != StatusCode::TOO_MANY_REQUESTS {
            return None;
        }
        let headers = response.headers();
        let class = ProviderErrors.classify(&Failure::Response {
            status,
            headers,
            body,
        });
        let text = String::from_utf8_lossy(body).to_ascii_lowercase();
        Some(Self {
            decision: Decision::Provider,
            limited_by: limited_by(headers, body, &text),
            scope: response
                .extensions()
                .get::<Scope>()
                .cloned()
                .unwrap_or_default(),
            retry_after: parse::retry_after(headers, SystemTime::now())
                .or_else(|| parse::body_retry_delay(body)),
            exhausted: matches!(class, FailureClass::Permanent(_)),
            status: Some(status),
            headers: headers.clone(),
            body: Bytes::copy_from_slice(body),
        })
    }

    /// The rate-limit failure a local refusal of this crate describes (a cost that never
    /// fits, a deadline passed while waiting or predicted to pass, a full queue); `None` for
    /// other errors.
    fn from_local(error: &Error) -> Option<Self> {
        let (limited_by, exhausted) = if let Some(too_large) = error.insufficient_capacity() {
            let by = match too_large.dimension() {
                Dimension::Requests => LimitedBy::Requests,
                Dimension::InputTokens => LimitedBy::InputTokens,
                Dimension::OutputTokens => LimitedBy::OutputTokens,
                _ => LimitedBy::Tokens,
            };
            (by, true)
        } else if error.is_queue_full() || error.is_deadline_exceeded() {
            (LimitedBy::Queue, false)
        } else {
            return None;
        };
        Some(Self {
            decision: Decision::Local,
            limited_by,
            scope: Scope::default(),
            // A deadline refused on arrival: the wait the budget predicted.
            retry_after: error.predicted_wait(),
            exhausted,
            status: None,
            headers: HeaderMap::new(),
            body: Bytes::new(),
        })
    }

    /// Marks the quota exhausted (the provider asked for a wait beyond what is honoured).
    pub(crate) fn exhausted(self, exhausted: bool) -> Self {
        Self {
            exhausted: self.exhausted || exhausted,
            ..self
        }
    }

    /// Who refused the request.
    pub fn decision(&self) -> Decision {
        self.decision
    }

    /// Which limit was hit.
    pub fn limited_by(&self) -> LimitedBy {
        self.limited_by
    }

    /// Where the limit applies.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// How long the provider asked to wait, if it did.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Whether waiting a little helps (a per-minute limit), as opposed to an exhausted quota
    /// (billing, a daily limit, a cost that never fits).
    pub fn is_transient(&self) -> bool {
        !self.exhausted
    }

    /// The provider's status, headers and body, for debugging.
    pub fn provider_response(&self) -> Option<(StatusCode, &HeaderMap, &Bytes)> {
        self.status
            .map(|status| (status, &self.headers, &self.body))
    }
}

impl fmt::Display for RateLimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let who = match self.decision {
            Decision::Local => "rejected locally",
            Decision::Provider => "rejected by the provider",
        };
        write!(f, "{who}: rate limit on {:?}", self.limited_by)?;
        if let Some(wait) = self.retry_after {
            write!(f, ", retry after {wait:?}")?;
        }
        if self.exhausted {
            f.write_str(", quota exhausted")?;
        }
        Ok(())
    }
}

impl std::error::Error for RateLimitError {}

/// The limit a 429 names, as a metric label.
#[cfg(feature = "metrics")]
pub(crate) fn limit_type(headers: &HeaderMap, body: &[u8]) -> &'static str {
    let text = String::from_utf8_lossy(body).to_ascii_lowercase();
    match limited_by(headers, body, &text) {
        LimitedBy::Requests => "requests",
        LimitedBy::InputTokens => "input_tokens",
        LimitedBy::OutputTokens => "output_tokens",
        LimitedBy::Tokens => "tokens",
        LimitedBy::Daily => "daily",
        LimitedBy::Concurrency => "concurrency",
        LimitedBy::Queue => "queue",
        LimitedBy::Unknown => "unknown",
    }
}

/// The limit a 429 names, from its headers or its message.
fn limited_by(headers: &HeaderMap, body: &[u8], text: &str) -> LimitedBy {
    if ["per day", "perday", "(rpd)", "(tpd)"]
        .iter()
        .any(|w| text.contains(w))
    {
        return LimitedBy::Daily;
    }
    let (dimensions, _) = super::hints::spent(headers, body, None, None, SystemTime::now());
    let has = |d| dimensions.contains(&d);
    match (
        has(Dimension::Requests),
        has(Dimension::InputTokens),
        has(Dimension::OutputTokens),
    ) {
        _ if dimensions.len() == Dimension::ALL.len() => LimitedBy::Unknown,
        (true, false, false) => LimitedBy::Requests,
        (false, true, false) => LimitedBy::InputTokens,
        (false, false, true) => LimitedBy::OutputTokens,
        (false, ..) => LimitedBy::Tokens,
        (true, ..) => LimitedBy::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_provider_429_is_normalized() {
        let mut response = Response::new(());
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        response
            .headers_mut()
            .insert("retry-after", "20".parse().unwrap());
        response
            .headers_mut()
            .insert("x-ratelimit-remaining-tokens", "0".parse().unwrap());
        let body = br#"{"error":{"code":"rate_limit_exceeded","message":"Rate limit reached on tokens per min (TPM)"}}"#;
        let error = RateLimitError::from_response(&response, body).unwrap();
        assert_eq!(error.decision(), Decision::Provider);
        assert_eq!(error.limited_by(), LimitedBy::Tokens);
        assert_eq!(error.retry_after(), Some(Duration::from_secs(20)));
        assert!(error.is_transient());
        assert_eq!(error.provider_response().unwrap().2.as_ref(), body);

        let quota = br#"{"error":{"type":"insufficient_quota","code":"insufficient_quota"}}"#;
        let error = RateLimitError::from_response(&response, quota).unwrap();
        assert!(!error.is_transient());
        *response.status_mut() = StatusCode::BAD_REQUEST;
        assert!(RateLimitError::from_response(&response, body).is_none());
    }

    #[test]
    fn local_refusals_are_normalized() {
        let error = Error::queue_full(crate::Priority::Batch, 10);
        let limit = error.rate_limit().unwrap();
        assert_eq!(
            (limit.decision(), limit.limited_by()),
            (Decision::Local, LimitedBy::Queue)
        );
        assert!(Error::missing_cost().rate_limit().is_none());
    }
}
