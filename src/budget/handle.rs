//! The [`Budget`] handle and the [`Engine`] behind it: the state its clones share, with what
//! every part of the budget uses of it (the lock, the clock, settlement). The public API is
//! in `facade.rs`, the only `impl Budget`; admission in `engine/`.

use std::fmt;
use std::sync::{Arc, PoisonError};
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::engine::{Slots, WaitList};
use crate::budget::memory::store::{LimitState, MemoryStore, Origin, ReservationId, Store, nanos};
use crate::budget::store::state::{Remote, RemoteState};
use crate::budget::tenants::state::Tenants;
use crate::cost::Cost;
use crate::error::NotUntil;
use crate::loom::{Mutex, MutexGuard};
use crate::quota::{Limit, LimitSnapshot, PeriodCap, Quota};
use crate::tenant::Tenant;

/// A shared quota budget: a cheap handle, and clones share the same buckets and queue.
///
/// Hand clones to every client, task and layer that spends one provider quota. See the
/// [module documentation](crate::budget) for the admission rules.
#[derive(Clone)]
pub struct Budget {
    pub(super) engine: Arc<Engine>,
}

/// The engine behind every clone of a budget: its state under one lock, its clock, and the
/// store it shares with other processes. `facade.rs` is its public face; its methods are
/// spread by subject: admission in `engine/`, the shared store in `store/`, tenants in
/// `tenants/`, and here what all of them use (the lock, the clock, settlement).
pub(crate) struct Engine {
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
    /// The limits and circuit breaker of a budget kept in a store.
    pub(super) remote: Option<RemoteState>,
    pub(super) queue: WaitList,
    pub(super) slots: Slots,
    pub(super) next_id: u64,
    /// The tenant tree, when the budget has one (always, when the account has caps).
    pub(super) tenants: Option<Tenants>,
    /// The account's own caps ([`Quota::with_cap`]), counted in its tenant state.
    pub(super) caps: Vec<PeriodCap>,
    /// What the reservations outstanding in the buckets hold (of an in-memory budget): the
    /// most their settlements can give back.
    pub(super) held: crate::Cost,
}

impl Engine {
    pub(super) fn new(
        quota: &Quota,
        store: MemoryStore,
        remote_state: Option<RemoteState>,
        remote: Option<Remote>,
    ) -> Arc<Self> {
        let mut queue = WaitList::default();
        if let Some(name) = quota.name() {
            queue.set_label(name.into());
        }
        let engine = Arc::new(Engine {
            origin: Instant::now(),
            remote,
            #[cfg(feature = "metrics")]
            gauges_at: std::sync::atomic::AtomicU64::new(0),
            state: Mutex::new(State {
                store,
                remote: remote_state,
                queue,
                slots: Slots::new(quota.max_in_flight()),
                next_id: 0,
                tenants: None,
                held: crate::Cost::default(),
                caps: quota.caps().to_vec(),
            }),
        });
        // The account's caps are counted where its tenants' are.
        engine.count_caps();
        engine
    }

    /// The `queue` label of the depth gauge of the budget's ordering (its quota's name).
    pub(crate) fn queue_label(&self) -> Arc<str> {
        self.lock().queue.label()
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
        if let (Origin::Remote, Some(remote)) = (origin, &self.remote) {
            let (mut limits, mut path) = (None, None);
            self.update_state(|state| {
                settle_path(state);
                limits = state.remote.as_ref().map(|shared| shared.limits().clone());
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
            state.held = state.held.saturating_sub(*reserved);
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
        let last = self.gauges_at.load(Ordering::Relaxed);
        (last == 0 || now.saturating_sub(last) >= 100_000_000)
            && self
                .gauges_at
                .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the state rather than propagate.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn nanos_since_origin(&self, now: Instant) -> u64 {
        nanos(now.saturating_duration_since(self.origin))
    }

    pub(super) fn instant(&self, ns: u64) -> Instant {
        self.origin + Duration::from_nanos(ns)
    }

    /// A limit's state as a snapshot shows it, its instants on tokio's clock.
    pub(super) fn limit_snapshot(&self, state: LimitState) -> LimitSnapshot {
        LimitSnapshot {
            limit: state.limit,
            capacity: state.capacity,
            level: state.level,
            extra: state.extra,
            available_at: self.instant(state.available_at),
            full_at: self.instant(state.full_at),
        }
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
        let state = self.engine.lock();
        f.debug_struct("Budget")
            .field("store", &state.store)
            .field("waiters", &state.queue.len())
            .finish()
    }
}
