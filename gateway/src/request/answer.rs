//! Step 4: the answer. A provider's 429 or overload (after the stack's retries) becomes the
//! normalized refusal; any other answer goes to the caller as the provider sent it, its
//! account-wide rate-limit headers replaced by the caller's own scope's, and its body
//! metered: settled, audited and counted once when it ends ([`crate::metered`]).

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use http::{HeaderMap, StatusCode, header};
use tower_llm_quota::idempotency::Suppressed;
use tower_llm_quota::provider::ProviderScan;
use tower_llm_quota::routing::ServedBy;

use super::call::Answered;
use super::incoming::{Incoming, collect};
use super::pushback::{is_overloaded, overloaded, provider_refusal};
use crate::Gateway;
use crate::account::Account;
use crate::audit::Audited;
use crate::auth::Caller;
use crate::config::Retries;
use crate::fit::{self};
use crate::metered::{Meter, Metered};
use crate::refusal::Dialect;

/// The largest provider error body read to normalize a 429.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// The caller's answer to `incoming`, which `account` answered.
pub(super) async fn answer(
    gateway: &Arc<Gateway>,
    (caller, account): (&Caller, &Account),
    incoming: &Incoming,
    answered: Answered,
    mut audit: Audited,
) -> Response {
    let Answered {
        response,
        report,
        trip,
    } = answered;
    let (api, dialect) = (incoming.api, Dialect::of(incoming.api));
    let tenant = Some(caller.tenant.as_str());
    audit.answered(account, &response);
    let client_retries = caller.retries == Retries::Client;
    let status = response.status();
    if status == StatusCode::TOO_MANY_REQUESTS || is_overloaded(status) {
        let (head, body) = response.into_parts();
        let bytes = collect(body, MAX_ERROR_BODY).await.unwrap_or_default();
        let head = http::Response::from_parts(head, ());
        audit.provider_said(&head, &bytes);
        let refusal = if status == StatusCode::TOO_MANY_REQUESTS {
            // The scope of the account that answered: its budget's wait, its name.
            let scoped = trip.served_by();
            let scoped = scoped
                .as_ref()
                .unwrap_or_else(|| account.configured_scope(None));
            provider_refusal((account, scoped), &head, &bytes)
        } else {
            overloaded(account, head.headers())
        };
        let refusal = refusal.client_retries(client_retries);
        return audit.refuse(gateway, dialect, tenant, refusal);
    }
    let class = incoming.class;
    gateway
        .ledger
        .answered(&caller.tenant, api.as_str(), class, status.as_u16());
    let (mut head, body) = response.into_parts();
    answer_headers(gateway, (caller, account), incoming, &mut head);
    audit.entry.status = head.status.as_u16();
    if let Ok(id) = http::HeaderValue::from_str(&audit.entry.request_id) {
        head.headers.insert("x-request-id", id);
    }
    // An answer without a call of its own settled nothing: its body is read here.
    let profile = account.profile_of(api).unwrap_or(account.profile);
    let scan = (head.extensions.get::<Suppressed>())
        .map(|_| ProviderScan::new(profile, incoming.checked.streaming).tier_from(&head.headers));
    let meter = Meter {
        gateway: gateway.clone(),
        tenant: caller.tenant.clone(),
        path: caller.path.clone(),
        account: account.name.clone(),
        report,
        scan,
        estimate: incoming.checked.cost,
        audited: Some(audit),
        bytes: 0,
    };
    Response::from_parts(head, Body::new(Metered::new(body, meter)))
}

/// The answer's headers as the caller gets them: hop-by-hop ones dropped, the account's
/// rate-limit headers replaced by the caller's scope's, the route, the output bound written,
/// the request's id.
fn answer_headers(
    gateway: &Gateway,
    (caller, account): (&Caller, &Account),
    incoming: &Incoming,
    head: &mut http::response::Parts,
) {
    strip_hop_by_hop(&mut head.headers);
    // The account's rate-limit headers describe every tenant's traffic: each caller sees its
    // own scope's instead.
    strip_rate_limits(&mut head.headers);
    let dialect = Dialect::of(incoming.api);
    let own = (gateway.tenants).rate_limit_headers(&account.name, &caller.path, dialect);
    for (name, value) in own {
        head.headers.insert(name, value);
    }
    if let Some(served) = head.extensions.get::<ServedBy>().cloned() {
        insert_route_headers(&mut head.headers, &served);
    }
    if let Some(value) =
        (incoming.shaped.as_ref()).and_then(|s| http::HeaderValue::try_from(s.header()).ok())
    {
        head.headers.insert(fit::HEADER, value);
    }
}

impl Audited {
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
            self.entry.queue_ms = Some(crate::audit::millis(timings.waited()));
            self.entry.call_ms = Some(crate::audit::millis(timings.call()));
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
