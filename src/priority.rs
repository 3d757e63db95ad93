//! Request classes and admission deadlines, carried in request extensions.

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

/// How urgently a request must be served; place it in the request's extensions.
///
/// [`PriorityQueueLayer`](crate::PriorityQueueLayer) serves a lower class only when the higher
/// ones are empty, first in, first out inside a class, and promotes a request one class up
/// once it has waited past its class's aging ceiling.
///
/// # Example
///
/// ```
/// use tower_llm_quota::Priority;
///
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(Priority::Batch);
/// assert!(Priority::Interactive > Priority::Async && Priority::Async > Priority::Batch);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Priority {
    /// Minutes or hours of tolerance: nightly jobs, backfills.
    Batch,
    /// Seconds to minutes of tolerance: background work someone will look at later.
    Async,
    /// A person is waiting: seconds of tolerance.
    Interactive,
}

impl Priority {
    /// Every class, highest first.
    pub const ALL: [Priority; 3] = [Priority::Interactive, Priority::Async, Priority::Batch];

    /// The class one step up, if any.
    pub const fn promoted(self) -> Option<Priority> {
        match self {
            Priority::Batch => Some(Priority::Async),
            Priority::Async => Some(Priority::Interactive),
            Priority::Interactive => None,
        }
    }

    /// A short lowercase name, stable enough for logs and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Async => "async",
            Priority::Batch => "batch",
        }
    }

    /// The position in [`Priority::ALL`]: 0 for the highest class (a store ranks requests by
    /// it).
    pub const fn index(self) -> usize {
        match self {
            Priority::Interactive => 0,
            Priority::Async => 1,
            Priority::Batch => 2,
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Reads a class from its [name](Priority::as_str): `interactive`, `async` or `batch`.
///
/// ```
/// use tower_llm_quota::Priority;
///
/// assert_eq!("batch".parse::<Priority>(), Ok(Priority::Batch));
/// assert!("urgent".parse::<Priority>().is_err());
/// ```
impl std::str::FromStr for Priority {
    type Err = UnknownPriority;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Priority::ALL
            .into_iter()
            .find(|class| class.as_str() == name)
            .ok_or(UnknownPriority)
    }
}

/// A class name that is not `interactive`, `async` or `batch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownPriority;

impl fmt::Display for UnknownPriority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("unknown class: expected `interactive`, `async` or `batch`")
    }
}

impl std::error::Error for UnknownPriority {}

/// The latest instant at which a request may still be admitted; place it in the request's
/// extensions to override its class's maximum wait.
///
/// [`PriorityQueueLayer`](crate::PriorityQueueLayer) sets one on every request it forwards (its
/// own, or the class's), and [`TokenBudgetLayer`](crate::TokenBudgetLayer) gives up waiting for
/// the budget when it passes: the request fails locally, and nothing is sent.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_llm_quota::Deadline;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(Deadline::after(Duration::from_millis(300)));
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline(Instant);

impl Deadline {
    /// A deadline at `instant`.
    pub const fn at(instant: Instant) -> Self {
        Self(instant)
    }

    /// A deadline `wait` from now; `Duration::MAX` (or any wait too long to represent) means
    /// no deadline in practice (a century).
    pub fn after(wait: Duration) -> Self {
        Self(crate::timer::saturating_deadline(Instant::now(), wait))
    }

    /// The instant.
    pub const fn instant(&self) -> Instant {
        self.0
    }
}

/// The earliest instant a request may be admitted: it waits in its place in the budget's
/// ordering until then, and the requests behind it wait behind it.
/// [`RetryAfterLayer`](crate::RetryAfterLayer) sets it on a retry that waits out the
/// provider's `Retry-After` (when a [`TokenBudgetLayer`](crate::TokenBudgetLayer) inside
/// answered its last attempt), with its first attempt's [`EnqueuedAt`]: so the retry keeps its
/// place while it waits, rather than queueing again behind the requests that came meanwhile.
///
/// Honoured by the budget's ordering (a [`TokenBudgetLayer`](crate::TokenBudgetLayer)); a
/// [`PriorityQueueLayer`](crate::PriorityQueueLayer) counts its class's maximum wait from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct NotBefore(Instant);

impl NotBefore {
    /// Not admitted before `instant`.
    pub const fn at(instant: Instant) -> Self {
        Self(instant)
    }

    /// The instant.
    pub const fn instant(&self) -> Instant {
        self.0
    }
}

/// When a logical request first entered the queue; place it in a retried request's extensions
/// so that [`PriorityQueueLayer`](crate::PriorityQueueLayer) keeps its place and its aging
/// from the first attempt. [`RetryAfterLayer`](crate::RetryAfterLayer) does.
///
/// Only the order and aging use it: each attempt still gets the full maximum wait of its class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct EnqueuedAt(Instant);

impl EnqueuedAt {
    /// First enqueued at `instant`.
    pub const fn at(instant: Instant) -> Self {
        Self(instant)
    }

    /// The instant.
    pub const fn instant(&self) -> Instant {
        self.0
    }
}

/// Where a response's time went, in its extensions: waiting is measured apart from the call.
///
/// Each layer fills in its part: [`PriorityQueueLayer`](crate::PriorityQueueLayer) the time
/// queued, [`TokenBudgetLayer`](crate::TokenBudgetLayer) the time waiting for the budget (and
/// for the inner service's readiness) and the call until the response head arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timings {
    pub(crate) queued: Duration,
    pub(crate) budget: Duration,
    pub(crate) call: Duration,
    /// A budget's ordering answered it (it honours [`NotBefore`]).
    pub(crate) ordered: bool,
}

impl Timings {
    /// Time spent in the priority queue.
    pub fn queued(&self) -> Duration {
        self.queued
    }

    /// Time spent waiting for the budget to admit the cost, and for the inner service to be
    /// ready (a concurrency slot, a connection).
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// Time from sending to the response head.
    pub fn call(&self) -> Duration {
        self.call
    }

    /// Time waited before the call: queued plus budget.
    pub fn waited(&self) -> Duration {
        self.queued + self.budget
    }

    /// Records the time queued in `extensions`' timings.
    pub(crate) fn record_queued(extensions: &mut http::Extensions, queued: Duration) {
        Self::update(extensions, |t| t.queued = queued);
    }

    /// Records the budget wait and call time in `extensions`' timings.
    pub(crate) fn record_call(extensions: &mut http::Extensions, budget: Duration, call: Duration) {
        Self::update(extensions, |t| {
            t.budget = budget;
            t.call = call;
            t.ordered = true;
        });
    }

    fn update(extensions: &mut http::Extensions, change: impl FnOnce(&mut Timings)) {
        match extensions.get_mut::<Timings>() {
            Some(timings) => change(timings),
            None => {
                let mut timings = Timings::default();
                change(&mut timings);
                extensions.insert(timings);
            }
        }
    }
}
