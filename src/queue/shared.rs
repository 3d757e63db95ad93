//! The queue shared by every service of one layer, and its introspection handle.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::engine::{Engine, Key};
use crate::priority::Priority;

/// The engine behind a mutex, with the wake-up rules around it.
#[derive(Debug)]
pub(crate) struct Shared {
    engine: Mutex<Engine>,
}

impl Shared {
    pub(crate) fn new(engine: Engine) -> Self {
        Self {
            engine: Mutex::new(engine),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Engine> {
        // No code panics while holding the lock; recover the state rather than propagate.
        self.engine.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes a waiting request (cancelled, expired, failed) and lets the next one look.
    pub(crate) fn leave(&self, key: Key) {
        self.update(|engine, now| {
            engine.remove(key, now);
        });
    }

    /// Ends a dispatch and lets the next request look.
    pub(crate) fn end_dispatch(&self) {
        self.update(|engine, _| engine.end_dispatch());
    }

    /// Changes the queue, then wakes (after unlocking) the request that goes next.
    fn update(&self, change: impl FnOnce(&mut Engine, Instant)) {
        let now = Instant::now();
        let mut engine = self.lock();
        change(&mut engine, now);
        let next = engine.next_waker(now);
        drop(engine);
        if let Some(next) = next {
            next.wake();
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
        let engine = self.shared.lock();
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
