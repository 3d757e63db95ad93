use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower::Service;

use crate::budget::{Reservation, ReservationSlot, Reserve};
use crate::error::{BoxError, Error, ReserveError};
use crate::observe::{self, Labels};
use crate::pricing::Priced;
use crate::priority::{Priority, Timings};
use crate::timer::DeadlineTimer;

pin_project! {
    /// The response future of [`TokenBudget`](super::TokenBudget): waits for the budget, then
    /// for the inner service's readiness, then for its response.
    ///
    /// # Cancel safety
    ///
    /// Dropped while waiting for the budget, it leaves the ordering; after admission but
    /// before the call, its reservation is refunded; during the call, the reservation is
    /// charged its estimate unless an inner layer took it to settle.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B, S::Future>,
        priority: Option<Priority>,
        labels: Labels,
        started: Instant,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B, F> {
        Failed { error: Option<Error> },
        // Boxed: only a request that must wait pays for the space of its wait.
        Waiting { wait: Box<Wait<S, B>> },
        Calling {
            #[pin] future: F,
            unclaimed: Unclaimed,
            waited: Duration,
            // The request's prices, handed to its response.
            priced: Option<Priced>,
        },
        Done,
    }
}

/// A request waiting for the budget (`reserve`), then for the inner service's readiness
/// (`reservation`), until its deadline.
struct Wait<S, B> {
    reserve: Option<Pin<Box<Reserve>>>,
    reservation: Option<Reservation>,
    service: S,
    request: Option<Request<B>>,
    deadline: DeadlineTimer,
}

/// Takes back a reservation no inner layer claimed when the call ends or is dropped, so it is
/// charged then rather than whenever the request's extensions are dropped.
struct Unclaimed(ReservationSlot);

impl Drop for Unclaimed {
    fn drop(&mut self) {
        drop(self.0.take());
    }
}

/// Sends `request` on `service` (ready for it) with `reservation` in its extensions, marked
/// sent; the reservation comes back to the future when the call ends, unless an inner layer
/// took it. Priced by the estimation layer, the reservation settles the real usage at the
/// request's prices, which are handed back for its response.
fn send<S, B>(
    service: &mut S,
    mut request: Request<B>,
    mut reservation: Reservation,
) -> (S::Future, Unclaimed, Option<Priced>)
where
    S: Service<Request<B>>,
{
    reservation.mark_sent();
    let priced = request.extensions().get::<Priced>().cloned();
    if let Some(priced) = &priced {
        reservation.set_priced(priced.clone());
    }
    let slot = ReservationSlot::new(reservation);
    request.extensions_mut().insert(slot.clone());
    (service.call(request), Unclaimed(slot), priced)
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    /// A request admitted at once and sent on `service`, which was ready.
    pub(crate) fn sent(
        service: &mut S,
        request: Request<B>,
        reservation: Reservation,
        priority: Option<Priority>,
        labels: Labels,
        started: Instant,
    ) -> Self {
        observe::reserved(&labels, &reservation.cost());
        if let Some(priority) = priority {
            observe::queue_wait(priority, Duration::ZERO);
        }
        observe::span_record("budget_wait_ms", 0);
        let (future, unclaimed, priced) = send(service, request, reservation);
        Self {
            state: State::Calling {
                future,
                unclaimed,
                waited: Duration::ZERO,
                priced,
            },
            priority,
            labels,
            started,
        }
    }

    /// A request that waits: for the budget (`admitted` is `Err`), or only for the inner
    /// service's readiness.
    pub(crate) fn waiting(
        admitted: Result<Reservation, Reserve>,
        service: S,
        request: Request<B>,
        priority: Option<Priority>,
        deadline: Option<Instant>,
        labels: Labels,
        started: Instant,
    ) -> Self {
        let (reserve, reservation) = match admitted {
            Ok(reservation) => {
                observe::reserved(&labels, &reservation.cost());
                (None, Some(reservation))
            }
            Err(reserve) => (Some(Box::pin(reserve)), None),
        };
        Self {
            state: State::Waiting {
                wait: Box::new(Wait {
                    reserve,
                    reservation,
                    service,
                    request: Some(request),
                    deadline: DeadlineTimer::new(deadline),
                }),
            },
            priority,
            labels,
            started,
        }
    }

    pub(crate) fn failed(error: Error) -> Self {
        Self {
            state: State::Failed { error: Some(error) },
            priority: None,
            labels: Labels::default(),
            started: Instant::now(),
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
        let started = *this.started;
        loop {
            match this.state.as_mut().project() {
                StateProj::Failed { error } => {
                    let error = error.take().expect("polled after completion");
                    this.state.set(State::Done);
                    return Poll::Ready(Err(error));
                }
                StateProj::Waiting { wait } => {
                    match poll_wait(wait, this.labels, cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(error)) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(error));
                        }
                        // Waiting for the budget or the inner service: give up at the deadline.
                        Poll::Pending if !wait.deadline.poll_expired(cx) => return Poll::Pending,
                        Poll::Pending => {
                            // Leaving the state leaves the budget's ordering, or refunds the
                            // reservation.
                            this.state.set(State::Done);
                            return Poll::Ready(Err(deadline_passed(*this.priority, started)));
                        }
                    }
                    // Admitted, and the inner service is ready.
                    let reservation = wait.reservation.take().expect("admitted");
                    let request = wait.request.take().expect("polled after completion");
                    let (future, unclaimed, priced) = send(&mut wait.service, request, reservation);
                    let waited = started.elapsed();
                    record_wait(*this.priority, waited);
                    this.state.set(State::Calling {
                        future,
                        unclaimed,
                        waited,
                        priced,
                    });
                }
                StateProj::Calling {
                    future,
                    waited,
                    priced,
                    ..
                } => {
                    let waited = *waited;
                    let output = ready!(future.poll(cx));
                    let priced = priced.take();
                    this.state.set(State::Done);
                    return Poll::Ready(match output {
                        Ok(mut response) => {
                            let call = started.elapsed().saturating_sub(waited);
                            record_call(response.extensions_mut(), this.labels, waited, call);
                            if let Some(priced) = priced {
                                response.extensions_mut().insert(priced);
                            }
                            Ok(response)
                        }
                        Err(e) => Err(Error::from_inner(e)),
                    });
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// The error of a request whose deadline passed while it waited for the budget.
fn deadline_passed(priority: Option<Priority>, started: Instant) -> Error {
    let waited = started.elapsed();
    tracing::debug!(?waited, "deadline passed while waiting for the budget");
    observe::rate_limit_hit("deadline", "local");
    Error::deadline_exceeded(priority, waited)
}

/// Records the wait of a request admitted and sent: into the request's span (if an outer layer
/// opened one), and as a queue wait when it has a class (the budget's ordering is where
/// requests queue).
fn record_wait(priority: Option<Priority>, waited: Duration) {
    observe::span_record("budget_wait_ms", waited.as_millis() as u64);
    if let Some(priority) = priority {
        observe::queue_wait(priority, waited);
    }
}

/// Records a call's duration: in the span, the response's [`Timings`] and the metrics.
fn record_call(
    extensions: &mut http::Extensions,
    labels: &Labels,
    waited: Duration,
    call: Duration,
) {
    observe::span_record("call_ms", call.as_millis() as u64);
    Timings::record_call(extensions, waited, call);
    observe::call(labels, call);
}

/// Waits for the budget, then for the inner service's readiness: ready once both are there.
fn poll_wait<S, B>(
    wait: &mut Wait<S, B>,
    labels: &Labels,
    cx: &mut Context<'_>,
) -> Poll<Result<(), Error>>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    if let Some(reserve) = wait.reserve.as_mut() {
        match ready!(reserve.as_mut().poll(cx)) {
            Ok(reservation) => {
                observe::reserved(labels, &reservation.cost());
                tracing::trace!(cost = ?reservation.cost(), "admitted by the budget");
                wait.reserve = None;
                wait.reservation = Some(reservation);
            }
            Err(refused) => {
                if let Some(too_large) = refused.insufficient_capacity() {
                    observe::rate_limit_hit(too_large.dimension().as_str(), "local");
                }
                if let ReserveError::DeadlineUnmet { .. } = refused {
                    observe::rate_limit_hit("deadline", "local");
                }
                tracing::debug!(%refused, "request rejected locally");
                return Poll::Ready(Err(refused.into()));
            }
        }
    }
    // Dropping the unsent reservation (on an error or a deadline) refunds it.
    wait.service.poll_ready(cx).map_err(Error::from_inner)
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Failed { .. } => "failed",
            State::Waiting { wait } if wait.reserve.is_some() => "admitting",
            State::Waiting { .. } => "readying",
            State::Calling { .. } => "calling",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("priority", &self.priority)
            .finish()
    }
}
