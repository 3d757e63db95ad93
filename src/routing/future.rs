//! The router's response future: the routing decisions, in order, around the routes' calls.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use tokio::time::Instant;
use tower::{Service, ServiceExt};

use super::condition::{Condition, Reason, failed_answer, failed_error};
use super::inner::Inner;
use super::ramp::{position_of, position_of_sequence};
use super::route::{RequestView, Route, RouteKey, ServedBy, Tenant, priority_of, rewrite};
use crate::budget::Budget;
use crate::cost::Cost;
use crate::error::{BoxError, Error};
use crate::estimate::{CharEstimator, Defaults, RequestEstimate, estimate};
use crate::priority::Priority;
use crate::retry::RetryReport;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The [`Router`](super::Router)'s response future.
///
/// One allocation per request: the decisions await a body, a route's readiness and up to one
/// call per route in turn, which a hand-written state machine would spell out state by state
/// for no measurable gain next to a network call.
///
/// # Cancel safety
///
/// Dropping it drops the route's call in progress, which gives back or charges its
/// reservation by the budget's rules; a probe of a route's budget is never held across an
/// await, so nothing is left reserved.
pub struct ResponseFuture<ResBody> {
    inner: BoxFuture<Result<Response<ResBody>, BoxError>>,
}

impl<ResBody> ResponseFuture<ResBody> {
    pub(crate) fn new(
        future: impl Future<Output = Result<Response<ResBody>, BoxError>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(future),
        }
    }
}

impl<ResBody> Future for ResponseFuture<ResBody> {
    type Output = Result<Response<ResBody>, Error>;

    /// A route's failure is the crate's [`Error`] (a route's stack's own, passed unchanged),
    /// or the client's, wrapped as [`Error::is_inner`].
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx).map_err(Error::from_inner)
    }
}

impl<ResBody> fmt::Debug for ResponseFuture<ResBody> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// Where the request is now.
#[derive(Clone, Copy)]
enum At {
    Primary,
    Ramped,
    Fallback(usize),
}

impl<S> Inner<S> {
    fn at(&self, at: At) -> &Route<S> {
        match at {
            At::Primary => &self.primary,
            At::Ramped => self.ramp.as_ref().map_or(&self.primary, |(route, _)| route),
            At::Fallback(index) => &self.fallbacks[index].0,
        }
    }

    /// The primary, or the ramped route when the request falls within the ramp's share and
    /// the compatibility check accepts the ramped route.
    fn first(&self, parts: &Parts, view: &RequestView<'_>) -> At {
        let Some((ramped, ramp)) = &self.ramp else {
            return At::Primary;
        };
        if !self.compatible(view, ramped.info()) {
            return At::Primary;
        }
        ramp.ticked(|state| {
            let applies = state.config().tenant().is_none_or(|tenant| {
                parts
                    .extensions
                    .get::<Tenant>()
                    .is_some_and(|t| t.is_within(tenant))
            });
            if !applies {
                return At::Primary;
            }
            let position = match parts.extensions.get::<RouteKey>() {
                Some(key) => position_of(key.0.as_bytes()),
                None => position_of_sequence(self.next_position()),
            };
            if state.admits(position, Instant::now()) {
                At::Ramped
            } else {
                At::Primary
            }
        })
    }

    /// A fallback chosen before sending to `first`: degraded classes, context length, or a
    /// wait on `first` longer than a fallback accepts.
    fn before_sending(
        &self,
        first: &Route<S>,
        class: Priority,
        cost: Option<Cost>,
        view: &RequestView<'_>,
    ) -> Option<(usize, Reason)> {
        // The wait on the first route, asked at most once.
        let mut wait: Option<Option<Duration>> = None;
        for (index, (route, fallback)) in self.fallbacks.iter().enumerate() {
            if !fallback.serves(class) {
                continue;
            }
            let reason = if fallback.has(Condition::Degrade) {
                Some(Reason::Degraded)
            } else if fallback.has(Condition::ContextLengthNeeded)
                && needs_context(first, route, cost)
            {
                Some(Reason::ContextLength)
            } else if let Some(max) = fallback.max_wait() {
                let tenant = view.parts.extensions.get::<Tenant>();
                let wait = *wait
                    .get_or_insert_with(|| wait_on(first.budget.as_ref(), cost, class, tenant));
                wait.is_some_and(|wait| wait > max)
                    .then_some(Reason::WouldWait)
            } else {
                None
            };
            let Some(reason) = reason else { continue };
            if self.compatible(view, route.info()) {
                return Some((index, reason));
            }
            tracing::debug!(
                from = first.info().name(),
                to = route.info().name(),
                reason = reason.as_str(),
                "fallback refused by the compatibility check"
            );
        }
        None
    }

    /// The next fallback after `after` for `failure`.
    fn after_failure(
        &self,
        from: &Route<S>,
        after: Option<usize>,
        failure: Reason,
        class: Priority,
        view: &RequestView<'_>,
    ) -> Option<usize> {
        let start = after.map_or(0, |index| index + 1);
        for (index, (route, fallback)) in self.fallbacks.iter().enumerate().skip(start) {
            if !fallback.serves(class) || !fallback.after(failure) {
                continue;
            }
            if self.compatible(view, route.info()) {
                return Some(index);
            }
            tracing::debug!(
                from = from.info().name(),
                to = route.info().name(),
                reason = failure.as_str(),
                "fallback refused by the compatibility check"
            );
        }
        None
    }
}

/// Whether the request's tokens exceed `first`'s context window and fit `fallback`'s.
fn needs_context<S>(first: &Route<S>, fallback: &Route<S>, cost: Option<Cost>) -> bool {
    let (Some(cost), Some(window)) = (cost, first.info().context_window()) else {
        return false;
    };
    let tokens = cost.input_tokens().saturating_add(cost.output_tokens());
    tokens > window
        && fallback
            .info()
            .context_window()
            .is_none_or(|fits| tokens <= fits)
}

/// How long `cost` of `class` would wait on `budget` now (see `Budget::would_wait`); `None`
/// when nobody can tell (no budget or cost, a shared store, a cost that never fits).
fn wait_on(
    budget: Option<&Budget>,
    cost: Option<Cost>,
    class: Priority,
    tenant: Option<&Tenant>,
) -> Option<Duration> {
    // Only what would be admitted before it: its class and those above, its tenant's path.
    budget?.would_wait(cost?, class, tenant)
}

/// The request again, for one route: the head cloned, the body rewritten for its model and
/// service tier.
fn rebuild<B: From<Bytes>>(parts: &Parts, body: &Bytes, route: &Route<impl Sized>) -> Request<B> {
    let info = route.info();
    let (mut fields, mut n) = ([("", ""); 2], 0);
    for (key, value) in [
        ("model", info.model()),
        ("service_tier", info.service_tier()),
    ] {
        if let Some(value) = value {
            fields[n] = (key, value);
            n += 1;
        }
    }
    let body = match n {
        0 => body.clone(),
        _ => rewrite(body, &fields[..n]),
    };
    let mut request = Request::new(B::from(body));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    *request.extensions_mut() = parts.extensions.clone();
    // What a layer above read of the body, as rewritten for this route.
    if let Some(read) = request.extensions_mut().get_mut::<RequestEstimate>() {
        read.retarget(info.model(), info.service_tier());
    }
    request
}

/// The provider calls a route's outcome made: its retry report's attempts, else one for an
/// answer or an error that reached the provider, none for a local refusal.
fn attempts<R>(result: &Result<Response<R>, BoxError>) -> u32 {
    match result {
        Ok(response) => {
            (response.extensions().get::<RetryReport>()).map_or(1, RetryReport::attempts)
        }
        Err(error) => match error.downcast_ref::<crate::Error>() {
            Some(error) => match error.retry_report() {
                Some(report) => report.attempts(),
                None if error.is_local() => 0,
                None => 1,
            },
            None => 1,
        },
    }
}

fn met_rate_limit<R>(result: &Result<Response<R>, BoxError>) -> bool {
    let report = match result {
        Ok(response) if response.status() == StatusCode::TOO_MANY_REQUESTS => return true,
        Ok(response) => response.extensions().get::<RetryReport>(),
        Err(error) => error
            .downcast_ref::<crate::Error>()
            .and_then(crate::Error::retry_report),
    };
    report.is_some_and(|r| r.last_status() == Some(StatusCode::TOO_MANY_REQUESTS))
}

pub(crate) async fn route<S, B, ResBody>(
    inner: Arc<Inner<S>>,
    request: Request<B>,
) -> Result<Response<ResBody>, BoxError>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + Sync + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    let body = Limited::new(body, inner.max_body)
        .collect()
        .await?
        .to_bytes();
    let view = RequestView {
        parts: &parts,
        body: &body,
    };
    let class = priority_of(&parts);
    // The caller's cost, else what a layer above read of the body, else the body's estimate.
    let cost = parts.extensions.get::<Cost>().copied().or_else(|| {
        match parts.extensions.get::<RequestEstimate>() {
            Some(read) => Some(read.cost(&Defaults::default())),
            None => estimate(&body, &CharEstimator::default(), &Defaults::default()),
        }
    });

    let first = inner.first(&parts, &view);
    let ramped = matches!(first, At::Ramped);
    let mut at = first;
    let mut reason = None;
    if let Some((index, why)) = inner.before_sending(inner.at(first), class, cost, &view) {
        decided(inner.at(first), inner.at(At::Fallback(index)), why);
        at = At::Fallback(index);
        reason = Some(why);
    } else {
        tracing::debug!(
            route = inner.at(first).info().name(),
            ramped,
            class = class.as_str(),
            "routed"
        );
    }

    let mut earlier_attempts = 0;
    loop {
        let route = inner.at(at);
        let started = Instant::now();
        let mut service = route.service.clone();
        let ready: Result<&mut S, BoxError> = service.ready().await.map_err(Into::into);
        let result = match ready {
            Ok(service) => service
                .call(rebuild(&parts, &body, route))
                .await
                .map_err(Into::into),
            Err(error) => Err(error),
        };
        if let (At::Ramped, Some((_, ramp))) = (at, &inner.ramp) {
            let limited = met_rate_limit(&result);
            ramp.ticked(|state| state.record(started.elapsed(), limited));
        }
        let failure = match &result {
            Ok(response) => failed_answer(response.status(), response.extensions().get()),
            Err(error) => failed_error(error),
        };
        let next = failure.and_then(|failure| {
            let after = match at {
                At::Fallback(index) => Some(index),
                _ => None,
            };
            inner
                .after_failure(route, after, failure, class, &view)
                .map(|index| (index, failure))
        });
        match next {
            Some((index, failure)) => {
                earlier_attempts += attempts(&result);
                // The failed answer is dropped here: its body settles its reservation.
                drop(result);
                decided(route, inner.at(At::Fallback(index)), failure);
                at = At::Fallback(index);
                reason = Some(failure);
            }
            None => {
                return result.map(|mut response| {
                    response.extensions_mut().insert(ServedBy {
                        route: route.info.name().into(),
                        provider: route.info.provider().into(),
                        reason,
                        ramped: ramped && matches!(at, At::Ramped),
                        earlier_attempts,
                    });
                    response
                });
            }
        }
    }
}

fn decided<S>(from: &Route<S>, to: &Route<S>, reason: Reason) {
    crate::observe::route_fallback(
        from.info().provider(),
        to.info().provider(),
        reason.as_str(),
    );
    tracing::info!(
        from = from.info().name(),
        to = to.info().name(),
        reason = reason.as_str(),
        "routed to a fallback"
    );
}
