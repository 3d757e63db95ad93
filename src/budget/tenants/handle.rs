//! The operator's handle on a budget's tenant tree: pause, resume, change, look.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;

use crate::budget::Budget;
use crate::quota::Limit;
use crate::tenant::InvalidTree;
use crate::tenant::Tenant;
use crate::tenant::TenantNode;
use crate::tenant::TenantSnapshot;
use crate::tenant::{CapRecord, CapScope, PeriodCap};

/// Changes and reads the tenant tree of a [`Budget`] while it runs; from
/// [`Budget::tenants`]. Clones share the budget.
///
/// Every change takes effect at once, for requests waiting as for new ones, under the
/// budget's lock (a node's levels and counts carry over a change of its limits).
#[derive(Clone)]
pub struct TenantHandle {
    pub(crate) budget: Budget,
}

impl TenantHandle {
    /// Pauses `scope` (a tenant, a team, a key): its queued requests and every new one at or
    /// below it fail at once with a [`TenantRefused`](crate::tenant::TenantRefused) naming it, and
    /// nothing of it is sent until [`resume`](TenantHandle::resume). Calls already sent run
    /// to their end. Other tenants are unaffected.
    pub fn pause(&self, scope: &Tenant) {
        self.budget.engine.set_tenant_paused(scope, true);
    }

    /// Ends a pause of `scope`.
    pub fn resume(&self, scope: &Tenant) {
        self.budget.engine.set_tenant_paused(scope, false);
    }

    /// Replaces the configuration of the node at `path` (limits, weight, guarantee, caps).
    ///
    /// # Errors
    ///
    /// [`InvalidTree`] when the tree with this node could not be enforced (a share out of
    /// range, siblings' guarantees above the whole, a cap below the guarantee): nothing
    /// changes.
    pub fn set_node(&self, path: &Tenant, node: TenantNode) -> Result<(), InvalidTree> {
        self.budget.engine.set_tenant_node(path, node)
    }

    /// Adds or replaces one limit of the node at `path` (of the same dimension and period),
    /// keeping the rest of its configuration.
    ///
    /// # Errors
    ///
    /// As [`set_node`](Self::set_node).
    pub fn set_limit(&self, path: &Tenant, limit: Limit) -> Result<(), InvalidTree> {
        let node = self.node(path).unwrap_or_default().with_limit(limit);
        self.set_node(path, node)
    }

    /// Sets the weight of the node at `path`, keeping the rest of its configuration; requests
    /// already waiting keep their place.
    ///
    /// # Errors
    ///
    /// As [`set_node`](Self::set_node).
    pub fn set_weight(&self, path: &Tenant, weight: NonZeroU32) -> Result<(), InvalidTree> {
        let node = self.node(path).unwrap_or_default().with_weight(weight);
        self.set_node(path, node)
    }

    /// The configuration of the node at `path`: its own, else its depth's template.
    pub fn node(&self, path: &Tenant) -> Option<TenantNode> {
        self.budget.engine.tenant_config(path)
    }

    /// The node at `path` now: limits and levels, use, guarantee, borrowing, queue, the day's
    /// use. A node with no traffic and no state of its own reads as fresh.
    pub fn snapshot(&self, path: &Tenant) -> TenantSnapshot {
        self.budget.engine.tenant_snapshot(path)
    }

    /// Writes every later change of a cap's count over a period (the nodes' caps, and the
    /// caps of the accounts served) to `record`, so that the counts outlive the process;
    /// see [`CapRecord`]. With a budget kept in a store, the store counts caps for every
    /// process and this records the process's own view only.
    pub fn record_caps(&self, record: Arc<dyn CapRecord>) {
        self.budget.engine.record_caps(record);
    }

    /// Counts at least `used` in `scope`'s cap of `cap`'s dimension and window (its amount
    /// may have changed since) for the period that began at `since` (seconds since the
    /// epoch), as a [`CapRecord`] kept it: a restarted process's caps start where they were.
    /// Raised, never lowered; nothing for a cap `scope` does not have, or a period that has
    /// ended.
    pub fn restore_cap(&self, scope: CapScope<'_>, cap: PeriodCap, since: u64, used: u64) {
        self.budget.engine.restore_cap(scope, &cap, (since, used));
    }

    /// How many nodes hold state now: those with traffic in flight or recent, a pause, a
    /// day's use, or buckets not yet full again. Idle nodes are forgotten as admissions go on
    /// (one looked at per admission), and all at once by this call, which looks at every
    /// live node.
    pub fn live_nodes(&self) -> usize {
        self.budget.engine.tenant_live_nodes()
    }
}

impl fmt::Debug for TenantHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantHandle")
            .field("live_nodes", &self.live_nodes())
            .finish()
    }
}
