//! The quota API under `/admin`, behind bearer tokens: the operator's (`server.admin_token`,
//! named `admin`, and `[[admins]]` without a `tenant`), and delegated admins' (`[[admins]]`
//! with a `tenant`), who read and change only that subtree.
//!
//! | route | does | delegated admin |
//! |---|---|---|
//! | `GET /admin/tenants` | the tree: each node's weight, pause, and on each account its limits and levels, its tokens of the last minute on that account (`used`), guaranteed and borrowed tokens a minute, calls in flight, queued requests by class; today's usage | its subtree |
//! | `PUT /admin/limits` | `{"tenant": "acme/search", "limits": [{"dimension": "total_tokens", "amount": 9000, "period_seconds": 60}], "remove": [{"dimension": "requests", "period_seconds": 60}], "weight": 2}`: each limit given replaces the node's of the same dimension and period (or is added), with its `burst` when given (the most admitted at once; else the default share of the amount), spend as `amount_usd` if wished; each of `remove` is dropped, the weight is replaced; every other limit is kept (any part may be left out) | the nodes below its own, each limit and burst at most its own of that dimension and period |
//! | `POST /admin/pause` | `{"tenant": "globex"}` or `{"key": "globex-app"}`: refused at once, queued ones too | below its own |
//! | `POST /admin/resume` | the same, lifted | below its own |
//! | `GET /admin/usage` | today's requests, tokens and refusals per tenant | its subtree |
//! | `GET /admin/keys` | the callers' keys: name, tenant, class, where each comes from, until when each secret is valid (never a secret) | its subtree's |
//! | `POST /admin/keys` | `{"name": "acme-batch", "tenant": "acme/reports", "default_class": "batch"}` (and `allow_priority_header`, `models`, `retries`): a new key of a tenant the gateway knows, its secret in the answer, once | in its subtree |
//! | `POST /admin/keys/{name}/rotate` | `{"overlap_seconds": 3600}`: a new secret; the old ones valid for the overlap (an hour by default), then refused | its subtree's |
//! | `DELETE /admin/keys/{name}` | revokes the key, a configured one too | its subtree's |
//! | `GET /admin/report` | `?since=2026-11-26&until=...&format=json\|csv&table=rows\|accounts`: the review of a period (a week back by default; at most 35 days): per account, tenant and model, requests, tokens by kind, estimated against settled tokens, requests that queued, refusals by scope and limit, the provider's 429s; per account, its idle quota (what nobody used in the minutes nobody waited) | its subtree's rows, no account table |
//! | `GET /admin/overrides` | what the admin API holds over the configuration file: each override's `id`, node (`tenant`) or `key`, `setting` (`requests_per_minute`, `weight`, `secret`), `value` (an amount, `removed`, `rotated`, `revoked`), the `file`'s value it shadows (`null`: the file sets none), `by` and `at` | its subtree's |
//! | `DELETE /admin/overrides?id=...` | gives the setting back to the file (on every replica within `admin_sync_ms`); 200 with the override removed | below its own |
//! | `GET /admin/routes` | each public model's routes (the primary first, then fallbacks, then a ramp: name and account), and its ramp's share, ceiling and why it is paused | 403 |
//! | `POST /admin/reload` | the configuration in the body (TOML), or with an empty body the file the gateway started with, applied as far as a reload can: the callers' keys, the admin tokens, the tenant nodes, the accounts' figures (limits' amounts, calls in flight, caps) and the models; `{"keys", "nodes", "accounts", "restart": ["accounts", "models", "prices", "spend_alerts", "server"], "why"}` says what changed that needs a restart, and why; an invalid configuration is a 400 with why, and changes nothing | 403 |
//!
//! Changes of limits, weights and keys are kept in the admin state ([`super::state`]): with
//! `--redis-url` in Redis, and every replica applies them within `admin_sync_ms`; else in
//! `server.state_file`. The file is the base and they are overrides of it, applied over a
//! reload's file too: the reload's answer lists every setting they shadow (`shadowed`), the
//! status page marks them, and `DELETE /admin/overrides` gives a setting back to the file. Pauses
//! are kept by the budget (in Redis with `--redis-url`, where every replica sees them at its
//! next admission).
//!
//! A tenant or key the gateway does not know, or a delegated admin may not see, is a 404
//! naming it (and the nearest name it may see); a body that cannot be read or a value out of range is a 400 with the reason; a
//! route or node a delegated admin may see but not change is a 403; every error is JSON:
//! `{"error": {"type": "not_found" | "invalid_request" | "forbidden" | "conflict" |
//! "authentication" | "unavailable", "message": ...}}`. Every change is an audit line naming the
//! admin token that made it, with the node or key before and after.

mod answers;
mod keys;
mod overrides;
mod report;

use std::sync::Arc;

use axum::Extension;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Request, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use http::StatusCode;
use serde::{Deserialize, Serialize};

use std::num::NonZeroU32;

use tower_llm_quota::tenant::Tenant;

use super::Gateway;
use super::audit::{AdminEntry, rfc3339};
use super::auth::Admin;
use super::state;
use super::status;
use super::tenancy::{LimitChange, LimitKey, dimension};
use super::usage::Counts;
use answers::{Refused, error, not_found, store, unreadable};

pub(crate) fn routes(gateway: Arc<Gateway>) -> Router<Arc<Gateway>> {
    Router::new()
        .route("/tenants", get(tenants))
        .route("/limits", put(limits))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/usage", get(usage))
        .route("/routes", get(routes_of_models))
        .route("/reload", post(reload))
        .route("/keys", get(keys::list).post(keys::create))
        .route("/keys/{name}/rotate", post(keys::rotate))
        .route("/keys/{name}", delete(keys::revoke))
        .route("/report", get(report::report))
        .route("/overrides", get(overrides::get).delete(overrides::delete))
        .route_layer(from_fn_with_state(gateway, require_token))
}

/// Lets through a request carrying an admin token, the [`Admin`] in its extensions.
async fn require_token(
    State(gateway): State<Arc<Gateway>>,
    mut request: Request,
    next: Next,
) -> Response {
    match gateway.admin(request.headers()) {
        Some(admin) => {
            request.extensions_mut().insert(admin);
            next.run(request).await
        }
        None => error(
            StatusCode::UNAUTHORIZED,
            "authentication",
            "the admin API needs an admin token (Authorization: Bearer)",
        ),
    }
}

impl Admin {
    /// Whether this admin may read the node at `path`: every node for an operator, its
    /// subtree for a delegated admin.
    fn sees(&self, path: &Tenant) -> bool {
        self.scope
            .as_ref()
            .is_none_or(|scope| path.is_within(scope))
    }

    /// Whether it may change the node at `path` (limits, weight, pause): every node for an
    /// operator; for a delegated admin, the nodes below its own (its own are the operator's
    /// to set).
    fn changes(&self, path: &Tenant) -> bool {
        self.scope
            .as_ref()
            .is_none_or(|scope| path.is_within(scope) && path != scope)
    }

    /// `Err(403)` unless an operator calls.
    fn operator_only(&self, route: &str) -> Result<(), Refused> {
        match &self.scope {
            None => Ok(()),
            Some(scope) => Err(Refused(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!(
                    "{route} is the operator's; admin `{}` administers {scope}",
                    self.name
                ),
            )),
        }
    }

    /// The node at `path` if this admin may change it: 404 when it may not see it (or the
    /// gateway knows no such node), 403 when it sees it but may not change it.
    fn to_change(&self, gateway: &Gateway, path: &Tenant) -> Result<(), Refused> {
        if !self.sees(path) || !known(gateway, path) {
            // A delegated admin is told of names in its subtree only.
            let hint = gateway.tenants.hint(path.as_str(), self.scope.as_ref());
            return Err(Refused(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no tenant named `{path}`{hint}"),
            ));
        }
        if !self.changes(path) {
            return Err(Refused(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!(
                    "admin `{}` changes the nodes below {path}; {path} itself is the operator's",
                    self.name
                ),
            ));
        }
        Ok(())
    }
}

/// One public model's routes, for `GET /admin/routes`.
#[derive(Debug, Serialize)]
struct ModelRoutes {
    model: String,
    /// `{"route", "account"}`, the primary first.
    routes: Vec<serde_json::Value>,
    ramp: Option<serde_json::Value>,
}

async fn routes_of_models(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
) -> Response {
    if let Err(refused) = admin.operator_only("GET /admin/routes") {
        return refused.into_response();
    }
    let models = gateway.models();
    let models = models
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
        .collect::<Vec<_>>();
    Json(models).into_response()
}

/// The tenant rows `admin` may see.
fn visible(gateway: &Gateway, admin: &Admin) -> Vec<status::TenantStatus> {
    let mut rows = status::tenants(gateway);
    rows.retain(|row| Tenant::parse(&row.node.path).is_ok_and(|path| admin.sees(&path)));
    rows
}

async fn tenants(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
) -> Json<Vec<status::TenantStatus>> {
    Json(visible(&gateway, &admin))
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
    Extension(admin): Extension<Admin>,
    change: Result<Json<NodeChange>, JsonRejection>,
) -> Response {
    let change = match change {
        Ok(Json(change)) => change,
        Err(rejection) => return unreadable(&rejection),
    };
    let path = &change.tenant;
    if let Err(refused) = admin.to_change(&gateway, path) {
        return refused.into_response();
    }
    if let Err(reason) = within_own(&gateway, &admin, &change.limits) {
        return error(StatusCode::BAD_REQUEST, "invalid_request", reason);
    }
    let mut fields = state::Change::new();
    for limit in &change.limits {
        let Ok(dimension) = dimension(&limit.dimension) else {
            continue; // `set_node` names it
        };
        let field = state::limit_field(path, dimension, limit.period_seconds);
        let set = state::SetLimit {
            amount: limit.amount,
            burst: limit.burst,
        };
        fields.push((field, Some(set.field_value())));
    }
    for removed in &change.remove {
        let Ok(dimension) = dimension(&removed.dimension) else {
            continue;
        };
        let field = state::limit_field(path, dimension, removed.period_seconds);
        fields.push((field, Some("-".to_owned())));
    }
    if let Some(weight) = change.weight {
        fields.push((state::weight_field(path), Some(weight.to_string())));
    }
    let before = gateway.tenants.node_summary(path);
    // Checked where it applies (a limit the node lacks, a tree the budget refuses) before it
    // is stored; put back as stored when the store refuses it.
    let parts = (change.limits.as_slice(), change.remove.as_slice());
    if let Err(reason) = gateway.tenants.set_node(path, parts, change.weight) {
        return error(StatusCode::BAD_REQUEST, "invalid_request", reason);
    }
    if let Err(refused) = store(&gateway, &admin, fields).await {
        return refused.into_response();
    }
    audit_change(&gateway, &admin, "limits", path, before);
    StatusCode::NO_CONTENT.into_response()
}

/// For a delegated admin: each limit at most its own node's of the same dimension and period
/// (where it has one): a partner resells within what it bought.
fn within_own(gateway: &Gateway, admin: &Admin, limits: &[LimitChange]) -> Result<(), String> {
    let Some(scope) = &admin.scope else {
        return Ok(());
    };
    let own = gateway.tenants.node(scope).unwrap_or_default();
    for change in limits {
        let over = own.limits().iter().find(|l| {
            l.dimension().as_str() == change.dimension
                && l.period().as_secs() == change.period_seconds
                && l.amount() < change.amount
        });
        if let Some(own) = over {
            return Err(format!(
                "{} {} per {} s is above {scope}'s own ({})",
                change.amount,
                change.dimension,
                change.period_seconds,
                own.amount()
            ));
        }
        let burst_over = own.limits().iter().find(|l| {
            l.dimension().as_str() == change.dimension
                && l.period().as_secs() == change.period_seconds
                && change.burst.is_some_and(|burst| burst.get() > l.capacity())
        });
        if let Some(own) = burst_over {
            return Err(format!(
                "a burst of {} {} is above {scope}'s own ({})",
                change.burst.map_or(0, std::num::NonZeroU64::get),
                change.dimension,
                own.capacity()
            ));
        }
    }
    Ok(())
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
    admin: &Admin,
    target: Result<Json<Target>, JsonRejection>,
    paused: bool,
) -> Response {
    let target = match target {
        Ok(Json(target)) => target,
        Err(rejection) => return unreadable(&rejection),
    };
    let path = match (target.tenant, target.key) {
        (Some(tenant), None) => tenant,
        (None, Some(key)) => match gateway.keys().path_of(&key) {
            Some(path) if admin.sees(path) => path.clone(),
            _ => return not_found("key", &key),
        },
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "give one of `tenant` and `key`",
            );
        }
    };
    if let Err(refused) = admin.to_change(gateway, &path) {
        return refused.into_response();
    }
    let before = gateway.tenants.node_summary(&path);
    gateway.tenants.set_paused(&path, paused);
    audit_change(
        gateway,
        admin,
        if paused { "pause" } else { "resume" },
        &path,
        before,
    );
    StatusCode::NO_CONTENT.into_response()
}

/// `POST /admin/reload`: the TOML in the body, or (with an empty body) the file the gateway
/// was started with, applied as far as a reload can (keys, tenant nodes); 200 with what was
/// applied and what needs a restart, or 400 with why nothing changed.
async fn reload(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
    body: String,
) -> Response {
    if let Err(refused) = admin.operator_only("POST /admin/reload") {
        return refused.into_response();
    }
    let result = if body.trim().is_empty() {
        gateway.reload_file()
    } else {
        gateway.reload(&body)
    };
    match result {
        Ok(reloaded) => {
            gateway.audit.write(&AdminEntry {
                time: rfc3339(std::time::SystemTime::now()),
                admin: &admin.name,
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
fn audit_change(
    gateway: &Gateway,
    admin: &Admin,
    action: &'static str,
    path: &Tenant,
    before: serde_json::Value,
) {
    gateway.audit.write(&AdminEntry {
        time: rfc3339(std::time::SystemTime::now()),
        admin: &admin.name,
        action,
        target: path.as_str(),
        before,
        after: gateway.tenants.node_summary(path),
    });
}

async fn pause(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
    target: Result<Json<Target>, JsonRejection>,
) -> Response {
    set_paused(&gateway, &admin, target, true)
}

async fn resume(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
    target: Result<Json<Target>, JsonRejection>,
) -> Response {
    set_paused(&gateway, &admin, target, false)
}

#[derive(Debug, Serialize)]
struct TenantUsage {
    tenant: String,
    #[serde(flatten)]
    counts: Counts,
    /// Whose requests these are: `this replica` when replicas share the state (the fleet's
    /// are in `GET /admin/report`), else `the gateway`.
    counted_by: &'static str,
}

async fn usage(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
) -> Json<Vec<TenantUsage>> {
    Json(
        visible(&gateway, &admin)
            .into_iter()
            .map(|tenant| TenantUsage {
                tenant: tenant.node.path,
                counts: tenant.usage,
                counted_by: status::counted_by(&gateway),
            })
            .collect(),
    )
}

/// Whether the gateway knows the node `path`: configured, a key's tenant or an ancestor, or a
/// key's own path.
fn known(gateway: &Gateway, path: &Tenant) -> bool {
    gateway.tenants.knows(path) || gateway.keys().is_key_path(path)
}
