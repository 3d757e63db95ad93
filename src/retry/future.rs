//! The response future of [`RetryAfter`](super::RetryAfter): one request's attempts, waits and
//! final report.
//!
//! # Length
//!
//! One `pin_project` state machine (calling, reading an error body, waiting to retry, done) in
//! one loop, as tower's retry future is: its transitions share the attempt's template, report
//! and span, and read best as one table. The pure parts live elsewhere: classification in
//! `classify.rs`, wait hints in `hints.rs`, the backoff arithmetic in `policy.rs`.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::response::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::combinators::Collect;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep, sleep};
use tower::Service;
use tower::retry::budget::{Budget as _, TpsBudget};

use super::settings::Settings;
use super::{
    Classify, Failure, FailureClass, GaveUp, Permanent, RetryBody, RetryReport, TierUnavailable,
};
use crate::cost::Cost;
use crate::error::{BoxError, Error};
use crate::priority::{Deadline, EnqueuedAt, NotBefore, Priority, Timings};
use crate::provider::hints;
use crate::provider::{RateLimitError, Scope};
use crate::timer::saturating_deadline;

/// Error bodies larger than this are not read: the failure is classified by its status and
/// headers, with an empty body.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

pin_project! {
    #[project = FutureProj]
    /// The response future of [`RetryAfter`](super::RetryAfter).
    ///
    /// # Cancel safety
    ///
    /// Dropping it drops the attempt in flight (cancel safe in this crate's layers) or the wait
    /// between attempts; nothing is left behind.
    pub struct ResponseFuture<S, B, ResBody, C>
    where
        S: Service<Request<B>>,
        ResBody: Body,
        ResBody::Error: Into<BoxError>,
    {
        #[pin]
        state: State<S::Future, ResBody>,
        service: S,
        template: Request<B>,
        settings: Arc<Settings<C>>,
        priority: Priority,
        deadline: Option<Instant>,
        // The request's own bound on its attempts (`MaxAttempts`), if any.
        max_attempts: Option<u32>,
        started: Instant,
        // When the first failed attempt was sent: the class's total time counts from there,
        // not from the first wait in the queue.
        first_sent: Option<Instant>,
        // Whether this request earned its retries yet: when its first attempt ends, so that
        // the retry budget follows the traffic the provider sees, not arrivals in the queue.
        deposited: bool,
        // A budget's ordering answered the last attempt: the next waits out its delay there,
        // in its first attempt's place (`NotBefore`), rather than here.
        ordered: bool,
        not_before: Option<Instant>,
        // The provider's last 429 (its head and body), while its retry is under way: a retry
        // the budget refuses ends with it, the provider's answer, not with a local error.
        refused: Option<Box<(http::response::Builder, Bytes)>>,
        report: RetryReport,
        // The request's span: the inner layers record their facts into it.
        span: tracing::Span,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, ResBody>
    where
        ResBody: Body,
        ResBody::Error: Into<BoxError>,
    {
        Calling { #[pin] future: F },
        // An error response whose body is read to classify it.
        Reading { #[pin] collect: Collect<Limited<ResBody>>, head: Option<Parts> },
        Waiting { #[pin] sleep: Sleep },
        Readying,
        Done,
    }
}

/// After a failed attempt: wait, then try again; or finish with this.
enum After<T> {
    Wait(Duration),
    Finish(T),
}

/// What to do after a failed attempt.
enum Next {
    Retry(Duration),
    GiveUp(GaveUp),
}

impl<S, B, ResBody, C> ResponseFuture<S, B, ResBody, C>
where
    S: Service<Request<B>>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    pub(crate) fn new(
        first: S::Future,
        service: S,
        template: Request<B>,
        settings: Arc<Settings<C>>,
        span: tracing::Span,
    ) -> Self {
        let priority = template
            .extensions()
            .get::<Priority>()
            .copied()
            .unwrap_or(Priority::Async);
        let deadline = template
            .extensions()
            .get::<Deadline>()
            .map(Deadline::instant);
        let max_attempts = template
            .extensions()
            .get::<super::MaxAttempts>()
            .map(|m| m.0.get());
        Self {
            state: State::Calling { future: first },
            service,
            template,
            settings,
            priority,
            deadline,
            max_attempts,
            started: Instant::now(),
            first_sent: None,
            deposited: false,
            ordered: false,
            not_before: None,
            refused: None,
            span,
            report: RetryReport {
                attempts: 1,
                waited: Duration::ZERO,
                last_status: None,
                last_class: None,
                gave_up: None,
                asked_wait: None,
            },
        }
    }
}

impl<S, B, ResBody, C> Future for ResponseFuture<S, B, ResBody, C>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Clone,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
    C: Classify,
{
    type Output = Result<Response<RetryBody<ResBody>>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let span = this.span.clone();
        let _entered = span.enter();
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Calling { future } => match deposit_once(
                    ready!(future.poll(cx)),
                    this.deposited,
                    &this.settings.budget,
                ) {
                    Ok(response) if !is_failure(&response) => {
                        // Handed to the caller: once its body starts, nothing is retried.
                        this.state.set(State::Done);
                        this.span.record("decision", "ok");
                        let mut response = response.map(RetryBody::streaming);
                        if this.report.attempts > 1 {
                            response.extensions_mut().insert(*this.report);
                        }
                        return Poll::Ready(Ok(response));
                    }
                    Ok(response) => {
                        let (head, body) = response.into_parts();
                        let readable = body
                            .size_hint()
                            .upper()
                            .is_none_or(|n| n <= ERROR_BODY_LIMIT as u64);
                        if readable {
                            this.state.set(State::Reading {
                                collect: Limited::new(body, ERROR_BODY_LIMIT).collect(),
                                head: Some(head),
                            });
                            continue;
                        }
                        drop(body);
                        match respond_or_retry(&mut this, head, Bytes::new()) {
                            After::Wait(wait) => wait,
                            After::Finish(response) => return Poll::Ready(Ok(response)),
                        }
                    }
                    Err(error) => match error_or_retry(&mut this, error.into(), true) {
                        After::Wait(wait) => wait,
                        After::Finish(result) => return Poll::Ready(result),
                    },
                },
                StateProj::Reading { collect, head } => {
                    let collected = ready!(collect.poll(cx));
                    let head = head.take().expect("polled after completion");
                    match collected {
                        Ok(collected) => {
                            match respond_or_retry(&mut this, head, collected.to_bytes()) {
                                After::Wait(wait) => wait,
                                After::Finish(response) => return Poll::Ready(Ok(response)),
                            }
                        }
                        // Larger than the limit: classified by its status, with an empty body.
                        Err(error) if error.is::<LengthLimitError>() => {
                            match respond_or_retry(&mut this, head, Bytes::new()) {
                                After::Wait(wait) => wait,
                                After::Finish(response) => return Poll::Ready(Ok(response)),
                            }
                        }
                        // The error body itself failed (cut, or larger than it said).
                        Err(error) => match error_or_retry(&mut this, error, false) {
                            After::Wait(wait) => wait,
                            After::Finish(result) => return Poll::Ready(result),
                        },
                    }
                }
                StateProj::Waiting { sleep } => {
                    ready!(sleep.poll(cx));
                    this.state.set(State::Readying);
                    continue;
                }
                StateProj::Readying => {
                    if let Err(error) = ready!(this.service.poll_ready(cx)) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(Error::from_inner(error)));
                    }
                    let mut request = this.template.clone();
                    // Queue again, keeping the first attempt's place for aging.
                    request
                        .extensions_mut()
                        .insert(EnqueuedAt::at(*this.started));
                    if let Some(at) = this.not_before.take() {
                        request.extensions_mut().insert(NotBefore::at(at));
                    }
                    this.report.attempts += 1;
                    this.span.record("attempt", this.report.attempts);
                    tracing::debug!(attempt = this.report.attempts, "retrying");
                    this.state.set(State::Calling {
                        future: this.service.call(request),
                    });
                    continue;
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            };
            this.report.waited += next;
            if *this.ordered {
                // The budget's ordering holds its place meanwhile.
                *this.not_before = Some(saturating_deadline(Instant::now(), next));
                this.state.set(State::Readying);
            } else {
                this.state.set(State::Waiting { sleep: sleep(next) });
            }
        }
    }
}

/// A failed response: retry after a wait, or give it to the caller with the report.
fn respond_or_retry<S, B, ResBody, C>(
    this: &mut FutureProj<'_, S, B, ResBody, C>,
    head: Parts,
    body: Bytes,
) -> After<Response<RetryBody<ResBody>>>
where
    S: Service<Request<B>>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
    C: Classify,
{
    let failure = Failure::Response {
        status: head.status,
        headers: &head.headers,
        body: &body,
    };
    let class = this.settings.classify.classify(&failure);
    *this.ordered = (head.extensions.get::<Timings>()).is_some_and(|t| t.ordered);
    if head.status == http::StatusCode::TOO_MANY_REQUESTS {
        tracing::debug!(?class, "provider rate limit (429)");
    }
    if this.first_sent.is_none() {
        let call = head
            .extensions
            .get::<Timings>()
            .map_or(Duration::ZERO, Timings::call);
        let now = Instant::now();
        *this.first_sent = Some(now.checked_sub(call).unwrap_or(now));
    }
    let now = SystemTime::now();
    let hint = hints::provider_wait(&head.headers, &body, now);
    if class == FailureClass::Transient(super::Transient::RateLimited) {
        if let Some(budget) = &this.settings.pause {
            let cost = this.template.extensions().get::<Cost>();
            let (dimensions, pause) = hints::spent(&head.headers, &body, hint, cost, now);
            if let Some(pause) = pause {
                // Never longer than the longest wait honoured: a daily quota's 86,400 s is
                // not retried, and does not stop the budget for a day either.
                let pause = pause.min(this.settings.policy.max_honored());
                tracing::debug!(?dimensions, ?pause, "provider rate limit: budget paused");
                budget.pause(
                    &dimensions,
                    crate::timer::saturating_deadline(Instant::now(), pause),
                );
            }
        }
    }
    this.report.last_status = Some(head.status);
    #[cfg(feature = "metrics")]
    if head.status == http::StatusCode::TOO_MANY_REQUESTS {
        crate::observe::rate_limit_hit(
            crate::provider::limit_type(&head.headers, &body),
            "provider",
        );
    }
    match next(this, class, hint) {
        Next::Retry(wait) => {
            *this.refused = (head.status == http::StatusCode::TOO_MANY_REQUESTS)
                .then(|| Box::new((copy_head(&head), body)));
            After::Wait(wait)
        }
        Next::GiveUp(reason) => {
            let response = Response::from_parts(head, RetryBody::buffered(body.clone()));
            After::Finish(give_up_with(this, response, &body, reason))
        }
    }
}

/// A response's status, version and headers, to build it again.
fn copy_head(head: &Parts) -> http::response::Builder {
    let mut builder = Response::builder()
        .status(head.status)
        .version(head.version);
    if let Some(headers) = builder.headers_mut() {
        headers.clone_from(&head.headers);
    }
    builder
}

/// The failed `response` (of `body`) handed to the caller as the final answer, `reason` in
/// its report.
fn give_up_with<S, B, ResBody, C>(
    this: &mut FutureProj<'_, S, B, ResBody, C>,
    mut response: Response<RetryBody<ResBody>>,
    body: &Bytes,
    reason: GaveUp,
) -> Response<RetryBody<ResBody>>
where
    S: Service<Request<B>>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    this.report.gave_up = Some(reason);
    this.state.set(State::Done);
    let decision = if response.status() == http::StatusCode::TOO_MANY_REQUESTS {
        "provider"
    } else {
        "failed"
    };
    this.span.record("decision", decision);
    response.extensions_mut().insert(*this.report);
    if let Some(scope) = this.template.extensions().get::<Scope>() {
        response.extensions_mut().insert(scope.clone());
    }
    // A final 429 also carries its normalized description.
    if let Some(rate_limit) = RateLimitError::from_response(&response, body) {
        let exhausted = reason == GaveUp::WaitTooLong;
        response
            .extensions_mut()
            .insert(rate_limit.exhausted(exhausted));
    }
    response
}

/// A failed attempt without a response: retry after a wait, or fail. A retry after a
/// provider 429 that the budget refuses (it learnt from that answer, say, that the request
/// cannot pass now) ends with that 429: the provider's answer, not a local error.
fn error_or_retry<S, B, ResBody, C>(
    this: &mut FutureProj<'_, S, B, ResBody, C>,
    error: BoxError,
    before_head: bool,
) -> After<Result<Response<RetryBody<ResBody>>, Error>>
where
    S: Service<Request<B>>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
    C: Classify,
{
    let mut class = this.settings.classify.classify(&Failure::Error(&*error));
    if before_head {
        // Sent but unanswered: retried only when a retry cannot bill twice.
        let has_key = super::ambiguity::has_key(this.template);
        class = super::ambiguity::gate(class, &*error, has_key);
    }
    this.report.last_status = None;
    if this.first_sent.is_none() {
        *this.first_sent = Some(Instant::now());
    }
    let refused = this.refused.take();
    match next(this, class, None) {
        Next::Retry(wait) => After::Wait(wait),
        Next::GiveUp(reason) => {
            let local = class == FailureClass::Permanent(Permanent::Local);
            if let Some((head, body)) = refused.filter(|_| local).map(|refused| *refused) {
                tracing::debug!(%error, "retry refused by the budget: the provider's 429 stands");
                if let Ok(response) = head.body(RetryBody::buffered(body.clone())) {
                    this.report.last_status = Some(response.status());
                    return After::Finish(Ok(give_up_with(this, response, &body, reason)));
                }
            }
            this.state.set(State::Done);
            this.span
                .record("decision", if local { "local" } else { "failed" });
            // A first failure that is not worth a retry is the inner error, unchanged.
            if this.report.attempts == 1 && reason == GaveUp::Permanent {
                return After::Finish(Err(Error::from_inner(error)));
            }
            this.report.gave_up = Some(reason);
            After::Finish(Err(Error::gave_up(*this.report, error)))
        }
    }
}

/// The retry decision: the class, then the provider's wait, the class's limits, the deadline
/// and the retry budget, in that order.
///
/// A rate-limited async or batch request is not lost to the attempt count or the retry
/// budget: its retry re-enters admission, which the 429 paused and which spaces it, so it
/// waits for budget bounded only by its deadline and its class's total time. Interactive
/// requests keep every limit.
fn next<S, B, ResBody, C>(
    this: &mut FutureProj<'_, S, B, ResBody, C>,
    class: FailureClass,
    hint: Option<Duration>,
) -> Next
where
    S: Service<Request<B>>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    let policy = &this.settings.policy;
    this.report.last_class = Some(class);
    this.report.asked_wait = hint;
    if let FailureClass::Permanent(_) = class {
        return Next::GiveUp(GaveUp::Permanent);
    }
    let tier_unavailable = class == FailureClass::Transient(super::Transient::TierUnavailable);
    if tier_unavailable && policy.tier_unavailable(*this.priority) == TierUnavailable::GiveUp {
        return Next::GiveUp(GaveUp::TierUnavailable);
    }
    if hint.is_some_and(|hint| !policy.honors(hint)) {
        this.report.last_class = Some(FailureClass::Permanent(Permanent::WaitTooLong));
        return Next::GiveUp(GaveUp::WaitTooLong);
    }
    // A rate-limited request waits for its budget, and one whose tier lacks capacity waits
    // for it, within their time: their attempt count does not bound them.
    let waits_for_budget = (class == FailureClass::Transient(super::Transient::RateLimited)
        && *this.priority != Priority::Interactive)
        || tier_unavailable;
    if !waits_for_budget && this.report.attempts >= policy.attempts(*this.priority) {
        return Next::GiveUp(GaveUp::Attempts);
    }
    if this
        .max_attempts
        .is_some_and(|max| this.report.attempts >= max)
    {
        return Next::GiveUp(GaveUp::Attempts);
    }
    // Waiting in a budget's ordering, a provider's wait needs no jitter: the retries come
    // back to their places at its end, and the budget spaces them.
    let jitter = match *this.ordered && hint.is_some() {
        true => 0.0,
        false => this.settings.jitter.fraction(),
    };
    let wait = policy.wait((this.report.attempts - 1).min(30), hint, jitter);
    let first_sent = this.first_sent.unwrap_or(*this.started);
    if first_sent.elapsed().saturating_add(wait) > policy.total(*this.priority) {
        return Next::GiveUp(GaveUp::Time);
    }
    if this
        .deadline
        .is_some_and(|deadline| crate::sched::saturating_deadline(Instant::now(), wait) > deadline)
    {
        return Next::GiveUp(GaveUp::Deadline);
    }
    if !this.settings.budget.withdraw() {
        if !waits_for_budget {
            return Next::GiveUp(GaveUp::Budget);
        }
        tracing::debug!("retry budget spent: the rate-limited request waits for admission");
    }
    tracing::debug!(?class, ?wait, "transient failure, retrying after a wait");
    crate::observe::retry(
        &crate::observe::Labels::of(this.template.extensions()),
        class.metric_label(),
    );
    Next::Retry(wait)
}

/// The first attempt's outcome earns the request its retries.
fn deposit_once<T>(outcome: T, deposited: &mut bool, budget: &TpsBudget) -> T {
    if !*deposited {
        *deposited = true;
        budget.deposit();
    }
    outcome
}

fn is_failure<B>(response: &Response<B>) -> bool {
    response.status().is_client_error() || response.status().is_server_error()
}

impl<S, B, ResBody, C> fmt::Debug for ResponseFuture<S, B, ResBody, C>
where
    S: Service<Request<B>>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}
