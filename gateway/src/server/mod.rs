//! The gateway: state, routes and the server loop. `main.rs` parses the command line and
//! calls [`Gateway::new`] and [`serve`]; the tests call the same two.

pub(crate) mod admin;
pub(crate) mod audit;
pub(crate) mod auth;
pub(crate) mod config;
pub(crate) mod forward;
pub(crate) mod metered;
pub(crate) mod models;
pub(crate) mod refusal;
pub(crate) mod routes;
pub(crate) mod serve;
pub(crate) mod status;
pub(crate) mod tenancy;
pub(crate) mod upstream;
pub(crate) mod usage;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

use auth::KeyRing;
use config::{Api, Config, ConfigError};
use refusal::Refusal;
use serve::limits::{ConnectionLimits, open_files_limit};
pub(crate) use serve::serve;
use tenancy::Tenancy;
use upstream::Account;
use usage::Ledger;

/// Everything a request handler reads.
#[derive(Debug)]
pub(crate) struct Gateway {
    /// The callers' keys, replaced whole by a reload.
    keys: std::sync::RwLock<Arc<KeyRing>>,
    /// The configuration running, to tell a reload what it changes.
    config: std::sync::Mutex<Config>,
    /// The file the configuration was read from, which a reload reads again.
    pub(crate) config_path: std::sync::OnceLock<std::path::PathBuf>,
    pub(crate) tenants: Tenancy,
    pub(crate) ledger: Arc<Ledger>,
    pub(crate) accounts: Vec<Account>,
    /// The public model names, and the account serving each.
    pub(crate) models: models::Models,
    pub(crate) max_body_bytes: usize,
    /// Timeouts, head size and the cap on connections, resolved at start.
    pub(crate) connection_limits: ConnectionLimits,
    admin_token: String,
    /// Cancelled when the gateway stops: queued requests are answered 503.
    pub(crate) shutdown: CancellationToken,
    metrics: PrometheusHandle,
    /// The audit log: a line per request and per admin change.
    pub(crate) audit: audit::Audit,
    /// The bearer token `/status.json` and `/metrics` require, if any.
    status_token: Option<String>,
}

/// The buckets of the latency histograms, in seconds: from 5 ms (a call answered at once, the
/// gateway's own time) to 15 minutes (batch work waiting for its quota).
const SECONDS_BUCKETS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0,
];

/// The buckets of `llm_estimate_error_ratio` (reserved ÷ used): 1 is an exact estimate.
const RATIO_BUCKETS: [f64; 12] = [
    0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0,
];

/// The process's Prometheus recorder, installed on first use: every histogram rendered as a
/// Prometheus histogram (buckets add up across replicas; summaries do not).
pub(crate) fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            use metrics_exporter_prometheus::Matcher;
            let recorder = PrometheusBuilder::new()
                .set_buckets(&SECONDS_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("llm_estimate_error_ratio".into()),
                        &RATIO_BUCKETS,
                    )
                })
                .expect("non-empty buckets")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder already installed (a test's): this one still renders its own.
            if metrics::set_global_recorder(recorder).is_ok() {
                usage::describe();
            }
            handle
        })
        .clone()
}

impl Gateway {
    /// Builds the gateway of `config`; with `redis_url`, every account's budget is shared
    /// through Redis with the other replicas.
    pub(crate) async fn new(
        config: &Config,
        redis_url: Option<&str>,
    ) -> Result<Arc<Self>, ConfigError> {
        config.check()?;
        let (connection_limits, lowered) =
            ConnectionLimits::new(&config.server, open_files_limit())?;
        if let Some(note) = lowered {
            tracing::warn!("{note}");
        }
        let admin_token = match (&config.server.admin_token, &config.server.admin_token_env) {
            (_, Some(var)) => std::env::var(var)
                .map_err(|_| ConfigError(format!("the admin token variable {var} is not set")))?,
            (Some(token), None) => token.clone(),
            (None, None) => {
                return Err(ConfigError("no admin token: set `admin_token_env`".into()));
            }
        };
        let status_token =
            match (&config.server.status_token, &config.server.status_token_env) {
                (_, Some(var)) => Some(std::env::var(var).map_err(|_| {
                    ConfigError(format!("the status token variable {var} is not set"))
                })?),
                (token, None) => token.clone(),
            };
        let (tree, paths) = config.tenant_tree()?;
        let mut tenants = Tenancy::new(paths);
        let mut accounts = Vec::with_capacity(config.accounts.len());
        for account in &config.accounts {
            // Every account serves one tenant state: a tenant's limits hold over all of them.
            let before = accounts.first().map(Account::budget);
            let lease = Some(config.server.lease_refresh_ms)
                .filter(|&ms| ms > 0)
                .map(Duration::from_millis);
            let shared = (redis_url, config.server.fail_closed, lease);
            let account = Account::new(account, (&tree, before), shared).await?;
            if let Some(handle) = account.tenants() {
                tenants.attach(&account.name, handle);
            }
            accounts.push(account);
        }
        Ok(Arc::new(Self {
            keys: std::sync::RwLock::new(Arc::new(KeyRing::new(&config.keys)?)),
            config: std::sync::Mutex::new(config.clone()),
            config_path: std::sync::OnceLock::new(),
            tenants,
            ledger: Arc::new(Ledger::default()),
            models: models::Models::new(
                &config.models,
                &accounts,
                &routes::idempotency(redis_url)?,
            ),
            accounts,
            max_body_bytes: config.server.max_body_bytes,
            connection_limits,
            admin_token,
            shutdown: CancellationToken::new(),
            metrics: metrics_handle(),
            status_token,
            audit: {
                let target = config.server.audit_log.as_deref().unwrap_or("stdout");
                audit::Audit::open(target)
                    .map_err(|e| ConfigError(format!("server.audit_log {target}: {e}")))?
            },
        }))
    }

    /// The callers' keys now.
    pub(crate) fn keys(&self) -> Arc<KeyRing> {
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Applies the configuration `text` without a restart: the callers' keys (added, rotated,
    /// revoked) and the tenant tree's nodes (limits, weights, guarantees, caps: their levels and
    /// requests in flight kept). What else it changes (accounts, models, the server) needs a
    /// restart: listed in the report, not applied. An invalid configuration changes nothing.
    pub(crate) fn reload(&self, text: &str) -> Result<Reloaded, ConfigError> {
        let new = Config::from_toml(text)?;
        let keys = KeyRing::new(&new.keys)?;
        let (tree, _) = new.tenant_tree()?;
        let mut current = self.config.lock().unwrap_or_else(|e| e.into_inner());
        let differs =
            |a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| format!("{a:?}") != format!("{b:?}");
        let mut restart = Vec::new();
        if differs(&new.accounts, &current.accounts) {
            restart.push("accounts");
        }
        if differs(&new.models, &current.models) {
            restart.push("models");
        }
        if differs(&new.server, &current.server) {
            restart.push("server");
        }
        // The nodes first: a node a new key names must exist before the key is served.
        let nodes = self.tenants.replace_nodes(&tree)?;
        *self.keys.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(keys);
        *current = new;
        Ok(Reloaded {
            keys: current.keys.len(),
            nodes,
            restart,
        })
    }

    /// [`reload`](Self::reload) from the file the gateway was started with.
    pub(crate) fn reload_file(&self) -> Result<Reloaded, ConfigError> {
        let path = self.config_path.get().ok_or_else(|| {
            ConfigError("the gateway runs the built-in demo: send the TOML to reload".into())
        })?;
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
        self.reload(&text)
    }

    /// The account serving `api`.
    pub(crate) fn account(&self, api: Api) -> Option<&Account> {
        self.accounts.iter().find(|a| a.profile_of(api).is_some())
    }

    /// Answers a refusal, recording it for the status page and the metrics.
    pub(crate) fn refuse(&self, tenant: Option<&str>, refusal: Refusal) -> Response {
        self.ledger.refused(tenant, &refusal);
        refusal.into_response()
    }

    /// [`refuse`](Self::refuse), in the error schema of `dialect`.
    pub(crate) fn refuse_in(
        &self,
        dialect: refusal::Dialect,
        tenant: Option<&str>,
        refusal: Refusal,
    ) -> Response {
        self.refuse(tenant, refusal.dialect(dialect))
    }

    /// Whether a request carries the admin token.
    pub(crate) fn is_admin(&self, headers: &http::HeaderMap) -> bool {
        let presented = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        auth::secret_matches(presented, &self.admin_token)
    }

    /// Every route of the gateway.
    pub(crate) fn router(self: &Arc<Self>) -> Router {
        let api = |api: Api| {
            move |State(gateway): State<Arc<Gateway>>, request: Request| {
                forward::forward(gateway, api, request)
            }
        };
        Router::new()
            .route(Api::Chat.path(), post(api(Api::Chat)))
            .route(Api::Responses.path(), post(api(Api::Responses)))
            .route(Api::Messages.path(), post(api(Api::Messages)))
            .route(Api::Embeddings.path(), post(api(Api::Embeddings)))
            .route(Api::Completions.path(), post(api(Api::Completions)))
            .route(Api::CountTokens.path(), post(api(Api::CountTokens)))
            .route("/v1/models", get(models::list))
            .route("/v1/models/{id}", get(models::retrieve))
            .route("/", get(status::page))
            .route(
                "/status.json",
                get(status::json).route_layer(from_fn_with_state(self.clone(), require_status)),
            )
            .route("/healthz", get(status::healthz))
            .route(
                "/metrics",
                get(metrics).route_layer(from_fn_with_state(self.clone(), require_status)),
            )
            .nest("/admin", admin::routes(self.clone()))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .with_state(self.clone())
    }
}

/// `/status.json` and `/metrics` behind the status token, when one is configured (the status
/// page itself holds no figures: it sends the token it finds after `#token=` in its URL).
async fn require_status(
    State(gateway): State<Arc<Gateway>>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(token) = &gateway.status_token else {
        return next.run(request).await;
    };
    let presented = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if auth::secret_matches(presented, token) {
        next.run(request).await
    } else {
        let body = serde_json::json!({"error": {"type": "authentication",
            "message": "this route needs the status token (Authorization: Bearer)"}});
        (http::StatusCode::UNAUTHORIZED, axum::Json(body)).into_response()
    }
}

/// What a reload applied, and what waits for a restart.
#[derive(Debug, serde::Serialize)]
pub(crate) struct Reloaded {
    /// The callers' keys now served.
    pub(crate) keys: usize,
    /// The tenant nodes whose settings were applied.
    pub(crate) nodes: usize,
    /// The parts of the configuration that changed and need a restart.
    pub(crate) restart: Vec<&'static str>,
}

/// 404 with a JSON body: no such route.
async fn not_found(uri: http::Uri) -> Response {
    Refusal::not_found(uri.path()).into_response()
}

/// 405 with a JSON body: the route exists, not for this method.
async fn method_not_allowed(method: http::Method, uri: http::Uri) -> Response {
    Refusal::method_not_allowed(&method, uri.path()).into_response()
}

async fn metrics(State(gateway): State<Arc<Gateway>>) -> impl IntoResponse {
    status::record_gauges(&gateway);
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        gateway.metrics.render(),
    )
}
