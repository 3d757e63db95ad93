//! The layer's own failures.

use std::fmt;
use std::sync::Arc;

/// A failure of [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) rather than of the inner
/// service. Opaque: ask with the `is_*` methods; the `Display` text is not stable.
#[derive(Debug, Clone)]
pub struct IdempotencyError {
    kind: Kind,
}

#[derive(Debug, Clone)]
enum Kind {
    InvalidKey(InvalidKey),
    LeaderFailed(Arc<str>),
    NotReplayable,
    Interrupted(Arc<str>),
    StillInFlight,
    KeyReused(Arc<str>),
}

impl IdempotencyError {
    pub(crate) fn invalid_key(error: InvalidKey) -> Self {
        Self {
            kind: Kind::InvalidKey(error),
        }
    }

    pub(crate) fn leader_failed(message: &str) -> Self {
        Self {
            kind: Kind::LeaderFailed(message.into()),
        }
    }

    pub(crate) fn not_replayable() -> Self {
        Self {
            kind: Kind::NotReplayable,
        }
    }

    pub(crate) fn interrupted(message: &str) -> Self {
        Self {
            kind: Kind::Interrupted(message.into()),
        }
    }

    pub(crate) fn still_in_flight() -> Self {
        Self {
            kind: Kind::StillInFlight,
        }
    }

    pub(crate) fn key_reused(key: &str) -> Self {
        Self {
            kind: Kind::KeyReused(key.into()),
        }
    }

    /// This request waited for an identical one in flight as long as it may (its
    /// [`Deadline`](crate::Deadline), or [`IdempotencyLayer::max_wait`](crate::idempotency::IdempotencyLayer::max_wait)),
    /// and that one had not answered. Nothing was sent for this request (a second call would
    /// be billed twice): try again later, when the first has completed and its record answers
    /// (an HTTP front answers 409 Conflict).
    pub fn is_still_in_flight(&self) -> bool {
        matches!(self.kind, Kind::StillInFlight)
    }

    /// The request's idempotency key header is malformed (empty, too long, not visible
    /// ASCII, or repeated): nothing was sent.
    pub fn is_invalid_key(&self) -> bool {
        matches!(self.kind, Kind::InvalidKey(_))
    }

    /// This request waited for an identical one in flight, whose call failed without a
    /// response. Nothing was sent for this request, and the operation may be tried again.
    pub fn is_leader_failed(&self) -> bool {
        matches!(self.kind, Kind::LeaderFailed(_))
    }

    /// The operation completed within the record's time to live, but its body was larger
    /// than the layer keeps: it cannot be replayed, and is not sent again (it would be
    /// billed twice). Raise [`IdempotencyLayer::max_body`](crate::idempotency::IdempotencyLayer::max_body)
    /// or send the request with another key.
    pub fn is_not_replayable(&self) -> bool {
        matches!(self.kind, Kind::NotReplayable)
    }

    /// The response was interrupted after its first byte: the provider processed the call
    /// (and billed it), and it is not retried transparently.
    pub fn is_interrupted(&self) -> bool {
        matches!(self.kind, Kind::Interrupted(_))
    }

    /// The caller's idempotency key was used before for another request (another endpoint or
    /// body): nothing was sent, and the earlier answer is not given for it (an HTTP front
    /// answers 422, as Stripe does). Send the new request with a new key.
    pub fn is_key_reused(&self) -> bool {
        matches!(self.kind, Kind::KeyReused(_))
    }
}

impl fmt::Display for IdempotencyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::InvalidKey(error) => write!(f, "invalid idempotency key: {error}"),
            Kind::LeaderFailed(message) => write!(
                f,
                "the identical request this one waited for failed: {message}"
            ),
            Kind::NotReplayable => f.write_str(
                "the operation already completed, but its response was too large to keep",
            ),
            Kind::StillInFlight => f.write_str(
                "an identical request is still in flight: waited as long as allowed for it",
            ),
            Kind::KeyReused(key) => write!(
                f,
                "the idempotency key {key:?} was used for another request (another endpoint or \
                 body): send this one with a new key"
            ),
            Kind::Interrupted(message) => write!(
                f,
                "the response was interrupted after its first byte (the provider processed \
                 the call): {message}"
            ),
        }
    }
}

impl std::error::Error for IdempotencyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            Kind::InvalidKey(error) => Some(error),
            _ => None,
        }
    }
}

/// A malformed idempotency key; the message says why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidKey(pub(crate) &'static str);

impl fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for InvalidKey {}
