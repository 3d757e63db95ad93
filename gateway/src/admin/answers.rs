//! The admin API's answers: its JSON errors, and a change written to the admin state.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::response::{IntoResponse, Response};
use http::StatusCode;

use super::super::Gateway;
use super::super::audit::rfc3339;
use super::super::auth::Admin;
use super::super::state;

/// An error of the admin API, in JSON.
pub(super) fn error(
    status: StatusCode,
    kind: &'static str,
    message: impl std::fmt::Display,
) -> Response {
    Refused(status, kind, message.to_string()).into_response()
}

/// An admin request refused: its status, the error's type and message.
#[derive(Debug)]
pub(super) struct Refused(
    pub(super) StatusCode,
    pub(super) &'static str,
    pub(super) String,
);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        let Self(status, kind, message) = self;
        let body = serde_json::json!({"error": {"type": kind, "message": message}});
        (status, Json(body)).into_response()
    }
}

/// A body the admin API cannot read: a 400 with axum's reason.
pub(super) fn unreadable(rejection: &JsonRejection) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        rejection.body_text(),
    )
}

/// Writes `change` to the admin state, each field stamped with `admin` and the time, and
/// applies every field after it; when the store
/// refuses it, the state as last applied is applied again (undoing what was applied ahead of
/// the write) and the answer is a 503.
pub(super) async fn store(
    gateway: &Gateway,
    admin: &Admin,
    change: state::Change,
) -> Result<(), Refused> {
    let stamp = state::Stamp {
        admin: admin.name.clone(),
        at: rfc3339(std::time::SystemTime::now()),
    };
    let written = gateway.state.write(state::stamped(change, &stamp)).await;
    let fields = match &written {
        Ok(fields) => fields.clone(),
        Err(_) => gateway.applied_state(),
    };
    if let Err(reason) = gateway.apply_state(&fields) {
        tracing::error!(%reason, "the admin state does not apply");
    }
    written.map(drop).map_err(|reason| {
        Refused(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            format!("{reason}; nothing changed"),
        )
    })
}

/// 404: the gateway knows no `what` (tenant, key) of this name.
pub(super) fn not_found(what: &str, name: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no {what} named `{name}`"),
    )
}
