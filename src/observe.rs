//! The field's metrics, recorded through the [`metrics`](https://docs.rs/metrics) facade when
//! the `metrics` feature is on; without it every function here compiles to nothing.
//!
//! Label values come from the request: `provider` and `model` from its
//! [`Scope`](crate::provider::Scope) (`"unknown"` when absent), `priority` from its class,
//! `dimension` and `status` from fixed sets. Keep the scope's values to a bounded set (provider
//! and model names, never user ids), so the number of series stays bounded.

use std::time::Duration;

use http::Extensions;

use crate::cost::{Cost, Usage};
use crate::priority::Priority;

/// The request's `provider` and `model` labels.
#[derive(Debug, Clone, Default)]
pub(crate) struct Labels {
    #[cfg(feature = "metrics")]
    provider: metrics::SharedString,
    #[cfg(feature = "metrics")]
    model: metrics::SharedString,
}

impl Labels {
    /// The labels of a request, from its [`Scope`](crate::provider::Scope).
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn of(extensions: &Extensions) -> Self {
        #[cfg(feature = "metrics")]
        {
            let scope = extensions.get::<crate::provider::Scope>();
            let value = |v: Option<&String>| {
                v.map_or(metrics::SharedString::const_str("unknown"), |v| {
                    metrics::SharedString::from(v.clone())
                })
            };
            Self {
                provider: value(scope.and_then(|s| s.provider.as_ref())),
                model: value(scope.and_then(|s| s.model.as_ref())),
            }
        }
        #[cfg(not(feature = "metrics"))]
        Self {}
    }
}

#[cfg(feature = "metrics")]
mod enabled {
    use std::sync::Once;

    pub(super) fn describe() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
            describe_counter!(
                "llm_requests_total",
                "Calls that reached the provider, by status."
            );
            describe_counter!(
                "llm_tokens_reserved_total",
                Unit::Count,
                "Tokens reserved before calls."
            );
            describe_counter!(
                "llm_tokens_used_total",
                Unit::Count,
                "Tokens the provider reported."
            );
            describe_counter!("llm_retries_total", "Retries, by failure class.");
            describe_gauge!("llm_queue_depth", "Requests waiting in the priority queue.");
            describe_histogram!(
                "llm_queue_wait_seconds",
                Unit::Seconds,
                "Time queued before the budget."
            );
            describe_histogram!(
                "llm_call_seconds",
                Unit::Seconds,
                "Time from sending to the response head."
            );
            describe_counter!(
                "llm_rate_limit_hits_total",
                "Rate-limit refusals, local or the provider's."
            );
            describe_counter!(
                "llm_usage_missing_total",
                "Responses settled without reported usage."
            );
            describe_histogram!(
                "llm_estimate_error_ratio",
                "Reserved divided by used, per dimension."
            );
            describe_gauge!(
                "llm_budget_level",
                "Budget level after a settlement, per limit."
            );
            describe_gauge!(
                "llm_budget_debt",
                "Budget debt after a settlement, per limit."
            );
            describe_counter!(
                "llm_fallbacks_total",
                "Requests routed to a fallback (reserved)."
            );
            describe_counter!(
                "llm_duplicate_suppressed_total",
                "Duplicates suppressed (reserved)."
            );
        });
    }
}

macro_rules! when_enabled {
    ($($body:tt)*) => {{
        #[cfg(feature = "metrics")]
        {
            enabled::describe();
            $($body)*
        }
    }};
}

/// A call reached the provider and answered with `status`, or failed without an answer.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn request(labels: &Labels, status: Option<http::StatusCode>) {
    when_enabled! {
        let status = status.map_or_else(|| "error".to_owned(), |s| s.as_str().to_owned());
        metrics::counter!("llm_requests_total", "provider" => labels.provider.clone(), "model" => labels.model.clone(), "status" => status).increment(1);
    }
}

/// The budget admitted `cost`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn reserved(labels: &Labels, cost: &Cost) {
    when_enabled! {
        for (dimension, tokens) in [("input_tokens", cost.input_tokens()), ("output_tokens", cost.output_tokens())] {
            metrics::counter!("llm_tokens_reserved_total", "provider" => labels.provider.clone(), "model" => labels.model.clone(), "dimension" => dimension).increment(tokens);
        }
    }
}

/// A reservation of `reserved` was settled with `usage`, or charged its estimate when `None`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn settled(labels: &Labels, reserved: &Cost, usage: Option<&Usage>) {
    when_enabled! {
        let Some(usage) = usage else {
            metrics::counter!("llm_usage_missing_total").increment(1);
            return;
        };
        for (dimension, reserved, used) in [
            ("input_tokens", reserved.input_tokens(), usage.input_tokens()),
            ("output_tokens", reserved.output_tokens(), usage.output_tokens()),
        ] {
            metrics::counter!("llm_tokens_used_total", "provider" => labels.provider.clone(), "model" => labels.model.clone(), "dimension" => dimension).increment(used);
            if used > 0 {
                metrics::histogram!("llm_estimate_error_ratio", "dimension" => dimension).record(reserved as f64 / used as f64);
            }
        }
    }
}

/// The levels and debts of a budget, after a settlement; at most ten times a second.
#[cfg(feature = "metrics")]
pub(crate) fn budget(budget: &crate::budget::Budget) {
    if !budget.gauges_due() {
        return;
    }
    when_enabled! {
        for limit in budget.snapshot().limits() {
            let dimension = limit.limit().dimension().as_str();
            let window = limit.limit().period().as_secs().to_string();
            metrics::gauge!("llm_budget_level", "dimension" => dimension, "window_seconds" => window.clone()).set(limit.level() as f64);
            metrics::gauge!("llm_budget_debt", "dimension" => dimension, "window_seconds" => window).set(limit.debt() as f64);
        }
    }
}

/// A retry after a failure of `class` (`"rate_limited"`, `"server"`, ...).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn retry(labels: &Labels, class: crate::retry::FailureClass) {
    #[cfg(feature = "metrics")]
    let class = {
        use crate::retry::{FailureClass, Transient};
        match class {
            FailureClass::Transient(Transient::RateLimited) => "rate_limited",
            FailureClass::Transient(Transient::Overloaded) => "overloaded",
            FailureClass::Transient(Transient::Server) => "server",
            FailureClass::Transient(Transient::Timeout) => "timeout",
            FailureClass::Transient(Transient::Connection) => "connection",
            _ => "other",
        }
    };
    when_enabled! {
        metrics::counter!("llm_retries_total", "provider" => labels.provider.clone(), "model" => labels.model.clone(), "error_type" => class).increment(1);
    }
}

/// A rate-limit refusal: `limit_type` (`"requests"`, `"tokens"`, `"queue"`, ...) and
/// `decision` (`"local"` or `"provider"`).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn rate_limit_hit(limit_type: &'static str, decision: &'static str) {
    when_enabled! {
        metrics::counter!("llm_rate_limit_hits_total", "limit_type" => limit_type, "decision" => decision).increment(1);
    }
}

/// The depth of one class of the priority queue.
#[cfg(feature = "metrics")]
pub(crate) fn queue_depth(priority: Priority, depth: usize) {
    when_enabled! {
        metrics::gauge!("llm_queue_depth", "priority" => priority.as_str()).set(depth as f64);
    }
}

/// A request of `priority` waited `wait` in the queue.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn queue_wait(priority: Priority, wait: Duration) {
    when_enabled! {
        metrics::histogram!("llm_queue_wait_seconds", "priority" => priority.as_str()).record(wait.as_secs_f64());
    }
}

/// A call took `call` from sending to its response head.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn call(labels: &Labels, call: Duration) {
    when_enabled! {
        metrics::histogram!("llm_call_seconds", "provider" => labels.provider.clone(), "model" => labels.model.clone()).record(call.as_secs_f64());
    }
}
