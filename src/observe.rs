//! The field's metrics, recorded through the [`metrics`](https://docs.rs/metrics) facade when
//! the `metrics` feature is on; without it every function here compiles to nothing.
//!
//! Label values come from the request: `provider` and `model` from its
//! [`Scope`](crate::scope::Scope) (`"unknown"` when absent), `priority` from its class,
//! `dimension` and `status` from fixed sets. Keep the scope's values to a bounded set (provider
//! and model names, never user ids), so the number of series stays bounded.
//!
//! # Length
//!
//! Every metric name and label set of the crate is here, one function per event, so that the
//! names are reviewed, documented (in the README's table) and kept stable in one place.

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
    /// The labels of a request, from its [`Scope`](crate::scope::Scope).
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn of(extensions: &Extensions) -> Self {
        #[cfg(feature = "metrics")]
        {
            let scope = extensions.get::<crate::scope::Scope>();
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
    //! Handles are cached per thread, per recorder: registering a labelled series on every call
    //! (building its key, looking it up) cost more than the rest of the stack. The cache is keyed
    //! by the recorder's identity too, so a recorder installed after the first requests (or a
    //! local one in a test) gets fresh handles and the descriptions, never stale no-ops.

    use std::cell::RefCell;
    use std::collections::HashMap;

    use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder, SharedString};

    static METADATA: Metadata<'static> =
        Metadata::new("tower_llm_quota", Level::INFO, Some(module_path!()));

    /// A series: its name and up to four label values (the label names are fixed per name).
    type Series = (&'static str, [SharedString; 4]);

    type Map<H> = HashMap<Series, H, foldhash::fast::RandomState>;

    #[derive(Default)]
    struct Cache {
        recorder: usize,
        counters: Map<Counter>,
        gauges: Map<Gauge>,
        histograms: Map<Histogram>,
    }

    /// At most this many series are cached per thread and kind; past it the cache starts over.
    const MAX_SERIES: usize = 4_096;

    thread_local! {
        static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
    }

    fn recorder_id() -> usize {
        metrics::with_recorder(|r| r as *const dyn Recorder as *const () as usize)
    }

    fn key(name: &'static str, labels: &[(&'static str, SharedString)]) -> Key {
        Key::from_parts(
            name,
            labels
                .iter()
                .map(|(k, v)| Label::new(*k, v.clone()))
                .collect::<Vec<_>>(),
        )
    }

    /// The cache, emptied (and the descriptions given again) if the recorder changed.
    fn with_cache<T>(f: impl FnOnce(&mut Cache) -> T) -> T {
        let id = recorder_id();
        CACHE.with_borrow_mut(|cache| {
            if cache.recorder != id {
                *cache = Cache {
                    recorder: id,
                    ..Cache::default()
                };
                describe();
            }
            f(cache)
        })
    }

    fn series(name: &'static str, labels: &[(&'static str, SharedString)]) -> Series {
        debug_assert!(
            labels.len() <= 4,
            "a series of {name} with more than four labels"
        );
        let mut values = [const { SharedString::const_str("") }; 4];
        for (slot, (_, value)) in values.iter_mut().zip(labels) {
            *slot = value.clone();
        }
        (name, values)
    }

    pub(super) fn counter(
        name: &'static str,
        labels: &[(&'static str, SharedString)],
        record: impl FnOnce(&Counter),
    ) {
        with_cache(|cache| {
            if cache.counters.len() >= MAX_SERIES {
                cache.counters.clear();
            }
            record(
                cache
                    .counters
                    .entry(series(name, labels))
                    .or_insert_with(|| {
                        metrics::with_recorder(|r| {
                            r.register_counter(&key(name, labels), &METADATA)
                        })
                    }),
            );
        });
    }

    pub(super) fn gauge(
        name: &'static str,
        labels: &[(&'static str, SharedString)],
        record: impl FnOnce(&Gauge),
    ) {
        with_cache(|cache| {
            if cache.gauges.len() >= MAX_SERIES {
                cache.gauges.clear();
            }
            record(cache.gauges.entry(series(name, labels)).or_insert_with(|| {
                metrics::with_recorder(|r| r.register_gauge(&key(name, labels), &METADATA))
            }));
        });
    }

    pub(super) fn histogram(
        name: &'static str,
        labels: &[(&'static str, SharedString)],
        record: impl FnOnce(&Histogram),
    ) {
        with_cache(|cache| {
            if cache.histograms.len() >= MAX_SERIES {
                cache.histograms.clear();
            }
            record(
                cache
                    .histograms
                    .entry(series(name, labels))
                    .or_insert_with(|| {
                        metrics::with_recorder(|r| {
                            r.register_histogram(&key(name, labels), &METADATA)
                        })
                    }),
            );
        });
    }

    fn describe() {
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
            "Tokens the provider reported, by the service tier that served them."
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
            "Budget level after a settlement, per budget (queue: the quota's name) and limit."
        );
        describe_gauge!(
            "llm_budget_debt",
            "Budget debt after a settlement, per budget (queue: the quota's name) and limit."
        );
        describe_gauge!(
            "llm_budget_share",
            "Share of the nominal limit the budget plans for (adaptive or fixed), per budget (queue: the quota's name) and limit."
        );
        describe_counter!(
            "llm_fallbacks_total",
            "Requests sent to a fallback route, and admissions of a shared budget from its local share (from `shared_store` to `local_share`), by reason."
        );
        describe_gauge!(
            "llm_ramp_share",
            "A ramp's share of the traffic it applies to, in percent, per route."
        );
        describe_gauge!(
            "llm_ramp_paused",
            "Whether a ramp's growth is paused (1) or not (0), per route."
        );
        describe_counter!(
            "llm_tenant_tokens_total",
            Unit::Count,
            "Tokens settled per tenant, guaranteed (within its guarantee) or borrowed."
        );
        describe_counter!(
            "llm_tenant_refusals_total",
            "Requests refused by a tenant scope, by reason."
        );
        describe_counter!(
            "llm_duplicate_suppressed_total",
            "Requests answered without a call of their own: joined an identical call in flight, or replayed a stored response; by task type."
        );
    }
}

macro_rules! when_enabled {
    ($($body:tt)*) => {{
        #[cfg(feature = "metrics")]
        {
            $($body)*
        }
    }};
}

#[cfg(feature = "metrics")]
use metrics::SharedString;

#[cfg(feature = "metrics")]
const INPUT: SharedString = SharedString::const_str("input_tokens");
#[cfg(feature = "metrics")]
const OUTPUT: SharedString = SharedString::const_str("output_tokens");

/// A call reached the provider and answered with `status`, or failed without an answer.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn request(labels: &Labels, status: Option<http::StatusCode>) {
    when_enabled! {
        let status = match status {
            Some(status) => SharedString::from(status.as_str().to_owned()),
            None => SharedString::const_str("error"),
        };
        enabled::counter(
            "llm_requests_total",
            &[("provider", labels.provider.clone()), ("model", labels.model.clone()), ("status", status)], |h| h.increment(1));
    }
}

/// A shared budget admitted from its local fallback share: its store did not answer
/// (`store_unavailable`) or its breaker was open (`breaker_open`). Counted in
/// `llm_fallbacks_total` from `shared_store` to `local_share`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn fallback(reason: &'static str) {
    when_enabled! {
        enabled::counter(
            "llm_fallbacks_total",
            &[
                ("from_provider", SharedString::const_str("shared_store")),
                ("to_provider", SharedString::const_str("local_share")),
                ("reason", SharedString::const_str(reason)),
            ],
            |h| h.increment(1),
        );
    }
}

/// A router sent a request from a route of `from` to a fallback of `to`, for `reason`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn route_fallback(from: &str, to: &str, reason: &'static str) {
    when_enabled! {
        enabled::counter(
            "llm_fallbacks_total",
            &[
                ("from_provider", SharedString::from(from.to_owned())),
                ("to_provider", SharedString::from(to.to_owned())),
                ("reason", SharedString::const_str(reason)),
            ],
            |h| h.increment(1),
        );
    }
}

/// A ramp's share of its route (percent) and whether its growth is paused.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn ramp(route: &str, share: f64, paused: bool) {
    when_enabled! {
        let labels = [("route", SharedString::from(route.to_owned()))];
        enabled::gauge("llm_ramp_share", &labels, |g| g.set(share));
        enabled::gauge("llm_ramp_paused", &labels, |g| g.set(if paused { 1.0 } else { 0.0 }));
    }
}

/// The budget admitted `cost`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn reserved(labels: &Labels, cost: &Cost) {
    when_enabled! {
        for (dimension, tokens) in [(INPUT, cost.input_tokens()), (OUTPUT, cost.output_tokens())] {
            enabled::counter(
                "llm_tokens_reserved_total",
                &[("provider", labels.provider.clone()), ("model", labels.model.clone()), ("dimension", dimension)], |h| h.increment(tokens));
        }
    }
}

/// A reservation of `reserved` was settled with `usage`, or charged its estimate when `None`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn settled(labels: &Labels, reserved: &Cost, usage: Option<&Usage>) {
    when_enabled! {
        let Some(usage) = usage else {
            enabled::counter("llm_usage_missing_total", &[], |h| h.increment(1));
            return;
        };
        let tier = metrics::SharedString::const_str(usage.service_tier().map_or("unknown", |t| t.as_str()));
        for (dimension, reserved, used) in [
            (INPUT, reserved.input_tokens(), usage.input_tokens()),
            (OUTPUT, reserved.output_tokens(), usage.output_tokens()),
        ] {
            enabled::counter(
                "llm_tokens_used_total",
                &[("provider", labels.provider.clone()), ("model", labels.model.clone()), ("dimension", dimension.clone()), ("service_tier", tier.clone())], |h| h.increment(used));
            if used > 0 {
                enabled::histogram("llm_estimate_error_ratio", &[("dimension", dimension)], |h| h.record(reserved as f64 / used as f64));
            }
        }
    }
}

/// The levels and debts of a budget's `limits` (from its snapshot), after a settlement (at most ten times a
/// second: the caller asks the budget whether its gauges are due), labelled `queue` with the
/// quota's name as its ordering's depth is: several budgets (accounts, scopes) keep series
/// of their own.
#[cfg(feature = "metrics")]
pub(crate) fn budget(name: std::sync::Arc<str>, limits: &[crate::quota::LimitSnapshot]) {
    let name = SharedString::from(name);
    for limit in limits {
        let labels = [
            ("queue", name.clone()),
            (
                "dimension",
                SharedString::const_str(limit.limit().dimension().as_str()),
            ),
            (
                "window_seconds",
                SharedString::from(limit.limit().period().as_secs().to_string()),
            ),
        ];
        enabled::gauge("llm_budget_level", &labels, |h| h.set(limit.level() as f64));
        enabled::gauge("llm_budget_debt", &labels, |h| h.set(limit.debt() as f64));
        enabled::gauge("llm_budget_share", &labels, |h| {
            h.set(limit.limit().headroom())
        });
    }
}

/// A retry after a failure of `error_type` (`"rate_limited"`, `"server"`, ...).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn retry(labels: &Labels, error_type: &'static str) {
    when_enabled! {
        enabled::counter(
            "llm_retries_total",
            &[("provider", labels.provider.clone()), ("model", labels.model.clone()), ("error_type", SharedString::const_str(error_type))], |h| h.increment(1));
    }
}

/// A rate-limit refusal: `limit_type` (`"requests"`, `"tokens"`, `"queue_full"`, ...) and
/// `decision` (`"local"` or `"provider"`).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn rate_limit_hit(limit_type: &'static str, decision: &'static str) {
    when_enabled! {
        enabled::counter(
            "llm_rate_limit_hits_total",
            &[("limit_type", SharedString::const_str(limit_type)), ("decision", SharedString::const_str(decision))], |h| h.increment(1));
    }
}

/// The depth of one class of an ordering changed by `change`: the gauge adds up the orderings
/// that share a `queue` label.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn queue_depth_change(priority: Priority, queue: &std::sync::Arc<str>, change: f64) {
    #[cfg(feature = "metrics")]
    enabled::gauge(
        "llm_queue_depth",
        &[
            ("priority", SharedString::const_str(priority.as_str())),
            ("queue", SharedString::from(std::sync::Arc::clone(queue))),
        ],
        |h| h.increment(change),
    );
}

/// Records `value` in the field `name` of the current span (the request's, opened by the
/// retry layer at debug level), unless no subscriber listens at that level: looking the span up
/// is then skipped.
pub(crate) fn span_record(name: &'static str, value: u64) {
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        tracing::Span::current().record(name, value);
    }
}

/// A request of `priority` waited `wait` in the queue.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn queue_wait(priority: Priority, wait: Duration) {
    when_enabled! {
        enabled::histogram("llm_queue_wait_seconds", &[("priority", SharedString::const_str(priority.as_str()))], |h| h.record(wait.as_secs_f64()));
    }
}

/// A call took `call` from sending to its response head.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn call(labels: &Labels, call: Duration) {
    when_enabled! {
        enabled::histogram(
            "llm_call_seconds",
            &[("provider", labels.provider.clone()), ("model", labels.model.clone())], |h| h.record(call.as_secs_f64()));
    }
}

/// A request of `task` was answered without a call of its own (coalesced or replayed).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn duplicate_suppressed(task: Option<&str>) {
    when_enabled! {
        let task = task.map_or(SharedString::const_str("unknown"), |t| SharedString::from(t.to_owned()));
        enabled::counter("llm_duplicate_suppressed_total", &[("task_type", task)], |h| h.increment(1));
    }
}
