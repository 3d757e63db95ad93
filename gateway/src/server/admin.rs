//! The quota API under `/admin`, behind its own bearer token.
//!
//! | route | does |
//! |---|---|
//! | `GET /admin/tenants` | the tree: each node's weight, pause, and on each account its limits and levels, used, guaranteed and borrowed tokens a minute, calls in flight, queued requests by class; today's usage |
//! | `PUT /admin/limits` | `{"tenant": "acme/search", "limits": [{"dimension": "total_tokens", "amount": 9000, "period_seconds": 60}], "remove": [{"dimension": "requests", "period_seconds": 60}], "weight": 2}`: each limit given replaces the node's of the same dimension and period (or is added), each of `remove` is dropped, the weight is replaced; every other limit is kept (any part may be left out) |
//! | `POST /admin/pause` | `{"tenant": "globex"}` or `{"key": "globex-app"}`: refused at once, queued ones too |
//! | `POST /admin/resume` | the same, lifted |
//! | `GET /admin/usage` | today's requests, tokens and refusals per tenant |
//! | `GET /admin/routes` | each public model's routes (the primary first, then fallbacks, then a ramp: name and account), and its ramp's share, ceiling and why it is paused |
//! | `POST /admin/reload` | the configuration in the body (TOML), or with an empty body the file the gateway started with, applied as far as a reload can: the callers' keys and the tenant nodes; `{"keys", "nodes", "restart": ["accounts", "models", "server"]}` says what changed that needs a restart; an invalid configuration is a 400 with why, and changes nothing |
//!
//! A tenant or key the gateway does not know is a 404 naming it; a body that cannot be read or
//! a value out of range is a 400 with the reason; every error is JSON:
//! `{"error": {"type": "not_found" | "invalid_request" | "authentication", "message": ...}}`.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Request, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use http::StatusCode;
use serde::{Deserialize, Serialize};

use std::num::NonZeroU32;

use tower_llm_quota::tenant::Tenant;

use super::Gateway;
use super::audit::{AdminEntry, rfc3339};
use super::status;
use super::tenancy::{LimitChange, LimitKey};
use super::usage::Counts;

pub(crate) fn routes(gateway: Arc<Gateway>) -> Router<Arc<Gateway>> {
    Router::new()
        .route("/tenants", get(tenants))
        .route("/limits", put(limits))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/usage", get(usage))
        .route("/routes", get(routes_of_models))
        .route("/reload", post(reload))
        .route_layer(from_fn_with_state(gateway, require_token))
}

async fn require_token(
    State(gateway): State<Arc<Gateway>>,
    request: Request,
    next: Next,
) -> Response {
    if gateway.is_admin(request.headers()) {
        next.run(request).await
    } else {
        error(
            StatusCode::UNAUTHORIZED,
            "authentication",
            "the admin API needs its bearer token",
        )
    }
}

/// An error of the admin API, in JSON.
fn error(status: StatusCode, kind: &str, message: impl std::fmt::Display) -> Response {
    let body = serde_json::json!({"error": {"type": kind, "message": message.to_string()}});
    (status, Json(body)).into_response()
}

/// A body the admin API cannot read: a 400 with axum's reason.
fn unreadable(rejection: &JsonRejection) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        rejection.body_text(),
    )
}

/// One public model's routes, for `GET /admin/routes`.
#[derive(Debug, Serialize)]
struct ModelRoutes {
    model: String,
    /// `{"route", "account"}`, the primary first.
    routes: Vec<serde_json::Value>,
    ramp: Option<serde_json::Value>,
}

async fn routes_of_models(State(gateway): State<Arc<Gateway>>) -> Json<Vec<ModelRoutes>> {
    let models = gateway
        .models
        .routed()
        .map(|(model, routed)| {
            ModelRoutes {
            model: model.to_owned(),
            routes: routed
                .routes
                .iter()
                .map(|(route, account)| {
                    serde_json::json!({"route": route, "account": gateway.accounts[*account].name})
                })
                .collect(),
            ramp: routed.ramp.as_ref().map(|ramp| {
                let status = ramp.status();
                serde_json::json!({
                    "share_percent": status.share,
                    "ceiling_percent": status.ceiling,
                    "paused": status.paused.map(|reason| reason.as_str()),
                })
            }),
        }
        })
        .collect();
    Json(models)
}

async fn tenants(State(gateway): State<Arc<Gateway>>) -> Json<Vec<status::TenantStatus>> {
    Json(status::tenants(&gateway))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeChange {
    tenant: Tenant,
    #[serde(default)]
    limits: Vec<LimitChange>,
    #[serde(default)]
    remove: Vec<LimitKey>,
    weight: Option<NonZeroU32>,
}

async fn limits(
    State(gateway): State<Arc<Gateway>>,
    change: Result<Json<NodeChange>, JsonRejection>,
) -> Response {
    let change = match change {
        Ok(Json(change)) => change,
        Err(rejection) => return unreadable(&rejection),
    };
    if !known(&gateway, &change.tenant) {
        return not_found("tenant", change.tenant.as_str());
    }
    let parts = (change.limits.as_slice(), change.remove.as_slice());
    let before = gateway.tenants.node_summary(&change.tenant);
    match gateway
        .tenants
        .set_node(&change.tenant, parts, change.weight)
    {
        Ok(()) => {
            audit_change(&gateway, "limits", &change.tenant, before);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(reason) => error(StatusCode::BAD_REQUEST, "invalid_request", reason),
    }
}

/// A tenant path or a key name.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Target {
    tenant: Option<Tenant>,
    key: Option<String>,
}

fn set_paused(
    gateway: &Gateway,
    target: Result<Json<Target>, JsonRejection>,
    paused: bool,
) -> Response {
    let target = match target {
        Ok(Json(target)) => target,
        Err(rejection) => return unreadable(&rejection),
    };
    let path = match (target.tenant, target.key) {
        (Some(tenant), None) if known(gateway, &tenant) => tenant,
        (Some(tenant), None) => return not_found("tenant", tenant.as_str()),
        (None, Some(key)) => match gateway.keys().path_of(&key) {
            Some(path) => path.clone(),
            None => return not_found("key", &key),
        },
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "give one of `tenant` and `key`",
            );
        }
    };
    let before = gateway.tenants.node_summary(&path);
    gateway.tenants.set_paused(&path, paused);
    audit_change(
        gateway,
        if paused { "pause" } else { "resume" },
        &path,
        before,
    );
    StatusCode::NO_CONTENT.into_response()
}

/// `POST /admin/reload`: the TOML in the body, or (with an empty body) the file the gateway
/// was started with, applied as far as a reload can (keys, tenant nodes); 200 with what was
/// applied and what needs a restart, or 400 with why nothing changed.
async fn reload(State(gateway): State<Arc<Gateway>>, body: String) -> Response {
    let result = if body.trim().is_empty() {
        gateway.reload_file()
    } else {
        gateway.reload(&body)
    };
    match result {
        Ok(reloaded) => {
            gateway.audit.write(&AdminEntry {
                time: rfc3339(std::time::SystemTime::now()),
                admin: "admin",
                action: "reload",
                target: "configuration",
                before: serde_json::Value::Null,
                after: serde_json::to_value(&reloaded).unwrap_or_default(),
            });
            Json(reloaded).into_response()
        }
        Err(reason) => error(StatusCode::BAD_REQUEST, "invalid_request", reason),
    }
}

/// Writes an admin change to the audit log: who (the admin token's name), what, the node
/// before and after.
fn audit_change(gateway: &Gateway, action: &'static str, path: &Tenant, before: serde_json::Value) {
    gateway.audit.write(&AdminEntry {
        time: rfc3339(std::time::SystemTime::now()),
        admin: "admin",
        action,
        target: path.as_str(),
        before,
        after: gateway.tenants.node_summary(path),
    });
}

async fn pause(
    State(gateway): State<Arc<Gateway>>,
    target: Result<Json<Target>, JsonRejection>,
) -> Response {
    set_paused(&gateway, target, true)
}

async fn resume(
    State(gateway): State<Arc<Gateway>>,
    target: Result<Json<Target>, JsonRejection>,
) -> Response {
    set_paused(&gateway, target, false)
}

#[derive(Debug, Serialize)]
struct TenantUsage {
    tenant: String,
    #[serde(flatten)]
    counts: Counts,
}

async fn usage(State(gateway): State<Arc<Gateway>>) -> Json<Vec<TenantUsage>> {
    Json(
        status::tenants(&gateway)
            .into_iter()
            .map(|tenant| TenantUsage {
                tenant: tenant.node.path,
                counts: tenant.usage,
            })
            .collect(),
    )
}

/// Whether the gateway knows the node `path`: configured, a key's tenant or an ancestor, or a
/// key's own path.
fn known(gateway: &Gateway, path: &Tenant) -> bool {
    gateway.tenants.knows(path) || gateway.keys().is_key_path(path)
}

/// 404: the gateway knows no `what` (tenant, key) of this name.
fn not_found(what: &str, name: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no {what} named `{name}`"),
    )
}
