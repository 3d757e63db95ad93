//! OpenTelemetry (the `otel` feature): one span per request, with the GenAI semantic
//! conventions' attributes and the quota decision, exported over OTLP/HTTP (protobuf) to
//! `server.otlp_endpoint` by a batch processor on a thread of its own.
//!
//! The span runs from the request's head to its answer's last byte (or its refusal), as a
//! child of the caller's `traceparent` when it sends one. Its name is `{operation} {model}`
//! (`chat gpt-4o-mini`) and its kind `CLIENT`, as the conventions ask of a call to a model;
//! its attributes:
//!
//! | attribute | value |
//! |---|---|
//! | `gen_ai.operation.name` | `chat`, `embeddings`, `text_completion` (`count_tokens` for Anthropic's) |
//! | `gen_ai.provider.name` | the account's provider: `openai`, `anthropic`, `azure.ai.openai`, `gcp.gemini`, `openai_compatible` |
//! | `gen_ai.request.model` | the model asked for |
//! | `gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens` | as the provider reported them |
//! | `gen_ai.usage.cache_read.input_tokens` | cached input tokens read |
//! | `openai.response.service_tier` | the tier that served it, where read |
//! | `http.response.status_code`, `error.type` | the answer's status; `error.type` on a refusal (its limit) |
//! | `llm_quota.decision` | `admitted`, `local` (a refusal of the gateway) or `provider` |
//! | `llm_quota.tenant`, `llm_quota.key`, `llm_quota.class`, `llm_quota.account`, `llm_quota.route` | who, in which class, served where |
//! | `llm_quota.limit`, `llm_quota.scope` | what refused it |
//! | `llm_quota.estimated.input_tokens`, `llm_quota.estimated.output_tokens` | what was reserved |
//! | `llm_quota.queue_ms`, `llm_quota.attempts` | the wait for quota, the provider calls |

use std::time::{Duration, SystemTime};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Span, SpanKind, Status, Tracer, TracerProvider};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

use super::audit::Entry;
use super::config::ConfigError;

/// The exporter and the tracer of the gateway's spans.
pub(crate) struct Otel {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl std::fmt::Debug for Otel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Otel").finish_non_exhaustive()
    }
}

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// The caller's trace context (`traceparent`, `tracestate`), if it sends one.
pub(crate) fn parent(headers: &http::HeaderMap) -> Option<Context> {
    headers
        .contains_key("traceparent")
        .then(|| TraceContextPropagator::new().extract(&Headers(headers)))
}

impl Otel {
    /// Exports to `endpoint` (`http://collector:4318/v1/traces`). The HTTP client is a
    /// blocking one, made on a thread where blocking is allowed.
    pub(crate) async fn start(endpoint: String) -> Result<Self, ConfigError> {
        tokio::task::spawn_blocking(move || {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_endpoint(endpoint.clone())
                .with_timeout(Duration::from_secs(5))
                .build()
                .map_err(|e| ConfigError(format!("server.otlp_endpoint {endpoint}: {e}")))?;
            let resource = opentelemetry_sdk::Resource::builder()
                .with_service_name("llm-quota-gateway")
                .build();
            let provider = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource)
                .build();
            let tracer = provider.tracer("tower-llm-quota-gateway");
            Ok(Self { provider, tracer })
        })
        .await
        .map_err(|e| ConfigError(format!("server.otlp_endpoint: {e}")))?
    }

    /// The span of a finished request: from `started` to `ended`.
    pub(crate) fn span(
        &self,
        entry: &Entry,
        parent: Option<&Context>,
        (started, ended): (SystemTime, SystemTime),
    ) {
        let operation = match entry.api {
            "embeddings" => "embeddings",
            "completions" => "text_completion",
            "count_tokens" => "count_tokens",
            _ => "chat",
        };
        let model = entry.model.as_deref().unwrap_or("-");
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", operation),
            KeyValue::new("gen_ai.request.model", model.to_owned()),
            KeyValue::new("http.response.status_code", i64::from(entry.status)),
            KeyValue::new("llm_quota.decision", entry.decision),
        ];
        attributes.extend(request_attributes(entry));
        attributes.extend(token_attributes(entry));
        if entry.decision != "admitted" {
            let kind = entry
                .limit
                .clone()
                .unwrap_or_else(|| entry.status.to_string());
            attributes.push(KeyValue::new("error.type", kind));
        }
        let builder = self
            .tracer
            .span_builder(format!("{operation} {model}"))
            .with_kind(SpanKind::Client)
            .with_start_time(started)
            .with_attributes(attributes);
        let mut span = match parent {
            Some(parent) => builder.start_with_context(&self.tracer, parent),
            None => builder.start(&self.tracer),
        };
        if entry.decision != "admitted" || entry.status >= 500 {
            let reason = entry.reason.clone().unwrap_or_default();
            span.set_status(Status::error(reason));
        }
        span.end_with_timestamp(ended);
    }

    /// Exports what waits, and stops the exporter (a gateway's stop).
    pub(crate) async fn shutdown(&self) {
        let provider = self.provider.clone();
        let done = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        if let Ok(Err(error)) = done {
            tracing::warn!(%error, "the OpenTelemetry exporter did not stop cleanly");
        }
    }
}

/// The conventions' name of a provider, from the profile's.
fn provider_name(profile: &str) -> &'static str {
    match profile {
        "anthropic" => "anthropic",
        "azure_openai" => "azure.ai.openai",
        "gemini" => "gcp.gemini",
        "openai" => "openai",
        _ => "openai_compatible",
    }
}

/// The tokens a request used and was estimated at, as span attributes.
fn token_attributes(entry: &Entry) -> Vec<KeyValue> {
    let mut attributes = Vec::new();
    let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    if let Some(used) = entry.used {
        attributes.push(KeyValue::new(
            "gen_ai.usage.input_tokens",
            count(used.input),
        ));
        attributes.push(KeyValue::new(
            "gen_ai.usage.output_tokens",
            count(used.output),
        ));
        if let Some(cached) = used.cached {
            let key = "gen_ai.usage.cache_read.input_tokens";
            attributes.push(KeyValue::new(key, count(cached)));
        }
    }
    if let Some(estimated) = entry.estimated {
        let input = count(estimated.input);
        let output = count(estimated.output);
        attributes.push(KeyValue::new("llm_quota.estimated.input_tokens", input));
        attributes.push(KeyValue::new("llm_quota.estimated.output_tokens", output));
    }
    attributes
}

/// Who sent a request, where it went and how it waited, as span attributes.
fn request_attributes(entry: &Entry) -> impl Iterator<Item = KeyValue> + '_ {
    let text = |key: &'static str, value: &Option<String>| {
        value.as_ref().map(|v| KeyValue::new(key, v.clone()))
    };
    [
        text("llm_quota.tenant", &entry.tenant),
        text("llm_quota.key", &entry.key),
        text("llm_quota.account", &entry.account),
        text("llm_quota.route", &entry.route),
        text("llm_quota.limit", &entry.limit),
        text("llm_quota.scope", &entry.scope),
        entry
            .provider
            .map(|p| KeyValue::new("gen_ai.provider.name", provider_name(p))),
        entry.class.map(|c| KeyValue::new("llm_quota.class", c)),
        entry
            .service_tier
            .map(|t| KeyValue::new("openai.response.service_tier", t)),
        entry
            .queue_ms
            .map(|ms| KeyValue::new("llm_quota.queue_ms", ms)),
        entry
            .attempts
            .map(|n| KeyValue::new("llm_quota.attempts", i64::from(n))),
    ]
    .into_iter()
    .flatten()
}
