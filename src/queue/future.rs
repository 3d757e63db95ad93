use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower::Service;

use super::engine::Key;
use super::shared::Shared;
use crate::error::{BoxError, Error};
use crate::observe;
use crate::priority::{Priority, Timings};

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
        state: State<S, B, S::Future>,
    }

    impl<S, B> PinnedDrop for ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        fn drop(this: Pin<&mut Self>) {
            match this.project().state.project() {
                StateProj::Queued { shared, key, .. } => shared.leave(*key),
                // Only if the inner service panicked during the hand-over.
                StateProj::Calling { dispatching, .. } => {
                    if let Some(shared) = dispatching.take() {
                        shared.end_dispatch();
                    }
                }
                _ => {}
            }
        }
    }
}

pin_project! {
    // What a request holds while it waits shares its space with the inner future it becomes.
    #[project = StateProj]
    #[project_replace = StateReplace]
    enum State<S, B, F> {
        Failed { error: Option<Error> },
        Queued {
            shared: Arc<Shared>,
            key: Key,
            service: S,
            request: Request<B>,
            // When this attempt arrived (the key keeps a retried request's first enqueue time).
            arrived: Instant,
        },
        Calling {
            #[pin]
            future: F,
            // Set from the hand-over until the inner future's first poll.
            dispatching: Option<Arc<Shared>>,
            key: Key,
            arrived: Instant,
            queued: Duration,
        },
        Done,
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(crate) fn queued(shared: Arc<Shared>, key: Key, service: S, request: Request<B>) -> Self {
        Self {
            state: State::Queued {
                shared,
                key,
                service,
                request,
                arrived: Instant::now(),
            },
        }
    }

    pub(crate) fn failed(error: Error) -> Self {
        Self {
            state: State::Failed { error: Some(error) },
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
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Failed { error } => {
                    let error = error.take().expect("polled after completion");
                    state.set(State::Done);
                    return Poll::Ready(Err(error));
                }
                StateProj::Queued {
                    shared,
                    key,
                    service,
                    arrived,
                    ..
                } => {
                    let error = match poll_turn(shared, *key, service, cx) {
                        Turn::Go => {
                            let StateReplace::Queued {
                                shared,
                                key,
                                mut service,
                                request,
                                arrived,
                            } = state.as_mut().project_replace(State::Done)
                            else {
                                unreachable!("matched above")
                            };
                            // Nobody else may go until the inner future had its first poll
                            // (entering the budget's queue, say): see `Calling`. Should the
                            // inner service panic in `call`, the guard ends the hand-over.
                            let queued = arrived.elapsed();
                            tracing::debug!(
                                priority = key.priority().as_str(),
                                queued_ms = queued.as_millis() as u64,
                                "turn came"
                            );
                            observe::queue_wait(key.priority(), queued);
                            tracing::Span::current()
                                .record("queue_wait_ms", queued.as_millis() as u64);
                            let guard = Dispatching(Some(shared));
                            let future = service.call(request);
                            state.set(State::Calling {
                                future,
                                dispatching: guard.disarm(),
                                key,
                                arrived,
                                queued,
                            });
                            continue;
                        }
                        Turn::Fail(error) => error,
                        // Not our turn, or the inner service is not ready: wait, until the
                        // deadline.
                        Turn::Wait if shared.poll_deadline(*key, cx).is_pending() => {
                            return Poll::Pending;
                        }
                        Turn::Wait => {
                            let waited = arrived.elapsed();
                            let priority = key.priority();
                            tracing::debug!(%priority, ?waited, "deadline passed while queued");
                            observe::rate_limit_hit("deadline", "local");
                            Error::deadline_exceeded(Some(priority), waited)
                        }
                    };
                    shared.leave(*key);
                    state.set(State::Done);
                    return Poll::Ready(Err(error));
                }
                StateProj::Calling {
                    future,
                    dispatching,
                    key,
                    arrived,
                    queued,
                } => {
                    let output = future.poll(cx);
                    if let Some(shared) = dispatching.take() {
                        shared.end_dispatch();
                    }
                    let output = ready!(output);
                    let (priority, arrived, queued) = (key.priority(), *arrived, *queued);
                    state.set(State::Done);
                    return Poll::Ready(finish(output, priority, arrived, queued));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// Ends a hand-over if dropped before it is disarmed.
struct Dispatching(Option<Arc<Shared>>);

impl Dispatching {
    fn disarm(mut self) -> Option<Arc<Shared>> {
        self.0.take()
    }
}

impl Drop for Dispatching {
    fn drop(&mut self) {
        if let Some(shared) = self.0.take() {
            shared.end_dispatch();
        }
    }
}

enum Turn {
    /// Our turn, and the inner service is ready: the hand-over has begun.
    Go,
    /// Not yet.
    Wait,
    /// The inner service failed its readiness.
    Fail(Error),
}

/// Whether it is this request's turn and the inner service is ready for it; if so, begins the
/// hand-over.
fn poll_turn<S, B>(shared: &Shared, key: Key, service: &mut S, cx: &mut Context<'_>) -> Turn
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    let now = Instant::now();
    let mut state = shared.lock();
    state.engine.set_waker(key, cx.waker());
    match state.engine.next(now) {
        Some(next) if next == key => {}
        next => {
            // Someone else goes first. Aging may have made it first since the last event, so
            // make sure it looks.
            let wake = next.and_then(|_| state.engine.next_waker(now));
            drop(state);
            if let Some(waker) = wake {
                if !waker.will_wake(cx.waker()) {
                    waker.wake();
                }
            }
            return Turn::Wait;
        }
    }
    drop(state);
    match service.poll_ready(cx) {
        Poll::Pending => Turn::Wait,
        Poll::Ready(Err(e)) => Turn::Fail(Error::from_inner(e)),
        // Still first? Another task may have queued ahead while we looked; the check and the
        // start of the hand-over happen under one lock.
        Poll::Ready(Ok(())) if shared.begin_dispatch(key) => Turn::Go,
        Poll::Ready(Ok(())) => Turn::Wait,
    }
}

/// Records the time queued, and tells deadline errors from inner layers for the whole wait.
fn finish<ResBody, E: Into<BoxError>>(
    output: Result<Response<ResBody>, E>,
    priority: Priority,
    arrived: Instant,
    queued: Duration,
) -> Result<Response<ResBody>, Error> {
    match output {
        Ok(mut response) => {
            Timings::record_queued(response.extensions_mut(), queued);
            Ok(response)
        }
        Err(e) => Err(Error::from_inner(e).with_wait(priority, arrived.elapsed())),
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Failed { .. } => "failed",
            State::Queued { .. } => "queued",
            State::Calling { .. } => "calling",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
