//! The public models: the names callers send, the account serving each and its name
//! upstream, which keys may use which; and `GET /v1/models` in the caller's SDK's format
//! (OpenAI's list, or Anthropic's when the request carries `anthropic-version`).
//!
//! With no `[[models]]` configured the gateway is open: any model passes to the account
//! serving the API, and the list is empty.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use http::HeaderMap;
use serde_json::{Value, json};

use super::Gateway;
use super::auth::Caller;
use super::config::{Api, ModelConfig};
use super::refusal::{Dialect, Refusal};
use super::routes::{self, Routed};
use super::upstream::Account;
use tower_llm_quota::idempotency::IdempotencyLayer;

/// One public model.
#[derive(Debug, Clone)]
pub(crate) struct Model {
    pub(crate) name: String,
    /// The index of its primary account in the gateway's accounts.
    pub(crate) account: usize,
    /// Its router.
    pub(crate) routed: Routed,
}

/// The configured public models, or, with none, a router per API.
#[derive(Debug, Clone, Default)]
pub(crate) struct Models {
    models: Vec<Model>,
    /// Without models: the router of each API served.
    open: Vec<(Api, Routed)>,
}

impl Models {
    /// The models of `config`, whose accounts are among `accounts` (checked with the
    /// configuration), their requests deduplicated by `idempotency`.
    pub(crate) fn new(
        config: &[ModelConfig],
        accounts: &[Account],
        idempotency: &IdempotencyLayer,
    ) -> Self {
        let models = config
            .iter()
            .filter_map(|model| {
                let account = accounts.iter().position(|a| a.name == model.account)?;
                Some(Model {
                    name: model.name.clone(),
                    account,
                    routed: routes::model_target(model, accounts, idempotency),
                })
            })
            .collect();
        let open = Api::ALL
            .into_iter()
            .filter_map(|api| {
                let index = accounts.iter().position(|a| a.profile_of(api).is_some())?;
                Some((api, routes::api_target(index, accounts, idempotency)))
            })
            .collect();
        Self { models, open }
    }

    /// Every model's router, for the admin API.
    pub(crate) fn routed(&self) -> impl Iterator<Item = (&str, &Routed)> {
        self.models.iter().map(|m| (m.name.as_str(), &m.routed))
    }

    /// The models `caller` may use.
    fn visible_to<'a>(&'a self, caller: &'a Caller) -> impl Iterator<Item = &'a Model> + 'a {
        self.models.iter().filter(|m| caller.may_use(&m.name))
    }

    /// The primary account of a request of `api` for `model`, and its router; or the 404
    /// naming the model.
    pub(crate) fn resolve<'a>(
        &'a self,
        gateway: &'a Gateway,
        caller: &Caller,
        api: Api,
        model: &str,
    ) -> Result<(&'a Account, &'a Routed), Refusal> {
        if self.models.is_empty() {
            return self
                .open
                .iter()
                .find(|(served, _)| *served == api)
                .map(|(_, routed)| (&gateway.accounts[routed.routes[0].1], routed))
                .ok_or_else(|| Refusal::not_served(api.path()));
        }
        let found = self
            .models
            .iter()
            .find(|m| m.name == model && caller.may_use(model))
            .ok_or_else(|| Refusal::model_not_found(model))?;
        let account = &gateway.accounts[found.account];
        if account.profile_of(api).is_none() {
            return Err(Refusal::model_not_found(model).message(format!(
                "the model `{model}` is not served on {}",
                api.path()
            )));
        }
        Ok((account, &found.routed))
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
    let keys = gateway.keys();
    let Some(caller) = keys.authenticate(&headers) else {
        return gateway.refuse_in(dialect, None, Refusal::unauthorized());
    };
    let models = gateway.models();
    let data: Vec<Value> = models
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
    let keys = gateway.keys();
    let Some(caller) = keys.authenticate(&headers) else {
        return gateway.refuse_in(dialect, None, Refusal::unauthorized());
    };
    match gateway.models().visible_to(caller).find(|m| m.name == id) {
        Some(model) => axum::Json(entry(&gateway, model, dialect)).into_response(),
        None => gateway.refuse_in(
            dialect,
            Some(caller.tenant.as_str()),
            Refusal::model_not_found(&id),
        ),
    }
}
