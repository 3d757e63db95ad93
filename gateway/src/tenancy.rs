//! The gateway's view of the crate's tenant tree (`tower_llm_quota::tenant`): each account's
//! budget holds a copy of the configured tree; this module pauses, changes and reads the
//! nodes on every account at once, and refuses a request its own nodes cannot pay now.
//!
//! A request of key `web` of tenant `acme/search` carries the path `acme/search/web`, so a
//! key is a node too (it can be paused, and a template may limit every key). The budget
//! admits it only when `acme`, `acme/search`, `acme/search/web` and the account can all pay,
//! and serves waiting requests by weighted fair queuing over token cost. The gateway adds one
//! policy: a request that a node of its own path cannot pay now is refused at once (429
//! naming that node, with the wait until it could), instead of holding its connection while
//! its tenant refills. A request that only the account cannot pay waits its fair turn.

use std::num::NonZeroU32;
use std::time::Duration;

use http::{HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use tower_llm_quota::budget::LimitSnapshot;
use tower_llm_quota::pricing::Usd;
use tower_llm_quota::tenant::{
    CapWindow, Refusal as Why, Tenant, TenantHandle, TenantNode, TenantRefused,
};
use tower_llm_quota::{Dimension, Limit, Priority};

use super::config::ConfigError;
use super::refusal::{Dialect, Refusal, limit_name};
use super::state::{NodeOverride, without_limits};

/// The tenant nodes of every account.
#[derive(Debug, Default)]
pub(crate) struct Tenancy {
    /// The nodes the views list, in path order.
    paths: std::sync::RwLock<Vec<Tenant>>,
    accounts: Vec<(String, TenantHandle)>,
    /// The nodes the admin state changed when it was last applied: one no longer changed
    /// goes back to the file's settings.
    overridden: std::sync::Mutex<std::collections::BTreeSet<Tenant>>,
}

/// A limit to remove, by its dimension and period.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LimitKey {
    pub(crate) dimension: String,
    pub(crate) period_seconds: u64,
}

/// A limit as the admin API takes it: `amount`, or for spend `amount_usd` (dollars, a
/// decimal string: `"0.50"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, try_from = "LimitWritten")]
pub(crate) struct LimitChange {
    /// `requests`, `input_tokens`, `output_tokens`, `total_tokens` or `spend`.
    pub(crate) dimension: String,
    /// For spend, nano-dollars.
    pub(crate) amount: std::num::NonZeroU64,
    pub(crate) period_seconds: u64,
    /// The most admitted at once, when not the default share of the amount.
    pub(crate) burst: Option<std::num::NonZeroU64>,
}

/// A limit as written to the admin API, before its amount is read.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitWritten {
    dimension: String,
    amount: Option<std::num::NonZeroU64>,
    amount_usd: Option<String>,
    period_seconds: u64,
    burst: Option<std::num::NonZeroU64>,
}

impl TryFrom<LimitWritten> for LimitChange {
    type Error = String;

    fn try_from(written: LimitWritten) -> Result<Self, String> {
        let amount = match (written.amount, written.amount_usd.as_deref()) {
            (Some(amount), None) => amount,
            (None, Some(usd)) if written.dimension == "spend" => {
                let nanos = Usd::parse(usd).map_err(|e| e.to_string())?.nanos();
                std::num::NonZeroU64::new(nanos).ok_or("amount_usd must be above zero")?
            }
            (None, Some(_)) => return Err("amount_usd is for spend; give `amount`".into()),
            (Some(_), Some(_)) => return Err("give `amount` or `amount_usd`, not both".into()),
            (None, None) => return Err("missing field `amount` (or `amount_usd`)".into()),
        };
        Ok(Self {
            dimension: written.dimension,
            amount,
            period_seconds: written.period_seconds,
            burst: written.burst,
        })
    }
}

/// The dimension of that name, or why there is none.
pub(crate) fn dimension(name: &str) -> Result<Dimension, ConfigError> {
    Dimension::ALL
        .into_iter()
        .find(|d| d.as_str() == name)
        .ok_or_else(|| {
            ConfigError(format!(
                "unknown dimension `{name}` (requests, input_tokens, output_tokens, total_tokens)"
            ))
        })
}

/// One node on one account, as the admin API and the status page show it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct NodeView {
    pub(crate) path: String,
    /// The node's configured weight (its template's when it has none of its own).
    pub(crate) weight: u32,
    /// The weight it is served by in the fair share: the product of the weights on its path.
    pub(crate) path_weight: u32,
    pub(crate) paused: bool,
    pub(crate) accounts: Vec<ShareView>,
}

/// A node's state on one account now; tokens per minute in the account's reference dimension.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ShareView {
    pub(crate) account: String,
    pub(crate) levels: Vec<LevelView>,
    /// The node's caps over a period (a day, a month) and what the current period used of
    /// each (the fleet's with Redis).
    pub(crate) caps: Vec<CapView>,
    /// Tokens its answers used on this account over the last minute (the others are the
    /// node's over every account).
    pub(crate) used: u64,
    pub(crate) guaranteed: u64,
    pub(crate) borrowed: u64,
    pub(crate) in_flight: usize,
    pub(crate) queued: [usize; 3],
}

/// A cap over a period and what the current period used of it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CapView {
    /// `total_tokens_per_day`, `spend_per_month`, ...
    pub(crate) limit: String,
    pub(crate) amount: u64,
    /// `calendar day (UTC)`, `calendar month (UTC)` or `rolling 24 h`.
    pub(crate) window: String,
    pub(crate) used: u64,
    /// A spend cap's amount and use in dollars (`"500.00"`, exact); `amount` and `used` are
    /// nano-dollars.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) amount_usd: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) used_usd: Option<String>,
}

impl CapView {
    /// The views of `caps`, each with what its period used.
    pub(crate) fn all(caps: &[(tower_llm_quota::tenant::PeriodCap, u64)]) -> Vec<Self> {
        (caps.iter())
            .map(|(cap, used)| {
                let usd = |nanos: u64| {
                    (cap.dimension() == Dimension::Spend).then(|| Usd::from_nanos(nanos).decimal())
                };
                CapView {
                    limit: cap_name(cap.dimension().as_str(), cap.window()),
                    amount: cap.amount().get(),
                    window: cap.window().to_string(),
                    used: *used,
                    amount_usd: usd(cap.amount().get()),
                    used_usd: usd(*used),
                }
            })
            .collect()
    }
}

/// A limit's state now: its name, its amount per its period, its burst (the most spent at
/// once, `capacity`), and what is left of the burst now (`level`).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LevelView {
    pub(crate) limit: String,
    /// The configured (or provider-reported) amount per `period_seconds`.
    pub(crate) amount: u64,
    pub(crate) period_seconds: f64,
    /// The burst: at most this much at once.
    pub(crate) capacity: u64,
    /// What is left of the burst now.
    pub(crate) level: i64,
    /// Spent: the seconds until one unit may be spent again (absent while one may now).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) frees_in_seconds: Option<f64>,
}

impl From<&LimitSnapshot> for LevelView {
    fn from(snapshot: &LimitSnapshot) -> Self {
        let limit = snapshot.limit();
        let frees_in = snapshot
            .available_at()
            .saturating_duration_since(tokio::time::Instant::now());
        Self {
            limit: limit_name(limit.dimension().as_str(), limit.period()),
            amount: limit.amount().get(),
            period_seconds: limit.period().as_secs_f64(),
            capacity: snapshot.capacity(),
            level: snapshot.level(),
            frees_in_seconds: (!frees_in.is_zero())
                .then(|| (frees_in.as_secs_f64() * 10.0).ceil() / 10.0),
        }
    }
}

/// The path of every node from the root down to `path`: `a`, `a/b`, `a/b/c`.
fn ancestry(path: &Tenant) -> impl Iterator<Item = Tenant> + '_ {
    (1..=path.depth()).filter_map(|depth| Tenant::parse(path.prefix(depth)).ok())
}

impl Tenancy {
    /// The nodes the views list (configured ones, every key's tenant and their ancestors).
    pub(crate) fn new(paths: Vec<Tenant>) -> Self {
        Self {
            paths: std::sync::RwLock::new(paths),
            accounts: Vec::new(),
            overridden: std::sync::Mutex::default(),
        }
    }

    /// Whether `path` is a node the gateway knows: a configured one, a key's tenant or one of
    /// their ancestors.
    pub(crate) fn knows(&self, path: &Tenant) -> bool {
        self.paths().contains(path)
    }

    /// ` (did you mean `x`?)` naming the known node nearest `name`, if one is near, among
    /// those within `scope` (all of them when `None`).
    pub(crate) fn hint(&self, name: &str, scope: Option<&Tenant>) -> String {
        let paths = self.paths();
        let seen = (paths.iter())
            .filter(|path| scope.is_none_or(|scope| path.is_within(scope)))
            .map(Tenant::as_str);
        super::nearest::hint(name, seen)
    }

    fn paths(&self) -> std::sync::RwLockReadGuard<'_, Vec<Tenant>> {
        self.paths.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Lists `paths` (a reload's configured nodes and keys' tenants, with their ancestors) and
    /// `extra` (the admin API's keys' tenants and nodes) and their ancestors.
    pub(crate) fn set_paths<'a>(
        &self,
        paths: &[Tenant],
        extra: impl IntoIterator<Item = &'a Tenant>,
    ) {
        let mut all: std::collections::BTreeSet<Tenant> = paths.iter().cloned().collect();
        for path in extra {
            all.extend(ancestry(path));
        }
        *self.paths.write().unwrap_or_else(|e| e.into_inner()) = all.into_iter().collect();
    }

    /// Sets the node at `path` to `node` on every account (levels and requests in flight
    /// kept).
    pub(crate) fn set_configured(
        &self,
        path: &Tenant,
        node: &TenantNode,
    ) -> Result<(), ConfigError> {
        for (_, handle) in &self.accounts {
            handle
                .set_node(path, node.clone())
                .map_err(|e| ConfigError(format!("tenant {path}: {e}")))?;
        }
        Ok(())
    }

    /// Sets every node `tree` configures, with the admin API's `overrides` over them, on
    /// every account (a start, a reload, another replica's change): levels, requests in flight
    /// and queues are kept. Returns how many nodes the configuration sets.
    pub(crate) fn apply(
        &self,
        tree: &tower_llm_quota::tenant::TenantTree,
        overrides: &std::collections::BTreeMap<Tenant, NodeOverride>,
    ) -> Result<usize, ConfigError> {
        let mut count = 0;
        for (path, node) in tree.nodes() {
            if !overrides.contains_key(path) {
                self.set_configured(path, node)?;
            }
            count += 1;
        }
        for (path, changes) in overrides {
            let base = tree.node(path).cloned().unwrap_or_default();
            self.set_configured(path, &changes.over(&base))?;
        }
        // A node whose overrides were all deleted, and that the file does not name: back to
        // what the file gives it (a template's, or nothing).
        let now: std::collections::BTreeSet<Tenant> = overrides.keys().cloned().collect();
        let before = std::mem::replace(
            &mut *self.overridden.lock().unwrap_or_else(|e| e.into_inner()),
            now.clone(),
        );
        let configured: std::collections::BTreeSet<&Tenant> =
            tree.nodes().map(|(path, _)| path).collect();
        for path in before.difference(&now).filter(|p| !configured.contains(p)) {
            self.set_configured(path, &tree.node(path).cloned().unwrap_or_default())?;
        }
        Ok(count)
    }

    /// The configuration of the node at `path` now (the accounts serve one tenant state).
    pub(crate) fn node(&self, path: &Tenant) -> Option<TenantNode> {
        self.accounts
            .first()
            .and_then(|(_, handle)| handle.node(path))
    }

    /// What the admin API may change of the node at `path`, for the audit log: its weight, its
    /// limits (amount per period) and whether it is paused.
    pub(crate) fn node_summary(&self, path: &Tenant) -> serde_json::Value {
        let Some((_, handle)) = self.accounts.first() else {
            return serde_json::Value::Null;
        };
        let node = handle.node(path).unwrap_or_default();
        let limits: Vec<serde_json::Value> = node
            .limits()
            .iter()
            .map(|l| {
                serde_json::json!({
                    "limit": limit_name(l.dimension().as_str(), l.period()),
                    "amount": l.amount().get(),
                })
            })
            .collect();
        serde_json::json!({
            "weight": node.weight().get(),
            "limits": limits,
            "paused": handle.snapshot(path).is_paused(),
        })
    }

    /// Adds an account's copy of the tree.
    pub(crate) fn attach(&mut self, account: &str, handle: TenantHandle) {
        self.accounts.push((account.to_owned(), handle));
    }

    fn handle(&self, account: &str) -> Option<&TenantHandle> {
        self.accounts
            .iter()
            .find(|(name, _)| name == account)
            .map(|(_, h)| h)
    }

    /// The rate-limit headers a caller of `path` sees on `account`: those of the nearest node
    /// of its path with limits of its own (its key's, its team's, its tenant's), in the
    /// dialect's names — never the account's, which describe other tenants' traffic too.
    /// OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (resets as durations);
    /// Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,
    /// remaining}`. None when no node of the path has limits.
    pub(crate) fn rate_limit_headers(
        &self,
        account: &str,
        path: &Tenant,
        dialect: Dialect,
    ) -> Vec<(HeaderName, HeaderValue)> {
        let Some(handle) = self.handle(account) else {
            return Vec::new();
        };
        let mut node = Some(path.clone());
        let snapshot = loop {
            let Some(current) = node else {
                return Vec::new();
            };
            let snapshot = handle.snapshot(&current);
            if !snapshot.limits().is_empty() {
                break snapshot;
            }
            node = current.parent();
        };
        let now = tokio::time::Instant::now();
        let mut headers = Vec::with_capacity(3 * snapshot.limits().len());
        for limit in snapshot.limits() {
            let amount = limit.limit().amount().get();
            let remaining = u64::try_from(limit.level()).unwrap_or(0);
            let ([limit_name, remaining_name], reset_name) =
                header_names(dialect, limit.limit().dimension());
            headers.push((limit_name, HeaderValue::from(amount)));
            headers.push((remaining_name, HeaderValue::from(remaining)));
            if let Some(reset_name) = reset_name {
                let reset = limit.full_at().saturating_duration_since(now);
                if let Ok(value) = HeaderValue::try_from(duration_text(reset)) {
                    headers.push((reset_name, value));
                }
            }
        }
        headers
    }

    /// Pauses (or resumes) a node on every account.
    pub(crate) fn set_paused(&self, path: &Tenant, paused: bool) {
        for (_, handle) in &self.accounts {
            match paused {
                true => handle.pause(path),
                false => handle.resume(path),
            }
        }
    }

    /// Changes a node on every account: each limit of `limits` replaces the node's limit of
    /// the same dimension and period (or is added), each of `remove` (a dimension and a period)
    /// is dropped, the weight is replaced when given; every other limit and setting is kept.
    pub(crate) fn set_node(
        &self,
        path: &Tenant,
        (limits, remove): (&[LimitChange], &[LimitKey]),
        weight: Option<NonZeroU32>,
    ) -> Result<(), ConfigError> {
        let limits = limits
            .iter()
            .map(|l| {
                let limit = Limit::new(
                    dimension(&l.dimension)?,
                    l.amount,
                    Duration::from_secs(l.period_seconds),
                )
                .map_err(|e| {
                    ConfigError(format!("{} per {} s: {e}", l.dimension, l.period_seconds))
                })?;
                Ok(l.burst.map_or(limit, |burst| limit.with_burst(burst)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let remove = remove
            .iter()
            .map(|k| {
                Ok((
                    dimension(&k.dimension)?,
                    Duration::from_secs(k.period_seconds),
                ))
            })
            .collect::<Result<Vec<_>, ConfigError>>()?;
        // The accounts serve one tenant state: what it holds now is checked once.
        let current = self.accounts.first().and_then(|(_, h)| h.node(path));
        for (dimension, period) in &remove {
            let held = current.iter().flat_map(TenantNode::limits);
            if !held
                .into_iter()
                .any(|l| l.dimension() == *dimension && l.period() == *period)
            {
                return Err(ConfigError(format!(
                    "the tenant {path} has no {dimension} limit per {} s to remove",
                    period.as_secs()
                )));
            }
        }
        for (_, handle) in &self.accounts {
            // A node made here refuses at once what it cannot pay, as configured ones do.
            let old = handle.node(path).unwrap_or_else(node);
            let kept = old.limits().iter().filter(|l| {
                !remove
                    .iter()
                    .any(|(d, p)| l.dimension() == *d && l.period() == *p)
            });
            let mut node = kept
                .chain(&limits)
                .fold(without_limits(&old), |n, l| n.with_limit(*l));
            if let Some(weight) = weight {
                node = node.with_weight(weight);
            }
            handle
                .set_node(path, node)
                .map_err(|e| ConfigError(e.to_string()))?;
        }
        Ok(())
    }

    /// Every listed node, in path order, on every account: the node's own state (its limits
    /// and shares hold over every account, so they read the same on each) and `used`, what
    /// the ledger counted of its answers on that account over the last minute.
    pub(crate) fn snapshot(&self, ledger: &super::usage::Ledger) -> Vec<NodeView> {
        self.paths()
            .iter()
            .map(|path| {
                let shares: Vec<_> = self
                    .accounts
                    .iter()
                    .map(|(name, handle)| (name, handle.snapshot(path)))
                    .collect();
                let configured = self.accounts.first().and_then(|(_, h)| h.node(path));
                NodeView {
                    path: path.to_string(),
                    weight: configured.map_or(1, |node| node.weight().get()),
                    path_weight: shares.first().map_or(1, |(_, s)| s.weight()),
                    paused: shares.iter().any(|(_, s)| s.is_paused()),
                    accounts: shares
                        .iter()
                        .map(|(name, s)| ShareView {
                            account: (*name).clone(),
                            levels: s.limits().iter().map(LevelView::from).collect(),
                            caps: CapView::all(s.used_in_period()),
                            used: ledger.used_last_minute(name, path.as_str()),
                            guaranteed: s.guaranteed(),
                            borrowed: s.borrowed(),
                            in_flight: s.in_flight(),
                            queued: Priority::ALL.map(|p| s.queued(p)),
                        })
                        .collect(),
                }
            })
            .collect()
    }
}

/// How long a caller of a paused tenant is told to wait: a pause has no known end.
const PAUSED_RETRY_AFTER: Duration = Duration::from_secs(60);

fn paused(node: &Tenant) -> Refusal {
    Refusal::rate_limited("paused", format!("tenant:{node}"))
        .retry_after(Some(PAUSED_RETRY_AFTER))
        .message(format!("the tenant {node} is paused by an operator"))
}

/// The name of a cap over `window`, as limits are named: `spend_per_month`,
/// `total_tokens_per_day`.
fn cap_name(dimension: &str, window: CapWindow) -> String {
    match window {
        CapWindow::CalendarMonthUtc => format!("{dimension}_per_month"),
        _ => limit_name(dimension, Duration::from_secs(86_400)),
    }
}

/// A node the gateway makes (one the admin API names for the first time): it refuses at once
/// what it cannot pay now, as the configured ones do by default.
pub(crate) fn node() -> TenantNode {
    TenantNode::new().with_max_wait(Duration::ZERO)
}

/// The normalized refusal of a tenant scope, from the budget.
pub(crate) fn refused(refusal: &TenantRefused) -> Refusal {
    let scope = refusal.scope();
    match refusal.reason() {
        Why::Paused => paused(scope),
        Why::PeriodCap { dimension, window, resets_at, .. } => {
            let wait = resets_at.duration_since(std::time::SystemTime::now()).unwrap_or_default();
            // The account's own cap, or a node's.
            let scope = match refusal.account() {
                Some(account) => format!("account:{account}"),
                None => format!("tenant:{scope}"),
            };
            Refusal::rate_limited(cap_name(dimension.as_str(), window), scope)
                .dimension(Some(dimension.as_str()))
                .retry_after(Some(wait))
                .message(refusal.to_string())
        }
        Why::TooLarge { dimension, cost, capacity } => Refusal::bad_request(format!(
            "the request's {dimension} ({cost}) exceed what tenant {scope} may ever spend at once ({capacity})"
        ))
        .scope(format!("tenant:{scope}"))
        .dimension(Some(dimension.as_str())),
        // The node's own limit, past its `max_wait`: come back when it can pay.
        Why::RateLimited { dimension, period, retry_after } => {
            Refusal::rate_limited(limit_name(dimension.as_str(), period), format!("tenant:{scope}"))
                .dimension(Some(dimension.as_str()))
                .retry_after(Some(retry_after))
                .message(refusal.to_string())
        }
        // Its calls in flight are taken: when one ends is not known; a second is a guess.
        Why::InFlight { .. } => Refusal::rate_limited("in_flight", format!("tenant:{scope}"))
            .message(refusal.to_string()),
        _ => Refusal::rate_limited("tenant", format!("tenant:{scope}")).message(refusal.to_string()),
    }
}

/// A wait as OpenAI writes its resets: `250ms`, `1.5s`, `20s`, rounded up to the millisecond.
fn duration_text(wait: Duration) -> String {
    let millis = wait.as_nanos().div_ceil(1_000_000);
    if millis < 1_000 {
        return format!("{millis}ms");
    }
    let text = format!("{:.3}", millis as f64 / 1_000.0);
    format!("{}s", text.trim_end_matches('0').trim_end_matches('.'))
}

/// The names of a limit's headers in `dialect` (a limit, what is left, when it is full again;
/// Anthropic's has no reset here): OpenAI's, also for Google's callers (Google sends none);
/// Anthropic's by dimension.
fn header_names(dialect: Dialect, dimension: Dimension) -> ([HeaderName; 2], Option<HeaderName>) {
    let names: [&'static str; 3] = match (dialect, dimension) {
        (Dialect::OpenAi | Dialect::Gemini, Dimension::Requests) => [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        ],
        (Dialect::OpenAi | Dialect::Gemini, _) => [
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
        ],
        (Dialect::Anthropic, Dimension::Requests) => [
            "anthropic-ratelimit-requests-limit",
            "anthropic-ratelimit-requests-remaining",
            "",
        ],
        (Dialect::Anthropic, Dimension::InputTokens) => [
            "anthropic-ratelimit-input-tokens-limit",
            "anthropic-ratelimit-input-tokens-remaining",
            "",
        ],
        (Dialect::Anthropic, Dimension::OutputTokens) => [
            "anthropic-ratelimit-output-tokens-limit",
            "anthropic-ratelimit-output-tokens-remaining",
            "",
        ],
        (Dialect::Anthropic, _) => [
            "anthropic-ratelimit-tokens-limit",
            "anthropic-ratelimit-tokens-remaining",
            "",
        ],
    };
    let [limit, remaining, reset] = names;
    (
        [limit, remaining].map(HeaderName::from_static),
        (!reset.is_empty()).then(|| HeaderName::from_static(reset)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_is_named_by_its_period() {
        assert_eq!(
            cap_name("spend", CapWindow::CalendarMonthUtc),
            "spend_per_month"
        );
        assert_eq!(
            cap_name("requests", CapWindow::CalendarDayUtc),
            "requests_per_day"
        );
        assert_eq!(cap_name("requests", CapWindow::Rolling), "requests_per_day");
    }

    #[test]
    fn resets_read_as_openai_writes_them() {
        assert_eq!(duration_text(Duration::from_millis(250)), "250ms");
        assert_eq!(duration_text(Duration::from_millis(1_500)), "1.5s");
        assert_eq!(duration_text(Duration::from_secs(20)), "20s");
        assert_eq!(duration_text(Duration::from_nanos(1)), "1ms");
    }

    #[test]
    fn ancestry_runs_from_the_root() {
        let path = Tenant::parse("a/b/c").unwrap();
        let nodes: Vec<String> = ancestry(&path).map(|t| t.to_string()).collect();
        assert_eq!(nodes, ["a", "a/b", "a/b/c"]);
    }
}
