//! The failure of a shared quota store.

use std::fmt;
use std::sync::Arc;

/// The shared store did not answer: a timeout, a refused connection, a script error.
#[derive(Debug, Clone)]
pub struct StoreUnavailable {
    reason: Arc<str>,
}

impl StoreUnavailable {
    /// The store did not answer, for `reason`: what a [`QuotaStore`] answers when its medium
    /// fails (a timeout, a refused connection, a script error).
    ///
    /// [`QuotaStore`]: crate::budget::store::QuotaStore
    pub fn new(reason: impl fmt::Display) -> Self {
        Self {
            reason: reason.to_string().into(),
        }
    }

    /// The store was not asked: its circuit breaker is open after repeated failures.
    pub(crate) fn breaker_open() -> Self {
        Self::new("the circuit breaker is open after repeated failures")
    }

    /// Why the store did not answer.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for StoreUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the shared quota store is unavailable: {}", self.reason)
    }
}

impl std::error::Error for StoreUnavailable {}
