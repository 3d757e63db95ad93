//! The quota API under `/admin`, behind its own bearer token.
//!
//! | route | does |
//! |---|---|
//! | `GET /admin/tenants` | the tree: each node's weight, limits, levels, pause and today's usage |
//! | `PUT /admin/limits` | `{"tenant": "acme/search", "limits": {...}, "weight": 2}`: new limits (and weight) |
//! | `POST /admin/pause` | `{"tenant": "globex"}` or `{"key": "globex-app"}` |
//! | `POST /admin/resume` | the same, lifted |
//! | `GET /admin/usage` | today's requests, tokens and refusals per tenant |

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use http::StatusCode;
use serde::{Deserialize, Serialize};

use super::Gateway;
use super::config::Limits;
use super::status;
use super::usage::Counts;

pub(crate) fn routes(gateway: Arc<Gateway>) -> Router<Arc<Gateway>> {
    Router::new()
        .route("/tenants", get(tenants))
        .route("/limits", put(limits))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/usage", get(usage))
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

async fn tenants(State(gateway): State<Arc<Gateway>>) -> Json<Vec<status::TenantStatus>> {
    Json(status::tenants(&gateway))
}

#[derive(Debug, Deserialize)]
struct LimitsChange {
    tenant: String,
    limits: Limits,
    weight: Option<u32>,
}

async fn limits(State(gateway): State<Arc<Gateway>>, Json(change): Json<LimitsChange>) -> Response {
    match gateway
        .tenants
        .set_limits(&change.tenant, change.limits, change.weight)
    {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => not_found(&change.tenant),
        Err(error) => (StatusCode::BAD_REQUEST, error.to_string()).into_response(),
    }
}

/// A tenant path or a key name.
#[derive(Debug, Deserialize)]
struct Target {
    tenant: Option<String>,
    key: Option<String>,
}

fn set_paused(gateway: &Gateway, target: Target, paused: bool) -> Response {
    match (target.tenant, target.key) {
        (Some(tenant), None) if gateway.tenants.set_paused(&tenant, paused) => {
            StatusCode::NO_CONTENT.into_response()
        }
        (Some(tenant), None) => not_found(&tenant),
        (None, Some(key)) if gateway.keys.has_name(&key) => {
            gateway.tenants.set_key_paused(&key, paused);
            StatusCode::NO_CONTENT.into_response()
        }
        (None, Some(key)) => not_found(&key),
        _ => (StatusCode::BAD_REQUEST, "give one of `tenant` and `key`").into_response(),
    }
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
        gateway
            .tenants
            .snapshot()
            .into_iter()
            .map(|node| TenantUsage {
                counts: gateway.ledger.counts_under(&node.path),
                tenant: node.path,
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
