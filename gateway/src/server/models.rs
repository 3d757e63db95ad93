//! The public models: the names callers send, the account serving each and its name
//! upstream, which keys may use which; and `GET /v1/models` in the caller's SDK's format
//! (OpenAI's list, or Anthropic's when the request carries `anthropic-version`).
//!
//! With no `[[models]]` configured the gateway is open: any model passes to the account
//! serving the API, and the list is empty.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::HeaderMap;
use serde_json::{Value, json};

use super::Gateway;
use super::auth::Caller;
use super::config::{Api, ModelConfig};
use super::refusal::{Dialect, Refusal};
use super::upstream::Account;

/// One public model.
#[derive(Debug, Clone)]
pub(crate) struct Model {
    pub(crate) name: String,
    /// The index of its account in the gateway's accounts.
    pub(crate) account: usize,
    /// Its name upstream, when not its public name.
    pub(crate) upstream: Option<String>,
}

/// The configured public models.
#[derive(Debug, Clone, Default)]
pub(crate) struct Models {
    models: Vec<Model>,
}

impl Models {
    /// The models of `config`, whose accounts are among `accounts` (checked with the
    /// configuration).
    pub(crate) fn new(config: &[ModelConfig], accounts: &[Account]) -> Self {
        let models = config
            .iter()
            .filter_map(|model| {
                let account = accounts.iter().position(|a| a.name == model.account)?;
                let upstream = model.model.clone().filter(|m| *m != model.name);
                Some(Model {
                    name: model.name.clone(),
                    account,
                    upstream,
                })
            })
            .collect();
        Self { models }
    }

    /// The models `caller` may use.
    fn visible_to<'a>(&'a self, caller: &'a Caller) -> impl Iterator<Item = &'a Model> + 'a {
        self.models.iter().filter(|m| caller.may_use(&m.name))
    }

    /// The account a request of `api` for `model` goes to, and the model's name upstream
    /// when it is another; or the 404 naming the model.
    pub(crate) fn resolve<'a>(
        &'a self,
        gateway: &'a Gateway,
        caller: &Caller,
        api: Api,
        model: &str,
    ) -> Result<(&'a Account, Option<&'a str>), Refusal> {
        if self.models.is_empty() {
            return gateway
                .account(api)
                .map(|account| (account, None))
                .ok_or_else(|| Refusal::not_served(api.path()));
        }
        let found = self
            .models
            .iter()
            .find(|m| m.name == model && caller.may_use(model))
            .ok_or_else(|| Refusal::model_not_found(model))?;
        let account = &gateway.accounts[found.account];
        if account.stack(api).is_none() {
            return Err(Refusal::model_not_found(model).message(format!(
                "the model `{model}` is not served on {}",
                api.path()
            )));
        }
        Ok((account, found.upstream.as_deref()))
    }
}

/// The body with its `model` replaced by `upstream`.
pub(crate) fn rewrite_model(body: &Bytes, upstream: &str) -> Bytes {
    match serde_json::from_slice::<Value>(body) {
        Ok(mut value) => {
            value["model"] = Value::String(upstream.to_owned());
            serde_json::to_vec(&value).map_or_else(|_| body.clone(), Bytes::from)
        }
        Err(_) => body.clone(),
    }
}

/// Whose format a models request reads: Anthropic's SDK sends `anthropic-version`.
fn dialect(headers: &HeaderMap) -> Dialect {
    if headers.contains_key("anthropic-version") {
        Dialect::Anthropic
    } else {
        Dialect::OpenAi
    }
}

/// One model in the caller's format.
fn entry(gateway: &Gateway, model: &Model, dialect: Dialect) -> Value {
    match dialect {
        Dialect::OpenAi => json!({
            "id": model.name,
            "object": "model",
            "created": 0,
            "owned_by": gateway.accounts[model.account].name,
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
    let Some(caller) = gateway.keys.authenticate(&headers) else {
        return gateway.refuse_in(dialect, None, Refusal::unauthorized());
    };
    let data: Vec<Value> = gateway
        .models
        .visible_to(caller)
        .map(|model| entry(&gateway, model, dialect))
        .collect();
    let body = match dialect {
        Dialect::OpenAi => json!({"object": "list", "data": data}),
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
    let Some(caller) = gateway.keys.authenticate(&headers) else {
        return gateway.refuse_in(dialect, None, Refusal::unauthorized());
    };
    match gateway.models.visible_to(caller).find(|m| m.name == id) {
        Some(model) => axum::Json(entry(&gateway, model, dialect)).into_response(),
        None => gateway.refuse_in(
            dialect,
            Some(caller.tenant.as_str()),
            Refusal::model_not_found(&id),
        ),
    }
}
