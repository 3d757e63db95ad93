//! The queue shared by every service of one layer, and its introspection handle.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use tokio::time::{Instant, Sleep, sleep_until};

use super::config::QueueConfig;
use crate::budget::Budget;
use crate::sched::QueueSnapshot;
use crate::sched::order::{Order, Place};

/// The ordering behind a mutex, with the wake-up rules and the deadline alarm around it.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) config: QueueConfig,
    state: Mutex<State>,
    /// How many requests wait, readable without the lock (written under it).
    waiting: AtomicUsize,
    /// The budgets its requests went on to wait in, found through [`QueueLink`]s.
    linked: Mutex<Vec<Budget>>,
    /// Requests stamped: after the first budget is found, one request in
    /// [`LINK_EVERY`] still carries a link, to find others (a router's routes).
    stamped: AtomicUsize,
    /// The address of the budget linked last: the common case checks it without the lock.
    last_linked: AtomicUsize,
}

/// One request in this many carries a [`QueueLink`] once the queue knows a budget.
const LINK_EVERY: usize = 256;

/// A request extension naming the queue that placed it, so that a budget it waits in next
/// makes itself known to the queue (whose snapshot then counts the budget's waiters).
#[derive(Debug, Clone)]
pub(crate) struct QueueLink(pub(crate) Arc<Inner>);

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) order: Order<()>,
    /// One timer for the whole queue, armed for the first deadline by the request that has it
    /// (the sentinel): no timer per waiting request.
    alarm: Option<Pin<Box<Sleep>>>,
    sentinel: Option<Place>,
}

impl Inner {
    pub(crate) fn new(config: QueueConfig) -> Self {
        Self {
            config,
            state: Mutex::new(State {
                order: Order::default(),
                alarm: None,
                sentinel: None,
            }),
            waiting: AtomicUsize::new(0),
            linked: Mutex::new(Vec::new()),
            stamped: AtomicUsize::new(0),
            last_linked: AtomicUsize::new(0),
        }
    }

    /// The link a request placed now carries, if it carries one: every request until a
    /// budget is known, then one in [`LINK_EVERY`].
    pub(crate) fn link(self: &Arc<Self>) -> Option<QueueLink> {
        let n = self.stamped.fetch_add(1, Ordering::Relaxed);
        let known = self.last_linked.load(Ordering::Relaxed) != 0;
        (!known || n % LINK_EVERY == 0).then(|| QueueLink(Arc::clone(self)))
    }

    /// `budget` holds requests this queue placed: its waiters count in the queue's snapshot.
    pub(crate) fn linked_to(&self, budget: &Budget) {
        let address = budget.address();
        if self.last_linked.load(Ordering::Relaxed) == address {
            return;
        }
        let mut linked = self.linked.lock().unwrap_or_else(PoisonError::into_inner);
        if !linked.iter().any(|known| known.address() == address) {
            linked.push(budget.clone());
        }
        self.last_linked.store(address, Ordering::Relaxed);
    }

    /// Whether nobody waits in the queue's own ordering (a hint: it may change at once).
    pub(crate) fn is_empty(&self) -> bool {
        self.waiting.load(Ordering::Acquire) == 0
    }

    /// Records the ordering's length after a change made under the lock.
    pub(crate) fn count(&self, state: &State) {
        self.waiting.store(state.order.len(), Ordering::Release);
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the state rather than propagate.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes a waiting request (handed over, cancelled, expired, failed) and lets the next
    /// one look.
    pub(crate) fn leave(&self, place: Place) {
        let now = Instant::now();
        let mut state = self.lock();
        state.order.remove(place, now);
        self.count(&state);
        if state.order.is_empty() {
            // Nobody waits: nobody to wake, no deadline to watch (the common case of a queue
            // that keeps up).
            return;
        }
        let next = state.order.top_waker(now);
        let first_deadline = state.order.first_deadline();
        let sentinel = match first_deadline {
            Some(place) if state.sentinel != Some(place) => {
                state.sentinel = None;
                state.order.waker(place)
            }
            _ => None,
        };
        drop(state);
        if let Some(sentinel) = sentinel.filter(|s| next.as_ref().is_none_or(|n| !s.will_wake(n))) {
            sentinel.wake();
        }
        if let Some(next) = next {
            next.wake();
        }
    }

    /// Ready when `place`'s deadline has passed. Otherwise, if its deadline is the first, arms
    /// the queue's alarm for it (it becomes the sentinel, woken at its deadline).
    pub(crate) fn poll_deadline(&self, place: Place, cx: &mut Context<'_>) -> Poll<()> {
        let Some(deadline) = place.deadline() else {
            return Poll::Pending;
        };
        if Instant::now() >= deadline {
            return Poll::Ready(());
        }
        let mut state = self.lock();
        if state.order.first_deadline() != Some(place) {
            return Poll::Pending;
        }
        state.sentinel = Some(place);
        let alarm = state
            .alarm
            .get_or_insert_with(|| Box::pin(sleep_until(deadline)));
        if alarm.deadline() != deadline {
            alarm.as_mut().reset(deadline);
        }
        alarm.as_mut().poll(cx)
    }
}

/// A handle on a priority queue, for introspection; see
/// [`PriorityQueueLayer::handle`](crate::PriorityQueueLayer::handle).
///
/// Under a [`TokenBudgetLayer`](crate::TokenBudgetLayer), requests wait in the budget's
/// ordering rather than in the queue's own (the queue only stamps their class and place).
/// The snapshot counts everyone waiting: the queue's own ordering and that of every budget
/// its requests reached (each budget makes itself known through the requests; everyone
/// waiting in such a budget counts, whichever way they came), and of the budgets given to
/// [`including`](Self::including). [`own_snapshot`](Self::own_snapshot) is the narrower
/// view.
#[derive(Debug, Clone)]
pub struct QueueHandle {
    queue: Arc<Inner>,
    budget: Option<Budget>,
}

impl QueueHandle {
    pub(crate) fn new(queue: Arc<Inner>) -> Self {
        Self {
            queue,
            budget: None,
        }
    }

    /// This handle, counting also the requests waiting in `budget`'s ordering.
    pub fn including(self, budget: &Budget) -> Self {
        Self {
            budget: Some(budget.clone()),
            ..self
        }
    }

    /// The depth and oldest wait of every class, now, over everyone waiting (see above).
    pub fn snapshot(&self) -> QueueSnapshot {
        let mut budgets: Vec<Budget> = self
            .queue
            .linked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(budget) = &self.budget {
            if !budgets.iter().any(|b| b.address() == budget.address()) {
                budgets.push(budget.clone());
            }
        }
        budgets.iter().fold(self.own_snapshot(), |sum, budget| {
            sum.merge(budget.queue_snapshot())
        })
    }

    /// The depth and oldest wait of the requests waiting in the queue's own ordering only
    /// (for an inner service that is not ready), now.
    pub fn own_snapshot(&self) -> QueueSnapshot {
        self.queue.lock().order.snapshot(Instant::now())
    }
}
