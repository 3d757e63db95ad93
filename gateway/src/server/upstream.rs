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
use tower_llm_quota::budget::redis::RedisBudget;
use tower_llm_quota::provider::Profile;
use tower_llm_quota::queue::QueueHandle;
use tower_llm_quota::sim::{Faults, SimConfig, Simulator};
use tower_llm_quota::stack::{QuotaService, QuotaStack};
use tower_llm_quota::tenant::{TenantHandle, TenantTree};
use tower_llm_quota::{BoxError, Budget};

use super::config::{AccountConfig, Api, ConfigError, ProfileName};

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

/// One account: its budget, and a stack per API.
#[derive(Debug, Clone)]
pub(crate) struct Account {
    pub(crate) name: String,
    pub(crate) profile: Profile,
    budget: Budget,
    queue: QueueHandle,
    stacks: Vec<(Api, Profile, Governed)>,
    base: Uri,
    /// The provider key's header: `authorization: Bearer`, Anthropic's `x-api-key`, Azure's
    /// `api-key`.
    key: Option<(http::HeaderName, HeaderValue)>,
    /// The in-process simulator, when the account has no real upstream.
    pub(crate) simulator: Option<Simulator>,
}

fn profile(name: ProfileName, api: Api) -> Profile {
    match (name, api) {
        (ProfileName::Openai, Api::Responses) => Profile::openai_responses(),
        (ProfileName::Openai, _) => Profile::openai(),
        (ProfileName::Anthropic, _) => Profile::anthropic(),
        (ProfileName::AzureOpenai, _) => Profile::azure_openai(),
        (ProfileName::Groq, _) => Profile::groq(),
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
        _ => SimConfig::openai(
            amount(limits.requests_per_minute),
            amount(limits.tokens_per_minute),
        ),
    };
    Simulator::new(
        sim.minute(limits.minute())
            .latency(
                Duration::from_millis(config.sim.base_ms),
                Duration::from_millis(config.sim.per_token_ms),
            )
            .faults(Faults::none().server_errors(config.sim.server_error_share))
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
    /// of the account built `before` it: a tenant's limits, calls in flight, daily caps and
    /// pauses hold over every account it uses. With `redis_url` the account's quota and
    /// every node's limits are also kept in Redis for the other replicas (failing closed or
    /// not, and admitting from a share leased every `lease` rather than asking per
    /// admission); daily caps and caps on calls in flight stay in each replica.
    pub(crate) async fn new(
        config: &AccountConfig,
        (tree, before): (&TenantTree, Option<&Budget>),
        (redis_url, fail_closed, lease): (Option<&str>, bool, Option<Duration>),
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
        // Named after the account: its depth gauges are its own.
        let quota = config.quota.quota()?.with_name(config.name.as_str());
        let minute = config.quota.minute();
        let budget = match redis_url {
            None => Budget::new(quota.clone()),
            Some(url) => {
                let policy = if fail_closed {
                    FailurePolicy::FailClosed
                } else {
                    FailurePolicy::local_share_of(2)
                };
                let mut budget = RedisBudget::new(url, config.name.clone())
                    .prefix("gateway")
                    .failure_policy(policy);
                if let Some(refresh) = lease {
                    budget = budget.leased_shares(refresh);
                }
                budget
                    .connect(&quota)
                    .await
                    .map_err(|e| error(format!("redis: {e}")))?
            }
        };
        let budget = match before {
            Some(before) => budget.with_tenants_of(before),
            None => budget
                .with_tenant_tree(tree.clone())
                .map_err(|e| error(e.to_string()))?,
        };
        let client = client(simulator.as_ref(), tls);
        let mut stack_for = None;
        let stacks = config
            .apis
            .iter()
            .map(|&api| {
                let profile = profile(config.profile, api).windows(minute, minute);
                let stack =
                    QuotaStack::for_profile(profile, quota.clone()).with_budget(budget.clone());
                let governed = stack.layer(client.clone());
                stack_for.get_or_insert(stack);
                (api, profile, governed)
            })
            .collect::<Vec<_>>();
        let queue = stack_for.as_ref().map_or_else(
            || {
                QuotaStack::openai(quota.clone())
                    .with_budget(budget.clone())
                    .queue_handle()
            },
            QuotaStack::queue_handle,
        );
        let key = key
            .map(|key| {
                let (name, value) = match config.profile {
                    ProfileName::Anthropic => ("x-api-key", key),
                    ProfileName::AzureOpenai => ("api-key", key),
                    ProfileName::Openai | ProfileName::Groq => {
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
            budget,
            queue,
            stacks,
            base,
            key,
            simulator,
        })
    }

    /// The profile serving `api`, if this account serves it (the stack is not cloned).
    pub(crate) fn profile_of(&self, api: Api) -> Option<Profile> {
        self.stacks
            .iter()
            .find(|(a, ..)| *a == api)
            .map(|(_, profile, _)| *profile)
    }

    /// The stack and the profile serving `api`, if this account serves it.
    pub(crate) fn stack(&self, api: Api) -> Option<(Profile, Governed)> {
        self.stacks
            .iter()
            .find(|(a, ..)| *a == api)
            .map(|(_, profile, governed)| (*profile, governed.clone()))
    }

    /// The upstream request for a caller's body and headers: the gateway's own key, the
    /// provider's headers passed through, the caller's credentials dropped.
    pub(crate) fn request(
        &self,
        api: Api,
        headers: &http::HeaderMap,
        body: Bytes,
    ) -> Request<Full<Bytes>> {
        let mut request = Request::post(api.path())
            .body(Full::new(body))
            .expect("a valid request");
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
        self.retarget(api, &mut request);
        request
    }

    /// Points `request` at this account: its URL for `api`, its key (and only its key).
    pub(crate) fn retarget(&self, api: Api, request: &mut Request<Full<Bytes>>) {
        let uri = format!(
            "{}://{}{}{}",
            self.base.scheme_str().unwrap_or("http"),
            self.base.authority().map_or("localhost", |a| a.as_str()),
            self.base.path().trim_end_matches('/'),
            api.path()
        );
        *request.uri_mut() = uri.parse().expect("a valid upstream URL");
        let out = request.headers_mut();
        for name in ["authorization", "x-api-key", "api-key"] {
            out.remove(name);
        }
        if self.profile == Profile::anthropic() && !out.contains_key("anthropic-version") {
            out.insert("anthropic-version", HeaderValue::from_static("2023-06-01"));
        }
        if let Some((name, value)) = &self.key {
            out.insert(name.clone(), value.clone());
        }
    }

    /// The account's shared budget.
    pub(crate) fn budget(&self) -> &Budget {
        &self.budget
    }

    /// The account's copy of the tenant tree.
    pub(crate) fn tenants(&self) -> Option<TenantHandle> {
        self.budget.tenants()
    }

    /// Requests waiting for this account, by class.
    pub(crate) fn queue(&self) -> &QueueHandle {
        &self.queue
    }
}
