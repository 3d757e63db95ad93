//! A budget's tenant tree: installing it, and the handle's operations, under the budget's one
//! lock (see the [`tenant`](crate::tenant) module).

mod handle;
#[cfg(feature = "metrics")]
mod metrics;
mod node;
pub(crate) mod shared;
pub(crate) mod tree;

pub use handle::TenantHandle;

use std::task::Waker;

use tokio::time::Instant;

use super::handle::State;
use super::{Budget, LimitSnapshot};
use crate::budget::engine::Ask;
use crate::quota::{Limit, Quota};
use crate::tenant::{InvalidTree, Tenant, TenantNode, TenantSnapshot, TenantTree};
use shared::Tenants;
use tree::NodeView;

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
        let name = state.queue.label();
        state.tenants = Some(Tenants::new(tree, &account, name));
        drop(state);
        Ok(self)
    }

    /// The same budget (every clone of it) serving the tenants of `other`, the budget of
    /// another provider account: both hold one tenant state, so a tenant's limits, calls in
    /// flight, daily caps and pauses hold over every account it uses (a tenant of 20 requests
    /// a minute gets 20 in all, not 20 on each account). Each budget keeps its own ordering
    /// and fair share; guarantees and borrowing caps are shares of `other`'s account, as
    /// the state was made for it. Changes through either budget's
    /// [`tenants`](Budget::tenants) handle reach both; a pause refuses the other budget's
    /// queued requests of the scope when they next look (their turn or their timer), its
    /// parked ones at once. Replaces any tree this budget had; when `other` has none, this
    /// one has none either.
    ///
    /// With a shared store (Redis), a node's limits are also kept in each account's store
    /// and so hold per account across processes; within one process they hold over all.
    ///
    /// # Example
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use tower_llm_quota::tenant::{TenantNode, TenantTree};
    /// use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota};
    ///
    /// let nz = |n| NonZeroU64::new(n).unwrap();
    /// let tree = TenantTree::new().with_node(
    ///     "acme".parse()?,
    ///     TenantNode::new().with_limit(Limit::per_minute(Dimension::Requests, nz(20))),
    /// );
    /// let account = || Quota::new().with_limit(Limit::per_minute(Dimension::Requests, nz(500)));
    /// let openai = Budget::with_tenants(account(), tree)?;
    /// let anthropic = Budget::new(account()).with_tenants_of(&openai);
    /// let acme = "acme".parse()?;
    /// let mut held = Vec::new();
    /// for i in 0..20 {
    ///     let budget = if i % 2 == 0 { &openai } else { &anthropic };
    ///     held.push(budget.try_reserve_for(Cost::requests_only(1), &acme)?);
    /// }
    /// // The 21st of the minute, on either account, must wait.
    /// assert!(anthropic.try_reserve_for(Cost::requests_only(1), &acme).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_tenants_of(self, other: &Budget) -> Self {
        let theirs = other.lock().tenants.clone();
        let later = i128::try_from(
            self.shared
                .origin
                .saturating_duration_since(other.shared.origin)
                .as_nanos(),
        )
        .unwrap_or(i128::MAX)
            - i128::try_from(
                other
                    .shared
                    .origin
                    .saturating_duration_since(self.shared.origin)
                    .as_nanos(),
            )
            .unwrap_or(i128::MAX);
        let mut state = self.lock();
        let name = state.queue.label();
        state.tenants = theirs.map(|tenants| tenants.shared_with(later, name));
        drop(state);
        self
    }

    /// Whether this budget and `other` serve one tenant state
    /// ([`with_tenants_of`](Budget::with_tenants_of)).
    pub fn shares_tenants_with(&self, other: &Budget) -> bool {
        let mine = self.lock().tenants.clone();
        let theirs = other.lock().tenants.clone();
        matches!((mine, theirs), (Some(a), Some(b)) if a.same(&b))
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
