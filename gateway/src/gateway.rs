//! The gateway's state: everything a request handler reads, how it is built from a
//! configuration, reloaded, and changed by the admin state; the handlers are in the modules
//! around it, the routes in `mod.rs`.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

use super::account::{Account, Keeping};
use super::auth::{Admin, AdminRing, KeyRing};
use super::clients;
use super::config::{self, Api, Config, ConfigError};
#[cfg(feature = "otel")]
use super::otel;
use super::refusal::Refusal;
use super::reload::{self, Plan};
use super::serve::limits::{ConnectionLimits, open_files_limit};
use super::store::caps::CapsRecord;
use super::store::{Database, Persistence};
use super::tenancy::Tenancy;
use super::usage::{self, Ledger};
use super::{alerts, audit, fit, models, report, routes, state};

use tower_llm_quota::pricing::PriceTable;
use tower_llm_quota::tenant::{Tenant, TenantTree};

/// A gateway built from a [`Config`]: everything a request handler reads. Built by
/// [`Gateway::new`], served by [`serve`](crate::serve()), changed by [`Gateway::reload`].
#[derive(Debug)]
pub struct Gateway {
    /// The callers' keys, replaced whole by a reload and by the admin API.
    keys: std::sync::RwLock<Arc<KeyRing>>,
    /// The admin tokens, replaced whole by a reload.
    admins: std::sync::RwLock<Arc<AdminRing>>,
    /// The admin API's changes, kept apart from the configuration and applied over it.
    pub(crate) state: state::StateStore,
    /// The admin state as last applied.
    applied: std::sync::Mutex<state::Fields>,
    /// The configuration running, to tell a reload what it changes.
    config: std::sync::Mutex<Config>,
    /// The file the configuration was read from, which a reload reads again.
    pub(crate) config_path: std::sync::OnceLock<std::path::PathBuf>,
    pub(crate) tenants: Tenancy,
    pub(crate) ledger: Arc<Ledger>,
    /// How requests are bounded under hard caps.
    pub(crate) fitting: super::fit::Fitting,
    pub(crate) accounts: Vec<Account>,
    /// The public model names, and the account serving each (replaced whole by a reload).
    models: std::sync::RwLock<Arc<models::Models>>,
    /// The idempotency layer every route shares: a reload's new routes keep its records.
    idempotency: tower_llm_quota::IdempotencyLayer,
    pub(crate) max_body_bytes: usize,
    /// Timeouts, head size and the cap on connections, resolved at start.
    pub(crate) connection_limits: ConnectionLimits,
    /// Cancelled when the gateway stops: queued requests are answered 503.
    pub(crate) shutdown: CancellationToken,
    /// The Prometheus recorder's handle; `None` with `[server] metrics = false` (no recorder
    /// installed: every series is a no-op, and `/metrics` a 404).
    pub(crate) metrics: Option<PrometheusHandle>,
    /// The audit log: a line per request and per admin change.
    pub(crate) audit: audit::Audit,
    /// The counters of `GET /admin/report`.
    pub(crate) report: Arc<report::Report>,
    /// The SQL state, when there is one, and the caps' counts recorded in it: flushed when
    /// the gateway stops.
    database: Option<Database>,
    caps: Option<Arc<CapsRecord>>,
    /// The spend alerts, and their webhook's queue.
    pub(crate) alerts: Arc<alerts::Alerts>,
    /// The exporter of a span per request (`server.otlp_endpoint`).
    #[cfg(feature = "otel")]
    pub(crate) otel: Option<otel::Otel>,
    /// The bearer token `/status.json` and `/metrics` require, if any.
    pub(crate) status_token: Option<String>,
}

/// The buckets of the latency histograms, in seconds: from 5 ms (a call answered at once, the
/// gateway's own time) to 15 minutes (batch work waiting for its quota).
const SECONDS_BUCKETS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0,
];

/// The buckets of `gateway_added_seconds`, the gateway's own time: from 50 µs to a second.
const ADDED_BUCKETS: [f64; 12] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.1, 0.25, 1.0,
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
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("gateway_added_seconds".into()),
                        &ADDED_BUCKETS,
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
    /// Builds the gateway of `config`, its state kept as `persistence` says (in a store the
    /// replicas share, every account's budget is shared through it).
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] when the configuration cannot run (a key variable unset, a CA file
    /// unreadable) or the state cannot be reached.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves nothing behind but the connections it opened, closed with it.
    pub async fn new(config: &Config, persistence: &Persistence) -> Result<Arc<Self>, ConfigError> {
        config.check()?;
        let (connection_limits, admin_token, status_token) = server_settings(config)?;
        let (tree, paths) = config.tenant_tree()?;
        let mut tenants = Tenancy::new(paths);
        let database = Database::open(persistence).await?;
        let state = state::StateStore::open(
            persistence,
            database.as_ref(),
            config.server.state_file.as_deref(),
        )
        .await?;
        if let Some(url) = persistence.redis() {
            redis_keeps_its_data(url, config).await;
        }
        let prices = config.prices.clone().map(Arc::new);
        let idempotency = routes::idempotency(persistence, database.as_ref())?;
        let caps = match &database {
            Some(Database::Sqlite(sqlite)) => Some(Arc::new(CapsRecord::new(Arc::clone(sqlite)))),
            _ => None,
        };
        let keeping = keeping(config, persistence, caps.clone());
        let accounts = accounts(config, (&tree, &keeping), prices.as_ref(), &mut tenants).await?;
        restore_caps(caps.as_ref(), &accounts).await?;
        let alerts = alerts(config, persistence, database.as_ref()).await?;
        flush_in_background(caps.as_ref(), &alerts);
        let models = models::Models::new(&config.models, &accounts, &idempotency);
        let gateway = Arc::new(Self {
            keys: std::sync::RwLock::new(Arc::new(KeyRing::new(&config.keys, &[])?)),
            admins: std::sync::RwLock::new(Arc::new(AdminRing::new(&admin_token, &config.admins)?)),
            state,
            applied: std::sync::Mutex::default(),
            config: std::sync::Mutex::new(config.clone()),
            config_path: std::sync::OnceLock::new(),
            tenants,
            ledger: Arc::new(Ledger::default()),
            fitting: super::fit::Fitting::new(
                &config.output,
                prices,
                fit::tree_has_hard_caps(config),
            ),
            models: std::sync::RwLock::new(Arc::new(models)),
            idempotency,
            accounts,
            max_body_bytes: config.server.max_body_bytes,
            connection_limits,
            shutdown: CancellationToken::new(),
            metrics: config.server.metrics.then(metrics_handle),
            status_token,
            audit: audit_of(config)?,
            report: Arc::new(report::Report::open(persistence, database.as_ref())?),
            database: database.clone(),
            caps: caps.clone(),
            alerts,
            #[cfg(feature = "otel")]
            otel: otel_of(config).await?,
        });
        gateway.start(config).await?;
        Ok(gateway)
    }

    /// Starts what runs beside the requests: the report's flushes, the admin state applied
    /// now and (shared) synced from the other replicas.
    async fn start(self: &Arc<Self>, config: &Config) -> Result<(), ConfigError> {
        tokio::spawn(every(
            Arc::downgrade(self),
            self.report.flush_every(),
            async |gateway: &Gateway| keep_report(gateway).await,
        ));
        // The admin API's changes over the configuration: an unreachable shared store is read
        // again at the next sync; a state that does not apply stops the start.
        match self.state.read_all().await {
            Ok(fields) => self.apply_state(&fields.unwrap_or_default())?,
            Err(error) => tracing::warn!(%error, "the admin state is read again at the next sync"),
        }
        if self.state.is_shared() {
            let period = Duration::from_millis(config.server.admin_sync_ms);
            tokio::spawn(every(
                Arc::downgrade(self),
                period,
                async |gateway: &Gateway| sync_state(gateway).await,
            ));
        }
        Ok(())
    }

    /// Applies the admin state `fields` over the running configuration: node limits and
    /// weights, keys created, rotated or revoked. A field that cannot be read is skipped with
    /// a warning.
    pub(crate) fn apply_state(&self, fields: &state::Fields) -> Result<(), ConfigError> {
        let (parsed, skipped) = state::parse(fields);
        if !skipped.is_empty() {
            tracing::warn!(?skipped, "admin state fields not understood, skipped");
        }
        let config = self.config.lock().unwrap_or_else(|e| e.into_inner());
        let (tree, paths) = config.tenant_tree()?;
        let keys = KeyRing::new(&config.keys, &parsed.keys)?;
        self.tenants.apply(&tree, &parsed.nodes)?;
        self.tenants.set_paths(&paths, &listed(&parsed, &keys));
        *self.keys.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(keys);
        *self.applied.lock().unwrap_or_else(|e| e.into_inner()) = fields.clone();
        Ok(())
    }

    /// Once every request has been answered at a stop: the last settlements sent to the
    /// shared store (the fleet's caps count what the answers used, not their estimates), the
    /// report's last counters added, the spans waiting exported.
    pub(crate) async fn stopped(&self) {
        for account in &self.accounts {
            account.flush().await;
        }
        let accounts = self.accounts.iter().map(|a| a.name.as_str());
        self.report.mark_up(accounts, std::time::SystemTime::now());
        if let Err(error) = self.report.flush().await {
            tracing::warn!(%error, "the report's last counters were not added");
        }
        // The caps' last counts (the requests drained settled them) and whatever else waits.
        self.alerts.flush();
        if let Some(caps) = &self.caps
            && let Err(error) = caps.durable()
        {
            tracing::warn!(%error, "the caps' last counts were not committed");
        }
        if let Some(database) = &self.database
            && let Err(error) = database.flushed().await
        {
            tracing::warn!(%error, "the state's last writes were not committed");
        }
        #[cfg(feature = "otel")]
        if let Some(otel) = &self.otel {
            otel.shutdown().await;
        }
        // The audit lines of the last requests, written before the process ends.
        self.audit.flush();
    }

    /// The admin state as last applied.
    pub(crate) fn applied_state(&self) -> state::Fields {
        self.applied
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The running configuration.
    pub(crate) fn config(&self) -> std::sync::MutexGuard<'_, Config> {
        self.config.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The public models and their routes now.
    pub(crate) fn models(&self) -> Arc<models::Models> {
        self.models
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The callers' keys now.
    pub(crate) fn keys(&self) -> Arc<KeyRing> {
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Applies the configuration `text` without a restart: the callers' keys (added, rotated,
    /// revoked), the admin tokens, the tenant tree's nodes (limits, weights, guarantees, caps),
    /// the accounts' figures (their limits' amounts, calls in flight and caps, each scope's
    /// and each model's: levels, counts and requests in flight kept) and the public models
    /// with their routes. What else it changes (accounts added, removed or moved, which limits
    /// an account has, prices, spend alerts, the server) needs a restart: listed in the report
    /// with why, not applied, and the running configuration keeps it as it was. An invalid
    /// configuration changes nothing.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] listing every problem of `text`; nothing changed then.
    pub fn reload(&self, text: &str) -> Result<Reloaded, ConfigError> {
        let reloaded = self.apply_configuration(text);
        match &reloaded {
            Ok(reloaded) => tracing::warn!(
                keys = reloaded.keys,
                nodes = reloaded.nodes,
                accounts = reloaded.accounts,
                restart = ?reloaded.restart,
                why = ?reloaded.why,
                shadowed = ?(reloaded.shadowed.iter())
                    .map(|o| format!("{}: {} over the file's {}", o.id, o.value, o.file))
                    .collect::<Vec<_>>(),
                "configuration reloaded"
            ),
            Err(error) => tracing::error!(%error, "the configuration was not reloaded"),
        }
        reloaded
    }

    fn apply_configuration(&self, text: &str) -> Result<Reloaded, ConfigError> {
        let new = Config::from_toml(text)?;
        let (parsed, _) = state::parse(&self.applied_state());
        let keys = KeyRing::new(&new.keys, &parsed.keys)?;
        let admins = AdminRing::new(&root_token(&new)?, &new.admins)?;
        let (tree, paths) = new.tenant_tree()?;
        let mut current = self.config.lock().unwrap_or_else(|e| e.into_inner());
        let Plan {
            running,
            restart,
            why,
            retunes,
            models_changed,
        } = reload::plan(&current, &new);
        // The models are routed over the running accounts (their names unchanged).
        let models = models_changed
            .then(|| models::Models::new(&new.models, &self.accounts, &self.idempotency));
        // The nodes first: a node a new key names must exist before the key is served.
        let nodes = self.tenants.apply(&tree, &parsed.nodes)?;
        self.fitting
            .set_tree_hard(super::fit::tree_has_hard_caps(&new));
        self.tenants.set_paths(&paths, &listed(&parsed, &keys));
        *self.keys.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(keys);
        *self.admins.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(admins);
        for (i, retune) in &retunes {
            self.accounts[*i].retune(retune)?;
        }
        if let Some(models) = models {
            *self.models.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(models);
        }
        for reason in &why {
            tracing::warn!(reason = %reason, "a reload left this for a restart");
        }
        let shadowed = super::overrides::list(&running, &parsed);
        *current = running;
        Ok(Reloaded {
            keys: self.keys().list().count(),
            nodes,
            accounts: retunes.len(),
            restart,
            why,
            shadowed,
        })
    }

    /// Names the file [`reload_file`](Self::reload_file) reads (the one the gateway was
    /// started with); the first call wins.
    pub fn reloads_from(&self, path: std::path::PathBuf) {
        let _ = self.config_path.set(path);
    }

    /// The file [`reload_file`](Self::reload_file) reads, if one was named.
    pub fn config_file(&self) -> Option<&std::path::Path> {
        self.config_path.get().map(std::path::PathBuf::as_path)
    }

    /// [`reload`](Self::reload) from the file the gateway was started with.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] when the gateway was not started from a file, the file cannot be
    /// read, or [`reload`](Self::reload) refuses it.
    pub fn reload_file(&self) -> Result<Reloaded, ConfigError> {
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
        dialect: super::refusal::Dialect,
        tenant: Option<&str>,
        refusal: Refusal,
    ) -> Response {
        self.refuse(tenant, refusal.dialect(dialect))
    }

    /// The admin whose token a request carries.
    pub(crate) fn admin(&self, headers: &http::HeaderMap) -> Option<Admin> {
        self.admins
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .authenticate(headers)
            .cloned()
    }
}

/// Runs `tick` every `every` until the gateway stops or is dropped (the task holds it weakly).
async fn every(
    gateway: std::sync::Weak<Gateway>,
    every: Duration,
    mut tick: impl AsyncFnMut(&Gateway),
) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(gateway) = gateway.upgrade() else {
            return;
        };
        if gateway.shutdown.is_cancelled() {
            return;
        }
        tick(&gateway).await;
    }
}

/// Marks the accounts served and, kept in the state, adds the report's counters there (each
/// [`report::Report::flush_every`]; [`Gateway::stopped`] adds the last).
async fn keep_report(gateway: &Gateway) {
    let accounts = gateway.accounts.iter().map(|a| a.name.as_str());
    gateway
        .report
        .mark_up(accounts, std::time::SystemTime::now());
    if let Err(error) = gateway.report.flush().await {
        tracing::warn!(%error, "the report's counters wait for the next flush");
    }
}

/// Says whether the Redis at `url` keeps its data (an append-only file, or snapshots), when
/// `config` has caps over a period or spend alerts: a Redis that keeps nothing forgets their
/// counts when it restarts (the caps then start from nothing: a month's spend cap spent
/// again).
async fn redis_keeps_its_data(url: &str, config: &Config) {
    if !config.has_caps() && config.spend_alerts.is_empty() {
        return;
    }
    let asked = async {
        let client = redis::Client::open(url).ok()?;
        let mut connection = client.get_multiplexed_async_connection().await.ok()?;
        let aof: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("appendonly")
            .query_async(&mut connection)
            .await
            .ok()?;
        let save: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("save")
            .query_async(&mut connection)
            .await
            .ok()?;
        Some((
            aof.get(1).is_some_and(|v| v == "yes"),
            save.get(1).is_some_and(|v| !v.trim().is_empty()),
        ))
    };
    match tokio::time::timeout(Duration::from_secs(2), asked).await {
        Ok(Some((true, _))) => tracing::info!("Redis keeps its data in an append-only file"),
        Ok(Some((false, true))) => tracing::warn!(
            "Redis keeps its data in snapshots only: a restart of Redis loses the caps' \
             counts since the last snapshot; set `appendonly yes` (appendfsync always), or keep \
             the state in Postgres"
        ),
        Ok(Some((false, false))) => tracing::warn!(
            "Redis keeps nothing on disk: a restart of Redis forgets the caps' counts, the \
             alerts raised and the report (a month's spend cap spent again); set `appendonly \
             yes`, or keep the state in Postgres (--state postgres://...)"
        ),
        _ => tracing::warn!(
            "cannot tell whether Redis keeps its data (CONFIG GET refused): the caps' counts \
             last only as long as Redis does"
        ),
    }
}

/// The operator's admin token of `config` (`server.admin_token_env`, else `admin_token`).
fn root_token(config: &Config) -> Result<String, ConfigError> {
    let server = &config.server;
    config::secret(
        server.admin_token.as_ref(),
        server.admin_token_env.as_ref(),
        "the admin token",
    )?
    .ok_or_else(|| ConfigError("no admin token: set `admin_token_env`".into()))
}

/// The nodes the admin state adds to the views: those it changed, and its keys' tenants.
fn listed(parsed: &state::Parsed, keys: &KeyRing) -> Vec<Tenant> {
    let tenants = keys.list().filter_map(|(caller, ..)| caller.path.parent());
    parsed.nodes.keys().cloned().chain(tenants).collect()
}

/// Reads the admin state and applies another replica's changes.
async fn sync_state(gateway: &Gateway) {
    match gateway.state.read_all().await {
        Ok(Some(fields)) => {
            if let Err(error) = gateway.apply_state(&fields) {
                tracing::error!(%error, "the admin state read from the store does not apply");
            }
        }
        Ok(None) => {}
        Err(error) => tracing::warn!(%error, "the admin state was not read"),
    }
}

/// What a reload applied, and what waits for a restart (its JSON is the admin API's answer).
#[derive(Debug, serde::Serialize)]
pub struct Reloaded {
    /// The callers' keys now served.
    pub(crate) keys: usize,
    /// The tenant nodes whose settings were applied.
    pub(crate) nodes: usize,
    /// The accounts whose figures (limits, calls in flight, caps) were applied.
    pub(crate) accounts: usize,
    /// The parts of the configuration that changed and need a restart.
    pub(crate) restart: Vec<&'static str>,
    /// Why, for each: what changed that a reload cannot apply.
    pub(crate) why: Vec<String>,
    /// Every setting of the file an admin override shadows (it holds over the file's value
    /// until deleted: `DELETE /admin/overrides?id=...`).
    pub(crate) shadowed: Vec<super::overrides::Override>,
}

/// Where the accounts' budgets are kept, as the configuration and `persistence` say.
fn keeping(config: &Config, persistence: &Persistence, caps: Option<Arc<CapsRecord>>) -> Keeping {
    Keeping {
        persistence: persistence.clone(),
        fail_closed: config.server.fail_closed,
        lease: Some(config.server.lease_refresh_ms)
            .filter(|&ms| ms > 0)
            .map(Duration::from_millis),
        store_timeout: Duration::from_millis(config.server.store_timeout_ms),
        caps,
    }
}

/// The accounts of `config`, every one serving the tenant state of the first (a tenant's
/// limits hold over all of them), attached to `tenants`.
async fn accounts(
    config: &Config,
    (tree, keeping): (&TenantTree, &Keeping),
    prices: Option<&Arc<PriceTable>>,
    tenants: &mut Tenancy,
) -> Result<Vec<Account>, ConfigError> {
    let mut accounts = Vec::with_capacity(config.accounts.len());
    for account in &config.accounts {
        // Every account serves one tenant state: a tenant's limits hold over all of them.
        let before = accounts.first().map(Account::budget);
        let account = Account::new(account, (tree, before), keeping, prices).await?;
        if let Some(handle) = account.tenants() {
            tenants.attach(&account.name, handle);
        }
        accounts.push(account);
    }
    Ok(accounts)
}

/// One gateway's caps start where they were, and every change is recorded.
async fn restore_caps(
    caps: Option<&Arc<CapsRecord>>,
    accounts: &[Account],
) -> Result<(), ConfigError> {
    if let (Some(caps), Some(handle)) = (caps, accounts.first().and_then(Account::tenants)) {
        let restored = caps
            .restore(&handle)
            .await
            .map_err(|e| ConfigError(format!("state: the caps' counts: {e}")))?;
        tracing::info!(restored, "caps' counts restored from the state");
        handle.record_caps(Arc::clone(caps) as Arc<dyn tower_llm_quota::tenant::CapRecord>);
    }
    Ok(())
}

/// The spend alerts of `config`, their counts restored from the state.
async fn alerts(
    config: &Config,
    persistence: &Persistence,
    database: Option<&Database>,
) -> Result<Arc<alerts::Alerts>, ConfigError> {
    let alerts = alerts::Alerts::new(
        &config.spend_alerts,
        (persistence, database),
        config
            .server
            .alert_webhook
            .clone()
            .map(|url| (url, clients::webhook_client())),
    )?;
    alerts
        .restore()
        .await
        .map_err(|e| ConfigError(format!("state: the spend alerts' counts: {e}")))?;
    Ok(Arc::new(alerts))
}

/// What no request waits for (the caps' settlements, the alerts' counts) is written a
/// tenth of a second later at most, while the alerts live.
fn flush_in_background(caps: Option<&Arc<CapsRecord>>, alerts: &Arc<alerts::Alerts>) {
    let (flushed_caps, flushed_alerts) = (caps.map(Arc::downgrade), Arc::downgrade(alerts));
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(100));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let Some(alerts) = flushed_alerts.upgrade() else {
                return;
            };
            alerts.flush();
            if let Some(caps) = flushed_caps.as_ref().and_then(std::sync::Weak::upgrade)
                && let Err(error) = caps.durable()
            {
                tracing::warn!(%error, "the caps' counts were not committed");
            }
        }
    });
}

/// The server's connection limits (a cap above the open-file limit lowered, and said), the
/// operators' admin token and the status token.
fn server_settings(
    config: &Config,
) -> Result<(ConnectionLimits, String, Option<String>), ConfigError> {
    let (connection_limits, lowered) = ConnectionLimits::new(&config.server, open_files_limit())?;
    if let Some(note) = lowered {
        tracing::warn!("{note}");
    }
    let admin_token = root_token(config)?;
    let server = &config.server;
    let status_token = config::secret(
        server.status_token.as_ref(),
        server.status_token_env.as_ref(),
        "the status token",
    )?;
    Ok((connection_limits, admin_token, status_token))
}

/// The audit log `[server] audit_log` names (stdout by default).
fn audit_of(config: &Config) -> Result<audit::Audit, ConfigError> {
    let target = config.server.audit_log.as_deref().unwrap_or("stdout");
    audit::Audit::open(target).map_err(|e| ConfigError(format!("server.audit_log {target}: {e}")))
}

/// The OTLP exporter `[server] otlp_endpoint` names, started.
#[cfg(feature = "otel")]
async fn otel_of(config: &Config) -> Result<Option<otel::Otel>, ConfigError> {
    match &config.server.otlp_endpoint {
        Some(endpoint) => Ok(Some(otel::Otel::start(endpoint.clone()).await?)),
        None => Ok(None),
    }
}
