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
pub(crate) struct Shared {
    pub(crate) config: QueueConfig,
    state: Mutex<State>,
    /// How many requests wait, readable without the lock (written under it).
    waiting: AtomicUsize,
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) order: Order<()>,
    /// One timer for the whole queue, armed for the first deadline by the request that has it
    /// (the sentinel): no timer per waiting request.
    alarm: Option<Pin<Box<Sleep>>>,
    sentinel: Option<Place>,
}

impl Shared {
    pub(crate) fn new(config: QueueConfig) -> Self {
        Self {
            config,
            state: Mutex::new(State {
                order: Order::default(),
                alarm: None,
                sentinel: None,
            }),
            waiting: AtomicUsize::new(0),
        }
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
/// ordering rather than in the queue's own (the queue only stamps their class and place):
/// [`QueueHandle::including`] adds the budget's waiters to the snapshot.
#[derive(Debug, Clone)]
pub struct QueueHandle {
    shared: Arc<Shared>,
    budget: Option<Budget>,
}

impl QueueHandle {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self {
            shared,
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

    /// The depth and oldest wait of every class, now.
    pub fn snapshot(&self) -> QueueSnapshot {
        let own = self.shared.lock().order.snapshot(Instant::now());
        match &self.budget {
            Some(budget) => own.merge(budget.queue_snapshot()),
            None => own,
        }
    }
}
