//! A deadline for a wait, armed only if the wait happens.

use std::pin::Pin;
use std::task::Context;

use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep, sleep_until};

pin_project! {
    /// A deadline whose timer is created on the first wait, so requests that never wait never
    /// touch the timer wheel. Dropping it cancels the timer.
    #[derive(Debug)]
    pub(crate) struct DeadlineTimer {
        deadline: Option<Instant>,
        #[pin]
        sleep: Option<Sleep>,
    }
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
    pub(crate) fn poll_expired(self: Pin<&mut Self>, cx: &mut Context<'_>) -> bool {
        let mut this = self.project();
        let Some(deadline) = *this.deadline else {
            return false;
        };
        if this.sleep.is_none() {
            this.sleep.set(Some(sleep_until(deadline)));
        }
        this.sleep
            .as_pin_mut()
            .is_some_and(|sleep| sleep.poll(cx).is_ready())
    }
}
