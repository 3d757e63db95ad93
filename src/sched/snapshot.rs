//! The depth and oldest wait of an ordering, by class.

use std::time::Duration;

use crate::priority::Priority;

/// The requests waiting in an ordering at one instant: a priority queue's, or a budget's
/// (see [`Budget::queue_snapshot`](crate::Budget::queue_snapshot)).
///
/// With the `serde` feature it serializes, for a health or debug endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSnapshot {
    pub(crate) classes: [ClassSnapshot; 3],
    pub(crate) depth: usize,
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

    /// Both orderings a request can wait in, added class by class (the oldest wait is the
    /// longer of the two).
    pub(crate) fn merge(self, other: QueueSnapshot) -> QueueSnapshot {
        let mut classes = self.classes;
        for (mine, theirs) in classes.iter_mut().zip(other.classes) {
            mine.depth += theirs.depth;
            mine.oldest_wait = mine.oldest_wait.max(theirs.oldest_wait);
        }
        QueueSnapshot {
            classes,
            depth: self.depth + other.depth,
        }
    }
}

/// One class in a [`QueueSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassSnapshot {
    pub(crate) priority: Priority,
    pub(crate) depth: usize,
    pub(crate) oldest_wait: Duration,
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
