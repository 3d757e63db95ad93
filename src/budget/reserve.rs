//! The future returned by [`Budget::reserve`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use sync_wrapper::SyncWrapper;
use tokio::time::{Instant, Sleep, sleep_until};

use super::bucket::Floor;
use super::remote::{Decision, StoreFuture};
use super::reservation::Origin;
use super::{Answer, Budget, Reservation, ReservationId, Step};
use crate::cost::Cost;
use crate::error::ReserveError;

pin_project! {
    /// Waits for a [`Budget`] to admit a cost; see [`Budget::reserve`].
    ///
    /// # Cancel safety
    ///
    /// Dropping it before completion reserves nothing and leaves the queue. For a shared
    /// budget, a question in flight to the shared store is answered by a release, so that
    /// whatever it took is given back.
    #[must_use = "futures do nothing unless polled"]
    pub struct Reserve {
        budget: Budget,
        cost: Cost,
        floor: Floor,
        // The place in the budget's queue, while waiting.
        ticket: Option<u64>,
        // Armed only while at the head of the queue; reset in place.
        #[pin]
        sleep: Option<Sleep>,
        // A shared budget's question to its store, in flight, with the id it reserves under.
        // (Behind a `SyncWrapper`, which only lends it mutably, so `Reserve` stays `Sync`.)
        asking: Option<(ReservationId, SyncWrapper<StoreFuture<Decision>>)>,
        // The store's hint: not to be asked again before.
        retry_at: Option<(Instant, u64)>,
        // The store failed: admit from the local fallback share.
        local: bool,
    }

    impl PinnedDrop for Reserve {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some((id, _)) = this.asking.take() {
                this.budget.abandoned(id, this.cost);
            }
            if let Some(ticket) = this.ticket.take() {
                this.budget.cancel(ticket);
            }
        }
    }
}

impl Reserve {
    pub(crate) fn new(budget: Budget, cost: Cost) -> Self {
        Self {
            budget,
            cost,
            floor: Floor::NONE,
            ticket: None,
            sleep: None,
            asking: None,
            retry_at: None,
            local: false,
        }
    }

    /// Admits the cost only while it leaves `fraction` of every bucket it touches untouched,
    /// so that requests of a higher class still find that share at once. `fraction` is
    /// clamped to `[0, 1]`; NaN counts as 0. Defaults to 0.
    ///
    /// A cost above the rest of a bucket's capacity fails at once, as a cost above the whole
    /// capacity does.
    pub fn keeping(mut self, fraction: f64) -> Self {
        // Not `..self`: the future implements `Drop`.
        self.floor = Floor::from_fraction(fraction);
        self
    }

    /// The cost being reserved.
    pub fn cost(&self) -> Cost {
        self.cost
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
                match this
                    .budget
                    .answered(this.ticket, id, answer, this.cost, cx.waker())
                {
                    Answer::Admitted => {
                        let reservation =
                            Reservation::new(this.budget.clone(), id, *this.cost, Origin::Shared);
                        return Poll::Ready(Ok(reservation));
                    }
                    Answer::Never(e) => return Poll::Ready(Err(ReserveError::TooLarge(e))),
                    Answer::Unavailable(e) => {
                        return Poll::Ready(Err(ReserveError::Unavailable(e)));
                    }
                    Answer::RetryAt(at, refunds) => *this.retry_at = Some((at, refunds)),
                    Answer::Fallback => *this.local = true,
                }
            }
            match this.budget.poll_admission(
                this.ticket,
                this.cost,
                *this.floor,
                cx.waker(),
                *this.local,
                *this.retry_at,
            ) {
                Step::Admitted(id, origin) => {
                    let reservation = Reservation::new(this.budget.clone(), id, *this.cost, origin);
                    return Poll::Ready(Ok(reservation));
                }
                Step::Never(e) => return Poll::Ready(Err(ReserveError::TooLarge(e))),
                Step::Unavailable(e) => return Poll::Ready(Err(ReserveError::Unavailable(e))),
                Step::Ask(id, limits) => {
                    *this.retry_at = None;
                    let question = this.budget.ask(id, *this.cost, *this.floor, limits);
                    *this.asking = Some((id, SyncWrapper::new(question)));
                }
                Step::Queued => return Poll::Pending,
                Step::WaitUntil(at) => {
                    match this.sleep.as_mut().as_pin_mut() {
                        Some(sleep) => {
                            if sleep.deadline() != at || sleep.is_elapsed() {
                                sleep.reset(at);
                            }
                        }
                        None => this.sleep.set(Some(sleep_until(at))),
                    }
                    if let Some(sleep) = this.sleep.as_mut().as_pin_mut() {
                        if sleep.poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                    }
                    // The cost's time has come: look again.
                }
            }
        }
    }
}

impl fmt::Debug for Reserve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reserve")
            .field("cost", &self.cost)
            .field("queued", &self.ticket.is_some())
            .finish()
    }
}
