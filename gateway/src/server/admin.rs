//! The quota API under `/admin`, behind its own bearer token.
//!
//! | route | does |
//! |---|---|
//! | `GET /admin/tenants` | the tree: each node's weight, pause, and on each account its limits and levels, used, guaranteed and borrowed tokens a minute, calls in flight, queued requests by class; today's usage |
//! | `PUT /admin/limits` | `{"tenant": "acme/search", "limits": [{"dimension": "total_tokens", "amount": 9000, "period_seconds": 60}], "weight": 2}`: new limits, new weight (either may be left out) |
//! | `POST /admin/pause` | `{"tenant": "globex"}` or `{"key": "globex-app"}`: refused at once, queued ones too |
//! | `POST /admin/resume` | the same, lifted |
//! | `GET /admin/usage` | today's requests, tokens and refusals per tenant |
//! | `GET /admin/routes` | each public model's routes (the primary first, then fallbacks, then a ramp: name and account), and its ramp's share, ceiling and why it is paused |

use std::sync::Arc;

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
use super::status;
use super::tenancy::LimitChange;
use super::usage::Counts;

pub(crate) fn routes(gateway: Arc<Gateway>) -> Router<Arc<Gateway>> {
    Router::new()
        .route("/tenants", get(tenants))
        .route("/limits", put(limits))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/usage", get(usage))
        .route("/routes", get(routes_of_models))
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
        (StatusCode::UNAUTHORIZED, Json(serde_json::json!({
            "error": {"type": "authentication", "message": "the admin API needs its bearer token"}
        })))
            .into_response()
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
    limits: Option<Vec<LimitChange>>,
    weight: Option<NonZeroU32>,
}

async fn limits(State(gateway): State<Arc<Gateway>>, Json(change): Json<NodeChange>) -> Response {
    let limits = change.limits.as_deref();
    match gateway
        .tenants
        .set_node(&change.tenant, limits, change.weight)
    {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(error) => (StatusCode::BAD_REQUEST, error.to_string()).into_response(),
    }
}

/// A tenant path or a key name.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Target {
    tenant: Option<Tenant>,
    key: Option<String>,
}

fn set_paused(gateway: &Gateway, target: Target, paused: bool) -> Response {
    let path = match (target.tenant, target.key) {
        (Some(tenant), None) => tenant,
        (None, Some(key)) => match gateway.keys.path_of(&key) {
            Some(path) => path.clone(),
            None => return not_found(&key),
        },
        _ => return (StatusCode::BAD_REQUEST, "give one of `tenant` and `key`").into_response(),
    };
    gateway.tenants.set_paused(&path, paused);
    StatusCode::NO_CONTENT.into_response()
}

async fn pause(State(gateway): State<Arc<Gateway>>, Json(target): Json<Target>) -> Response {
    set_paused(&gateway, target, true)
}

async fn resume(State(gateway): State<Arc<Gateway>>, Json(target): Json<Target>) -> Response {
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

fn not_found(name: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        format!("no tenant or key named `{name}`"),
    )
        .into_response()
}
