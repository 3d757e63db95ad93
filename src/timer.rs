//! A deadline for a wait, armed only if the wait happens.

use std::future::Future;
use std::pin::Pin;
use std::task::Context;
use std::time::Duration;

use tokio::time::{Instant, Sleep, sleep_until};

/// The longest duration the crate acts on: 100 years. Every duration it accepts (a wait, a
/// lease, a time to live, a period, a backoff) is capped at this before it reaches a timer, a
/// store or a sum, so `Duration::MAX` anywhere means "a very long time", never an overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 86_400);

/// `duration`, at most [`MAX_DURATION`]: what a store or a layer may add to an instant
/// without overflow.
///
/// ```
/// use std::time::Duration;
/// use tower_llm_quota::{MAX_DURATION, capped_duration};
///
/// assert_eq!(capped_duration(Duration::MAX), MAX_DURATION);
/// assert_eq!(capped_duration(Duration::from_secs(5)), Duration::from_secs(5));
/// ```
pub const fn capped(duration: Duration) -> Duration {
    if duration.as_secs() >= MAX_DURATION.as_secs() {
        MAX_DURATION
    } else {
        duration
    }
}

/// `from + wait`, or as late as can be represented: `Duration::MAX` means no limit, and
/// deadline arithmetic never overflows.
///
/// ```
/// use std::time::Duration;
/// use tower_llm_quota::saturating_deadline;
///
/// let now = tokio::time::Instant::now();
/// assert!(saturating_deadline(now, Duration::MAX) > now);
/// assert_eq!(saturating_deadline(now, Duration::from_secs(1)), now + Duration::from_secs(1));
/// ```
pub fn saturating_deadline(from: Instant, wait: Duration) -> Instant {
    from.checked_add(capped(wait))
        .or_else(|| from.checked_add(MAX_DURATION))
        .unwrap_or(from)
}

/// A deadline whose timer is created on the first wait, so requests that never wait never
/// touch the timer wheel nor allocate it. Dropping it cancels the timer.
///
/// The timer lives in a box of its own: a future that holds it stays small for the requests
/// that never wait (most of them), and only a waiting request pays for the allocation.
#[derive(Debug)]
pub(crate) struct DeadlineTimer {
    deadline: Option<Instant>,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl DeadlineTimer {
    /// A timer for `deadline`; `None` never expires.
    pub(crate) fn new(deadline: Option<Instant>) -> Self {
        Self {
            deadline,
            sleep: None,
        }
    }

    /// Whether the deadline has passed; if not, the task is woken when it does.
    pub(crate) fn poll_expired(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(deadline) = self.deadline else {
            return false;
        };
        if Instant::now() >= deadline {
            return true;
        }
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(sleep_until(deadline)));
        sleep.as_mut().poll(cx).is_ready()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_saturate() {
        let now = Instant::now();
        assert!(saturating_deadline(now, Duration::MAX) > now + Duration::from_secs(86_400));
        assert_eq!(
            saturating_deadline(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
    }
}
