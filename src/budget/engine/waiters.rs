//! The requests waiting for a budget, in the one ordering, and its in-flight slots.
//!
//! Plain data with no clock and no locking: the budget holds them under its mutex.

use std::num::NonZeroUsize;
use std::task::Waker;

use tokio::time::Instant;

use crate::budget::memory::bucket::Floor;
use crate::cost::Cost;
use crate::priority::Priority;
use crate::sched::Scheduling;
use crate::sched::order::{Full, Order, Place};
use crate::tenant::Tenant;

/// What one admission asks of the budget: its cost, the floor its class keeps, its place, its
/// tenant path (for a budget with tenants, the tree's default when the request named none).
#[derive(Debug, Clone)]
pub(crate) struct Ask {
    pub(crate) cost: Cost,
    pub(crate) floor: Floor,
    pub(crate) scheduling: Scheduling,
    pub(crate) tenant: Option<Tenant>,
}

/// What a request counts for in its tenant's fair share: its tokens (its requests, for a cost
/// of none).
fn fair_cost(ask: &Ask) -> u64 {
    ask.cost.total_tokens().max(ask.cost.requests())
}

/// A request waiting for the budget.
#[derive(Debug)]
pub(crate) struct Waiter {
    cost: Cost,
    floor: Floor,
    /// The request's tenant path, when the budget has tenants.
    pub(crate) tenant: Option<Tenant>,
    /// Its last attempt failed only because of its floor: requests behind it with a lower
    /// floor may go first.
    floor_blocked: bool,
}

/// Requests waiting for budget, in priority order (see `sched::order`), with the sum of their
/// costs.
///
/// Only the head may be admitted, or a request behind heads that wait only to keep their
/// class floor, when its own floor is lower. The others wait for their turn without a timer.
#[derive(Debug, Default)]
pub(crate) struct WaitList {
    order: Order<Waiter>,
    /// The head last told to look (or that looked): waiters that find another head than
    /// their own wake it once, not at every poll.
    told: Option<Place>,
    /// The sum of the waiting costs by class, to tell a newcomer when its turn can come at the
    /// earliest.
    queued: [Cost; 3],
}

impl WaitList {
    /// Adds a waiter, or refreshes the waker of one already in the list.
    pub(crate) fn wait(
        &mut self,
        place: &mut Option<Place>,
        ask: &Ask,
        waker: &Waker,
    ) -> Result<(), Full> {
        let mine = match *place {
            Some(mine) => mine,
            None => {
                let waiter = Waiter {
                    cost: ask.cost,
                    floor: ask.floor,
                    tenant: ask.tenant.clone(),
                    floor_blocked: false,
                };
                let mine = self
                    .order
                    .push_fair(&ask.scheduling, None, fair_cost(ask), waiter)?;
                self.add(mine, ask.cost);
                *place.insert(mine)
            }
        };
        self.order.set_waker(mine, waker);
        Ok(())
    }

    /// Puts back a waiter that left to ask a shared store.
    pub(crate) fn restore(&mut self, place: Place, ask: &Ask, waker: &Waker) {
        let waiter = Waiter {
            cost: ask.cost,
            floor: ask.floor,
            tenant: ask.tenant.clone(),
            floor_blocked: false,
        };
        self.order
            .restore(place, &ask.scheduling, fair_cost(ask), waiter);
        self.add(place, ask.cost);
        self.order.set_waker(place, waker);
    }

    /// Removes a waiter that was not served and will not come back (it left, was refused),
    /// waiting or stepped out; returns the waker of whoever may go now in its stead, when the
    /// fronts changed and someone is left.
    pub(crate) fn remove(&mut self, place: Place, now: Instant) -> Option<Waker> {
        self.take(place, now, Order::remove)
    }

    /// Removes a waiter admitted now (its tenant's fair share counts it); returns the waker of
    /// whoever may go next.
    pub(crate) fn serve(&mut self, place: Place, now: Instant) -> Option<Waker> {
        self.take(place, now, Order::serve)
    }

    /// Steps a waiter out of the ordering for a while (it asks a shared store, or waits for
    /// a node of its tenant path), keeping its place and its tenant's turn; returns the waker
    /// of whoever may go now in its stead.
    pub(crate) fn step_out(&mut self, place: Place, now: Instant) -> Option<Waker> {
        self.take(place, now, Order::step_out)
    }

    /// Counts a waiter that stepped out to ask a shared store as served: it was admitted.
    pub(crate) fn serve_away(&mut self, place: Place) {
        self.order.serve_away(place);
    }

    fn take(
        &mut self,
        place: Place,
        now: Instant,
        leave: fn(&mut Order<Waiter>, Place, Instant) -> Option<Waiter>,
    ) -> Option<Waker> {
        let fronts = self.order.ranked(now);
        let waiter = leave(&mut self.order, place, now)?;
        self.subtract(place, waiter.cost);
        // Whoever goes next changed when a front left, and also when a request behind a
        // tenant's oldest did: its successor may rank before the other tenants.
        if self.order.ranked(now) != fronts {
            self.next_to_wake(now, None)
        } else {
            None
        }
    }

    /// Whether `place` may try to be admitted now: it is the head, or every request served
    /// before it (in its class or another) waits only to keep a class floor higher than its
    /// own.
    pub(crate) fn may_go(&self, place: Place, now: Instant) -> bool {
        let Some(mine) = self.order.get(place) else {
            return false;
        };
        for (ahead, waiter) in self.order.walk(now) {
            if ahead == place {
                return true;
            }
            if !(waiter.floor_blocked && waiter.floor > mine.floor) {
                return false;
            }
        }
        false
    }

    /// The waker of the first front (ranked after `after`, if given) that may go and is not
    /// itself waiting only for its floor: whoever should look next. A front waiting for its
    /// floor has a timer of its own, so waking it again would only spin.
    fn next_to_wake(&self, now: Instant, after: Option<Place>) -> Option<Waker> {
        let mut passed = after.is_none();
        for (place, waiter) in self.order.walk(now) {
            if !passed {
                passed = Some(place) == after;
                continue;
            }
            if !waiter.floor_blocked {
                // The first that is not waiting for its floor: it may go if every one before
                // it waits for a higher floor.
                return self
                    .may_go(place, now)
                    .then(|| self.order.waker(place))
                    .flatten();
            }
        }
        None
    }

    /// Records whether `place`'s last attempt failed only because of its floor; if it did,
    /// returns the waker of the next request behind it that may go instead.
    pub(crate) fn set_floor_blocked(
        &mut self,
        place: Place,
        blocked: bool,
        now: Instant,
    ) -> Option<Waker> {
        let waiter = self.order.get_mut(place)?;
        waiter.floor_blocked = blocked;
        if !blocked {
            return None;
        }
        self.next_to_wake(now, Some(place))
    }

    /// When the ranking of the fronts may change by aging alone: the head, sleeping until its
    /// cost fits, must look again then.
    pub(crate) fn next_reorder(&self, now: Instant) -> Option<Instant> {
        self.order.next_promotion(now)
    }

    /// The waker of the head, to wake once the lock is released.
    pub(crate) fn head_waker(&self, now: Instant) -> Option<Waker> {
        self.order.top_waker(now)
    }

    /// The waker of the head, unless it was told to look (or looked) since it became the
    /// head.
    pub(crate) fn tell_head(&mut self, now: Instant) -> Option<Waker> {
        let head = self.order.top(now)?;
        if self.told == Some(head) {
            return None;
        }
        self.told = Some(head);
        self.order.waker(head)
    }

    /// `place` looks now: it needs no telling.
    pub(crate) fn told(&mut self, place: Place) {
        self.told = Some(place);
    }

    pub(crate) fn order(&self) -> &Order<Waiter> {
        &self.order
    }

    /// The wakers of the waiters whose tenant path `pick` chooses.
    pub(crate) fn wakers_of_tenants(&self, mut pick: impl FnMut(&Tenant) -> bool) -> Vec<Waker> {
        self.order
            .wakers_of(|waiter| waiter.tenant.as_ref().is_some_and(&mut pick))
    }

    /// How many requests wait.
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Adds to `out` every flow with requests waiting, with its weight, and to `guarantors`
    /// their guarantors.
    pub(crate) fn waiting_flows(&self, out: &mut Vec<(u64, u32)>, guarantors: &mut Vec<u64>) {
        self.order.waiting_flows(out, guarantors);
    }

    /// Names the ordering: the `queue` label of its depth gauge.
    pub(crate) fn set_label(&mut self, label: std::sync::Arc<str>) {
        self.order.set_label(label);
    }

    /// The `queue` label of its depth gauge.
    pub(crate) fn label(&self) -> std::sync::Arc<str> {
        self.order.label()
    }

    /// The total cost of the waiting requests.
    pub(crate) fn queued(&self) -> Cost {
        self.queued
            .iter()
            .fold(Cost::default(), |sum, cost| sum.saturating_add(*cost))
    }

    /// The cost of the requests a newcomer of `priority` arriving at `now` would wait behind:
    /// every request of its class and of the classes above, and a lower class's front that
    /// aging has lifted to its class or above. (Fair share inside a class is not counted: a
    /// tenant's newcomer is taken to wait behind its whole class.)
    pub(crate) fn queued_ahead_of(&self, priority: Priority, now: Instant) -> Cost {
        let mut ahead = Cost::default();
        for class in Priority::ALL {
            if class.index() <= priority.index() {
                ahead = ahead.saturating_add(self.queued[class.index()]);
            } else if let Some((lifted, waiter)) = self.order.front_of(class, now) {
                if lifted.index() <= priority.index() {
                    ahead = ahead.saturating_add(waiter.cost);
                }
            }
        }
        ahead
    }

    fn add(&mut self, place: Place, cost: Cost) {
        let class = place.priority().index();
        self.queued[class] = self.queued[class].saturating_add(cost);
    }

    fn subtract(&mut self, place: Place, cost: Cost) {
        let class = place.priority().index();
        self.queued[class] = self.queued[class].saturating_sub(cost);
    }
}

/// The budget's in-flight slots: a limit that does not refill with time. A slot is taken with
/// the tokens, in the same admission, and given back when the reservation ends.
#[derive(Debug, Default)]
pub(crate) struct Slots {
    max: Option<NonZeroUsize>,
    /// Reservations holding a slot.
    used: usize,
    /// Slots kept for questions in flight to a shared store.
    promised: usize,
}

impl Slots {
    pub(crate) fn new(max: Option<NonZeroUsize>) -> Self {
        Self {
            max,
            ..Self::default()
        }
    }

    /// Whether one more admission may take a slot.
    pub(crate) fn free(&self) -> bool {
        self.max
            .is_none_or(|max| self.used + self.promised < max.get())
    }

    pub(crate) fn take(&mut self) {
        self.used += 1;
    }

    /// Gives a slot back; returns whether slots are limited (so a waiter may go now).
    pub(crate) fn release_limited(&mut self) -> bool {
        self.used = self.used.saturating_sub(1);
        self.max.is_some()
    }

    pub(crate) fn promise(&mut self) {
        self.promised += 1;
    }

    /// A promised slot is taken (`admitted`) or given back.
    pub(crate) fn fulfil(&mut self, admitted: bool) {
        self.promised = self.promised.saturating_sub(1);
        if admitted {
            self.used += 1;
        }
    }

    pub(crate) fn set_max(&mut self, max: Option<NonZeroUsize>) {
        self.max = max;
    }

    pub(crate) fn max(&self) -> Option<NonZeroUsize> {
        self.max
    }

    pub(crate) fn used(&self) -> usize {
        self.used
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::priority::Priority;
    use std::time::Duration;

    fn ask(priority: Priority, at: Instant, tokens: u64, floor: f64) -> Ask {
        Ask {
            cost: Cost::new(tokens, 0),
            floor: Floor::from_fraction(floor),
            scheduling: Scheduling::new(priority, at),
            tenant: None,
        }
    }

    #[test]
    fn class_then_arrival_with_removal_anywhere() {
        let t0 = Instant::now();
        let mut list = WaitList::default();
        let waker = Waker::noop();
        let (mut a, mut b, mut c) = (None, None, None);
        list.wait(&mut a, &ask(Priority::Batch, t0, 10, 0.0), waker)
            .unwrap();
        list.wait(&mut b, &ask(Priority::Batch, t0, 20, 0.0), waker)
            .unwrap();
        list.wait(&mut c, &ask(Priority::Interactive, t0, 30, 0.0), waker)
            .unwrap();
        let (a, b, c) = (a.unwrap(), b.unwrap(), c.unwrap());
        assert!(list.may_go(c, t0) && !list.may_go(a, t0));
        assert_eq!(list.queued().input_tokens(), 60);
        assert!(list.remove(b, t0).is_none(), "not the head");
        assert_eq!(list.queued().input_tokens(), 40);
        assert!(
            list.remove(c, t0).is_some(),
            "the head left: the next is woken"
        );
        assert!(list.may_go(a, t0));
        list.remove(a, t0);
        assert!(list.is_empty());
        assert_eq!(list.queued(), Cost::default());
    }

    #[test]
    fn a_head_blocked_by_its_floor_lets_a_lower_floor_go() {
        let t0 = Instant::now();
        let now = t0 + Duration::from_secs(200);
        let mut list = WaitList::default();
        let waker = Waker::noop();
        // A batch request that has aged to interactive (150 s) heads the list; it keeps 10 %
        // of every bucket for higher classes. An interactive request keeping nothing, and a
        // second batch request, wait behind it.
        let (mut batch, mut interactive, mut second) = (None, None, None);
        list.wait(&mut batch, &ask(Priority::Batch, t0, 10, 0.1), waker)
            .unwrap();
        list.wait(
            &mut interactive,
            &ask(Priority::Interactive, now, 10, 0.0),
            waker,
        )
        .unwrap();
        list.wait(&mut second, &ask(Priority::Batch, t0, 10, 0.0), waker)
            .unwrap();
        let (batch, interactive, second) = (batch.unwrap(), interactive.unwrap(), second.unwrap());
        assert!(list.may_go(batch, now) && !list.may_go(interactive, now));
        // Its last attempt failed only because of its floor: the interactive one may go, and
        // is the one told to look; the second batch request is no front and still waits.
        assert!(list.set_floor_blocked(batch, true, now).is_some());
        assert!(list.may_go(interactive, now));
        assert!(!list.may_go(second, now));
        // Once it fails for want of capacity instead, nobody overtakes it.
        assert!(list.set_floor_blocked(batch, false, now).is_none());
        assert!(!list.may_go(interactive, now));
    }

    #[test]
    fn slots_count_promises() {
        let mut slots = Slots::new(NonZeroUsize::new(2));
        slots.take();
        slots.promise();
        assert!(!slots.free());
        slots.fulfil(false);
        assert!(slots.free());
        slots.take();
        assert!(!slots.free());
        assert!(slots.release_limited());
        assert!(slots.free());
        assert_eq!(slots.used(), 1);
    }
}
