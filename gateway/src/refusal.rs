//! Every refusal in the error schema of the API it answers (so the official SDKs raise their
//! own exceptions), with the gateway's fields beside, and a `Retry-After` header when the
//! wait is known. On OpenAI routes (and outside any API):
//!
//! ```json
//! {"error": {"message": "tenant acme/search is over its tokens per minute; retry in 2.5 s",
//!            "type": "tokens", "param": null, "code": "rate_limit_exceeded",
//!            "gateway_decision": "local", "limit": "tokens_per_minute",
//!            "dimension": "total_tokens", "scope": "tenant:acme/search", "retry_after": 2.5}}
//! ```
//!
//! On `/v1/messages`, Anthropic's: `{"type": "error", "error": {"type": "rate_limit_error",
//! "message": "...", "gateway_decision": ..., ...}}`. On Gemini's native routes, Google's:
//! `{"error": {"code": 429, "message": "...", "status": "RESOURCE_EXHAUSTED", "details":
//! [{"@type": "...ErrorInfo", "reason": "REQUESTS_PER_MINUTE", "metadata": {"gateway_decision":
//! ..., ...}}, {"@type": "...RetryInfo", "retryDelay": "2.5s"}]}}`.
//!
//! `gateway_decision` is `local` when the gateway refused before anything was sent, and
//! `provider` when the provider refused after the gateway admitted the request. `scope` names
//! what ran out: `tenant:<path>`, `account:<name>` or `gateway`.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;

/// Whose error schema a refusal is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Dialect {
    /// OpenAI's (also Azure's and OpenAI-compatible servers'): the default.
    #[default]
    OpenAi,
    /// Anthropic's.
    Anthropic,
    /// Google's (`{"error": {"code", "message", "status", "details"}}`), the wait in a
    /// `RetryInfo` detail too.
    Gemini,
}

/// The limit of a refusal for an overloaded provider.
pub(crate) const OVERLOADED: &str = "overloaded";

/// The header naming what refused a request: `tenant:<path>`, `account:<name>`,
/// `account:<name>/scope:<scope>` or `gateway`.
const SCOPE_HEADER: &str = "x-llm-quota-scope";

/// The header the official OpenAI and Anthropic SDKs read before retrying an answer.
const SHOULD_RETRY: &str = "x-should-retry";

/// Who refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Decision {
    Local,
    Provider,
}

/// A refusal, ready to be answered.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Refusal {
    #[serde(skip)]
    pub(crate) status: StatusCode,
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) gateway_decision: Decision,
    /// The limit that binds (`requests_per_minute`, `paused`, `body_size`, ...).
    pub(crate) limit: Box<str>,
    /// The quota dimension, when the limit counts one.
    pub(crate) dimension: Option<&'static str>,
    pub(crate) scope: Box<str>,
    /// Seconds to wait before trying again, when known.
    pub(crate) retry_after: Option<f64>,
    pub(crate) message: Box<str>,
    #[serde(skip)]
    pub(crate) dialect: Dialect,
    /// Whether the caller retries the provider itself (its key's `retries = "client"`): then
    /// a provider's answer does not tell its SDK not to.
    #[serde(skip)]
    pub(crate) client_retries: bool,
}

impl Dialect {
    /// Whose error schema the callers of `api` read: the Anthropic SDK's on `/v1/messages`,
    /// Google's on its native API, OpenAI's elsewhere.
    pub(crate) fn of(api: crate::config::Api) -> Self {
        use crate::config::Api;
        match api {
            Api::Messages | Api::CountTokens => Dialect::Anthropic,
            Api::Chat | Api::Responses | Api::Embeddings | Api::Completions => Dialect::OpenAi,
            Api::GenerateContent | Api::EmbedContent | Api::GeminiCountTokens => Dialect::Gemini,
        }
    }
}

impl Refusal {
    /// The refusal of a request that came while the gateway stops.
    pub(crate) fn stopping() -> Self {
        Refusal::unavailable(
            "shutdown",
            "the gateway is shutting down; retry on another replica",
        )
        .retry_after(Some(std::time::Duration::from_secs(1)))
    }

    fn new(status: StatusCode, kind: &'static str, limit: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            gateway_decision: Decision::Local,
            limit: limit.into().into_boxed_str(),
            dimension: None,
            scope: "gateway".into(),
            retry_after: None,
            message: "".into(),
            dialect: Dialect::OpenAi,
            client_retries: false,
        }
    }

    /// The same refusal in the error schema of `dialect`. An overloaded provider is
    /// Anthropic's own 529 for an Anthropic caller (its SDK raises `OverloadedError`), a 503
    /// for an OpenAI one.
    pub(crate) fn dialect(mut self, dialect: Dialect) -> Self {
        if dialect == Dialect::Anthropic && &*self.limit == OVERLOADED {
            self.status = StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        }
        Self { dialect, ..self }
    }

    /// OpenAI's `type` and `code` for this refusal.
    fn openai_type_and_code(&self) -> (&'static str, Option<&'static str>) {
        match self.status.as_u16() {
            401 => ("invalid_request_error", Some("invalid_api_key")),
            429 => {
                let kind = if self.dimension == Some("requests") {
                    "requests"
                } else {
                    "tokens"
                };
                (kind, Some("rate_limit_exceeded"))
            }
            404 if &*self.limit == "model" => ("invalid_request_error", Some("model_not_found")),
            413 => ("invalid_request_error", Some("request_too_large")),
            400..=499 => ("invalid_request_error", None),
            _ => ("server_error", None),
        }
    }

    /// Anthropic's error `type` for this refusal.
    fn anthropic_type(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        }
    }

    /// Google's canonical status name for this refusal's HTTP status.
    fn google_status(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 413 | 422 => "INVALID_ARGUMENT",
            401 => "UNAUTHENTICATED",
            403 => "PERMISSION_DENIED",
            404 | 405 => "NOT_FOUND",
            408 | 504 => "DEADLINE_EXCEEDED",
            409 => "ABORTED",
            429 => "RESOURCE_EXHAUSTED",
            502 | 503 | 529 => "UNAVAILABLE",
            _ => "INTERNAL",
        }
    }

    /// Google's error: the gateway's fields as an `ErrorInfo`'s metadata (strings, as
    /// Google's are), the wait as a `RetryInfo`.
    fn google_body(&self) -> serde_json::Value {
        use serde_json::json;
        let mut metadata = json!({
            "gateway_decision": match self.gateway_decision {
                Decision::Local => "local",
                Decision::Provider => "provider",
            },
            "gateway_type": self.kind,
            "limit": self.limit,
            "scope": self.scope,
        });
        if let Some(dimension) = self.dimension {
            metadata["dimension"] = json!(dimension);
        }
        let mut details = vec![json!({
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": self.limit.to_ascii_uppercase(),
            "domain": "llm-quota-gateway",
            "metadata": metadata,
        })];
        if let Some(seconds) = self.retry_after {
            details.push(json!({
                "@type": "type.googleapis.com/google.rpc.RetryInfo",
                "retryDelay": format!("{seconds}s"),
            }));
        }
        json!({"error": {
            "code": self.status.as_u16(),
            "message": self.message,
            "status": self.google_status(),
            "details": details,
        }})
    }

    /// The body: the dialect's schema, the gateway's fields inside its `error` object.
    fn body(&self) -> serde_json::Value {
        use serde_json::json;
        let mut error = json!({
            "message": self.message,
            "gateway_decision": self.gateway_decision,
            "gateway_type": self.kind,
            "limit": self.limit,
            "dimension": self.dimension,
            "scope": self.scope,
            "retry_after": self.retry_after,
        });
        match self.dialect {
            Dialect::Gemini => self.google_body(),
            Dialect::OpenAi => {
                let (kind, code) = self.openai_type_and_code();
                error["type"] = json!(kind);
                error["param"] = serde_json::Value::Null;
                error["code"] = json!(code);
                json!({"error": error})
            }
            Dialect::Anthropic => {
                error["type"] = json!(self.anthropic_type());
                json!({"type": "error", "error": error})
            }
        }
    }

    /// 429: a rate or quota limit. Every 429 says when to come back: a second unless the
    /// refusal knows better ([`retry_after`](Self::retry_after)).
    pub(crate) fn rate_limited(limit: impl Into<String>, scope: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit", limit)
            .scope(scope)
            .retry_after(Some(Duration::from_secs(1)))
    }

    /// 401: no key, or an unknown one.
    pub(crate) fn unauthorized() -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication", "api_key").message(
            "a valid gateway key is required (Authorization: Bearer, x-api-key or x-goog-api-key)",
        )
    }

    /// 400: a body the gateway cannot read; nothing was reserved.
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::invalid("body", message)
    }

    /// 400: a part of the request (`limit` names it: `body`, `idempotency_key`) the gateway
    /// cannot read; nothing was reserved or sent.
    pub(crate) fn invalid(limit: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", limit).message(message)
    }

    /// 413: a body above the configured size.
    pub(crate) fn too_large(max: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request",
            "body_size",
        )
        .message(format!("the request body is over {max} bytes"))
    }

    /// 408: the request's body did not arrive within the body timeout.
    pub(crate) fn body_timeout(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request",
            "body_timeout",
        )
        .message(message)
    }

    /// 409: the request conflicts with another in flight (its idempotency key).
    pub(crate) fn conflict(limit: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", limit).message(message)
    }

    /// 422: the request cannot be served as sent (an idempotency key used for another
    /// request).
    pub(crate) fn unprocessable(limit: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", limit).message(message)
    }

    /// 503: the shared store is unreachable and the policy is to refuse, or the gateway stops.
    pub(crate) fn unavailable(limit: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", limit).message(message)
    }

    /// 404: no account serves this API.
    pub(crate) fn not_served(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request", "route")
            .message(format!("no upstream account serves {path}"))
    }

    /// 404: no such model, or not for this key (OpenAI's `model_not_found`).
    pub(crate) fn model_not_found(model: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request", "model").message(format!(
            "The model `{model}` does not exist or you do not have access to it."
        ))
    }

    /// 404: no such route.
    pub(crate) fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request", "route")
            .message(format!("Invalid URL ({path}): no such route"))
    }

    /// 405: the route does not take this method.
    pub(crate) fn method_not_allowed(method: &http::Method, path: &str) -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request", "method")
            .message(format!("{method} is not allowed on {path}"))
    }

    /// The same refusal for a caller that retries the provider itself.
    pub(crate) fn client_retries(mut self, client: bool) -> Self {
        self.client_retries = client;
        self
    }

    pub(crate) fn provider(mut self) -> Self {
        self.gateway_decision = Decision::Provider;
        self
    }

    pub(crate) fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into().into_boxed_str();
        self
    }

    pub(crate) fn dimension(mut self, dimension: Option<&'static str>) -> Self {
        self.dimension = dimension;
        self
    }

    pub(crate) fn retry_after(mut self, wait: Option<Duration>) -> Self {
        self.retry_after = wait.map(|w| (w.as_secs_f64() * 1000.0).ceil() / 1000.0);
        self
    }

    pub(crate) fn message(mut self, message: impl Into<String>) -> Self {
        self.message = message.into().into_boxed_str();
        self
    }

    /// The `Retry-After` header's value: whole seconds, rounded up.
    fn retry_after_header(&self) -> Option<HeaderValue> {
        let secs = self.retry_after?.ceil().max(0.0);
        HeaderValue::from_str(&format!("{secs:.0}")).ok()
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.body()).unwrap_or_default();
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(value) = self.retry_after_header() {
            headers.insert(header::RETRY_AFTER, value);
        }
        // What binds, for a caller that reads headers only (as the audit line and the body's
        // `scope` say it).
        if let Ok(scope) = HeaderValue::from_str(&self.scope) {
            headers.insert(SCOPE_HEADER, scope);
        }
        if self.gateway_decision == Decision::Provider && !self.client_retries {
            // The gateway retried the provider already, as its policy allows: an SDK retrying
            // this answer would multiply the provider's calls (both official SDKs honour it).
            headers.insert(SHOULD_RETRY, HeaderValue::from_static("false"));
        }
        response
    }
}

/// The name of a limit of `dimension` over `period`: `requests_per_minute`,
/// `total_tokens_per_day`, and for any other period its length, `requests_per_10_seconds`,
/// `total_tokens_per_2_hours`.
pub(crate) fn limit_name(dimension: &str, period: Duration) -> String {
    let secs = period.as_secs();
    let millis = period.as_millis();
    let per = match secs {
        _ if millis % 1_000 != 0 => format!("{millis}_milliseconds"),
        1 => "second".to_owned(),
        60 => "minute".to_owned(),
        3_600 => "hour".to_owned(),
        86_400 => "day".to_owned(),
        s if s % 86_400 == 0 => format!("{}_days", s / 86_400),
        s if s % 3_600 == 0 => format!("{}_hours", s / 3_600),
        s if s % 60 == 0 => format!("{}_minutes", s / 60),
        s => format!("{s}_seconds"),
    };
    format!("{dimension}_per_{per}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_is_named_by_its_own_period() {
        let name = |secs: u64| limit_name("requests", Duration::from_secs(secs));
        assert_eq!(name(60), "requests_per_minute");
        assert_eq!(name(10), "requests_per_10_seconds");
        assert_eq!(name(7_200), "requests_per_2_hours");
        assert_eq!(name(86_400), "requests_per_day");
        assert_eq!(name(172_800), "requests_per_2_days");
        assert_eq!(name(300), "requests_per_5_minutes");
        assert_eq!(name(1), "requests_per_second");
        assert_eq!(
            limit_name("requests", Duration::from_millis(2_000)),
            "requests_per_2_seconds"
        );
        assert_eq!(
            limit_name("requests", Duration::from_millis(1_500)),
            "requests_per_1500_milliseconds"
        );
    }
}
