//! The gateway's configuration: a TOML file (serde), or the demo built in.
//!
//! ```toml
//! [server]
//! listen = "127.0.0.1:8080"
//! admin_token_env = "GATEWAY_ADMIN_TOKEN"
//! max_body_bytes = 1048576
//! state = "sqlite:/var/lib/llm-quota-gateway/state.db"  # what outlives a restart (the default: beside this file)
//!
//! [[accounts]]
//! name = "openai-main"
//! base_url = "https://api.openai.com"  # http(s)://, or "sim": the simulated provider, in process
//! # ca_file = "corp-ca.pem"            # trust these CAs (PEM) instead of the Mozilla roots
//! key_env = "OPENAI_API_KEY"
//! profile = "openai"                   # openai | anthropic | azure_openai | groq
//! apis = ["chat", "responses"]         # chat | responses | messages | embeddings | completions | count_tokens
//! quota = { requests_per_minute = 500, tokens_per_minute = 200000, max_in_flight = 64 }
//!
//! [[accounts]]
//! name = "anthropic-main"
//! base_url = "https://api.anthropic.com"
//! key_env = "ANTHROPIC_API_KEY"
//! profile = "anthropic"
//! apis = ["messages"]
//! quota = { requests_per_minute = 4000 }   # with scopes: what every model shares
//! # Anthropic pools limits per model class: every Opus 4.x model in one set of buckets.
//! scopes = [
//!   { name = "opus-4", models = ["claude-opus-4*"], quota = { input_tokens_per_minute = 2000000, output_tokens_per_minute = 400000 } },
//!   { name = "sonnet-4", models = ["claude-sonnet-4*"], quota = { input_tokens_per_minute = 2000000, output_tokens_per_minute = 400000 } },
//! ]
//! # OpenAI limits each model apart: `model_quota` gives every model no scope names buckets
//! # of its own.
//! # model_quota = { requests_per_minute = 500, tokens_per_minute = 200000 }
//!
//! [tenants.nodes."acme/search"]
//! weight = 3
//! guarantee = 0.5
//! limits = [{ dimension = "total_tokens", amount = 60000, period_seconds = 60 }]
//!
//! [[keys]]
//! name = "acme-search-web"
//! key_env = "ACME_SEARCH_KEY"
//! tenant = "acme/search"
//! default_class = "interactive"
//! allow_priority_header = true
//!
//! [[admins]]                           # a delegated admin: acme's subtree only
//! name = "acme-partner"
//! token_env = "ACME_ADMIN_TOKEN"
//! tenant = "acme"
//! ```

mod check;

use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::time::Duration;

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use tower_llm_quota::CapWindow;
use tower_llm_quota::tenant::{Tenant, TenantTree};
use tower_llm_quota::{Dimension, Limit, Priority, Quota};

/// The gateway's configuration: its TOML file, parsed and checked by
/// [`Config::from_toml`] (the reference is the crate's README).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub(crate) server: ServerConfig,
    pub(crate) accounts: Vec<AccountConfig>,
    /// The tenant tree, in the crate's format (`tower_llm_quota::tenant`'s configuration
    /// file): `default_tenant`, `label_depth`, `nodes`, `templates`.
    #[serde(default)]
    pub(crate) tenants: toml::Table,
    pub(crate) keys: Vec<KeyConfig>,
    /// Named admin tokens: the operators', and delegated admins' limited to a subtree.
    #[serde(default)]
    pub(crate) admins: Vec<AdminConfig>,
    /// The public model names callers may send, each served by an account; when none is
    /// configured, any model passes to the account serving the API.
    #[serde(default)]
    pub(crate) models: Vec<ModelConfig>,
    /// Prices per model and service tier (the crate's price table format): with them, every
    /// request's spend is reserved and settled, and spend limits and caps hold.
    #[serde(default)]
    pub(crate) prices: Option<tower_llm_quota::pricing::PriceTable>,
    /// Thresholds of a node's spend over a day or a month, raised once per period.
    #[serde(default)]
    pub(crate) spend_alerts: Vec<AlertConfig>,
    /// How requests are bounded under hard caps: the models' largest outputs, the bound
    /// written into a request for a model not known, the smallest useful bound.
    #[serde(default)]
    pub(crate) output: OutputConfig,
}

/// `[output]`: the output bound of a request under a hard cap (a cap of spend, output or
/// total tokens over a period, not `enforce = "soft"`, on its tenant, key or account).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct OutputConfig {
    /// A request the caps would lower below this many output tokens (per choice) is refused
    /// with the cap's reason instead. Default 64.
    #[serde(default = "default_min_tokens")]
    pub(crate) min_tokens: u64,
    /// The `max_tokens` written into a request that sets none, for a model the table of
    /// largest outputs does not know. Default 4,096.
    #[serde(default = "default_unknown_model_tokens")]
    pub(crate) unknown_model_tokens: u64,
    /// Largest outputs per model (names, or prefixes ending in `*`), over the built-in
    /// table of the providers' published limits.
    #[serde(default)]
    pub(crate) largest: BTreeMap<String, u64>,
}

fn default_min_tokens() -> u64 {
    64
}

fn default_unknown_model_tokens() -> u64 {
    4_096
}

impl Default for OutputConfig {
    fn default() -> Self {
        Self {
            min_tokens: default_min_tokens(),
            unknown_model_tokens: default_unknown_model_tokens(),
            largest: BTreeMap::new(),
        }
    }
}

/// One public model name: the account that serves it, its fallbacks, a ramp.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ModelConfig {
    /// The name callers send, and `GET /v1/models` lists.
    pub(crate) name: String,
    /// The account serving it (by name): the primary route.
    pub(crate) account: String,
    /// The model's name upstream; the request's `model` is rewritten to it. Defaults to
    /// `name`.
    pub(crate) model: Option<String>,
    /// The primary's context window in tokens, for `context_length` fallbacks.
    pub(crate) context_window: Option<u64>,
    /// Routes tried after the primary, in order, each under its conditions.
    #[serde(default)]
    pub(crate) fallbacks: Vec<FallbackConfig>,
    /// A route taking a growing share of the primary's traffic (a migration).
    pub(crate) ramp: Option<RampConfig>,
}

/// A fallback route of a model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FallbackConfig {
    pub(crate) account: String,
    /// Its model upstream; defaults to the primary's.
    pub(crate) model: Option<String>,
    /// When it serves: any of these.
    pub(crate) on: Vec<FallbackOn>,
    /// With `would_wait`: the longest the primary may make a request wait (0: not at all).
    #[serde(default)]
    pub(crate) would_wait_seconds: f64,
    /// The classes it serves; all when absent.
    pub(crate) classes: Option<Vec<Class>>,
    /// Its context window in tokens.
    pub(crate) context_window: Option<u64>,
    /// What it supports of what a request may need; everything when absent.
    pub(crate) features: Option<Vec<Feature>>,
    /// The service tier it asks for (the body's `service_tier` rewritten: `default` for a
    /// fallback from flex); the request's own when absent.
    pub(crate) service_tier: Option<String>,
}

/// What a request may need of a route, read from its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Feature {
    /// Tool or function calls: the body has `tools` or `functions`.
    Tools,
    /// Structured output: the body has `response_format`.
    ResponseFormat,
    /// Image input: a message part of type `image_url` or `image`.
    Images,
}

impl Feature {
    pub(crate) const ALL: [Feature; 3] = [Feature::Tools, Feature::ResponseFormat, Feature::Images];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Feature::Tools => "tools",
            Feature::ResponseFormat => "response_format",
            Feature::Images => "images",
        }
    }
}

/// A condition under which a fallback serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum FallbackOn {
    /// The primary answered 5xx (or overloaded) after its retries.
    ServerError,
    /// The primary answered 429 after its retries.
    RateLimited,
    /// The primary could not take the request (its store down, its provider unreachable).
    Unavailable,
    /// The primary's budget cannot admit the request within `would_wait_seconds`.
    WouldWait,
    /// The request does not fit the primary's context window, and fits this one's.
    ContextLength,
    /// Always, for its classes: a degraded route.
    Degrade,
    /// The primary's service tier had no capacity (OpenAI flex's 429 "Resource
    /// Unavailable", not billed) after its retries.
    TierUnavailable,
    /// A spend cap of the request's tenant or key cannot pay its estimate on the primary
    /// (nothing sent): this cheaper route may still fit what is left.
    SpendCapped,
}

/// A ramp of a model: a route taking a growing share of its traffic.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RampConfig {
    pub(crate) account: String,
    pub(crate) model: Option<String>,
    /// The share it starts with, in percent.
    pub(crate) start_percent: f64,
    /// Percentage points added each minute while it is healthy.
    pub(crate) percent_per_minute: f64,
    /// The share it stops at.
    #[serde(default = "default_ramp_ceiling")]
    pub(crate) max_percent: f64,
    /// What it supports of what a request may need; everything when absent.
    pub(crate) features: Option<Vec<Feature>>,
}

fn default_ramp_ceiling() -> f64 {
    100.0
}

/// Where the gateway listens and what it accepts.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ServerConfig {
    #[serde(default = "default_listen")]
    #[allow(dead_code, reason = "read by main.rs; the tests bind their own port")]
    pub(crate) listen: SocketAddr,
    /// The admin API's bearer token, read from this environment variable.
    pub(crate) admin_token_env: Option<String>,
    /// The admin token itself (the demo's); prefer `admin_token_env`.
    pub(crate) admin_token: Option<String>,
    /// A bearer token `/status.json` and `/metrics` require, read from this environment
    /// variable; without one (nor `status_token`) they are open (keep them on a private
    /// address).
    pub(crate) status_token_env: Option<String>,
    /// The status token itself; prefer `status_token_env`.
    pub(crate) status_token: Option<String>,
    /// The largest request body accepted (413 above).
    #[serde(default = "default_max_body")]
    pub(crate) max_body_bytes: usize,
    /// Refuse (503) rather than admit locally when the shared store is unreachable.
    #[serde(default = "default_true")]
    pub(crate) fail_closed: bool,
    /// Seconds a connection has to send a request's head: from its accept, or from its first
    /// byte after an idle spell; the connection is closed after.
    #[serde(default = "default_header_timeout")]
    pub(crate) header_timeout_seconds: f64,
    /// Seconds a request's body has to arrive, from its head (408 after).
    #[serde(default = "default_body_timeout")]
    pub(crate) body_timeout_seconds: f64,
    /// Seconds a kept-alive connection may stay idle between requests.
    #[serde(default = "default_idle_timeout")]
    pub(crate) idle_timeout_seconds: f64,
    /// The most connections held at once; by default, and at most, the process's open-file
    /// limit less a reserve (an eighth of it, at least 64).
    pub(crate) max_connections: Option<std::num::NonZeroUsize>,
    /// The largest request head (request line and headers) accepted (431 above).
    #[serde(default = "default_max_header")]
    pub(crate) max_header_bytes: usize,
    /// The audit log (a JSON line per request and per admin change): `stdout` (the default),
    /// `off`, or a file path (appended to; rotation is left to the platform).
    pub(crate) audit_log: Option<String>,
    /// With a shared store: each replica admits from what it leased of every account,
    /// renewed every this many milliseconds (100 by default); 0 asks the store per admission.
    #[serde(default = "default_lease_refresh")]
    pub(crate) lease_refresh_ms: u64,
    /// With a shared store: how long a call to it may take before it counts as failed (250 ms
    /// by default, 1 to 10,000). One failure asks again; three in a row open the breaker, and
    /// the failure policy (`fail_closed`) answers.
    #[serde(default = "default_store_timeout")]
    pub(crate) store_timeout_ms: u64,
    /// Where the gateway's state lives (`--state` overrides it): `sqlite:FILE` (a relative
    /// file beside the configuration), `postgres://...`, `redis://...` or `memory`; by
    /// default an SQLite file beside the configuration, named after it (`gateway.toml`:
    /// `gateway.state.db`).
    #[allow(dead_code, reason = "read by main.rs; the tests name their state")]
    pub(crate) state: Option<String>,
    /// The JSON file an earlier version kept the admin API's changes in: read once into the
    /// state's table when that is empty; with `state = "memory"`, still the file the changes
    /// are kept in.
    pub(crate) state_file: Option<std::path::PathBuf>,
    /// With a state the replicas share: how often each replica reads the admin state for
    /// another replica's changes, in milliseconds.
    #[serde(default = "default_admin_sync")]
    pub(crate) admin_sync_ms: u64,
    /// Where the `otel` build exports a span per request (OTLP over HTTP, protobuf):
    /// `http://collector:4318/v1/traces`.
    pub(crate) otlp_endpoint: Option<String>,
    /// Whether the gateway records metrics (`/metrics`, the crate's `llm_*` series); on by
    /// default.
    #[serde(default = "default_true")]
    pub(crate) metrics: bool,
    /// Where spend alerts are `POST`ed as JSON, if anywhere.
    #[serde(default)]
    pub(crate) alert_webhook: Option<String>,
}

fn default_admin_sync() -> u64 {
    1_000
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            admin_token_env: None,
            admin_token: None,
            status_token_env: None,
            status_token: None,
            max_body_bytes: default_max_body(),
            fail_closed: true,
            header_timeout_seconds: default_header_timeout(),
            body_timeout_seconds: default_body_timeout(),
            idle_timeout_seconds: default_idle_timeout(),
            max_connections: None,
            max_header_bytes: default_max_header(),
            lease_refresh_ms: default_lease_refresh(),
            store_timeout_ms: default_store_timeout(),
            audit_log: None,
            state: None,
            state_file: None,
            admin_sync_ms: default_admin_sync(),
            otlp_endpoint: None,
            metrics: true,
            alert_webhook: None,
        }
    }
}

impl ServerConfig {
    /// The connection timeouts, each a positive number of seconds of at most a day.
    pub(crate) fn timeouts(&self) -> Result<[Duration; 3], ConfigError> {
        let seconds = |key: &str, value: f64| {
            if value.is_finite() && value > 0.0 && value <= 86_400.0 {
                Ok(Duration::from_secs_f64(value))
            } else {
                Err(ConfigError(format!(
                    "server.{key} must be a number of seconds above 0 and at most 86400, not {value}"
                )))
            }
        };
        Ok([
            seconds("header_timeout_seconds", self.header_timeout_seconds)?,
            seconds("body_timeout_seconds", self.body_timeout_seconds)?,
            seconds("idle_timeout_seconds", self.idle_timeout_seconds)?,
        ])
    }
}

fn default_header_timeout() -> f64 {
    10.0
}

fn default_body_timeout() -> f64 {
    30.0
}

fn default_idle_timeout() -> f64 {
    60.0
}

/// Leases renewed every 100 ms: a store call per replica and account ten times a second.
fn default_lease_refresh() -> u64 {
    100
}

fn default_store_timeout() -> u64 {
    250
}

fn default_max_header() -> usize {
    32 * 1024
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8080))
}

fn default_max_body() -> usize {
    1 << 20
}

fn default_true() -> bool {
    true
}

/// The APIs the gateway serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/responses`.
    Responses,
    /// `POST /v1/messages`.
    Messages,
    /// `POST /v1/embeddings`: input tokens only.
    Embeddings,
    /// `POST /v1/completions`, OpenAI's legacy completions (a `prompt`).
    Completions,
    /// `POST /v1/messages/count_tokens`, Anthropic's: one request, no tokens.
    CountTokens,
    /// Gemini's `POST /v1beta/models/{model}:generateContent` and `:streamGenerateContent`.
    GenerateContent,
    /// Gemini's `POST /v1beta/models/{model}:embedContent` and `:batchEmbedContents`: input
    /// tokens only.
    EmbedContent,
    /// Gemini's `POST /v1beta/models/{model}:countTokens`: one request, no tokens.
    GeminiCountTokens,
}

impl Api {
    pub(crate) const ALL: [Api; 9] = [
        Api::Chat,
        Api::Responses,
        Api::Messages,
        Api::Embeddings,
        Api::Completions,
        Api::CountTokens,
        Api::GenerateContent,
        Api::EmbedContent,
        Api::GeminiCountTokens,
    ];

    pub(crate) fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
            Api::Embeddings => "/v1/embeddings",
            Api::Completions => "/v1/completions",
            Api::CountTokens => "/v1/messages/count_tokens",
            Api::GenerateContent => "/v1beta/models/{model}:generateContent",
            Api::EmbedContent => "/v1beta/models/{model}:embedContent",
            Api::GeminiCountTokens => "/v1beta/models/{model}:countTokens",
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Responses => "responses",
            Api::Messages => "messages",
            Api::Embeddings => "embeddings",
            Api::Completions => "completions",
            Api::CountTokens => "count_tokens",
            Api::GenerateContent => "generate_content",
            Api::EmbedContent => "embed_content",
            Api::GeminiCountTokens => "gemini_count_tokens",
        }
    }

    /// The wire format of its bodies: which accounts can serve it, and which routes can
    /// take its requests (the gateway translates no format into another).
    pub(crate) fn format(self) -> Format {
        match self {
            Api::Chat | Api::Responses | Api::Embeddings | Api::Completions => Format::OpenAi,
            Api::Messages | Api::CountTokens => Format::Anthropic,
            Api::GenerateContent | Api::EmbedContent | Api::GeminiCountTokens => Format::Gemini,
        }
    }
}

/// A family of wire formats: the APIs of a provider's SDK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// OpenAI's (also Azure's, Groq's and Gemini's OpenAI-compatible endpoint).
    OpenAi,
    /// Anthropic's Messages.
    Anthropic,
    /// Google's native Gemini API.
    Gemini,
}

impl Format {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Format::OpenAi => "OpenAI's",
            Format::Anthropic => "Anthropic's",
            Format::Gemini => "Gemini's native",
        }
    }
}

/// One provider account: where it is, its key, its profile, its quota.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AccountConfig {
    pub(crate) name: String,
    /// `https://host` (or `http://host:port`) of the provider, or `sim` for the in-process
    /// simulator.
    pub(crate) base_url: String,
    /// A PEM bundle of the CAs to trust for an `https://` upstream (a corporate proxy, a
    /// private gateway), instead of the Mozilla roots compiled in; a relative path is from the
    /// working directory.
    pub(crate) ca_file: Option<std::path::PathBuf>,
    /// The environment variable holding the provider key (never logged).
    pub(crate) key_env: Option<String>,
    /// The provider key itself; prefer `key_env`.
    pub(crate) key: Option<String>,
    pub(crate) profile: ProfileName,
    pub(crate) apis: Vec<Api>,
    /// The account's limits. With `scopes` or `model_quota`, what every model of the account
    /// shares (the provider's account-wide request limit and calls in flight), beside each
    /// scope's own limits.
    pub(crate) quota: Limits,
    /// Caps over a calendar day or month (UTC) on the whole account, whatever the tenant or
    /// model: `caps = [{ dimension = "spend", amount = 500000000000, window =
    /// "calendar_month_utc" }]` ($500 a month, in nano-dollars, with `[prices]`). A request
    /// that would take the period above a cap is refused at once, until the period ends.
    #[serde(default)]
    pub(crate) caps: Vec<tower_llm_quota::tenant::PeriodCap>,
    /// Models whose limits the provider pools (Anthropic's model classes) or keeps apart
    /// (OpenAI's per-model limits): each scope has buckets of its own, and a provider 429 for
    /// one of its models pauses that scope only.
    #[serde(default)]
    pub(crate) scopes: Vec<ScopeConfig>,
    /// The limits of each model that no scope names, in buckets of its own (OpenAI's
    /// per-model limits); without it, those models share the account's limits alone.
    pub(crate) model_quota: Option<Limits>,
    /// What each class does when a service tier has no capacity: `retry` later, or
    /// `give_up` (fail fast, or take a `tier_unavailable` fallback). Defaults: interactive
    /// gives up, async and batch retry.
    #[serde(default)]
    pub(crate) tier_unavailable: TierPolicy,
    /// The simulator's latency, when `base_url` is `sim`.
    #[serde(default)]
    pub(crate) sim: SimBehaviour,
}

/// What each class does when a service tier has no capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TierPolicy {
    #[serde(default = "give_up")]
    pub(crate) interactive: TierAction,
    #[serde(default = "retry", rename = "async")]
    pub(crate) async_: TierAction,
    #[serde(default = "retry")]
    pub(crate) batch: TierAction,
}

impl Default for TierPolicy {
    fn default() -> Self {
        Self {
            interactive: give_up(),
            async_: retry(),
            batch: retry(),
        }
    }
}

impl TierPolicy {
    /// The retry policy saying so.
    pub(crate) fn retry_policy(self) -> tower_llm_quota::RetryPolicy {
        use tower_llm_quota::retry::TierUnavailable;
        let action = |a: TierAction| match a {
            TierAction::Retry => TierUnavailable::Retry,
            TierAction::GiveUp => TierUnavailable::GiveUp,
        };
        tower_llm_quota::RetryPolicy::new()
            .on_tier_unavailable(Priority::Interactive, action(self.interactive))
            .on_tier_unavailable(Priority::Async, action(self.async_))
            .on_tier_unavailable(Priority::Batch, action(self.batch))
    }
}

/// Retry a tier without capacity later, or give up at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum TierAction {
    Retry,
    GiveUp,
}

fn give_up() -> TierAction {
    TierAction::GiveUp
}

fn retry() -> TierAction {
    TierAction::Retry
}

/// Models that share one set of buckets on an account.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ScopeConfig {
    /// The scope's name, in refusals and on the status page.
    pub(crate) name: String,
    /// The upstream model names it pools: exact, or a prefix ending in `*`
    /// (`"claude-opus-4*"`).
    pub(crate) models: Vec<String>,
    /// Its limits.
    pub(crate) quota: Limits,
}

impl ScopeConfig {
    /// Whether the scope pools `model` (its upstream name).
    pub(crate) fn pools(&self, model: &str) -> bool {
        self.models
            .iter()
            .any(|pattern| match pattern.strip_suffix('*') {
                Some(prefix) => model.starts_with(prefix),
                None => model == pattern,
            })
    }
}

impl AccountConfig {
    /// Whether the account's limits are scoped by model.
    pub(crate) fn is_scoped(&self) -> bool {
        !self.scopes.is_empty() || self.model_quota.is_some()
    }

    /// Scopes have names and models; a scoped account's own quota limits requests and calls
    /// in flight only (its token limits belong to a scope: the provider counts them there).
    fn check_scopes(&self) -> Result<(), ConfigError> {
        let error = |message: String| ConfigError(format!("account `{}`: {message}", self.name));
        let mut names = BTreeSet::new();
        for scope in &self.scopes {
            if !valid_scope_name(&scope.name) {
                return Err(error(format!(
                    "scope name `{}` must be 1 to 64 of letters, digits, `.`, `-`, `_`, `:`",
                    scope.name
                )));
            }
            if !names.insert(scope.name.as_str()) {
                return Err(error(format!("scope `{}` is configured twice", scope.name)));
            }
            if scope.models.is_empty() || scope.models.iter().any(|m| m.is_empty() || m == "*") {
                return Err(error(format!(
                    "scope `{}` must name models (exact, or a prefix ending in `*`)",
                    scope.name
                )));
            }
            scope.quota.limits()?;
        }
        if let Some(quota) = &self.model_quota {
            quota.limits()?;
        }
        let quota = &self.quota;
        let tokens = [
            quota.tokens_per_minute,
            quota.input_tokens_per_minute,
            quota.output_tokens_per_minute,
            quota.tokens_per_day,
        ];
        if self.is_scoped() && tokens.iter().any(Option::is_some) {
            return Err(error(
                "with scopes, the account's quota limits requests and calls in flight only: \
                 give token limits to the scopes (or model_quota)"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// A scope's name, also a model's name kept in a scope of its own: safe in store keys and
/// metric labels.
pub(crate) fn valid_scope_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':'))
}

/// How the in-process simulator answers: how fast, and how often it fails.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SimBehaviour {
    /// Before the first token.
    #[serde(default)]
    pub(crate) base_ms: u64,
    /// For each output token.
    #[serde(default)]
    pub(crate) per_token_ms: u64,
    /// The share of calls answered 500 (0 to 1), to try fallbacks.
    #[serde(default)]
    pub(crate) server_error_share: f64,
    /// The `max_tokens` of an OpenAI request that sets none (default 1,024).
    #[serde(default = "sim_default_max_tokens")]
    pub(crate) default_max_tokens: u64,
    /// The model's largest `max_tokens` (default 128,000).
    #[serde(default = "sim_max_output_tokens")]
    pub(crate) max_output_tokens: u64,
}

impl Default for SimBehaviour {
    fn default() -> Self {
        Self {
            base_ms: 0,
            per_token_ms: 0,
            server_error_share: 0.0,
            default_max_tokens: sim_default_max_tokens(),
            max_output_tokens: sim_max_output_tokens(),
        }
    }
}

fn sim_default_max_tokens() -> u64 {
    1_024
}

fn sim_max_output_tokens() -> u64 {
    128_000
}

/// The provider profiles a configuration may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ProfileName {
    Openai,
    Anthropic,
    AzureOpenai,
    Groq,
    /// Google's native Gemini API (`x-goog-api-key`, `usageMetadata`, no rate-limit headers).
    Gemini,
    /// Gemini's OpenAI-compatible endpoint (`/v1beta/openai/...`, OpenAI's bodies).
    GeminiOpenai,
}

impl ProfileName {
    /// The wire formats an account of this profile speaks.
    pub(crate) fn format(self) -> Format {
        match self {
            ProfileName::Anthropic => Format::Anthropic,
            ProfileName::Gemini => Format::Gemini,
            ProfileName::Openai
            | ProfileName::AzureOpenai
            | ProfileName::Groq
            | ProfileName::GeminiOpenai => Format::OpenAi,
        }
    }
}

/// Limits per window, as in a provider's dashboard; all optional.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Limits {
    pub(crate) requests_per_minute: Option<NonZeroU64>,
    pub(crate) tokens_per_minute: Option<NonZeroU64>,
    pub(crate) input_tokens_per_minute: Option<NonZeroU64>,
    pub(crate) output_tokens_per_minute: Option<NonZeroU64>,
    pub(crate) tokens_per_day: Option<NonZeroU64>,
    /// Requests a day (Gemini's RPD, Groq's).
    pub(crate) requests_per_day: Option<NonZeroU64>,
    pub(crate) max_in_flight: Option<std::num::NonZeroUsize>,
    /// The length of a "minute" in milliseconds (60 000; shorter against a fast simulator).
    pub(crate) minute_ms: Option<NonZeroU64>,
}

impl Limits {
    /// The window the per-minute limits count over.
    pub(crate) fn minute(&self) -> Duration {
        self.minute_ms.map_or(Duration::from_secs(60), |ms| {
            Duration::from_millis(ms.get())
        })
    }

    /// The crate's limits for these figures.
    pub(crate) fn limits(&self) -> Result<Vec<Limit>, ConfigError> {
        let minute = self.minute();
        let day = Duration::from_secs(86_400);
        [
            (Dimension::Requests, self.requests_per_minute, minute),
            (Dimension::TotalTokens, self.tokens_per_minute, minute),
            (Dimension::InputTokens, self.input_tokens_per_minute, minute),
            (
                Dimension::OutputTokens,
                self.output_tokens_per_minute,
                minute,
            ),
            (Dimension::TotalTokens, self.tokens_per_day, day),
            (Dimension::Requests, self.requests_per_day, day),
        ]
        .into_iter()
        .filter_map(|(dimension, amount, period)| Some((dimension, amount?, period)))
        .map(|(dimension, amount, period)| {
            Limit::new(dimension, amount, period).map_err(|e| ConfigError(e.to_string()))
        })
        .collect()
    }

    /// The crate's quota for these figures.
    pub(crate) fn quota(&self) -> Result<Quota, ConfigError> {
        let quota = self
            .limits()?
            .into_iter()
            .fold(Quota::new(), Quota::with_limit);
        Ok(match self.max_in_flight {
            Some(max) => quota.with_max_in_flight(max),
            None => quota,
        })
    }
}

/// A named admin token: an operator's (no `tenant`), or a delegated admin's, who reads and
/// changes only the subtree of `tenant` (a partner reselling quota, a team lead).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AdminConfig {
    /// Its name in the audit log.
    pub(crate) name: String,
    /// The environment variable holding the token.
    pub(crate) token_env: Option<String>,
    /// The token itself (the demo's); prefer `token_env`.
    pub(crate) token: Option<String>,
    /// The subtree it administers; the whole gateway when absent.
    pub(crate) tenant: Option<String>,
}

/// The classes a key may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Class {
    Interactive,
    Async,
    Batch,
}

impl From<Class> for Priority {
    fn from(class: Class) -> Self {
        match class {
            Class::Interactive => Priority::Interactive,
            Class::Async => Priority::Async,
            Class::Batch => Priority::Batch,
        }
    }
}

/// One caller API key: which tenant it spends, in which class.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct KeyConfig {
    /// A name for logs, metrics and the admin API (the key itself is never shown).
    pub(crate) name: String,
    /// The environment variable holding the key.
    pub(crate) key_env: Option<String>,
    /// The key itself (the demo's); prefer `key_env`.
    pub(crate) key: Option<String>,
    pub(crate) tenant: String,
    #[serde(default = "default_class")]
    pub(crate) default_class: Class,
    /// Whether `x-priority` may choose another class.
    #[serde(default)]
    pub(crate) allow_priority_header: bool,
    /// The models (of `[[models]]`) the key may use; all of them when absent.
    pub(crate) models: Option<Vec<String>>,
    /// Who retries the provider for this key's requests.
    #[serde(default)]
    pub(crate) retries: Retries,
}

/// Who retries a provider's failures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Retries {
    /// The gateway, within the class's policy; its final answer says `x-should-retry: false`
    /// so that the caller's SDK does not retry it again (the default).
    #[default]
    Gateway,
    /// The caller: one attempt, the provider's answer handed back (with `Retry-After`), and the
    /// SDK's own retries paced by the gateway's budget.
    Client,
}

fn default_class() -> Class {
    Class::Async
}

/// A secret the configuration gives inline (`token`, `key`) or names the environment variable
/// of (`*_env`), read now: the variable's when both are given (the configuration checks that
/// keys and admins give one), `None` when neither. `what` names it in the error.
pub(crate) fn secret(
    inline: Option<&String>,
    var: Option<&String>,
    what: &str,
) -> Result<Option<String>, ConfigError> {
    match (inline, var) {
        (_, Some(var)) => std::env::var(var)
            .map(Some)
            .map_err(|_| ConfigError(format!("{what}: the variable {var} is not set"))),
        (inline, None) => Ok(inline.cloned()),
    }
}

/// Why a configuration cannot run (or a state cannot be reached): every problem found, one
/// per line, each with where it is.
#[derive(Debug)]
pub struct ConfigError(pub(crate) String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Whether any cap over a period is configured: an account's, or a tenant node's or
    /// template's.
    pub(crate) fn has_caps(&self) -> bool {
        self.accounts.iter().any(|a| !a.caps.is_empty()) || self.tree_caps().next().is_some()
    }

    /// The cap entries of the tenant tree's nodes and templates, as written.
    pub(crate) fn tree_caps(&self) -> impl Iterator<Item = &toml::Value> {
        ["nodes", "templates"]
            .into_iter()
            .filter_map(|section| self.tenants.get(section).and_then(toml::Value::as_table))
            .flat_map(|nodes| nodes.values())
            .filter_map(toml::Value::as_table)
            .flat_map(|node| {
                ["caps", "daily", "calendar_utc"]
                    .into_iter()
                    .filter_map(|key| node.get(key).and_then(toml::Value::as_array))
                    .flatten()
            })
    }

    /// The tenant tree, and the paths the status page lists: every configured node, every
    /// key's tenant, and their ancestors.
    pub(crate) fn tenant_tree(&self) -> Result<(TenantTree, Vec<Tenant>), ConfigError> {
        let error = |e: &dyn std::fmt::Display| ConfigError(format!("tenants: {e}"));
        let tree = TenantTree::deserialize(toml::Value::Table(refusing_at_once(&self.tenants)))
            .map_err(|e| error(&e))?;
        let mut paths = BTreeSet::new();
        let configured = self.tenants.get("nodes").and_then(toml::Value::as_table);
        let named = configured.into_iter().flat_map(|nodes| nodes.keys());
        for path in named.chain(self.keys.iter().map(|k| &k.tenant)) {
            let mut tenant = Some(Tenant::parse(path).map_err(|e| error(&e))?);
            while let Some(node) = tenant {
                tenant = node.parent();
                paths.insert(node);
            }
        }
        Ok((tree, paths.into_iter().collect()))
    }

    /// Where the gateway listens (`[server] listen`).
    pub fn listen(&self) -> std::net::SocketAddr {
        self.server.listen
    }

    /// Where the configuration says the state lives (`[server] state`), if it says.
    pub fn state(&self) -> Option<&str> {
        self.server.state.as_deref()
    }

    /// The callers' keys given in the file itself (the demo's), each with its tenant and
    /// default class: what a newcomer tries first.
    pub fn inline_keys(&self) -> impl Iterator<Item = (&str, &str, Priority)> {
        (self.keys.iter())
            .filter_map(|k| Some((k.key.as_deref()?, k.tenant.as_str(), k.default_class.into())))
    }

    /// The admin token given in the file itself (the demo's), if any.
    pub fn inline_admin_token(&self) -> Option<&str> {
        self.server.admin_token.as_deref()
    }

    /// What `--check-config` says of a valid configuration: its accounts, keys and tenant
    /// nodes.
    pub fn summary(&self) -> String {
        let nodes = self
            .tenants
            .get("nodes")
            .and_then(toml::Value::as_table)
            .map_or(0, toml::map::Map::len);
        let accounts: Vec<&str> = self.accounts.iter().map(|a| a.name.as_str()).collect();
        format!(
            "configuration OK: {} account(s) ({}), {} key(s), {nodes} tenant node(s)",
            accounts.len(),
            accounts.join(", "),
            self.keys.len()
        )
    }
}

/// The `[tenants]` table with `max_wait_seconds = 0` on every node and template that sets no
/// wait: a node refuses at once what it cannot pay now (with when it could), as a gateway's
/// caller expects of "20 a minute"; a node may still let its requests wait by setting one.
fn refusing_at_once(tenants: &toml::Table) -> toml::Table {
    let mut tenants = tenants.clone();
    for section in ["nodes", "templates"] {
        let Some(toml::Value::Table(nodes)) = tenants.get_mut(section) else {
            continue;
        };
        for (_, node) in nodes.iter_mut() {
            if let toml::Value::Table(node) = node {
                node.entry("max_wait_seconds")
                    .or_insert(toml::Value::Integer(0));
            }
        }
    }
    tenants
}

/// One `[[spend_alerts]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AlertConfig {
    /// The node whose spend is watched: a tenant's path, or a key's (`team/key-name`).
    pub(crate) tenant: Option<String>,
    /// Or the account whose spend is watched, every tenant's answers on it.
    pub(crate) account: Option<String>,
    /// The amount the thresholds are shares of, in nano-dollars (`amount`), or written in
    /// dollars (`amount_usd = "500.00"`).
    #[serde(default)]
    pub(crate) amount: u64,
    #[serde(default, deserialize_with = "usd_as_nanos")]
    pub(crate) amount_usd: Option<u64>,
    /// `calendar_day_utc` or `calendar_month_utc`.
    pub(crate) window: AlertWindow,
    /// Percentages of `amount`, each raised once per period.
    #[serde(default = "default_thresholds")]
    pub(crate) thresholds: Vec<u32>,
}

/// Dollars written as a decimal string, read as nano-dollars.
fn usd_as_nanos<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    let text = String::deserialize(deserializer)?;
    tower_llm_quota::pricing::Usd::parse(&text)
        .map(|usd| Some(usd.nanos()))
        .map_err(serde::de::Error::custom)
}

impl AlertConfig {
    /// The amount in nano-dollars, as `amount` or `amount_usd` gives it.
    pub(crate) fn nanos(&self) -> u64 {
        self.amount_usd.unwrap_or(self.amount)
    }
}

fn default_thresholds() -> Vec<u32> {
    vec![50, 80, 100]
}

/// The period an alert counts over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum AlertWindow {
    CalendarDayUtc,
    CalendarMonthUtc,
}

impl AlertWindow {
    pub(crate) fn cap_window(self) -> CapWindow {
        match self {
            Self::CalendarDayUtc => CapWindow::CalendarDayUtc,
            Self::CalendarMonthUtc => CapWindow::CalendarMonthUtc,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::CalendarDayUtc => "calendar_day_utc",
            Self::CalendarMonthUtc => "calendar_month_utc",
        }
    }
}
