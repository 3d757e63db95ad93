use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use super::ResponseFuture;
use crate::budget::Budget;
use crate::cost::Cost;
use crate::error::{BoxError, Error};
use crate::observe::Labels;
use crate::priority::{Deadline, EnqueuedAt, Priority};
use crate::sched::Scheduling;
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
#[derive(Debug, Clone)]
pub struct TokenBudget<S> {
    inner: S,
    budget: Budget,
    missing_cost: MissingCost,
    /// The share of every bucket each class must leave untouched, by `Priority::index`.
    pub(super) class_headroom: [f64; 3],
}

impl<S> TokenBudget<S> {
    /// Wraps `inner`, spending `budget`.
    pub fn new(inner: S, budget: Budget) -> Self {
        Self {
            inner,
            budget,
            missing_cost: MissingCost::default(),
            class_headroom: [0.0; 3],
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
    pub fn class_headroom(mut self, priority: Priority, fraction: f64) -> Self {
        self.class_headroom[priority.index()] = fraction;
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
    /// (bounded by its depth, refused there with `is_queue_full()`). The inner service's
    /// readiness is awaited after admission.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let cost = match (request.extensions().get::<Cost>(), self.missing_cost) {
            (Some(cost), _) => *cost,
            (None, MissingCost::Charge(cost)) => cost,
            (None, MissingCost::Reject) => {
                tracing::debug!("request without a cost rejected");
                return ResponseFuture::failed(Error::missing_cost());
            }
        };
        let extensions = request.extensions();
        let priority = extensions.get::<Priority>().copied();
        let keep = priority.map_or(0.0, |p| self.class_headroom[p.index()]);
        // Placed as a priority queue outside placed it, or by the request's own class and
        // first enqueue time.
        let scheduling = extensions.get::<Scheduling>().copied().unwrap_or_else(|| {
            let now = Instant::now();
            let enqueued_at = extensions
                .get::<EnqueuedAt>()
                .map_or(now, |at| at.instant().min(now));
            Scheduling::new(priority.unwrap_or(Priority::Async), enqueued_at)
        });
        let deadline = request
            .extensions()
            .get::<Deadline>()
            .map(Deadline::instant);
        let labels = Labels::of(request.extensions());
        ResponseFuture::new(
            self.budget
                .reserve(cost)
                .keeping(keep)
                .scheduling(scheduling),
            self.inner.clone(),
            request,
            priority,
            deadline,
            labels,
        )
    }
}
