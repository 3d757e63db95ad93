//! How far a failed attempt got: never sent, sent without an answer, or answered in part.
//!
//! Pure: it reads an error's source chain and nothing else.
//!
//! | failure | [`Ambiguity`] | retried |
//! |---|---|---|
//! | connect failure (refused, unreachable, DNS), a local decision | not sent | yes, anywhere |
//! | timeout, reset or closed connection before the response head | uncertain | only on the same provider, and only when the request carries an idempotency key |
//! | failure after the response head (a cut body) | processed | never transparently: the error is [`Interrupted`] |
//!
//! An error nothing here recognises counts as uncertain: retrying it without a key could bill
//! twice.

use std::error::Error as StdError;
use std::fmt;
use std::io;

use http::Request;

use super::{FailureClass, Permanent};
use crate::error::BoxError;

/// How far a failed attempt got, as far as the provider is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Ambiguity {
    /// It never reached the provider (the connection was never made, or a local layer
    /// decided): nothing was processed, so it is safe to retry anywhere.
    NotSent,
    /// It was sent, and failed before the response head (a timeout, a reset): the provider
    /// may have processed it. Retry only on the same provider (which can recognise the
    /// idempotency key) and only with the key.
    Uncertain,
    /// The response had begun: the provider processed the call and billed it. Never retried
    /// transparently.
    Processed,
}

impl Ambiguity {
    /// How far an attempt that failed with `error` got, along its source chain.
    pub fn of_error(error: &(dyn StdError + 'static)) -> Self {
        let mut link = Some(error);
        while let Some(error) = link {
            if let Some(ambiguity) = known(error) {
                return ambiguity;
            }
            link = error.source();
        }
        Self::Uncertain
    }

    /// Whether a retry is safe: always when not sent, with an idempotency key when uncertain,
    /// never once processed.
    pub fn may_retry(self, has_key: bool) -> bool {
        match self {
            Self::NotSent => true,
            Self::Uncertain => has_key,
            Self::Processed => false,
        }
    }

    /// Whether a router may send the request to another provider or model: only when it
    /// never reached this one (another provider would not recognise the key).
    pub fn may_route_elsewhere(self) -> bool {
        self == Self::NotSent
    }
}

fn known(error: &(dyn StdError + 'static)) -> Option<Ambiguity> {
    if error.is::<Interrupted>() {
        return Some(Ambiguity::Processed);
    }
    if let Some(error) = error.downcast_ref::<crate::Error>() {
        return error.is_local().then_some(Ambiguity::NotSent);
    }
    if let Some(error) = error.downcast_ref::<io::Error>() {
        use io::ErrorKind::*;
        return match error.kind() {
            ConnectionRefused | AddrNotAvailable | AddrInUse | HostUnreachable
            | NetworkUnreachable => Some(Ambiguity::NotSent),
            _ => Some(Ambiguity::Uncertain),
        };
    }
    #[cfg(feature = "hyper")]
    if let Some(error) = error.downcast_ref::<hyper_util::client::legacy::Error>() {
        if error.is_connect() {
            return Some(Ambiguity::NotSent);
        }
    }
    #[cfg(feature = "reqwest")]
    if let Some(error) = error.downcast_ref::<reqwest::Error>() {
        if error.is_connect() {
            return Some(Ambiguity::NotSent);
        }
        if error.is_body() || error.is_decode() {
            return Some(Ambiguity::Processed);
        }
    }
    None
}

/// Whether `request` carries an idempotency key: one set by
/// [`IdempotencyLayer`](crate::IdempotencyLayer), or an `idempotency-key` header of its own.
pub(crate) fn has_key<B>(request: &Request<B>) -> bool {
    request
        .extensions()
        .get::<crate::idempotency::IdempotencyKey>()
        .is_some()
        || request.headers().contains_key("idempotency-key")
}

/// A transient failure without a response head stays transient only when a retry is safe.
pub(crate) fn gate(
    class: FailureClass,
    error: &(dyn StdError + 'static),
    has_key: bool,
) -> FailureClass {
    match class {
        FailureClass::Transient(_) if !Ambiguity::of_error(error).may_retry(has_key) => {
            FailureClass::Permanent(Permanent::Ambiguous)
        }
        class => class,
    }
}

/// The error of a response body that failed after the response head: the provider processed
/// the call, and it is not retried. Its [`source`](StdError::source) is the body's own error.
#[derive(Debug)]
pub struct Interrupted {
    source: BoxError,
}

impl Interrupted {
    pub(crate) fn new(source: BoxError) -> Self {
        Self { source }
    }
}

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the response was interrupted after its head (the provider processed the call; not retried): {}",
            self.source
        )
    }
}

impl StdError for Interrupted {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_failures_are_not_sent_resets_uncertain_cut_bodies_processed() {
        let refused = io::Error::new(io::ErrorKind::ConnectionRefused, "refused");
        let reset = io::Error::new(io::ErrorKind::ConnectionReset, "reset");
        let timed_out = io::Error::new(io::ErrorKind::TimedOut, "timeout");
        assert_eq!(Ambiguity::of_error(&refused), Ambiguity::NotSent);
        assert_eq!(Ambiguity::of_error(&reset), Ambiguity::Uncertain);
        assert_eq!(Ambiguity::of_error(&timed_out), Ambiguity::Uncertain);
        let wrapped = crate::Error::from_inner(refused);
        assert_eq!(Ambiguity::of_error(&wrapped), Ambiguity::NotSent);
        let cut = Interrupted::new(Box::new(reset));
        assert_eq!(Ambiguity::of_error(&cut), Ambiguity::Processed);
        assert_eq!(Ambiguity::of_error(&fmt::Error), Ambiguity::Uncertain);
        assert_eq!(
            Ambiguity::of_error(&crate::Error::missing_cost()),
            Ambiguity::NotSent
        );
    }

    #[test]
    fn retry_and_routing_rules() {
        assert!(Ambiguity::NotSent.may_retry(false));
        assert!(!Ambiguity::Uncertain.may_retry(false));
        assert!(Ambiguity::Uncertain.may_retry(true));
        assert!(!Ambiguity::Processed.may_retry(true));
        assert!(Ambiguity::NotSent.may_route_elsewhere());
        assert!(!Ambiguity::Uncertain.may_route_elsewhere());
    }
}
