//! What the retry layer did, for the caller and for dashboards.

use std::fmt;
use std::time::Duration;

use http::StatusCode;

use super::failure::FailureClass;

/// What happened to a request that failed at least once; in the final response's extensions,
/// or in the [`Error`](crate::Error) when there was no response.
///
/// Where it is found:
///
/// - **A success after retries** (a 2xx after at least one failed attempt): in the response's
///   extensions, with [`gave_up`](RetryReport::gave_up) `None`, and the last failure's status
///   and class. A success at the first attempt carries no report: look for one with
///   `response.extensions().get::<RetryReport>()` and read its absence as "sent once".
/// - **A final failed response** (a 429 or 5xx the layer stopped retrying, a permanent 4xx):
///   in its extensions, with `gave_up` saying why. A retry of a 429 that the budget then
///   refuses (it learnt from the 429's headers that the request cannot pass, say) ends with
///   that 429, its `last_class` the local refusal.
/// - **No response** (every attempt failed before its head, or a local refusal after any
///   other failure): in the error, through [`Error::retry_report`](crate::Error::retry_report).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryReport {
    pub(crate) attempts: u32,
    pub(crate) waited: Duration,
    pub(crate) last_status: Option<StatusCode>,
    pub(crate) last_class: Option<FailureClass>,
    pub(crate) gave_up: Option<GaveUp>,
    pub(crate) asked_wait: Option<Duration>,
}

impl RetryReport {
    /// Attempts made, the first included.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Time spent waiting between attempts.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// The status of the last failed attempt, if it had a response.
    pub fn last_status(&self) -> Option<StatusCode> {
        self.last_status
    }

    /// How the last failure was classified.
    pub fn last_class(&self) -> Option<FailureClass> {
        self.last_class
    }

    /// Why retrying stopped, if the request finally failed.
    pub fn gave_up(&self) -> Option<GaveUp> {
        self.gave_up
    }

    /// The wait the provider asked for last, if any (above the honoured maximum when
    /// [`GaveUp::WaitTooLong`]).
    pub fn asked_wait(&self) -> Option<Duration> {
        self.asked_wait
    }
}

/// Why the retry layer stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GaveUp {
    /// The failure is not transient.
    Permanent,
    /// The class's maximum number of attempts was reached.
    Attempts,
    /// The next wait would cross the class's maximum total time.
    Time,
    /// The next wait would cross the request's deadline.
    Deadline,
    /// The retry budget (a share of recent traffic) is spent.
    Budget,
    /// The provider asked for a wait beyond the honoured maximum.
    WaitTooLong,
    /// The request's service tier had no capacity, and its class hands that back at once
    /// ([`TierUnavailable::GiveUp`](crate::retry::TierUnavailable::GiveUp)).
    TierUnavailable,
}

impl fmt::Display for GaveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GaveUp::Permanent => "the failure is not transient",
            GaveUp::Attempts => "no attempts left",
            GaveUp::Time => "the next wait would cross the time limit",
            GaveUp::Deadline => "the next wait would cross the deadline",
            GaveUp::Budget => "the retry budget is spent",
            GaveUp::WaitTooLong => "the provider asked for a wait beyond the honoured maximum",
            GaveUp::TierUnavailable => {
                "the service tier has no capacity now, and the class does not wait for it"
            }
        })
    }
}
