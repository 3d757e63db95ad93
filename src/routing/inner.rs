//! What a router's services and futures share: its routes and their checks, and a ramp's
//! state behind its handle.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::time::Instant;

use super::condition::Fallback;
use super::ramp::{Ramp, RampState, RampStatus};
use super::route::{RequestView, Route, RouteInfo};
use crate::budget::Budget;

/// A user's compatibility check: may this request be served by this route?
pub(crate) type Compatible = dyn Fn(&RequestView<'_>, &RouteInfo) -> bool + Send + Sync;

/// A router's routes, shared by its clones and their futures.
pub(crate) struct Inner<S> {
    pub(crate) primary: Route<S>,
    pub(crate) ramp: Option<(Route<S>, RampHandle)>,
    pub(crate) fallbacks: Vec<(Route<S>, Fallback)>,
    pub(crate) compatible: Option<Box<Compatible>>,
    pub(crate) max_body: usize,
    /// Requests without a [`RouteKey`](super::RouteKey) seen by the ramp.
    pub(crate) sequence: AtomicU64,
}

impl<S> Inner<S> {
    pub(crate) fn compatible(&self, view: &RequestView<'_>, route: &RouteInfo) -> bool {
        self.compatible
            .as_ref()
            .is_none_or(|check| check(view, route))
    }

    pub(crate) fn next_position(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::Relaxed)
    }
}

/// A ramp's shared state: read its [`status`](RampHandle::status) for dashboards. Clones
/// share the ramp.
#[derive(Clone)]
pub struct RampHandle {
    inner: Arc<RampInner>,
}

struct RampInner {
    route: Arc<str>,
    budget: Option<Budget>,
    state: Mutex<RampState>,
}

impl RampHandle {
    pub(crate) fn new(route: &str, budget: Option<Budget>, ramp: Ramp) -> Self {
        let handle = Self {
            inner: Arc::new(RampInner {
                route: route.into(),
                budget,
                state: Mutex::new(RampState::new(ramp, Instant::now())),
            }),
        };
        let status = handle.with(|state| state.status());
        crate::observe::ramp(route, status.share, status.paused.is_some());
        handle
    }

    fn with<T>(&self, f: impl FnOnce(&mut RampState) -> T) -> T {
        let mut state = self
            .inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut state)
    }

    /// Evaluates the periods that ended, then runs `f` on the state.
    pub(crate) fn ticked<T>(&self, f: impl FnOnce(&mut RampState) -> T) -> T {
        let depth = self.inner.budget.as_ref().map_or(0, Budget::waiters);
        let now = Instant::now();
        let (changed, status, out) = self.with(|state| {
            let changed = state.tick(now, depth);
            (changed, state.status(), f(state))
        });
        if changed {
            crate::observe::ramp(&self.inner.route, status.share, status.paused.is_some());
            match status.paused {
                Some(reason) => tracing::debug!(
                    route = %self.inner.route,
                    share = status.share,
                    reason = reason.as_str(),
                    "ramp paused"
                ),
                None => tracing::debug!(
                    route = %self.inner.route,
                    share = status.share,
                    "ramp growing"
                ),
            }
        }
        out
    }

    /// The ramp's state now (its share and why it is paused), after evaluating the periods
    /// that ended.
    pub fn status(&self) -> RampStatus {
        self.ticked(|state| state.status())
    }

    /// The ramped route's name.
    pub fn route(&self) -> &str {
        &self.inner.route
    }
}

impl fmt::Debug for RampHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RampHandle")
            .field("route", &self.inner.route)
            .field("status", &self.with(|state| state.status()))
            .finish()
    }
}
