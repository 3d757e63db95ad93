//! The handle a budget holds on its tenants' run-time state. Every budget that serves the
//! same tenants (one per provider account, say) holds a handle on one state, so that a
//! tenant's limits, calls in flight, daily caps and pauses hold over every account it uses:
//! the provider account is the bottom of a tenant's path, not the top of a tree of its own.
//!
//! The state lives behind a mutex of its own, always taken *inside* a budget's lock and never
//! the other way round, and it never calls back into a budget: a budget checks and takes a
//! path in one step under both locks. Each budget's times are nanoseconds since its own
//! origin; the handle shifts them to the state's clock and back.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Waker;

use tokio::time::Instant;

use super::tree::{Check, NodeView, TenantState};
use crate::budget::store::PathLimits;
use crate::cost::Cost;
use crate::priority::Priority;
use crate::quota::Limit;
use crate::sched::Flow;
use crate::tenant::{PeriodCap, Tenant};
use crate::tenant::{Refusal, TenantRefused};
use crate::tenant::{TenantNode, TenantTree};

/// A budget's handle on its tenants' state.
#[derive(Debug, Clone)]
pub(crate) struct Tenants {
    state: Arc<Mutex<TenantState>>,
    /// What to add to this budget's nanoseconds to get the state's.
    shift: i128,
    /// The budget's name: nodes scoped to another account are passed over.
    account: Arc<str>,
}

impl Tenants {
    /// Tenants of their own, for a budget whose account limits are `account`.
    pub(crate) fn new(tree: TenantTree, limits: &[Limit], account: Arc<str>) -> Self {
        Self {
            state: Arc::new(Mutex::new(TenantState::new(tree, limits))),
            shift: 0,
            account,
        }
    }

    /// The same tenants for a budget named `account` whose clock starts `later` nanoseconds
    /// after the clock of the budget holding `self` (negative: before).
    pub(crate) fn shared_with(&self, later: i128, account: Arc<str>) -> Self {
        Self {
            state: Arc::clone(&self.state),
            shift: self.shift + later,
            account,
        }
    }

    /// Sets the caps of this budget's account itself (none: it has none).
    pub(crate) fn set_account_caps(&self, caps: &[PeriodCap]) {
        self.lock().set_account_caps(&self.account, caps);
    }

    /// What this budget's account's own caps have used in their periods.
    pub(crate) fn account_caps(&self, at: Instant) -> Vec<(PeriodCap, u64)> {
        self.lock().account_caps(&self.account, at)
    }

    /// Writes every later change of a cap's count to `record`.
    pub(crate) fn record_caps(&self, record: std::sync::Arc<dyn crate::tenant::CapRecord>) {
        self.lock().record_caps(record);
    }

    /// Restores a cap's count (see [`TenantState::restore_cap`](super::tree::TenantState)).
    pub(crate) fn restore_cap(
        &self,
        scope: crate::tenant::CapScope<'_>,
        cap: &PeriodCap,
        (since, used): (u64, u64),
        at: Instant,
    ) {
        self.lock().restore_cap(scope, cap, since, used, at);
    }

    /// Whether two handles are on one state.
    pub(crate) fn same(&self, other: &Tenants) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }

    fn lock(&self) -> MutexGuard<'_, TenantState> {
        // The state holds no invariant a panic elsewhere could break half-way.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// This budget's time on the state's clock.
    fn there(&self, ns: u64) -> u64 {
        clamp(i128::from(ns) + self.shift)
    }

    /// The state's time on this budget's clock.
    fn here(&self, ns: u64) -> u64 {
        clamp(i128::from(ns) - self.shift)
    }

    /// Records in how many processes each flow waits (a lease's renewal).
    pub(crate) fn spread(
        &self,
        flows: impl Iterator<Item = (u64, u32)>,
        guarantees: impl Iterator<Item = (u64, u32)>,
        share: f64,
    ) {
        self.lock().spread(flows, guarantees, share);
    }

    pub(crate) fn guarantees_of(&self, keys: &[u64]) -> Vec<(u64, u32)> {
        self.lock().guarantees_of(keys)
    }

    /// Turns the fleet weights of `flows` back into their configured weights.
    pub(crate) fn unspread(&self, flows: &mut [(u64, u32)]) {
        self.lock().unspread(flows);
    }

    pub(crate) fn path_of(&self, tenant: Option<&Tenant>) -> Tenant {
        self.lock().path_of(tenant)
    }

    pub(crate) fn live(&self) -> usize {
        self.lock().live()
    }

    pub(crate) fn tree(&self) -> TenantTree {
        self.lock().tree.clone()
    }

    pub(crate) fn config(&self, path: &Tenant) -> Option<TenantNode> {
        self.lock().tree.node(path).cloned()
    }

    #[cfg(feature = "metrics")]
    pub(crate) fn label_depth(&self) -> usize {
        self.lock().tree.label_depth
    }

    pub(crate) fn check(
        &self,
        path: &Tenant,
        cost: &Cost,
        now: u64,
        at: Instant,
        arrived: Instant,
    ) -> Check {
        let now = self.there(now);
        match self
            .lock()
            .check(&self.account, path, cost, now, at, arrived)
        {
            Check::Blocked { depth, at, give_up } => Check::Blocked {
                depth,
                at: at.map(|(ready, limit)| (self.here(ready), limit)),
                give_up: give_up.map(|g| self.here(g)),
            },
            other => other,
        }
    }

    /// The tree's wall clock at `at`, in seconds since the epoch.
    pub(crate) fn unix_seconds(&self, at: Instant) -> u64 {
        self.lock().tree.clock.unix_seconds(at)
    }

    pub(crate) fn take(&self, path: &Tenant, cost: &Cost, now: u64, at: Instant) {
        self.lock()
            .take(&self.account, path, cost, self.there(now), at);
    }

    pub(crate) fn settle(
        &self,
        path: &Tenant,
        (reserved, actual): (&Cost, &Cost),
        now: u64,
        at: Instant,
        wakers: &mut Vec<Waker>,
    ) {
        let now = self.there(now);
        self.lock()
            .settle(&self.account, path, (reserved, actual), now, at, wakers);
    }

    pub(crate) fn flow(&self, path: &Tenant) -> Flow {
        self.lock().flow(path)
    }

    pub(crate) fn park(
        &self,
        path: &Tenant,
        depth: usize,
        priority: Priority,
        waker: &Waker,
    ) -> u64 {
        self.lock().park(path, depth, priority, waker)
    }

    pub(crate) fn parked_within(&self, scope: &Tenant) -> [usize; 3] {
        self.lock().parked_within(scope)
    }

    pub(crate) fn refuses_after(
        &self,
        path: &Tenant,
        depth: usize,
        refusal: Refusal,
        wait: std::time::Duration,
        times: (Instant, Instant),
    ) -> Option<TenantRefused> {
        self.lock().refuses_after(path, depth, refusal, wait, times)
    }

    pub(crate) fn unpark(&self, path: &Tenant, depth: usize, ticket: u64) {
        self.lock().unpark(path, depth, ticket);
    }

    pub(crate) fn set_paused(&self, scope: &Tenant, paused: bool, wakers: &mut Vec<Waker>) {
        self.lock().set_paused(scope, paused, wakers);
    }

    pub(crate) fn set_node(
        &self,
        path: Tenant,
        config: TenantNode,
        now: u64,
        wakers: &mut Vec<Waker>,
    ) {
        self.lock().set_node(path, config, self.there(now), wakers);
    }

    /// Whether any node has limits or controls a shared store keeps (see
    /// `TenantState::keeps_any_in_store`).
    pub(crate) fn keeps_any_in_store(&self) -> bool {
        self.lock().keeps_any_in_store()
    }

    /// The daily caps a store may count for every process (see `TenantState::caps`).
    pub(crate) fn caps(&self) -> Vec<(Tenant, PeriodCap)> {
        self.lock().caps(&self.account)
    }

    /// What the store counts of `caps` for every process.
    pub(crate) fn set_fleet_days(&self, caps: Vec<(Tenant, PeriodCap)>, used: &[u64]) {
        self.lock().set_fleet_days(caps, used);
    }

    pub(crate) fn shared_path(&self, path: &Tenant) -> PathLimits {
        self.lock().shared_path(&self.account, path)
    }

    pub(crate) fn view(&self, path: &Tenant, now: u64, at: Instant) -> NodeView {
        let mut view = self.lock().view(path, self.there(now), at);
        for limit in &mut view.limits {
            limit.available_at = self.here(limit.available_at);
            limit.full_at = self.here(limit.full_at);
        }
        view
    }

    pub(crate) fn sweep_all(&self, now: u64, at: Instant) {
        self.lock().sweep_all(self.there(now), at);
    }
}

/// Counts a refusal by a scope (feature `metrics`).
#[cfg(feature = "metrics")]
pub(crate) fn refused_metric(tenants: &Tenants, refused: &TenantRefused) {
    super::metrics::refused(tenants.label_depth(), refused);
}

fn clamp(ns: i128) -> u64 {
    u64::try_from(ns.max(0)).unwrap_or(u64::MAX)
}
