//! The [`Budget`] handle and the state its clones share: construction, snapshots, limit and
//! level changes, pauses, and settlement. Admission lives in `admission` (in memory) and
//! `remote_admission` (through a shared store).

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::{Arc, PoisonError};
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::engine::{Slots, WaitList};
use super::observation::Observation;
use super::remote_state::{Remote, SharedState};
use super::snapshot::BudgetSnapshot;
use super::store::{MemoryStore, Origin, ReservationId, Store, nanos};
use crate::budget::tenants::shared::Tenants;
use crate::cost::Cost;
use crate::error::NotUntil;
use crate::loom::{Mutex, MutexGuard};
use crate::quota::LimitSnapshot;
use crate::quota::{Dimension, Limit, Quota};
use crate::sched::QueueSnapshot;
use crate::tenant::Tenant;

/// A shared quota budget: a cheap handle, and clones share the same buckets and queue.
///
/// Hand clones to every client, task and layer that spends one provider quota. See the
/// [module documentation](crate::budget) for the admission rules.
#[derive(Clone)]
pub struct Budget {
    pub(super) shared: Arc<Shared>,
}

pub(super) struct Shared {
    /// The zero of the budget's clock; times inside are nanoseconds since it.
    pub(super) origin: Instant,
    pub(super) state: Mutex<State>,
    /// The store shared with other processes, when there is one.
    pub(super) remote: Option<Remote>,
    /// When the level gauges were last recorded (nanoseconds on the budget's clock).
    #[cfg(feature = "metrics")]
    pub(super) gauges_at: std::sync::atomic::AtomicU64,
}

pub(super) struct State {
    /// The buckets of an in-memory budget; of a shared one, its local fallback share.
    pub(super) store: MemoryStore,
    /// The limits and circuit breaker of a shared budget.
    pub(super) shared: Option<SharedState>,
    pub(super) queue: WaitList,
    pub(super) slots: Slots,
    pub(super) next_id: u64,
    /// The tenant tree, when the budget has one.
    pub(super) tenants: Option<Tenants>,
}

impl Budget {
    /// A budget enforcing every limit of `quota`, with every bucket full.
    pub fn new(quota: Quota) -> Self {
        Self::with_store(&quota, MemoryStore::new(&quota), None, None)
    }

    pub(super) fn with_store(
        quota: &Quota,
        store: MemoryStore,
        shared: Option<SharedState>,
        remote: Option<Remote>,
    ) -> Self {
        let mut queue = WaitList::default();
        if let Some(name) = quota.name() {
            queue.set_label(name.into());
        }
        Self {
            shared: Arc::new(Shared {
                origin: Instant::now(),
                remote,
                #[cfg(feature = "metrics")]
                gauges_at: std::sync::atomic::AtomicU64::new(0),
                state: Mutex::new(State {
                    store,
                    shared,
                    queue,
                    slots: Slots::new(quota.max_in_flight()),
                    next_id: 0,
                    tenants: None,
                }),
            }),
        }
    }

    /// The budget's identity: equal for every clone of one budget.
    pub(crate) fn address(&self) -> usize {
        Arc::as_ptr(&self.shared) as usize
    }

    /// The `queue` label of the depth gauge of the budget's ordering (its quota's name).
    pub(crate) fn queue_label(&self) -> Arc<str> {
        self.lock().queue.label()
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
    /// share ([`AdaptiveShare`](super::AdaptiveShare)) counts the refusal and plans less.
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
                tenants.settle(path, (reserved, actual), ns, at, &mut parked);
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
    pub(super) fn update_state(&self, change: impl FnOnce(&mut State) -> bool) {
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

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the state rather than propagate.
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn nanos_since_origin(&self, now: Instant) -> u64 {
        nanos(now.saturating_duration_since(self.shared.origin))
    }

    pub(super) fn instant(&self, ns: u64) -> Instant {
        self.shared.origin + Duration::from_nanos(ns)
    }

    pub(super) fn not_until(&self, at: u64, limit: &Limit) -> NotUntil {
        NotUntil {
            at: self.instant(at),
            dimension: limit.dimension(),
            period: limit.period(),
        }
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
