//! The budget's public API in one place: making a budget, admission, what it holds now,
//! changes to its limits, its tenants, its shared store. Each method is short or delegates:
//! admission to the wait engine (`engine/`), the arithmetic to the in-memory backend
//! (`memory/`) or the store kept with other processes (`store/`), the tenants' state to `tenants/`.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::engine::Ask;
use super::handle::{Budget, Engine};
use super::memory::store::{MemoryStore, Store};
use super::observation::Observation;
use super::reservation::Reservation;
use super::reserve::Reserve;
use super::snapshot::BudgetSnapshot;
use super::store::{QuotaStore, StoreOptions};
use crate::cost::Cost;
use crate::error::TryReserveError;
use crate::priority::Priority;
use crate::quota::{Dimension, Limit, PeriodCap, Quota};
use crate::sched::QueueSnapshot;
use crate::tenant::{InvalidTree, Tenant, TenantHandle, TenantTree};

/// Making a budget.
impl Budget {
    /// A budget enforcing every limit of `quota`, with every bucket full.
    pub fn new(quota: Quota) -> Self {
        Self {
            engine: Engine::new(&quota, MemoryStore::new(&quota), None, None),
        }
    }

    /// Whether two handles share the same budget.
    pub fn ptr_eq(&self, other: &Budget) -> bool {
        Arc::ptr_eq(&self.engine, &other.engine)
    }
}

/// What the budget holds now.
impl Budget {
    /// The state of every limit and of the queue, now.
    ///
    /// For a budget shared through a store in another process (Redis), the limits are those
    /// of its local fallback share, with the levels this process spent from it while the
    /// store was out of reach; the shared levels live in the store.
    pub fn snapshot(&self) -> BudgetSnapshot {
        let now = Instant::now();
        let ns = self.engine.nanos_since_origin(now);
        let state = self.engine.lock();
        let limits = state
            .store
            .snapshot(ns)
            .into_iter()
            .map(|s| self.engine.limit_snapshot(s))
            .collect();
        let caps = (state.tenants.as_ref()).map_or_else(Vec::new, |t| t.account_caps(now));
        BudgetSnapshot {
            taken_at: now,
            limits,
            waiters: state.queue.len(),
            queued: state.queue.queued(),
            in_flight: state.slots.used(),
            max_in_flight: state.slots.max(),
            caps,
            live_processes: state.remote.as_ref().and_then(|r| r.live),
        }
    }

    /// The requests waiting for admission, by class (the budget's ordering).
    pub fn queue_snapshot(&self) -> QueueSnapshot {
        self.engine.lock().queue.order().snapshot(Instant::now())
    }

    /// How many requests wait for admission.
    pub fn waiters(&self) -> usize {
        self.engine.lock().queue.len()
    }
}

/// Changes to its limits: configured, reported by the provider, paused.
impl Budget {
    /// Caps the calls in flight at `max` (`None`: no cap), from now on; a slot is held from
    /// admission until the reservation ends (with [`ReconcileLayer`](crate::ReconcileLayer),
    /// when the response body ends). Lowering it below the calls in flight admits nobody until
    /// enough of them end. Defaults to the quota's
    /// [`max_in_flight`](Quota::with_max_in_flight).
    pub fn set_max_in_flight(&self, max: Option<NonZeroUsize>) {
        self.engine.update_state(|state| {
            state.slots.set_max(max);
            true
        });
    }

    /// Replaces the limit of the same dimension and period (or adds it), keeping the bucket's
    /// current level, clamped to the new capacity. Waiters are re-examined at once (for a
    /// shared budget, the head asks the store again when the store's last wait is over).
    pub fn set_limit(&self, limit: Limit) {
        let now = self.engine.nanos_since_origin(Instant::now());
        self.engine.update_state(|state| {
            let local = match &mut state.remote {
                Some(shared) => shared.set_limit(limit),
                None => limit,
            };
            state.store.set_limit(local, now);
            true
        });
    }

    /// Replaces the account's own caps over a period ([`Quota::with_cap`]) from now on,
    /// keeping what the current period used of each cap that stays (same dimension and
    /// window); a new cap counts from the change; an empty list removes them. A shared
    /// budget's counts live in its store and carry over there too.
    pub fn set_caps(&self, caps: &[PeriodCap]) {
        self.engine.lock().caps = caps.to_vec();
        self.engine.count_caps();
    }

    /// Applies a provider's report on one of the limits; see [`Observation`].
    ///
    /// A shared budget writes it to the shared store too, in the background, so that every
    /// process sharing the quota sees it.
    pub fn observe(&self, observation: &Observation) {
        let now = self.engine.nanos_since_origin(Instant::now());
        self.engine.update_state(|state| match &mut state.remote {
            Some(shared) => {
                let lowered = shared.observe(observation);
                if let Some(remote) = self.engine.remote.as_ref() {
                    for &(limit, remaining) in &lowered {
                        remote.lower(limit, Some(remaining), Duration::ZERO);
                    }
                }
                // What the provider has left lowers the account's bucket in the store. A
                // leasing process's wallets hold what was granted, but never more than the
                // provider reports left of the whole account (someone else spent the rest:
                // the grant would be spent into 429s). The fallback share does not adapt:
                // other processes spend the shared quota.
                match state.store.holds_wallets() {
                    true => {
                        for (limit, remaining) in &lowered {
                            state.store.cap_wallet(limit, *remaining, now);
                        }
                        false
                    }
                    false => {
                        state
                            .store
                            .observe(&shared.local_observation(observation), now, false)
                    }
                }
            }
            None => state.store.observe(observation, now, true),
        });
    }

    /// Admits nothing in any of `dimensions` until `until`, for every holder of this budget:
    /// the provider said (with a 429) that the quota they share is spent until then. The
    /// shortest window of each dimension is held until then, keeping its level (lower it to
    /// what the provider reports with [`Budget::observe`]), so that when the pause ends the
    /// bucket holds what it refilled meanwhile, not nothing; longer windows, such as a daily
    /// limit, are not held. A later pause extends an earlier one; an earlier end never
    /// shortens it, and neither does a refund; [`Budget::lift_pause`] ends it. An adaptive
    /// share ([`AdaptiveShare`](super::AdaptiveShare)) counts the refusal and plans less.
    ///
    /// A shared budget writes the pause to the shared store too, in the background, as a hold
    /// of the same window measured by the store's clock: one process's 429 holds every process
    /// sharing the quota until the pause's end (plus the time the write takes), and the shared
    /// level keeps refilling meanwhile.
    pub fn pause(&self, dimensions: &[Dimension], until: Instant) {
        let pause = until.saturating_duration_since(Instant::now());
        let now = self.engine.nanos_since_origin(Instant::now());
        let until = self.engine.nanos_since_origin(until);
        self.engine.update_state(|state| {
            let adapt = state.remote.is_none();
            dimensions.iter().for_each(|&d| {
                state.store.pause(d, until, now, adapt);
            });
            if let (Some(shared), Some(remote)) = (&state.remote, &self.engine.remote) {
                for &dimension in dimensions {
                    let shortest = shared
                        .limits()
                        .iter()
                        .filter(|limit| limit.dimension() == dimension)
                        .min_by_key(|limit| limit.period());
                    if let Some(&limit) = shortest {
                        remote.lower(limit, None, pause);
                    }
                }
            }
            false
        });
    }

    /// Ends the pauses of `dimensions` now, so that waiting requests are admitted as soon as
    /// the levels allow: for example once an operator knows that a provider's long wait (a
    /// daily quota) is over. Waiters are re-examined at once.
    ///
    /// A shared budget lifts the holds in the shared store too, in the background and after
    /// any pause this process sent before, for every process sharing the quota: this
    /// process's waiters ask the store again as soon as the lift is written; those of other
    /// processes within a second, as a process waiting for a hold asks the store again at
    /// least once a second.
    pub fn lift_pause(&self, dimensions: &[Dimension]) {
        self.engine.update_state(|state| {
            dimensions.iter().for_each(|&d| state.store.lift(d));
            if let (Some(shared), Some(remote)) = (&state.remote, &self.engine.remote) {
                let lifted: Vec<Limit> = shared
                    .limits()
                    .iter()
                    .filter(|limit| dimensions.contains(&limit.dimension()))
                    .copied()
                    .collect();
                if !lifted.is_empty() {
                    remote.lift(lifted);
                }
            }
            true
        });
    }
}

/// Admission: wait in the ordering, or try once. The engine (`engine/`) does the work.
impl Budget {
    /// Waits until `cost` can be paid in every limit it touches (and an in-flight slot is
    /// free, when the quota caps them), then reserves it.
    ///
    /// Waiters are admitted in the budget's ordering: by the class and place set with
    /// [`Reserve::priority`] (by default async, in arrival order). Fails at once, without waiting, when `cost`
    /// exceeds a bucket's capacity (or later, should a limit shrink below it while waiting).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes reserves nothing and gives up its place in the
    /// queue.
    pub fn reserve(&self, cost: Cost) -> Reserve {
        Reserve::new(self.clone(), cost)
    }

    /// Reserves `cost` now, or tells when to retry, or that it never fits.
    ///
    /// It does not overtake waiting requests: while others wait, it fails with a
    /// [`NotUntil`](crate::error::NotUntil) that counts their costs ahead of this one.
    ///
    /// A budget shared through a store in another process (such as Redis) cannot answer
    /// without a round trip: its `try_reserve` fails with [`TryReserveError::Unavailable`];
    /// use [`Budget::reserve`].
    pub fn try_reserve(&self, cost: Cost) -> Result<Reservation, TryReserveError> {
        self.engine.try_reserve_as(cost, None, None)
    }

    /// [`Budget::try_reserve`] for `tenant`: the account and every node of its path must pay
    /// now ([`TryReserveError::Tenant`] when a node refuses it; `NotYet` or `NoSlot` when a
    /// node cannot pay yet). A budget without tenants ignores `tenant`.
    pub fn try_reserve_for(
        &self,
        cost: Cost,
        tenant: &Tenant,
    ) -> Result<Reservation, TryReserveError> {
        self.engine.try_reserve_as(cost, Some(tenant), None)
    }
}

/// Tenants: the tree a budget enforces and the accounts that share it (`tenants/`).
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
    /// Redis (`tower_llm_quota_redis::RedisBudget`), whose store then keeps
    /// every node's limits beside the account's, checked and taken in the same script call.
    /// Install it before traffic: requests already waiting keep the place they had.
    ///
    /// Fails when the tree cannot be enforced.
    pub fn with_tenant_tree(self, tree: TenantTree) -> Result<Self, InvalidTree> {
        tree.validate()?;
        self.engine.install_tenants(tree);
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
    /// With a shared store (Redis), a node's limits are kept in the store too: per account
    /// by default, over every account of a
    /// tenant plane (`RedisBudget::tenant_plane`) when the accounts
    /// share one, so that they hold over all of them across processes as well.
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
        self.engine.serve_tenants_of(&other.engine);
        self
    }

    /// Whether this budget and `other` serve one tenant state
    /// ([`with_tenants_of`](Budget::with_tenants_of)).
    pub fn shares_tenants_with(&self, other: &Budget) -> bool {
        self.engine.same_tenants_as(&other.engine)
    }

    /// The handle on the budget's tenant tree (pause, resume, limits, snapshots), when it has
    /// one.
    pub fn tenants(&self) -> Option<TenantHandle> {
        self.engine.lock().tenants.as_ref()?;
        Some(TenantHandle {
            budget: self.clone(),
        })
    }
}

/// The store kept with other processes, if any (`store/`).
impl Budget {
    /// A budget whose quota is kept in `store` for every process sharing it: the same
    /// handle, layers and API as an in-memory budget. Named after the quota's
    /// [name](Quota::with_name). Must be called within a tokio runtime: it spawns the task
    /// that sends settlements (and, leasing, the one that renews the lease).
    ///
    /// Stores are made by their crates (`tower_llm_quota_redis::RedisBudget` makes one and
    /// calls this); see [`store`](crate::budget::store) to write one.
    pub fn with_store(quota: &Quota, store: Arc<dyn QuotaStore>, options: StoreOptions) -> Self {
        let (options, reachable) = options.engine();
        Self {
            engine: Engine::with_remote(quota, store, options, reachable),
        }
    }

    /// Completes once every reservation settled (or refunded) before the call has reached
    /// the shared store, or its retries ran out: a process stopping calls it before it
    /// exits, so that the fleet counts what its last requests used, not their estimates.
    /// At once for an in-memory budget.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops the waiting only: the settlements are sent all the same.
    pub async fn flush(&self) {
        if let Some(remote) = &self.engine.remote {
            let _ = remote.flush().await;
        }
    }

    /// Whether the budget is shared through a store in another process.
    pub fn is_shared(&self) -> bool {
        self.engine.remote.is_some()
    }

    /// Whether a shared budget admits through its store now (its circuit breaker is closed,
    /// and a leasing budget's lease is renewed); `false` while it falls back or refuses.
    /// Always `false` for an in-memory budget.
    pub fn is_store_reachable(&self) -> bool {
        self.engine.store_reachable()
    }
}

/// What the crate's layers ask of a budget beyond its public API, each from the engine.
impl Budget {
    /// The budget's identity: equal for every clone of one budget.
    pub(crate) fn address(&self) -> usize {
        Arc::as_ptr(&self.engine) as usize
    }

    /// The `queue` label of the depth gauge of the budget's ordering (its quota's name).
    /// Its quota's name ([`Quota::with_name`]), if it was given one.
    pub(crate) fn name(&self) -> Option<Arc<str>> {
        Some(self.queue_label()).filter(|label| &**label != crate::sched::order::DEFAULT_LABEL)
    }

    pub(crate) fn queue_label(&self) -> Arc<str> {
        self.engine.queue_label()
    }

    /// Whether the level gauges are due (at most ten recordings a second per budget).
    #[cfg(feature = "metrics")]
    pub(crate) fn gauges_due(&self) -> bool {
        self.engine.gauges_due()
    }

    /// What a request of `class` (and `tenant`) would wait now; see the engine's
    /// `would_wait`. The router's would-wait condition asks it.
    pub(crate) fn would_wait(
        &self,
        cost: Cost,
        class: Priority,
        tenant: Option<&Tenant>,
    ) -> Option<Duration> {
        self.engine.would_wait(cost, class, tenant)
    }

    /// Admits `ask` at once when nobody waits and the in-memory buckets can pay (the layers'
    /// fast path); `None` otherwise, having changed nothing.
    pub(crate) fn admit_now(&self, ask: &Ask, now: Instant) -> Option<Reservation> {
        self.engine.admit_now(ask, now)
    }
}
