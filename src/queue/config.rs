//! How a priority queue treats each class.

use std::num::NonZeroUsize;
use std::time::Duration;

use tokio::time::Instant;

use crate::priority::Priority;
use crate::sched::{Aging, Scheduling, depth};

/// The configuration of a [`PriorityQueueLayer`](crate::PriorityQueueLayer).
///
/// # Defaults
///
/// | class | maximum wait | promoted after |
/// |---|---|---|
/// | interactive | 5 s | (highest class) |
/// | async | 2 min | 30 s (to interactive) |
/// | batch | none: as long as the quota needs | 120 s (to async) |
///
/// At most 10,000 requests wait in all, with no further limit per class; a request without a
/// [`Priority`] is `Async`. A gateway in front of people typically lowers the interactive wait
/// to a few hundred milliseconds and sends the rest to a fallback.
///
/// Batch work has no maximum wait: a job bigger than the quota (500 tickets at 10,000 tokens
/// a minute take over half an hour) loses nothing waiting. A caller that sets a
/// [`Deadline`](crate::Deadline) that a budget can tell will not be met (from the costs
/// waiting ahead and the quota's rate) is refused at once, with the predicted wait
/// ([`Error::predicted_wait`](crate::Error::predicted_wait)), rather than after waiting it
/// out. A class's maximum wait is waited out: it bounds a wait the refunds of calls in
/// flight may well shorten.
///
/// # Example
///
/// ```
/// use std::{num::NonZeroUsize, time::Duration};
/// use tower_llm_quota::{Priority, QueueConfig};
///
/// let config = QueueConfig::new()
///     .max_wait(Priority::Interactive, Duration::from_millis(300))
///     .promote_after(Priority::Batch, Some(Duration::from_secs(60)))
///     .class_max_depth(Priority::Batch, NonZeroUsize::new(5_000).unwrap())
///     .default_priority(Priority::Interactive);
/// assert_eq!(config.class(Priority::Interactive).max_wait(), Some(Duration::from_millis(300)));
/// assert_eq!(config.class(Priority::Batch).max_wait(), None); // as long as the quota needs
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueConfig {
    classes: [ClassConfig; 3],
    max_depth: NonZeroUsize,
    default_priority: Priority,
}

/// How a [`QueueConfig`] treats one class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassConfig {
    max_wait: Option<Duration>,
    promote_after: Option<Duration>,
    max_depth: Option<NonZeroUsize>,
}

impl ClassConfig {
    /// The longest a request of this class may wait before it is sent (none: as long as it
    /// takes).
    pub fn max_wait(&self) -> Option<Duration> {
        self.max_wait
    }

    /// How long a request waits in this class before it moves one class up.
    pub fn promote_after(&self) -> Option<Duration> {
        self.promote_after
    }

    /// The most requests of this class that may wait, if limited apart from the total.
    pub fn max_depth(&self) -> Option<NonZeroUsize> {
        self.max_depth
    }
}

const fn class(max_wait_secs: Option<u64>, promote_after_secs: Option<u64>) -> ClassConfig {
    ClassConfig {
        max_wait: match max_wait_secs {
            Some(secs) => Some(Duration::from_secs(secs)),
            None => None,
        },
        promote_after: match promote_after_secs {
            Some(secs) => Some(Duration::from_secs(secs)),
            None => None,
        },
        max_depth: None,
    }
}

impl QueueConfig {
    /// The default configuration (see the table above).
    pub const fn new() -> Self {
        Self {
            // Indexed highest class first, as `Priority::ALL`.
            classes: [
                class(Some(5), None),
                class(Some(120), Some(30)),
                class(None, Some(120)),
            ],
            max_depth: NonZeroUsize::new(10_000).unwrap(),
            default_priority: Priority::Async,
        }
    }

    /// The longest a request of `priority` may wait before it is sent; past it (or as soon as
    /// a budget can tell it would be passed), it fails locally. `Duration::MAX` (or anything
    /// from [`MAX_DURATION`](crate::MAX_DURATION)) is no limit. A
    /// [`Deadline`](crate::Deadline) in the request's extensions overrides it. Defaults to
    /// 5 s and 2 min for interactive and async, no limit for batch. A request of an
    /// in-memory budget that cannot be admitted within it even if every call in flight gave
    /// back all it holds (a spent limit) is refused on arrival, with the predicted wait
    /// ([`Error::predicted_wait`](crate::Error::predicted_wait)).
    pub const fn max_wait(mut self, priority: Priority, max_wait: Duration) -> Self {
        let capped = crate::timer::capped(max_wait);
        self.classes[priority.index()].max_wait =
            if capped.as_secs() == crate::timer::MAX_DURATION.as_secs() {
                None
            } else {
                Some(capped)
            };
        self
    }

    /// Moves a request of `priority` one class up once it has waited `after` in it (`None`:
    /// never). Ignored for the highest class. Defaults to 30 s for async and 120 s for batch.
    pub const fn promote_after(mut self, priority: Priority, after: Option<Duration>) -> Self {
        self.classes[priority.index()].promote_after = match after {
            Some(after) => Some(crate::timer::capped(after)),
            None => None,
        };
        self
    }

    /// The most requests that may wait in all; past it, new ones are shed. Defaults to 10,000.
    pub const fn max_depth(self, max_depth: NonZeroUsize) -> Self {
        Self { max_depth, ..self }
    }

    /// The most requests of `priority` that may wait; past it, new ones of that class are
    /// shed. Defaults to no limit apart from the total.
    pub const fn class_max_depth(mut self, priority: Priority, max_depth: NonZeroUsize) -> Self {
        self.classes[priority.index()].max_depth = Some(max_depth);
        self
    }

    /// The class of a request without a [`Priority`]. Defaults to [`Priority::Async`].
    pub const fn default_priority(self, default_priority: Priority) -> Self {
        Self {
            default_priority,
            ..self
        }
    }

    /// How `priority` is treated.
    pub const fn class(&self, priority: Priority) -> &ClassConfig {
        &self.classes[priority.index()]
    }

    /// The most requests that may wait in all.
    pub const fn total_max_depth(&self) -> NonZeroUsize {
        self.max_depth
    }

    /// The class of a request without a [`Priority`].
    pub const fn default_class(&self) -> Priority {
        self.default_priority
    }

    /// How a request of `priority` that entered at `enqueued_at`, may go from `not_before`
    /// and gives up at `deadline` (if any; `own` when the caller set it) is placed in an
    /// ordering.
    pub(crate) fn placed(
        &self,
        priority: Priority,
        (enqueued_at, not_before): (Instant, Option<Instant>),
        (deadline, own): (Option<Instant>, bool),
    ) -> Scheduling {
        Scheduling {
            deadline,
            own_deadline: own,
            not_before,
            ..self.scheduling(priority, enqueued_at)
        }
    }

    /// How a request of `priority` that entered at `enqueued_at` is placed in an ordering.
    pub(crate) fn scheduling(&self, priority: Priority, enqueued_at: Instant) -> Scheduling {
        Scheduling {
            aging: Aging::new(self.classes.map(|class| class.promote_after)),
            max_depth: depth(self.max_depth.get()),
            class_max_depth: self
                .class(priority)
                .max_depth
                .map_or(u32::MAX, |max| depth(max.get())),
            ..Scheduling::new(priority, enqueued_at)
        }
    }
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self::new()
    }
}
