//! `GET /v1/models` and `GET /v1/models/{id}`: the models a caller's key may use, in its SDK's
//! format (OpenAI's list, or Anthropic's when the request carries `anthropic-version`); `GET
//! /v1beta/models` and `/v1beta/models/{model}`, Google's, for the models of accounts that
//! speak Gemini's native API.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use http::HeaderMap;
use serde_json::{Value, json};

use super::Gateway;
use super::account::Account;
use super::auth::Caller;
use super::gemini;
use super::models::Model;
use super::refusal::{Dialect, Refusal};

/// Whose format a models request reads: Anthropic's SDK sends `anthropic-version`.
fn dialect(headers: &HeaderMap) -> Dialect {
    if headers.contains_key("anthropic-version") {
        Dialect::Anthropic
    } else {
        Dialect::OpenAi
    }
}

/// One model in the caller's format.
fn entry(accounts: &[Account], model: &Model, dialect: Dialect) -> Value {
    match dialect {
        // Gemini's list is its own route's (`gemini.rs`).
        Dialect::OpenAi | Dialect::Gemini => json!({
            "id": model.name,
            "object": "model",
            "created": 0,
            "owned_by": accounts[model.account].name,
        }),
        Dialect::Anthropic => json!({
            "type": "model",
            "id": model.name,
            "display_name": model.name,
            "created_at": "1970-01-01T00:00:00Z",
        }),
    }
}

/// `GET /v1/models`: the models the caller's key may use.
pub(crate) async fn list(State(gateway): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    let dialect = dialect(&headers);
    let keys = gateway.keys();
    let Some(caller) = keys.authenticate(&headers) else {
        return gateway.refuse_in(dialect, None, Refusal::unauthorized());
    };
    let models = gateway.models();
    let data: Vec<Value> = models
        .visible_to(caller)
        .map(|model| entry(&gateway.accounts, model, dialect))
        .collect();
    let body = match dialect {
        Dialect::OpenAi | Dialect::Gemini => json!({"object": "list", "data": data}),
        Dialect::Anthropic => {
            let first = data.first().map(|m| m["id"].clone());
            let last = data.last().map(|m| m["id"].clone());
            json!({"data": data, "has_more": false, "first_id": first, "last_id": last})
        }
    };
    axum::Json(body).into_response()
}

/// `GET /v1/models/{id}`: one model the caller's key may use, or a 404 naming it.
pub(crate) async fn retrieve(
    State(gateway): State<Arc<Gateway>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let dialect = dialect(&headers);
    let keys = gateway.keys();
    let Some(caller) = keys.authenticate(&headers) else {
        return gateway.refuse_in(dialect, None, Refusal::unauthorized());
    };
    match gateway.models().visible_to(caller).find(|m| m.name == id) {
        Some(model) => axum::Json(entry(&gateway.accounts, model, dialect)).into_response(),
        None => gateway.refuse_in(
            dialect,
            Some(caller.tenant.as_str()),
            Refusal::model_not_found(&id),
        ),
    }
}

/// `GET /v1beta/models`: the configured models the caller's key may use whose account
/// speaks Gemini's native API, in Google's shape.
pub(crate) async fn gemini_list(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    let Some(caller) = gemini_caller(&gateway, request) else {
        return gateway.refuse_in(Dialect::Gemini, None, Refusal::unauthorized());
    };
    let models: Vec<Value> = gateway
        .models()
        .visible_to(&caller)
        .filter_map(|model| gemini_entry(&gateway, &model.name, model.account))
        .collect();
    axum::Json(json!({ "models": models })).into_response()
}

/// `GET /v1beta/models/{model}`: one of them, or a 404 naming it.
pub(crate) async fn gemini_get(
    State(gateway): State<Arc<Gateway>>,
    Path(name): Path<String>,
    request: Request,
) -> Response {
    let Some(caller) = gemini_caller(&gateway, request) else {
        return gateway.refuse_in(Dialect::Gemini, None, Refusal::unauthorized());
    };
    let name = name.strip_prefix("models/").unwrap_or(&name);
    let models = gateway.models();
    let found = models
        .visible_to(&caller)
        .find(|model| model.name == name)
        .and_then(|model| gemini_entry(&gateway, &model.name, model.account));
    match found {
        Some(model) => axum::Json(model).into_response(),
        None => gateway.refuse_in(
            Dialect::Gemini,
            Some(caller.tenant.as_str()),
            Refusal::model_not_found(name),
        ),
    }
}

/// The caller of a Gemini route: its key in `x-goog-api-key` or `?key=`.
fn gemini_caller(gateway: &Gateway, mut request: Request) -> Option<Caller> {
    gemini::key_from_query(&mut request);
    gateway.keys().authenticate(request.headers()).cloned()
}

/// A model in Google's shape, with the methods its account serves; `None` when its account
/// speaks no native Gemini API.
fn gemini_entry(gateway: &Gateway, name: &str, account: usize) -> Option<Value> {
    let account = &gateway.accounts[account];
    let methods: Vec<&str> = gemini::Method::ALL
        .into_iter()
        .filter(|method| account.profile_of(method.api()).is_some())
        .map(gemini::Method::as_str)
        .collect();
    (!methods.is_empty()).then(|| {
        json!({
            "name": format!("models/{name}"),
            "displayName": name,
            "description": format!("served by the account {}", account.name),
            "supportedGenerationMethods": methods,
        })
    })
}
