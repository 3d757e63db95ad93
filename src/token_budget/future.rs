use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower::Service;

use crate::budget::{Reservation, ReservationSlot, Reserve};
use crate::error::{BoxError, Error};
use crate::observe::{self, Labels};
use crate::priority::{Priority, Timings};
use crate::timer::DeadlineTimer;

pin_project! {
    /// The response future of [`TokenBudget`](super::TokenBudget): waits for the budget, then
    /// for the inner service's readiness, then for its response.
    ///
    /// # Cancel safety
    ///
    /// Dropped while waiting for the budget, it leaves the queue; after admission but before
    /// the call, its reservation is refunded; during the call, the reservation is charged its
    /// estimate unless an inner layer took it to settle.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S::Future>,
        service: Option<S>,
        request: Option<Request<B>>,
        priority: Option<Priority>,
        labels: Labels,
        started: Option<Instant>,
        #[pin]
        deadline: DeadlineTimer,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Failed { error: Option<Error> },
        Admitting { #[pin] reserve: Reserve },
        Readying { reservation: Option<Reservation> },
        Calling { #[pin] future: F, unclaimed: Unclaimed, waited: std::time::Duration },
        Done,
    }
}

/// Takes back a reservation no inner layer claimed when the call ends or is dropped, so it is
/// charged then rather than whenever the request's extensions are dropped.
struct Unclaimed(ReservationSlot);

impl Drop for Unclaimed {
    fn drop(&mut self) {
        drop(self.0.take());
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(crate) fn new(
        reserve: Reserve,
        service: S,
        request: Request<B>,
        priority: Option<Priority>,
        deadline: Option<Instant>,
        labels: Labels,
    ) -> Self {
        Self {
            state: State::Admitting { reserve },
            service: Some(service),
            request: Some(request),
            priority,
            labels,
            started: None,
            deadline: DeadlineTimer::new(deadline),
        }
    }

    pub(crate) fn failed(error: Error) -> Self {
        Self {
            state: State::Failed { error: Some(error) },
            service: None,
            request: None,
            priority: None,
            labels: Labels::default(),
            started: None,
            deadline: DeadlineTimer::new(None),
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
{
    type Output = Result<S::Response, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let started = *this.started.get_or_insert_with(Instant::now);
        loop {
            let waiting = match this.state.as_mut().project() {
                StateProj::Failed { error } => {
                    let error = error.take().expect("polled after completion");
                    this.state.set(State::Done);
                    return Poll::Ready(Err(error));
                }
                StateProj::Admitting { reserve } => match reserve.poll(cx) {
                    Poll::Ready(Ok(reservation)) => {
                        observe::reserved(this.labels, &reservation.cost());
                        tracing::trace!(cost = ?reservation.cost(), "admitted by the budget");
                        this.state.set(State::Readying {
                            reservation: Some(reservation),
                        });
                        continue;
                    }
                    Poll::Ready(Err(refused)) => {
                        if let Some(too_large) = refused.insufficient_capacity() {
                            observe::rate_limit_hit(too_large.dimension().as_str(), "local");
                        }
                        tracing::debug!(%refused, "request rejected locally");
                        this.state.set(State::Done);
                        return Poll::Ready(Err(refused.into()));
                    }
                    Poll::Pending => Poll::Pending,
                },
                StateProj::Readying { reservation } => {
                    let service = this.service.as_mut().expect("polled after completion");
                    match service.poll_ready(cx) {
                        Poll::Ready(Ok(())) => {
                            let mut reservation =
                                reservation.take().expect("polled after completion");
                            reservation.mark_sent();
                            let slot = ReservationSlot::new(reservation);
                            let mut request = this.request.take().expect("polled after completion");
                            request.extensions_mut().insert(slot.clone());
                            let future = service.call(request);
                            let waited = started.elapsed();
                            // Into the request's span, if an outer layer opened one.
                            tracing::Span::current()
                                .record("budget_wait_ms", waited.as_millis() as u64);
                            if let Some(priority) = *this.priority {
                                // The budget's ordering is where requests queue.
                                observe::queue_wait(priority, waited);
                            }
                            this.state.set(State::Calling {
                                future,
                                unclaimed: Unclaimed(slot),
                                waited,
                            });
                            continue;
                        }
                        Poll::Ready(Err(e)) => {
                            // Dropping the unsent reservation refunds it.
                            this.state.set(State::Done);
                            return Poll::Ready(Err(Error::from_inner(e)));
                        }
                        Poll::Pending => Poll::Pending,
                    }
                }
                StateProj::Calling { future, waited, .. } => {
                    let waited = *waited;
                    let output = ready!(future.poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(match output {
                        Ok(mut response) => {
                            let call = started.elapsed().saturating_sub(waited);
                            tracing::Span::current().record("call_ms", call.as_millis() as u64);
                            Timings::record_call(response.extensions_mut(), waited, call);
                            observe::call(this.labels, call);
                            Ok(response)
                        }
                        Err(e) => Err(Error::from_inner(e)),
                    });
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            };
            // Waiting for the budget or the inner service: give up at the deadline.
            if !this.deadline.as_mut().poll_expired(cx) {
                return waiting;
            }
            // Leaving the state leaves the budget's queue, or refunds the reservation.
            this.state.set(State::Done);
            let waited = started.elapsed();
            tracing::debug!(?waited, "deadline passed while waiting for the budget");
            observe::rate_limit_hit("deadline", "local");
            return Poll::Ready(Err(Error::deadline_exceeded(*this.priority, waited)));
        }
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Failed { .. } => "failed",
            State::Admitting { .. } => "admitting",
            State::Readying { .. } => "readying",
            State::Calling { .. } => "calling",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("priority", &self.priority)
            .finish()
    }
}
