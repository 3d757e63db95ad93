use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower::Service;

use super::engine::Key;
use super::shared::Shared;
use crate::error::{BoxError, Error};
use crate::priority::{Priority, Timings};
use crate::timer::DeadlineTimer;

pin_project! {
    /// The response future of [`PriorityQueue`](super::PriorityQueue): waits for its turn,
    /// then for the inner service.
    ///
    /// # Cancel safety
    ///
    /// Dropped while queued, it leaves the queue (its place, and its deadline timer, are gone;
    /// the next request is told to look). Dropped after its turn came, the inner future is
    /// dropped, which is cancel safe in this crate's layers.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S::Future>,
        queue: Option<Queued<S, B>>,
        // Set from the hand-over until the inner future's first poll.
        dispatching: Option<Arc<Shared>>,
        priority: Option<Priority>,
        enqueued_at: Option<Instant>,
        dispatched_at: Option<Instant>,
        #[pin]
        deadline: DeadlineTimer,
    }

    impl<S, B> PinnedDrop for ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(queued) = this.queue.take() {
                queued.shared.leave(queued.key);
            }
            // Only if the inner service panicked during the hand-over.
            if let Some(shared) = this.dispatching.take() {
                shared.end_dispatch();
            }
        }
    }
}

/// What a request holds while it waits for its turn.
struct Queued<S, B> {
    shared: Arc<Shared>,
    key: Key,
    service: S,
    request: Request<B>,
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Failed { error: Option<Error> },
        Queued,
        Calling { #[pin] future: F },
        Done,
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(crate) fn queued(
        shared: Arc<Shared>,
        key: Key,
        service: S,
        request: Request<B>,
        priority: Priority,
        enqueued_at: Instant,
        deadline: Instant,
    ) -> Self {
        Self {
            state: State::Queued,
            queue: Some(Queued {
                shared,
                key,
                service,
                request,
            }),
            dispatching: None,
            priority: Some(priority),
            enqueued_at: Some(enqueued_at),
            dispatched_at: None,
            deadline: DeadlineTimer::new(Some(deadline)),
        }
    }

    pub(crate) fn failed(error: Error) -> Self {
        Self {
            state: State::Failed { error: Some(error) },
            queue: None,
            dispatching: None,
            priority: None,
            enqueued_at: None,
            dispatched_at: None,
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
        loop {
            match this.state.as_mut().project() {
                StateProj::Failed { error } => {
                    let error = error.take().expect("polled after completion");
                    this.state.set(State::Done);
                    return Poll::Ready(Err(error));
                }
                StateProj::Queued => {
                    let queued = this.queue.as_mut().expect("polled after completion");
                    let error = match poll_turn(queued, cx) {
                        Turn::Go => {
                            let Queued {
                                shared,
                                mut service,
                                request,
                                key,
                                ..
                            } = this.queue.take().expect("polled after completion");
                            let now = Instant::now();
                            *this.dispatched_at = Some(now);
                            // Nobody else may go until the inner future had its first poll
                            // (entering the budget's queue, say): see `Calling`.
                            shared.lock().begin_dispatch(key, now);
                            *this.dispatching = Some(shared);
                            this.state.set(State::Calling {
                                future: service.call(request),
                            });
                            continue;
                        }
                        Turn::Fail(error) => error,
                        Turn::Wait => {
                            // Not our turn, or the inner service is not ready: wait, until
                            // the deadline.
                            if !this.deadline.as_mut().poll_expired(cx) {
                                return Poll::Pending;
                            }
                            let waited = this.enqueued_at.map(|at| at.elapsed());
                            tracing::debug!(priority = ?this.priority, ?waited, "deadline passed while queued");
                            Error::deadline_exceeded(*this.priority, waited.unwrap_or_default())
                        }
                    };
                    if let Some(queued) = this.queue.take() {
                        queued.shared.leave(queued.key);
                    }
                    this.state.set(State::Done);
                    return Poll::Ready(Err(error));
                }
                StateProj::Calling { future } => {
                    let output = future.poll(cx);
                    if let Some(shared) = this.dispatching.take() {
                        shared.end_dispatch();
                    }
                    let output = ready!(output);
                    this.state.set(State::Done);
                    return Poll::Ready(finish(
                        output,
                        *this.priority,
                        *this.enqueued_at,
                        *this.dispatched_at,
                    ));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

enum Turn {
    /// Our turn, and the inner service is ready.
    Go,
    /// Not yet.
    Wait,
    /// The inner service failed its readiness.
    Fail(Error),
}

/// Whether it is this request's turn, and the inner service is ready for it.
fn poll_turn<S, B>(queued: &mut Queued<S, B>, cx: &mut Context<'_>) -> Turn
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    let now = Instant::now();
    let mut engine = queued.shared.lock();
    engine.set_waker(queued.key, cx.waker());
    match engine.next(now) {
        Some(next) if next == queued.key => {}
        next => {
            // Someone else goes first. Aging may have made it first since the last event, so
            // make sure it looks.
            let wake = next.and_then(|_| engine.next_waker(now));
            drop(engine);
            if let Some(waker) = wake {
                if !waker.will_wake(cx.waker()) {
                    waker.wake();
                }
            }
            return Turn::Wait;
        }
    }
    drop(engine);
    match queued.service.poll_ready(cx) {
        Poll::Pending => Turn::Wait,
        Poll::Ready(Err(e)) => Turn::Fail(Error::from_inner(e)),
        Poll::Ready(Ok(())) => {
            // Still first? Another task may have queued ahead while we looked.
            let engine = queued.shared.lock();
            if engine.next(Instant::now()) == Some(queued.key) {
                Turn::Go
            } else {
                Turn::Wait
            }
        }
    }
}

/// Records the time queued, and tells deadline errors from inner layers for the whole wait.
fn finish<ResBody, E: Into<BoxError>>(
    output: Result<Response<ResBody>, E>,
    priority: Option<Priority>,
    enqueued_at: Option<Instant>,
    dispatched_at: Option<Instant>,
) -> Result<Response<ResBody>, Error> {
    match output {
        Ok(mut response) => {
            if let (Some(enqueued), Some(dispatched)) = (enqueued_at, dispatched_at) {
                let queued = dispatched.saturating_duration_since(enqueued);
                Timings::record_queued(response.extensions_mut(), queued);
            }
            Ok(response)
        }
        Err(e) => {
            let error = Error::from_inner(e);
            Err(match (priority, enqueued_at) {
                (Some(priority), Some(at)) => error.with_wait(priority, at.elapsed()),
                _ => error,
            })
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
            State::Queued => "queued",
            State::Calling { .. } => "calling",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("priority", &self.priority)
            .finish()
    }
}
