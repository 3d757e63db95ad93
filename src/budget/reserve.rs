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
use super::store::Origin;
use super::{Answer, Ask, Budget, Reservation, ReservationId, Step};
use crate::cost::Cost;
use crate::error::ReserveError;
use crate::priority::Priority;
use crate::sched::Scheduling;
use crate::sched::order::Place;
use crate::tenant::Tenant;

impl Budget {
    /// Waits until `cost` can be paid in every limit it touches (and an in-flight slot is
    /// free, when the quota caps them), then reserves it.
    ///
    /// Waiters are admitted in the budget's ordering: by the class and place set with
    /// [`Reserve::priority`] (by default async, in arrival order). Fails at once, without waiting, when `cost`
    /// exceeds a bucket's capacity (or later, should a limit shrink below it while waiting).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes reserves nothing and gives up its place in the
    /// queue.
    pub fn reserve(&self, cost: Cost) -> Reserve {
        Reserve::new(self.clone(), cost)
    }
}

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
        ask: Ask,
        // The place in the budget's ordering, while waiting.
        place: Option<Place>,
        // Armed only while at the head of the ordering; reset in place.
        #[pin]
        sleep: Option<Sleep>,
        // A shared budget's question to its store, in flight, with the id it reserves under.
        // (Behind a `SyncWrapper`, which only lends it mutably, so `Reserve` stays `Sync`.)
        asking: Option<(ReservationId, SyncWrapper<StoreFuture<Decision>>)>,
        // The store's hint: not to be asked again before.
        retry_at: Option<(Instant, u64)>,
        // The store failed: admit from the local fallback share.
        local: bool,
        // Out of the ordering (keeping its place) until a node of its tenant path can pay:
        // the depth of that node and the parking's ticket.
        parked: Option<(usize, u64)>,
    }

    impl PinnedDrop for Reserve {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some((id, _)) = this.asking.take() {
                this.budget.abandoned(id, this.ask);
            }
            if let Some(parked) = this.parked.take() {
                this.budget.unpark(this.ask, parked);
            }
            if let Some(place) = this.place.take() {
                this.budget.cancel(place);
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
            ask,
            place: None,
            sleep: None,
            asking: None,
            retry_at: None,
            local: false,
            parked: None,
        }
    }

    /// Reserves for `tenant`: admitted only when the account and every node of its path can
    /// pay, served in its flow's fair share (see [`tenant`](crate::tenant)). Defaults to the
    /// tree's default tenant; ignored by a budget without tenants.
    pub fn tenant(mut self, tenant: Tenant) -> Self {
        self.ask.tenant = Some(tenant);
        self
    }

    /// Admits the cost only while it leaves `fraction` of every bucket it touches untouched,
    /// so that requests of a higher class still find that share at once. `fraction` is
    /// clamped to `[0, 1]`; NaN counts as 0. Defaults to 0.
    ///
    /// A cost above the rest of a bucket's capacity fails at once, as a cost above the whole
    /// capacity does. While it waits only to keep its floor, requests behind it with a lower
    /// floor are admitted first.
    pub fn keeping(mut self, fraction: f64) -> Self {
        // Not `..self`: the future implements `Drop`.
        self.ask.floor = Floor::from_fraction(fraction);
        self
    }

    /// Waits in `priority`'s class of the budget's ordering. Defaults to
    /// [`Priority::Async`].
    pub fn priority(mut self, priority: Priority) -> Self {
        self.ask.scheduling.priority = priority;
        self
    }

    /// Keeps the place of a request that first entered an ordering at `instant` (a retry),
    /// rather than now. Defaults to now.
    pub fn enqueued_at(mut self, instant: Instant) -> Self {
        self.ask.scheduling.enqueued_at = instant.min(self.ask.scheduling.enqueued_at);
        self
    }

    /// The cost being reserved.
    pub fn cost(&self) -> Cost {
        self.ask.cost
    }
}

impl Future for Reserve {
    type Output = Result<Reservation, ReserveError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let priority = this.ask.scheduling.priority;
        loop {
            if let Some((id, question)) = this.asking.as_mut() {
                let Poll::Ready(answer) = question.get_mut().as_mut().poll(cx) else {
                    return Poll::Pending;
                };
                let id = *id;
                *this.asking = None;
                match this
                    .budget
                    .answered(this.place, id, answer, this.ask, cx.waker())
                {
                    Answer::Admitted => {
                        let cost = this.ask.cost;
                        let reservation =
                            Reservation::new(this.budget.clone(), id, cost, Origin::Shared)
                                .with_tenant(this.ask.tenant.clone());
                        return Poll::Ready(Ok(reservation));
                    }
                    Answer::Never(e) => return Poll::Ready(Err(ReserveError::TooLarge(e))),
                    Answer::Refused(e) => return Poll::Ready(Err(ReserveError::Tenant(e))),
                    Answer::Unavailable(e) => {
                        return Poll::Ready(Err(ReserveError::Unavailable(e)));
                    }
                    Answer::Full(depth) => {
                        return Poll::Ready(Err(ReserveError::QueueFull { priority, depth }));
                    }
                    Answer::RetryAt(at, refunds) => *this.retry_at = Some((at, refunds)),
                    Answer::Fallback => *this.local = true,
                    Answer::Parked(at, parked) => {
                        *this.parked = Some(parked);
                        match this.sleep.as_mut().as_pin_mut() {
                            Some(sleep) => sleep.reset(at),
                            None => this.sleep.set(Some(sleep_until(at))),
                        }
                        let sleep = this.sleep.as_mut().as_pin_mut().expect("armed");
                        if sleep.poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        // Its time has come: back to its place (in `poll_admission`).
                    }
                }
            }
            match this.budget.poll_admission(
                this.place,
                this.ask,
                cx.waker(),
                *this.local,
                *this.retry_at,
                this.parked,
            ) {
                Step::Admitted(id, origin) => {
                    let reservation =
                        Reservation::new(this.budget.clone(), id, this.ask.cost, origin)
                            .with_tenant(this.ask.tenant.clone());
                    return Poll::Ready(Ok(reservation));
                }
                Step::Refused(e) => return Poll::Ready(Err(ReserveError::Tenant(e))),
                Step::Parked(None) => return Poll::Pending,
                Step::Never(e) => return Poll::Ready(Err(ReserveError::TooLarge(e))),
                Step::Full(depth) => {
                    return Poll::Ready(Err(ReserveError::QueueFull { priority, depth }));
                }
                Step::Unavailable(e) => return Poll::Ready(Err(ReserveError::Unavailable(e))),
                Step::Ask(id, limits, path) => {
                    *this.retry_at = None;
                    let question =
                        this.budget
                            .ask(id, this.ask.cost, this.ask.floor, (limits, path));
                    *this.asking = Some((id, SyncWrapper::new(question)));
                }
                Step::Queued => return Poll::Pending,
                Step::WaitUntil(at) | Step::Parked(Some(at)) => {
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
            .field("cost", &self.ask.cost)
            .field("priority", &self.ask.scheduling.priority)
            .field("queued", &self.place.is_some())
            .finish()
    }
}
