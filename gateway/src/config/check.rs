//! One validation for `--check-config`, start and reload: every problem of a configuration
//! at once, each with its line in the file, the environment's included (a secret's variable
//! not set, a feature this binary lacks): what `--check-config` accepts starts.

use std::collections::BTreeSet;

use tower_llm_quota::tenant::Tenant;

use super::{Api, Config, ConfigError, Format, ModelConfig, secret};

/// One thing wrong with a configuration, and where it is written: a path into the TOML
/// (`keys`, 3, `tenant`) that gives its line when the text is at hand.
#[derive(Debug, Clone)]
struct Problem {
    at: Vec<Step>,
    message: String,
}

/// A step of a path into the TOML document: a table's key, or an array's index.
#[derive(Debug, Clone)]
enum Step {
    Key(String),
    Index(usize),
}

/// The problems found so far.
#[derive(Debug, Default)]
struct Problems(Vec<Problem>);

impl Problems {
    /// `message`, written at `at`.
    fn add(&mut self, at: &[Step], message: impl std::fmt::Display) {
        self.0.push(Problem {
            at: at.to_vec(),
            message: message.to_string(),
        });
    }

    /// The error of `result`, if any, written at `at`.
    fn check<T>(&mut self, at: &[Step], result: Result<T, ConfigError>) -> Option<T> {
        result.map_err(|e| self.add(at, e)).ok()
    }

    /// Every problem, one a line, each after its line in `text` when it can be found.
    fn into_error(self, text: Option<&str>) -> Option<ConfigError> {
        let document = text.and_then(|text| Some((text, toml::de::DeTable::parse(text).ok()?)));
        let lines: Vec<String> = (self.0.iter())
            .map(|problem| {
                let line = (document.as_ref())
                    .and_then(|(text, table)| line_of(text, table.get_ref(), &problem.at));
                match line {
                    Some(line) => format!("line {line}: {}", problem.message),
                    None => problem.message.clone(),
                }
            })
            .collect();
        match lines.len() {
            0 => None,
            1 => Some(ConfigError(lines.concat())),
            n => Some(ConfigError(format!(
                "{n} problems in the configuration:\n  {}",
                lines.join("\n  ")
            ))),
        }
    }
}

/// The line (from 1) where the value at `at` is written: the deepest step found.
fn line_of(text: &str, table: &toml::de::DeTable<'_>, at: &[Step]) -> Option<usize> {
    let mut span = None;
    let mut value: Option<&toml::de::DeValue<'_>> = None;
    let mut current = Some(table);
    for step in at {
        let next = match (step, current, value) {
            (Step::Key(key), Some(table), _) => table
                .iter()
                .find(|(k, _)| k.get_ref() == key)
                .map(|(_, v)| v),
            (Step::Index(i), _, Some(toml::de::DeValue::Array(items))) => items.get(*i),
            _ => None,
        };
        let Some(next) = next else { break };
        span = Some(next.span());
        value = Some(next.get_ref());
        current = match next.get_ref() {
            toml::de::DeValue::Table(table) => Some(table),
            _ => None,
        };
    }
    let start = span?.start;
    Some(text.get(..start)?.matches('\n').count() + 1)
}

fn key(name: &str) -> Step {
    Step::Key(name.to_owned())
}

impl Config {
    /// Parses and checks a TOML configuration: every problem at once, each with its line.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] listing every problem, each with its line.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError(e.to_string()))?;
        match config.problems().into_error(Some(text)) {
            Some(error) => Err(error),
            None => Ok(config),
        }
    }

    /// Checks a configuration already parsed (without its lines): every problem at once.
    pub(crate) fn check(&self) -> Result<(), ConfigError> {
        self.problems().into_error(None).map_or(Ok(()), Err)
    }

    /// Every key's tenant and name are paths and its tenant a configured node, models name
    /// configured accounts, every API is served once unless models choose the account,
    /// limits are valid, and what the configuration reads from the environment is there.
    fn problems(&self) -> Problems {
        let mut problems = Problems::default();
        self.check_server(&mut problems);
        for (i, account) in self.accounts.iter().enumerate() {
            let at = [key("accounts"), Step::Index(i)];
            problems.check(&at, account.quota.limits());
            problems.check(&at, account.check_scopes());
            let format = account.profile.format();
            for api in account.apis.iter().filter(|api| api.format() != format) {
                problems.add(
                    &[key("accounts"), Step::Index(i), key("apis")],
                    format_args!(
                        "account `{}`: its profile speaks {} API and cannot serve `{}` ({} API)",
                        account.name,
                        format.as_str(),
                        api.as_str(),
                        api.format().as_str()
                    ),
                );
            }
        }
        let output = &self.output;
        if output.min_tokens == 0 || output.unknown_model_tokens < output.min_tokens {
            problems.add(
                &[key("output")],
                format_args!(
                    "output: min_tokens must be at least 1 and at most unknown_model_tokens \
                     (min_tokens {}, unknown_model_tokens {})",
                    output.min_tokens, output.unknown_model_tokens
                ),
            );
        }
        if let Some((model, _)) = output.largest.iter().find(|(_, tokens)| **tokens == 0) {
            problems.add(
                &[key("output"), key("largest"), key(model)],
                format_args!("output.largest: `{model}` must answer at least one token"),
            );
        }
        problems.check(&[key("tenants")], self.tenant_tree());
        self.check_keys(&mut problems);
        self.check_admins(&mut problems);
        self.check_models(&mut problems);
        // Without models, the API alone picks the account: one account per API.
        for api in Api::ALL.into_iter().filter(|_| self.models.is_empty()) {
            let serving = self.accounts.iter().filter(|a| a.apis.contains(&api));
            if serving.count() > 1 {
                problems.add(
                    &[key("accounts")],
                    format_args!(
                        "{} is served by two accounts: name the models each serves in \
                         [[models]]",
                        api.path()
                    ),
                );
            }
        }
        self.check_environment(&mut problems);
        problems
    }

    fn check_server(&self, problems: &mut Problems) {
        let server = &self.server;
        let at = |field: &str| [key("server"), key(field)];
        problems.check(&[key("server")], server.timeouts());
        if !(1024..=1 << 20).contains(&server.max_header_bytes) {
            problems.add(
                &at("max_header_bytes"),
                format_args!(
                    "server.max_header_bytes must be from 1024 to 1048576, not {}",
                    server.max_header_bytes
                ),
            );
        }
        let ms = server.lease_refresh_ms;
        if ms > 60_000 {
            problems.add(
                &at("lease_refresh_ms"),
                format_args!(
                    "server.lease_refresh_ms must be from 0 (a store call per admission) to \
                     60000, not {ms}"
                ),
            );
        }
        let ms = server.store_timeout_ms;
        if !(1..=10_000).contains(&ms) {
            problems.add(
                &at("store_timeout_ms"),
                format_args!("server.store_timeout_ms must be from 1 to 10000, not {ms}"),
            );
        }
        if !(10..=60_000).contains(&server.admin_sync_ms) {
            problems.add(
                &at("admin_sync_ms"),
                format_args!(
                    "server.admin_sync_ms must be from 10 to 60000, not {}",
                    server.admin_sync_ms
                ),
            );
        }
        if cfg!(not(feature = "otel")) && server.otlp_endpoint.is_some() {
            problems.add(
                &at("otlp_endpoint"),
                "server.otlp_endpoint: this gateway was built without the `otel` feature \
                 (cargo install --features otel)",
            );
        }
    }

    /// Every key's tenant and name make a path; when `[tenants.nodes]` names nodes, a key's
    /// tenant is one of them or above one (a misspelled tenant would be a new node with no
    /// limits); every key has one secret.
    fn check_keys(&self, problems: &mut Problems) {
        let configured = self.tenants.get("nodes").and_then(toml::Value::as_table);
        let mut nodes = BTreeSet::new();
        for path in configured.into_iter().flat_map(|nodes| nodes.keys()) {
            let mut node = Tenant::parse(path).ok();
            while let Some(path) = node {
                node = path.parent();
                nodes.insert(path);
            }
        }
        let mut names = BTreeSet::new();
        for (i, config) in self.keys.iter().enumerate() {
            let at = |field: &str| [key("keys"), Step::Index(i), key(field)];
            let name = &config.name;
            if !names.insert(name.as_str()) {
                problems.add(
                    &at("name"),
                    format_args!("key `{name}` is configured twice"),
                );
            }
            match Tenant::parse(&config.tenant) {
                Ok(tenant) if tenant.child(name).is_err() => problems.add(
                    &at("name"),
                    format_args!("key `{name}`: its name must be a tenant path's segment"),
                ),
                Ok(tenant) if !nodes.is_empty() && !nodes.contains(&tenant) => {
                    let hint = super::super::nearest::hint(
                        &config.tenant,
                        nodes.iter().map(Tenant::as_str),
                    );
                    problems.add(
                        &at("tenant"),
                        format_args!(
                            "key `{name}`: tenant `{}` is not in [tenants.nodes]{hint}",
                            config.tenant
                        ),
                    );
                }
                Ok(_) => {}
                Err(e) => problems.add(&at("tenant"), format_args!("key `{name}`: {e}")),
            }
            if config.key.is_none() == config.key_env.is_none() {
                problems.add(
                    &[key("keys"), Step::Index(i)],
                    format_args!("key `{name}`: give exactly one of `key` and `key_env`"),
                );
            }
        }
    }

    fn check_admins(&self, problems: &mut Problems) {
        let mut admins = BTreeSet::from(["admin"]);
        for (i, admin) in self.admins.iter().enumerate() {
            let at = [key("admins"), Step::Index(i)];
            let name = &admin.name;
            if !admins.insert(name.as_str()) {
                problems.add(
                    &at,
                    format_args!(
                        "admin `{name}` is named twice (`admin` is the server's admin_token)"
                    ),
                );
            }
            if admin.token.is_none() == admin.token_env.is_none() {
                problems.add(
                    &at,
                    format_args!("admin `{name}`: give exactly one of `token` and `token_env`"),
                );
            }
            if let Some(tenant) = &admin.tenant
                && let Err(e) = Tenant::parse(tenant)
            {
                problems.add(&at, format_args!("admin `{name}`: {e}"));
            }
        }
    }

    /// Every model name is unique and served by a configured account; every key's models
    /// are configured ones.
    /// Every route of `model` speaks its primary's wire format: the gateway translates no
    /// format into another, so a route to another format could never serve its requests.
    fn check_formats(&self, model: &ModelConfig, at: &[Step], problems: &mut Problems) {
        let format = |name: &str| {
            let account = self.accounts.iter().find(|a| a.name == name)?;
            Some(account.profile.format())
        };
        let Some(primary) = format(&model.account) else {
            return;
        };
        let routes = model
            .fallbacks
            .iter()
            .map(|f| ("fallback", &f.account))
            .chain(model.ramp.iter().map(|r| ("ramp", &r.account)));
        for (kind, account) in routes {
            let Some(other) = format(account).filter(|f| *f != primary) else {
                continue;
            };
            let hint = if [primary, other].contains(&Format::OpenAi) {
                " (Gemini's OpenAI-compatible endpoint takes OpenAI's: profile = \"gemini_openai\")"
            } else {
                ""
            };
            problems.add(
                at,
                format_args!(
                    "model `{}`: the {kind} account `{account}` speaks {} API and the primary \
                     `{}` {} API; the gateway translates no format into another{hint}",
                    model.name,
                    other.as_str(),
                    model.account,
                    primary.as_str()
                ),
            );
        }
    }

    fn check_models(&self, problems: &mut Problems) {
        let mut names = BTreeSet::new();
        for (i, model) in self.models.iter().enumerate() {
            let at = [key("models"), Step::Index(i)];
            let name = &model.name;
            if name.trim().is_empty() || model.model.as_deref() == Some("") {
                problems.add(&at, "a model's name is empty");
            }
            if !names.insert(name.as_str()) {
                problems.add(&at, format_args!("model `{name}` is configured twice"));
            }
            let accounts = std::iter::once(&model.account)
                .chain(model.fallbacks.iter().map(|f| &f.account))
                .chain(model.ramp.iter().map(|r| &r.account));
            for account in accounts {
                if !self.accounts.iter().any(|a| a.name == *account) {
                    let hint = super::super::nearest::hint(
                        account,
                        self.accounts.iter().map(|a| a.name.as_str()),
                    );
                    problems.add(
                        &at,
                        format_args!("model `{name}`: no account is named `{account}`{hint}"),
                    );
                }
            }
            self.check_formats(model, &at, problems);
            Self::check_routes(model, &at, problems);
        }
        self.check_key_models(&names, problems);
    }

    /// A model's fallbacks (each with a condition and a sane wait) and its ramp.
    fn check_routes(model: &super::ModelConfig, at: &[Step], problems: &mut Problems) {
        let name = &model.name;
        for fallback in &model.fallbacks {
            if fallback.on.is_empty() {
                problems.add(
                    at,
                    format_args!(
                        "model `{name}`: a fallback to `{}` has no condition (`on`)",
                        fallback.account
                    ),
                );
            }
            let wait = fallback.would_wait_seconds;
            if !(wait.is_finite() && (0.0..=86_400.0).contains(&wait)) {
                problems.add(
                    at,
                    format_args!(
                        "model `{name}`: would_wait_seconds must be from 0 to 86400, not \
                         {wait}"
                    ),
                );
            }
        }
        if let Some(ramp) = &model.ramp {
            let ramp = tower_llm_quota::routing::Ramp::new(
                ramp.start_percent,
                ramp.percent_per_minute,
                ramp.max_percent,
            );
            if let Err(e) = ramp {
                problems.add(at, format_args!("model `{name}`: ramp: {e}"));
            }
        }
    }

    /// The models each key may use are configured.
    fn check_key_models(&self, names: &BTreeSet<&str>, problems: &mut Problems) {
        for (i, config) in self.keys.iter().enumerate() {
            for model in config.models.iter().flatten() {
                if !names.contains(model.as_str()) {
                    let hint = super::super::nearest::hint(model, names.iter().copied());
                    problems.add(
                        &[key("keys"), Step::Index(i), key("models")],
                        format_args!(
                            "key `{}`: model `{model}` is not in [[models]]{hint}",
                            config.name
                        ),
                    );
                }
            }
        }
    }

    /// What the configuration reads from the environment is set and not empty: the admin
    /// and status tokens, the admins' tokens, the callers' keys and the accounts' keys. Each
    /// variable is named once, however many entries name it.
    fn check_environment(&self, problems: &mut Problems) {
        let mut named = BTreeSet::new();
        let mut read = |problems: &mut Problems,
                        at: &[Step],
                        inline: Option<&String>,
                        var: Option<&String>,
                        what: &str,
                        required: bool| {
            if var.is_some_and(|var| !named.insert(var.clone())) {
                return;
            }
            match secret(inline, var, what) {
                Ok(Some(value)) if value.is_empty() => {
                    problems.add(at, format_args!("{what} is empty"));
                }
                Ok(None) if required => problems.add(at, format_args!("{what} is not given")),
                Ok(_) => {}
                Err(e) => problems.add(at, e),
            }
        };
        for (at, inline, var, what, required) in self.secrets_read() {
            read(problems, &at, inline, var, &what, required);
        }
    }

    /// Every secret the configuration gives inline or names a variable of: where, the
    /// value, the variable, what it is, and whether it must be given.
    #[allow(clippy::type_complexity)]
    fn secrets_read(&self) -> Vec<(Vec<Step>, Option<&String>, Option<&String>, String, bool)> {
        let server = &self.server;
        let mut read = vec![
            (
                vec![key("server"), key("admin_token_env")],
                server.admin_token.as_ref(),
                server.admin_token_env.as_ref(),
                "the admin token (`admin_token_env`)".to_owned(),
                true,
            ),
            (
                vec![key("server"), key("status_token_env")],
                server.status_token.as_ref(),
                server.status_token_env.as_ref(),
                "the status token".to_owned(),
                false,
            ),
        ];
        for (i, admin) in self.admins.iter().enumerate() {
            let what = format!("admin `{}`'s token", admin.name);
            let at = vec![key("admins"), Step::Index(i)];
            read.push((
                at,
                admin.token.as_ref(),
                admin.token_env.as_ref(),
                what,
                false,
            ));
        }
        for (i, config) in self.keys.iter().enumerate() {
            let what = format!("key `{}`", config.name);
            let at = vec![key("keys"), Step::Index(i)];
            read.push((
                at,
                config.key.as_ref(),
                config.key_env.as_ref(),
                what,
                false,
            ));
        }
        for (i, account) in self.accounts.iter().enumerate() {
            if account.base_url == "sim" {
                continue;
            }
            let what = format!("account `{}`'s key", account.name);
            let at = vec![key("accounts"), Step::Index(i), key("key_env")];
            read.push((
                at,
                account.key.as_ref(),
                account.key_env.as_ref(),
                what,
                false,
            ));
        }
        read
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[server]
admin_token = "t"

[[accounts]]
name = "sim"
base_url = "sim"
profile = "openai"
apis = ["chat"]
quota = { requests_per_minute = 60 }

[tenants.nodes."acme/web"]
weight = 1
"#;

    #[test]
    fn every_problem_at_once_with_its_line() {
        let text = format!(
            "{BASE}
[[keys]]
name = \"ok\"
key = \"k1\"
tenant = \"acme/web\"

[[keys]]
name = \"typo\"
key = \"k2\"
tenant = \"acme/wbe\"

[[keys]]
name = \"unset\"
key_env = \"LLM_QUOTA_TEST_SURELY_UNSET\"
tenant = \"acme\"
"
        );
        let error = Config::from_toml(&text).unwrap_err().to_string();
        assert!(error.starts_with("2 problems"), "{error}");
        let line = |needle: &str| text.lines().position(|l| l.contains(needle)).unwrap() + 1;
        let typo = line("tenant = \"acme/wbe\"");
        assert!(
            error.contains(&format!(
                "line {typo}: key `typo`: tenant `acme/wbe` is not in [tenants.nodes] \
                 (did you mean `acme/web`?)"
            )),
            "{error}"
        );
        assert!(
            error.contains("LLM_QUOTA_TEST_SURELY_UNSET is not set"),
            "{error}"
        );
    }

    #[test]
    fn without_nodes_keys_name_their_tenants() {
        let text = "[server]\nadmin_token = \"t\"\n\n[[accounts]]\nname = \"sim\"\n\
                    base_url = \"sim\"\nprofile = \"openai\"\napis = [\"chat\"]\n\
                    quota = { requests_per_minute = 60 }\n\n[[keys]]\nname = \"k\"\n\
                    key = \"s\"\ntenant = \"team\"\n";
        Config::from_toml(text).unwrap();
    }

    #[test]
    fn a_variable_is_named_once() {
        let text = format!(
            "{BASE}
[[keys]]
name = \"a\"
key_env = \"LLM_QUOTA_TEST_SURELY_UNSET_TOO\"
tenant = \"acme/web\"

[[keys]]
name = \"b\"
key_env = \"LLM_QUOTA_TEST_SURELY_UNSET_TOO\"
tenant = \"acme/web\"
"
        );
        let error = Config::from_toml(&text).unwrap_err().to_string();
        assert_eq!(
            error.matches("LLM_QUOTA_TEST_SURELY_UNSET_TOO").count(),
            1,
            "{error}"
        );
    }

    #[test]
    fn a_missing_admin_token_is_a_problem() {
        let text = "keys = []\n".to_owned()
            + &BASE.replace(
                "admin_token = \"t\"",
                "admin_token_env = \"LLM_QUOTA_NO_ADMIN\"",
            );
        let error = Config::from_toml(&text).unwrap_err().to_string();
        assert!(error.contains("LLM_QUOTA_NO_ADMIN is not set"), "{error}");
    }
}
