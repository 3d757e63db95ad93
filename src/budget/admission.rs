//! In-memory admission: the one ordering's step (`Budget::poll_admission`), immediate
//! admission (`try_reserve`, `admit_now`), and the state's helpers for joining and leaving the
//! ordering. A shared budget's step hands over to its store (`Step::Ask`); what the store
//! answers is handled in `remote_admission`.

use std::sync::Arc;
use std::task::Waker;

use tokio::time::Instant;

use super::bucket::Floor;
use super::handle::{Budget, State};
use super::remote::{FailurePolicy, PathLimits};
use super::reservation::Reservation;
use super::store::Origin;
use super::store::{Denial, ReservationId, Store};
use super::waiters::Ask;
use crate::budget::tenants::tree::Check;
use crate::cost::Cost;
use crate::error::StoreUnavailable;
use crate::error::{InsufficientCapacity, TryReserveError};
use crate::priority::Priority;
use crate::quota::Limit;
use crate::sched::order::{Full, Place};
use crate::tenant::Tenant;
use crate::tenant::TenantRefused;

/// One step of a waiting admission.
pub(crate) enum Step {
    Admitted(ReservationId, Origin),
    Never(InsufficientCapacity),
    /// The ordering holds as many requests as the request's configuration allows.
    Full(usize),
    /// The shared store could not be asked, and the policy is to refuse.
    Unavailable(StoreUnavailable),
    /// At the head of the queue of a shared budget: ask the shared store, under this id, for
    /// the account's limits and those of the tenant path's nodes.
    Ask(ReservationId, Arc<[Limit]>, PathLimits),
    /// At the head of the queue: the cost fits at this instant.
    WaitUntil(Instant),
    /// Behind others, or waiting for an in-flight slot or a question to the store: woken
    /// when it may go.
    Queued,
    /// A node of its tenant path refused it.
    Refused(TenantRefused),
    /// Out of the ordering, keeping its place, until a node of its tenant path can pay: at
    /// this instant, or when woken (one of the node's calls ended).
    Parked(Option<Instant>),
}

/// A waker collected under the lock, woken after it is released.
#[derive(Default)]
pub(super) struct Wakeups(Option<Waker>);

impl Wakeups {
    pub(super) fn wake(self) {
        if let Some(waker) = self.0 {
            waker.wake();
        }
    }
}

impl Budget {
    /// Reserves `cost` now, or tells when to retry, or that it never fits.
    ///
    /// It does not overtake waiting requests: while others wait, it fails with a
    /// [`NotUntil`](crate::error::NotUntil) that counts their costs ahead of this one.
    ///
    /// A budget shared through a store in another process (such as Redis) cannot answer
    /// without a round trip: its `try_reserve` fails with [`TryReserveError::Unavailable`];
    /// use [`Budget::reserve`].
    pub fn try_reserve(&self, cost: Cost) -> Result<Reservation, TryReserveError> {
        self.try_reserve_as(cost, None, None)
    }

    /// [`Budget::try_reserve`] for `tenant`: the account and every node of its path must pay
    /// now ([`TryReserveError::Tenant`] when a node refuses it; `NotYet` or `NoSlot` when a
    /// node cannot pay yet). A budget without tenants ignores `tenant`.
    pub fn try_reserve_for(
        &self,
        cost: Cost,
        tenant: &Tenant,
    ) -> Result<Reservation, TryReserveError> {
        self.try_reserve_as(cost, Some(tenant), None)
    }

    /// What a request of `class` (and `tenant`) would wait now: zero when it would be
    /// admitted at once, the time until its cost fits behind the requests that would be
    /// admitted before it (its class and the classes above, and lower fronts aging has lifted
    /// to its class; not those of lower classes), `Duration::MAX` while no in-flight slot is
    /// free; `None` when it cannot tell (a shared store, a cost that never fits, a refused
    /// tenant). The router's would-wait condition asks it.
    pub(crate) fn would_wait(
        &self,
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
    fn try_reserve_as(
        &self,
        cost: Cost,
        tenant: Option<&Tenant>,
        class: Option<Priority>,
    ) -> Result<Reservation, TryReserveError> {
        if self.shared.remote.is_some() {
            return Err(TryReserveError::Unavailable(StoreUnavailable::new(
                "a shared budget admits through `reserve`, which asks the shared store",
            )));
        }
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let mut state = self.lock();
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
        let ahead = match class {
            None => state.queue.queued(),
            Some(class) => state.queue.queued_ahead_of(class, now),
        };
        if ahead != Cost::default() {
            state
                .store
                .check_capacity(&cost, Floor::NONE)
                .map_err(TryReserveError::Never)?;
            let behind = ahead.saturating_add(cost);
            if let Some((at, limit)) = state.store.not_before(&behind, ns) {
                let limit = state.store.limit(limit);
                return Err(TryReserveError::NotYet(self.not_until(at, &limit)));
            }
        }
        if !state.slots.free() {
            return Err(TryReserveError::NoSlot);
        }
        // Its scope cannot pay yet (a refusal was answered above).
        match check {
            Some(Check::Blocked { at: None, .. }) => return Err(TryReserveError::NoSlot),
            Some(Check::Blocked {
                at: Some((at, limit)),
                ..
            }) => return Err(TryReserveError::NotYet(self.not_until(at, &limit))),
            _ => {}
        }
        let id = state.next_id();
        match state.store.reserve(id, &cost, Floor::NONE, ns) {
            Ok(()) => {
                state.slots.take();
                if let (Some(tenants), Some(path)) = (&mut state.tenants, &path) {
                    tenants.take(path, &cost, ns, now);
                }
                drop(state);
                Ok(Reservation::new(self.clone(), id, cost, Origin::Local).with_tenant(path))
            }
            Err(Denial::NotUntil { at, limit }) => {
                let limit = state.store.limit(limit);
                Err(TryReserveError::NotYet(self.not_until(at, &limit)))
            }
            Err(Denial::Never(e)) => Err(TryReserveError::Never(e)),
        }
    }

    /// One step of [`Reserve`](super::Reserve): admit, queue, or say when to look again.
    ///
    /// A request may go when it is the head of the ordering (or the ordering is empty), or
    /// when the heads before it wait only to keep a higher class floor. It then needs a free
    /// in-flight slot, and every bucket its cost touches. A shared budget asks its shared
    /// store (`Step::Ask`) unless `local` (the store failed and the policy is to fall back)
    /// or its breaker is open; not before `retry_at`, the store's last hint.
    pub(crate) fn poll_admission(
        &self,
        place: &mut Option<Place>,
        ask: &mut Ask,
        waker: &Waker,
        local: bool,
        retry_at: Option<(Instant, u64)>,
        parked: &mut Option<(usize, u64)>,
    ) -> Step {
        let now = Instant::now();
        let arrived = ask.scheduling.enqueued_at;
        let mut state = self.lock();
        let tenant_check = match state.tenants.as_mut() {
            Some(tenants) => {
                let ns = self.nanos_since_origin(now);
                let path = ask.tenant.get_or_insert_with(|| tenants.path_of(None));
                if let Some((depth, ticket)) = parked.take() {
                    // Back from parking, to its place.
                    tenants.unpark(path, depth, ticket);
                    if let Some(mine) = *place {
                        state.queue.restore(mine, ask, waker);
                    }
                    let tenants = state.tenants.as_mut().expect("checked");
                    let path = ask.tenant.as_ref().expect("resolved");
                    Some(tenants.check(path, &ask.cost, ns, now, arrived))
                } else {
                    if place.is_none() {
                        ask.scheduling.flow = tenants.flow(path);
                    }
                    Some(tenants.check(path, &ask.cost, ns, now, arrived))
                }
            }
            None => None,
        };
        if let Some(Check::Refused(refused)) = tenant_check {
            // Paused, its day spent, or too large for a node: refused at once, queued or not.
            #[cfg(feature = "metrics")]
            if let Some(tenants) = &state.tenants {
                crate::budget::tenants::shared::refused_metric(tenants, &refused);
            }
            let wakeups = state.leave(place, now);
            drop(state);
            wakeups.wake();
            return Step::Refused(refused);
        }
        if place.is_none() && !state.queue.is_empty() {
            // Others wait: refuse at once what can never fit, rather than after a wait in
            // line, and take a place (it may be the head's: a higher class goes first).
            if let Err(e) = state.check_capacity(&ask.cost, ask.floor) {
                return Step::Never(e);
            }
            if let Step::Full(depth) = state.wait(place, ask, waker) {
                return Step::Full(depth);
            }
        }
        if let Some(mine) = *place {
            if !state.queue.may_go(mine, now) {
                // Not its turn. Aging may have made another the head since the last event,
                // and nobody else would tell it: make sure it looks (once: a head already told
                // is not woken again, so waiters polled together cannot keep waking each
                // other, whatever their wakers compare as).
                let step = state.wait(place, ask, waker);
                let head = state.queue.tell_head(now);
                drop(state);
                if let Some(head) = head {
                    head.wake();
                }
                return step;
            }
            // Its turn: it looks now.
            state.queue.told(mine);
        }
        if !state.slots.free() {
            // Every slot is taken: the head waits for one to be given back, holding nothing.
            return state.wait(place, ask, waker);
        }
        let ns = self.nanos_since_origin(now);
        if let Some(Check::Blocked { depth, at, give_up }) = tenant_check {
            // Its own scope cannot pay yet: it steps out of the ordering, keeping its place,
            // so that the others go meanwhile, and comes back when that scope can pay.
            if let Step::Full(depth) = state.wait(place, ask, waker) {
                return Step::Full(depth);
            }
            let mine = place.expect("placed");
            let next = state.queue.step_out(mine, now);
            let tenants = state.tenants.as_mut().expect("a budget with tenants");
            let path = ask.tenant.as_ref().expect("resolved");
            let priority = ask.scheduling.priority;
            *parked = Some((depth, tenants.park(path, depth, priority, waker)));
            drop(state);
            if let Some(next) = next {
                next.wake();
            }
            // Until the node can pay, or (waiting for its calls in flight) until its
            // `max_wait` is over, when it refuses.
            let wake = match (at.map(|(at, _)| at), give_up) {
                (Some(at), Some(give_up)) => Some(at.min(give_up)),
                (at, give_up) => at.or(give_up),
            };
            return Step::Parked(wake.map(|at| self.instant(at)));
        }
        if let (Some(remote), true, false) = (&self.shared.remote, state.shared.is_some(), local) {
            // The store's wait, unless a refund reached the store since it told it.
            let refunds = state.shared.as_ref().map_or(0, |shared| shared.refunds);
            if let Some((at, _)) = retry_at.filter(|(at, told)| *at > now && *told == refunds) {
                return match state.wait(place, ask, waker) {
                    Step::Queued => Step::WaitUntil(state.until_reorder(at, now)),
                    other => other,
                };
            }
            let id = state.peek_id();
            let shared = state
                .shared
                .as_mut()
                .expect("a shared budget has shared state");
            if !shared.may_ask() {
                // Another question is on its way: while the store refuses, only one asks at
                // a time, so the store admits in this process's order.
                return state.wait(place, ask, waker);
            }
            if shared.breaker.allow(id.get(), ns) {
                shared.asking += 1;
                let limits = shared.limits().clone();
                let path = state.path_limits(ask.tenant.as_ref());
                state.slots.promise();
                // It leaves the ordering while it asks (and comes back to its place if the
                // store refuses), so the next may ask too while the store admits.
                let next = place.and_then(|mine| state.queue.step_out(mine, now));
                let id = state.next_id();
                drop(state);
                if let Some(next) = next {
                    next.wake();
                }
                return Step::Ask(id, limits, path);
            }
            if remote.policy() == FailurePolicy::FailClosed {
                let wakeups = state.leave(place, now);
                drop(state);
                wakeups.wake();
                return Step::Unavailable(StoreUnavailable::breaker_open());
            }
        }
        if state.shared.is_some() && state.store.check_capacity(&ask.cost, ask.floor).is_err() {
            // The store is out of reach and the local share cannot pay this cost at all.
            let wakeups = state.leave(place, now);
            drop(state);
            wakeups.wake();
            return Step::Unavailable(StoreUnavailable::new(
                "the shared store is out of reach and the cost exceeds the local fallback share",
            ));
        }
        let id = state.next_id();
        match state.store.reserve(id, &ask.cost, ask.floor, ns) {
            Ok(()) => {
                if let (Some(tenants), Some(path)) = (&mut state.tenants, &ask.tenant) {
                    tenants.take(path, &ask.cost, ns, now);
                }
                if state.shared.is_some() {
                    let reason = if local {
                        "store_unavailable"
                    } else {
                        "breaker_open"
                    };
                    crate::observe::fallback(reason);
                }
                state.slots.take();
                let wakeups = state.served(place, now);
                drop(state);
                wakeups.wake();
                Step::Admitted(id, Origin::Local)
            }
            Err(Denial::NotUntil { at, .. }) => {
                let step = state.wait(place, ask, waker);
                let Some(mine) = *place else { return step };
                // Blocked only by its floor: whoever may go instead is told to look.
                let fits = state
                    .store
                    .not_before(&ask.cost, ns)
                    .is_none_or(|(at, _)| at <= ns);
                let floor_only = ask.floor != Floor::NONE && fits;
                let other = state.queue.set_floor_blocked(mine, floor_only, now);
                let until = state.until_reorder(self.instant(at), now);
                drop(state);
                if let Some(other) = other {
                    other.wake();
                }
                match step {
                    Step::Queued => Step::WaitUntil(until),
                    other => other,
                }
            }
            Err(Denial::Never(e)) => {
                // Too large from the start, or a limit shrank below it while it waited.
                let wakeups = state.leave(place, now);
                drop(state);
                wakeups.wake();
                Step::Never(e)
            }
        }
    }

    /// Admits `ask` at once, when nobody waits, a slot is free and the in-memory buckets can
    /// pay; changes nothing otherwise. A shared budget always answers `None`: it must ask its
    /// store.
    pub(crate) fn admit_now(&self, ask: &Ask, now: Instant) -> Option<Reservation> {
        let (id, tenant) = self.admit_id_now(ask, now)?;
        Some(Reservation::new(self.clone(), id, ask.cost, Origin::Local).with_tenant(tenant))
    }

    fn admit_id_now(&self, ask: &Ask, now: Instant) -> Option<(ReservationId, Option<Tenant>)> {
        if self.shared.remote.is_some() {
            return None;
        }
        let ns = self.nanos_since_origin(now);
        let mut state = self.lock();
        if !state.queue.is_empty() || !state.slots.free() {
            return None;
        }
        let path = match &mut state.tenants {
            Some(tenants) => {
                let path = tenants.path_of(ask.tenant.as_ref());
                let arrived = ask.scheduling.enqueued_at;
                if !matches!(
                    tenants.check(&path, &ask.cost, ns, now, arrived),
                    Check::Fits
                ) {
                    return None;
                }
                Some(path)
            }
            None => None,
        };
        let id = state.peek_id();
        state.store.reserve(id, &ask.cost, ask.floor, ns).ok()?;
        state.slots.take();
        if let (Some(tenants), Some(path)) = (&mut state.tenants, &path) {
            tenants.take(path, &ask.cost, ns, now);
        }
        Some((state.next_id(), path))
    }

    /// Gives up a place in the ordering.
    pub(crate) fn cancel(&self, place: Place) {
        let wakeups = self.lock().leave(&mut Some(place), Instant::now());
        wakeups.wake();
    }
}

impl State {
    /// Fails when `cost` exceeds a capacity (less `floor`): of the shared limits for a shared
    /// budget, of the buckets for an in-memory one.
    pub(super) fn check_capacity(
        &self,
        cost: &Cost,
        floor: Floor,
    ) -> Result<(), InsufficientCapacity> {
        match &self.shared {
            Some(shared) => shared.check_capacity(cost, floor),
            None => self.store.check_capacity(cost, floor),
        }
    }

    /// Joins the ordering, or refreshes the waker of a waiter already in it: `Step::Queued`,
    /// or `Step::Full` when the ordering is as deep as the request allows.
    pub(super) fn wait(&mut self, place: &mut Option<Place>, ask: &Ask, waker: &Waker) -> Step {
        match self.queue.wait(place, ask, waker) {
            Ok(()) => Step::Queued,
            Err(Full(depth)) => Step::Full(depth),
        }
    }

    /// The limits of the tenant nodes of `path`, for the shared store (none without tenants).
    pub(super) fn path_limits(&self, path: Option<&Tenant>) -> PathLimits {
        match (&self.tenants, path) {
            (Some(tenants), Some(path)) => tenants.shared_path(path),
            _ => Arc::from([]),
        }
    }

    pub(super) fn next_id(&mut self) -> ReservationId {
        self.next_id += 1;
        ReservationId(self.next_id)
    }

    /// The id [`State::next_id`] will give.
    pub(super) fn peek_id(&self) -> ReservationId {
        ReservationId(self.next_id + 1)
    }

    /// `at`, or sooner when aging may change who goes first before then: the head sleeping
    /// until its cost fits looks again then, and hands over if it is no longer the head.
    pub(super) fn until_reorder(&self, at: Instant, now: Instant) -> Instant {
        self.queue
            .next_reorder(now)
            .map_or(at, |reorder| reorder.min(at))
    }

    /// Leaves the ordering unserved, if in it; collects the waker of the new head.
    pub(super) fn leave(&mut self, place: &mut Option<Place>, now: Instant) -> Wakeups {
        Wakeups(place.take().and_then(|mine| self.queue.remove(mine, now)))
    }

    /// Leaves the ordering admitted, if in it; collects the waker of the new head.
    pub(super) fn served(&mut self, place: &mut Option<Place>, now: Instant) -> Wakeups {
        Wakeups(place.take().and_then(|mine| self.queue.serve(mine, now)))
    }
}
