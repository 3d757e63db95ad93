//! The router: a primary route, an optional ramped route, ordered fallbacks.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower::Service;

use super::condition::Fallback;
use super::future::{ResponseFuture, route};
use super::inner::{Compatible, Inner, RampHandle};
use super::ramp::Ramp;
use super::route::{RequestView, Route, RouteInfo};
use crate::error::{BoxError, Error};

/// The largest request body a router reads by default: 8 MiB.
pub const DEFAULT_MAX_BODY: usize = 8 << 20;

/// Routes each request to a primary, a ramped or a fallback route; see the
/// [module documentation](super).
///
/// Cloning it is cheap and shares its routes and its ramp.
///
/// # Cancel safety
///
/// Dropping a [`ResponseFuture`] drops the call in progress on its route, which gives back
/// or charges that route's reservation by its budget's rules; nothing is held on any other
/// route.
pub struct Router<S> {
    pub(crate) inner: Arc<Inner<S>>,
}

impl<S> Clone for Router<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S> Router<S> {
    /// A router sending every request to `primary` until fallbacks or a ramp are added.
    pub fn builder(primary: Route<S>) -> RouterBuilder<S> {
        RouterBuilder {
            primary,
            ramp: None,
            fallbacks: Vec::new(),
            compatible: None,
            max_body: DEFAULT_MAX_BODY,
        }
    }

    /// The ramp's handle, if the router has one.
    pub fn ramp(&self) -> Option<&RampHandle> {
        self.inner.ramp.as_ref().map(|(_, handle)| handle)
    }
}

impl<S> fmt::Debug for Router<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Router")
            .field("primary", &self.inner.primary)
            .field("ramp", &self.inner.ramp)
            .field("fallbacks", &self.inner.fallbacks)
            .field("max_body", &self.inner.max_body)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Router`].
pub struct RouterBuilder<S> {
    primary: Route<S>,
    ramp: Option<(Route<S>, RampHandle)>,
    fallbacks: Vec<(Route<S>, Fallback)>,
    compatible: Option<Box<Compatible>>,
    max_body: usize,
}

impl<S> RouterBuilder<S> {
    /// Adds `route` as the next fallback, used under `when`. Fallbacks are tried in the order
    /// they are added.
    pub fn fallback(mut self, route: Route<S>, when: Fallback) -> Self {
        self.fallbacks.push((route, when));
        self
    }

    /// Ramps `route` up by `ramp`: the requests within the ramp's share go to `route`
    /// instead of the primary (with the same fallbacks), the others to the primary. The ramp
    /// starts now (its first period ends one evaluation period from now).
    pub fn ramp(mut self, route: Route<S>, ramp: Ramp) -> Self {
        let handle = RampHandle::new(route.info.name(), route.budget.clone(), ramp);
        self.ramp = Some((route, handle));
        self
    }

    /// Checks every fallback, and the ramped route, before it is used: `check` says whether
    /// the request may be served by the route (tools, structured output, residency, ...).
    /// When it says no, the request stays where it is: it waits on its route, or gets the
    /// route's own answer or refusal (and a ramp leaves it on the primary). Defaults to every
    /// route being compatible.
    pub fn compatible(
        mut self,
        check: impl Fn(&RequestView<'_>, &RouteInfo) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.compatible = Some(Box::new(check));
        self
    }

    /// Reads request bodies up to `bytes`; a larger one fails the request with
    /// [`LengthLimitError`](http_body_util::LengthLimitError), sent nowhere. Defaults to
    /// [`DEFAULT_MAX_BODY`].
    pub fn max_body(self, bytes: usize) -> Self {
        Self {
            max_body: bytes,
            ..self
        }
    }

    /// The router.
    pub fn build(self) -> Router<S> {
        Router {
            inner: Arc::new(Inner {
                primary: self.primary,
                ramp: self.ramp,
                fallbacks: self.fallbacks,
                compatible: self.compatible,
                max_body: self.max_body,
                sequence: AtomicU64::new(0),
            }),
        }
    }
}

impl<S> fmt::Debug for RouterBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouterBuilder")
            .field("primary", &self.primary)
            .field("fallbacks", &self.fallbacks)
            .finish_non_exhaustive()
    }
}

impl<S, B, ResBody> Service<Request<B>> for Router<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + Sync + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = Error;
    type Future = ResponseFuture<ResBody>;

    /// Always ready: the route a request takes is known only in `call`, and its readiness is
    /// awaited in the response future, on a clone of the route's service.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        ResponseFuture::new(route(Arc::clone(&self.inner), request))
    }
}
