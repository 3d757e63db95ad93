//! `/admin/overrides`: each override of the file ([`crate::overrides`]) with who
//! made it, when, and the file's value it shadows; deleting one gives the setting back to the
//! file.

use std::sync::Arc;

use axum::Extension;
use axum::Json;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde::Deserialize;
use tower_llm_quota::tenant::Tenant;

use super::super::Gateway;
use super::super::auth::Admin;
use super::super::overrides::{Override, list};
use super::super::state;
use super::answers::{error, store};

/// The overrides an admin may see: every one for an operator; for a delegated admin, those
/// of its subtree's nodes and keys.
fn visible(gateway: &Gateway, admin: &Admin) -> Vec<Override> {
    let (parsed, _) = state::parse(&gateway.applied_state());
    let all = list(&gateway.config(), &parsed);
    let keys = gateway.keys();
    (all.into_iter())
        .filter(|o| {
            let path = match (&o.tenant, &o.key) {
                (Some(tenant), _) => Tenant::parse(tenant).ok(),
                (None, Some(key)) => keys.path_of(key).cloned(),
                _ => None,
            };
            path.is_some_and(|path| admin.sees(&path))
        })
        .collect()
}

/// `GET /admin/overrides`.
pub(super) async fn get(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
) -> Json<Vec<Override>> {
    Json(visible(&gateway, &admin))
}

/// `DELETE /admin/overrides?id=...`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Which {
    id: String,
}

/// Gives a setting back to the file: the override's field (and its stamp) removed, the file's
/// value applied on every replica. 200 with the override removed.
pub(super) async fn delete(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
    Query(which): Query<Which>,
) -> Response {
    let Some(found) = visible(&gateway, &admin)
        .into_iter()
        .find(|o| o.id == which.id)
    else {
        let reason = format!("no override `{}`", which.id);
        return error(StatusCode::NOT_FOUND, "not_found", reason);
    };
    if let Some(tenant) = found.tenant.as_deref().and_then(|t| Tenant::parse(t).ok())
        && let Err(refused) = admin.to_change(&gateway, &tenant)
    {
        return refused.into_response();
    }
    if let Err(refused) = store(&gateway, &admin, vec![(found.id.clone(), None)]).await {
        return refused.into_response();
    }
    gateway.audit.write(&super::super::audit::AdminEntry {
        time: super::super::audit::rfc3339(std::time::SystemTime::now()),
        admin: &admin.name,
        action: "delete_override",
        target: &found.id,
        before: serde_json::to_value(&found).unwrap_or_default(),
        after: found.file.clone(),
    });
    Json(found).into_response()
}
