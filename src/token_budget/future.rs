use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Request;
use pin_project_lite::pin_project;
use tower::Service;

use crate::budget::{Reservation, ReservationSlot, Reserve};
use crate::error::{BoxError, Error};

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
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Failed { error: Option<Error> },
        Admitting { #[pin] reserve: Reserve },
        Readying { reservation: Option<Reservation> },
        Calling { #[pin] future: F, unclaimed: Unclaimed },
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
    pub(crate) fn new(reserve: Reserve, service: S, request: Request<B>) -> Self {
        Self {
            state: State::Admitting { reserve },
            service: Some(service),
            request: Some(request),
        }
    }

    pub(crate) fn failed(error: Error) -> Self {
        Self {
            state: State::Failed { error: Some(error) },
            service: None,
            request: None,
        }
    }
}

impl<S, B> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    type Output = Result<S::Response, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Failed { error } => {
                    let error = error.take().expect("polled after completion");
                    this.state.set(State::Done);
                    return Poll::Ready(Err(error));
                }
                StateProj::Admitting { reserve } => match ready!(reserve.poll(cx)) {
                    Ok(reservation) => this.state.set(State::Readying {
                        reservation: Some(reservation),
                    }),
                    Err(too_large) => {
                        tracing::debug!(%too_large, "request rejected locally");
                        this.state.set(State::Done);
                        return Poll::Ready(Err(too_large.into()));
                    }
                },
                StateProj::Readying { reservation } => {
                    let service = this.service.as_mut().expect("polled after completion");
                    if let Err(e) = ready!(service.poll_ready(cx)) {
                        // Dropping the unsent reservation refunds it.
                        this.state.set(State::Done);
                        return Poll::Ready(Err(Error::from_inner(e)));
                    }
                    let mut reservation = reservation.take().expect("polled after completion");
                    reservation.mark_sent();
                    let slot = ReservationSlot::new(reservation);
                    let mut request = this.request.take().expect("polled after completion");
                    request.extensions_mut().insert(slot.clone());
                    let future = service.call(request);
                    this.state.set(State::Calling {
                        future,
                        unclaimed: Unclaimed(slot),
                    });
                }
                StateProj::Calling { future, .. } => {
                    let output = ready!(future.poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(output.map_err(Error::from_inner));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
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
            .finish()
    }
}
