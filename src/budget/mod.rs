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
//! # Waiting: first in, first out
//!
//! Requests that cannot be admitted at once wait in a queue and are admitted in arrival order:
//! a large request is never overtaken by a stream of small ones (a sleep-and-recheck loop lets
//! that happen). The trade-off is head-of-line blocking: a small request that would fit now
//! waits behind a large one at the head, exactly as tokio's semaphore does. Only the head
//! sleeps, until the instant its cost becomes available; it is woken earlier when a refund or a
//! limit change makes that sooner. The others wait without a timer, so waiting costs no CPU.
//!
//! # Cancel safety
//!
//! [`Reserve`] is cancel safe: dropping it leaves the queue (and wakes the next waiter if it was
//! at the head), and a reservation is only ever handed out by a completed future. A dropped
//! [`Reservation`] is refunded or charged by the rule in its documentation, so no capacity
//! leaks.

mod bucket;
mod observation;
#[cfg(feature = "redis")]
pub mod redis;
mod remote;
mod reservation;
mod reserve;
mod share;
mod shared;
mod snapshot;
pub(crate) mod store;
mod waiters;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
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
use crate::quota::{Dimension, Limit, Quota};
use bucket::Floor;
use remote::Decision;
use reservation::Origin;
use shared::{Remote, SharedState};
use store::{Denial, MemoryStore, Store, nanos};
use waiters::{VacancyWatchers, WaitQueue};

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
    queue: WaitQueue,
    vacancy: VacancyWatchers,
    next_id: u64,
}

/// One step of a waiting admission.
pub(crate) enum Step {
    Admitted(ReservationId, Origin),
    Never(InsufficientCapacity),
    /// The shared store could not be asked, and the policy is to refuse.
    Unavailable(StoreUnavailable),
    /// At the head of the queue of a shared budget: ask the shared store, under this id.
    Ask(ReservationId, Arc<[Limit]>),
    /// At the head of the queue: the cost fits at this instant.
    WaitUntil(Instant),
    /// Behind others: woken when it reaches the head.
    Queued,
}

/// Wakers collected under the lock, woken after it is released.
#[derive(Default)]
struct Wakeups {
    head: Option<Waker>,
    vacancy: BTreeMap<u64, Waker>,
}

impl Wakeups {
    fn wake(self) {
        if let Some(head) = self.head {
            head.wake();
        }
        self.vacancy.into_values().for_each(Waker::wake);
    }
}

impl Budget {
    /// A budget enforcing every limit of `quota`, with every bucket full.
    pub fn new(quota: Quota) -> Self {
        Self::with_store(MemoryStore::new(&quota), None, None)
    }

    fn with_store(store: MemoryStore, shared: Option<SharedState>, remote: Option<Remote>) -> Self {
        Self {
            shared: Arc::new(Shared {
                origin: Instant::now(),
                remote,
                #[cfg(feature = "metrics")]
                gauges_at: std::sync::atomic::AtomicU64::new(0),
                state: Mutex::new(State {
                    store,
                    shared,
                    queue: WaitQueue::default(),
                    vacancy: VacancyWatchers::default(),
                    next_id: 0,
                }),
            }),
        }
    }

    /// Waits until `cost` can be paid in every limit it touches, then reserves it.
    ///
    /// Waiters are admitted first in, first out. Fails at once, without waiting, when `cost`
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
        let id = state.next_id();
        match state.store.reserve(id, &cost, Floor::NONE, ns) {
            Ok(()) => {
                drop(state);
                Ok(Reservation::new(self.clone(), id, cost, Origin::Local))
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
        }
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
    /// shortens it; [`Budget::lift_pause`] ends it. An adaptive share
    /// ([`AdaptiveShare`]) counts the refusal and plans less.
    ///
    /// A shared budget writes the pause to the shared store too, in the background: one
    /// process's 429 pauses every process sharing the quota.
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
    /// Only this process's buckets are lifted: a pause already written to a shared store
    /// lasts until its own end.
    pub fn lift_pause(&self, dimensions: &[Dimension]) {
        self.update_state(|state| {
            dimensions.iter().for_each(|&d| state.store.lift(d));
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
    /// A shared budget asks its shared store (`Step::Ask`) unless `local` (the store failed
    /// and the policy is to fall back) or its breaker is open; not before `retry_at`, the
    /// store's last hint.
    pub(crate) fn poll_admission(
        &self,
        ticket: &mut Option<u64>,
        cost: &Cost,
        floor: Floor,
        waker: &Waker,
        local: bool,
        retry_at: Option<(Instant, u64)>,
    ) -> Step {
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let mut state = self.lock();
        let at_head = match *ticket {
            None => state.queue.is_empty(),
            Some(t) => state.queue.head() == Some(t),
        };
        if !at_head {
            if ticket.is_none() {
                // Refuse at once what can never fit, rather than after a wait in line.
                if let Err(e) = state.check_capacity(cost, floor) {
                    return Step::Never(e);
                }
            }
            state.wait(ticket, cost, waker);
            return Step::Queued;
        }
        if let (Some(remote), true, false) = (&self.shared.remote, state.shared.is_some(), local) {
            // The store's wait, unless a refund reached the store since it told it.
            let refunds = state.shared.as_ref().map_or(0, |shared| shared.refunds);
            if let Some((at, _)) = retry_at.filter(|(at, told)| *at > now && *told == refunds) {
                state.wait(ticket, cost, waker);
                return Step::WaitUntil(at);
            }
            let id = state.peek_id();
            let shared = state
                .shared
                .as_mut()
                .expect("a shared budget has shared state");
            if shared.breaker.allow(id.get(), ns) {
                let limits = shared.limits().clone();
                return Step::Ask(state.next_id(), limits);
            }
            if remote.policy() == FailurePolicy::FailClosed {
                let wakeups = ticket.take().map(|t| state.leave(t)).unwrap_or_default();
                drop(state);
                wakeups.wake();
                return Step::Unavailable(StoreUnavailable::breaker_open());
            }
        }
        if state.shared.is_some() && state.store.check_capacity(cost, floor).is_err() {
            // The store is out of reach and the local share cannot pay this cost at all.
            let wakeups = ticket.take().map(|t| state.leave(t)).unwrap_or_default();
            drop(state);
            wakeups.wake();
            return Step::Unavailable(StoreUnavailable::new(
                "the shared store is out of reach and the cost exceeds the local fallback share",
            ));
        }
        let id = state.next_id();
        match state.store.reserve(id, cost, floor, ns) {
            Ok(()) => {
                if state.shared.is_some() {
                    let reason = if local {
                        "store_unavailable"
                    } else {
                        "breaker_open"
                    };
                    crate::observe::fallback(reason);
                }
                let wakeups = ticket.take().map(|t| state.leave(t)).unwrap_or_default();
                drop(state);
                wakeups.wake();
                Step::Admitted(id, Origin::Local)
            }
            Err(Denial::NotUntil { at, .. }) => {
                state.wait(ticket, cost, waker);
                Step::WaitUntil(self.instant(at))
            }
            Err(Denial::Never(e)) => {
                // Too large from the start, or a limit shrank below it while it waited.
                let wakeups = ticket.take().map(|t| state.leave(t)).unwrap_or_default();
                drop(state);
                wakeups.wake();
                Step::Never(e)
            }
        }
    }

    /// Gives up a place in the queue.
    pub(crate) fn cancel(&self, ticket: u64) {
        let wakeups = self.lock().leave(ticket);
        wakeups.wake();
    }

    /// What the shared store answered to the head's question (`Step::Ask`).
    pub(crate) fn answered(
        &self,
        ticket: &mut Option<u64>,
        id: ReservationId,
        answer: Result<Decision, StoreUnavailable>,
        cost: &Cost,
        waker: &Waker,
    ) -> Answer {
        let Some(remote) = &self.shared.remote else {
            unreachable!("only a shared budget asks a shared store")
        };
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let mut state = self.lock();
        let shared = state
            .shared
            .as_mut()
            .expect("a shared budget has shared state");
        let mut leave = false;
        let answer = match answer {
            Ok(decision) => {
                shared.breaker.succeeded();
                match decision {
                    Decision::Admitted => {
                        leave = true;
                        Answer::Admitted
                    }
                    Decision::Denied { wait, .. } => {
                        let refunds = shared.refunds;
                        state.wait(ticket, cost, waker);
                        Answer::RetryAt(now + remote.jittered(wait), refunds)
                    }
                    Decision::TooLarge { limit } => {
                        leave = true;
                        Answer::Never(shared.too_large(limit, cost))
                    }
                }
            }
            Err(error) => {
                shared.breaker.failed(ns);
                // The script may have run after all: give back whatever it took.
                remote.release(id, *cost, shared.limits().clone());
                tracing::warn!(%error, "the shared quota store did not answer");
                match remote.policy() {
                    FailurePolicy::LocalFallback { .. } => Answer::Fallback,
                    FailurePolicy::FailClosed => {
                        leave = true;
                        Answer::Unavailable(error)
                    }
                }
            }
        };
        if leave {
            let wakeups = ticket.take().map(|t| state.leave(t)).unwrap_or_default();
            drop(state);
            wakeups.wake();
        }
        answer
    }

    /// A question to the shared store was abandoned (its caller left): give back whatever it
    /// may have taken, and let another caller probe the store.
    pub(crate) fn abandoned(&self, id: ReservationId, cost: &Cost) {
        let mut state = self.lock();
        if let (Some(shared), Some(remote)) = (state.shared.as_mut(), &self.shared.remote) {
            shared.breaker.abandoned(id.get());
            remote.release(id, *cost, shared.limits().clone());
        }
    }

    /// The question for the shared store, bounded by its timeout.
    pub(crate) fn ask(
        &self,
        id: ReservationId,
        cost: Cost,
        floor: Floor,
        limits: Arc<[Limit]>,
    ) -> remote::StoreFuture<Decision> {
        let Some(remote) = &self.shared.remote else {
            unreachable!("only a shared budget asks a shared store")
        };
        remote.reserve(id, cost, floor, limits)
    }

    /// Settles a reservation: `actual` replaces `reserved`.
    pub(crate) fn settle(&self, id: ReservationId, origin: Origin, reserved: &Cost, actual: &Cost) {
        if let (Origin::Shared, Some(remote)) = (origin, &self.shared.remote) {
            let limits = match &self.lock().shared {
                Some(shared) => shared.limits().clone(),
                None => return,
            };
            remote.settle(id, *reserved, *actual, limits);
            return;
        }
        let now = || self.nanos_since_origin(Instant::now());
        self.update_state(|state| state.store.settle(id, reserved, actual, now));
    }

    /// Changes the state; when `change` says capacity may have come sooner, wakes the head of
    /// the queue (after releasing the lock) to look again.
    fn update_state(&self, change: impl FnOnce(&mut State) -> bool) {
        let mut state = self.lock();
        let head = if change(&mut state) {
            state.queue.head_waker()
        } else {
            None
        };
        drop(state);
        if let Some(head) = head {
            head.wake();
        }
    }

    /// Ready when no request waits, so a new one would not queue behind others; otherwise
    /// registers the caller (under `key`) to be woken when the queue empties.
    pub(crate) fn poll_vacancy(&self, key: &mut Option<u64>, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.lock();
        if state.queue.is_empty() {
            if let Some(key) = key.take() {
                state.vacancy.forget(key);
            }
            return Poll::Ready(());
        }
        state.vacancy.register(key, cx.waker());
        Poll::Pending
    }

    /// Forgets a registration made by [`Budget::poll_vacancy`].
    pub(crate) fn forget_vacancy(&self, key: u64) {
        self.lock().vacancy.forget(key);
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

    /// Joins the queue, or refreshes the waker of a waiter already in it.
    fn wait(&mut self, ticket: &mut Option<u64>, cost: &Cost, waker: &Waker) {
        match *ticket {
            Some(t) => self.queue.set_waker(t, waker),
            None => *ticket = Some(self.queue.push(*cost, waker)),
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

    /// Removes a waiter; collects the wakers of whoever should look again.
    fn leave(&mut self, ticket: u64) -> Wakeups {
        let was_head = self.queue.remove(ticket);
        let mut wakeups = Wakeups::default();
        if self.queue.is_empty() {
            wakeups.vacancy = self.vacancy.take();
        } else if was_head {
            wakeups.head = self.queue.head_waker();
        }
        wakeups
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
