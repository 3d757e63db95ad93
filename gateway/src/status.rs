//! `/`, the status page (one static HTML file that fetches `/status.json` every second),
//! `/status.json`, `/healthz`, and the gauges `/metrics` renders.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{Html, IntoResponse};
use http::StatusCode;
use metrics::gauge;
use serde::Serialize;
use tower_llm_quota::Priority;
use tower_llm_quota::queue::QueueSnapshot;

use super::Gateway;
use super::tenancy::{CapView, LevelView, NodeView};
use super::usage::{Counts, HourView, RefusalRecord, Whose};

/// A tenant node with today's usage of its subtree.
#[derive(Debug, Serialize)]
pub(crate) struct TenantStatus {
    #[serde(flatten)]
    pub(crate) node: NodeView,
    pub(crate) usage: Counts,
    /// The node's settings an admin override holds over the file's (`requests_per_minute`,
    /// `weight`): `GET /admin/overrides` says who, when, and the file's value.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) overridden: Vec<String>,
    /// Its last hour, minute by minute: tokens answered, their spend, refusals.
    pub(crate) hour: HourView,
}

/// An account: its limits now, calls in flight, requests queued by class.
#[derive(Debug, Serialize)]
struct AccountStatus {
    name: String,
    levels: Vec<LevelView>,
    /// The account's caps over a day or a month, with what the period used.
    caps: Vec<CapView>,
    /// The limit with the least of its burst left now: the one that binds when requests wait.
    binding: Option<String>,
    in_flight: usize,
    queued: Vec<(&'static str, usize)>,
    /// With a shared store: the live replicas on the account at the store's last count (each
    /// falls back to that share of it while the store is out of reach).
    #[serde(skip_serializing_if = "Option::is_none")]
    live_replicas: Option<u32>,
    /// With a shared store: whether the account admits through it now (`false` while it
    /// falls back to its local share, or refuses).
    #[serde(skip_serializing_if = "Option::is_none")]
    store_reachable: Option<bool>,
    /// What the in-process simulator behind the account saw (none for a real upstream).
    #[serde(skip_serializing_if = "Option::is_none")]
    simulator: Option<SimulatorView>,
    /// The account's last hour, minute by minute (on its own row; not on its scopes').
    #[serde(skip_serializing_if = "Option::is_none")]
    hour: Option<HourView>,
}

/// The calls an in-process simulator received, answered and refused with a 429.
#[derive(Debug, Clone, Copy, Serialize)]
struct SimulatorView {
    received: u64,
    admitted: u64,
    rate_limited: u64,
}

#[derive(Debug, Serialize)]
struct Status {
    /// Whose requests the tenants' `usage` counts: `this replica` when replicas share the
    /// state (the fleet's are in `GET /admin/report`), else `the gateway`.
    usage_counted_by: &'static str,
    tenants: Vec<TenantStatus>,
    accounts: Vec<AccountStatus>,
    refusals: Vec<RefusalRecord>,
    stopping: bool,
}

pub(crate) fn tenants(gateway: &Gateway) -> Vec<TenantStatus> {
    let (parsed, _) = super::state::parse(&gateway.applied_state());
    let overrides = super::overrides::list(&gateway.config(), &parsed);
    gateway
        .tenants
        .snapshot(&gateway.ledger)
        .into_iter()
        .map(|node| TenantStatus {
            usage: gateway.ledger.counts_under(&node.path),
            hour: gateway.ledger.last_hour(Whose::Node(&node.path)),
            overridden: (overrides.iter())
                .filter(|o| o.tenant.as_deref() == Some(node.path.as_str()))
                .map(|o| o.setting.clone())
                .collect(),
            node,
        })
        .collect()
}

/// A row per account and, for an account with scopes, a row of its account-wide limits (the
/// gate, named after the account), then one per scope (`account/scope`, `account/*` for the
/// models no scope names).
fn accounts(gateway: &Gateway) -> Vec<AccountStatus> {
    let mut rows = Vec::new();
    for account in &gateway.accounts {
        let simulator = account.simulator.as_ref().map(|s| {
            let stats = s.stats();
            SimulatorView {
                received: stats.received,
                admitted: stats.admitted,
                rate_limited: stats.rate_limited,
            }
        });
        // A budget's row, its requests queued by class as `queue` counts them.
        let row = |name: String, budget: &tower_llm_quota::Budget, queue: QueueSnapshot| {
            let hour =
                (name == account.name).then(|| gateway.ledger.last_hour(Whose::Account(&name)));
            let snapshot = budget.snapshot();
            let levels: Vec<LevelView> = snapshot.limits().iter().map(LevelView::from).collect();
            let left = |l: &LevelView| l.level as f64 / l.capacity.max(1) as f64;
            let binding = levels
                .iter()
                .min_by(|a, b| left(a).total_cmp(&left(b)))
                .map(|l| l.limit.clone());
            AccountStatus {
                name,
                caps: CapView::all(snapshot.used_in_period()),
                levels,
                binding,
                in_flight: snapshot.in_flight(),
                live_replicas: snapshot.live_processes(),
                store_reachable: budget.is_shared().then(|| budget.is_store_reachable()),
                queued: Priority::ALL
                    .iter()
                    .map(|p| (p.as_str(), queue.class(*p).depth()))
                    .collect(),
                simulator,
                hour,
            }
        };
        let Some(gate) = account.gate() else {
            let queue = account.queue().snapshot();
            rows.push(row(account.name.clone(), account.budget(), queue));
            continue;
        };
        let own = |budget: &tower_llm_quota::Budget| budget.queue_snapshot();
        rows.push(row(account.name.clone(), gate, own(gate)));
        let main = account.budget();
        rows.push(row(format!("{}/*", account.name), main, own(main)));
        for scope in account.scopes() {
            let name = scope.name().unwrap_or("*");
            let budget = scope.budget();
            rows.push(row(format!("{}/{name}", account.name), budget, own(budget)));
        }
    }
    rows
}

/// Whose requests the usage counts ([`super::usage::Ledger`] is each process's own).
pub(crate) fn counted_by(gateway: &Gateway) -> &'static str {
    if gateway.state.is_shared() {
        "this replica"
    } else {
        "the gateway"
    }
}

pub(crate) async fn page() -> Html<&'static str> {
    Html(include_str!("status.html"))
}

pub(crate) async fn json(State(gateway): State<Arc<Gateway>>) -> impl IntoResponse {
    Json(status(&gateway))
}

fn status(gateway: &Gateway) -> Status {
    Status {
        usage_counted_by: counted_by(gateway),
        tenants: tenants(gateway),
        accounts: accounts(gateway),
        refusals: gateway.ledger.last_refusals(),
        stopping: gateway.shutdown.is_cancelled(),
    }
}

impl Gateway {
    /// What `/status.json` answers now: the tenants with their levels and today's usage, the
    /// accounts with their levels, calls in flight and requests queued by class, the last
    /// refusals. Also after [`serve`](crate::serve()) returned.
    pub fn status(&self) -> serde_json::Value {
        serde_json::to_value(status(self)).unwrap_or_default()
    }
}

pub(crate) async fn healthz(State(gateway): State<Arc<Gateway>>) -> impl IntoResponse {
    if gateway.shutdown.is_cancelled() {
        (StatusCode::SERVICE_UNAVAILABLE, "stopping")
    } else {
        (StatusCode::OK, "ok")
    }
}

/// Sets the level gauges of every tenant and account, and the queue depths, before a scrape.
pub(crate) fn record_gauges(gateway: &Gateway) {
    for tenant in gateway.tenants.snapshot(&gateway.ledger) {
        for share in &tenant.accounts {
            let labels = |name: &'static str| {
                let (tenant, account) = (tenant.path.clone(), share.account.clone());
                gauge!(name, "tenant" => tenant, "account" => account)
            };
            labels("gateway_tenant_used_tokens_per_minute").set(share.used as f64);
            labels("gateway_tenant_guaranteed_tokens_per_minute").set(share.guaranteed as f64);
            labels("gateway_tenant_borrowed_tokens_per_minute").set(share.borrowed as f64);
            labels("gateway_tenant_queued").set(share.queued.iter().sum::<usize>() as f64);
            for level in &share.levels {
                gauge!("gateway_tenant_level", "tenant" => tenant.path.clone(),
                    "account" => share.account.clone(), "limit" => level.limit.clone())
                .set(level.level as f64);
            }
        }
        gauge!("gateway_tenant_paused", "tenant" => tenant.path.clone())
            .set(f64::from(u8::from(tenant.paused)));
    }
    for account in accounts(gateway) {
        gauge!("gateway_account_in_flight", "account" => account.name.clone())
            .set(account.in_flight as f64);
        for (class, depth) in account.queued {
            gauge!("gateway_account_queued", "account" => account.name.clone(), "class" => class)
                .set(depth as f64);
        }
        for level in &account.levels {
            let labels = |name: &'static str| gauge!(name, "account" => account.name.clone(), "limit" => level.limit.clone());
            labels("gateway_account_level").set(level.level as f64);
            labels("gateway_account_burst").set(level.capacity as f64);
        }
    }
}
