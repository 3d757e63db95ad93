//! The future returned by [`Budget::reserve`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use tokio::time::{Sleep, sleep_until};

use super::bucket::Floor;
use super::{Budget, Reservation, Step};
use crate::cost::Cost;
use crate::error::InsufficientCapacity;

pin_project! {
    /// Waits for a [`Budget`] to admit a cost; see [`Budget::reserve`].
    ///
    /// # Cancel safety
    ///
    /// Dropping it before completion reserves nothing and leaves the queue.
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
    }

    impl PinnedDrop for Reserve {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
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
    type Output = Result<Reservation, InsufficientCapacity>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this
                .budget
                .poll_admission(this.ticket, this.cost, *this.floor, cx.waker())
            {
                Step::Admitted(id) => {
                    return Poll::Ready(Ok(Reservation::new(this.budget.clone(), id, *this.cost)));
                }
                Step::Never(e) => return Poll::Ready(Err(e)),
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
