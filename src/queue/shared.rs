//! The queue shared by every service of one layer, and its introspection handle.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep, sleep_until};

use super::engine::{Engine, Key};
use crate::priority::Priority;

/// The engine behind a mutex, with the wake-up rules and the deadline alarm around it.
#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) engine: Engine,
    /// One timer for the whole queue, armed for the first deadline by the request that has it
    /// (the sentinel): no timer per waiting request.
    alarm: Option<Pin<Box<Sleep>>>,
    sentinel: Option<Key>,
}

impl Shared {
    pub(crate) fn new(engine: Engine) -> Self {
        Self {
            state: Mutex::new(State {
                engine,
                alarm: None,
                sentinel: None,
            }),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the state rather than propagate.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes a waiting request (cancelled, expired, failed) and lets the next one look.
    pub(crate) fn leave(&self, key: Key) {
        self.update(|engine, now| {
            engine.remove(key, now);
        });
    }

    /// Hands `key` to the inner service if it goes next; see [`Engine::begin_dispatch`].
    pub(crate) fn begin_dispatch(&self, key: Key) -> bool {
        let mut began = false;
        self.update(|engine, now| began = engine.begin_dispatch(key, now));
        began
    }

    /// Ends a dispatch and lets the next request look.
    pub(crate) fn end_dispatch(&self) {
        self.update(|engine, _| engine.end_dispatch());
    }

    /// Ready when `key`'s deadline has passed. Otherwise, if its deadline is the first, arms
    /// the queue's alarm for it (it becomes the sentinel, woken at its deadline).
    pub(crate) fn poll_deadline(&self, key: Key, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= key.deadline() {
            return Poll::Ready(());
        }
        let mut state = self.lock();
        if state.engine.first_deadline() != Some(key) {
            return Poll::Pending;
        }
        state.sentinel = Some(key);
        let alarm = state
            .alarm
            .get_or_insert_with(|| Box::pin(sleep_until(key.deadline())));
        if alarm.deadline() != key.deadline() {
            alarm.as_mut().reset(key.deadline());
        }
        alarm.as_mut().poll(cx)
    }

    /// Changes the queue, then wakes (after unlocking) the request that goes next, and the one
    /// whose deadline is now first if the sentinel changed, so that it arms the alarm.
    fn update(&self, change: impl FnOnce(&mut Engine, Instant)) {
        let now = Instant::now();
        let mut state = self.lock();
        change(&mut state.engine, now);
        if state.engine.len() == 0 {
            // Nobody waits: nobody to wake, no deadline to watch (the common case of a queue
            // that keeps up).
            return;
        }
        let next = state.engine.next_waker(now);
        let first_deadline = state.engine.first_deadline();
        let sentinel = match first_deadline {
            Some(key) if state.sentinel != Some(key) => {
                state.sentinel = None;
                state.engine.waker(key)
            }
            _ => None,
        };
        drop(state);
        if let Some(next) = next {
            if let Some(sentinel) = sentinel.filter(|s| !s.will_wake(&next)) {
                sentinel.wake();
            }
            next.wake();
        } else if let Some(sentinel) = sentinel {
            sentinel.wake();
        }
    }
}

/// A handle on a priority queue, for introspection; see
/// [`PriorityQueueLayer::handle`](crate::PriorityQueueLayer::handle).
#[derive(Debug, Clone)]
pub struct QueueHandle {
    pub(crate) shared: std::sync::Arc<Shared>,
}

impl QueueHandle {
    /// The depth and oldest wait of every class, now.
    pub fn snapshot(&self) -> QueueSnapshot {
        let now = Instant::now();
        let state = self.shared.lock();
        let engine = &state.engine;
        QueueSnapshot {
            classes: engine.snapshot(now).map(|c| ClassSnapshot {
                priority: c.priority,
                depth: c.depth,
                oldest_wait: c.oldest_wait,
            }),
            depth: engine.len(),
        }
    }
}

/// A queue's state at one instant.
///
/// With the `serde` feature it serializes, for a health or debug endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSnapshot {
    classes: [ClassSnapshot; 3],
    depth: usize,
}

impl QueueSnapshot {
    /// Every class, highest first.
    pub fn classes(&self) -> &[ClassSnapshot] {
        &self.classes
    }

    /// One class.
    pub fn class(&self, priority: Priority) -> &ClassSnapshot {
        &self.classes[priority.index()]
    }

    /// Requests waiting in all.
    pub fn depth(&self) -> usize {
        self.depth
    }
}

/// One class in a [`QueueSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassSnapshot {
    priority: Priority,
    depth: usize,
    oldest_wait: Duration,
}

impl ClassSnapshot {
    /// The class (as requested, before any promotion).
    pub fn priority(&self) -> Priority {
        self.priority
    }

    /// Requests of this class waiting.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// How long the oldest of them has waited (zero when none waits).
    pub fn oldest_wait(&self) -> Duration {
        self.oldest_wait
    }
}
