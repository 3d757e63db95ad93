//! Calls admitted per idempotency key: how a test proves that no operation was billed twice.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use http::HeaderMap;

/// The header a client sends its operation's key under.
const HEADER: &str = "idempotency-key";

/// Admitted (billed) calls per `idempotency-key` header value.
#[derive(Debug, Default)]
pub(crate) struct KeyCounts {
    counts: Mutex<HashMap<String, u64>>,
}

impl KeyCounts {
    /// An admitted call with `headers`: counted under its key, if it has one that is text.
    pub(crate) fn admitted(&self, headers: &HeaderMap) {
        let Some(key) = headers.get(HEADER).and_then(|v| v.to_str().ok()) else {
            return;
        };
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        *counts.entry(key.to_owned()).or_default() += 1;
    }

    pub(crate) fn snapshot(&self) -> HashMap<String, u64> {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn clear(&self) {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}
