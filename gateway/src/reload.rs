//! A reload planned: what of a new configuration applies in place, and what waits for a
//! restart and why. Pure: [`Gateway::reload`](crate::Gateway::reload) applies the plan.

use crate::account::{Account, Retune};
use crate::config::{self, Config};

/// What a reload from the running configuration to a new one does.
#[derive(Debug)]
pub(crate) struct Plan {
    /// The configuration that runs once the reload is done: the new one, but for what waits
    /// for a restart.
    pub(crate) running: Config,
    /// The parts that changed and wait for a restart.
    pub(crate) restart: Vec<&'static str>,
    /// Why, for each.
    pub(crate) why: Vec<String>,
    /// The accounts (by index) whose figures change in place.
    pub(crate) retunes: Vec<(usize, Retune)>,
    /// Whether the public models change (routed over the running accounts).
    pub(crate) models_changed: bool,
}

/// The plan of a reload from `current` to `new`.
pub(crate) fn plan(current: &Config, new: &Config) -> Plan {
    // What runs once the reload is done: the new configuration, but for what waits for a
    // restart.
    let mut plan = Plan {
        running: new.clone(),
        restart: Vec::new(),
        why: Vec::new(),
        retunes: Vec::new(),
        models_changed: false,
    };
    plan.accounts(current, new);
    plan.read_at_start(current, new);
    plan.server(current, new);
    plan
}

/// Whether `a` and `b` differ, as their `Debug` says (the configuration's types are not all
/// comparable).
fn differs(a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug) -> bool {
    format!("{a:?}") != format!("{b:?}")
}

/// The accounts' names, in order.
fn names(config: &Config) -> Vec<&str> {
    config.accounts.iter().map(|a| a.name.as_str()).collect()
}

impl Plan {
    /// The accounts' figures retuned in place while the accounts stay as they are; the
    /// models routed again over them.
    fn accounts(&mut self, current: &Config, new: &Config) {
        let restart = self.why.len();
        if names(new) == names(current) {
            let pairs = current.accounts.iter().zip(&new.accounts).enumerate();
            for (i, (old, is)) in pairs.filter(|(_, (old, is))| differs(old, is)) {
                match Account::plan(old, is) {
                    Ok(retune) => self.retunes.push((i, retune)),
                    Err(reason) => {
                        self.why.push(reason);
                        self.running.accounts[i] = old.clone();
                    }
                }
            }
        } else {
            (self.why).push("accounts were added, removed or reordered".into());
            (self.running.accounts).clone_from(&current.accounts);
        }
        if self.why.len() > restart {
            self.restart.push("accounts");
        }
        // The models are routed over the running accounts: only while their names stand.
        if differs(&new.models, &current.models) {
            if names(new) == names(current) {
                self.models_changed = true;
            } else {
                self.restart.push("models");
                (self.why).push("models: they name accounts that need a restart".into());
                self.running.models.clone_from(&current.models);
            }
        }
    }

    /// What is read at start only: the prices, the output bounds, the spend alerts.
    fn read_at_start(&mut self, current: &Config, new: &Config) {
        if new.prices != current.prices {
            self.restart.push("prices");
            self.why.push(
                "prices: the price table is read at start (what requests in flight reserved \
                 was priced by the running one)"
                    .into(),
            );
            self.running.prices.clone_from(&current.prices);
        }
        if new.output != current.output {
            self.restart.push("output");
            self.why
                .push("output: the output bounds under hard caps are read at start".into());
            self.running.output.clone_from(&current.output);
        }
        if new.spend_alerts != current.spend_alerts {
            self.restart.push("spend_alerts");
            self.why.push(
                "spend_alerts: the alerts are read at start (each is raised once a period, \
                 counted from then)"
                    .into(),
            );
            self.running.spend_alerts.clone_from(&current.spend_alerts);
        }
    }

    /// `[server]`, read at start (but for the admin token, which a reload applies).
    fn server(&mut self, current: &Config, new: &Config) {
        let mut server = new.server.clone();
        server.admin_token.clone_from(&current.server.admin_token);
        server
            .admin_token_env
            .clone_from(&current.server.admin_token_env);
        if differs(&server, &current.server) {
            self.restart.push("server");
            self.why.push(format!(
                "server: {} changed; [server] is read at start",
                changed_fields(&server, &current.server).join(", ")
            ));
            let (token, token_env) = (
                self.running.server.admin_token.take(),
                self.running.server.admin_token_env.take(),
            );
            self.running.server.clone_from(&current.server);
            (
                self.running.server.admin_token,
                self.running.server.admin_token_env,
            ) = (token, token_env);
        }
    }
}

/// The names of the fields of `[server]` that differ (never their values: some are secrets).
fn changed_fields(new: &config::ServerConfig, old: &config::ServerConfig) -> Vec<String> {
    let fields = |server| match serde_json::to_value(server) {
        Ok(serde_json::Value::Object(fields)) => fields,
        _ => serde_json::Map::new(),
    };
    let (new, old) = (fields(new), fields(old));
    (new.iter())
        .filter(|(name, value)| old.get(*name) != Some(value))
        .map(|(name, _)| name.clone())
        .collect()
}
