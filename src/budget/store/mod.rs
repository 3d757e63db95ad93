//! The store that keeps a budget's quota for several processes: the seam, and what a budget
//! does when its store fails.
//!
//! A budget kept in a store ([`Budget::with_store`](crate::Budget::with_store)) keeps its wait
//! queue in the process, as an in-memory one does, but asks the store for every admission in
//! one asynchronous round trip (or, leasing, for a share of the account now and then).
//! Settlements and provider reports are sent in the background: they are idempotent, so they
//! may be retried. When the store cannot answer in time, a [`FailurePolicy`] decides: admit
//! from a local share of the quota, or refuse with a [`StoreUnavailable`] error. A circuit
//! breaker stops asking a store that keeps failing, and lets one probe through from time to
//! time to notice its return.
//!
//! # Implementing a store
//!
//! A store is a [`QuotaStore`]: each method is one atomic call, answered by a boxed future
//! ([`StoreFuture`]). The Redis store of the `tower-llm-quota-redis` crate is one, written
//! against this module alone; a store over Postgres or DynamoDB would be another. What every
//! store must keep, whatever its medium:
//!
//! - **All or nothing.** A reservation takes its cost from every limit it touches (the
//!   account's and its tenant path's) or from none, and a denial writes nothing.
//! - **Idempotent settlements.** A settlement carries the reservation's id; a duplicate neither
//!   refunds nor charges twice, so the budget retries them freely.
//! - **Conservative under failure.** A reply lost after the write must leave the store having
//!   counted the reservation (capacity unused for a while, never spent twice).
//! - **One clock.** Refill is computed from the store's own clock, never a caller's.
//!
//! The crate's tests run the shared-store suite against a store over a mutex (in a few dozen
//! lines) as well as against Redis; [`fleet`] is the reference arithmetic of leases, which a
//! store that leases shares must match.

pub(crate) mod client;
pub mod fleet;
pub(crate) mod lease;
mod options;
pub(crate) mod state;

pub use options::StoreOptions;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub use crate::budget::memory::bucket::Floor;
use crate::cost::Cost;
use crate::error::StoreUnavailable;
use crate::priority::Priority;
use crate::quota::Limit;
use crate::tenant::{PeriodCap, Tenant};

/// A boxed, sendable future: the shape of the shared store's answers.
pub type StoreFuture<T> = Pin<Box<dyn Future<Output = Result<T, StoreUnavailable>> + Send>>;

/// What a store answered to a reservation ([`QuotaStore::reserve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// Every limit paid.
    Admitted,
    /// Nothing was taken; the cost fits in `wait` at the earliest, `limit` (an index into the
    /// limits asked about) being the one that refills the longest. `floor_only`: every bucket
    /// holds the cost, only the floor it must leave keeps it out.
    Denied {
        /// How long until the cost fits, by the store's clock.
        wait: Duration,
        /// The limit that refills the longest: an index into the account's limits, then the
        /// path's.
        limit: usize,
        /// Every bucket holds the cost; only the floor keeps it out.
        floor_only: bool,
        /// The process is first in the store's line: nobody else takes what it waits for,
        /// so it asks again exactly then (no jitter).
        first: bool,
    },
    /// The cost exceeds the capacity of `limit` (an index into the limits asked about).
    TooLarge {
        /// An index into the account's limits, then the path's.
        limit: usize,
    },
    /// The node at `depth` of the request's tenant path is paused in the store (by any
    /// process): refused, nothing taken.
    Paused {
        /// The paused node's depth on the path (0: the top).
        depth: usize,
    },
    /// The daily cap `control` (an index into the path's controls) is spent: `used` of it
    /// in the current day, as the store counts it for every process. Refused, nothing taken.
    DayCapped {
        /// An index into the path's controls.
        control: usize,
        /// What the period used, over every process.
        used: u64,
    },
    /// Every slot of the in-flight cap `control` (an index into the path's controls) is held
    /// by a live process: nothing taken; a slot comes back when a call ends or its process's
    /// lease on it expires.
    NoSlot {
        /// An index into the path's controls.
        control: usize,
    },
}

/// One reservation to settle: `actual` replaces `reserved` in every limit of `limits`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settle {
    /// The reservation's id, as [`QuotaStore::reserve`] received it: unique over every
    /// process; a second settlement of one id changes nothing.
    pub id: String,
    /// What was reserved.
    pub reserved: Cost,
    /// What was used: refunded or charged against `reserved`.
    pub actual: Cost,
    /// The account's limits the reservation was taken from.
    pub limits: Arc<[Limit]>,
    /// The limits of the tenant nodes on the reservation's path, each under its node.
    pub path: PathLimits,
}

/// What a store keeps of a tenant path, checked and taken in the same atomic call as
/// the account's buckets.
pub type PathLimits = Arc<StorePath>;

/// The nodes of a tenant path as a store keeps them, from the top.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct StorePath {
    /// The limits of the nodes, each with its node: buckets beside the account's.
    pub limits: Vec<(Tenant, Limit)>,
    /// The controls of the nodes that hold for every process: their daily caps and their
    /// caps on calls in flight.
    pub controls: Vec<(Tenant, Control)>,
}

/// A control of a tenant node kept in a store. Not `non_exhaustive` on purpose: a store
/// must hold every control, and one added later is a change every store must make (a store
/// that ignored it would admit more than the control allows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// At most this many calls in flight over every process: a slot per call, held under
    /// its process's lease (see [`QuotaStore::heartbeat`]).
    InFlight(std::num::NonZeroUsize),
    /// At most this much of a dimension per day, counted for every process.
    Daily(PeriodCap),
}

/// What a leasing process tells the store at a renewal.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Demand {
    /// The renewal's number: higher than every earlier renewal of the process, so that the
    /// store ignores one that arrives after a later one.
    pub seq: u64,
    /// The fraction of the account it wants, in `[0, 1]`; negative: it leaves.
    pub want: f64,
    /// Its flows with requests waiting: each flow's key and weight.
    pub flows: Vec<(u64, u32)>,
    /// Its tenants' guarantees with requests waiting: each guarantee's key and its share of
    /// the account in millionths.
    pub guarantees: Vec<(u64, u32)>,
    /// Per account limit, its report of what it holds and what it asks for.
    pub reports: Vec<Report>,
}

pub use fleet::Report;

impl Demand {
    /// The process stops leasing, giving back what it holds (`reports`).
    pub(crate) fn leave(seq: u64, reports: Vec<Report>) -> Self {
        Self {
            seq,
            want: -1.0,
            flows: Vec::new(),
            guarantees: Vec::new(),
            reports,
        }
    }
}

/// How the store took a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// Renewed.
    Renewed,
    /// The store did not know the process (its first renewal, or its lease had ended).
    New,
    /// The process left.
    Left,
    /// A later renewal of the process was seen first: nothing changed, nothing granted.
    Stale,
}

/// What the store granted.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    /// How the store took the renewal.
    pub renewal: Renewal,
    /// This process's part of the account at the last division, in `[0, 1]`.
    pub part: f64,
    /// How long the grant lasts, counted from when it was asked.
    pub lease: Duration,
    /// Per account limit asked about, how long a provider's pause still holds it.
    pub holds: Vec<Duration>,
    /// Per account limit asked about, the share of its amount the fleet plans for (its
    /// adaptive share, lowered by the provider's 429s; 1 for a fixed share).
    pub plans: Vec<f64>,
    /// Per account limit asked about, the units granted: taken from the account's bucket.
    pub granted: Vec<u64>,
    /// A need not granted should be covered in about this long (zero when granted).
    pub ready: Duration,
    /// Per flow told, its weight in this process ([`fleet::local_weights`]; 0 when the last
    /// division did not know it), then per guarantee told, in how many processes it waits.
    pub spread: Vec<u32>,
}

/// The operations a shared quota store performs, each as one atomic call.
///
/// Reservation ids are unique across every process sharing the store. Settlements are
/// idempotent: a duplicate neither refunds nor charges twice, so callers may retry them.
pub trait QuotaStore: Send + Sync + fmt::Debug + 'static {
    /// Reserves `cost` in every limit of `limits` it touches, leaving `floor` of each, and in
    /// every limit of the tenant nodes of `path` (leaving nothing), or nothing. A denial or a
    /// refusal naming a limit past `limits` names one of `path`'s, in order.
    ///
    /// `id` is `<process>-<n>`: a store may keep the processes refused for want of the
    /// account's capacity in line, by `class` then by arrival, and refuse the others while the
    /// first is expected back, so that every process's head gets its turn.
    ///
    /// A request of `tenant` is refused ([`Decision::Paused`]) when a node of its path is
    /// paused in the store, or ([`Decision::DayCapped`]) when a daily cap of `path` is spent;
    /// it waits ([`Decision::NoSlot`]) when every slot of a cap on calls in flight is held.
    /// Admitted, it counts in the path's daily caps and holds a slot of each cap on calls in
    /// flight until it is settled.
    #[allow(
        clippy::too_many_arguments,
        reason = "one atomic call: everything it checks"
    )]
    fn reserve(
        &self,
        id: String,
        cost: Cost,
        floor: Floor,
        class: Priority,
        limits: Arc<[Limit]>,
        path: PathLimits,
        tenant: Option<Tenant>,
    ) -> StoreFuture<Decision>;

    /// Pauses (or resumes) the tenant node `scope` for every process sharing the store.
    fn set_paused(&self, scope: Tenant, paused: bool) -> StoreFuture<()>;

    /// The tenant nodes paused in the store, or `None` for a store that keeps no pauses.
    fn paused(&self) -> StoreFuture<Option<Vec<Tenant>>>;

    /// Settles every reservation of `batch`, in one call.
    fn settle(&self, batch: Vec<Settle>) -> StoreFuture<()>;

    /// Lowers `limit`'s level to `remaining` units, and holds it (admits nothing in it,
    /// keeping its level) for `pause`: a later end extends a hold, an earlier one never
    /// shortens it.
    fn lower(&self, limit: Limit, remaining: Option<u64>, pause: Duration) -> StoreFuture<()>;

    /// Ends the holds of `limits` now, for every process.
    fn lift(&self, limits: Vec<Limit>) -> StoreFuture<()>;

    /// What each of `caps` (a tenant node's daily cap) has used in its current day, as the
    /// store counts it for every process; `None` for a store that keeps no days.
    fn days(&self, caps: Vec<(Tenant, PeriodCap)>) -> StoreFuture<Option<Vec<u64>>> {
        let _ = caps;
        Box::pin(async { Ok(None) })
    }

    /// Renews `process`'s lease on the account: the in-flight slots it holds
    /// ([`Control::InFlight`]) stay its own while it renews (a process that stops, having
    /// died, loses them when its lease ends). Returns how many processes' leases on the
    /// account are current, this one's included (what [`FailurePolicy::LiveShare`] divides
    /// by), or `None` from a store that does not count them (the default: it does nothing).
    fn heartbeat(&self, process: u64) -> StoreFuture<Option<u32>> {
        let _ = process;
        Box::pin(async { Ok(None) })
    }

    /// Leases `process` a share of the account's `limits` for `lease`, by what it wants
    /// (`demand`) and what every other live lease wants (the arithmetic is [`fleet`]'s). A
    /// `demand` that leaves gives the share back.
    fn lease(
        &self,
        process: u64,
        lease: Duration,
        limits: Arc<[Limit]>,
        demand: Demand,
    ) -> StoreFuture<Grant> {
        let _ = (process, lease, limits, demand);
        Box::pin(async { Err(StoreUnavailable::new("this store does not lease shares")) })
    }
}

/// What a shared budget does when its store does not answer within its timeout.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Admit from a bucket in this process holding `share` (in `(0, 1]`) of every limit, until
    /// the store answers again. With `n` processes sharing the quota, a share of `1 / n` keeps
    /// their sum within it. A share above 1 counts as 1; zero, negative or NaN as the smallest
    /// share (one unit of each limit).
    LocalFallback {
        /// The fraction of each limit this process may spend alone.
        share: f64,
    },
    /// Admit from a bucket in this process holding `1 / n` of every limit, `n` the number of
    /// live processes on the account the store counted at its last heartbeat
    /// ([`QuotaStore::heartbeat`], every [`StoreOptions::heartbeat`]), this one included, and
    /// `1 / expected` before it has counted (a process that never reached the store). So the
    /// fleet's local shares add up to about the account whatever its size: a process that
    /// died since the last count only leaves capacity unused; one that joined while the
    /// store was away takes `1 / expected` more. A store that does not count keeps
    /// `1 / expected`.
    LiveShare {
        /// The processes assumed before the store has counted them (0 counts as 1).
        expected: u32,
    },
    /// Refuse: the reservation fails with [`StoreUnavailable`].
    FailClosed,
}

impl FailurePolicy {
    /// A local fallback holding `1 / instances` of the quota, whatever the fleet's size.
    pub fn local_share_of(instances: u32) -> Self {
        FailurePolicy::LocalFallback {
            share: 1.0 / f64::from(instances.max(1)),
        }
    }

    /// A local fallback holding `1 / n` of the quota, `n` the live processes the store last
    /// counted (`expected` before it has): [`FailurePolicy::LiveShare`].
    pub fn live_share(expected: u32) -> Self {
        FailurePolicy::LiveShare { expected }
    }

    /// The local share this policy admits from with `live` processes last counted (`None`:
    /// not counted yet), or `None` when it refuses.
    pub fn share_with(self, live: Option<u32>) -> Option<f64> {
        match self {
            FailurePolicy::LocalFallback { share } => Some(share),
            FailurePolicy::LiveShare { expected } => {
                Some(1.0 / f64::from(live.unwrap_or(expected).max(1)))
            }
            FailurePolicy::FailClosed => None,
        }
    }
}

impl Default for FailurePolicy {
    /// A local fallback holding `1 / n` of the quota, `n` the live processes last counted
    /// (two before the first count).
    fn default() -> Self {
        FailurePolicy::live_share(2)
    }
}

/// A circuit breaker over the shared store: pure state, times in nanoseconds of the budget's
/// clock.
///
/// Closed, every admission asks the store. After `threshold` failures in a row it opens for
/// `open_for`: nobody asks. Failures of questions that were all on their way together (one
/// stall of the store, or of this process on a busy machine, ends them at once) count as one:
/// a failure counts only for a question asked after the last one counted. Then one probe
/// asks; its success closes the breaker, its failure opens it again. A probe that neither answers nor is dropped within `open_for` (its caller
/// stopped polling it) no longer holds the others back: another may probe.
#[derive(Debug, Clone)]
pub(crate) struct Breaker {
    threshold: u32,
    open_for: u64,
    failures: u32,
    open_until: Option<u64>,
    /// The probe in flight: its question's id, and when it was asked.
    probe: Option<(u64, u64)>,
    /// The newest question allowed to ask (ids grow).
    newest: u64,
    /// The newest question asked when the last failure was counted: failures of questions up
    /// to it are the same episode.
    episode: u64,
}

impl Breaker {
    pub(crate) fn new(threshold: u32, open_for: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            open_for: crate::budget::memory::store::nanos(open_for),
            failures: 0,
            open_until: None,
            probe: None,
            newest: 0,
            episode: 0,
        }
    }

    /// Opens the breaker at once: the store is known to be out of reach.
    pub(crate) fn open(&mut self, now: u64) {
        self.failures = self.threshold;
        self.open_until = Some(now);
    }

    /// Whether the question `id` may ask the store now; the first one after the breaker
    /// opened is the probe.
    pub(crate) fn allow(&mut self, id: u64, now: u64) -> bool {
        let allowed = self.may_ask(id, now);
        if allowed {
            self.newest = self.newest.max(id);
        }
        allowed
    }

    fn may_ask(&mut self, id: u64, now: u64) -> bool {
        match self.open_until {
            None => true,
            Some(until) if now >= until => {
                let stale = |(_, asked): (u64, u64)| now >= asked.saturating_add(self.open_for);
                if self.probe.is_none_or(stale) {
                    self.probe = Some((id, now));
                    true
                } else {
                    false
                }
            }
            Some(_) => false,
        }
    }

    /// Whether the breaker lets admissions through without a probe.
    pub(crate) fn is_closed(&self) -> bool {
        self.open_until.is_none()
    }

    pub(crate) fn succeeded(&mut self) {
        self.failures = 0;
        self.open_until = None;
        self.probe = None;
    }

    /// The question `id` failed; it counts unless it was asked before the last failure
    /// counted (the same episode).
    pub(crate) fn failed(&mut self, id: u64, now: u64) {
        if id <= self.episode {
            return;
        }
        self.episode = self.newest.max(id);
        self.failures = self.failures.saturating_add(1);
        if self.probe.is_some() || self.failures >= self.threshold {
            self.open_until = Some(now.saturating_add(self.open_for));
            self.probe = None;
        }
    }

    /// The question `id` was abandoned (its caller left): if it was the probe, the next
    /// caller probes instead.
    pub(crate) fn abandoned(&mut self, id: u64) {
        if self.probe.is_some_and(|(probe, _)| probe == id) {
            self.probe = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn opens_after_the_threshold_then_lets_one_probe_through() {
        let mut breaker = Breaker::new(3, Duration::from_millis(500));
        assert!(breaker.allow(1, 0));
        breaker.failed(1, 0);
        assert!(breaker.allow(2, 0));
        breaker.failed(2, 0);
        assert!(breaker.allow(3, 0), "two failures: still closed");
        breaker.failed(3, 10 * MS);
        assert!(!breaker.allow(4, 10 * MS));
        assert!(!breaker.allow(5, 509 * MS));
        assert!(breaker.allow(6, 510 * MS), "the probe");
        assert!(!breaker.allow(7, 510 * MS), "one probe at a time");
        breaker.failed(6, 520 * MS);
        assert!(
            !breaker.allow(8, 1_000 * MS),
            "a failed probe opens it again"
        );
        assert!(breaker.allow(9, 1_020 * MS));
        breaker.succeeded();
        assert!(breaker.is_closed());
        assert!(breaker.allow(10, 1_020 * MS) && breaker.allow(11, 1_020 * MS));
    }

    #[test]
    fn questions_that_fail_together_count_once() {
        let mut breaker = Breaker::new(3, Duration::from_millis(500));
        for id in 1..=8 {
            assert!(breaker.allow(id, 0));
        }
        // One stall ends all eight questions on their way: one failure.
        for id in 1..=8 {
            breaker.failed(id, 250 * MS);
        }
        assert!(breaker.allow(9, 255 * MS), "one episode: still closed");
        assert!(breaker.allow(10, 255 * MS));
        breaker.failed(9, 505 * MS);
        breaker.failed(10, 505 * MS);
        assert!(breaker.allow(11, 510 * MS), "two episodes: still closed");
        breaker.failed(11, 760 * MS);
        assert!(!breaker.allow(12, 760 * MS), "three episodes open it");
    }

    #[test]
    fn a_success_resets_the_count() {
        let mut breaker = Breaker::new(2, Duration::from_millis(500));
        assert!(breaker.allow(1, 0));
        breaker.failed(1, 0);
        breaker.succeeded();
        assert!(breaker.allow(2, 0));
        breaker.failed(2, 0);
        assert!(breaker.allow(3, 0));
    }

    #[test]
    fn only_the_probe_abandoned_gives_its_turn() {
        let mut breaker = Breaker::new(1, Duration::from_millis(100));
        assert!(breaker.allow(1, 0));
        breaker.failed(1, 0);
        assert!(breaker.allow(2, 100 * MS));
        breaker.abandoned(3);
        assert!(
            !breaker.allow(4, 100 * MS),
            "another question left, not the probe"
        );
        breaker.abandoned(2);
        assert!(breaker.allow(5, 100 * MS));
    }

    #[test]
    fn a_probe_never_answered_lets_another_probe_after_a_while() {
        let mut breaker = Breaker::new(1, Duration::from_millis(100));
        assert!(breaker.allow(1, 0));
        breaker.failed(1, 0);
        assert!(breaker.allow(2, 100 * MS));
        assert!(!breaker.allow(3, 199 * MS));
        assert!(breaker.allow(4, 200 * MS), "the first probe is stale");
    }

    #[test]
    fn opened_at_once_when_the_store_is_known_out_of_reach() {
        let mut breaker = Breaker::new(3, Duration::from_millis(100));
        breaker.open(50 * MS);
        assert!(!breaker.is_closed());
        assert!(breaker.allow(1, 50 * MS), "a probe right away");
        assert!(!breaker.allow(2, 50 * MS));
    }
}
