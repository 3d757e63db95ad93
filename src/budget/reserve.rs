//! The future returned by [`Budget::reserve`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use sync_wrapper::SyncWrapper;
use tokio::time::{Instant, Sleep, sleep_until};

use super::{Answer, Ask, Budget, Reservation, ReservationId, Step, Waiting};
use crate::budget::memory::bucket::Floor;
use crate::budget::memory::store::Origin;
use crate::budget::store::{Decision, StoreFuture};
use crate::cost::Cost;
use crate::error::ReserveError;
use crate::priority::Priority;
use crate::sched::Scheduling;
use crate::tenant::Tenant;

pin_project! {
    /// Waits for a [`Budget`] to admit a cost; see [`Budget::reserve`].
    ///
    /// # Cancel safety
    ///
    /// Dropping it before completion reserves nothing and leaves the ordering. For a shared
    /// budget, a question in flight to the shared store is answered by a release, so that
    /// whatever it took is given back.
    #[must_use = "futures do nothing unless polled"]
    pub struct Reserve {
        budget: Budget,
        // What it asks, its place in the ordering, and what the store told it.
        waiting: Waiting,
        // Armed only while at the head of the ordering; reset in place.
        #[pin]
        sleep: Option<Sleep>,
        // A shared budget's question to its store, in flight, with the id it reserves under.
        // (Behind a `SyncWrapper`, which only lends it mutably, so `Reserve` stays `Sync`.)
        asking: Option<(ReservationId, SyncWrapper<StoreFuture<Decision>>)>,
    }

    impl PinnedDrop for Reserve {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some((id, _)) = this.asking.take() {
                this.budget.engine.abandoned(id, this.waiting);
            }
            if let Some(parked) = this.waiting.parked.take() {
                this.budget.engine.unpark(&this.waiting.ask, parked);
            }
            if let Some(place) = this.waiting.place.take() {
                this.budget.engine.cancel(place);
            }
        }
    }
}

impl Reserve {
    pub(crate) fn new(budget: Budget, cost: Cost) -> Self {
        let scheduling = Scheduling::new(Priority::Async, Instant::now());
        let floor = Floor::NONE;
        Self::asking(
            budget,
            Ask {
                cost,
                floor,
                scheduling,
                tenant: None,
            },
        )
    }

    /// A reservation of what `ask` asks.
    pub(crate) fn asking(budget: Budget, ask: Ask) -> Self {
        Self {
            budget,
            waiting: Waiting::new(ask),
            sleep: None,
            asking: None,
        }
    }

    /// Reserves for `tenant`: admitted only when the account and every node of its path can
    /// pay, served in its flow's fair share (see [`tenant`](crate::tenant)). Defaults to the
    /// tree's default tenant; ignored by a budget without tenants.
    pub fn tenant(mut self, tenant: Tenant) -> Self {
        self.waiting.ask.tenant = Some(tenant);
        self
    }

    /// Admits the cost only while it leaves `fraction` of every bucket it touches untouched,
    /// so that requests of a higher class still find that share at once. `fraction` is
    /// clamped to `[0, 1]`; NaN counts as 0. Defaults to 0.
    ///
    /// A cost above the rest of a bucket's capacity fails at once, as a cost above the whole
    /// capacity does. While it waits only to keep its floor, requests behind it with a lower
    /// floor are admitted first.
    pub fn floor(mut self, fraction: f64) -> Self {
        // Not `..self`: the future implements `Drop`.
        self.waiting.ask.floor = Floor::from_fraction(fraction);
        self
    }

    /// Waits in `priority`'s class of the budget's ordering. Defaults to
    /// [`Priority::Async`].
    pub fn priority(mut self, priority: Priority) -> Self {
        self.waiting.ask.scheduling.priority = priority;
        self
    }

    /// Keeps the place of a request that first entered an ordering at `instant` (a retry),
    /// rather than now. Defaults to now.
    pub fn enqueued_at(mut self, instant: Instant) -> Self {
        self.waiting.ask.scheduling.enqueued_at =
            instant.min(self.waiting.ask.scheduling.enqueued_at);
        self
    }

    /// Not admitted before `instant` (a retry waiting out `Retry-After`, see
    /// [`NotBefore`](crate::queue::NotBefore)): the reservation takes its place now, steps
    /// out of the way of the others, and comes back to it a millisecond before `instant`.
    /// Defaults to no such instant.
    pub fn not_before(mut self, instant: Instant) -> Self {
        self.waiting.ask.scheduling.not_before = Some(instant);
        self
    }

    /// The cost being reserved.
    pub fn cost(&self) -> Cost {
        self.waiting.ask.cost
    }
}

impl Future for Reserve {
    type Output = Result<Reservation, ReserveError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            if let Some((id, question)) = this.asking.as_mut() {
                let Poll::Ready(answer) = question.get_mut().as_mut().poll(cx) else {
                    return Poll::Pending;
                };
                let id = *id;
                *this.asking = None;
                let answer = this
                    .budget
                    .engine
                    .answered(this.waiting, id, answer, cx.waker());
                let at = match answer {
                    Answer::RetryAt(at, refunds) => {
                        this.waiting.retry_at = Some((at, refunds));
                        None
                    }
                    Answer::Fallback => {
                        this.waiting.local = true;
                        None
                    }
                    Answer::Parked(at, parked) => {
                        this.waiting.parked = Some(parked);
                        Some(at)
                    }
                    end => return Poll::Ready(this.waiting.ended_by(end, id, this.budget)),
                };
                // Parked: its time must come before it goes back to its place (in the pass).
                if let Some(at) = at {
                    if sleep_until_elapsed(this.sleep.as_mut(), at, cx).is_pending() {
                        return Poll::Pending;
                    }
                }
            }
            match this.budget.engine.poll_admission(this.waiting, cx.waker()) {
                Step::Ask(id, limits, path) => {
                    this.waiting.retry_at = None;
                    let question = this
                        .budget
                        .engine
                        .ask(id, &this.waiting.ask, (limits, path));
                    *this.asking = Some((id, SyncWrapper::new(question)));
                }
                Step::Queued | Step::Parked(None) => return Poll::Pending,
                Step::WaitUntil(at) | Step::Parked(Some(at)) => {
                    if sleep_until_elapsed(this.sleep.as_mut(), at, cx).is_pending() {
                        return Poll::Pending;
                    }
                    // The cost's time has come: look again.
                }
                end => return Poll::Ready(this.waiting.ended(end, this.budget)),
            }
        }
    }
}

/// Arms `sleep` for `at` (reset in place) and polls it.
fn sleep_until_elapsed(
    mut sleep: Pin<&mut Option<Sleep>>,
    at: Instant,
    cx: &mut Context<'_>,
) -> Poll<()> {
    match sleep.as_mut().as_pin_mut() {
        Some(armed) if armed.deadline() != at || armed.is_elapsed() => armed.reset(at),
        Some(_) => {}
        None => sleep.set(Some(sleep_until(at))),
    }
    sleep.as_pin_mut().expect("armed above").poll(cx)
}

impl Waiting {
    /// The outcome of a pass that ended the wait.
    fn ended(&self, step: Step, budget: &Budget) -> Result<Reservation, ReserveError> {
        let priority = self.ask.scheduling.priority;
        match step {
            Step::Admitted(id, origin) => Ok(self.reservation(budget, id, origin)),
            Step::Refused(e) => Err(ReserveError::Tenant(e)),
            Step::Late(predicted, limit) => Err(ReserveError::DeadlineUnmet {
                priority,
                predicted,
                binding: Box::new(crate::error::Binding {
                    limit,
                    quota: budget.name(),
                }),
            }),
            Step::Never(e) => Err(ReserveError::TooLarge(e)),
            Step::Full(depth) => Err(ReserveError::QueueFull { priority, depth }),
            Step::Unavailable(e) => Err(ReserveError::Unavailable(e)),
            Step::Ask(..) | Step::Queued | Step::WaitUntil(_) | Step::Parked(_) => {
                unreachable!("a step that waits does not end the wait")
            }
        }
    }

    /// The outcome of a store's answer that ended the wait (question `id`).
    fn ended_by(
        &self,
        answer: Answer,
        id: ReservationId,
        budget: &Budget,
    ) -> Result<Reservation, ReserveError> {
        let priority = self.ask.scheduling.priority;
        match answer {
            Answer::Admitted => Ok(self.reservation(budget, id, Origin::Remote)),
            Answer::Never(e) => Err(ReserveError::TooLarge(e)),
            Answer::Refused(e) => Err(ReserveError::Tenant(e)),
            Answer::Unavailable(e) => Err(ReserveError::Unavailable(e)),
            Answer::Full(depth) => Err(ReserveError::QueueFull { priority, depth }),
            Answer::RetryAt(..) | Answer::Fallback | Answer::Parked(..) => {
                unreachable!("an answer that waits does not end the wait")
            }
        }
    }

    fn reservation(&self, budget: &Budget, id: ReservationId, origin: Origin) -> Reservation {
        Reservation::new(budget.clone(), id, self.ask.cost, origin)
            .with_tenant(self.ask.tenant.clone())
    }
}

impl fmt::Debug for Reserve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reserve")
            .field("cost", &self.waiting.ask.cost)
            .field("priority", &self.waiting.ask.scheduling.priority)
            .field("queued", &self.waiting.place.is_some())
            .finish()
    }
}
