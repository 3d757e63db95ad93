//! A budget's tenant tree: installing it, and the handle's operations, under the budget's one
//! lock (see the [`tenant`](crate::tenant) module).

use std::task::Waker;

use tokio::time::Instant;

use super::handle::State;
use super::{Budget, LimitSnapshot};
use crate::budget::waiters::Ask;
use crate::quota::{Limit, Quota};
use crate::tenant::tree::{NodeView, Tenants};
use crate::tenant::{InvalidTree, Tenant, TenantHandle, TenantNode, TenantSnapshot, TenantTree};

impl Budget {
    /// A budget enforcing every limit of `quota` for the account, and `tree` for its tenants:
    /// a request is admitted only when the account and every node of its
    /// [`Tenant`] path can pay, and waiting requests share a class by
    /// weighted fair queuing over token cost. See the [`tenant`](crate::tenant) module.
    ///
    /// Fails when the tree cannot be enforced (guarantees of siblings above the whole, a cap
    /// below a guarantee).
    pub fn with_tenants(quota: Quota, tree: TenantTree) -> Result<Self, InvalidTree> {
        Self::new(quota).with_tenant_tree(tree)
    }

    /// The same budget (every clone of it) enforcing `tree` for its tenants from now on,
    /// replacing any tree it had: for a budget built elsewhere, such as one shared through
    /// Redis ([`RedisBudget`](crate::budget::redis::RedisBudget)), whose store then keeps
    /// every node's limits beside the account's, checked and taken in the same script call.
    /// Install it before traffic: requests already waiting keep the place they had.
    ///
    /// Fails when the tree cannot be enforced.
    pub fn with_tenant_tree(self, tree: TenantTree) -> Result<Self, InvalidTree> {
        tree.validate()?;
        let mut state = self.lock();
        let account: Vec<Limit> = match &state.shared {
            Some(shared) => shared.limits().to_vec(),
            None => state.store.limits(),
        };
        state.tenants = Some(Tenants::new(tree, &account));
        drop(state);
        Ok(self)
    }

    /// The handle on the budget's tenant tree (pause, resume, limits, snapshots), when it has
    /// one.
    pub fn tenants(&self) -> Option<TenantHandle> {
        self.lock().tenants.as_ref()?;
        Some(TenantHandle {
            budget: self.clone(),
        })
    }

    /// Ends a parking (its request was dropped).
    pub(crate) fn unpark(&self, ask: &Ask, (depth, ticket): (usize, u64)) {
        let mut state = self.lock();
        if let (Some(tenants), Some(path)) = (&mut state.tenants, &ask.tenant) {
            tenants.unpark(path, depth, ticket);
        }
    }

    /// Pauses or resumes a scope of the tenant tree: a pause wakes its queued and parked
    /// requests, which are refused at once; a resume wakes the head.
    pub(crate) fn set_tenant_paused(&self, scope: &Tenant, paused: bool) {
        let now = Instant::now();
        let mut wakers = Vec::new();
        let mut state = self.lock();
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
        let mut candidate = tenants.tree.clone();
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
        self.lock().tenants.as_ref()?.tree.node(path).cloned()
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
                .map(|s| LimitSnapshot {
                    limit: s.limit,
                    capacity: s.capacity,
                    level: s.level,
                    available_at: self.instant(s.available_at),
                    full_at: self.instant(s.full_at),
                })
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
