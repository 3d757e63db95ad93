//! Step 3's refusals: the governed stack's errors and the provider's refusals (429s after the
//! retries, an overloaded provider) mapped to the gateway's normalized refusal, each naming
//! the scope or limit that binds and when to come back.

use std::time::Duration;

use http::{HeaderMap, StatusCode};
use tower_llm_quota::Error;
use tower_llm_quota::provider::{LimitedBy, RateLimitError};
use tower_llm_quota::retry::{Classify, Failure, FailureClass, ProviderErrors, Transient};

use crate::account::{Account, ScopeError, Scoped, StateRefused};
use crate::refusal::{Refusal, limit_name};
use crate::routes::ScopeRefused;
use crate::tenancy;

/// The normalized refusal for an error of the governed stack.
pub(super) fn stack_error(account: &Account, error: &Error) -> Refusal {
    let scope = format!("account:{}", account.name);
    if let Some(refused) = error.tenant_refused() {
        return tenancy::refused(refused);
    }
    if let Some(refusal) = idempotency_refusal(error) {
        return refusal;
    }
    if let Some(refusal) = unsent(&scope, error) {
        return refusal;
    }
    if let Some(capacity) = error.insufficient_capacity() {
        return too_large(account, scope, capacity);
    }
    if error.is_queue_full() || error.is_deadline_exceeded() {
        return queue_refusal(account, scope, error);
    }
    upstream_failure(&scope, &error.to_string())
}

/// The refusal of a request its `Idempotency-Key` stopped (nothing was sent).
fn idempotency_refusal(error: &Error) -> Option<Refusal> {
    if error
        .idempotency_error()
        .is_some_and(|e| e.is_still_in_flight())
    {
        // Nothing was sent: the first request with this key is still being answered.
        return Some(
            Refusal::conflict(
                "idempotency_key",
                "a request with this Idempotency-Key is still in flight; retry when it completes",
            )
            .retry_after(Some(Duration::from_secs(1))),
        );
    }
    if let Some(invalid) = error.idempotency_error().filter(|e| e.is_invalid_key()) {
        // Nothing was sent: the caller's header cannot be a key.
        let why = std::error::Error::source(invalid)
            .map_or_else(|| invalid.to_string(), ToString::to_string);
        let message = format!(
            "invalid Idempotency-Key header: {why} (1 to 255 visible ASCII characters, once)"
        );
        return Some(Refusal::invalid("idempotency_key", message));
    }
    if let Some(reused) = error.idempotency_error().filter(|e| e.is_key_reused()) {
        // Nothing was sent: the key belongs to another request.
        return Some(Refusal::unprocessable(
            "idempotency_key",
            reused.to_string(),
        ));
    }
    None
}

/// The refusal of a request the account could not send: no scope for its model, no price,
/// its caps not durable, the shared store out of reach.
fn unsent(scope: &str, error: &Error) -> Option<Refusal> {
    if let Some(refused) = in_chain::<ScopeRefused>(error) {
        return Some(match &refused.0 {
            ScopeError::Store(_) => Refusal::unavailable("store", refused.to_string())
                .scope(scope)
                .retry_after(Some(Duration::from_secs(1))),
            ScopeError::BadName | ScopeError::TooMany => {
                Refusal::bad_request(format!("model: {refused}")).scope(scope)
            }
        });
    }
    if error.is_unpriced() {
        // Nothing was sent: a spend limit cannot be kept for a model without a price.
        let reason = std::error::Error::source(error).map_or_else(
            || "the model has no price".to_owned(),
            |no_price| format!("{no_price}: the gateway's [prices] do not name it"),
        );
        return Some(Refusal::bad_request(reason).scope(scope));
    }
    if let Some(refused) = in_chain::<StateRefused>(error) {
        // Nothing was sent: the caps could not count it durably.
        return Some(
            Refusal::unavailable("state", refused.to_string())
                .scope(scope)
                .retry_after(Some(Duration::from_secs(1))),
        );
    }
    if error.is_store_unavailable() {
        // The store's circuit breaker asks again within a second.
        return Some(
            Refusal::unavailable("store", "the shared quota store is unreachable")
                .scope(scope)
                .retry_after(Some(Duration::from_secs(1))),
        );
    }
    None
}

/// The refusal of a request larger than a limit's burst: a bad request, or a rate limit
/// when the provider reported a burst below the configured one.
fn too_large(
    account: &Account,
    scope: String,
    capacity: &tower_llm_quota::error::InsufficientCapacity,
) -> Refusal {
    let dimension = capacity.dimension().as_str();
    let configured = account.configured_capacity(capacity.dimension());
    if configured.is_some_and(|configured| capacity.capacity() < configured) {
        // The burst is below the configured one: the provider reported a lower limit
        // (which it enforces with a 429 for such a request too). A rate limit, not a bad
        // request; the account admits it again if the provider's limit rises.
        return Refusal::rate_limited("reported_limit", scope)
            .dimension(Some(dimension))
            .retry_after(Some(Duration::from_secs(60)))
            .message(format!(
                "the provider reports a {dimension} limit whose burst ({}) is below this \
                     request's {} (configured: {}): the account cannot admit it now",
                capacity.capacity(),
                capacity.cost(),
                configured.unwrap_or_default()
            ));
    }
    Refusal::bad_request(format!(
        "the request's {dimension} ({}) exceed what the account may ever admit at once ({})",
        capacity.cost(),
        capacity.capacity()
    ))
    .scope(scope)
    .dimension(Some(dimension))
}

/// The refusal of a request the account's queue refused: too deep, or a wait longer than
/// its class allows (predicted on arrival, or waited).
fn queue_refusal(account: &Account, scope: String, error: &Error) -> Refusal {
    let limit = if error.is_queue_full() {
        "queue_depth"
    } else {
        "queue_wait"
    };
    // Every 429 says when to come back: the wait the budget predicted (a spent limit: it
    // refused at once), else the one it knows, else a second (the queue moves on within
    // it: its head is admitted or refused by then).
    let retry_after = (error.predicted_wait())
        .or_else(|| error.rate_limit().and_then(|r| r.retry_after()))
        .unwrap_or(Duration::from_secs(1));
    let refusal = match error.predicted_by() {
        // Refused on arrival: the limit and the budget that bind (a model's scope, or the
        // account's own).
        Some(binding) => {
            let (limit, quota) = (binding.limit(), binding.quota());
            let dimension = limit.dimension().as_str();
            let scope = quota.map_or(scope, |quota| budget_scope(&account.name, quota));
            Refusal::rate_limited(limit_name(dimension, limit.period()), scope)
                .dimension(Some(dimension))
        }
        None => Refusal::rate_limited(limit, scope),
    };
    refusal
        .retry_after(Some(retry_after))
        .message(format!("the account's queue refused the request: {error}"))
}

/// The refusal's scope for the budget named `quota` of `account`: its own budgets are named
/// after it (`name`, and `name/*` beside a gate), a scope's `name/scope`.
fn budget_scope(account: &str, quota: &str) -> String {
    match quota
        .strip_prefix(account)
        .and_then(|rest| rest.strip_prefix('/'))
    {
        Some(scope) if scope != "*" => format!("account:{account}/scope:{scope}"),
        _ => format!("account:{account}"),
    }
}

/// The first error of type `T` in `error`'s chain of sources: the state's refusal to make a
/// request's caps durable, the scope a route could not give the request's model.
fn in_chain<T: std::error::Error + 'static>(error: &Error) -> Option<&T> {
    let mut link: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = link {
        if let Some(found) = e.downcast_ref::<T>() {
            return Some(found);
        }
        link = e.source();
    }
    None
}

/// 502: the provider failed without an answer (after the retries the policy allows).
fn upstream_failure(scope: &str, message: &str) -> Refusal {
    let mut refusal = Refusal::unavailable("upstream", format!("the provider failed: {message}"))
        .provider()
        .scope(scope);
    refusal.status = StatusCode::BAD_GATEWAY;
    refusal
}

/// The normalized refusal for a provider's 429 (its retries given up).
pub(super) fn provider_refusal(
    (account, scoped): (&Account, &Scoped),
    head: &http::Response<()>,
    body: &[u8],
) -> Refusal {
    let scope = scoped.label(&account.name);
    let failure = Failure::Response {
        status: head.status(),
        headers: head.headers(),
        body,
    };
    if ProviderErrors.classify(&failure) == FailureClass::Transient(Transient::TierUnavailable) {
        // Not a rate limit: the tier asked for has no capacity now, and the call was not
        // billed. Retry later, or ask for another tier.
        let wait =
            tower_llm_quota::provider::retry_after(head.headers(), std::time::SystemTime::now());
        return Refusal::rate_limited("service_tier", scope)
            .provider()
            .retry_after(Some(wait.unwrap_or(Duration::from_secs(1))))
            .message(format!(
                "the provider account {} has no capacity for the requested service tier now \
                 (not billed): retry later, or ask for another tier",
                account.name
            ));
    }
    let parsed = RateLimitError::from_response(head, body);
    let (limit, dimension) = match parsed.as_ref().map(RateLimitError::limited_by) {
        Some(LimitedBy::Requests) => ("requests_per_minute", Some("requests")),
        Some(LimitedBy::InputTokens) => ("input_tokens_per_minute", Some("input_tokens")),
        Some(LimitedBy::OutputTokens) => ("output_tokens_per_minute", Some("output_tokens")),
        Some(LimitedBy::Tokens) => ("tokens_per_minute", Some("total_tokens")),
        Some(LimitedBy::Daily) => ("tokens_per_day", None),
        Some(LimitedBy::Concurrency) => ("max_in_flight", None),
        _ => ("unknown", None),
    };
    // Every 429 says when to come back: the provider's wait, else when the account's budget
    // (which the 429 drained) expects to admit again, at least a second.
    let retry_after = parsed
        .as_ref()
        .and_then(RateLimitError::retry_after)
        .unwrap_or_else(|| budget_wait(scoped.budget()).max(Duration::from_secs(1)));
    // Google names the quota it refused in (its `QuotaFailure`): passed on.
    let named = crate::gemini::violation(body).map_or(String::new(), |v| format!("; {v}"));
    Refusal::rate_limited(limit, scope)
        .provider()
        .dimension(dimension)
        .retry_after(Some(retry_after))
        .message(match scoped.name() {
            Some(name) => format!(
                "the provider account {} is rate limited for the models of scope {name} \
                 ({limit}{named})",
                account.name
            ),
            None => format!(
                "the provider account {} is rate limited ({limit}{named})",
                account.name
            ),
        })
}

/// How long until every limit of `budget` can spend again.
fn budget_wait(budget: &tower_llm_quota::Budget) -> Duration {
    let snapshot = budget.snapshot();
    snapshot
        .limits()
        .iter()
        .map(|limit| {
            limit
                .available_at()
                .saturating_duration_since(snapshot.taken_at())
        })
        .max()
        .unwrap_or_default()
}

/// Whether an upstream status says the provider is overloaded (Anthropic's 529, a 503), after
/// the stack's retries.
pub(super) fn is_overloaded(status: StatusCode) -> bool {
    status == StatusCode::SERVICE_UNAVAILABLE || status.as_u16() == 529
}

/// The normalized refusal for an overloaded provider: a 503 with `Retry-After` (the
/// provider's, else a second), in the caller's API's schema (for Anthropic's, its 529
/// `overloaded_error`).
pub(super) fn overloaded(account: &Account, headers: &HeaderMap) -> Refusal {
    let retry_after = tower_llm_quota::provider::retry_after(headers, std::time::SystemTime::now())
        .unwrap_or(Duration::from_secs(1));
    Refusal::unavailable(
        crate::refusal::OVERLOADED,
        format!("the provider account {} is overloaded", account.name),
    )
    .provider()
    .scope(format!("account:{}", account.name))
    .retry_after(Some(retry_after))
}
