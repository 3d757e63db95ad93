//! The provider accounts: one governed stack ([`QuotaStack`]) per API an account serves, over
//! one budget per account (with scopes, one per scope and an account-wide gate), in front of
//! the simulator or an HTTP(S) upstream.
//!
//! Here the account model; its budgets and stacks are made in [`budgets`], a request is
//! pointed at it in [`target`], and a reload retunes it in place through [`reload`].

use std::sync::Arc;

use http::{HeaderValue, Uri};
use tower_llm_quota::pricing::PriceTable;
use tower_llm_quota::provider::Profile;
use tower_llm_quota::queue::QueueHandle;
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::tenant::{TenantHandle, TenantTree};
use tower_llm_quota::{Budget, Quota};
use tower_llm_quota_sim::Simulator;

use super::config::{AccountConfig, Api, ConfigError, Format, ProfileName, ScopeConfig};

mod budgets;
mod reload;
pub(crate) use reload::Retune;
mod target;

use crate::clients::{client, tls_config};
use crate::simulated::{SIM_KEY, simulator};
pub(crate) use budgets::{Governed, Keeping, Scoped, StateRefused};
use budgets::{Maker, Upstream, budget, configured, durable, profile, stacks};

/// One account: its budgets, and a stack per API over each.
///
/// Without scopes, one budget holds the account's limits. With scopes (the provider's
/// per-model or per-class limits), each scope has a budget of its own and the account's
/// limits sit in a gate every scope's requests also pass, one reservation per attempt: a
/// provider 429 pauses the scope that drew it, and the account-wide request limit still holds.
#[derive(Debug, Clone)]
pub(crate) struct Account {
    pub(crate) name: String,
    pub(crate) profile: Profile,
    /// The wire format of its APIs.
    format: Format,
    /// The models no scope names (every model, without scopes); it holds the tenant tree.
    main: Scoped,
    /// The configured scopes, in order: the first that pools a model serves it.
    scopes: Arc<[(ScopeConfig, Scoped)]>,
    /// Each model no scope names in buckets of its own (`model_quota`), made at its first
    /// request.
    per_model: Option<Arc<PerModel>>,
    /// With scopes: the account-wide limits every scope's requests also pass.
    gate: Option<Budget>,
    /// Every limit the configuration gives the account and its scopes, to tell them from
    /// limits the provider reported lower since (replaced by a reload).
    configured: Arc<std::sync::RwLock<Vec<tower_llm_quota::Limit>>>,
    queue: QueueHandle,
    base: Uri,
    /// Where the OpenAI APIs' paths start upstream instead of `/v1`: Gemini's
    /// OpenAI-compatible endpoint's root.
    root: Option<&'static str>,
    /// The provider key's header: `authorization: Bearer`, Anthropic's `x-api-key`, Azure's
    /// `api-key`, Google's `x-goog-api-key`.
    key: Option<(http::HeaderName, HeaderValue)>,
    /// The in-process simulator, when the account has no real upstream.
    pub(crate) simulator: Option<Simulator>,
    /// Whether the account itself has a hard cap an output bound keeps (replaced by a
    /// reload).
    hard_caps: Arc<std::sync::atomic::AtomicBool>,
}

/// The root of Gemini's OpenAI-compatible endpoint: `/v1beta/openai/chat/completions` for
/// OpenAI's `/v1/chat/completions`.
const GEMINI_OPENAI_ROOT: &str = "/v1beta/openai";

/// The most models an account keeps in buckets of their own (`model_quota`): a caller
/// sending made-up model names cannot grow the gateway's memory or the store without bound.
pub(crate) const MAX_MODEL_SCOPES: usize = 256;

/// What makes a model's own scope, and the scopes made so far.
#[derive(Debug)]
struct PerModel {
    maker: Maker,
    /// Each model's limits (replaced by a reload).
    quota: std::sync::RwLock<Quota>,
    made: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::OnceCell<Scoped>>>>,
}

impl Account {
    /// Builds an account, its budget serving the tenant `tree`, or the tenants of the budget
    /// of the account built `before` it: a tenant's limits, calls in flight, caps over a
    /// period and pauses hold over every account it uses. Kept in the replicas' store
    /// (`keeping`), the account's quota and every node's limits and controls hold over every
    /// replica (failing closed or not, and admitting from a share leased every `lease` rather
    /// than asking per admission).
    pub(crate) async fn new(
        config: &AccountConfig,
        (tree, before): (&TenantTree, Option<&Budget>),
        keeping: &Keeping,
        prices: Option<&Arc<PriceTable>>,
    ) -> Result<Self, ConfigError> {
        let error = |message: String| ConfigError(format!("account `{}`: {message}", config.name));
        let simulator = (config.base_url == "sim").then(|| simulator(config));
        let (base, key) = match &simulator {
            Some(_) => (
                Uri::from_static("http://simulator"),
                Some(SIM_KEY.to_owned()),
            ),
            None => {
                let base = config
                    .base_url
                    .parse::<Uri>()
                    .map_err(|e| error(e.to_string()))?;
                if !matches!(base.scheme_str(), Some("http" | "https")) {
                    return Err(error(
                        "base_url must be http:// or https:// (or `sim`)".into(),
                    ));
                }
                let key = match (&config.key, &config.key_env) {
                    (Some(key), _) => Some(key.clone()),
                    (None, Some(var)) => {
                        Some(std::env::var(var).map_err(|_| error(format!("{var} is not set")))?)
                    }
                    (None, None) => None,
                };
                (base, key)
            }
        };
        let tls = tls_config(config.ca_file.as_deref()).map_err(error)?;
        let client = durable(
            client(simulator.as_ref(), tls),
            keeping.caps.clone(),
            keeping.fail_closed,
        );
        // Named after the account: its depth gauges are its own.
        // The account's caps go where every request of it passes: the gate when it has one.
        let quota = (config.caps.iter().copied())
            .fold(config.quota.quota()?, tower_llm_quota::Quota::with_cap)
            .with_name(config.name.as_str());
        let (main_quota, gate) = if config.is_scoped() {
            // The account-wide limits move to the gate; the models no scope names have no
            // limits of their own but the tenants'.
            let gate = budget(&config.name, &quota, keeping).await?;
            let main = Quota::new().with_name(format!("{}/*", config.name));
            (main, Some(gate))
        } else {
            (quota, None)
        };
        let budget = match &gate {
            Some(_) => budget(&format!("{}/*", config.name), &main_quota, keeping).await?,
            None => budget(&config.name, &main_quota, keeping).await?,
        };
        let budget = match before {
            Some(before) => budget.with_tenants_of(before),
            None => budget
                .with_tenant_tree(tree.clone())
                .map_err(|e| error(e.to_string()))?,
        };
        let queue = QuotaStack::for_profile(profile(config.profile, Api::Chat), main_quota.clone())
            .with_budget(budget.clone())
            .queue_handle();
        let upstream = Upstream {
            client,
            gate: gate.clone(),
        };
        let main = Scoped {
            name: None,
            stacks: stacks(config, &main_quota, (&budget, prices), &upstream),
            budget: budget.clone(),
        };
        let maker = Maker {
            account: config.clone(),
            tenants_of: budget,
            keeping: keeping.clone(),
            upstream,
            prices: prices.cloned(),
        };
        let mut scopes = Vec::with_capacity(config.scopes.len());
        for scope in &config.scopes {
            let quota = scope.quota.quota()?;
            scopes.push((scope.clone(), maker.make(&scope.name, &quota).await?));
        }
        let per_model = match &config.model_quota {
            Some(limits) => Some(Arc::new(PerModel {
                quota: std::sync::RwLock::new(limits.quota()?),
                maker,
                made: std::sync::Mutex::default(),
            })),
            None => None,
        };
        let configured = Arc::new(std::sync::RwLock::new(configured(config)?));
        let key = key
            .map(|key| {
                let (name, value) = match config.profile {
                    ProfileName::Anthropic => ("x-api-key", key),
                    ProfileName::AzureOpenai => ("api-key", key),
                    ProfileName::Gemini => (super::gemini::KEY_HEADER, key),
                    ProfileName::Openai | ProfileName::Groq | ProfileName::GeminiOpenai => {
                        ("authorization", format!("Bearer {key}"))
                    }
                };
                let mut value = HeaderValue::from_str(&value)
                    .map_err(|_| error("the key is not a header value".into()))?;
                value.set_sensitive(true);
                Ok((http::HeaderName::from_static(name), value))
            })
            .transpose()?;
        Ok(Self {
            name: config.name.clone(),
            profile: profile(config.profile, Api::Chat),
            format: config.profile.format(),
            main,
            scopes: scopes.into(),
            per_model,
            gate,
            configured,
            queue,
            base,
            root: (config.profile == ProfileName::GeminiOpenai).then_some(GEMINI_OPENAI_ROOT),
            key,
            simulator,
            hard_caps: Arc::new(std::sync::atomic::AtomicBool::new(super::fit::any_hard(
                &config.caps,
            ))),
        })
    }

    /// Whether a hard cap an output bound keeps (spend, output or total tokens) holds over
    /// the requests of `path`: the account's own, or one of a node of the path (looked for
    /// only when the tree has one somewhere: `tree_hard`).
    pub(crate) fn hard_capped(
        &self,
        path: &tower_llm_quota::tenant::Tenant,
        tree_hard: bool,
    ) -> bool {
        if self.hard_caps.load(std::sync::atomic::Ordering::Relaxed) {
            return true;
        }
        if !tree_hard {
            return false;
        }
        let Some(tenants) = self.tenants() else {
            return false;
        };
        path.prefixes().any(|prefix| {
            tower_llm_quota::tenant::Tenant::parse(prefix)
                .ok()
                .and_then(|scope| tenants.node(&scope))
                .is_some_and(|node| super::fit::any_hard(node.caps()))
        })
    }

    /// The wire format of its APIs.
    pub(crate) fn format(&self) -> Format {
        self.format
    }

    /// The profile serving `api`, if this account serves it (the stack is not cloned).
    pub(crate) fn profile_of(&self, api: Api) -> Option<Profile> {
        self.main
            .stacks
            .iter()
            .find(|(a, ..)| *a == api)
            .map(|(_, profile, _)| *profile)
    }

    /// The configured scope pooling `model`, else the account's own budget; never a scope
    /// made for one model (see [`Account::scope`]).
    pub(crate) fn configured_scope(&self, model: Option<&str>) -> &Scoped {
        model
            .and_then(|model| self.scopes.iter().find(|(config, _)| config.pools(model)))
            .map_or(&self.main, |(_, scoped)| scoped)
    }

    /// The scope serving `model` (its name upstream): the first configured scope pooling it,
    /// else its own (with `model_quota`, made at its first request), else the account's own
    /// budget.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a scope being made when the future is dropped is made by the next call.
    pub(crate) async fn scope(&self, model: Option<&str>) -> Result<Scoped, ScopeError> {
        let configured = self.configured_scope(model);
        let (Some(per_model), Some(model), None) = (&self.per_model, model, configured.name())
        else {
            return Ok(configured.clone());
        };
        if !super::config::valid_scope_name(model) {
            return Err(ScopeError::BadName);
        }
        let cell = {
            let mut made = per_model.made.lock().unwrap_or_else(|e| e.into_inner());
            if !made.contains_key(model) && made.len() >= MAX_MODEL_SCOPES {
                return Err(ScopeError::TooMany);
            }
            made.entry(model.to_owned()).or_default().clone()
        };
        let quota = per_model
            .quota
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let scoped = cell
            .get_or_try_init(|| per_model.maker.make(model, &quota))
            .await
            .map_err(ScopeError::Store)?;
        Ok(scoped.clone())
    }

    /// Every scope with a budget of its own: the configured ones, then those made per model.
    pub(crate) fn scopes(&self) -> Vec<Scoped> {
        let mut scopes: Vec<Scoped> = self.scopes.iter().map(|(_, s)| s.clone()).collect();
        if let Some(per_model) = &self.per_model {
            let made = per_model.made.lock().unwrap_or_else(|e| e.into_inner());
            let mut own: Vec<Scoped> = made.values().filter_map(|c| c.get().cloned()).collect();
            own.sort_by(|a, b| a.name.cmp(&b.name));
            scopes.extend(own);
        }
        scopes
    }

    /// Completes once every budget of the account (its own, its scopes', its gate) has sent
    /// its last settlements to the shared store: see [`Budget::flush`].
    pub(crate) async fn flush(&self) {
        let scopes = self.scopes();
        let budgets = std::iter::once(&self.main.budget)
            .chain(scopes.iter().map(|s| &s.budget))
            .chain(self.gate.as_ref());
        for budget in budgets {
            budget.flush().await;
        }
    }

    /// The smallest burst the configuration gives a limit of `dimension` on this account (or
    /// its scopes), if any: a budget refusing a request as larger than a burst below it is
    /// following a limit the provider reported.
    pub(crate) fn configured_capacity(&self, dimension: tower_llm_quota::Dimension) -> Option<u64> {
        self.configured
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|limit| limit.dimension() == dimension)
            .map(tower_llm_quota::Limit::capacity)
            .min()
    }

    /// The account-wide budget every scope's requests pass, when the account has scopes.
    pub(crate) fn gate(&self) -> Option<&Budget> {
        self.gate.as_ref()
    }

    /// The account's own budget: every model's without scopes; with scopes, the models no
    /// scope names (the account-wide limits are the [gate](Account::gate)'s).
    pub(crate) fn budget(&self) -> &Budget {
        &self.main.budget
    }

    /// The account's copy of the tenant tree.
    pub(crate) fn tenants(&self) -> Option<TenantHandle> {
        self.main.budget.tenants()
    }

    /// Requests waiting for this account, by class.
    pub(crate) fn queue(&self) -> &QueueHandle {
        &self.queue
    }
}

/// Why a model has no scope to serve it.
#[derive(Debug)]
pub(crate) enum ScopeError {
    /// Its name cannot name a scope of its own (see `valid_scope_name`).
    BadName,
    /// The account keeps [`MAX_MODEL_SCOPES`] models apart already.
    TooMany,
    /// The store could not make its budget.
    Store(ConfigError),
}

impl std::fmt::Display for ScopeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScopeError::BadName => {
                f.write_str("the model name must be 1 to 64 of letters, digits, `.`, `-`, `_`, `:`")
            }
            ScopeError::TooMany => write!(
                f,
                "the account already keeps {MAX_MODEL_SCOPES} models apart; no more are served"
            ),
            ScopeError::Store(e) => write!(f, "the shared store: {e}"),
        }
    }
}

impl std::error::Error for ScopeError {}
