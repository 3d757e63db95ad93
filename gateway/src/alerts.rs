//! Spend alerts (`[[spend_alerts]]`): thresholds of a node's spend over a calendar day or
//! month, each raised once per period, as a metric, an audit line and an optional webhook.
//!
//! Every answer priced with `[prices]` adds its spend to the count of each alert whose node
//! holds its tenant path, for the current period, in the gateway's state: in Redis
//! (`INCRBY`), or in the SQL state's table `alerts` (an upsert adding to the count and
//! answering it), atomic either way: of all the answers (and all the replicas'), exactly one
//! takes the count across each threshold, so each is raised once per period, over the fleet
//! and over restarts. In memory (the demo) the counts are lost at exit. An alert never
//! refuses: it records (the warn-only mode); a cap of the node refuses.
//!
//! The webhook is `POST`ed by a task of its own from a bounded channel, so a request never
//! waits for it: each event up to five times (0.5, 1, 2 and 4 s apart), every failed attempt
//! counted in `gateway_alert_webhook_failures_total`, an event given up (or one that found the
//! channel full) in `gateway_alert_webhook_dropped_total`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tower_llm_quota::pricing::Usd;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use redis::aio::ConnectionManager;
use serde::Serialize;
use tokio::sync::mpsc;
use tower::ServiceExt;
use tower_llm_quota::tenant::Tenant;

use super::clients::Client;
use super::config::{AlertConfig, AlertWindow, ConfigError};
use super::store::{Database, Persistence, Sqlite, Statement, Value};

/// Events waiting for the webhook, at most.
const BACKLOG: usize = 1_024;

/// The webhook's attempts per event, and the first wait between two (doubled each time).
const ATTEMPTS: u32 = 5;
const FIRST_RETRY: Duration = Duration::from_millis(500);

/// How long one webhook call may take.
const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(5);

/// What an alert watches.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Watched {
    /// A tenant node, with every node below it.
    Node(Tenant),
    /// An account, whatever the tenant.
    Account(String),
}

impl Watched {
    /// Whether an answer of `path` on `account` counts.
    fn counts(&self, path: Option<&Tenant>, account: Option<&str>) -> bool {
        match self {
            Watched::Node(node) => path.is_some_and(|path| path.is_within(node)),
            Watched::Account(name) => account == Some(name.as_str()),
        }
    }
}

impl std::fmt::Display for Watched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Watched::Node(node) => write!(f, "tenant:{node}"),
            Watched::Account(name) => write!(f, "account:{name}"),
        }
    }
}

/// An alert as the gateway runs it.
#[derive(Debug)]
struct Alert {
    watched: Watched,
    amount: u64,
    window: AlertWindow,
    thresholds: Vec<u32>,
}

/// A threshold crossed: the audit line and the webhook's body.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct AlertEvent {
    pub(crate) time: String,
    pub(crate) event: &'static str,
    /// The node watched, for a node's alert.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tenant: Option<String>,
    /// The account watched, for an account's alert.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) account: Option<String>,
    pub(crate) window: &'static str,
    /// When the period started and when it ends (RFC 3339).
    pub(crate) period_start: String,
    pub(crate) period_end: String,
    pub(crate) threshold_percent: u32,
    pub(crate) amount_nano_usd: u64,
    /// The period's spend when the threshold was crossed.
    pub(crate) spent_nano_usd: u64,
    /// The same two in dollars, exact decimals (`"500.00"`).
    pub(crate) amount_usd: String,
    pub(crate) spent_usd: String,
}

/// The alerts, their counts and the webhook's queue.
pub(crate) struct Alerts {
    alerts: Vec<Alert>,
    /// Memory: the count of each alert (by index) in each period (by its first second).
    counts: Mutex<HashMap<(usize, u64), u64>>,
    /// SQLite: the counts changed since they were last written.
    unwritten: Mutex<std::collections::HashSet<(usize, u64)>>,
    /// Where the counts are kept, when not in memory.
    kept: Option<Kept>,
    webhook: Option<mpsc::Sender<AlertEvent>>,
}

/// Where the counts are kept.
#[derive(Clone)]
enum Kept {
    /// Counted by Redis for every replica.
    Redis(ConnectionManager),
    /// Counted by Postgres for every replica.
    Database(Database),
    /// One gateway's SQLite state: counted in memory (restored at start) and written behind;
    /// a threshold is raised once the count that crossed it is committed, so a restart never
    /// raises it again.
    Sqlite(std::sync::Arc<Sqlite>),
}

/// Sets an alert's count in a period (SQLite: the counts written behind, in any order;
/// never lowered).
const SET: &str = "INSERT INTO alerts (alert, period, spent) VALUES ($1, $2, $3) \
    ON CONFLICT (alert, period) DO UPDATE SET spent = max(alerts.spent, excluded.spent)";

/// The counts of the periods that have not ended (a month back at most).
const CURRENT: &str = "SELECT alert, period, spent FROM alerts WHERE period >= $1";

/// Adds to an alert's count in a period, answering the new count.
const ADD: &str = "INSERT INTO alerts (alert, period, spent) VALUES ($1, $2, $3) \
    ON CONFLICT (alert, period) DO UPDATE SET spent = alerts.spent + excluded.spent \
    RETURNING spent";

impl std::fmt::Debug for Alerts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alerts")
            .field("alerts", &self.alerts)
            .field("kept", &self.kept.is_some())
            .field("webhook", &self.webhook.is_some())
            .finish_non_exhaustive()
    }
}

impl Alert {
    /// The alert `config` describes, checked.
    fn of(config: &AlertConfig) -> Result<Self, ConfigError> {
        let name = config.tenant.as_deref().or(config.account.as_deref());
        let error =
            |reason: &str| ConfigError(format!("spend_alerts `{}`: {reason}", name.unwrap_or("?")));
        let watched = match (&config.tenant, &config.account) {
            (Some(tenant), None) => {
                Watched::Node(Tenant::parse(tenant).map_err(|e| error(&e.to_string()))?)
            }
            (None, Some(account)) => Watched::Account(account.clone()),
            _ => return Err(error("name a `tenant` or an `account`, one of them")),
        };
        if config.amount != 0 && config.amount_usd.is_some() {
            return Err(error("give `amount` or `amount_usd`, not both"));
        }
        let amount = config.nanos();
        if amount == 0 {
            return Err(error("amount (or amount_usd) must be above zero"));
        }
        if config.thresholds.is_empty() || config.thresholds.contains(&0) {
            return Err(error("thresholds are percentages above zero"));
        }
        let mut thresholds = config.thresholds.clone();
        thresholds.sort_unstable();
        thresholds.dedup();
        Ok(Alert {
            watched,
            amount,
            window: config.window,
            thresholds,
        })
    }

    /// Whether `other` watches the same node or account over the same window and amount.
    fn same(&self, other: &Alert) -> bool {
        self.watched == other.watched && self.window == other.window && self.amount == other.amount
    }
}

/// The queue of the task that posts events to the webhook at `url` through `client`.
fn webhook_sender(url: &str, client: Client) -> Result<mpsc::Sender<AlertEvent>, ConfigError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| ConfigError(format!("server.alert_webhook {url}: {e}")))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(ConfigError(format!(
            "server.alert_webhook {url}: an http:// or https:// URL"
        )));
    }
    let (sender, receiver) = mpsc::channel(BACKLOG);
    tokio::spawn(deliver(uri, client, receiver));
    Ok(sender)
}

impl Alerts {
    /// The alerts of `configs`, counted in the state of `persistence` (Redis, or the SQL
    /// `database`), else in memory, their events posted to `webhook` through `client`.
    pub(crate) fn new(
        configs: &[AlertConfig],
        (persistence, database): (&Persistence, Option<&Database>),
        webhook: Option<(String, Client)>,
    ) -> Result<Self, ConfigError> {
        let mut alerts: Vec<Alert> = Vec::with_capacity(configs.len());
        for config in configs {
            let alert = Alert::of(config)?;
            if alerts.iter().any(|a| a.same(&alert)) {
                let name = config.tenant.as_deref().or(config.account.as_deref());
                return Err(ConfigError(format!(
                    "spend_alerts `{}`: another alert has the same window and amount",
                    name.unwrap_or("?")
                )));
            }
            alerts.push(alert);
        }
        let kept = match (persistence.redis(), database) {
            _ if alerts.is_empty() => None,
            (Some(url), _) => Some(Kept::Redis(super::report::connection(url, "alerts")?)),
            (None, Some(Database::Sqlite(sqlite))) => Some(Kept::Sqlite(sqlite.clone())),
            (None, Some(database)) => Some(Kept::Database(database.clone())),
            (None, None) => None,
        };
        let webhook = webhook
            .map(|(url, client)| webhook_sender(&url, client))
            .transpose()?;
        Ok(Self {
            alerts,
            counts: Mutex::default(),
            unwritten: Mutex::default(),
            kept,
            webhook,
        })
    }

    /// The name an alert's count is kept under.
    fn name(&self, i: usize) -> String {
        let alert = &self.alerts[i];
        format!("{}:{}:{}", alert.watched, alert.window.name(), alert.amount)
    }

    /// With an SQLite state, reads the counts of the periods that have not ended back into
    /// memory: how many.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub(crate) async fn restore(&self) -> Result<usize, super::store::DatabaseError> {
        let Some(Kept::Sqlite(sqlite)) = &self.kept else {
            return Ok(0);
        };
        let month_ago = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs()
            .saturating_sub(32 * 86_400);
        let rows = sqlite
            .transaction(vec![Statement::new(CURRENT, vec![month_ago.into()])])
            .await?;
        let names: HashMap<String, usize> =
            (0..self.alerts.len()).map(|i| (self.name(i), i)).collect();
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let mut restored = 0;
        for row in rows.into_iter().flatten() {
            let [name, period, spent] = &row[..] else {
                continue;
            };
            if let Some(&i) = names.get(name.text()) {
                let count = counts.entry((i, period.int().max(0) as u64)).or_default();
                *count = (*count).max(spent.int().max(0) as u64);
                restored += 1;
            }
        }
        Ok(restored)
    }

    fn unwritten(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<(usize, u64)>> {
        self.unwritten.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The statement setting alert `i`'s count in `period` to `total`.
    fn set(&self, i: usize, period: u64, total: u64) -> Statement {
        Statement::new(SET, vec![self.name(i).into(), period.into(), total.into()])
    }

    /// With an SQLite state, queues the counts changed since the last call (written behind:
    /// a count lost with the process is below the true one, never below a threshold it
    /// raised).
    pub(crate) fn flush(&self) {
        let Some(Kept::Sqlite(sqlite)) = &self.kept else {
            return;
        };
        let unwritten = std::mem::take(&mut *self.unwritten());
        if unwritten.is_empty() {
            return;
        }
        let statements = {
            let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
            (unwritten.into_iter())
                .map(|(i, period)| self.set(i, period, counts[&(i, period)]))
                .collect()
        };
        sqlite.write_all(statements);
    }

    /// Adds `spend` to the count of each alert of `over` in its period, in memory: each
    /// alert's index, period and new count.
    fn count(&self, over: &[(usize, u64)], spend: u64) -> Vec<(usize, u64, u64)> {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        over.iter()
            .map(|&(i, period)| {
                let count = counts.entry((i, period)).or_default();
                *count = count.saturating_add(spend);
                (i, period, *count)
            })
            .collect()
    }

    /// Whether alert `i`'s count going to `total` by `added` crosses one of its thresholds.
    fn crosses(&self, i: usize, (total, added): (u64, u64)) -> bool {
        let alert = &self.alerts[i];
        let before = total.saturating_sub(added);
        let crossed = |count: u64, percent: u32| {
            u128::from(count) * 100 >= u128::from(alert.amount) * u128::from(percent)
        };
        (alert.thresholds.iter()).any(|&p| !crossed(before, p) && crossed(total, p))
    }

    /// Whether any alert is configured (else an answer's path need not be built).
    pub(crate) fn watches_any(&self) -> bool {
        !self.alerts.is_empty()
    }

    /// Adds `spend` of an answer of `path` on `account` at `at` to the alerts over it (its
    /// node's and their ancestors', its account's); the events of the thresholds it crossed,
    /// written to `audit` and sent to the webhook. Kept in the state, the counting is a task
    /// of its own (the answer never waits for it); in memory, the thresholds raised are
    /// answered (each alert's, by its index).
    pub(crate) fn add(
        self: &std::sync::Arc<Self>,
        (path, account): (Option<&str>, Option<&str>),
        spend: u64,
        at: SystemTime,
        audit: &super::audit::Audit,
    ) -> Vec<(usize, u32)> {
        let mut raised = Vec::new();
        if spend == 0 || self.alerts.is_empty() {
            return raised;
        }
        let path = path.and_then(|path| Tenant::parse(path).ok());
        let unix = at.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        let over: Vec<(usize, u64)> = (self.alerts.iter().enumerate())
            .filter(|(_, alert)| alert.watched.counts(path.as_ref(), account))
            .map(|(i, alert)| (i, alert.window.cap_window().started_at(unix)))
            .collect();
        if over.is_empty() {
            return raised;
        }
        let Some(kept) = self.kept.clone() else {
            for (i, _, total) in self.count(&over, spend) {
                let crossed = self.crossed(i, unix, (total, spend), audit);
                raised.extend(crossed.into_iter().map(|percent| (i, percent)));
            }
            return raised;
        };
        if let Kept::Sqlite(sqlite) = kept {
            let totals = self.count(&over, spend);
            for (i, period, total) in totals {
                if !self.crosses(i, (total, spend)) {
                    self.unwritten().insert((i, period));
                    continue;
                }
                // Committed before it is raised: a restart never raises it again.
                let statement = self.set(i, period, total);
                if let Err(error) = sqlite.inline(|c| c.commit(&[statement])) {
                    tracing::warn!(%error, "a spend alert's count was not kept: raised anyway");
                }
                let crossed = self.crossed(i, unix, (total, spend), audit);
                raised.extend(crossed.into_iter().map(|percent| (i, percent)));
            }
            return raised;
        }
        tokio::spawn(Arc::clone(self).count_shared(kept, over, (spend, unix), audit.clone()));
        raised
    }

    /// Adds `spend` to the shared counts of the alerts `over` (index and period) in `kept`
    /// (Redis, or the SQL state), then raises the thresholds the totals crossed.
    async fn count_shared(
        self: Arc<Self>,
        kept: Kept,
        over: Vec<(usize, u64)>,
        (spend, unix): (u64, u64),
        audit: super::audit::Audit,
    ) {
        let names = over.iter().map(|&(i, period)| (self.name(i), period));
        let totals: Result<Vec<u64>, String> = match kept {
            Kept::Redis(mut redis) => {
                let mut pipe = redis::pipe();
                for (name, period) in names {
                    let key = format!("{{gateway:alerts}}:{name}:{period}");
                    pipe.cmd("INCRBY").arg(&key).arg(spend);
                    pipe.expire(&key, 62 * 86_400).ignore();
                }
                pipe.query_async(&mut redis)
                    .await
                    .map_err(|e| e.to_string())
            }
            Kept::Sqlite(_) => unreachable!("counted in memory above"),
            Kept::Database(database) => {
                let statements = names
                    .map(|(name, period)| {
                        Statement::new(ADD, vec![name.into(), period.into(), Value::from(spend)])
                    })
                    .collect();
                database.transaction(statements).await.map_or_else(
                    |e| Err(e.to_string()),
                    |answers| {
                        Ok(answers
                            .iter()
                            .map(|rows| rows.first().map_or(0, |row| row[0].int().max(0) as u64))
                            .collect())
                    },
                )
            }
        };
        match totals {
            Ok(totals) => {
                for (&(i, _), total) in over.iter().zip(totals) {
                    let _raised = self.crossed(i, unix, (total, spend), &audit);
                }
            }
            Err(error) => {
                metrics::counter!("gateway_alert_count_failures_total").increment(1);
                tracing::warn!(%error, "a spend alert's count was not added");
            }
        }
    }

    /// Raises each threshold of alert `i` that the count crossed going to `total` by `added`;
    /// the thresholds raised.
    fn crossed(
        &self,
        i: usize,
        unix: u64,
        (total, added): (u64, u64),
        audit: &super::audit::Audit,
    ) -> Vec<u32> {
        let mut raised = Vec::new();
        let alert = &self.alerts[i];
        let before = total.saturating_sub(added);
        for &percent in &alert.thresholds {
            let level = u128::from(alert.amount) * u128::from(percent);
            let crossed = |count: u64| u128::from(count) * 100 >= level;
            if crossed(before) || !crossed(total) {
                continue;
            }
            let window = alert.window.cap_window();
            let (start, end) = (window.started_at(unix), window.resets_after(unix));
            let time = |secs: u64| super::audit::rfc3339(UNIX_EPOCH + Duration::from_secs(secs));
            let event = AlertEvent {
                time: super::audit::rfc3339(SystemTime::now()),
                event: "spend_threshold",
                tenant: match &alert.watched {
                    Watched::Node(node) => Some(node.to_string()),
                    Watched::Account(_) => None,
                },
                account: match &alert.watched {
                    Watched::Account(name) => Some(name.clone()),
                    Watched::Node(_) => None,
                },
                window: alert.window.name(),
                period_start: time(start),
                period_end: time(end),
                threshold_percent: percent,
                amount_nano_usd: alert.amount,
                spent_nano_usd: total,
                amount_usd: Usd::from_nanos(alert.amount).decimal(),
                spent_usd: Usd::from_nanos(total).decimal(),
            };
            let (label, watched) = match &alert.watched {
                Watched::Node(node) => ("tenant", node.to_string()),
                Watched::Account(name) => ("account", name.clone()),
            };
            metrics::counter!(
                "gateway_spend_alerts_total",
                label => watched,
                "threshold" => percent.to_string(),
            )
            .increment(1);
            tracing::warn!(
                scope = %alert.watched,
                threshold = percent,
                spent = %Usd::from_nanos(total),
                amount = %Usd::from_nanos(alert.amount),
                "spend alert"
            );
            audit.write(&event);
            if let Some(webhook) = &self.webhook
                && webhook.try_send(event).is_err()
            {
                metrics::counter!("gateway_alert_webhook_dropped_total").increment(1);
            }
            raised.push(percent);
        }
        raised
    }
}

/// Posts each event of `events` to `uri`, retrying with backoff.
async fn deliver(uri: http::Uri, client: Client, mut events: mpsc::Receiver<AlertEvent>) {
    while let Some(event) = events.recv().await {
        let body = Bytes::from(serde_json::to_vec(&event).unwrap_or_default());
        let mut wait = FIRST_RETRY;
        let mut delivered = false;
        for attempt in 1..=ATTEMPTS {
            let request = Request::post(uri.clone())
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(body.clone()))
                .expect("a valid request");
            let call = client.clone().oneshot(request);
            match tokio::time::timeout(WEBHOOK_TIMEOUT, call).await {
                Ok(Ok(response)) if response.status().is_success() => {
                    delivered = true;
                    break;
                }
                outcome => {
                    metrics::counter!("gateway_alert_webhook_failures_total").increment(1);
                    let reason = match outcome {
                        Ok(Ok(response)) => response.status().to_string(),
                        Ok(Err(error)) => error.to_string(),
                        Err(_) => "timed out".to_owned(),
                    };
                    tracing::warn!(attempt, %reason, "the alert webhook failed");
                }
            }
            if attempt < ATTEMPTS {
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
        }
        if !delivered {
            metrics::counter!("gateway_alert_webhook_dropped_total").increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(unix: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(unix)
    }

    /// Time as an argument, the clock never read: a month of answers in a few steps. Each
    /// threshold is raised by the answer that crosses it, once in the month, whatever the
    /// answers after it; an answer crossing two raises both; a node's alert counts the
    /// answers of its keys and children, not its siblings'; the next month starts again.
    #[test]
    fn thresholds_are_raised_once_each_per_period() {
        let config = |tenant: &str| AlertConfig {
            amount_usd: None,
            tenant: Some(tenant.to_owned()),
            account: None,
            amount: 1_000,
            window: AlertWindow::CalendarMonthUtc,
            thresholds: vec![100, 50, 80],
        };
        let alerts = std::sync::Arc::new(
            Alerts::new(
                &[config("acme"), config("acme/search")],
                (&Persistence::Memory, None),
                None,
            )
            .unwrap(),
        );
        let audit = super::super::audit::Audit::Off;
        // 2026-12-03T12:00:00Z, then the last second of December, then January.
        let (december, last, january) = (1_796_299_200, 1_798_761_599, 1_798_761_600);
        let add = |path: &str, spend, unix| {
            alerts.add((Some(path), Some("openai")), spend, at(unix), &audit)
        };
        assert_eq!(add("acme/search/key", 499, december), []);
        assert_eq!(add("acme/search/key", 1, december), [(0, 50), (1, 50)]);
        assert_eq!(add("acme/reports/key", 299, december), []);
        assert_eq!(add("acme/reports/key", 1, december), [(0, 80)]);
        assert_eq!(add("globex/key", 5_000, december), []);
        // Crossing 100 % of the node's alert and 80 and 100 % of its child's at once.
        assert_eq!(
            add("acme/search/key", 500, last),
            [(0, 100), (1, 80), (1, 100)]
        );
        assert_eq!(add("acme/search/key", 5_000, last), []);
        // January: counted from nothing again.
        assert_eq!(add("acme/key", 499, january), []);
        assert_eq!(add("acme/key", 501, january), [(0, 50), (0, 80), (0, 100)]);
    }

    #[test]
    fn mistakes_are_named() {
        let config = |amount, thresholds: Vec<u32>| AlertConfig {
            amount_usd: None,
            tenant: Some("acme".to_owned()),
            account: None,
            amount,
            window: AlertWindow::CalendarDayUtc,
            thresholds,
        };
        let error = |configs: &[AlertConfig]| {
            Alerts::new(configs, (&Persistence::Memory, None), None)
                .unwrap_err()
                .0
        };
        assert!(error(&[config(0, vec![50])]).contains("above zero"));
        assert!(error(&[config(5, vec![0])]).contains("percentages"));
        assert!(error(&[config(5, vec![50]), config(5, vec![80])]).contains("same window"));
        let both = AlertConfig {
            amount_usd: None,
            account: Some("openai".to_owned()),
            ..config(5, vec![50])
        };
        assert!(error(std::slice::from_ref(&both)).contains("one of them"));
        let neither = AlertConfig {
            amount_usd: None,
            tenant: None,
            account: None,
            ..both
        };
        assert!(error(&[neither]).contains("one of them"));
    }

    /// An account's alert counts every tenant's answers on the account, and no other
    /// account's; beside a node's alert, each is raised by its own count.
    #[test]
    fn an_account_s_alert_counts_every_tenant_on_it() {
        let alerts = std::sync::Arc::new(
            Alerts::new(
                &[
                    AlertConfig {
                        amount_usd: None,
                        tenant: None,
                        account: Some("openai".to_owned()),
                        amount: 1_000,
                        window: AlertWindow::CalendarDayUtc,
                        thresholds: vec![50, 100],
                    },
                    AlertConfig {
                        amount_usd: None,
                        tenant: Some("acme".to_owned()),
                        account: None,
                        amount: 1_000,
                        window: AlertWindow::CalendarDayUtc,
                        thresholds: vec![50],
                    },
                ],
                (&Persistence::Memory, None),
                None,
            )
            .unwrap(),
        );
        let audit = super::super::audit::Audit::Off;
        let day = 1_796_299_200;
        let add = |path: &str, account: &str, spend| {
            alerts.add((Some(path), Some(account)), spend, at(day), &audit)
        };
        assert_eq!(add("acme/key", "anthropic", 900), [(1, 50)]);
        assert_eq!(add("acme/key", "openai", 300), []);
        assert_eq!(add("globex/key", "openai", 200), [(0, 50)]);
        assert_eq!(add("globex/key", "openai", 499), []);
        assert_eq!(add("initech/key", "openai", 1), [(0, 100)]);
    }
}
