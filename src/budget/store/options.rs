//! How a budget uses its store: the public builder over the engine's options.

use std::time::Duration;

use super::FailurePolicy;
use super::state::{LeaseOptions, PIPELINE, RemoteOptions};
use crate::timer::capped;

/// How a budget kept in a [`QuotaStore`](super::QuotaStore) asks it, and what it does when the
/// store does not answer; passed to [`Budget::with_store`](crate::Budget::with_store).
///
/// ```
/// use std::time::Duration;
/// use tower_llm_quota::budget::store::StoreOptions;
///
/// let options = StoreOptions::new()
///     .timeout(Duration::from_millis(50))
///     .expected_instances(4)
///     .leased_shares(Duration::from_millis(100));
/// assert_eq!(options.get_timeout(), Duration::from_millis(50));
/// ```
#[derive(Debug, Clone, Copy)]
pub struct StoreOptions {
    options: RemoteOptions,
    reachable: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl StoreOptions {
    /// The defaults: a 50 ms timeout, a local fallback holding half of the quota, a breaker
    /// opening after 3 failures for 500 ms, 8 questions in flight, one question per admission
    /// (no leases), a heartbeat every 500 ms.
    pub fn new() -> Self {
        Self {
            options: RemoteOptions {
                policy: FailurePolicy::default(),
                timeout: Duration::from_millis(50),
                breaker_threshold: 3,
                breaker_open_for: Duration::from_millis(500),
                pipeline: PIPELINE,
                leases: None,
                heartbeat: Duration::from_millis(500),
            },
            reachable: true,
        }
    }

    /// The longest an admission waits for the store before the failure policy applies
    /// (default 50 ms). Also bounds each background settlement.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.options.timeout = capped(timeout);
        self
    }

    /// The timeout set.
    pub fn get_timeout(&self) -> Duration {
        self.options.timeout
    }

    /// The most admission questions on their way to the store at once while it admits them
    /// (default 8); while it refuses, one at a time, the head's. With more than one, a later,
    /// smaller request may be admitted while an earlier, larger one asked just before it
    /// finds its cost missing (at most this many of them, and only as capacity runs out);
    /// with 1, the store admits exactly in the ordering's order, at one round trip per
    /// admission. Clamped to at least 1.
    pub fn questions_in_flight(mut self, questions: usize) -> Self {
        self.options.pipeline = questions.max(1);
        self
    }

    /// What to do when the store does not answer (default: a local fallback holding half of
    /// the quota; see [`expected_instances`](Self::expected_instances)).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.options.policy = policy;
        self
    }

    /// The failure policy set.
    pub fn get_failure_policy(&self) -> FailurePolicy {
        self.options.policy
    }

    /// How many processes are expected to share the quota: while the store is out of reach, each
    /// falls back to `1 / n` of it, `n` the live processes the store last counted, and
    /// `1 / instances` before it has ([`FailurePolicy::live_share`]), so together they stay
    /// within it.
    pub fn expected_instances(self, instances: u32) -> Self {
        self.failure_policy(FailurePolicy::live_share(instances))
    }

    /// Admits from shares leased from the account, renewed every `refresh` (and sooner when
    /// requests wait), instead of asking the store per admission; a grant lasts three
    /// refreshes. The store must implement [`QuotaStore::lease`](super::QuotaStore::lease).
    /// A `refresh` of zero counts as one millisecond.
    pub fn leased_shares(mut self, refresh: Duration) -> Self {
        let refresh = capped(refresh).max(Duration::from_millis(1));
        self.options.leases = Some(LeaseOptions {
            refresh,
            lease: capped(refresh.saturating_mul(3)),
        });
        self
    }

    /// Whether admissions come from leased shares.
    pub fn is_leasing(&self) -> bool {
        self.options.leases.is_some()
    }

    /// The circuit breaker: it opens after `failures` failures in a row, and lets one probe
    /// through every `open_for` (defaults 3 and 500 ms).
    pub fn breaker(mut self, failures: u32, open_for: Duration) -> Self {
        self.options.breaker_threshold = failures;
        self.options.breaker_open_for = capped(open_for);
        self
    }

    /// How often the budget renews its process's lease on the slots it holds
    /// ([`QuotaStore::heartbeat`](super::QuotaStore::heartbeat)) and reads the store's pauses
    /// (default 500 ms; at most a second, at least a millisecond).
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.options.heartbeat = every.clamp(Duration::from_millis(1), Duration::from_secs(1));
        self
    }

    /// Whether the store answered before the budget was made (default `true`). A budget made
    /// with `false` starts with its breaker open: the first admissions use the failure
    /// policy at once, and a probe looks for the store.
    pub fn reachable(mut self, reachable: bool) -> Self {
        self.reachable = reachable;
        self
    }

    pub(crate) fn engine(&self) -> (RemoteOptions, bool) {
        (self.options, self.reachable)
    }
}
