use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use super::ResponseFuture;
use crate::budget::{Ask, Budget, Floor, Reserve};
use crate::cost::Cost;
use crate::error::{BoxError, Error};
use crate::observe::Labels;
use crate::priority::{Deadline, EnqueuedAt, NotBefore, Priority};
use crate::queue::QueueLink;
use crate::sched::Scheduling;
use crate::tenant::Tenant;
use tokio::time::Instant;

/// What [`TokenBudget`] does with a request that carries no [`Cost`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingCost {
    /// Fail the request locally, before anything is sent. The default: an unpriced request is
    /// usually a missing estimation layer, and letting it through unmetered is how quotas are
    /// overrun.
    #[default]
    Reject,
    /// Charge this cost instead.
    Charge(Cost),
}

/// Reserves each request's cost in a [`Budget`] before calling the inner service; see the
/// [module documentation](crate::token_budget).
///
/// Clones share the budget (and its ordering).
#[derive(Debug)]
pub struct TokenBudget<S> {
    inner: S,
    budget: Budget,
    missing_cost: MissingCost,
    /// The share of every bucket each class must leave untouched, by `Priority::index`.
    pub(super) class_floor: [f64; 3],
    /// `poll_ready` found the inner service ready: a request admitted at once is sent at once.
    ready: bool,
}

// Written by hand: a clone shares the budget, but not the readiness its original took.
impl<S: Clone> Clone for TokenBudget<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            budget: self.budget.clone(),
            missing_cost: self.missing_cost,
            class_floor: self.class_floor,
            ready: false,
        }
    }
}

impl<S> TokenBudget<S> {
    /// Wraps `inner`, spending `budget`.
    pub fn new(inner: S, budget: Budget) -> Self {
        Self {
            inner,
            budget,
            missing_cost: MissingCost::default(),
            class_floor: [0.0; 3],
            ready: false,
        }
    }

    /// What to do with a request that carries no [`Cost`]. Defaults to [`MissingCost::Reject`].
    pub fn missing_cost(mut self, missing_cost: MissingCost) -> Self {
        // Not `..self`: the service implements `Drop`.
        self.missing_cost = missing_cost;
        self
    }

    /// Makes requests of `priority` leave `fraction` of every bucket untouched, so that higher
    /// classes find that share at once even while lower ones saturate the quota (for example
    /// batch keeping 10 % of the token bucket for interactive work). `fraction` is clamped to
    /// `[0, 1]`. Defaults to 0 for every class; requests without a [`Priority`] keep nothing.
    pub fn class_floor(mut self, priority: Priority, fraction: f64) -> Self {
        self.class_floor[priority.index()] = fraction;
        self
    }

    /// The budget this service spends.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The request's cost, or the one charged for a request without one; `None` to reject it.
    fn cost_of<B>(&self, request: &Request<B>) -> Option<Cost> {
        match (request.extensions().get::<Cost>(), self.missing_cost) {
            (Some(cost), _) => Some(*cost),
            (None, MissingCost::Charge(cost)) => Some(cost),
            (None, MissingCost::Reject) => None,
        }
    }

    /// What the request asks of the budget, and its class if it carries one (a request that
    /// carries none, and met no queue, keeps no class floor).
    fn ask_for<B>(&self, request: &Request<B>, cost: Cost) -> (Ask, Option<Priority>) {
        let extensions = request.extensions();
        if let Some(link) = extensions.get::<QueueLink>() {
            // The queue that placed it counts this budget's waiters in its snapshot.
            link.0.linked_to(&self.budget);
        }
        // Placed as a priority queue outside placed it, or by the request's own class, first
        // enqueue time and deadline.
        let scheduling = extensions.get::<Scheduling>().copied().unwrap_or_else(|| {
            let now = Instant::now();
            let enqueued_at = extensions
                .get::<EnqueuedAt>()
                .map_or(now, |at| at.instant().min(now));
            let priority = extensions.get::<Priority>().copied();
            let deadline = extensions.get::<Deadline>().map(Deadline::instant);
            Scheduling {
                deadline,
                own_deadline: deadline.is_some(),
                not_before: extensions.get::<NotBefore>().map(NotBefore::instant),
                ..Scheduling::new(priority.unwrap_or(Priority::Async), enqueued_at)
            }
        });
        let priority = extensions
            .get::<Priority>()
            .copied()
            .or_else(|| extensions.get::<Scheduling>().map(|s| s.priority));
        let keep = priority.map_or(0.0, |p| self.class_floor[p.index()]);
        let ask = Ask {
            cost,
            floor: Floor::from_fraction(keep),
            scheduling,
            tenant: extensions.get::<Tenant>().cloned(),
        };
        (ask, priority)
    }
}

impl<S: Clone> TokenBudget<S> {
    /// Gives back the readiness taken in `poll_ready` (an inner limit's permit), if any, by
    /// dropping the ready handle for a fresh clone.
    fn give_back_readiness(&mut self) {
        if std::mem::take(&mut self.ready) {
            self.inner = self.inner.clone();
        }
    }
}

impl<S, B, ResBody> Service<Request<B>> for TokenBudget<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = Error;
    type Future = ResponseFuture<S, B>;

    /// Always ready: requests wait for the budget in its ordering, in the response future
    /// (bounded by its depth, refused there with `is_queue_full()`).
    ///
    /// It asks the inner service's readiness here, so that a request the budget admits at
    /// once is sent at once; a request that must wait holds nothing while it waits, and its
    /// future asks the inner service's readiness again once admitted. An inner service that
    /// fails its readiness fails this one.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if !self.ready {
            match self.inner.poll_ready(cx) {
                Poll::Ready(Ok(())) => self.ready = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(Error::from_inner(e))),
                // Requests will wait in their futures; the handle gives up the place it may
                // have taken in the inner service's own waiting list (a semaphore's).
                Poll::Pending => self.inner = self.inner.clone(),
            }
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let Some(cost) = self.cost_of(&request) else {
            tracing::debug!("request without a cost rejected");
            // Nothing is sent: the readiness taken in `poll_ready` (an inner limit's permit)
            // is given back for the next caller.
            self.give_back_readiness();
            return ResponseFuture::failed(Error::missing_cost());
        };
        let (ask, priority) = self.ask_for(&request, cost);
        let scheduling = ask.scheduling;
        let labels = Labels::of(request.extensions());
        let started = Instant::now();
        match self.budget.admit_now(&ask, started).ok_or(ask) {
            // Admitted at once, and the inner service is ready: the common case of a quota
            // that keeps up.
            Ok(reservation) if std::mem::take(&mut self.ready) => ResponseFuture::sent(
                &mut self.inner,
                request,
                reservation,
                priority,
                labels,
                started,
            ),
            admitted => {
                // The readiness taken for a request admitted at once is given back: a request
                // that waits holds nothing, and its future asks a clone's readiness once
                // admitted.
                self.give_back_readiness();
                // A request held back until its time (a retry waiting out `Retry-After`)
                // waits in the queue from then: the time before is the retry's.
                let started = scheduling.not_before.map_or(started, |at| at.max(started));
                ResponseFuture::waiting(
                    admitted.map_err(|ask| Reserve::asking(self.budget.clone(), ask)),
                    self.inner.clone(),
                    request,
                    priority,
                    scheduling.deadline,
                    labels,
                    started,
                )
            }
        }
    }
}
