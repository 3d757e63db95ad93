//! `POST /v1/chat/completions`, `/v1/responses` and `/v1/messages`: authenticate, read and
//! check the body, admit by the tenant tree, send through the account's governed stack, and
//! answer the provider's bytes unchanged, or one normalized refusal.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::Value;
use tower::ServiceExt;
use tower_llm_quota::estimate::{
    CharEstimator, Defaults, RequestEstimate, read_embeddings_json, read_request_json,
};
use tower_llm_quota::provider::ProviderScan;
use tower_llm_quota::provider::{LimitedBy, RateLimitError, Scope};
use tower_llm_quota::retry::{
    Classify, Failure, FailureClass, MaxAttempts, ProviderErrors, Transient,
};
use tower_llm_quota::{BoxError, Cost, Error};

use super::Gateway;
use super::account::{Account, ScopeError, Scoped, StateRefused};
use super::audit::{Audited, Tokens};
use super::clients::Dispatched;
use super::config::{Api, Retries};
use super::fit::{self, Shaped};
use super::gemini::{Method, Native};
use super::metered::{Meter, Metered};
use super::refusal::{Dialect, Refusal, limit_name};
use super::routes::{ScopeRefused, Target};
use super::tenancy;
use tower_llm_quota::idempotency::{IdempotentBody, Operation, Suppressed};
use tower_llm_quota::reconcile::UsageReport;
use tower_llm_quota::routing::ServedBy;

/// The largest provider error body read to normalize a 429.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Forwards one request of `api`.
pub(crate) async fn forward(gateway: Arc<Gateway>, api: Api, request: Request<Body>) -> Response {
    let dialect = dialect_of(api);
    let (parts, body) = request.into_parts();
    let mut audit = Audited::new(api, &parts.headers);
    #[cfg(feature = "otel")]
    {
        audit.parent = super::otel::parent(&parts.headers);
    }
    let Some(caller) = gateway.keys().authenticate(&parts.headers).cloned() else {
        return audit.refuse(&gateway, dialect, None, Refusal::unauthorized());
    };
    audit.entry.tenant = Some(caller.tenant.clone());
    audit.entry.key = Some(caller.name.clone());
    let tenant = Some(caller.tenant.as_str());
    if gateway.shutdown.is_cancelled() {
        return audit.refuse(&gateway, dialect, tenant, stopping());
    }
    if gateway.account(api).is_none() {
        return audit.refuse(&gateway, dialect, tenant, Refusal::not_served(api.path()));
    }
    let body = match read_body(body, gateway.max_body_bytes).await {
        Ok(body) => body,
        Err(refusal) => return audit.refuse(&gateway, dialect, tenant, refusal),
    };
    let native = parts.extensions.get::<Native>();
    let Checked {
        read,
        cost,
        streaming,
        model,
    } = match check_body(api, native, &body) {
        Ok(checked) => checked,
        Err(refusal) => return audit.refuse(&gateway, dialect, tenant, refusal),
    };
    audit.entry.model = Some(model.clone());
    let models = gateway.models();
    let (primary, routed) = match models.resolve(&gateway.accounts, &caller, api, &model) {
        Ok(resolved) => resolved,
        Err(refusal) => return audit.refuse(&gateway, dialect, tenant, refusal),
    };
    let class = caller.class(&parts.headers);
    audit.entry.class = Some(class.as_str());
    audit.entry.account = Some(primary.name.clone());
    audit.entry.provider = Some(primary.profile.name());
    let client_retries = caller.retries == Retries::Client;
    // Under a hard cap, the request's output is bounded, and lowered to what the caps have
    // left when one refuses it.
    let hard = read.is_some() && primary.hard_capped(&caller.path, gateway.fitting.tree_hard());
    let (mut body, mut read, mut cost, mut shaped) = (body, read, cost, None);
    if hard && let Some(asked) = read.take() {
        let (bounded, written) = gateway.fitting.bound(api, &model, (&body, asked));
        cost = bounded.cost(&Defaults::new());
        read = Some(bounded);
        if let Some((written, how)) = written {
            body = written;
            shaped = Some(how);
        }
    }
    // The request as the account's stack takes it: its body, what the estimation layer reads
    // of it, and what the call reports back.
    let upstream = |body: Bytes, read: Option<RequestEstimate>, cost: Cost| {
        let dispatched = Dispatched::default();
        let report = UsageReport::new();
        let mut upstream = primary.request(api, native, &parts.headers, body);
        let extensions = upstream.extensions_mut();
        extensions.insert(class);
        extensions.insert(api);
        if client_retries {
            // One attempt: the caller's SDK retries, paced by the budget the answer paused.
            extensions.insert(MaxAttempts(std::num::NonZeroU32::MIN));
        }
        match read {
            // The body as read here: the estimation layer prices it without parsing it again.
            Some(read) => {
                extensions.insert(read);
            }
            // Its cost as checked: the estimation layer would reserve a reply it never has.
            None => {
                extensions.insert(cost);
            }
        }
        extensions.insert(dispatched.clone());
        // The usage the stack settles the answer with, read when its body ends.
        extensions.insert(report.clone());
        extensions.insert(caller.path.clone());
        // Idempotency keys are the tenant's own: another tenant's same key is another
        // operation.
        extensions.insert(Operation::new(caller.tenant.clone(), api.as_str()));
        extensions.insert(Scope {
            provider: Some(primary.name.clone()),
            model: Some(model.clone()),
            key: Some(caller.name.clone()),
        });
        (upstream, dispatched, report)
    };
    let mut lowered = 0;
    let (result, report) = loop {
        audit.entry.estimated = Some(Tokens {
            input: cost.input_tokens(),
            output: cost.output_tokens(),
            cached: None,
        });
        // Kept only where a hard cap may lower it (else the stack takes it, uncopied).
        let sent = if hard { read.clone() } else { read.take() };
        let (request, dispatched, report) = upstream(body.clone(), sent, cost);
        let mut call = send(routed.target.clone(), request);
        let result = tokio::select! {
            biased;
            result = &mut call => result,
            () = gateway.shutdown.cancelled() => {
                if dispatched.is_set() {
                    call.await
                } else {
                    // Still queued: leave the queue (the future's drop gives its place back).
                    drop(call);
                    return audit.refuse(&gateway, dialect, tenant, stopping());
                }
            }
        };
        // A hard cap refused it: sent again with its bound lowered to what the cap has left,
        // or refused when that is too little to be of use.
        if let (Err(error), Some(asked)) = (&result, &read)
            && lowered < MAX_LOWERINGS
            && let Some(fit) = lower(&gateway, (api, &model), error, (&body, asked))
        {
            match fit {
                Ok((lower_body, lower_read, how)) => {
                    lowered += 1;
                    cost = lower_read.cost(&Defaults::new());
                    (body, read, shaped) = (lower_body, Some(lower_read), Some(how));
                    continue;
                }
                Err(why) => {
                    let refusal = stack_error(primary, error)
                        .client_retries(client_retries)
                        .message(why);
                    return audit.refuse(&gateway, dialect, tenant, refusal);
                }
            }
        }
        break (result, report);
    };
    audit.entry.output_bound = shaped.as_ref().map(Shaped::header);
    let response = match result {
        Ok(response) => response,
        Err(error) => {
            audit.entry.attempts = error.retry_report().map(|r| r.attempts());
            let refusal = stack_error(primary, &error).client_retries(client_retries);
            return audit.refuse(&gateway, dialect, tenant, refusal);
        }
    };
    // The account of the route that answered (a fallback's, a ramp's, or the primary's).
    let served = response.extensions().get::<ServedBy>().cloned();
    let account = &gateway.accounts[routed.account_of(served.as_ref().map(ServedBy::route))];
    audit.answered(account, &response);
    let profile = account.profile_of(api).unwrap_or(account.profile);
    // The scope of the account that answered: its budget's wait, its name in refusals.
    let scoped = response.extensions().get::<Scoped>().cloned();
    let scoped = scoped
        .as_ref()
        .unwrap_or_else(|| account.configured_scope(None));
    if response.status() == StatusCode::TOO_MANY_REQUESTS {
        let (head, body) = response.into_parts();
        let bytes = collect(body, MAX_ERROR_BODY).await.unwrap_or_default();
        let head = http::Response::from_parts(head, ());
        audit.provider_said(&head, &bytes);
        let refusal =
            provider_refusal((account, scoped), &head, &bytes).client_retries(client_retries);
        return audit.refuse(&gateway, dialect, tenant, refusal);
    }
    if is_overloaded(response.status()) {
        let (head, body) = response.into_parts();
        let bytes = collect(body, MAX_ERROR_BODY).await.unwrap_or_default();
        let head = http::Response::from_parts(head, ());
        audit.provider_said(&head, &bytes);
        let refusal = overloaded(account, head.headers()).client_retries(client_retries);
        return audit.refuse(&gateway, dialect, tenant, refusal);
    }
    gateway.ledger.answered(
        &caller.tenant,
        api.as_str(),
        class,
        response.status().as_u16(),
    );
    let (mut head, body) = response.into_parts();
    strip_hop_by_hop(&mut head.headers);
    // The account's rate-limit headers describe every tenant's traffic: each caller sees its
    // own scope's instead.
    strip_rate_limits(&mut head.headers);
    for (name, value) in gateway
        .tenants
        .rate_limit_headers(&account.name, &caller.path, dialect)
    {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::try_from(name),
            http::HeaderValue::try_from(value),
        ) {
            head.headers.insert(name, value);
        }
    }
    if let Some(served) = &served {
        insert_route_headers(&mut head.headers, served);
    }
    if let Some(value) = shaped
        .as_ref()
        .and_then(|s| http::HeaderValue::try_from(s.header()).ok())
    {
        head.headers.insert(fit::HEADER, value);
    }
    audit.entry.status = head.status.as_u16();
    if let Ok(id) = http::HeaderValue::from_str(&audit.entry.request_id) {
        head.headers.insert("x-request-id", id);
    }
    // An answer without a call of its own settled nothing: its body is read here.
    let scan = head
        .extensions
        .get::<Suppressed>()
        .map(|_| ProviderScan::new(profile, streaming).tier_from(&head.headers));
    let meter = Meter {
        gateway: gateway.clone(),
        tenant: caller.tenant.clone(),
        path: caller.path.clone(),
        account: account.name.clone(),
        report,
        scan,
        estimate: cost,
        audited: Some(audit),
        bytes: 0,
    };
    Response::from_parts(head, Body::new(Metered::new(body, meter)))
}

impl Audited {
    /// Writes the refused request's line and answers the refusal (in `dialect`, recorded for
    /// `tenant`), with the request's id.
    fn refuse(
        mut self,
        gateway: &Gateway,
        dialect: Dialect,
        tenant: Option<&str>,
        refusal: Refusal,
    ) -> Response {
        self.entry.decision = match refusal.gateway_decision {
            super::refusal::Decision::Local => "local",
            super::refusal::Decision::Provider => "provider",
        };
        self.entry.status = refusal.status.as_u16();
        self.entry.limit = Some(refusal.limit.to_string());
        self.entry.scope = Some(refusal.scope.to_string());
        self.entry.reason = Some(refusal.message.to_string());
        let id = http::HeaderValue::from_str(&self.entry.request_id).ok();
        self.finish(gateway, None, 0);
        let mut response = gateway.refuse_in(dialect, tenant, refusal);
        if let Some(id) = id {
            response.headers_mut().insert("x-request-id", id);
        }
        response
    }

    /// Records what the answer's head says: the route and account that served it, why a
    /// fallback did, the attempts, the time queued and the call's.
    fn answered<B>(&mut self, account: &Account, response: &http::Response<B>) {
        let extensions = response.extensions();
        self.entry.account = Some(account.name.clone());
        self.entry.provider = Some(account.profile.name());
        self.prices = extensions
            .get::<tower_llm_quota::pricing::Priced>()
            .cloned();
        if let Some(served) = extensions.get::<ServedBy>() {
            self.entry.route = Some(served.route().to_owned());
            self.entry.fallback = served.fallback_reason().map(|r| r.as_str());
        }
        let timings = extensions.get::<tower_llm_quota::Timings>();
        // A report when the stack retried; a call's timings alone when one attempt did; neither
        // for an answer replayed from an idempotency record.
        self.entry.attempts = match extensions.get::<tower_llm_quota::retry::RetryReport>() {
            Some(report) => Some(report.attempts()),
            None => timings.map(|_| 1),
        };
        // A fallback's answer: the calls the routes before it made count too.
        let earlier = extensions
            .get::<ServedBy>()
            .map_or(0, ServedBy::earlier_attempts);
        if earlier > 0 {
            self.entry.attempts = Some(self.entry.attempts.unwrap_or(0) + earlier);
        }
        if let Some(timings) = timings {
            self.entry.queue_ms = Some(super::audit::millis(timings.waited()));
            self.entry.call_ms = Some(super::audit::millis(timings.call()));
            // The gateway's own time to the answer's head: neither the queue nor the call.
            let added = self
                .started
                .elapsed()
                .saturating_sub(timings.waited() + timings.call());
            metrics::histogram!("gateway_added_seconds", "api" => self.entry.api)
                .record(added.as_secs_f64());
        }
    }
}

/// `x-llm-quota-route`: the route that served the request; `x-llm-quota-fallback`: why a
/// fallback did; `x-llm-quota-ramped: true` for the ramp's share.
fn insert_route_headers(headers: &mut HeaderMap, served: &ServedBy) {
    if let Ok(route) = http::HeaderValue::from_str(served.route()) {
        headers.insert("x-llm-quota-route", route);
    }
    if let Some(reason) = served.fallback_reason() {
        headers.insert(
            "x-llm-quota-fallback",
            http::HeaderValue::from_static(reason.as_str()),
        );
    }
    if served.ramped() {
        headers.insert("x-llm-quota-ramped", http::HeaderValue::from_static("true"));
    }
}

/// How many times a request is lowered to fit the hard caps before it is refused: each
/// lowering fits what the refusing cap had left, which other requests may take first, and
/// another cap of its path may then refuse it.
const MAX_LOWERINGS: usize = 4;

/// For a request a hard cap refused (`error`), the request lowered to what the cap has left
/// (its new body, estimate, and what was done), or why it is not (too little left to be of
/// use); `None` when no hard cap refused it or lowering cannot help (its prompt alone does
/// not fit, it asked no more than what is left).
fn lower(
    gateway: &Gateway,
    (api, model): (Api, &str),
    error: &Error,
    (body, read): (&[u8], &RequestEstimate),
) -> Option<Result<(Bytes, RequestEstimate, Shaped), String>> {
    let refused = error.tenant_refused()?;
    let left = refused.cap_left()?;
    let room = gateway.fitting.room(read, model, left)?;
    if room >= read.max_output_tokens()? {
        return None;
    }
    let min = gateway.fitting.min_tokens();
    if room < min {
        return Some(Err(format!(
            "{refused}: what it has left pays for {room} output tokens, below the useful \
             minimum of {min} ([output] min_tokens)"
        )));
    }
    let body = fit::write_bound(api, body, room)?;
    let cap = tenancy::refused(refused);
    let how = Shaped::Lowered {
        to: room,
        limit: cap.limit.to_string(),
        scope: cap.scope.to_string(),
    };
    Some(Ok((body, read.clone().with_output_bound(room), how)))
}

/// Whose error schema the callers of `api` read: the Anthropic SDK's on `/v1/messages`,
/// OpenAI's elsewhere.
pub(crate) fn dialect_of(api: Api) -> Dialect {
    match api {
        Api::Messages | Api::CountTokens => Dialect::Anthropic,
        Api::Chat | Api::Responses | Api::Embeddings | Api::Completions => Dialect::OpenAi,
        Api::GenerateContent | Api::EmbedContent | Api::GeminiCountTokens => Dialect::Gemini,
    }
}

/// The answer of a request's target.
type Answer = Result<http::Response<IdempotentBody>, Error>;

/// The target's answer, as a boxed `Send` future (its type names the whole stack).
fn send(
    target: Target,
    request: http::Request<http_body_util::Full<Bytes>>,
) -> Pin<Box<dyn Future<Output = Answer> + Send>> {
    Box::pin(target.oneshot(request))
}

fn stopping() -> Refusal {
    Refusal::unavailable(
        "shutdown",
        "the gateway is shutting down; retry on another replica",
    )
    .retry_after(Some(Duration::from_secs(1)))
}

/// A body's bytes, at most `max` of them, as a boxed `Send` future.
fn collect<B>(body: B, max: usize) -> Pin<Box<dyn Future<Output = Result<Bytes, BoxError>> + Send>>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    Box::pin(async move { Ok(Limited::new(body, max).collect().await?.to_bytes()) })
}

async fn read_body(body: Body, max: usize) -> Result<Bytes, Refusal> {
    match collect(body, max).await {
        Ok(bytes) => Ok(bytes),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            Err(Refusal::too_large(max))
        }
        Err(error) if super::serve::BodyTimeout::is_in(&*error) => {
            Err(Refusal::body_timeout(error.to_string()))
        }
        Err(error) => Err(Refusal::bad_request(format!(
            "the body could not be read: {error}"
        ))),
    }
}

/// The request's estimated cost, whether it streams and its model, or why its body is
/// refused. A native Gemini request's model and stream are its path's (`native`).
pub(crate) fn check_body(
    api: Api,
    native: Option<&Native>,
    body: &[u8],
) -> Result<Checked, Refusal> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| Refusal::bad_request(format!("the body is not JSON: {e}")))?;
    let object = value
        .as_object()
        .ok_or_else(|| Refusal::bad_request("the body is not a JSON object"))?;
    let fields: &[&str] = match (api, native.map(|n| n.method)) {
        (Api::Responses | Api::Embeddings, _) => &["input"],
        (Api::Completions, _) => &["prompt"],
        (Api::Chat | Api::Messages | Api::CountTokens, _) => &["messages"],
        (Api::GenerateContent | Api::GeminiCountTokens, _) => &["contents"],
        (Api::EmbedContent, Some(Method::BatchEmbed)) => &["requests"],
        (Api::EmbedContent, _) => &["content"],
    };
    let field = fields[0];
    if !fields.iter().any(|field| object.contains_key(*field)) {
        return Err(Refusal::bad_request(format!("the body has no `{field}`")));
    }
    let (model, streaming) = match native {
        Some(native) => (native.model.to_string(), native.streams()),
        None => {
            let model = match object.get("model").and_then(Value::as_str) {
                Some(model) if !model.trim().is_empty() => model.to_owned(),
                _ => return Err(Refusal::bad_request("the body names no `model`")),
            };
            let streaming = object
                .get("stream")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            (model, streaming)
        }
    };
    // Read as the accounts' estimation layers read it (their default estimator and defaults),
    // from the value parsed above: the body is parsed once.
    let chars = CharEstimator::new();
    let defaults = Defaults::new();
    let read = match api {
        // Anthropic and Google count tokens without billing any: one request.
        Api::CountTokens | Api::GeminiCountTokens => None,
        Api::Embeddings | Api::EmbedContent => Some(read_embeddings_json(&value, &chars)),
        _ => Some(read_request_json(&value, &chars, &defaults)),
    };
    let cost = match &read {
        None => Cost::new(0, 0),
        Some(Some(read)) => read.cost(&defaults),
        Some(None) => {
            return Err(Refusal::bad_request(format!(
                "the `{field}` cannot be read"
            )));
        }
    };
    Ok(Checked {
        read: read.flatten(),
        cost,
        streaming,
        model,
    })
}

/// A request body as the gateway checked it.
#[derive(Debug)]
pub(crate) struct Checked {
    /// What the estimation layer reads of it; none for a count of tokens.
    pub(crate) read: Option<RequestEstimate>,
    /// Its estimated cost.
    pub(crate) cost: Cost,
    /// Whether it asks for a stream.
    pub(crate) streaming: bool,
    /// The model it names.
    pub(crate) model: String,
}

/// The normalized refusal for an error of the governed stack.
fn stack_error(account: &Account, error: &Error) -> Refusal {
    let scope = format!("account:{}", account.name);
    if let Some(refused) = error.tenant_refused() {
        return tenancy::refused(refused);
    }
    if error
        .idempotency_error()
        .is_some_and(|e| e.is_still_in_flight())
    {
        // Nothing was sent: the first request with this key is still being answered.
        return Refusal::conflict(
            "idempotency_key",
            "a request with this Idempotency-Key is still in flight; retry when it completes",
        )
        .retry_after(Some(Duration::from_secs(1)));
    }
    if let Some(invalid) = error.idempotency_error().filter(|e| e.is_invalid_key()) {
        // Nothing was sent: the caller's header cannot be a key.
        let why = std::error::Error::source(invalid)
            .map_or_else(|| invalid.to_string(), ToString::to_string);
        let message = format!(
            "invalid Idempotency-Key header: {why} (1 to 255 visible ASCII characters, once)"
        );
        return Refusal::invalid("idempotency_key", message);
    }
    if let Some(reused) = error.idempotency_error().filter(|e| e.is_key_reused()) {
        // Nothing was sent: the key belongs to another request.
        return Refusal::unprocessable("idempotency_key", reused.to_string());
    }
    if let Some(refused) = scope_refused(error) {
        return match &refused.0 {
            ScopeError::Store(_) => Refusal::unavailable("store", refused.to_string())
                .scope(scope)
                .retry_after(Some(Duration::from_secs(1))),
            ScopeError::BadName | ScopeError::TooMany => {
                Refusal::bad_request(format!("model: {refused}")).scope(scope)
            }
        };
    }
    if error.is_unpriced() {
        // Nothing was sent: a spend limit cannot be kept for a model without a price.
        let reason = std::error::Error::source(error).map_or_else(
            || "the model has no price".to_owned(),
            |no_price| format!("{no_price}: the gateway's [prices] do not name it"),
        );
        return Refusal::bad_request(reason).scope(scope);
    }
    if let Some(refused) = state_refused(error) {
        // Nothing was sent: the caps could not count it durably.
        return Refusal::unavailable("state", refused.to_string())
            .scope(scope)
            .retry_after(Some(Duration::from_secs(1)));
    }
    if error.is_store_unavailable() {
        // The store's circuit breaker asks again within a second.
        return Refusal::unavailable("store", "the shared quota store is unreachable")
            .scope(scope)
            .retry_after(Some(Duration::from_secs(1)));
    }
    if let Some(capacity) = error.insufficient_capacity() {
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
        return Refusal::bad_request(format!(
            "the request's {dimension} ({}) exceed what the account may ever admit at once ({})",
            capacity.cost(),
            capacity.capacity()
        ))
        .scope(scope)
        .dimension(Some(dimension));
    }
    if error.is_queue_full() || error.is_deadline_exceeded() {
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
        return refusal
            .retry_after(Some(retry_after))
            .message(format!("the account's queue refused the request: {error}"));
    }
    upstream_failure(&scope, &error.to_string())
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

/// The state's refusal to make a request's caps durable, if that refused it.
fn state_refused(error: &Error) -> Option<&StateRefused> {
    let mut link: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = link {
        if let Some(refused) = e.downcast_ref::<StateRefused>() {
            return Some(refused);
        }
        link = e.source();
    }
    None
}

/// The scope a route could not give the request's model, if that refused it.
fn scope_refused(error: &Error) -> Option<&ScopeRefused> {
    let mut link: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = link {
        if let Some(refused) = e.downcast_ref::<ScopeRefused>() {
            return Some(refused);
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
fn provider_refusal(
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
    let named = super::gemini::violation(body).map_or(String::new(), |v| format!("; {v}"));
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
fn is_overloaded(status: StatusCode) -> bool {
    status == StatusCode::SERVICE_UNAVAILABLE || status.as_u16() == 529
}

/// The normalized refusal for an overloaded provider: a 503 with `Retry-After` (the
/// provider's, else a second), in the caller's API's schema (for Anthropic's, its 529
/// `overloaded_error`).
fn overloaded(account: &Account, headers: &HeaderMap) -> Refusal {
    let retry_after = tower_llm_quota::provider::retry_after(headers, std::time::SystemTime::now())
        .unwrap_or(Duration::from_secs(1));
    Refusal::unavailable(
        super::refusal::OVERLOADED,
        format!("the provider account {} is overloaded", account.name),
    )
    .provider()
    .scope(format!("account:{}", account.name))
    .retry_after(Some(retry_after))
}

/// Removes the provider's rate-limit headers (OpenAI's, Azure's and Anthropic's).
fn strip_rate_limits(headers: &mut HeaderMap) {
    let names: Vec<http::HeaderName> = headers
        .keys()
        .filter(|name| {
            let name = name.as_str();
            name.starts_with("x-ratelimit-") || name.starts_with("anthropic-ratelimit-")
        })
        .cloned()
        .collect();
    for name in names {
        headers.remove(name);
    }
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
}
