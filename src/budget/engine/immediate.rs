//! Admission without waiting: `try_reserve` (behind everyone waiting), the would-wait probe
//! (behind whoever a request of a class would wait behind), and the layers' fast path
//! (`admit_now`, when nobody waits). Each pays the same ways as the wait engine
//! ([`State::pay`]).

use tokio::time::Instant;

use super::Ask;
use super::ways::{Bill, Unpaid};
use std::sync::Arc;

use crate::budget::handle::{Budget, Engine, State};
use crate::budget::memory::bucket::Floor;
use crate::budget::memory::store::{Denial, Origin, ReservationId, Store};
use crate::budget::reservation::Reservation;
use crate::budget::tenants::tree::Check;
use crate::cost::Cost;
use crate::error::{StoreUnavailable, TryReserveError};
use crate::priority::Priority;
use crate::tenant::Tenant;

impl Engine {
    /// What a request of `class` (and `tenant`) would wait now: zero when it would be
    /// admitted at once, the time until its cost fits behind the requests that would be
    /// admitted before it (its class and the classes above, and lower fronts aging has lifted
    /// to its class; not those of lower classes), `Duration::MAX` while no in-flight slot is
    /// free; `None` when it cannot tell (a shared store, a cost that never fits, a refused
    /// tenant). The router's would-wait condition asks it.
    pub(crate) fn would_wait(
        self: &Arc<Self>,
        cost: Cost,
        class: Priority,
        tenant: Option<&Tenant>,
    ) -> Option<std::time::Duration> {
        match self.try_reserve_as(cost, tenant, Some(class)) {
            Ok(reservation) => {
                // A probe: given back at once.
                drop(reservation);
                Some(std::time::Duration::ZERO)
            }
            Err(TryReserveError::NotYet(not_until)) => {
                Some(not_until.wait_time_from(Instant::now()))
            }
            Err(TryReserveError::NoSlot) => Some(std::time::Duration::MAX),
            Err(_) => None,
        }
    }

    /// `try_reserve` behind every waiting request (`class` `None`), or behind those a request
    /// of `class` would wait behind.
    pub(in crate::budget) fn try_reserve_as(
        self: &Arc<Self>,
        cost: Cost,
        tenant: Option<&Tenant>,
        class: Option<Priority>,
    ) -> Result<Reservation, TryReserveError> {
        if self.asks_per_admission() {
            return Err(asks_its_store());
        }
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let mut state = self.lock();
        if self.kept_in_store(&state, tenant) {
            return Err(asks_its_store());
        }
        // A budget with tenants admits it for its tenant, else the default one; a scope that
        // refuses it (paused, over its daily cap) says so whoever waits.
        let path = state.tenants.as_ref().map(|t| t.path_of(tenant));
        let check = match (&mut state.tenants, &path) {
            (Some(tenants), Some(path)) => Some(tenants.check(path, &cost, ns, now, now)),
            _ => None,
        };
        if let Some(Check::Refused(e)) = check {
            return Err(TryReserveError::Tenant(e));
        }
        self.behind_the_waiters(&state, cost, class, now)?;
        let bill = Bill::local(&cost, Floor::NONE, path.as_ref(), check.as_ref(), (ns, now));
        match state.pay(&bill) {
            Ok(id) => {
                drop(state);
                Ok(Reservation::new(
                    Budget {
                        engine: Arc::clone(self),
                    },
                    id,
                    cost,
                    Origin::Local,
                )
                .with_tenant(path))
            }
            Err(Unpaid::NoSlot) => Err(TryReserveError::NoSlot),
            Err(Unpaid::Node) => match check {
                Some(Check::Blocked {
                    at: Some((at, limit)),
                    ..
                }) => Err(TryReserveError::NotYet(self.not_until(at, &limit))),
                // Its scope waits for one of its calls to end, as for a slot.
                _ => Err(TryReserveError::NoSlot),
            },
            Err(Unpaid::Buckets(Denial::NotUntil { at, limit })) => {
                if let Some(lease) = state.remote.as_mut().and_then(|s| s.lease.as_mut()) {
                    // Its wallets lack it: the next renewal (sooner) asks for it whole.
                    lease.blocked = Some(cost);
                    if let Some(remote) = &self.remote {
                        remote.wants_more.notify_one();
                    }
                }
                let limit = state.store.limit(limit);
                Err(TryReserveError::NotYet(self.not_until(at, &limit)))
            }
            Err(Unpaid::Buckets(Denial::Never(e))) => Err(TryReserveError::Never(e)),
            // Not asked of an in-memory budget (a shared one answered above).
            Err(Unpaid::Store) => Err(asks_its_store()),
            Err(Unpaid::Unavailable(e)) => Err(TryReserveError::Unavailable(e)),
        }
    }

    /// Fails while requests wait ahead of `cost` (all of them, or those a request of `class`
    /// would wait behind): never when it can never fit, else not until their costs and its
    /// own have been paid.
    fn behind_the_waiters(
        &self,
        state: &State,
        cost: Cost,
        class: Option<Priority>,
        now: Instant,
    ) -> Result<(), TryReserveError> {
        let ahead = match class {
            None => state.queue.queued(),
            Some(class) => state.queue.queued_ahead_of(class, now),
        };
        if ahead == Cost::default() {
            return Ok(());
        }
        state
            .store
            .check_capacity(&cost, Floor::NONE)
            .map_err(TryReserveError::Never)?;
        let behind = ahead.saturating_add(cost);
        match state
            .store
            .not_before(&behind, self.nanos_since_origin(now))
        {
            Some((at, limit)) => {
                let limit = state.store.limit(limit);
                Err(TryReserveError::NotYet(self.not_until(at, &limit)))
            }
            None => Ok(()),
        }
    }

    /// Admits `ask` at once, when nobody waits, a slot is free and the in-memory buckets can
    /// pay; changes nothing otherwise. A shared budget always answers `None`: it must ask its
    /// store.
    pub(crate) fn admit_now(self: &Arc<Self>, ask: &Ask, now: Instant) -> Option<Reservation> {
        let (id, tenant) = self.admit_id_now(ask, now)?;
        Some(
            Reservation::new(
                Budget {
                    engine: Arc::clone(self),
                },
                id,
                ask.cost,
                Origin::Local,
            )
            .with_tenant(tenant),
        )
    }

    fn admit_id_now(&self, ask: &Ask, now: Instant) -> Option<(ReservationId, Option<Tenant>)> {
        if self.asks_per_admission() || ask.scheduling.not_before.is_some_and(|at| at > now) {
            return None;
        }
        let ns = self.nanos_since_origin(now);
        let mut state = self.lock();
        if !state.queue.is_empty() || self.kept_in_store(&state, ask.tenant.as_ref()) {
            return None;
        }
        let (path, check) = match &mut state.tenants {
            Some(tenants) => {
                let path = tenants.path_of(ask.tenant.as_ref());
                let arrived = ask.scheduling.enqueued_at;
                let check = tenants.check(&path, &ask.cost, ns, now, arrived);
                (Some(path), Some(check))
            }
            None => (None, None),
        };
        if let Some(Check::Refused(_)) = check {
            return None;
        }
        let bill = Bill::local(
            &ask.cost,
            ask.floor,
            path.as_ref(),
            check.as_ref(),
            (ns, now),
        );
        let id = state.pay(&bill).ok()?;
        Some((id, path))
    }
}

/// What `try_reserve` answers for a shared budget: it admits through `reserve`.
impl Engine {
    /// Whether a leasing budget asks its store for a request of `tenant`: its path has
    /// limits or controls kept there (see `Pass::kept_in_store`).
    pub(in crate::budget) fn kept_in_store(&self, state: &State, tenant: Option<&Tenant>) -> bool {
        let keeps = state
            .tenants
            .as_ref()
            .is_some_and(|t| t.keeps_any_in_store());
        if !keeps || !self.leases() {
            return false;
        }
        let path = state.path_limits(tenant);
        !path.limits.is_empty() || !path.controls.is_empty()
    }
}

fn asks_its_store() -> TryReserveError {
    TryReserveError::Unavailable(StoreUnavailable::new(
        "a shared budget admits through `reserve`, which asks the shared store",
    ))
}
