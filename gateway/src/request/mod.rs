//! One request's walk down and back, a step per file:
//!
//! 1. [`incoming`]: who asks (the caller's key, checked once) and what (the body read and
//!    parsed once: its model, its estimated cost, whether it streams).
//! 2. The route: the model's routes and primary account, found once by
//!    [`Models::resolve`](crate::models::Models::resolve); under a hard cap the output is
//!    bounded ([`crate::fit`]).
//! 3. [`call`]: through the crate's stack, over the route that admits it (the route points
//!    the request at its account, scope and model: [`crate::routes`]).
//! 4. [`answer`]: a provider's refusal normalized ([`pushback`]), or the provider's answer
//!    passed on, settled, audited and metered once when its body ends ([`crate::metered`]).

mod answer;
mod call;
mod incoming;
mod pushback;

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use http::Request;

use crate::Gateway;
use crate::audit::Audited;
use crate::config::Api;
use crate::refusal::{Dialect, Refusal};

/// Serves one request of `api`: the walk, step by step.
///
/// # Cancel safety
///
/// Dropped at any point (its connection closed), nothing is charged twice or lost: a request
/// still queued leaves the queue, and a reservation is settled or refunded by the stack's
/// futures and bodies as they drop. A request dropped before its answer's head writes no
/// audit line; once the answer's body is on its way, its end or its drop writes it.
pub(crate) async fn handle(gateway: Arc<Gateway>, api: Api, request: Request<Body>) -> Response {
    let dialect = Dialect::of(api);
    let (parts, body) = request.into_parts();
    let mut audit = Audited::new(api, &parts.headers);
    #[cfg(feature = "otel")]
    {
        audit.parent = crate::otel::parent(&parts.headers);
    }
    // 1. Who asks, and what.
    let Some(caller) = gateway.keys().authenticate(&parts.headers).cloned() else {
        return audit.refuse(&gateway, dialect, None, Refusal::unauthorized());
    };
    audit.entry.tenant = Some(caller.tenant.clone());
    audit.entry.key = Some(caller.name.clone());
    let tenant = Some(caller.tenant.as_str());
    let incoming = match incoming::read(&gateway, (api, &caller), &parts, body).await {
        Ok(incoming) => incoming,
        Err(refusal) => return audit.refuse(&gateway, dialect, tenant, refusal),
    };
    audit.entry.model = Some(incoming.checked.model.clone());
    // 2. Where it goes.
    let models = gateway.models();
    let route = models.resolve(&gateway.accounts, &caller, api, &incoming.checked.model);
    let (primary, routed) = match route {
        Ok(resolved) => resolved,
        Err(refusal) => return audit.refuse(&gateway, dialect, tenant, refusal),
    };
    audit.entry.class = Some(incoming.class.as_str());
    audit.entry.account = Some(primary.name.clone());
    audit.entry.provider = Some(primary.profile.name());
    // 3. Through the crate's stack.
    let sent = call::Call {
        gateway: &gateway,
        caller: &caller,
        headers: &parts.headers,
        native: parts.extensions.get(),
        primary,
    };
    let (answered, incoming) = match sent.send(routed, incoming, &mut audit).await {
        Ok(answered) => answered,
        Err(refusal) => return audit.refuse(&gateway, dialect, tenant, refusal),
    };
    // 4. The answer.
    let account = &gateway.accounts[routed.account_of(answered.route())];
    answer::answer(&gateway, (&caller, account), &incoming, answered, audit).await
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
            crate::refusal::Decision::Local => "local",
            crate::refusal::Decision::Provider => "provider",
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
}
