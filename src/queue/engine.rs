//! The scheduling decision: who goes next. Plain data, no clock of its own, no locking.
//!
//! Each class is a FIFO ordered by enqueue time. Aging applies to the *front* of each class:
//! it is promoted once it has been the front for its class's ceiling, counted from when it
//! became the front (its enqueue time, if the class was empty). Promotion is computed when a
//! decision is made: no timer per item, no scan, only the fronts of the three classes compared.
//!
//! Why the front only: aging every item by its own enqueue time would promote a whole backlog at
//! once (a batch job of 10,000 items submitted together would, 150 s later, outrank every new
//! interactive request until all 10,000 are served). Aging the front still bounds every
//! request's wait, and a higher class waits behind at most one promoted request of each lower
//! class at a time.
//!
//! A later per-tenant fair share replaces a class's FIFO by a set of per-tenant FIFOs served in
//! weighted turns; the decision still only asks each class for its front.

use std::collections::BTreeMap;
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::config::QueueConfig;
use crate::priority::Priority;

/// A waiting request: its class, when it was enqueued and a tie-breaking ticket, and its
/// deadline (its own, or its class's maximum wait).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Key {
    priority: Priority,
    slot: Slot,
    deadline: Instant,
    /// Whether the deadline is the request's own rather than its class's.
    own_deadline: bool,
}

/// The order of service within a class: enqueue time, then ticket.
type Slot = (Instant, u64);

impl Key {
    /// When the request stops waiting.
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The class the request was enqueued in.
    pub(crate) fn priority(&self) -> Priority {
        self.priority
    }

    /// When the request was enqueued.
    pub(crate) fn enqueued_at(&self) -> Instant {
        self.slot.0
    }
}

/// Requests waiting for their turn, by class.
#[derive(Debug)]
pub(crate) struct Engine {
    config: QueueConfig,
    /// One FIFO per class, indexed as `Priority::ALL`.
    classes: [Class; 3],
    /// Requests with a deadline of their own, by deadline.
    own_deadlines: BTreeMap<(Instant, u64), Key>,
    len: usize,
    next_ticket: u64,
    /// Whether a request is being handed to the inner service: nobody else may go meanwhile.
    dispatching: bool,
}

/// One class's FIFO, kept as two maps so that deadlines need no index of their own: requests
/// with the class's maximum wait expire in the order they were enqueued, so the first of them
/// expires first; requests with their own deadline are also indexed by it in `Engine`.
#[derive(Debug, Default)]
struct Class {
    with_class_deadline: BTreeMap<Slot, Option<Waker>>,
    with_own_deadline: BTreeMap<Slot, (Option<Waker>, Instant)>,
    /// When the current front became the front: its aging starts there.
    front_since: Option<Instant>,
}

impl Class {
    fn len(&self) -> usize {
        self.with_class_deadline.len() + self.with_own_deadline.len()
    }

    fn waker_mut(&mut self, key: &Key) -> Option<&mut Option<Waker>> {
        if key.own_deadline {
            self.with_own_deadline
                .get_mut(&key.slot)
                .map(|(waker, _)| waker)
        } else {
            self.with_class_deadline.get_mut(&key.slot)
        }
    }

    fn waker(&self, key: &Key) -> Option<&Waker> {
        if key.own_deadline {
            self.with_own_deadline.get(&key.slot)?.0.as_ref()
        } else {
            self.with_class_deadline.get(&key.slot)?.as_ref()
        }
    }

    fn insert(&mut self, key: &Key) {
        if key.own_deadline {
            self.with_own_deadline
                .insert(key.slot, (None, key.deadline));
        } else {
            self.with_class_deadline.insert(key.slot, None);
        }
    }

    fn remove(&mut self, key: &Key) -> bool {
        if key.own_deadline {
            self.with_own_deadline.remove(&key.slot).is_some()
        } else {
            self.with_class_deadline.remove(&key.slot).is_some()
        }
    }
}

/// Why a request could not join the queue: the depth it would exceed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full(pub(crate) usize);

/// The depth and oldest wait of one class, from [`Engine::snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClassState {
    pub(crate) priority: Priority,
    pub(crate) depth: usize,
    pub(crate) oldest_wait: Duration,
}

impl Engine {
    pub(crate) fn new(config: QueueConfig) -> Self {
        Self {
            config,
            classes: Default::default(),
            own_deadlines: BTreeMap::new(),
            len: 0,
            next_ticket: 0,
            dispatching: false,
        }
    }

    pub(crate) fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// Adds a request of `priority` enqueued at `enqueued_at`, with its own `deadline` or its
    /// class's maximum wait, unless a depth limit is reached.
    pub(crate) fn push(
        &mut self,
        priority: Priority,
        enqueued_at: Instant,
        deadline: Option<Instant>,
    ) -> Result<Key, Full> {
        let total = self.config.total_max_depth().get();
        if self.len >= total {
            return Err(Full(total));
        }
        if let Some(max) = self.config.class(priority).max_depth() {
            if self.classes[priority.index()].len() >= max.get() {
                return Err(Full(max.get()));
            }
        }
        let slot = (enqueued_at, self.next_ticket);
        self.next_ticket += 1;
        let key = Key {
            priority,
            slot,
            deadline: deadline.unwrap_or_else(|| self.class_deadline(priority, enqueued_at)),
            own_deadline: deadline.is_some(),
        };
        if self.front(priority).is_none_or(|front| slot < front.slot) {
            // First in line at once (an empty class, or an earlier enqueue time kept across a
            // retry): it has been waiting since it was enqueued.
            self.classes[priority.index()].front_since = Some(enqueued_at);
        }
        self.classes[priority.index()].insert(&key);
        if key.own_deadline {
            self.own_deadlines.insert((key.deadline, slot.1), key);
        }
        self.len += 1;
        self.record_depth(priority);
        Ok(key)
    }

    /// Removes a request at `now`; returns whether it was there.
    pub(crate) fn remove(&mut self, key: Key, now: Instant) -> bool {
        let was_front = self.front(key.priority) == Some(key);
        let removed = self.classes[key.priority.index()].remove(&key);
        if was_front {
            // The next in line becomes the front now, and starts aging.
            let front_since = self
                .front(key.priority)
                .map(|front| front.enqueued_at().max(now));
            self.classes[key.priority.index()].front_since = front_since;
        }
        if key.own_deadline {
            self.own_deadlines.remove(&(key.deadline, key.slot.1));
        }
        self.len -= usize::from(removed);
        self.record_depth(key.priority);
        removed
    }

    /// The waiting request whose deadline comes first: the first with its class's deadline in
    /// each class, or the first by its own.
    pub(crate) fn first_deadline(&self) -> Option<Key> {
        let by_class = Priority::ALL.iter().filter_map(|&priority| {
            let class = &self.classes[priority.index()];
            let (&slot, _) = class.with_class_deadline.first_key_value()?;
            Some(Key {
                priority,
                slot,
                deadline: self.class_deadline(priority, slot.0),
                own_deadline: false,
            })
        });
        by_class
            .chain(self.own_deadlines.values().next().copied())
            .min_by_key(|key| (key.deadline, key.slot.1))
    }

    /// The waker of a waiting request.
    pub(crate) fn waker(&self, key: Key) -> Option<Waker> {
        self.classes[key.priority.index()].waker(&key).cloned()
    }

    /// The first request in line in `priority`'s class.
    fn front(&self, priority: Priority) -> Option<Key> {
        let class = &self.classes[priority.index()];
        let with_class = class
            .with_class_deadline
            .first_key_value()
            .map(|(&slot, _)| Key {
                priority,
                slot,
                deadline: self.class_deadline(priority, slot.0),
                own_deadline: false,
            });
        let with_own = class
            .with_own_deadline
            .first_key_value()
            .map(|(&slot, &(_, deadline))| Key {
                priority,
                slot,
                deadline,
                own_deadline: true,
            });
        match (with_class, with_own) {
            (Some(a), Some(b)) => Some(if a.slot < b.slot { a } else { b }),
            (a, b) => a.or(b),
        }
    }

    fn class_deadline(&self, priority: Priority, enqueued_at: Instant) -> Instant {
        let wait = self.config.class(priority).max_wait();
        // A wait too long to represent never ends in practice: a century will do.
        enqueued_at
            .checked_add(wait)
            .unwrap_or_else(|| enqueued_at + Duration::from_secs(100 * 365 * 86_400))
    }

    /// Stores the waker of a waiting request.
    pub(crate) fn set_waker(&mut self, key: Key, waker: &Waker) {
        if let Some(slot) = self.classes[key.priority.index()].waker_mut(&key) {
            match slot {
                Some(existing) if existing.will_wake(waker) => {}
                _ => *slot = Some(waker.clone()),
            }
        }
    }

    /// The request to serve next at `now`, unless one is being dispatched.
    pub(crate) fn next(&self, now: Instant) -> Option<Key> {
        if self.dispatching {
            return None;
        }
        self.top(now)
    }

    /// The waker of the request to serve next, to wake once the lock is released.
    pub(crate) fn next_waker(&self, now: Instant) -> Option<Waker> {
        self.waker(self.next(now)?)
    }

    /// If `key` goes next, removes it to hand it to the inner service, and nobody else goes
    /// until [`Engine::end_dispatch`]; returns whether it did.
    pub(crate) fn begin_dispatch(&mut self, key: Key, now: Instant) -> bool {
        if self.next(now) != Some(key) {
            return false;
        }
        self.remove(key, now);
        self.dispatching = true;
        true
    }

    pub(crate) fn end_dispatch(&mut self) {
        self.dispatching = false;
    }

    /// How many requests wait.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Records the depth of `priority`'s class as a metric (nothing without the `metrics`
    /// feature).
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    fn record_depth(&self, priority: Priority) {
        #[cfg(feature = "metrics")]
        crate::observe::queue_depth(priority, self.classes[priority.index()].len());
    }

    /// The depth and oldest wait of every class, highest first.
    pub(crate) fn snapshot(&self, now: Instant) -> [ClassState; 3] {
        Priority::ALL.map(|priority| {
            let class = &self.classes[priority.index()];
            ClassState {
                priority,
                depth: class.len(),
                oldest_wait: self.front(priority).map_or(Duration::ZERO, |front| {
                    now.saturating_duration_since(front.enqueued_at())
                }),
            }
        })
    }

    /// The front of the highest effective class; among equals, the one that entered that class
    /// first.
    fn top(&self, now: Instant) -> Option<Key> {
        Priority::ALL
            .iter()
            .filter_map(|&priority| {
                let front = self.front(priority)?;
                let since = self.classes[priority.index()]
                    .front_since
                    .unwrap_or(front.enqueued_at());
                let (class, entered) = self.aged(priority, since, now);
                Some(((std::cmp::Reverse(class), entered, front.slot.1), front))
            })
            .min_by_key(|(rank, _)| *rank)
            .map(|(_, key)| key)
    }

    /// The class a front of `priority` since `since` has reached by `now`, and when it entered
    /// it.
    fn aged(&self, priority: Priority, since: Instant, now: Instant) -> (Priority, Instant) {
        let (mut class, mut entered) = (priority, since);
        while let (Some(up), Some(after)) =
            (class.promoted(), self.config.class(class).promote_after())
        {
            match entered.checked_add(after) {
                Some(at) if at <= now => (class, entered) = (up, at),
                _ => break,
            }
        }
        (class, entered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroUsize;

    const SEC: Duration = Duration::from_secs(1);

    #[test]
    fn higher_classes_first_fifo_within() {
        let t0 = Instant::now();
        let mut engine = Engine::new(QueueConfig::new());
        let batch = engine.push(Priority::Batch, t0, None).unwrap();
        let async1 = engine.push(Priority::Async, t0 + SEC, None).unwrap();
        let async2 = engine.push(Priority::Async, t0 + 2 * SEC, None).unwrap();
        let interactive = engine
            .push(Priority::Interactive, t0 + 3 * SEC, None)
            .unwrap();
        let now = t0 + 4 * SEC;
        let mut order = Vec::new();
        while let Some(key) = engine.next(now) {
            order.push(key);
            engine.remove(key, now);
        }
        assert_eq!(order, [interactive, async1, async2, batch]);
    }

    #[test]
    fn aging_promotes_at_the_exact_threshold() {
        let t0 = Instant::now();
        let mut engine = Engine::new(QueueConfig::new());
        let batch = engine.push(Priority::Batch, t0, None).unwrap();
        let asynchronous = engine.push(Priority::Async, t0 + 100 * SEC, None).unwrap();
        // At 119.999 s the batch item is still batch; at 120 s it is async, and entered async
        // at 120 s, after the async item (100 s): the async item goes first.
        assert_eq!(
            engine.next(t0 + 120 * SEC - Duration::from_millis(1)),
            Some(asynchronous)
        );
        assert_eq!(engine.next(t0 + 120 * SEC), Some(asynchronous));
        // At 130 s the async item reaches interactive (30 s): still first.
        assert_eq!(engine.next(t0 + 130 * SEC), Some(asynchronous));
        engine.remove(asynchronous, t0 + 130 * SEC);
        let interactive = engine
            .push(Priority::Interactive, t0 + 140 * SEC, None)
            .unwrap();
        // The batch item reaches interactive at 150 s, entering before one enqueued at 151 s,
        // but after one enqueued at 140 s.
        assert_eq!(engine.next(t0 + 150 * SEC), Some(interactive));
        engine.remove(interactive, t0 + 150 * SEC);
        let late = engine
            .push(Priority::Interactive, t0 + 151 * SEC, None)
            .unwrap();
        assert_eq!(engine.next(t0 + 151 * SEC), Some(batch));
        engine.remove(batch, t0 + 151 * SEC);
        assert_eq!(engine.next(t0 + 151 * SEC), Some(late));
    }

    #[test]
    fn only_the_front_ages_so_a_backlog_is_not_promoted_at_once() {
        let t0 = Instant::now();
        let mut engine = Engine::new(QueueConfig::new());
        let first = engine.push(Priority::Batch, t0, None).unwrap();
        let second = engine.push(Priority::Batch, t0, None).unwrap();
        let at = t0 + 150 * SEC;
        let interactive = engine.push(Priority::Interactive, at, None).unwrap();
        // The front has waited 150 s: interactive now, entered at 150 s, like the newcomer,
        // whose ticket is later.
        assert_eq!(engine.next(at), Some(first));
        engine.remove(first, at);
        // The second batch item became the front at 150 s: it starts aging only now.
        assert_eq!(engine.next(at), Some(interactive));
        engine.remove(interactive, at);
        assert_eq!(engine.next(at + 149 * SEC), Some(second));
        let newcomer = engine
            .push(Priority::Interactive, at + 149 * SEC, None)
            .unwrap();
        assert_eq!(engine.next(at + 149 * SEC), Some(newcomer));
        // At 150 s of being the front it is interactive too, but entered after the newcomer.
        assert_eq!(engine.next(at + 150 * SEC), Some(newcomer));
        engine.remove(newcomer, at + 150 * SEC);
        let later = engine
            .push(Priority::Interactive, at + 151 * SEC, None)
            .unwrap();
        assert_eq!(engine.next(at + 151 * SEC), Some(second));
        engine.remove(second, at + 151 * SEC);
        assert_eq!(engine.next(at + 151 * SEC), Some(later));
    }

    #[test]
    fn depth_limits_shed() {
        let t0 = Instant::now();
        let config = QueueConfig::new()
            .max_depth(NonZeroUsize::new(3).unwrap())
            .class_max_depth(Priority::Batch, NonZeroUsize::new(1).unwrap());
        let mut engine = Engine::new(config);
        engine.push(Priority::Batch, t0, None).unwrap();
        assert_eq!(engine.push(Priority::Batch, t0, None), Err(Full(1)));
        engine.push(Priority::Async, t0, None).unwrap();
        engine.push(Priority::Interactive, t0, None).unwrap();
        assert_eq!(engine.push(Priority::Interactive, t0, None), Err(Full(3)));
        assert_eq!(engine.len(), 3);
    }

    #[test]
    fn the_first_deadline_is_found_without_an_index_of_class_deadlines() {
        let t0 = Instant::now();
        let config = QueueConfig::new()
            .max_wait(Priority::Interactive, SEC)
            .max_wait(Priority::Batch, 10 * SEC);
        let mut engine = Engine::new(config);
        let batch = engine.push(Priority::Batch, t0, None).unwrap();
        let own = engine
            .push(Priority::Batch, t0, Some(t0 + 5 * SEC))
            .unwrap();
        assert_eq!(engine.first_deadline(), Some(own));
        let interactive = engine.push(Priority::Interactive, t0 + SEC, None).unwrap();
        assert_eq!(interactive.deadline(), t0 + 2 * SEC);
        assert_eq!(engine.first_deadline(), Some(interactive));
        engine.remove(interactive, t0);
        engine.remove(own, t0);
        assert_eq!(engine.first_deadline(), Some(batch));
        assert_eq!(batch.deadline(), t0 + 10 * SEC);
        // Both maps make one FIFO: the request with its own deadline came second.
        assert_eq!(engine.snapshot(t0)[2].depth, 1);
    }

    #[test]
    fn dispatching_blocks_the_next_decision() {
        let t0 = Instant::now();
        let mut engine = Engine::new(QueueConfig::new());
        let a = engine.push(Priority::Async, t0, None).unwrap();
        let b = engine.push(Priority::Async, t0, None).unwrap();
        assert!(!engine.begin_dispatch(b, t0), "not its turn");
        assert!(engine.begin_dispatch(a, t0));
        assert_eq!(engine.next(t0), None);
        engine.end_dispatch();
        assert_eq!(engine.next(t0), Some(b));
        let snapshot = engine.snapshot(t0 + SEC);
        assert_eq!(snapshot[1].depth, 1);
        assert_eq!(snapshot[1].oldest_wait, SEC);
    }
}
