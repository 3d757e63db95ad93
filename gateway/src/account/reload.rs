//! A reload's change of an account's figures: planned against the running configuration
//! ([`Account::plan`]), then applied in place ([`Account::retune`]).

use tower_llm_quota::Budget;

use crate::config::{AccountConfig, ConfigError};

use super::Account;
use super::budgets::configured;

/// A reload's change of one account's figures, checked: see [`Account::plan`].
#[derive(Debug)]
pub(crate) struct Retune {
    account: AccountConfig,
    configured: Vec<tower_llm_quota::Limit>,
}

impl Account {
    /// What a reload changing this account's configuration from `old` to `new` does in
    /// place: new amounts for the limits it has (the account's, each scope's, each model's),
    /// calls in flight, caps. `Err` names what needs a restart instead (where the account
    /// is, its key, profile, APIs, scopes, which limits it has, its minute, its tier policy).
    /// Nothing is applied here: [`Account::retune`] applies it.
    pub(crate) fn plan(old: &AccountConfig, new: &AccountConfig) -> Result<Retune, String> {
        let why = |what: &str| Err(format!("account `{}`: {what} changed", old.name));
        // The same shape once the figures a reload applies are set aside.
        let mut shape = new.clone();
        shape.quota = old.quota;
        shape.caps.clone_from(&old.caps);
        shape.model_quota = old.model_quota;
        if shape.scopes.len() == old.scopes.len() {
            for (scope, was) in shape.scopes.iter_mut().zip(&old.scopes) {
                scope.quota = was.quota;
            }
        }
        if format!("{shape:?}") != format!("{old:?}") {
            return why("more than its limits and caps");
        }
        // Which limits there are stays: a bucket is neither made nor dropped.
        let keys = |l: &crate::config::Limits| -> Result<Vec<_>, String> {
            let limits = l.limits().map_err(|e| e.0)?;
            Ok(limits.iter().map(|l| (l.dimension(), l.period())).collect())
        };
        if old.model_quota.is_some() != new.model_quota.is_some() {
            return why("model_quota");
        }
        let pairs = std::iter::once((&old.quota, &new.quota))
            .chain(
                old.scopes
                    .iter()
                    .map(|s| &s.quota)
                    .zip(new.scopes.iter().map(|s| &s.quota)),
            )
            .chain(old.model_quota.as_ref().zip(new.model_quota.as_ref()));
        for (was, is) in pairs {
            if keys(was)? != keys(is)? {
                return why("which limits it has");
            }
        }
        let configured = configured(new).map_err(|e| e.0)?;
        Ok(Retune {
            account: new.clone(),
            configured,
        })
    }

    /// Applies a reload's [`Retune`]: every budget of the account takes its new amounts at
    /// once, keeping its levels (clamped to a lowered burst) and its requests in flight;
    /// its caps keep what the period used.
    pub(crate) fn retune(&self, retune: &Retune) -> Result<(), ConfigError> {
        let config = &retune.account;
        let apply = |budget: &Budget, limits: &crate::config::Limits| -> Result<(), ConfigError> {
            for limit in limits.limits()? {
                budget.set_limit(limit);
            }
            budget.set_max_in_flight(limits.max_in_flight);
            Ok(())
        };
        let account = self.gate.as_ref().unwrap_or(&self.main.budget);
        apply(account, &config.quota)?;
        account.set_caps(&config.caps);
        self.hard_caps.store(
            crate::fit::any_hard(&config.caps),
            std::sync::atomic::Ordering::Relaxed,
        );
        for ((_, scoped), scope) in self.scopes.iter().zip(&config.scopes) {
            apply(&scoped.budget, &scope.quota)?;
        }
        if let (Some(per_model), Some(limits)) = (&self.per_model, &config.model_quota) {
            *per_model.quota.write().unwrap_or_else(|e| e.into_inner()) = limits.quota()?;
            let made = per_model.made.lock().unwrap_or_else(|e| e.into_inner());
            for scoped in made.values().filter_map(|cell| cell.get()) {
                apply(&scoped.budget, limits)?;
            }
        }
        *self.configured.write().unwrap_or_else(|e| e.into_inner()) = retune.configured.clone();
        Ok(())
    }
}
