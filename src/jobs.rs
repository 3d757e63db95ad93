//! Durable batch jobs, as a job queue reports them: the counts behind `llm_jobs{state}`.
//!
//! A job queue (the batch example uses apalis with its Redis backend) knows how many jobs
//! wait, wait for a not-before time, are done or dead; [`JobCounts::record`] publishes them
//! through the crate's metrics (feature `metrics`), next to the quota's own series, so one
//! dashboard shows a batch's progress and the quota it spends.
//!
//! # Example
//!
//! ```
//! use tower_llm_quota::jobs::JobCounts;
//!
//! let counts = JobCounts { queued: 120, delayed: 3, done: 370, dead: 7 };
//! assert_eq!(counts.total(), 500);
//! assert!(!counts.settled(500));
//! counts.record(); // llm_jobs{state="queued"} 120, ... (a no-op without `metrics`)
//! ```

/// How many jobs are in each state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JobCounts {
    /// Ready, waiting for a worker.
    pub queued: u64,
    /// Waiting for a not-before time (a transient failure rescheduled, or scheduled work).
    pub delayed: u64,
    /// Completed, with a stored result.
    pub done: u64,
    /// Failed permanently, in the dead-letter set with their error.
    pub dead: u64,
}

impl JobCounts {
    /// All jobs counted (those being worked on are in none of the states).
    pub fn total(&self) -> u64 {
        self.queued
            .saturating_add(self.delayed)
            .saturating_add(self.done)
            .saturating_add(self.dead)
    }

    /// Whether every one of `enqueued` jobs has ended, done or dead.
    pub fn settled(&self, enqueued: u64) -> bool {
        self.done.saturating_add(self.dead) >= enqueued
    }

    /// Sets the gauge `llm_jobs{state}` to each count (feature `metrics`; otherwise nothing).
    pub fn record(&self) {
        crate::observe::jobs(self.queued, self.delayed, self.done, self.dead);
    }
}
