//! The crate-level [`Error`]: a local decision, or the inner service's failure.

use std::fmt;
use std::time::Duration;

use super::capacity::InsufficientCapacity;
use super::idempotency::IdempotencyError;
use super::report::{GaveUp, RetryReport};
use crate::priority::Priority;
use crate::tenant::TenantRefused;

/// A boxed error, as tower services return.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The error of this crate's services.
///
/// It tells a *local* decision (the request was refused or failed before anything was sent)
/// apart from a failure of the inner service, reached through [`Error::is_inner`] and
/// [`source`](std::error::Error::source). Its kinds are private and read through the `is_*`
/// methods, so new kinds can be added without breaking callers; the `Display` text is for
/// people and may change.
pub struct Error {
    inner: Box<Inner>,
}

struct Inner {
    kind: Kind,
    source: Option<BoxError>,
}

#[derive(Debug)]
enum Kind {
    TooLarge(InsufficientCapacity),
    /// The source is the [`StoreUnavailable`](crate::budget::StoreUnavailable).
    StoreUnavailable,
    MissingCost,
    DeadlineExceeded {
        priority: Option<Priority>,
        waited: Duration,
        /// Refused on arrival: the wait a budget predicted, past the deadline.
        predicted: Option<Duration>,
        /// What it would wait for, when a budget predicted it.
        binding: Option<Box<super::Binding>>,
    },
    QueueFull {
        priority: Priority,
        depth: usize,
    },
    GaveUp(RetryReport),
    /// The source is the error of the caller's request body.
    RequestBody,
    /// The source is the [`NoPrice`](crate::pricing::NoPrice).
    Unpriced,
    /// The source is the [`TenantRefused`].
    Tenant,
    /// The source is the [`IdempotencyError`].
    Idempotency,
    Inner,
}

impl Error {
    fn new(kind: Kind, source: Option<BoxError>) -> Self {
        Self {
            inner: Box::new(Inner { kind, source }),
        }
    }

    /// The budget's shared store did not answer: `unavailable` is its
    /// [`StoreUnavailable`](crate::budget::StoreUnavailable).
    pub(crate) fn store_unavailable(unavailable: BoxError) -> Self {
        Self::new(Kind::StoreUnavailable, Some(unavailable))
    }

    /// A scope of the tenant path refused the request: `refused` is its [`TenantRefused`].
    pub(crate) fn tenant_refused_by(refused: BoxError) -> Self {
        Self::new(Kind::Tenant, Some(refused))
    }

    /// The idempotency layer decided (`failure` is its [`IdempotencyError`]).
    pub(crate) fn idempotency(failure: BoxError) -> Self {
        Self::new(Kind::Idempotency, Some(failure))
    }

    pub(crate) fn missing_cost() -> Self {
        Self::new(Kind::MissingCost, None)
    }

    pub(crate) fn deadline_exceeded(priority: Option<Priority>, waited: Duration) -> Self {
        let predicted = None;
        Self::new(
            Kind::DeadlineExceeded {
                priority,
                waited,
                predicted,
                binding: None,
            },
            None,
        )
    }

    /// Refused on arrival: the budget of `quota` predicted a wait of `predicted`, past the
    /// deadline.
    pub(crate) fn deadline_unmet(
        priority: Priority,
        predicted: Duration,
        binding: Option<Box<super::Binding>>,
    ) -> Self {
        Self::new(
            Kind::DeadlineExceeded {
                priority: Some(priority),
                waited: Duration::ZERO,
                predicted: Some(predicted),
                binding,
            },
            None,
        )
    }

    pub(crate) fn queue_full(priority: Priority, depth: usize) -> Self {
        Self::new(Kind::QueueFull { priority, depth }, None)
    }

    pub(crate) fn gave_up(report: RetryReport, last: BoxError) -> Self {
        Self::new(Kind::GaveUp(report), Some(last))
    }

    /// The caller's request body failed while a layer read it.
    pub(crate) fn request_body(error: BoxError) -> Self {
        Self::new(Kind::RequestBody, Some(error))
    }

    /// The request's model has no price, under a price table that refuses such models:
    /// `no_price` is the [`NoPrice`](crate::pricing::NoPrice).
    pub(crate) fn unpriced(no_price: BoxError) -> Self {
        Self::new(Kind::Unpriced, Some(no_price))
    }

    /// Wraps an inner service's error, unless it already is an [`Error`] of this crate (an
    /// inner layer of the same stack), which is passed on unchanged, or an
    /// [`IdempotencyError`], which becomes its kind.
    pub(crate) fn from_inner(error: impl Into<BoxError>) -> Self {
        match error.into().downcast::<Error>() {
            Ok(error) => *error,
            Err(error) if error.is::<IdempotencyError>() => Self::idempotency(error),
            Err(error) => Self::new(Kind::Inner, Some(error)),
        }
    }

    /// Whether the request was refused locally, before anything was sent.
    pub fn is_local(&self) -> bool {
        !matches!(self.inner.kind, Kind::Inner | Kind::GaveUp(_))
    }

    /// Whether the retry layer gave up on a request whose attempts failed without a response;
    /// [`Error::retry_report`] says why, [`source`](std::error::Error::source) is the last
    /// failure.
    pub fn is_retries_exhausted(&self) -> bool {
        matches!(self.inner.kind, Kind::GaveUp(_))
    }

    /// What the retry layer did, when [`Error::is_retries_exhausted`].
    pub fn retry_report(&self) -> Option<&RetryReport> {
        match &self.inner.kind {
            Kind::GaveUp(report) => Some(report),
            _ => None,
        }
    }

    /// Whether the caller's request body failed while the estimation layer read it (nothing
    /// was sent); [`source`](std::error::Error::source) is the body's error.
    pub fn is_request_body(&self) -> bool {
        matches!(self.inner.kind, Kind::RequestBody)
    }

    /// Whether the request's model has no price in the estimation layer's
    /// [`PriceTable`](crate::pricing::PriceTable), which refuses unpriced models (nothing was
    /// sent); [`source`](std::error::Error::source) is the
    /// [`NoPrice`](crate::pricing::NoPrice) naming the model.
    pub fn is_unpriced(&self) -> bool {
        matches!(self.inner.kind, Kind::Unpriced)
    }

    /// Whether the inner service failed; [`source`](std::error::Error::source) is its error.
    pub fn is_inner(&self) -> bool {
        matches!(self.inner.kind, Kind::Inner)
    }

    /// Whether the request's cost exceeds a bucket's capacity and so can never be admitted.
    pub fn is_too_large(&self) -> bool {
        matches!(self.inner.kind, Kind::TooLarge(_))
    }

    /// Whether the budget's shared store (Redis) did not answer in time and the budget's
    /// [`FailurePolicy`](crate::budget::FailurePolicy) is to refuse rather than fall back.
    pub fn is_store_unavailable(&self) -> bool {
        matches!(self.inner.kind, Kind::StoreUnavailable)
    }

    /// Whether the request had no [`Cost`](crate::Cost) and the layer was set to refuse it.
    pub fn is_missing_cost(&self) -> bool {
        matches!(self.inner.kind, Kind::MissingCost)
    }

    /// Whether the request waited past its deadline (its class's maximum wait, or its own
    /// [`Deadline`](crate::Deadline)) before it could be sent, or was refused on arrival
    /// because a budget predicted it would ([`Error::predicted_wait`]).
    pub fn is_deadline_exceeded(&self) -> bool {
        matches!(self.inner.kind, Kind::DeadlineExceeded { .. })
    }

    /// Whether the request was shed because the priority queue was full.
    pub fn is_queue_full(&self) -> bool {
        matches!(self.inner.kind, Kind::QueueFull { .. })
    }

    /// The request's class, when the error is about queueing.
    pub fn priority(&self) -> Option<Priority> {
        match self.inner.kind {
            Kind::DeadlineExceeded { priority, .. } => priority,
            Kind::QueueFull { priority, .. } => Some(priority),
            _ => None,
        }
    }

    /// How long the request waited before its deadline passed (or before it was refused,
    /// when its deadline was predicted to pass).
    pub fn waited(&self) -> Option<Duration> {
        match self.inner.kind {
            Kind::DeadlineExceeded { waited, .. } => Some(waited),
            _ => None,
        }
    }

    /// The wait a budget predicted for the request when it refused it on arrival, its
    /// deadline being sooner: the costs waiting ahead of it and its own, at the quota's rate.
    /// `None` for a request that waited until its deadline passed.
    pub fn predicted_wait(&self) -> Option<Duration> {
        match self.inner.kind {
            Kind::DeadlineExceeded { predicted, .. } => predicted,
            _ => None,
        }
    }

    /// What binds when a budget predicted the wait of
    /// [`predicted_wait`](Self::predicted_wait): the limit whose refill the request would
    /// wait for, and the budget's quota.
    pub fn predicted_by(&self) -> Option<&super::Binding> {
        match &self.inner.kind {
            Kind::DeadlineExceeded {
                binding: Some(binding),
                ..
            } => Some(binding),
            _ => None,
        }
    }

    /// The same deadline error, told for the whole wait of a request of `priority`.
    pub(crate) fn with_wait(self, priority: Priority, waited: Duration) -> Self {
        match self.inner.kind {
            Kind::DeadlineExceeded {
                predicted, binding, ..
            } => Self::new(
                Kind::DeadlineExceeded {
                    priority: Some(priority),
                    waited,
                    predicted,
                    binding,
                },
                None,
            ),
            _ => self,
        }
    }

    /// The scope of the tenant path that refused the request (paused, its day spent, too
    /// large for it), when one did.
    pub fn tenant_refused(&self) -> Option<&TenantRefused> {
        match self.inner.kind {
            Kind::Tenant => self.inner.source.as_deref()?.downcast_ref(),
            _ => None,
        }
    }

    /// What the idempotency layer decided, when it failed the request: an invalid key, a
    /// duplicate whose leader failed, a completed operation too large to replay, an
    /// interrupted response ([`IdempotencyError`]'s `is_*` methods). No downcast needed.
    pub fn idempotency_error(&self) -> Option<&IdempotencyError> {
        match self.inner.kind {
            Kind::Idempotency => self.inner.source.as_deref()?.downcast_ref(),
            _ => None,
        }
    }

    /// The bucket that is too small, when [`Error::is_too_large`].
    pub fn insufficient_capacity(&self) -> Option<&InsufficientCapacity> {
        match &self.inner.kind {
            Kind::TooLarge(e) => Some(e),
            _ => None,
        }
    }

    /// The inner service's error, when [`Error::is_inner`].
    pub fn into_inner(self) -> Option<BoxError> {
        match self.inner.kind {
            Kind::Inner => self.inner.source,
            _ => None,
        }
    }
}

impl From<InsufficientCapacity> for Error {
    fn from(e: InsufficientCapacity) -> Self {
        Self::new(Kind::TooLarge(e), None)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("tower_llm_quota::Error");
        d.field("kind", &self.inner.kind);
        if let Some(source) = &self.inner.source {
            d.field("source", source);
        }
        d.finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner.kind {
            Kind::TooLarge(e) => write!(f, "rejected locally: {e}"),
            Kind::StoreUnavailable => match &self.inner.source {
                Some(e) => write!(f, "rejected locally: {e}"),
                None => f.write_str("rejected locally: the shared quota store is unavailable"),
            },
            Kind::MissingCost => f.write_str("rejected locally: the request carries no cost"),
            Kind::DeadlineExceeded {
                priority,
                predicted: Some(predicted),
                ..
            } => {
                let request = priority.map_or(String::from("the request"), |p| {
                    format!("{} {p} request", article(p))
                });
                write!(
                    f,
                    "rejected locally: {request} would wait about {} for the quota, past the \
                     longest it may wait (its deadline, or its class's)",
                    rounded(*predicted)
                )
            }
            Kind::DeadlineExceeded {
                priority: Some(priority),
                waited,
                ..
            } => write!(
                f,
                "rejected locally: {} {priority} request waited {waited:?}, past its deadline",
                article(*priority)
            ),
            Kind::DeadlineExceeded {
                priority: None,
                waited,
                ..
            } => write!(
                f,
                "rejected locally: the request waited {waited:?}, past its deadline"
            ),
            Kind::QueueFull { priority, depth } => write!(
                f,
                "rejected locally: the queue is full ({depth} {priority} requests may wait)"
            ),
            Kind::GaveUp(report) => write!(
                f,
                "gave up after {} attempts: {}",
                report.attempts(),
                report.gave_up().unwrap_or(GaveUp::Permanent)
            ),
            Kind::RequestBody => f.write_str("rejected locally: the request body failed"),
            Kind::Unpriced => match &self.inner.source {
                Some(e) => write!(f, "rejected locally: {e} (its spend cannot be limited)"),
                None => f.write_str("rejected locally: the model has no price"),
            },
            Kind::Idempotency => match &self.inner.source {
                Some(e) => write!(f, "rejected locally: {e}"),
                None => f.write_str("rejected locally by the idempotency layer"),
            },
            Kind::Tenant => match self.tenant_refused() {
                Some(refused) => write!(f, "rejected locally: {refused}"),
                None => f.write_str("rejected locally by a tenant scope"),
            },
            Kind::Inner => f.write_str("inner service failed"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.inner.kind {
            Kind::TooLarge(e) => Some(e),
            _ => self
                .inner
                .source
                .as_deref()
                .map(|e| e as &(dyn std::error::Error + 'static)),
        }
    }
}

/// A wait for people: whole seconds, minutes or hours.
pub(crate) fn rounded(wait: Duration) -> String {
    let secs = wait.as_secs_f64();
    if secs < 1.0 {
        format!("{} ms", wait.as_millis())
    } else if secs < 120.0 {
        format!("{secs:.0} s")
    } else if secs < 7_200.0 {
        format!("{:.0} min", secs / 60.0)
    } else {
        format!("{:.1} h", secs / 3_600.0)
    }
}

/// "a" or "an" before a class's name.
pub(crate) fn article(priority: Priority) -> &'static str {
    match priority {
        Priority::Interactive | Priority::Async => "an",
        Priority::Batch => "a",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::Dimension;

    #[test]
    fn error_is_one_pointer() {
        assert_eq!(std::mem::size_of::<Error>(), std::mem::size_of::<usize>());
    }

    #[test]
    fn inner_errors_are_wrapped_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let once = Error::from_inner(io);
        assert!(once.is_inner() && !once.is_local());
        let twice = Error::from_inner(once);
        let source = std::error::Error::source(&twice).unwrap();
        assert!(source.downcast_ref::<std::io::Error>().is_some());
        assert!(twice.into_inner().is_some());
    }

    #[test]
    fn local_errors_say_so() {
        let e = Error::from(InsufficientCapacity {
            dimension: Dimension::InputTokens,
            period: Duration::from_secs(60),
            cost: 9_000,
            capacity: 6_375,
        });
        assert!(e.is_local() && e.is_too_large());
        assert_eq!(
            e.to_string(),
            "rejected locally: a cost of 9000 input tokens exceeds the capacity of 6375 of the limit per 60s"
        );
        assert_eq!(e.insufficient_capacity().unwrap().capacity(), 6_375);
        assert!(Error::missing_cost().is_missing_cost());
    }
}
