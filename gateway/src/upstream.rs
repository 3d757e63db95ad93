//! The provider accounts: one governed stack ([`QuotaStack`]) per API an account serves, over
//! one budget per account, in front of the simulator or an HTTP(S) upstream.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, Uri, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt};
use tower_llm_quota::budget::FailurePolicy;
use tower_llm_quota::pricing::PriceTable;
use tower_llm_quota::provider::Profile;
use tower_llm_quota::queue::QueueHandle;
use tower_llm_quota::stack::{QuotaService, QuotaStack};
use tower_llm_quota::tenant::{TenantHandle, TenantTree};
use tower_llm_quota::{BoxError, Budget, Quota};
use tower_llm_quota_postgres::PostgresBudget;
use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_sim::{Faults, SimConfig, Simulator};

use super::config::{AccountConfig, Api, ConfigError, Format, ProfileName, ScopeConfig};
use super::gemini::Native;
use super::store::Persistence;
use super::store::caps::CapsRecord;

/// Where an account's budgets are kept, and what holds while the state cannot be written.
#[derive(Debug, Clone)]
pub(crate) struct Keeping {
    /// In memory (one gateway), or in the replicas' store (Redis or Postgres).
    pub(crate) persistence: Persistence,
    /// Refuse while the store cannot answer (else admit from `1 / n` of the quota, `n` the
    /// live replicas the store last counted).
    pub(crate) fail_closed: bool,
    /// With a store: admit from leased shares renewed this often (else ask per admission).
    pub(crate) lease: Option<Duration>,
    /// With a store: how long a call to it may take.
    pub(crate) store_timeout: Duration,
    /// One gateway's caps, recorded in its SQLite state: a request they count is sent once
    /// its admission's counts are committed.
    pub(crate) caps: Option<Arc<CapsRecord>>,
}

/// A request the state could not make durable (its caps' counts not committed): refused,
/// nothing sent.
#[derive(Debug)]
pub(crate) struct StateRefused(pub(crate) super::store::DatabaseError);

impl std::fmt::Display for StateRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the gateway's state refused the caps' counts: {}",
            self.0
        )
    }
}

impl std::error::Error for StateRefused {}

/// A provider's response body, boxed.
pub(crate) type UpBody = BoxBody<Bytes, BoxError>;
/// The client under a governed stack.
pub(crate) type Client = BoxCloneSyncService<Request<Full<Bytes>>, Response<UpBody>, BoxError>;
/// A governed stack over a client.
pub(crate) type Governed = QuotaService<Client>;

/// The simulator's own key for the gateway (the gateway's provider key in the demo).
const SIM_KEY: &str = "sim-gateway-key";

/// Set when a request leaves for the provider: until then it is only queued.
#[derive(Debug, Clone, Default)]
pub(crate) struct Dispatched(Arc<AtomicBool>);

impl Dispatched {
    pub(crate) fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

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

/// A set of buckets of an account and a governed stack per API over it.
#[derive(Debug, Clone)]
pub(crate) struct Scoped {
    /// `None` for the account's own.
    name: Option<Arc<str>>,
    budget: Budget,
    stacks: Arc<[(Api, Profile, Governed)]>,
}

impl Scoped {
    /// The scope's name, `None` for the account's own budget.
    pub(crate) fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Its budget.
    pub(crate) fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Where a refusal of this scope of `account` says it applies: `account:NAME`, or
    /// `account:NAME/scope:SCOPE`.
    pub(crate) fn label(&self, account: &str) -> String {
        match &self.name {
            Some(scope) => format!("account:{account}/scope:{scope}"),
            None => format!("account:{account}"),
        }
    }

    pub(crate) fn stack(&self, api: Api) -> Option<Governed> {
        self.stacks
            .iter()
            .find(|(a, ..)| *a == api)
            .map(|(.., governed)| governed.clone())
    }
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

/// A reload's change of one account's figures, checked: see [`Account::plan`].
#[derive(Debug)]
pub(crate) struct Retune {
    account: AccountConfig,
    configured: Vec<tower_llm_quota::Limit>,
}

/// Every limit `config` gives an account and its scopes.
fn configured(config: &AccountConfig) -> Result<Vec<tower_llm_quota::Limit>, ConfigError> {
    Ok(std::iter::once(&config.quota)
        .chain(config.scopes.iter().map(|s| &s.quota))
        .chain(&config.model_quota)
        .map(super::config::Limits::limits)
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .flatten()
        .collect())
}

/// What a new scope of an account is made with.
#[derive(Debug, Clone)]
struct Maker {
    account: AccountConfig,
    /// The budget whose tenant state every scope serves.
    tenants_of: Budget,
    keeping: Keeping,
    /// The client under the stacks: through the gate, with scopes.
    upstream: Upstream,
    prices: Option<Arc<PriceTable>>,
}

impl Maker {
    /// The scope `name`'s budget (named `account/name` in the store) and stacks.
    async fn make(&self, name: &str, quota: &Quota) -> Result<Scoped, ConfigError> {
        let full = format!("{}/{name}", self.account.name);
        let quota = quota.clone().with_name(full.as_str());
        let budget = budget(&full, &quota, &self.keeping).await?;
        let budget = budget.with_tenants_of(&self.tenants_of);
        Ok(Scoped {
            name: Some(name.into()),
            stacks: stacks(
                &self.account,
                &quota,
                (&budget, self.prices.as_ref()),
                &self.upstream,
            ),
            budget,
        })
    }
}

/// A budget of `quota`, in memory or shared through the replicas' store under `name`.
async fn budget(name: &str, quota: &Quota, keeping: &Keeping) -> Result<Budget, ConfigError> {
    let policy = if keeping.fail_closed {
        FailurePolicy::FailClosed
    } else {
        FailurePolicy::live_share(2)
    };
    match &keeping.persistence {
        Persistence::Redis(url) => {
            let mut budget = RedisBudget::new(url, name.to_owned())
                .prefix("gateway")
                .timeout(keeping.store_timeout)
                .failure_policy(policy);
            if let Some(refresh) = keeping.lease {
                budget = budget.leased_shares(refresh);
            }
            budget
                .connect(quota)
                .await
                .map_err(|e| ConfigError(format!("account `{name}`: redis: {e}")))
        }
        Persistence::Postgres(url) => {
            let mut budget = PostgresBudget::new(url, name.to_owned())
                .prefix("gateway")
                .timeout(keeping.store_timeout)
                .failure_policy(policy);
            if let Some(refresh) = keeping.lease {
                budget = budget.leased_shares(refresh);
            }
            budget
                .connect(quota)
                .await
                .map_err(|e| ConfigError(format!("account `{name}`: {e}")))
        }
        Persistence::Memory | Persistence::Sqlite(_) => Ok(Budget::new(quota.clone())),
    }
}

/// `client`, sending a request only once the caps' counts of its admission are committed
/// (`caps`: one gateway's SQLite state); when they cannot be, refused (`fail_closed`) or sent
/// with a warning.
fn durable(client: Client, caps: Option<Arc<CapsRecord>>, fail_closed: bool) -> Client {
    let Some(caps) = caps else {
        return client;
    };
    BoxCloneSyncService::new(tower::service_fn(move |request: Request<Full<Bytes>>| {
        let (client, caps) = (client.clone(), Arc::clone(&caps));
        async move {
            if let Err(error) = caps.durable() {
                if fail_closed {
                    return Err(Box::new(StateRefused(error)) as BoxError);
                }
                tracing::warn!(%error, "sent though the caps' counts are not durable");
            }
            client.oneshot(request).await
        }
    }))
}

/// A governed stack per API of the account over `budget`, pricing requests at `prices`.
fn stacks(
    config: &AccountConfig,
    quota: &Quota,
    (budget, prices): (&Budget, Option<&Arc<PriceTable>>),
    upstream: &Upstream,
) -> Arc<[(Api, Profile, Governed)]> {
    let minute = config.quota.minute();
    config
        .apis
        .iter()
        .map(|&api| {
            let profile = profile(config.profile, api).windows(minute, minute);
            let mut stack = QuotaStack::for_profile(profile, quota.clone())
                .with_budget(budget.clone())
                .retry(config.tier_unavailable.retry_policy());
            if let Some(prices) = prices {
                stack = stack.prices(Arc::clone(prices));
            }
            (api, profile, stack.layer(upstream.client(profile)))
        })
        .collect()
}

/// What an account's stacks call: the client, through the gate of the account-wide budget
/// when the account has scopes.
#[derive(Debug, Clone)]
struct Upstream {
    client: Client,
    gate: Option<Budget>,
}

impl Upstream {
    /// The client under a stack of `profile`: through the gate, if any, a reservation in
    /// the account-wide budget per attempt, its slot held until the answer's body ends and
    /// settled with the answer's usage (read in `profile`'s format: an account's caps of
    /// spend count what was spent). The request's tenant is not asked again (its scope's
    /// budget charged it).
    fn client(&self, profile: Profile) -> Client {
        use tower_llm_quota::{ReconcileLayer, TokenBudgetLayer};
        let Some(budget) = &self.gate else {
            return self.client.clone();
        };
        let gate = tower::ServiceBuilder::new()
            .map_request(|mut request: Request<Full<Bytes>>| {
                request
                    .extensions_mut()
                    .remove::<tower_llm_quota::tenant::Tenant>();
                request
            })
            .layer(TokenBudgetLayer::new(budget.clone()))
            .layer(ReconcileLayer::with_extractor(GateUsage(profile)))
            .service(self.client.clone());
        BoxCloneSyncService::new(
            gate.map_response(|r| r.map(|b| b.map_err(BoxError::from).boxed()))
                .map_err(BoxError::from),
        )
    }
}

/// The gate's reading of an answer's usage: as its profile writes it, without adapting the
/// gate's limits to the answer's rate-limit headers (they are the scope's, which its own
/// stack adapts).
#[derive(Debug, Clone, Copy)]
struct GateUsage(Profile);

impl tower_llm_quota::reconcile::ExtractUsage for GateUsage {
    type Scanner = tower_llm_quota::provider::ProviderScan;

    fn start(&self, head: &http::response::Parts, _budget: &Budget) -> Self::Scanner {
        tower_llm_quota::provider::ProviderScan::of_response(self.0, head)
    }
}

fn profile(name: ProfileName, api: Api) -> Profile {
    match (name, api) {
        (ProfileName::Openai, Api::Responses) => Profile::openai_responses(),
        (ProfileName::Openai, _) => Profile::openai(),
        (ProfileName::Anthropic, _) => Profile::anthropic(),
        (ProfileName::AzureOpenai, _) => Profile::azure_openai(),
        (ProfileName::Groq, _) => Profile::groq(),
        (ProfileName::Gemini, _) => Profile::gemini(),
        // Google sends no rate-limit headers there either: the windows are the
        // configuration's.
        (ProfileName::GeminiOpenai, _) => {
            Profile::openai_compatible(Duration::from_secs(60), Duration::from_secs(60))
        }
    }
}

fn simulator(config: &AccountConfig) -> Simulator {
    let limits = &config.quota;
    let amount = |n: Option<std::num::NonZeroU64>| n.map_or(u64::MAX / 4, |n| n.get());
    let sim = match config.profile {
        ProfileName::Anthropic => SimConfig::anthropic(
            amount(limits.requests_per_minute),
            amount(limits.input_tokens_per_minute),
            amount(limits.output_tokens_per_minute),
        ),
        ProfileName::Gemini => SimConfig::gemini(
            amount(limits.requests_per_minute),
            amount(limits.input_tokens_per_minute.or(limits.tokens_per_minute)),
        ),
        _ => SimConfig::openai(
            amount(limits.requests_per_minute),
            amount(limits.tokens_per_minute),
        ),
    };
    let sim = match limits.requests_per_day {
        Some(day) => sim.limit(
            tower_llm_quota::Dimension::Requests,
            day.get(),
            Duration::from_secs(86_400),
        ),
        None => sim,
    };
    Simulator::new(
        sim.minute(limits.minute())
            .latency(
                Duration::from_millis(config.sim.base_ms),
                Duration::from_millis(config.sim.per_token_ms),
            )
            .faults(Faults::none().server_errors(config.sim.server_error_share))
            .default_max_tokens(config.sim.default_max_tokens)
            .max_output_tokens(config.sim.max_output_tokens)
            .key(SIM_KEY, config.name.clone()),
    )
}

/// The TLS configuration of an `https://` upstream: the Mozilla roots compiled in, or the
/// CAs of `ca_file` instead; the `ring` provider, TLS 1.2 and 1.3.
fn tls_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, String> {
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?;
    let Some(path) = ca_file else {
        use hyper_rustls::ConfigBuilderExt;
        return Ok(builder.with_webpki_roots().with_no_client_auth());
    };
    let shown = path.display();
    let pem = std::fs::read(path).map_err(|e| format!("ca_file {shown}: {e}"))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| format!("ca_file {shown}: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("ca_file {shown}: {e}"))?;
    }
    if roots.is_empty() {
        return Err(format!("ca_file {shown}: no certificate in the file"));
    }
    Ok(builder.with_root_certificates(roots).with_no_client_auth())
}

/// A TLS handshake the upstream failed (a certificate of an unknown CA, another name): the
/// same every time, so no retry is spent on it (a connect error alone reads as transient).
#[derive(Debug)]
struct TlsRefused(String);

impl std::fmt::Display for TlsRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the TLS handshake with the upstream failed: {}", self.0)
    }
}

impl std::error::Error for TlsRefused {}

/// The client's error, a [`TlsRefused`] when a TLS error caused it.
fn client_error(error: hyper_util::client::legacy::Error) -> BoxError {
    // An `io::Error` hides what it wraps from `source`: descend through `get_ref`.
    let mut link: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(e) = link {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Box::new(TlsRefused(tls.to_string()));
        }
        link = match e.downcast_ref::<std::io::Error>() {
            Some(io) => io
                .get_ref()
                .map(|inner| inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    error.into()
}

/// The client an account's stacks call: marks the request dispatched, then sends it, over
/// `tls` for an `https://` upstream.
/// A client for the alert webhook: HTTP or HTTPS (the Mozilla roots).
pub(crate) fn webhook_client() -> Client {
    let tls = tls_config(None).expect("the built-in roots load");
    client(None, tls)
}

fn client(simulator: Option<&Simulator>, tls: rustls::ClientConfig) -> Client {
    let mark = |request: Request<Full<Bytes>>| {
        if let Some(dispatched) = request.extensions().get::<Dispatched>() {
            dispatched.0.store(true, Ordering::Release);
        }
        request
    };
    match simulator {
        Some(simulator) => BoxCloneSyncService::new(
            simulator
                .service()
                .map_request(mark)
                .map_response(|r| r.map(|b| b.map_err(BoxError::from).boxed()))
                .map_err(BoxError::from),
        ),
        None => {
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            connector.enforce_http(false);
            let connector = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls)
                .https_or_http()
                .enable_http1()
                .enable_http2()
                .wrap_connector(connector);
            let http =
                HyperClient::builder(TokioExecutor::new()).build::<_, Full<Bytes>>(connector);
            BoxCloneSyncService::new(
                http.map_request(mark)
                    .map_response(|r| r.map(|b| b.map_err(BoxError::from).boxed()))
                    .map_err(client_error),
            )
        }
    }
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
        let keys = |l: &super::config::Limits| -> Result<Vec<_>, String> {
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
        let apply = |budget: &Budget, limits: &super::config::Limits| -> Result<(), ConfigError> {
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
            super::fit::any_hard(&config.caps),
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

    /// The account-wide budget every scope's requests pass, when the account has scopes.
    pub(crate) fn gate(&self) -> Option<&Budget> {
        self.gate.as_ref()
    }

    /// The upstream request for a caller's body and headers: the gateway's own key, the
    /// provider's headers passed through, the caller's credentials dropped.
    pub(crate) fn request(
        &self,
        api: Api,
        native: Option<&Native>,
        headers: &http::HeaderMap,
        body: Bytes,
    ) -> Request<Full<Bytes>> {
        let mut request = Request::post(api.path())
            .body(Full::new(body))
            .expect("a valid request");
        if let Some(native) = native {
            request.extensions_mut().insert(native.clone());
        }
        let out = request.headers_mut();
        out.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        for name in [
            "anthropic-version",
            "anthropic-beta",
            "openai-organization",
            "openai-project",
            "accept",
            "idempotency-key",
        ] {
            if let Some(value) = headers.get(name) {
                out.insert(name, value.clone());
            }
        }
        self.retarget(api, None, &mut request);
        request
    }

    /// Points `request` at this account: its URL for `api` (for a native Gemini call, its
    /// method of `model`, the route's name for it, else the caller's), its key (and only its
    /// key).
    pub(crate) fn retarget(
        &self,
        api: Api,
        model: Option<&str>,
        request: &mut Request<Full<Bytes>>,
    ) {
        // Borrowed for the OpenAI and Anthropic APIs: no allocation of their own per request.
        let path: std::borrow::Cow<'_, str> =
            match (request.extensions().get::<Native>(), self.root) {
                (Some(native), _) => native.upstream_path(model.unwrap_or(&native.model)).into(),
                (None, Some(root)) => format!(
                    "{root}{}",
                    api.path().strip_prefix("/v1").unwrap_or(api.path())
                )
                .into(),
                (None, None) => api.path().into(),
            };
        let uri = format!(
            "{}://{}{}{path}",
            self.base.scheme_str().unwrap_or("http"),
            self.base.authority().map_or("localhost", |a| a.as_str()),
            self.base.path().trim_end_matches('/'),
        );
        *request.uri_mut() = uri.parse().expect("a valid upstream URL");
        let out = request.headers_mut();
        for name in [
            "authorization",
            "x-api-key",
            "api-key",
            super::gemini::KEY_HEADER,
        ] {
            out.remove(name);
        }
        if self.profile == Profile::anthropic() && !out.contains_key("anthropic-version") {
            out.insert("anthropic-version", HeaderValue::from_static("2023-06-01"));
        }
        if let Some((name, value)) = &self.key {
            out.insert(name.clone(), value.clone());
        }
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
