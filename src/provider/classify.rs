//! Which failures are worth another attempt.

use std::error::Error as StdError;
use std::fmt;
use std::io;
use std::sync::Arc;

use http::{HeaderMap, StatusCode};

use crate::error::failure::{FailureClass, Permanent, Transient};

/// A failed attempt, as a classifier sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Failure<'a> {
    /// The provider answered with an error status. `body` is the error body (read up to a
    /// limit; empty when it was too large to read).
    Response {
        /// The status.
        status: StatusCode,
        /// The headers.
        headers: &'a HeaderMap,
        /// The body, buffered.
        body: &'a [u8],
    },
    /// The inner service failed without a response (connection, timeout, a local decision).
    Error(&'a (dyn StdError + 'static)),
}

/// Decides whether a failure is transient. Object safe, so a policy can hold
/// `Arc<dyn Classify>`.
pub trait Classify: Send + Sync + 'static {
    /// The class of `failure`.
    fn classify(&self, failure: &Failure<'_>) -> FailureClass;
}

/// A [`Classify`] from a closure. A newtype rather than a blanket implementation for closures,
/// which would break type inference at the call site.
#[derive(Clone)]
pub struct ClassifyFn<F>(pub F);

impl<F> Classify for ClassifyFn<F>
where
    F: Fn(&Failure<'_>) -> FailureClass + Send + Sync + 'static,
{
    fn classify(&self, failure: &Failure<'_>) -> FailureClass {
        (self.0)(failure)
    }
}

impl<F> fmt::Debug for ClassifyFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClassifyFn")
    }
}

impl<C: Classify + ?Sized> Classify for Arc<C> {
    fn classify(&self, failure: &Failure<'_>) -> FailureClass {
        (**self).classify(failure)
    }
}

/// Classifies the errors of inner services (transports, timeouts) that have no response.
///
/// The default classifier walks an error's [`source`](StdError::source) chain and asks each
/// link; implement it for your transport's error type and use it from a [`ClassifyFn`], or
/// rely on the built-in rules: [`io::Error`] by kind, tower's timeout, this crate's local
/// decisions, and with the `hyper` and `reqwest` features their client errors (timeouts,
/// closed connections, connect errors).
pub trait ClassifyError {
    /// The class of this error, if it knows.
    fn classify_error(&self) -> Option<FailureClass>;
}

impl ClassifyError for io::Error {
    fn classify_error(&self) -> Option<FailureClass> {
        use io::ErrorKind::*;
        Some(match self.kind() {
            TimedOut | WouldBlock => FailureClass::Transient(Transient::Timeout),
            ConnectionReset | ConnectionRefused | ConnectionAborted | NotConnected | BrokenPipe
            | UnexpectedEof | Interrupted => FailureClass::Transient(Transient::Connection),
            _ => return None,
        })
    }
}

impl ClassifyError for crate::Error {
    fn classify_error(&self) -> Option<FailureClass> {
        self.is_local()
            .then_some(FailureClass::Permanent(Permanent::Local))
    }
}

#[cfg(feature = "hyper")]
impl ClassifyError for hyper::Error {
    fn classify_error(&self) -> Option<FailureClass> {
        if self.is_timeout() {
            Some(FailureClass::Transient(Transient::Timeout))
        } else if self.is_closed() || self.is_incomplete_message() || self.is_canceled() {
            Some(FailureClass::Transient(Transient::Connection))
        } else {
            None
        }
    }
}

#[cfg(feature = "hyper")]
impl ClassifyError for hyper_util::client::legacy::Error {
    fn classify_error(&self) -> Option<FailureClass> {
        self.is_connect()
            .then_some(FailureClass::Transient(Transient::Connection))
    }
}

#[cfg(feature = "reqwest")]
impl ClassifyError for reqwest::Error {
    fn classify_error(&self) -> Option<FailureClass> {
        if self.is_timeout() {
            Some(FailureClass::Transient(Transient::Timeout))
        } else if self.is_connect() {
            Some(FailureClass::Transient(Transient::Connection))
        } else {
            None
        }
    }
}

impl ClassifyError for tower::timeout::error::Elapsed {
    fn classify_error(&self) -> Option<FailureClass> {
        Some(FailureClass::Transient(Transient::Timeout))
    }
}

/// The default [`Classify`], following the providers' documented errors: OpenAI, Azure
/// OpenAI, Anthropic, Gemini and OpenAI-compatible servers.
///
/// | failure | class |
/// |---|---|
/// | `x-should-retry: true` / `false` | transient / permanent, whatever the status |
/// | 429 with `insufficient_quota`, or a per-day quota id | permanent: quota exhausted |
/// | 429 saying "resource unavailable" (OpenAI flex), 498 (Groq flex) | transient: tier unavailable |
/// | other 429 | transient: rate limited |
/// | 529, or 503 saying "overloaded" | transient: overloaded |
/// | 500, 502, 503, 504, 409, other 5xx | transient: server |
/// | 408 | transient: timeout |
/// | 401, 403 | permanent: auth |
/// | 400 about the context length | permanent: context length |
/// | 400 about content policy or safety | permanent: policy |
/// | other 4xx | permanent: client |
/// | io errors (reset, refused, timed out), tower timeouts | transient |
/// | this crate's local decisions | permanent: local |
/// | anything else | permanent: unknown |
#[derive(Debug, Clone, Copy, Default)]
pub struct ProviderErrors;

impl Classify for ProviderErrors {
    fn classify(&self, failure: &Failure<'_>) -> FailureClass {
        match failure {
            Failure::Response {
                status,
                headers,
                body,
            } => classify_response(*status, headers, body),
            Failure::Error(error) => classify_error_chain(*error),
        }
    }
}

fn classify_response(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> FailureClass {
    let text = String::from_utf8_lossy(body).to_ascii_lowercase();
    let by_status = classify_status(status, &text);
    // The provider's explicit word wins over the status.
    match headers
        .get("x-should-retry")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
    {
        Some(v) if v.eq_ignore_ascii_case("true") => match by_status {
            FailureClass::Transient(_) => by_status,
            FailureClass::Permanent(_) => FailureClass::Transient(Transient::Server),
        },
        Some(v) if v.eq_ignore_ascii_case("false") => match by_status {
            FailureClass::Permanent(_) => by_status,
            FailureClass::Transient(_) => FailureClass::Permanent(Permanent::Client),
        },
        _ => by_status,
    }
}

fn classify_status(status: StatusCode, text: &str) -> FailureClass {
    use FailureClass::{Permanent as P, Transient as T};
    let says = |words: &[&str]| words.iter().any(|w| text.contains(w));
    match status.as_u16() {
        429 if says(&[
            "insufficient_quota",
            "perday",
            "per_day",
            "billing_hard_limit",
        ]) =>
        {
            P(Permanent::QuotaExhausted)
        }
        // A service tier without capacity (OpenAI flex), not a rate limit.
        429 if says(&["resource_unavailable", "resource unavailable"]) => {
            T(Transient::TierUnavailable)
        }
        429 => T(Transient::RateLimited),
        // Groq's flex tier: `capacity_exceeded`.
        498 => T(Transient::TierUnavailable),
        529 => T(Transient::Overloaded),
        503 if says(&["overloaded"]) => T(Transient::Overloaded),
        408 => T(Transient::Timeout),
        409 | 500..=599 => T(Transient::Server),
        401 | 403 => P(Permanent::Auth),
        400..=499
            if says(&[
                "context_length",
                "context length",
                "maximum context",
                "prompt is too long",
                "too many tokens",
            ]) =>
        {
            P(Permanent::ContextLength)
        }
        400..=499
            if says(&[
                "content_policy",
                "content_filter",
                "safety",
                "policy_violation",
            ]) =>
        {
            P(Permanent::Policy)
        }
        _ => P(Permanent::Client),
    }
}

/// The class of one error of a known type, if it knows.
fn known_error(error: &(dyn StdError + 'static)) -> Option<FailureClass> {
    if let Some(e) = error.downcast_ref::<crate::Error>() {
        return e.classify_error();
    }
    if let Some(e) = error.downcast_ref::<io::Error>() {
        return e.classify_error();
    }
    if let Some(e) = error.downcast_ref::<tower::timeout::error::Elapsed>() {
        return e.classify_error();
    }
    #[cfg(feature = "hyper")]
    {
        if let Some(e) = error.downcast_ref::<hyper::Error>() {
            return e.classify_error();
        }
        if let Some(e) = error.downcast_ref::<hyper_util::client::legacy::Error>() {
            return e.classify_error();
        }
    }
    #[cfg(feature = "reqwest")]
    {
        if let Some(e) = error.downcast_ref::<reqwest::Error>() {
            return e.classify_error();
        }
    }
    None
}

fn classify_error_chain(error: &(dyn StdError + 'static)) -> FailureClass {
    let mut link = Some(error);
    while let Some(error) = link {
        let known = known_error(error);
        if let Some(class) = known {
            return class;
        }
        link = error.source();
    }
    FailureClass::Permanent(Permanent::Unknown)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(status: u16, headers: &[(&'static str, &'static str)], body: &str) -> FailureClass {
        ProviderErrors.classify(&Failure::Response {
            status: StatusCode::from_u16(status).unwrap(),
            headers: &crate::test_util::headers(headers),
            body: body.as_bytes(),
        })
    }

    #[test]
    fn provider_vectors() {
        use FailureClass::{Permanent as P, Transient as T};
        let insufficient = r#"{"error":{"type":"insufficient_quota","code":"insufficient_quota"}}"#;
        assert_eq!(
            response(429, &[], insufficient),
            P(Permanent::QuotaExhausted)
        );
        assert_eq!(
            response(429, &[], r#"{"error":{"code":"rate_limit_exceeded"}}"#),
            T(Transient::RateLimited)
        );
        let overloaded = r#"{"type":"error","error":{"type":"overloaded_error"}}"#;
        assert_eq!(response(529, &[], overloaded), T(Transient::Overloaded));
        assert_eq!(
            response(
                429,
                &[],
                r#"{"quotaId":"GenerateRequestsPerDayPerProject"}"#
            ),
            P(Permanent::QuotaExhausted)
        );
        assert_eq!(response(503, &[], ""), T(Transient::Server));
        assert_eq!(response(408, &[], ""), T(Transient::Timeout));
        assert_eq!(response(401, &[], ""), P(Permanent::Auth));
        assert_eq!(
            response(400, &[], r#"{"error":{"code":"context_length_exceeded"}}"#),
            P(Permanent::ContextLength)
        );
        assert_eq!(response(400, &[], "{}"), P(Permanent::Client));
    }

    #[test]
    fn a_tier_without_capacity_is_not_a_rate_limit() {
        use FailureClass::Transient as T;
        let flex = r#"{"error":{"message":"Resource Unavailable: the flex tier has no capacity","type":"resource_unavailable","param":null,"code":"resource_unavailable"}}"#;
        assert_eq!(response(429, &[], flex), T(Transient::TierUnavailable));
        let worded = r#"{"error":{"message":"429 Resource Unavailable","code":null}}"#;
        assert_eq!(response(429, &[], worded), T(Transient::TierUnavailable));
        let groq =
            r#"{"error":{"message":"flex tier capacity exceeded","code":"capacity_exceeded"}}"#;
        assert_eq!(response(498, &[], groq), T(Transient::TierUnavailable));
        assert_eq!(
            FailureClass::Transient(Transient::TierUnavailable).metric_label(),
            "tier_unavailable"
        );
    }

    #[test]
    fn the_providers_word_overrides_the_status() {
        use FailureClass::{Permanent as P, Transient as T};
        assert_eq!(
            response(400, &[("x-should-retry", "true")], ""),
            T(Transient::Server)
        );
        assert_eq!(
            response(503, &[("x-should-retry", "false")], ""),
            P(Permanent::Client)
        );
    }

    #[test]
    fn errors_are_classified_along_their_source_chain() {
        let reset = io::Error::new(io::ErrorKind::ConnectionReset, "reset");
        let wrapped = crate::Error::from_inner(reset);
        assert_eq!(
            ProviderErrors.classify(&Failure::Error(&wrapped)),
            FailureClass::Transient(Transient::Connection)
        );
        let local = crate::Error::missing_cost();
        assert_eq!(
            ProviderErrors.classify(&Failure::Error(&local)),
            FailureClass::Permanent(Permanent::Local)
        );
        let other = fmt::Error;
        assert_eq!(
            ProviderErrors.classify(&Failure::Error(&other)),
            FailureClass::Permanent(Permanent::Unknown)
        );
    }

    #[test]
    fn classify_is_object_safe() {
        fn _object(_: &dyn Classify) {}
    }
}
