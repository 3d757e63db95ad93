//! A shared, multi-dimension token budget: reserve before a call, settle after it.
//!
//! A [`Budget`] holds one token bucket per [`Limit`] of a [`Quota`] (requests, input tokens,
//! output tokens, total tokens; per minute, per day, or any period). Buckets refill
//! continuously, computed lazily from elapsed [`tokio::time::Instant`]: no timers, no drift,
//! and tests drive it with tokio's paused clock.
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU64;
//! use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota, Usage};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let nz = |n| NonZeroU64::new(n).unwrap();
//! let budget = Budget::new(
//!     Quota::new()
//!         .with_limit(Limit::per_minute(Dimension::Requests, nz(500)))
//!         .with_limit(Limit::per_minute(Dimension::TotalTokens, nz(30_000))),
//! );
//!
//! // Before the call: reserve the estimate (waits if the budget cannot pay yet).
//! let mut reservation = budget.reserve(Cost::new(1_200, 200)).await?;
//! reservation.mark_sent();
//! // ... the call ...
//! // After it: settle with what the provider reports; the unused 150 tokens come back.
//! let settled = reservation.settle(&Usage::new(1_200, 50));
//! assert_eq!(settled.refunded(Dimension::TotalTokens), 150);
//! # Ok(()) }
//! ```
//!
//! # Why a token bucket per dimension
//!
//! Providers limit requests *and* tokens, and a call must fit all of its limits: limiting only
//! calls lets ten huge prompts exhaust the token quota. A token bucket's capacity is the burst
//! accepted at once and its refill rate the sustained regime, so unlike a fixed window it never
//! passes two bursts at a window boundary. Admission is all or nothing: a request that does not
//! fit one bucket takes nothing from the others.
//!
//! # Waiting: one ordering
//!
//! Requests that cannot be admitted at once wait in the budget's ordering: by
//! [`Priority`](crate::Priority) (the front of a class ages up), then by the time they first
//! entered (kept across retries), then by arrival. Only the head may be admitted: a large
//! request at the head is never overtaken by a stream of small ones (a sleep-and-recheck loop
//! lets that happen). The trade-off is head-of-line blocking: a small request that would fit
//! now waits behind a large one at the head, exactly as tokio's semaphore does. One exception
//! keeps class floors honest: a head that waits only to keep its class's floor
//! ([`Reserve::keeping`]) lets a request with a lower floor behind it go first.
//!
//! Only the head sleeps, until the instant its cost becomes available; it is woken earlier
//! when a refund, a released in-flight slot or a limit change makes that sooner. The others
//! wait without a timer, so waiting costs no CPU.
//!
//! Every resource of an admission is taken in one step from the head of that one ordering:
//! every bucket the cost touches and, when the quota caps calls in flight
//! ([`Quota::with_max_in_flight`]), a slot. So whatever binds — tokens, a slot, a shared
//! store, a floor — the next request served is the one the ordering names, and a request
//! waiting for one resource holds none of the others.
//!
//! # Cancel safety
//!
//! [`Reserve`] is cancel safe: dropping it leaves the queue (and wakes the next waiter if it was
//! at the head), and a reservation is only ever handed out by a completed future. A dropped
//! [`Reservation`] is refunded or charged by the rule in its documentation, so no capacity
//! leaks.

mod bucket;
#[cfg(all(test, loom))]
mod loom_ordering;
mod observation;
#[cfg(feature = "redis")]
pub mod redis;
mod remote;
mod reservation;
mod reserve;
mod share;
mod shared;
pub(crate) mod snapshot;
pub(crate) mod store;
mod tenants;
mod waiters;

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::{Arc, PoisonError};
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

pub use observation::Observation;
pub use remote::{FailurePolicy, StoreUnavailable};
pub use reservation::{Reservation, ReservationSlot, Settlement};
pub use reserve::Reserve;
pub use share::AdaptiveShare;
pub use snapshot::{BudgetSnapshot, LimitSnapshot};
pub use store::ReservationId;

use crate::cost::Cost;
use crate::error::{InsufficientCapacity, NotUntil, TryReserveError};
use crate::loom::{Mutex, MutexGuard};
use crate::quota::{Dimension, Limit, Quota};
use crate::sched::QueueSnapshot;
use crate::sched::order::{Full, Place};
use crate::tenant::Tenant;
use crate::tenant::TenantRefused;
use crate::tenant::tree::{Check, Tenants};
pub(crate) use bucket::Floor;
use remote::{Decision, PathLimits};
use reservation::Origin;
use shared::{Remote, SharedState};
use store::{Denial, MemoryStore, Store, nanos};
pub(crate) use waiters::Ask;
use waiters::{Slots, WaitList};

/// A shared quota budget: a cheap handle, and clones share the same buckets and queue.
///
/// Hand clones to every client, task and layer that spends one provider quota. See the
/// [module documentation](self) for the admission rules.
#[derive(Clone)]
pub struct Budget {
    shared: Arc<Shared>,
}

struct Shared {
    /// The zero of the budget's clock; times inside are nanoseconds since it.
    origin: Instant,
    state: Mutex<State>,
    /// The store shared with other processes, when there is one.
    remote: Option<Remote>,
    /// When the level gauges were last recorded (nanoseconds on the budget's clock).
    #[cfg(feature = "metrics")]
    gauges_at: std::sync::atomic::AtomicU64,
}

struct State {
    /// The buckets of an in-memory budget; of a shared one, its local fallback share.
    store: MemoryStore,
    /// The limits and circuit breaker of a shared budget.
    shared: Option<SharedState>,
    queue: WaitList,
    slots: Slots,
    next_id: u64,
    /// The tenant tree, when the budget has one.
    tenants: Option<Tenants>,
}

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
struct Wakeups(Option<Waker>);

impl Wakeups {
    fn wake(self) {
        if let Some(waker) = self.0 {
            waker.wake();
        }
    }
}

impl Budget {
    /// A budget enforcing every limit of `quota`, with every bucket full.
    pub fn new(quota: Quota) -> Self {
        Self::with_store(&quota, MemoryStore::new(&quota), None, None)
    }

    fn with_store(
        quota: &Quota,
        store: MemoryStore,
        shared: Option<SharedState>,
        remote: Option<Remote>,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                origin: Instant::now(),
                remote,
                #[cfg(feature = "metrics")]
                gauges_at: std::sync::atomic::AtomicU64::new(0),
                state: Mutex::new(State {
                    store,
                    shared,
                    queue: WaitList::default(),
                    slots: Slots::new(quota.max_in_flight()),
                    next_id: 0,
                    tenants: None,
                }),
            }),
        }
    }

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
    /// [`NotUntil`] that counts their costs ahead of this one.
    ///
    /// A budget shared through a store in another process (such as Redis) cannot answer
    /// without a round trip: its `try_reserve` fails with [`TryReserveError::Unavailable`];
    /// use [`Budget::reserve`].
    pub fn try_reserve(&self, cost: Cost) -> Result<Reservation, TryReserveError> {
        self.try_reserve_as(cost, None)
    }

    /// [`Budget::try_reserve`] for `tenant`: the account and every node of its path must pay
    /// now ([`TryReserveError::Tenant`] when a node refuses it; `NotYet` or `NoSlot` when a
    /// node cannot pay yet). A budget without tenants ignores `tenant`.
    pub fn try_reserve_for(
        &self,
        cost: Cost,
        tenant: &Tenant,
    ) -> Result<Reservation, TryReserveError> {
        self.try_reserve_as(cost, Some(tenant))
    }

    fn try_reserve_as(
        &self,
        cost: Cost,
        tenant: Option<&Tenant>,
    ) -> Result<Reservation, TryReserveError> {
        if self.shared.remote.is_some() {
            return Err(TryReserveError::Unavailable(StoreUnavailable::new(
                "a shared budget admits through `reserve`, which asks the shared store",
            )));
        }
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let mut state = self.lock();
        if !state.queue.is_empty() {
            state
                .store
                .check_capacity(&cost, Floor::NONE)
                .map_err(TryReserveError::Never)?;
            let behind = state.queue.queued().saturating_add(cost);
            if let Some((at, limit)) = state.store.not_before(&behind, ns) {
                let limit = state.store.limit(limit);
                return Err(TryReserveError::NotYet(self.not_until(at, &limit)));
            }
        }
        if !state.slots.free() {
            return Err(TryReserveError::NoSlot);
        }
        // A budget with tenants admits it for its tenant, else the default one.
        let path = state.tenants.as_ref().map(|t| t.path_of(tenant));
        if let (Some(tenants), Some(path)) = (&mut state.tenants, &path) {
            match tenants.check(path, &cost, ns, now) {
                Check::Fits => {}
                Check::Refused(e) => return Err(TryReserveError::Tenant(e)),
                Check::Blocked { at: None, .. } => return Err(TryReserveError::NoSlot),
                Check::Blocked {
                    at: Some((at, limit)),
                    ..
                } => return Err(TryReserveError::NotYet(self.not_until(at, &limit))),
            }
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

    /// The state of every limit and of the queue, now.
    ///
    /// For a budget shared through a store in another process (Redis), the limits are those
    /// of its local fallback share, with the levels this process spent from it while the
    /// store was out of reach; the shared levels live in the store.
    pub fn snapshot(&self) -> BudgetSnapshot {
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let state = self.lock();
        let limits = state
            .store
            .snapshot(ns)
            .into_iter()
            .map(|s| LimitSnapshot {
                limit: s.limit,
                capacity: s.capacity,
                level: s.level,
                available_at: self.instant(s.available_at),
                full_at: self.instant(s.full_at),
            })
            .collect();
        BudgetSnapshot {
            taken_at: now,
            limits,
            waiters: state.queue.len(),
            queued: state.queue.queued(),
            in_flight: state.slots.used(),
            max_in_flight: state.slots.max(),
        }
    }

    /// The requests waiting for admission, by class (the budget's ordering).
    pub fn queue_snapshot(&self) -> QueueSnapshot {
        self.lock().queue.order().snapshot(Instant::now())
    }

    /// Caps the calls in flight at `max` (`None`: no cap), from now on; a slot is held from
    /// admission until the reservation ends (with [`ReconcileLayer`](crate::ReconcileLayer),
    /// when the response body ends). Lowering it below the calls in flight admits nobody until
    /// enough of them end. Defaults to the quota's
    /// [`max_in_flight`](Quota::with_max_in_flight).
    pub fn set_max_in_flight(&self, max: Option<NonZeroUsize>) {
        self.update_state(|state| {
            state.slots.set_max(max);
            true
        });
    }

    /// Replaces the limit of the same dimension and period (or adds it), keeping the bucket's
    /// current level, clamped to the new capacity. Waiters are re-examined at once (for a
    /// shared budget, the head asks the store again when the store's last wait is over).
    pub fn set_limit(&self, limit: Limit) {
        let now = self.nanos_since_origin(Instant::now());
        self.update_state(|state| {
            let local = match &mut state.shared {
                Some(shared) => shared.set_limit(limit),
                None => limit,
            };
            state.store.set_limit(local, now);
            true
        });
    }

    /// Applies a provider's report on one of the limits; see [`Observation`].
    ///
    /// A shared budget writes it to the shared store too, in the background, so that every
    /// process sharing the quota sees it.
    pub fn observe(&self, observation: &Observation) {
        let now = self.nanos_since_origin(Instant::now());
        self.update_state(|state| match &mut state.shared {
            Some(shared) => {
                let lowered = shared.observe(observation);
                if let Some(remote) = &self.shared.remote {
                    lowered.for_each(|(limit, remaining)| {
                        remote.lower(limit, Some(remaining), Duration::ZERO)
                    });
                }
                // The fallback share does not adapt: other processes spend the shared quota.
                state
                    .store
                    .observe(&shared.local_observation(observation), now, false)
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
    /// share ([`AdaptiveShare`]) counts the refusal and plans less.
    ///
    /// A shared budget writes the pause to the shared store too, in the background, as a hold
    /// of the same window measured by the store's clock: one process's 429 holds every process
    /// sharing the quota until the pause's end (plus the time the write takes), and the shared
    /// level keeps refilling meanwhile.
    pub fn pause(&self, dimensions: &[Dimension], until: Instant) {
        let pause = until.saturating_duration_since(Instant::now());
        let now = self.nanos_since_origin(Instant::now());
        let until = self.nanos_since_origin(until);
        self.update_state(|state| {
            let adapt = state.shared.is_none();
            dimensions.iter().for_each(|&d| {
                state.store.pause(d, until, now, adapt);
            });
            if let (Some(shared), Some(remote)) = (&state.shared, &self.shared.remote) {
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
        self.update_state(|state| {
            dimensions.iter().for_each(|&d| state.store.lift(d));
            if let (Some(shared), Some(remote)) = (&state.shared, &self.shared.remote) {
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

    /// How many requests wait for admission.
    pub fn waiters(&self) -> usize {
        self.lock().queue.len()
    }

    /// Whether two handles share the same budget.
    pub fn ptr_eq(&self, other: &Budget) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// One step of [`Reserve`]: admit, queue, or say when to look again.
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
                    Some(tenants.check(path, &ask.cost, ns, now))
                } else {
                    if place.is_none() {
                        ask.scheduling.flow = tenants.flow(path, ns);
                    }
                    Some(tenants.check(path, &ask.cost, ns, now))
                }
            }
            None => None,
        };
        if let Some(Check::Refused(refused)) = tenant_check {
            // Paused, its day spent, or too large for a node: refused at once, queued or not.
            #[cfg(feature = "metrics")]
            if let Some(tenants) = &state.tenants {
                crate::tenant::tree::refused_metric(tenants, &refused);
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
                // and nobody else would tell it: make sure it looks.
                let step = state.wait(place, ask, waker);
                let head = state.queue.head_waker(now).filter(|h| !h.will_wake(waker));
                drop(state);
                if let Some(head) = head {
                    head.wake();
                }
                return step;
            }
        }
        if !state.slots.free() {
            // Every slot is taken: the head waits for one to be given back, holding nothing.
            return state.wait(place, ask, waker);
        }
        let ns = self.nanos_since_origin(now);
        if let Some(Check::Blocked { depth, at }) = tenant_check {
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
            return Step::Parked(at.map(|(at, _)| self.instant(at)));
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
                let next = place.and_then(|mine| state.queue.remove(mine, now));
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
                let wakeups = state.leave(place, now);
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
                if !matches!(tenants.check(&path, &ask.cost, ns, now), Check::Fits) {
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

    /// What the shared store answered to a question (`Step::Ask`). The asker left the
    /// ordering to ask; refused, it comes back to its place (or joins, if it asked on
    /// arrival).
    pub(crate) fn answered(
        &self,
        place: &mut Option<Place>,
        id: ReservationId,
        answer: Result<Decision, StoreUnavailable>,
        ask: &Ask,
        waker: &Waker,
    ) -> Answer {
        let Some(remote) = &self.shared.remote else {
            unreachable!("only a shared budget asks a shared store")
        };
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let mut state = self.lock();
        let path = state.path_limits(ask.tenant.as_ref());
        let State {
            shared,
            queue,
            slots,
            tenants,
            ..
        } = &mut *state;
        let shared = shared.as_mut().expect("a shared budget has shared state");
        shared.asking = shared.asking.saturating_sub(1);
        let admitted = matches!(answer, Ok(Decision::Admitted));
        slots.fulfil(admitted);
        let mut other = None;
        let mut back = |queue: &mut WaitList| match *place {
            Some(mine) => {
                queue.restore(mine, ask, waker);
                Ok(())
            }
            None => match queue.wait(place, ask, waker) {
                Ok(()) => Ok(()),
                Err(Full(depth)) => Err(depth),
            },
        };
        let answer = match answer {
            Ok(decision) => {
                shared.breaker.succeeded();
                match decision {
                    Decision::Admitted => {
                        shared.refused = false;
                        *place = None;
                        // The store took the path's shared buckets; the process's own copy
                        // of the tree (slots, days, meters, local buckets) takes its part.
                        if let (Some(tenants), Some(tenant)) = (tenants, &ask.tenant) {
                            tenants.take(tenant, &ask.cost, ns, now);
                        }
                        Answer::Admitted
                    }
                    Decision::Denied { wait, limit, .. }
                        if limit >= shared.limits().len()
                            && tenants.is_some()
                            && !path.is_empty() =>
                    {
                        // A node of its path cannot pay yet (other processes spent it): it
                        // steps out of the ordering, keeping its place, until then; the
                        // account did not refuse, so the others keep asking.
                        let node = &path[(limit - shared.limits().len()).min(path.len() - 1)].0;
                        let (tenants, tenant) = (tenants.as_mut().expect("checked"), &ask.tenant);
                        let tenant = tenant.as_ref().expect("a path was asked for");
                        let depth = node.depth();
                        let priority = ask.scheduling.priority;
                        let ticket = tenants.park(tenant, depth, priority, waker);
                        let at = crate::sched::saturating_deadline(now, remote.jittered(wait));
                        Answer::Parked(at, (depth, ticket))
                    }
                    Decision::Denied {
                        wait, floor_only, ..
                    } => {
                        shared.refused = true;
                        let restored = back(queue);
                        if let (Ok(()), Some(mine)) = (&restored, *place) {
                            // Refused only to keep its class floor: a request with a lower
                            // floor behind it may ask instead.
                            other = queue.set_floor_blocked(mine, floor_only, now);
                        }
                        match restored {
                            Ok(()) => Answer::RetryAt(
                                crate::sched::saturating_deadline(now, remote.jittered(wait)),
                                shared.refunds,
                            ),
                            Err(depth) => Answer::Full(depth),
                        }
                    }
                    Decision::TooLarge { limit } => {
                        *place = None;
                        match limit
                            .checked_sub(shared.limits().len())
                            .filter(|_| !path.is_empty())
                        {
                            None => Answer::Never(shared.too_large(limit, &ask.cost)),
                            // A node's limit, as the store knows it, is below the cost.
                            Some(node) => {
                                let (_, limit) = path[node.min(path.len() - 1)];
                                let dimension = limit.dimension();
                                Answer::Never(InsufficientCapacity {
                                    dimension,
                                    period: limit.period(),
                                    cost: ask.cost.amount(dimension),
                                    capacity: limit.capacity(),
                                })
                            }
                        }
                    }
                }
            }
            Err(error) => {
                shared.breaker.failed(ns);
                // The script may have run after all: give back whatever it took.
                remote.release(id, ask.cost, shared.limits().clone(), path.clone());
                tracing::warn!(%error, "the shared quota store did not answer");
                match remote.policy() {
                    FailurePolicy::LocalFallback { .. } => match back(queue) {
                        Ok(()) => Answer::Fallback,
                        Err(depth) => Answer::Full(depth),
                    },
                    FailurePolicy::FailClosed => {
                        *place = None;
                        Answer::Unavailable(error)
                    }
                }
            }
        };
        // A question ended: the head may ask (or be admitted) now, and whoever a floor lets go.
        let head = queue.head_waker(now).filter(|head| !head.will_wake(waker));
        drop(state);
        for waker in [head, other].into_iter().flatten() {
            waker.wake();
        }
        answer
    }

    /// A question to the shared store was abandoned (its caller left): give back whatever it
    /// may have taken, and let another caller probe the store.
    pub(crate) fn abandoned(&self, id: ReservationId, ask: &Ask) {
        let mut state = self.lock();
        state.slots.fulfil(false);
        let path = state.path_limits(ask.tenant.as_ref());
        if let (Some(shared), Some(remote)) = (state.shared.as_mut(), &self.shared.remote) {
            shared.asking = shared.asking.saturating_sub(1);
            shared.breaker.abandoned(id.get());
            remote.release(id, ask.cost, shared.limits().clone(), path);
        }
        let head = state.queue.head_waker(Instant::now());
        drop(state);
        if let Some(head) = head {
            head.wake();
        }
    }

    /// The question for the shared store, bounded by its timeout.
    pub(crate) fn ask(
        &self,
        id: ReservationId,
        cost: Cost,
        floor: Floor,
        (limits, path): (Arc<[Limit]>, PathLimits),
    ) -> remote::StoreFuture<Decision> {
        let Some(remote) = &self.shared.remote else {
            unreachable!("only a shared budget asks a shared store")
        };
        remote.reserve(id, cost, floor, limits, path)
    }

    /// Settles a reservation: `actual` replaces `reserved`, and its in-flight slot is given
    /// back.
    pub(crate) fn settle(
        &self,
        id: ReservationId,
        origin: Origin,
        reserved: &Cost,
        actual: &Cost,
        tenant: Option<&Tenant>,
    ) {
        // Every node of the tenant path settles too, under the same lock; requests parked for
        // a node that freed capacity look again.
        let mut parked = Vec::new();
        let mut settle_path = |state: &mut State| {
            if let (Some(tenants), Some(path)) = (&mut state.tenants, tenant) {
                let at = Instant::now();
                let ns = self.nanos_since_origin(at);
                tenants.settle(path, reserved, actual, ns, at, &mut parked);
            }
        };
        if let (Origin::Shared, Some(remote)) = (origin, &self.shared.remote) {
            let (mut limits, mut path) = (None, None);
            self.update_state(|state| {
                settle_path(state);
                limits = state.shared.as_ref().map(|shared| shared.limits().clone());
                path = Some(state.path_limits(tenant));
                // A slot given back: the head may go (the refund reaches the store later).
                state.slots.release_limited()
            });
            if let (Some(limits), Some(path)) = (limits, path) {
                remote.settle(id, *reserved, *actual, limits, path);
            }
            parked.into_iter().for_each(Waker::wake);
            return;
        }
        let now = || self.nanos_since_origin(Instant::now());
        self.update_state(|state| {
            settle_path(state);
            let slot = state.slots.release_limited();
            state.store.settle(id, reserved, actual, now) | slot
        });
        parked.into_iter().for_each(Waker::wake);
    }

    /// Changes the state; when `change` says capacity may have come sooner, wakes the head of
    /// the ordering (after releasing the lock) to look again.
    fn update_state(&self, change: impl FnOnce(&mut State) -> bool) {
        let mut state = self.lock();
        let head = if change(&mut state) && !state.queue.is_empty() {
            state.queue.head_waker(Instant::now())
        } else {
            None
        };
        drop(state);
        if let Some(head) = head {
            head.wake();
        }
    }

    /// Whether the level gauges are due (at most ten recordings a second per budget).
    #[cfg(feature = "metrics")]
    pub(crate) fn gauges_due(&self) -> bool {
        use std::sync::atomic::Ordering;
        let now = self.nanos_since_origin(Instant::now());
        let last = self.shared.gauges_at.load(Ordering::Relaxed);
        (last == 0 || now.saturating_sub(last) >= 100_000_000)
            && self
                .shared
                .gauges_at
                .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the state rather than propagate.
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn nanos_since_origin(&self, now: Instant) -> u64 {
        nanos(now.saturating_duration_since(self.shared.origin))
    }

    fn instant(&self, ns: u64) -> Instant {
        self.shared.origin + Duration::from_nanos(ns)
    }

    fn not_until(&self, at: u64, limit: &Limit) -> NotUntil {
        NotUntil {
            at: self.instant(at),
            dimension: limit.dimension(),
            period: limit.period(),
        }
    }
}

/// What a shared budget makes of its store's answer.
pub(crate) enum Answer {
    Admitted,
    Never(InsufficientCapacity),
    /// Denied for now: ask again at this instant (unless a refund reaches the store first:
    /// the second field counts them), keeping the place in the queue.
    RetryAt(Instant, u64),
    /// Denied, and the ordering is too deep to wait in.
    Full(usize),
    /// Denied by a node of its tenant path: out of the ordering, keeping its place, until this
    /// instant (or until woken), parked at that node.
    Parked(Instant, (usize, u64)),
    /// The store failed: admit from the local fallback share.
    Fallback,
    Unavailable(StoreUnavailable),
}

impl State {
    /// Fails when `cost` exceeds a capacity (less `floor`): of the shared limits for a shared
    /// budget, of the buckets for an in-memory one.
    fn check_capacity(&self, cost: &Cost, floor: Floor) -> Result<(), InsufficientCapacity> {
        match &self.shared {
            Some(shared) => shared.check_capacity(cost, floor),
            None => self.store.check_capacity(cost, floor),
        }
    }

    /// Joins the ordering, or refreshes the waker of a waiter already in it: `Step::Queued`,
    /// or `Step::Full` when the ordering is as deep as the request allows.
    fn wait(&mut self, place: &mut Option<Place>, ask: &Ask, waker: &Waker) -> Step {
        match self.queue.wait(place, ask, waker) {
            Ok(()) => Step::Queued,
            Err(Full(depth)) => Step::Full(depth),
        }
    }

    /// The limits of the tenant nodes of `path`, for the shared store (none without tenants).
    fn path_limits(&self, path: Option<&Tenant>) -> PathLimits {
        match (&self.tenants, path) {
            (Some(tenants), Some(path)) => tenants.shared_path(path),
            _ => Arc::from([]),
        }
    }

    fn next_id(&mut self) -> ReservationId {
        self.next_id += 1;
        ReservationId(self.next_id)
    }

    /// The id [`State::next_id`] will give.
    fn peek_id(&self) -> ReservationId {
        ReservationId(self.next_id + 1)
    }

    /// `at`, or sooner when aging may change who goes first before then: the head sleeping
    /// until its cost fits looks again then, and hands over if it is no longer the head.
    fn until_reorder(&self, at: Instant, now: Instant) -> Instant {
        self.queue
            .next_reorder(now)
            .map_or(at, |reorder| reorder.min(at))
    }

    /// Leaves the ordering, if in it; collects the waker of the new head.
    fn leave(&mut self, place: &mut Option<Place>, now: Instant) -> Wakeups {
        Wakeups(place.take().and_then(|mine| self.queue.remove(mine, now)))
    }
}

impl fmt::Debug for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("Budget")
            .field("store", &state.store)
            .field("waiters", &state.queue.len())
            .finish()
    }
}
