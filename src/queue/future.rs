//! The response future of [`PriorityQueue`](super::PriorityQueue): wait in the queue's own
//! ordering while the inner service is not ready, then call it.
//!
//! # Length
//!
//! One state machine (waiting, readying, calling) whose cancellation paths give back a place
//! in the ordering and a readiness taken but unused; its ordering is the pure `sched` module.

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

use super::inner::Inner;
use crate::error::{BoxError, Error};
use crate::observe;
use crate::priority::{Priority, Timings};
use crate::sched::Scheduling;
use crate::sched::order::{Full, Place};

pin_project! {
    /// The response future of [`PriorityQueue`](super::PriorityQueue): waits for its turn and
    /// the inner service's readiness, then for the inner service.
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
            if let StateProj::Waiting { wait } = this.project().state.project() {
                if let Some(place) = wait.place {
                    wait.queue.leave(place);
                }
            }
        }
    }
}

pin_project! {
    // What a request holds while it waits shares its space with the inner future it becomes.
    #[project = StateProj]
    #[project_replace = StateReplace]
    enum State<S, B, F> {
        // Boxed: only a request that could not be handed over at once pays for its space.
        Waiting { wait: Box<Wait<S, B>> },
        Calling {
            #[pin]
            future: F,
            priority: Priority,
            arrived: Instant,
            queued: Duration,
        },
        Done,
    }
}

/// A request waiting for its turn or for the inner service. Its placement (the queue's
/// configuration for its class) is stamped into the request only when it is handed over.
struct Wait<S, B> {
    queue: Arc<Inner>,
    // Its place in the queue's own ordering, once it had to wait there.
    place: Option<Place>,
    priority: Priority,
    // When the logical request first entered an ordering (kept across retries).
    enqueued_at: Instant,
    /// Not admitted before (a retry waiting out `Retry-After`, in a budget inside).
    not_before: Option<Instant>,
    /// When it gives up (none: it waits as long as it takes), and whether its caller set it.
    deadline: (Option<Instant>, bool),
    service: S,
    // `service` was asked its readiness and answered not yet: it may hold a place in the
    // inner service's own waiting list (a semaphore's), which it gives up if it stops being
    // the head.
    asked: bool,
    request: Request<B>,
    // When this attempt arrived (a retried request keeps its first enqueue time).
    arrived: Instant,
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    /// A request handed over at once: nobody waited and the inner service was ready.
    pub(crate) fn calling(future: S::Future, priority: Priority, arrived: Instant) -> Self {
        Self {
            state: State::Calling {
                future,
                priority,
                arrived,
                queued: Duration::ZERO,
            },
        }
    }

    pub(crate) fn new(
        queue: Arc<Inner>,
        (priority, enqueued_at, not_before): (Priority, Instant, Option<Instant>),
        deadline: (Option<Instant>, bool),
        service: S,
        request: Request<B>,
    ) -> Self {
        Self {
            state: State::Waiting {
                wait: Box::new(Wait {
                    queue,
                    place: None,
                    priority,
                    enqueued_at,
                    not_before,
                    deadline,
                    service,
                    asked: false,
                    request,
                    arrived: Instant::now(),
                }),
            },
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
{
    type Output = Result<S::Response, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Waiting { wait } => {
                    let Wait {
                        queue,
                        place,
                        priority,
                        enqueued_at,
                        not_before,
                        deadline,
                        service,
                        asked,
                        arrived,
                        ..
                    } = &mut **wait;
                    let placed = (*enqueued_at, *not_before);
                    let scheduling = queue.config.placed(*priority, placed, *deadline);
                    let error = match poll_turn(
                        queue,
                        place,
                        &scheduling,
                        deadline.0,
                        (service, asked),
                        cx,
                    ) {
                        Turn::Go => {
                            let StateReplace::Waiting { wait } =
                                state.as_mut().project_replace(State::Done)
                            else {
                                unreachable!("matched above")
                            };
                            let Wait {
                                queue,
                                place,
                                priority,
                                mut service,
                                mut request,
                                arrived,
                                ..
                            } = *wait;
                            // Inner layers follow the placement: a budget orders its waiters by
                            // it, and gives up waiting at its deadline.
                            request.extensions_mut().insert(scheduling);
                            if let Some(link) = queue.link() {
                                request.extensions_mut().insert(link);
                            }
                            let queued = arrived.elapsed();
                            observe::span_record("queue_wait_ms", queued.as_millis() as u64);
                            if let Some(place) = place {
                                // Handed over: the next in line may look.
                                queue.leave(place);
                                tracing::debug!(
                                    priority = priority.as_str(),
                                    queued_ms = queued.as_millis() as u64,
                                    "turn came"
                                );
                                observe::queue_wait(priority, queued);
                            }
                            let future = service.call(request);
                            state.set(State::Calling {
                                future,
                                priority,
                                arrived,
                                queued,
                            });
                            continue;
                        }
                        Turn::Fail(error) => error,
                        // Not our turn, or the inner service is not ready: wait, until the
                        // deadline.
                        Turn::Wait
                            if place.is_some_and(|place| {
                                queue.poll_deadline(place, cx).is_pending()
                            }) =>
                        {
                            return Poll::Pending;
                        }
                        Turn::Wait => {
                            let waited = arrived.elapsed();
                            let priority = *priority;
                            tracing::debug!(%priority, ?waited, "deadline passed while queued");
                            observe::rate_limit_hit("deadline", "local");
                            Error::deadline_exceeded(Some(priority), waited)
                        }
                    };
                    if let Some(place) = place.take() {
                        queue.leave(place);
                    }
                    state.set(State::Done);
                    return Poll::Ready(Err(error));
                }
                StateProj::Calling {
                    future,
                    priority,
                    arrived,
                    queued,
                } => {
                    let output = ready!(future.poll(cx));
                    let (priority, arrived, queued) = (*priority, *arrived, *queued);
                    state.set(State::Done);
                    return Poll::Ready(finish(output, priority, arrived, queued));
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
    /// The inner service failed its readiness, or the queue is full.
    Fail(Error),
}

/// Whether it is this request's turn and the inner service is ready for it. A request finding
/// the queue empty asks the inner service at once and queues only if it is not ready.
fn poll_turn<S, B>(
    shared: &Inner,
    place: &mut Option<Place>,
    scheduling: &Scheduling,
    deadline: Option<Instant>,
    (service, asked): (&mut S, &mut bool),
    cx: &mut Context<'_>,
) -> Turn
where
    S: Service<Request<B>> + Clone,
    S::Error: Into<BoxError>,
{
    let now = Instant::now();
    let mut state = shared.lock();
    let mine = match *place {
        Some(mine) => mine,
        None if state.order.is_empty() => {
            // Nobody waits here: the inner service decides (under a budget, it is always
            // ready and the budget's ordering takes over).
            drop(state);
            return match service.poll_ready(cx) {
                Poll::Ready(Ok(())) => Turn::Go,
                Poll::Ready(Err(e)) => Turn::Fail(Error::from_inner(e)),
                Poll::Pending => {
                    *asked = true;
                    join(shared, place, scheduling, deadline, cx)
                }
            };
        }
        None => match state.order.push(scheduling, deadline, ()) {
            Ok(mine) => {
                shared.count(&state);
                *place.insert(mine)
            }
            Err(Full(depth)) => return Turn::Fail(shed(scheduling, depth)),
        },
    };
    state.order.set_waker(mine, cx.waker());
    if state.order.top(now) != Some(mine) {
        // Someone else goes first. Aging may have made it first since the last event, so
        // make sure it looks.
        let wake = state.order.top_waker(now);
        drop(state);
        if std::mem::take(asked) {
            // No longer the head: give up any place in the inner service's own waiting list,
            // which belongs to the head now.
            *service = service.clone();
        }
        if let Some(waker) = wake.filter(|w| !w.will_wake(cx.waker())) {
            waker.wake();
        }
        return Turn::Wait;
    }
    drop(state);
    match service.poll_ready(cx) {
        Poll::Pending => {
            *asked = true;
            Turn::Wait
        }
        Poll::Ready(Err(e)) => Turn::Fail(Error::from_inner(e)),
        Poll::Ready(Ok(())) => Turn::Go,
    }
}

/// Joins the queue's ordering after the inner service was found not ready.
fn join(
    shared: &Inner,
    place: &mut Option<Place>,
    scheduling: &Scheduling,
    deadline: Option<Instant>,
    cx: &mut Context<'_>,
) -> Turn {
    let mut state = shared.lock();
    match state.order.push(scheduling, deadline, ()) {
        Ok(mine) => {
            shared.count(&state);
            state.order.set_waker(mine, cx.waker());
            *place = Some(mine);
            Turn::Wait
        }
        Err(Full(depth)) => Turn::Fail(shed(scheduling, depth)),
    }
}

fn shed(scheduling: &Scheduling, depth: usize) -> Error {
    let priority = scheduling.priority;
    tracing::debug!(%priority, depth, "queue full, request shed");
    observe::rate_limit_hit("queue_full", "local");
    Error::queue_full(priority, depth)
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
            State::Waiting { wait } if wait.place.is_none() => "arriving",
            State::Waiting { .. } => "queued",
            State::Calling { .. } => "calling",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
