//! The public models: the names callers send, the account serving each and its name
//! upstream, which keys may use which (`GET /v1/models` lists them: `catalog.rs`).
//!
//! With no `[[models]]` configured the gateway is open: any model passes to the account
//! serving the API, and the list is empty.

use super::account::Account;
use super::auth::Caller;
use super::config::{Api, ModelConfig};
use super::refusal::Refusal;
use super::routes::{self, Routed};
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
    pub(crate) fn visible_to<'a>(
        &'a self,
        caller: &'a Caller,
    ) -> impl Iterator<Item = &'a Model> + 'a {
        self.models.iter().filter(|m| caller.may_use(&m.name))
    }

    /// The primary account of a request of `api` for `model`, and its router; or the 404
    /// naming the model.
    pub(crate) fn resolve<'a>(
        &'a self,
        accounts: &'a [Account],
        caller: &Caller,
        api: Api,
        model: &str,
    ) -> Result<(&'a Account, &'a Routed), Refusal> {
        if self.models.is_empty() {
            return self
                .open
                .iter()
                .find(|(served, _)| *served == api)
                .map(|(_, routed)| (&accounts[routed.routes[0].1], routed))
                .ok_or_else(|| Refusal::not_served(api.path()));
        }
        let found = self
            .models
            .iter()
            .find(|m| m.name == model && caller.may_use(model))
            .ok_or_else(|| Refusal::model_not_found(model))?;
        let account = &accounts[found.account];
        if account.profile_of(api).is_none() {
            return Err(Refusal::model_not_found(model).message(format!(
                "the model `{model}` is not served on {}",
                api.path()
            )));
        }
        Ok((account, &found.routed))
    }
}
