//! The usage a reservation was settled with, told back to the caller.

use std::sync::{Arc, Mutex, PoisonError};

use crate::cost::Usage;

/// Where [`ReconcileLayer`](super::ReconcileLayer) tells the caller the usage it settled a
/// request's reservation with: put one in the request's extensions, keep a clone, and read it
/// once the response body has ended, failed or been dropped. A layer above that needs the
/// usage (an audit line, a per-tenant count) reads it here instead of scanning the body a
/// second time.
///
/// ```
/// use tower_llm_quota::reconcile::UsageReport;
///
/// let report = UsageReport::new();
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(report.clone());
/// // ... the request goes through the stack, its answer's body is read to its end ...
/// assert_eq!(report.settled(), None, "not settled yet");
/// ```
#[derive(Debug, Clone, Default)]
pub struct UsageReport(Arc<Mutex<Option<Option<Usage>>>>);

impl UsageReport {
    /// An empty report.
    pub fn new() -> Self {
        Self::default()
    }

    /// `None` until the reservation is settled (and for a request that reserved nothing);
    /// then `Some` of the usage it was settled with: `Some(None)` when none could be read
    /// (the estimate was charged, or nothing for an error answer).
    ///
    /// A request retried, or sent on to a fallback route, settles once per attempt: each
    /// attempt that failed settles when its answer is dropped, before the next is sent, so
    /// the report holds the last, the answer's.
    pub fn settled(&self) -> Option<Option<Usage>> {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The reservation was settled with `usage`: it replaces an earlier attempt's.
    pub(crate) fn set(&self, usage: Option<Usage>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(usage);
    }
}
