//! A budget's tenant tree: installing it, and the handle's operations, under the budget's one
//! lock (see the [`tenant`](crate::tenant) module).

mod handle;
#[cfg(feature = "metrics")]
mod metrics;
mod node;
pub(crate) mod state;
pub(crate) mod tree;

pub use handle::TenantHandle;

use std::task::Waker;

use tokio::time::Instant;

use super::handle::{Engine, State};
use crate::budget::engine::Ask;
use crate::quota::Limit;
use crate::tenant::{InvalidTree, Tenant, TenantNode, TenantSnapshot, TenantTree};
use state::Tenants;
use tree::NodeView;

impl Engine {
    /// Installs `tree` (validated) as the budget's tenant state, replacing any it had.
    pub(in crate::budget) fn install_tenants(&self, tree: TenantTree) {
        let mut state = self.lock();
        let account: Vec<Limit> = match &state.remote {
            Some(shared) => shared.limits().to_vec(),
            None => state.store.limits(),
        };
        let name = state.queue.label();
        let tenants = Tenants::new(tree, &account, name);
        tenants.set_account_caps(&state.caps);
        state.tenants = Some(tenants);
    }

    /// Serves the tenant state of `other` (none, if it has none), its times shifted to this
    /// budget's clock.
    pub(in crate::budget) fn serve_tenants_of(&self, other: &Engine) {
        let theirs = other.lock().tenants.clone();
        let nanos = |d: std::time::Duration| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX);
        let (mine, their) = (self.origin, other.origin);
        let later = nanos(mine.saturating_duration_since(their))
            - nanos(their.saturating_duration_since(mine));
        let mut state = self.lock();
        let name = state.queue.label();
        state.tenants = theirs.map(|tenants| tenants.shared_with(later, name));
        drop(state);
        self.count_caps();
    }

    /// Counts the account's own caps (`State::caps`) in its tenant state; without one, in a
    /// tree of no nodes of its own, made when there is a cap to count.
    pub(in crate::budget) fn count_caps(&self) {
        let state = self.lock();
        match &state.tenants {
            Some(tenants) => tenants.set_account_caps(&state.caps),
            None if !state.caps.is_empty() => {
                drop(state);
                self.install_tenants(TenantTree::new());
            }
            None => {}
        }
    }

    /// Writes every later change of a cap's count to `record`.
    pub(in crate::budget) fn record_caps(
        &self,
        record: std::sync::Arc<dyn crate::tenant::CapRecord>,
    ) {
        if let Some(tenants) = &self.lock().tenants {
            tenants.record_caps(record);
        }
    }

    /// Restores a cap's count: `used` in the period that began at `since`.
    pub(in crate::budget) fn restore_cap(
        &self,
        scope: crate::tenant::CapScope<'_>,
        cap: &crate::tenant::PeriodCap,
        since_used: (u64, u64),
    ) {
        if let Some(tenants) = &self.lock().tenants {
            tenants.restore_cap(scope, cap, since_used, Instant::now());
        }
    }

    pub(in crate::budget) fn same_tenants_as(&self, other: &Engine) -> bool {
        let mine = self.lock().tenants.clone();
        let theirs = other.lock().tenants.clone();
        matches!((mine, theirs), (Some(a), Some(b)) if a.same(&b))
    }

    /// Ends a parking (its request was dropped).
    pub(crate) fn unpark(&self, ask: &Ask, (depth, ticket): (usize, u64)) {
        let mut state = self.lock();
        if let (Some(tenants), Some(path)) = (&mut state.tenants, &ask.tenant) {
            tenants.unpark(path, depth, ticket);
        }
    }

    /// Pauses or resumes a scope of the tenant tree: a pause wakes its queued and parked
    /// requests, which are refused at once; a resume wakes the head. A budget shared through
    /// a store pauses the scope there too, for every process at its next admission.
    pub(crate) fn set_tenant_paused(&self, scope: &Tenant, paused: bool) {
        let now = Instant::now();
        let mut wakers = Vec::new();
        let mut state = self.lock();
        // Told to the store under the lock: a reading of the store's pauses under way does
        // not undo it.
        if let Some(remote) = &self.remote {
            remote.set_paused(scope.clone(), paused);
            // What the store will hold once the change lands: a later reading that finds the
            // pause gone (resumed by another process) resumes it here too.
            let mut seen =
                (remote.pauses_seen.lock()).unwrap_or_else(std::sync::PoisonError::into_inner);
            seen.retain(|path| path != scope);
            if paused {
                seen.push(scope.clone());
            }
        }
        let State { tenants, queue, .. } = &mut *state;
        let Some(tenants) = tenants else { return };
        tenants.set_paused(scope, paused, &mut wakers);
        if paused {
            wakers.extend(queue.wakers_of_tenants(|path| path.is_within(scope)));
        }
        wakers.extend(queue.head_waker(now));
        drop(state);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// This process's pauses and resumes so far, for a budget shared through a store with a
    /// tenant tree.
    pub(crate) fn pause_changes(&self) -> Option<u64> {
        let state = self.lock();
        state.tenants.as_ref()?;
        let remote = self.remote.as_ref()?;
        Some(
            remote
                .pause_changes
                .load(std::sync::atomic::Ordering::Acquire),
        )
    }

    /// Follows the store's `paused` nodes, unless this process paused or resumed one since
    /// `changes` (the reading is then stale): a node paused in the store since the last
    /// reading is paused here (its requests refused at once), one resumed there since is
    /// resumed here. A pause made here and not in this store (a tree shared with another
    /// account's budget) stays.
    pub(crate) fn sync_paused(&self, paused: &[Tenant], changes: u64) {
        let Some(remote) = &self.remote else {
            return;
        };
        let now = Instant::now();
        let mut wakers = Vec::new();
        let mut state = self.lock();
        if remote
            .pause_changes
            .load(std::sync::atomic::Ordering::Acquire)
            != changes
        {
            return;
        }
        let State { tenants, queue, .. } = &mut *state;
        let Some(tenants) = tenants else { return };
        let mut seen = remote
            .pauses_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for path in seen.iter().filter(|path| !paused.contains(path)) {
            tenants.set_paused(path, false, &mut wakers);
        }
        for path in paused.iter().filter(|path| !seen.contains(path)) {
            tenants.set_paused(path, true, &mut wakers);
            wakers.extend(queue.wakers_of_tenants(|p| p.is_within(path)));
        }
        *seen = paused.to_vec();
        drop(seen);
        wakers.extend(queue.head_waker(now));
        drop(state);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Replaces the configuration of a node of the tenant tree.
    pub(crate) fn set_tenant_node(
        &self,
        path: &Tenant,
        node: TenantNode,
    ) -> Result<(), InvalidTree> {
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let mut wakers = Vec::new();
        let mut state = self.lock();
        let State { tenants, queue, .. } = &mut *state;
        let Some(tenants) = tenants else {
            return Ok(());
        };
        // The tree with the new node must be enforceable as a whole (siblings' guarantees).
        let mut candidate = tenants.tree();
        candidate.nodes.insert(path.clone(), node.clone());
        candidate.validate()?;
        tenants.set_node(path.clone(), node, ns, &mut wakers);
        wakers.extend(queue.head_waker(now));
        drop(state);
        wakers.into_iter().for_each(Waker::wake);
        Ok(())
    }

    /// The configuration of a node of the tenant tree.
    pub(crate) fn tenant_config(&self, path: &Tenant) -> Option<TenantNode> {
        self.lock().tenants.as_ref()?.config(path)
    }

    /// How many nodes of the tenant tree hold state.
    pub(crate) fn tenant_live_nodes(&self) -> usize {
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let mut state = self.lock();
        let Some(tenants) = &mut state.tenants else {
            return 0;
        };
        tenants.sweep_all(ns, now);
        tenants.live()
    }

    /// A node of the tenant tree now.
    pub(crate) fn tenant_snapshot(&self, path: &Tenant) -> TenantSnapshot {
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let mut state = self.lock();
        let State { tenants, queue, .. } = &mut *state;
        let mut queued = [0; 3];
        for (priority, waiter) in queue.order().iter() {
            if waiter.tenant.as_ref().is_some_and(|t| t.is_within(path)) {
                queued[priority.index()] += 1;
            }
        }
        // Those stepped out of the ordering for a node's limits wait too.
        if let Some(tenants) = tenants.as_ref() {
            let parked = tenants.parked_within(path);
            queued.iter_mut().zip(parked).for_each(|(q, p)| *q += p);
        }
        let view = tenants.as_mut().map(|t| t.view(path, ns, now));
        drop(state);
        let view = view.unwrap_or_else(NodeView::empty);
        TenantSnapshot {
            path: path.clone(),
            limits: view
                .limits
                .into_iter()
                .map(|s| self.limit_snapshot(s))
                .collect(),
            weight: view.weight,
            paused: view.paused,
            in_flight: view.in_flight,
            used: view.used,
            guaranteed: view.guaranteed,
            queued,
            today: view.today,
        }
    }
}
