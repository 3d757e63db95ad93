//! When a fallback may serve a request: its conditions, its classes, and why it was used.
//!
//! Pure: these types read a status, an error and a request's class, and do no I/O.

use std::fmt;
use std::time::Duration;

use http::StatusCode;

use crate::error::{BoxError, Error};
use crate::priority::Priority;
use crate::quota::Dimension;
use crate::retry::{Ambiguity, FailureClass, RetryReport, Transient};
use crate::tenant::Refusal;

/// A circumstance under which a fallback may serve a request instead of the route before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Condition {
    /// The route answered 5xx (or an "overloaded" status) after the retry layer gave up.
    Provider5xx,
    /// The route answered 429 after the retry policy gave up.
    RateLimited,
    /// The route could not take the request at all: its shared store was unavailable and
    /// fail-closed (or its breaker open), or its provider could not be reached (a connect
    /// failure: the request was never sent).
    PrimaryUnavailable,
    /// Decided before waiting: the route's budget cannot admit the request within this
    /// duration. With `Duration::ZERO`, a request the route cannot admit at once goes to the
    /// fallback without queueing on the route.
    WouldWaitLongerThan(Duration),
    /// Decided before sending: the request's estimated tokens exceed the route's context
    /// window ([`Route::context_window`](super::Route::context_window)), and fit the
    /// fallback's.
    ContextLengthNeeded,
    /// Always, for the classes the fallback serves: a degraded route for low-priority work
    /// (batch to a cheaper model, say). Decided before sending.
    Degrade,
    /// The route's service tier had no capacity (OpenAI flex's 429 "Resource Unavailable",
    /// [`Transient::TierUnavailable`](crate::retry::Transient::TierUnavailable)) after the
    /// retry policy gave up: a fallback at another tier
    /// ([`Route::service_tier`](super::Route::service_tier)) may serve it. Without this
    /// condition such a 429 counts as [`Condition::RateLimited`].
    TierUnavailable,
    /// The route's budget refused the request, nothing sent, because a cap of spend of its
    /// tenant path ([`Dimension::Spend`](crate::Dimension::Spend)) cannot pay its estimate:
    /// a cheaper route (a cheaper model, or tier) may still fit what is left of the cap.
    SpendCapped,
}

impl Condition {
    /// [`Condition::Provider5xx`].
    pub const fn provider_5xx() -> Self {
        Self::Provider5xx
    }

    /// [`Condition::RateLimited`].
    pub const fn rate_limited() -> Self {
        Self::RateLimited
    }

    /// [`Condition::PrimaryUnavailable`].
    pub const fn primary_unavailable() -> Self {
        Self::PrimaryUnavailable
    }

    /// [`Condition::WouldWaitLongerThan`] `wait`.
    pub const fn would_wait_longer_than(wait: Duration) -> Self {
        Self::WouldWaitLongerThan(crate::timer::capped(wait))
    }

    /// [`Condition::ContextLengthNeeded`].
    pub const fn context_length_needed() -> Self {
        Self::ContextLengthNeeded
    }

    /// [`Condition::SpendCapped`].
    pub const fn spend_capped() -> Self {
        Self::SpendCapped
    }

    /// [`Condition::Degrade`].
    pub const fn degrade() -> Self {
        Self::Degrade
    }

    /// [`Condition::TierUnavailable`].
    pub const fn tier_unavailable() -> Self {
        Self::TierUnavailable
    }
}

/// Why a request was routed where it was: the `reason` label of `llm_fallbacks_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// [`Condition::Provider5xx`].
    Provider5xx,
    /// [`Condition::RateLimited`].
    RateLimited,
    /// [`Condition::PrimaryUnavailable`].
    PrimaryUnavailable,
    /// [`Condition::WouldWaitLongerThan`].
    WouldWait,
    /// [`Condition::ContextLengthNeeded`].
    ContextLength,
    /// [`Condition::Degrade`].
    Degraded,
    /// [`Condition::TierUnavailable`].
    TierUnavailable,
    /// [`Condition::SpendCapped`].
    SpendCapped,
}

impl Reason {
    /// A short lowercase name, stable enough for logs and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Provider5xx => "provider_5xx",
            Self::RateLimited => "rate_limited",
            Self::PrimaryUnavailable => "primary_unavailable",
            Self::WouldWait => "would_wait",
            Self::ContextLength => "context_length",
            Self::Degraded => "degraded",
            Self::TierUnavailable => "tier_unavailable",
            Self::SpendCapped => "spend_capped",
        }
    }

    const fn of(condition: &Condition) -> Self {
        match condition {
            Condition::Provider5xx => Self::Provider5xx,
            Condition::RateLimited => Self::RateLimited,
            Condition::PrimaryUnavailable => Self::PrimaryUnavailable,
            Condition::WouldWaitLongerThan(_) => Self::WouldWait,
            Condition::ContextLengthNeeded => Self::ContextLength,
            Condition::Degrade => Self::Degraded,
            Condition::TierUnavailable => Self::TierUnavailable,
            Condition::SpendCapped => Self::SpendCapped,
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// When a fallback may be used: its conditions (any of them) and the classes it serves.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_llm_quota::Priority;
/// use tower_llm_quota::routing::{Condition, Fallback};
///
/// // Interactive work only, when the primary fails or would keep it waiting 300 ms.
/// let when = Fallback::when(Condition::provider_5xx())
///     .or(Condition::would_wait_longer_than(Duration::from_millis(300)))
///     .classes(&[Priority::Interactive]);
/// # let _ = when;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    conditions: Vec<Condition>,
    /// By [`Priority::index`].
    classes: [bool; 3],
}

impl Fallback {
    /// A fallback used under `condition`, for every class.
    pub fn when(condition: Condition) -> Self {
        Self {
            conditions: vec![condition],
            classes: [true; 3],
        }
    }

    /// Also used under `condition`.
    pub fn or(mut self, condition: Condition) -> Self {
        if !self.conditions.contains(&condition) {
            self.conditions.push(condition);
        }
        self
    }

    /// Serves only requests of these classes (of the request's [`Priority`], async when it
    /// has none). Defaults to every class; an empty list serves none.
    pub fn classes(self, classes: &[Priority]) -> Self {
        let mut set = [false; 3];
        for class in classes {
            set[class.index()] = true;
        }
        Self {
            classes: set,
            ..self
        }
    }

    /// The conditions, in the order given.
    pub fn conditions(&self) -> &[Condition] {
        &self.conditions
    }

    /// Whether requests of `class` may use this fallback.
    pub fn serves(&self, class: Priority) -> bool {
        self.classes[class.index()]
    }

    /// The reason to use this fallback after the route before it failed with `failure`: a
    /// tier without capacity is also a rate limit to a fallback that does not name it.
    pub(crate) fn after(&self, failure: Reason) -> bool {
        self.conditions.iter().any(|c| {
            let reason = Reason::of(c);
            reason == failure
                || (failure == Reason::TierUnavailable
                    && reason == Reason::RateLimited
                    && !self.has(Condition::TierUnavailable))
        })
    }

    /// The shortest wait this fallback accepts on the route before it, if it has one.
    pub(crate) fn max_wait(&self) -> Option<Duration> {
        self.conditions
            .iter()
            .filter_map(|c| match c {
                Condition::WouldWaitLongerThan(d) => Some(*d),
                _ => None,
            })
            .min()
    }

    pub(crate) fn has(&self, condition: Condition) -> bool {
        self.conditions.contains(&condition)
    }
}

/// The failure a final answer of a route stands for, if a fallback may take the request
/// over: a 5xx or a 429 (the retry layer sits inside the route, so a final one means it gave
/// up); a 429 whose retries ended on a tier without capacity (its `report`'s
/// [`last_class`](RetryReport::last_class)) is [`Reason::TierUnavailable`].
pub(crate) fn failed_answer(status: StatusCode, report: Option<&RetryReport>) -> Option<Reason> {
    let tier = FailureClass::Transient(Transient::TierUnavailable);
    if status == StatusCode::TOO_MANY_REQUESTS
        && report.and_then(RetryReport::last_class) == Some(tier)
    {
        return Some(Reason::TierUnavailable);
    }
    if status == StatusCode::TOO_MANY_REQUESTS {
        Some(Reason::RateLimited)
    } else if status.is_server_error() || status.as_u16() == 529 {
        Some(Reason::Provider5xx)
    } else {
        None
    }
}

/// The failure an error of a route stands for, if the request may go elsewhere: only when it
/// never reached the provider ([`Ambiguity::may_route_elsewhere`]), and the route could not
/// take it (its store unavailable, its provider unreachable, or a cap of spend of its tenant
/// path spent for its estimate).
pub(crate) fn failed_error(error: &BoxError) -> Option<Reason> {
    if let Some(error) = error.downcast_ref::<Error>() {
        if error.is_store_unavailable() {
            return Some(Reason::PrimaryUnavailable);
        }
        let spend_capped = error.tenant_refused().is_some_and(|refused| {
            matches!(
                refused.reason(),
                Refusal::PeriodCap {
                    dimension: Dimension::Spend,
                    ..
                }
            )
        });
        if spend_capped {
            return Some(Reason::SpendCapped);
        }
        if error.is_local() {
            // Any other local decision (too large, deadline, queue full) is the route's
            // refusal to report, not a failure of the route.
            return None;
        }
    }
    Ambiguity::of_error(&**error)
        .may_route_elsewhere()
        .then_some(Reason::PrimaryUnavailable)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed_answer_of(status: StatusCode) -> Option<Reason> {
        failed_answer(status, None)
    }
    use std::io;

    #[test]
    fn statuses_name_their_condition() {
        assert_eq!(
            failed_answer_of(StatusCode::TOO_MANY_REQUESTS),
            Some(Reason::RateLimited)
        );
        assert_eq!(
            failed_answer_of(StatusCode::BAD_GATEWAY),
            Some(Reason::Provider5xx)
        );
        assert_eq!(
            failed_answer_of(StatusCode::from_u16(529).unwrap()),
            Some(Reason::Provider5xx)
        );
        assert_eq!(failed_answer_of(StatusCode::BAD_REQUEST), None);
        assert_eq!(failed_answer_of(StatusCode::OK), None);
    }

    #[test]
    fn a_spent_cap_of_spend_goes_to_a_cheaper_route_and_a_cap_of_tokens_does_not() {
        use crate::tenant::{CapWindow, TenantRefused};
        let capped = |dimension| -> BoxError {
            let refused = TenantRefused {
                scope: "team".parse().unwrap(),
                reason: Refusal::PeriodCap {
                    dimension,
                    window: CapWindow::CalendarMonthUtc,
                    cap: 100,
                    used: 90,
                    resets_at: std::time::UNIX_EPOCH,
                    soft: false,
                },
            };
            Box::new(Error::tenant_refused_by(Box::new(refused)))
        };
        assert_eq!(
            failed_error(&capped(Dimension::Spend)),
            Some(Reason::SpendCapped)
        );
        assert_eq!(failed_error(&capped(Dimension::TotalTokens)), None);
    }

    #[test]
    fn only_errors_that_never_reached_the_provider_go_elsewhere() {
        let refused: BoxError =
            Box::new(io::Error::new(io::ErrorKind::ConnectionRefused, "refused"));
        let reset: BoxError = Box::new(io::Error::new(io::ErrorKind::ConnectionReset, "reset"));
        assert_eq!(failed_error(&refused), Some(Reason::PrimaryUnavailable));
        assert_eq!(failed_error(&reset), None);
        let local: BoxError = Box::new(Error::missing_cost());
        assert_eq!(failed_error(&local), None);
        let closed: BoxError = Box::new(Error::from(crate::error::ReserveError::Unavailable(
            crate::budget::StoreUnavailable::new("the breaker is open"),
        )));
        assert_eq!(failed_error(&closed), Some(Reason::PrimaryUnavailable));
    }

    #[test]
    fn classes_and_conditions() {
        let fallback = Fallback::when(Condition::Provider5xx)
            .or(Condition::would_wait_longer_than(Duration::from_secs(2)))
            .or(Condition::would_wait_longer_than(Duration::from_millis(5)))
            .classes(&[Priority::Interactive]);
        assert!(fallback.serves(Priority::Interactive));
        assert!(!fallback.serves(Priority::Batch));
        assert!(fallback.after(Reason::Provider5xx));
        assert!(!fallback.after(Reason::RateLimited));
        assert_eq!(fallback.max_wait(), Some(Duration::from_millis(5)));
        assert!(
            Fallback::when(Condition::Degrade)
                .classes(&[])
                .conditions()
                .len()
                == 1
        );
        assert!(
            !Fallback::when(Condition::Degrade)
                .classes(&[])
                .serves(Priority::Async)
        );
    }
}
