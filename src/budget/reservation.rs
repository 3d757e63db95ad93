//! The debit held for one request, and how it is settled.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use super::{Budget, ReservationId};
use crate::budget::memory::store::Origin;
use crate::cost::{Cost, Usage};
use crate::pricing::Priced;
use crate::quota::Dimension;
use crate::tenant::Tenant;

/// The debit a [`Budget`] holds for one request, until it is settled.
///
/// # Settlement rules
///
/// - [`settle`](Reservation::settle) with the real [`Usage`]: the unused part of the estimate is
///   refunded at once; an overrun is charged as debt, which may drive a bucket below zero and
///   delays later admissions by exactly `debt / rate`, as the provider would.
/// - [`refund`](Reservation::refund): everything goes back, requests included.
/// - Dropped unsettled **before** [`mark_sent`](Reservation::mark_sent): full refund; nothing
///   reached the provider.
/// - Dropped unsettled **after** `mark_sent`: charged its estimate; the provider may have
///   counted the call, and the estimate errs high.
///
/// So every reservation ends settled, refunded or charged: none leaks.
#[must_use = "a dropped reservation is refunded if it was not sent, else charged its estimate"]
pub struct Reservation {
    budget: Budget,
    id: ReservationId,
    origin: Origin,
    cost: Cost,
    /// The tenant path it was admitted on, whose every node settles it too.
    tenant: Option<Tenant>,
    /// The prices its usage is settled at, if priced.
    priced: Option<Priced>,
    sent: bool,
    finished: bool,
}

impl Reservation {
    pub(crate) fn new(budget: Budget, id: ReservationId, cost: Cost, origin: Origin) -> Self {
        Self {
            budget,
            id,
            origin,
            cost,
            tenant: None,
            priced: None,
            sent: false,
            finished: false,
        }
    }

    /// The same reservation, admitted on `tenant`'s path.
    pub(crate) fn with_tenant(mut self, tenant: Option<Tenant>) -> Self {
        self.tenant = tenant;
        self
    }

    /// The tenant path it was admitted on, for a budget with tenants.
    pub fn tenant(&self) -> Option<&Tenant> {
        self.tenant.as_ref()
    }

    /// The reservation's id within its budget.
    pub fn id(&self) -> ReservationId {
        self.id
    }

    /// The cost reserved.
    pub fn cost(&self) -> Cost {
        self.cost
    }

    /// The budget this reservation was taken from.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Settles the spend of the real usage at `priced`'s prices (the
    /// [`TokenBudget`](crate::token_budget::TokenBudget) sets the request's own). Without
    /// prices, [`settle`](Self::settle) charges the spend the usage records, else the spend
    /// reserved.
    pub fn set_priced(&mut self, priced: Priced) {
        self.priced = Some(priced);
    }

    /// The prices its usage is settled at, if set.
    pub fn priced(&self) -> Option<&Priced> {
        self.priced.as_ref()
    }

    /// Records that the request is about to leave: from now on, dropping the reservation
    /// charges its estimate instead of refunding it.
    pub fn mark_sent(&mut self) {
        self.sent = true;
    }

    /// Whether [`mark_sent`](Reservation::mark_sent) was called.
    pub fn is_sent(&self) -> bool {
        self.sent
    }

    /// Settles with the real usage: the requests reserved stay charged, the tokens are replaced
    /// by the reported ones, and the spend by theirs at the reservation's
    /// [prices](Self::set_priced) (or the usage's own [spend](Usage::with_spend); else the
    /// spend reserved stays charged).
    pub fn settle(self, usage: &Usage) -> Settlement {
        let spend = match &self.priced {
            Some(priced) => priced.spend(usage),
            None => usage.spend().unwrap_or(self.cost.spend()),
        };
        let actual = usage.as_cost(self.cost.requests()).with_spend(spend);
        self.finish(actual)
    }

    /// Settles with an explicit actual cost, for callers that measure usage themselves.
    pub fn settle_cost(self, actual: Cost) -> Settlement {
        self.finish(actual)
    }

    /// Gives everything back, requests included (the call was never made).
    pub fn refund(self) -> Settlement {
        self.finish(Cost::default())
    }

    /// Keeps the estimate as the final charge (the usage will never be known).
    pub fn charge_estimate(self) -> Settlement {
        let cost = self.cost;
        self.finish(cost)
    }

    fn finish(mut self, actual: Cost) -> Settlement {
        self.finished = true;
        self.budget.engine.settle(
            self.id,
            self.origin,
            &self.cost,
            &actual,
            self.tenant.as_ref(),
        );
        Settlement {
            reserved: self.cost,
            actual,
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.finished {
            self.finished = true;
            let actual = if self.sent {
                self.cost
            } else {
                Cost::default()
            };
            self.budget.engine.settle(
                self.id,
                self.origin,
                &self.cost,
                &actual,
                self.tenant.as_ref(),
            );
        }
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("id", &self.id)
            .field("cost", &self.cost)
            .field("sent", &self.sent)
            .finish()
    }
}

/// What a settlement changed: the reserved cost and the actual one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    reserved: Cost,
    actual: Cost,
}

impl Settlement {
    /// The cost that was reserved.
    pub fn reserved(&self) -> Cost {
        self.reserved
    }

    /// The cost finally charged.
    pub fn actual(&self) -> Cost {
        self.actual
    }

    /// How much of `dimension` went back to the budget.
    pub fn refunded(&self, dimension: Dimension) -> u64 {
        self.reserved
            .amount(dimension)
            .saturating_sub(self.actual.amount(dimension))
    }

    /// How much of `dimension` was charged beyond the estimate, as debt.
    pub fn overrun(&self, dimension: Dimension) -> u64 {
        self.actual
            .amount(dimension)
            .saturating_sub(self.reserved.amount(dimension))
    }
}

/// A [`Reservation`] travelling in a request's extensions, to be taken once.
///
/// [`TokenBudget`](crate::token_budget::TokenBudget) inserts one into every request it admits;
/// [`Reconcile`](crate::reconcile::Reconcile), or any layer of your own, [`take`](ReservationSlot::take)s
/// it to settle. Extensions must be `Clone`, so clones of a slot share the one reservation:
/// whoever takes it first owns it. A reservation nobody takes is charged its estimate when the
/// `TokenBudget` call completes or is dropped.
#[derive(Clone, Default)]
pub struct ReservationSlot {
    reservation: Arc<Mutex<Option<Reservation>>>,
}

impl ReservationSlot {
    /// A slot holding `reservation`.
    pub fn new(reservation: Reservation) -> Self {
        Self {
            reservation: Arc::new(Mutex::new(Some(reservation))),
        }
    }

    /// Takes the reservation, if nobody has yet.
    pub fn take(&self) -> Option<Reservation> {
        self.reservation
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl fmt::Debug for ReservationSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let guard = self
            .reservation
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        f.debug_tuple("ReservationSlot").field(&*guard).finish()
    }
}
