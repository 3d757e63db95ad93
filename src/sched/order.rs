//! The ordering of waiting requests: who goes next. Plain data, no clock of its own, no locking.
//!
//! Each class keeps its requests by arrival, and its fair share (`sched::fair`) chooses which
//! one goes next: for a budget without tenants the first that came; with tenants, a flow owed
//! its guarantee first, then the smallest weighted-fair-queuing tag, each flow's requests in
//! the order they came. The choice is made when asked, from the state at that moment. Aging
//! applies to the *front* of each class: it moves one class up once it has been the front for
//! its class's ceiling, counted from when it became the front (its enqueue time, if the class
//! was empty). Promotion is computed when a decision is made: no timer per item, no scan, only
//! the fronts of the classes compared.
//!
//! Why the front only: aging every item by its own enqueue time would promote a whole backlog at
//! once (a batch job of 10,000 items submitted together would, 150 s later, outrank every new
//! interactive request until all 10,000 are served). Aging the front still bounds every
//! request's wait, and a higher class waits behind at most one promoted request of each lower
//! class at a time.
//!
//! Each entry carries the aging of the configuration that queued it, so requests queued by
//! differently configured layers share one order.

use std::collections::{BTreeMap, HashMap};
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::fair::{FairQueue, Slot};
use super::scheduling::{Aging, Flow, Scheduling};
use super::snapshot::{ClassSnapshot, QueueSnapshot};
use crate::priority::Priority;

/// Where a waiting request stands: its class, its place in it (enqueue time, ticket), and the
/// deadline the order watches for it (if any).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Place {
    priority: Priority,
    slot: Slot,
    deadline: Option<Instant>,
}

/// The order of service across classes: effective class (highest first), first arrival,
/// ticket.
type Rank = (std::cmp::Reverse<Priority>, Instant, u64);

impl Place {
    /// The class it waits in.
    pub(crate) fn priority(&self) -> Priority {
        self.priority
    }

    /// When the request stops waiting, if the order watches a deadline for it.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.deadline
    }
}

/// How a request leaves the order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leaving {
    Served,
    ForGood,
    ForAWhile,
}

/// Why a request could not join the order: the depth it would exceed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full(pub(crate) usize);

/// Requests waiting for their turn, by class, each with a value of the owner's.
#[derive(Debug)]
pub(crate) struct Order<T> {
    /// One list per class, indexed as `Priority::ALL`.
    classes: [Class<T>; 3],
    /// The requests whose deadline the order watches, by deadline (and ticket): their class and
    /// enqueue time, from which their place is rebuilt.
    deadlines: BTreeMap<(Instant, u64), (Priority, Instant)>,
    len: usize,
    next_ticket: u64,
    /// The `queue` label of its depth gauge.
    label: std::sync::Arc<str>,
    /// The depth of each class this ordering added to the gauge: orderings sharing a label
    /// (two budgets nobody named) add up rather than overwrite each other.
    recorded: [usize; 3],
}

/// The depth gauge's `queue` label of an ordering nobody named.
pub(crate) const DEFAULT_LABEL: &str = "default";

#[derive(Debug)]
struct Class<T> {
    /// Every waiting request, by arrival.
    waiting: BTreeMap<Slot, Entry<T>>,
    /// The requests stepped out for a while (asking a shared store, waiting for their own
    /// node), with their flow and cost: they keep their place and their flow's turn.
    away: HashMap<Slot, (Flow, u64)>,
    /// Who of them goes next.
    fair: FairQueue,
    /// When the current front became the front: its aging starts there.
    front_since: Option<Instant>,
}

impl<T> Default for Class<T> {
    fn default() -> Self {
        Self {
            waiting: BTreeMap::new(),
            away: HashMap::new(),
            fair: FairQueue::default(),
            front_since: None,
        }
    }
}

impl<T> Class<T> {
    /// The slot of the request this class serves next, and its entry.
    fn front(&self) -> Option<(Slot, &Entry<T>)> {
        let (_, slot) = self.fair.next()?;
        Some((slot, self.waiting.get(&slot)?))
    }
}

#[derive(Debug)]
struct Entry<T> {
    value: T,
    waker: Option<Waker>,
    deadline: Option<Instant>,
    aging: Aging,
    /// The tenant's flow, whose fair share it counts in, and its cost there.
    flow: Flow,
    cost: u64,
}

impl<T> Default for Order<T> {
    fn default() -> Self {
        Self {
            classes: Default::default(),
            deadlines: BTreeMap::new(),
            len: 0,
            next_ticket: 0,
            label: std::sync::Arc::from(DEFAULT_LABEL),
            recorded: [0; 3],
        }
    }
}

impl<T> Drop for Order<T> {
    /// Takes what it still counts off the gauge.
    fn drop(&mut self) {
        for priority in Priority::ALL {
            let depth = self.recorded[priority.index()] as f64;
            if depth > 0.0 {
                crate::observe::queue_depth_change(priority, &self.label, -depth);
            }
        }
    }
}

impl<T> Order<T> {
    /// Adds a request placed by `scheduling`, watching `deadline` for it, unless a depth limit
    /// is reached.
    pub(crate) fn push(
        &mut self,
        scheduling: &Scheduling,
        deadline: Option<Instant>,
        value: T,
    ) -> Result<Place, Full> {
        self.push_fair(scheduling, deadline, 0, value)
    }

    /// Adds a request of cost `cost` (its tenant flow's share counts it), watching `deadline`
    /// for it, unless a depth limit is reached.
    pub(crate) fn push_fair(
        &mut self,
        scheduling: &Scheduling,
        deadline: Option<Instant>,
        cost: u64,
        value: T,
    ) -> Result<Place, Full> {
        let (max, class_max) = (
            scheduling.max_depth as usize,
            scheduling.class_max_depth as usize,
        );
        if self.len >= max {
            return Err(Full(max));
        }
        let priority = scheduling.priority;
        if self.classes[priority.index()].waiting.len() >= class_max {
            return Err(Full(class_max));
        }
        let place = Place {
            priority,
            slot: (scheduling.enqueued_at, self.next_ticket),
            deadline,
        };
        self.next_ticket += 1;
        self.insert(place, scheduling, cost, value);
        Ok(place)
    }

    /// Puts a request back at the place it had (it stepped out to ask a shared store, which
    /// refused, or to wait for its own tenant node): no depth limit applies, it was counted
    /// before, and its flow's turn was kept for it.
    pub(crate) fn restore(&mut self, place: Place, scheduling: &Scheduling, cost: u64, value: T) {
        self.insert(place, scheduling, cost, value);
    }

    fn insert(&mut self, place: Place, scheduling: &Scheduling, cost: u64, value: T) {
        let class = &mut self.classes[place.priority.index()];
        let at = place.slot.0;
        class.front_since = match (class.front_since, class.waiting.first_key_value()) {
            // The first, or an earlier enqueue time kept across a retry: it has been waiting
            // since it was enqueued.
            (Some(since), Some((&(first, _), _))) if first <= at => Some(since),
            (Some(since), Some(_)) => Some(since.min(at)),
            _ => Some(at),
        };
        let entry = Entry {
            value,
            waker: None,
            deadline: place.deadline,
            aging: scheduling.aging,
            flow: scheduling.flow,
            cost,
        };
        if class.waiting.insert(place.slot, entry).is_none() {
            self.len += 1;
            match class.away.remove(&place.slot) {
                Some(_) => class.fair.rejoin(scheduling.flow, place.slot, cost),
                None => class.fair.join(scheduling.flow, place.slot, cost),
            }
        }
        if let Some(deadline) = place.deadline {
            self.deadlines
                .insert((deadline, place.slot.1), (place.priority, at));
        }
        self.record_depth(place.priority);
    }

    /// Every waiting request's class and value, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Priority, &T)> + '_ {
        Priority::ALL.into_iter().flat_map(move |priority| {
            self.classes[priority.index()]
                .waiting
                .values()
                .map(move |entry| (priority, &entry.value))
        })
    }

    /// The wakers of the waiting requests whose value `pick` chooses.
    pub(crate) fn wakers_of(&self, mut pick: impl FnMut(&T) -> bool) -> Vec<Waker> {
        self.classes
            .iter()
            .flat_map(|class| class.waiting.values())
            .filter(|entry| pick(&entry.value))
            .filter_map(|entry| entry.waker.clone())
            .collect()
    }

    /// Removes a request that was not served and will not come back (it gave up, was
    /// refused), waiting or stepped out: the fair share's clocks do not move. Returns its
    /// value if it was waiting.
    pub(crate) fn remove(&mut self, place: Place, now: Instant) -> Option<T> {
        let class = &mut self.classes[place.priority.index()];
        if let Some((flow, _)) = class.away.remove(&place.slot) {
            class.fair.abandon(flow.key);
            return None;
        }
        self.take(place, now, Leaving::ForGood)
    }

    /// Removes a request that is served now: its flow's fair share counts it.
    pub(crate) fn serve(&mut self, place: Place, now: Instant) -> Option<T> {
        self.take(place, now, Leaving::Served)
    }

    /// Steps a request out for a while (to ask a shared store, to wait for its own tenant
    /// node): it keeps its place and its flow's turn, and comes back with
    /// [`restore`](Self::restore), is served with [`serve_away`](Self::serve_away), or gives
    /// up with [`remove`](Self::remove).
    pub(crate) fn step_out(&mut self, place: Place, now: Instant) -> Option<T> {
        self.take(place, now, Leaving::ForAWhile)
    }

    /// Counts a request that stepped out as served (a shared store admitted it).
    pub(crate) fn serve_away(&mut self, place: Place) {
        let class = &mut self.classes[place.priority.index()];
        if let Some((flow, cost)) = class.away.remove(&place.slot) {
            class.fair.serve(flow, None, cost);
        }
    }

    fn take(&mut self, place: Place, now: Instant, leaving: Leaving) -> Option<T> {
        let class = &mut self.classes[place.priority.index()];
        let was_front = class
            .fair
            .next()
            .is_some_and(|(_, front)| front == place.slot);
        let entry = class.waiting.remove(&place.slot)?;
        match leaving {
            Leaving::Served => class.fair.serve(entry.flow, Some(place.slot), entry.cost),
            Leaving::ForGood => class.fair.leave(entry.flow.key, place.slot),
            Leaving::ForAWhile => {
                class.fair.step_out(entry.flow.key, place.slot);
                class.away.insert(place.slot, (entry.flow, entry.cost));
            }
        }
        if class.waiting.is_empty() {
            class.front_since = None;
        } else if was_front {
            // The next in line becomes the front now, and starts aging.
            class.front_since = class.front().map(|((at, _), _)| at.max(now));
        }
        if let Some(deadline) = place.deadline {
            self.deadlines.remove(&(deadline, place.slot.1));
        }
        self.len -= 1;
        self.record_depth(place.priority);
        Some(entry.value)
    }

    /// Records the depth of `priority`'s class as a metric (nothing without the `metrics`
    /// feature): the change since it last did, so that the orderings of one label add up.
    fn record_depth(&mut self, priority: Priority) {
        let depth = self.classes[priority.index()].waiting.len();
        let recorded = std::mem::replace(&mut self.recorded[priority.index()], depth);
        if depth != recorded {
            crate::observe::queue_depth_change(
                priority,
                &self.label,
                depth as f64 - recorded as f64,
            );
        }
    }

    /// Names the ordering: the `queue` label of its depth gauge (what it waits moves over).
    pub(crate) fn set_label(&mut self, label: std::sync::Arc<str>) {
        for priority in Priority::ALL {
            let depth = self.recorded[priority.index()] as f64;
            if depth > 0.0 {
                crate::observe::queue_depth_change(priority, &self.label, -depth);
                crate::observe::queue_depth_change(priority, &label, depth);
            }
        }
        self.label = label;
    }

    /// The `queue` label of its depth gauge.
    pub(crate) fn label(&self) -> std::sync::Arc<str> {
        std::sync::Arc::clone(&self.label)
    }

    /// The value of a waiting request.
    pub(crate) fn get_mut(&mut self, place: Place) -> Option<&mut T> {
        self.entry_mut(place).map(|entry| &mut entry.value)
    }

    /// The value of a waiting request.
    pub(crate) fn get(&self, place: Place) -> Option<&T> {
        self.classes[place.priority.index()]
            .waiting
            .get(&place.slot)
            .map(|entry| &entry.value)
    }

    fn entry_mut(&mut self, place: Place) -> Option<&mut Entry<T>> {
        self.classes[place.priority.index()]
            .waiting
            .get_mut(&place.slot)
    }

    /// Stores the waker of a waiting request, cloning only when it changed.
    pub(crate) fn set_waker(&mut self, place: Place, waker: &Waker) {
        if let Some(entry) = self.entry_mut(place) {
            match &mut entry.waker {
                Some(existing) if existing.will_wake(waker) => {}
                slot => *slot = Some(waker.clone()),
            }
        }
    }

    /// A clone of a waiting request's waker, to wake once the lock is released.
    pub(crate) fn waker(&self, place: Place) -> Option<Waker> {
        self.classes[place.priority.index()]
            .waiting
            .get(&place.slot)?
            .waker
            .clone()
    }

    /// The waiting request whose watched deadline comes first.
    pub(crate) fn first_deadline(&self) -> Option<Place> {
        let (&(deadline, ticket), &(priority, at)) = self.deadlines.first_key_value()?;
        Some(Place {
            priority,
            slot: (at, ticket),
            deadline: Some(deadline),
        })
    }

    /// The request to serve next at `now`: the front of the highest effective class; among
    /// equals, the one that came first (a promoted front before the later arrivals of its new
    /// class).
    pub(crate) fn top(&self, now: Instant) -> Option<Place> {
        self.ranked(now).into_iter().flatten().next()
    }

    /// The waker of the request to serve next.
    pub(crate) fn top_waker(&self, now: Instant) -> Option<Waker> {
        self.waker(self.top(now)?)
    }

    /// The front of `priority`'s class: its effective class at `now` (aging lifts it) and its
    /// value.
    pub(crate) fn front_of(&self, priority: Priority, now: Instant) -> Option<(Priority, &T)> {
        let class = &self.classes[priority.index()];
        let (slot, entry) = class.front()?;
        let since = class.front_since.unwrap_or(slot.0);
        Some((aged(priority, since, entry.aging, now), &entry.value))
    }

    /// The front of every class, in the order they would be served at `now`.
    pub(crate) fn ranked(&self, now: Instant) -> [Option<Place>; 3] {
        let mut fronts = Priority::ALL.map(|priority| {
            let class = &self.classes[priority.index()];
            let (slot, entry) = class.front()?;
            let since = class.front_since.unwrap_or(slot.0);
            // Ranked by effective class, then by first arrival: a promoted front goes before
            // the requests of its new class that came after it.
            let effective = aged(priority, since, entry.aging, now);
            let place = Place {
                priority,
                slot,
                deadline: entry.deadline,
            };
            Some(((std::cmp::Reverse(effective), slot.0, slot.1), place))
        });
        // Three items: sorting is a few comparisons, no allocation.
        fronts.sort_by_key(|front| front.map(|(rank, _)| rank).ok_or(()));
        fronts.map(|front| front.map(|(_, place)| place))
    }

    /// Every waiting request with its value, in the order they would be served from `now` if
    /// nothing changed: the fronts ranked as [`ranked`](Self::ranked) does, and behind each
    /// front the rest of its class in its fair share's order (not aged yet), merged by the
    /// same rule.
    pub(crate) fn walk(&self, now: Instant) -> impl Iterator<Item = (Place, &T)> + '_ {
        let mut lists =
            Priority::ALL.map(|p| self.classes[p.index()].fair.service_order().peekable());
        let mut fronts = [true; 3];
        std::iter::from_fn(move || {
            let mut best: Option<(Rank, usize)> = None;
            for (i, list) in lists.iter_mut().enumerate() {
                let Some(&slot) = list.peek() else {
                    continue;
                };
                let class = &self.classes[i];
                let priority = Priority::ALL[i];
                let effective = match class.waiting.get(&slot) {
                    Some(entry) if fronts[i] => {
                        let since = class.front_since.unwrap_or(slot.0);
                        aged(priority, since, entry.aging, now)
                    }
                    _ => priority,
                };
                let rank = (std::cmp::Reverse(effective), slot.0, slot.1);
                if best.is_none_or(|(ahead, _)| rank < ahead) {
                    best = Some((rank, i));
                }
            }
            let (_, i) = best?;
            fronts[i] = false;
            let slot = lists[i].next()?;
            let entry = self.classes[i].waiting.get(&slot)?;
            let place = Place {
                priority: Priority::ALL[i],
                slot,
                deadline: entry.deadline,
            };
            Some((place, &entry.value))
        })
    }

    /// The next instant after `now` at which a class's front moves up a class, when fronts of
    /// more than one class wait (else aging cannot change who goes first).
    pub(crate) fn next_promotion(&self, now: Instant) -> Option<Instant> {
        let waiting = self
            .classes
            .iter()
            .filter(|c| !c.waiting.is_empty())
            .count();
        if waiting < 2 {
            return None;
        }
        Priority::ALL
            .iter()
            .filter_map(|&priority| {
                let class = &self.classes[priority.index()];
                let (slot, entry) = class.front()?;
                let (mut level, mut from) = (priority, class.front_since.unwrap_or(slot.0));
                while let (Some(up), Some(after)) = (level.promoted(), entry.aging.after(level)) {
                    let at = from.checked_add(after)?;
                    if at > now {
                        return Some(at);
                    }
                    (level, from) = (up, at);
                }
                None
            })
            .min()
    }

    /// Adds to `out` every flow with requests waiting (or away), with its weight, and to
    /// `guarantors` their guarantors.
    pub(crate) fn waiting_flows(&self, out: &mut Vec<(u64, u32)>, guarantors: &mut Vec<u64>) {
        for class in &self.classes {
            class.fair.waiting_flows(out, guarantors);
        }
    }

    /// How many requests wait.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The depth and oldest wait of every class, highest first.
    pub(crate) fn snapshot(&self, now: Instant) -> QueueSnapshot {
        QueueSnapshot {
            classes: Priority::ALL.map(|priority| {
                let class = &self.classes[priority.index()];
                ClassSnapshot {
                    priority,
                    depth: class.waiting.len(),
                    oldest_wait: class
                        .waiting
                        .first_key_value()
                        .map_or(Duration::ZERO, |(&(at, _), _)| {
                            now.saturating_duration_since(at)
                        }),
                }
            }),
            depth: self.len,
        }
    }
}

/// The class a front of `priority`, the front since `since`, has reached by `now`. (It ranks
/// by its first arrival whatever its class: when it was promoted does not matter.)
fn aged(priority: Priority, since: Instant, aging: Aging, now: Instant) -> Priority {
    let (mut class, mut from) = (priority, since);
    while let (Some(up), Some(after)) = (class.promoted(), aging.after(class)) {
        match from.checked_add(after) {
            Some(at) if at <= now => (class, from) = (up, at),
            _ => break,
        }
    }
    class
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    fn push(order: &mut Order<()>, priority: Priority, at: Instant) -> Place {
        order
            .push(&Scheduling::new(priority, at), None, ())
            .unwrap()
    }

    #[test]
    fn tenants_share_a_class_by_tag_each_in_arrival_order() {
        let t0 = Instant::now();
        let mut order: Order<u32> = Order::default();
        let push = |order: &mut Order<u32>, key, weight, at: Instant, cost, value| {
            let mut scheduling = Scheduling::new(Priority::Batch, at);
            scheduling.flow = Flow {
                key,
                weight,
                ..Flow::DEFAULT
            };
            order.push_fair(&scheduling, None, cost, value).unwrap()
        };
        // a weighs 3, b 1; 300 tokens each: a's tags 100, 200, 300, b's 300, 600, 900.
        for i in 0..3 {
            push(&mut order, 1, 3, t0, 300, i);
            push(&mut order, 2, 1, t0, 300, 10 + i);
        }
        // A later request of a, much cheaper, still waits behind a's earlier ones.
        push(&mut order, 1, 3, t0 + SEC, 3, 3);
        // The front steps out (its own node) and comes back: its place is kept, and nothing
        // was served, so a newcomer of an idle flow still starts at 0.
        let front = order.top(t0).unwrap();
        let value = order.remove(front, t0).unwrap();
        let newcomer = push(&mut order, 4, 1, t0, 50, 7);
        let mut scheduling = Scheduling::new(Priority::Batch, t0);
        scheduling.flow = Flow {
            key: 1,
            weight: 3,
            ..Flow::DEFAULT
        };
        order.restore(front, &scheduling, 300, value);
        let mut served = Vec::new();
        while let Some(place) = order.top(t0) {
            served.push(*order.get(place).unwrap());
            order.serve(place, t0);
            assert!(place != newcomer || served.len() == 1);
        }
        // Equal tags go by arrival, then ticket: b's first (300) was pushed before a's third.
        assert_eq!(served, [7, 0, 1, 10, 2, 3, 11, 12]);
    }

    #[test]
    fn higher_classes_first_fifo_within() {
        let t0 = Instant::now();
        let mut order = Order::default();
        let batch = push(&mut order, Priority::Batch, t0);
        let async1 = push(&mut order, Priority::Async, t0 + SEC);
        let async2 = push(&mut order, Priority::Async, t0 + 2 * SEC);
        let interactive = push(&mut order, Priority::Interactive, t0 + 3 * SEC);
        let now = t0 + 4 * SEC;
        let mut served = Vec::new();
        while let Some(place) = order.top(now) {
            served.push(place);
            order.remove(place, now);
        }
        assert_eq!(served, [interactive, async1, async2, batch]);
        assert!(order.is_empty());
    }

    #[test]
    fn aging_promotes_at_the_exact_threshold() {
        let t0 = Instant::now();
        let mut order = Order::default();
        let batch = push(&mut order, Priority::Batch, t0);
        let asynchronous = push(&mut order, Priority::Async, t0 + 100 * SEC);
        // At 119.999 s the batch item is still batch; at 120 s it is async, and it came first
        // (at 0 s, the async item at 100 s): it goes first.
        let just_before = t0 + 120 * SEC - Duration::from_millis(1);
        assert_eq!(order.top(just_before), Some(asynchronous));
        assert_eq!(order.top(t0 + 120 * SEC), Some(batch));
        // The async item is interactive from 130 s (the front of its class since 100 s): it
        // goes before an interactive request of 140 s, and before the batch item, async then.
        let interactive = push(&mut order, Priority::Interactive, t0 + 140 * SEC);
        assert_eq!(order.top(t0 + 140 * SEC), Some(asynchronous));
        // At 150 s the batch item is interactive too, and came first of all.
        assert_eq!(order.top(t0 + 150 * SEC), Some(batch));
        order.remove(batch, t0 + 150 * SEC);
        assert_eq!(order.top(t0 + 150 * SEC), Some(asynchronous));
        order.remove(asynchronous, t0 + 150 * SEC);
        assert_eq!(order.top(t0 + 150 * SEC), Some(interactive));
    }

    #[test]
    fn only_the_front_ages_so_a_backlog_is_not_promoted_at_once() {
        let t0 = Instant::now();
        let mut order = Order::default();
        let first = push(&mut order, Priority::Batch, t0);
        let second = push(&mut order, Priority::Batch, t0);
        let at = t0 + 150 * SEC;
        let interactive = push(&mut order, Priority::Interactive, at);
        // The front has waited 150 s: interactive now, entered at 150 s, like the newcomer,
        // whose ticket is later.
        assert_eq!(order.top(at), Some(first));
        order.remove(first, at);
        // The second batch item became the front at 150 s: it starts aging only now.
        assert_eq!(order.top(at), Some(interactive));
        order.remove(interactive, at);
        assert_eq!(order.top(at + 149 * SEC), Some(second));
        let newcomer = push(&mut order, Priority::Interactive, at + 149 * SEC);
        assert_eq!(order.top(at + 149 * SEC), Some(newcomer));
        // At 150 s of being the front it is interactive too, and it came first (at 0 s).
        assert_eq!(order.top(at + 150 * SEC), Some(second));
    }

    #[test]
    fn each_entry_ages_by_its_own_configuration() {
        let t0 = Instant::now();
        let mut order = Order::default();
        let mut never = Scheduling::new(Priority::Batch, t0);
        never.aging = Aging::NEVER;
        let batch = order.push(&never, None, ()).unwrap();
        let asynchronous = push(&mut order, Priority::Async, t0 + 3_600 * SEC);
        assert_eq!(order.top(t0 + 3_600 * SEC), Some(asynchronous));
        order.remove(asynchronous, t0);
        assert_eq!(order.top(t0 + 3_600 * SEC), Some(batch));
    }

    #[test]
    fn depth_limits_shed() {
        let t0 = Instant::now();
        let mut order = Order::default();
        let limited = |priority, class_max: Option<u32>| Scheduling {
            max_depth: 3,
            class_max_depth: class_max.unwrap_or(u32::MAX),
            ..Scheduling::new(priority, t0)
        };
        order
            .push(&limited(Priority::Batch, Some(1)), None, ())
            .unwrap();
        assert_eq!(
            order.push(&limited(Priority::Batch, Some(1)), None, ()),
            Err(Full(1))
        );
        order
            .push(&limited(Priority::Async, None), None, ())
            .unwrap();
        order
            .push(&limited(Priority::Interactive, None), None, ())
            .unwrap();
        assert_eq!(
            order.push(&limited(Priority::Interactive, None), None, ()),
            Err(Full(3))
        );
        assert_eq!(order.len(), 3);
    }

    #[test]
    fn deadlines_are_watched_in_order_and_a_restored_place_keeps_its_rank() {
        let t0 = Instant::now();
        let mut order = Order::default();
        let scheduling = Scheduling::new(Priority::Batch, t0);
        let late = order.push(&scheduling, Some(t0 + 10 * SEC), ()).unwrap();
        let early = order.push(&scheduling, Some(t0 + 5 * SEC), ()).unwrap();
        assert_eq!(order.first_deadline(), Some(early));
        // The front leaves (to ask a store, say) and comes back: still the front.
        order.remove(late, t0);
        assert_eq!(order.top(t0), Some(early));
        order.restore(late, &scheduling, 0, ());
        assert_eq!(order.top(t0), Some(late));
        assert_eq!(order.first_deadline(), Some(early));
        let snapshot = order.snapshot(t0 + SEC);
        assert_eq!(snapshot.class(Priority::Batch).depth(), 2);
        assert_eq!(snapshot.class(Priority::Batch).oldest_wait(), SEC);
    }
}
