//! The queue of requests waiting for a budget, and the services waiting for it to empty.
//!
//! Plain data structures with no clock and no locking: the budget holds them under its mutex.

use std::collections::BTreeMap;
use std::task::Waker;

use crate::cost::Cost;

/// Requests waiting for budget, served first in, first out.
///
/// Only the head may be admitted; the others wait for their turn without a timer. Entries are
/// keyed by an increasing ticket, so a cancelled waiter is removed from anywhere in the queue in
/// `O(log n)`.
#[derive(Debug, Default)]
pub(crate) struct WaitQueue {
    next_ticket: u64,
    waiters: BTreeMap<u64, Waiter>,
    /// The sum of the waiting costs, to tell a newcomer when its turn can come at the earliest.
    queued: Cost,
}

#[derive(Debug)]
struct Waiter {
    cost: Cost,
    waker: Waker,
}

impl WaitQueue {
    /// Appends a waiter and returns its ticket.
    pub(crate) fn push(&mut self, cost: Cost, waker: &Waker) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.waiters.insert(
            ticket,
            Waiter {
                cost,
                waker: waker.clone(),
            },
        );
        self.queued = self.queued.saturating_add(cost);
        ticket
    }

    /// The ticket at the head of the queue.
    pub(crate) fn head(&self) -> Option<u64> {
        self.waiters.first_key_value().map(|(ticket, _)| *ticket)
    }

    /// A clone of the head's waker, to wake it once the lock is released.
    pub(crate) fn head_waker(&self) -> Option<Waker> {
        self.waiters
            .first_key_value()
            .map(|(_, waiter)| waiter.waker.clone())
    }

    /// Updates a waiter's waker, cloning only when it changed.
    pub(crate) fn set_waker(&mut self, ticket: u64, waker: &Waker) {
        if let Some(waiter) = self.waiters.get_mut(&ticket) {
            if !waiter.waker.will_wake(waker) {
                waiter.waker = waker.clone();
            }
        }
    }

    /// Removes a waiter; returns whether it was at the head.
    pub(crate) fn remove(&mut self, ticket: u64) -> bool {
        let was_head = self.head() == Some(ticket);
        if let Some(waiter) = self.waiters.remove(&ticket) {
            self.queued = self.queued.saturating_sub(waiter.cost);
        }
        was_head
    }

    /// How many requests wait.
    pub(crate) fn len(&self) -> usize {
        self.waiters.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// The total cost of the waiting requests.
    pub(crate) fn queued(&self) -> Cost {
        self.queued
    }
}

/// Services waiting for the queue to empty (see `TokenBudget`'s readiness).
///
/// Each service registers once under a key of its own, so the set holds at most one waker per
/// live service, however often it is polled.
#[derive(Debug, Default)]
pub(crate) struct VacancyWatchers {
    next_key: u64,
    watchers: BTreeMap<u64, Waker>,
}

impl VacancyWatchers {
    /// Registers (or refreshes) the waker of the service holding `key`.
    pub(crate) fn register(&mut self, key: &mut Option<u64>, waker: &Waker) {
        let key = *key.get_or_insert_with(|| {
            self.next_key += 1;
            self.next_key
        });
        match self.watchers.get_mut(&key) {
            Some(existing) if existing.will_wake(waker) => {}
            Some(existing) => *existing = waker.clone(),
            None => {
                self.watchers.insert(key, waker.clone());
            }
        }
    }

    /// Forgets a service's registration.
    pub(crate) fn forget(&mut self, key: u64) {
        self.watchers.remove(&key);
    }

    /// Takes every registered waker, to wake them once the lock is released.
    pub(crate) fn take(&mut self) -> BTreeMap<u64, Waker> {
        std::mem::take(&mut self.watchers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Waker;

    #[test]
    fn fifo_with_removal_anywhere() {
        let mut q = WaitQueue::default();
        let waker = Waker::noop();
        let a = q.push(Cost::new(10, 0), waker);
        let b = q.push(Cost::new(20, 0), waker);
        let c = q.push(Cost::new(30, 0), waker);
        assert_eq!(q.head(), Some(a));
        assert_eq!(q.queued().input_tokens(), 60);
        assert!(!q.remove(b));
        assert_eq!(q.queued().input_tokens(), 40);
        assert!(q.remove(a));
        assert_eq!(q.head(), Some(c));
        assert!(q.remove(c));
        assert!(q.is_empty());
        assert_eq!(q.queued(), Cost::default());
    }

    #[test]
    fn one_registration_per_service() {
        let mut w = VacancyWatchers::default();
        let mut key = None;
        for _ in 0..5 {
            w.register(&mut key, Waker::noop());
        }
        let mut other = None;
        w.register(&mut other, Waker::noop());
        assert_eq!(w.take().len(), 2);
        assert!(w.take().is_empty());
    }
}
