//! The types of a budget's shared-store state: what the budget holds under its lock and
//! what it sends its background worker. Their behaviour, and the worker, are in
//! `shared.rs`; kept apart so that the budget's handle names them without depending on the
//! code that uses the handle back.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::budget::store::{Breaker, FailurePolicy, QuotaStore, Settle};
use crate::quota::Limit;

/// How a budget uses its shared store.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RemoteOptions {
    pub(crate) policy: FailurePolicy,
    /// The longest an admission waits for the store's answer.
    pub(crate) timeout: Duration,
    /// Failures in a row that open the breaker.
    pub(crate) breaker_threshold: u32,
    /// How long the breaker stays open before one probe.
    pub(crate) breaker_open_for: Duration,
    /// The most questions on their way to the store at once while it admits.
    pub(crate) pipeline: usize,
    /// Admit from leases taken from the account rather than asking per admission.
    pub(crate) leases: Option<LeaseOptions>,
    /// How often the process renews its lease on its tenant nodes' slots and reads the
    /// store's pauses (a second at most).
    pub(crate) heartbeat: Duration,
}

/// How a budget leases its share of the account (see [`lease`](super::lease)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaseOptions {
    /// How often the share is renewed (and sooner when requests wait for more).
    pub(crate) refresh: Duration,
    /// How long a grant lasts without renewal.
    pub(crate) lease: Duration,
}

/// A leasing budget's last report and the limits it is about.
pub(crate) type Parting = (Arc<[Limit]>, super::Demand);

/// The handle on the shared store.
#[derive(Debug)]
pub(crate) struct Remote {
    pub(crate) store: Arc<dyn QuotaStore>,
    pub(crate) options: RemoteOptions,
    /// Makes this process's reservation ids unique among every process sharing the store.
    pub(crate) instance: u64,
    pub(crate) commands: mpsc::UnboundedSender<Command>,
    /// Counts this process's pauses and resumes (under the budget's lock): a reading of the
    /// store's pauses started before the last one is stale.
    pub(crate) pause_changes: std::sync::atomic::AtomicU64,
    /// The store's pauses at its last reading.
    pub(crate) pauses_seen: std::sync::Mutex<Vec<crate::tenant::Tenant>>,
    /// Woken when requests wait for a grant: the lease is renewed sooner.
    pub(crate) wants_more: Arc<tokio::sync::Notify>,
    /// Where a leasing budget sends its last report, made as its last handle goes (what it
    /// gives back, on which limits): to its renewal task, which gives it to the store.
    pub(crate) parting: Option<tokio::sync::oneshot::Sender<Option<Parting>>>,
    /// A large part of the account was spent at once (see `LeaseState::spent_much`).
    pub(crate) spent_much: Arc<std::sync::atomic::AtomicBool>,
}

impl LeaseState {
    /// Whether nothing may be admitted at `now`: no grant yet, or the grant ended unrenewed
    /// (this process's renewal is late). The failure policy's local share is never closed.
    pub(crate) fn closed(&self, now: u64) -> bool {
        !self.fallback && self.ends.is_none_or(|end| now >= end)
    }
}

impl Remote {
    /// Whether admissions come from leases rather than a question each.
    pub(crate) fn leases(&self) -> bool {
        self.options.leases.is_some()
    }
}

/// The limits and breaker of a shared budget, under the budget's lock.
#[derive(Debug)]
pub(crate) struct RemoteState {
    pub(crate) limits: Arc<[Limit]>,
    pub(crate) share: f64,
    pub(crate) breaker: Breaker,
    /// Counts the refunds this process made to the store: a wait the store told before the
    /// latest one may be too long.
    pub(crate) refunds: u64,
    /// Questions on their way to the store.
    pub(crate) asking: usize,
    /// The store's last answer was a refusal: until it admits again, one question at a time.
    pub(crate) refused: bool,
    /// The most questions on their way at once while the store admits.
    pub(crate) pipeline: usize,
    /// The live processes on the account at the store's last count (its heartbeat).
    pub(crate) live: Option<u32>,
    /// Leasing: what was spent since the last renewal, and when the lease ends (nanoseconds
    /// on the budget's clock).
    pub(crate) lease: Option<LeaseState>,
}

/// A leasing budget's account of its lease. What it holds is its buckets, as wallets (see
/// [`lease`](super::lease)).
#[derive(Debug, Clone, Default)]
pub(crate) struct LeaseState {
    /// What was admitted since the last renewal.
    pub(crate) spent: crate::cost::Cost,
    /// When the grant ends (nanoseconds on the budget's clock): admissions stop then. `None`
    /// before the first grant.
    pub(crate) ends: Option<u64>,
    /// The lease ended with its renewals failing: the failure policy's local share admits
    /// (refilling buckets, not wallets) until a renewal.
    pub(crate) fallback: bool,
    /// The lease ended with its renewals failing under [`FailurePolicy::FailClosed`]: requests
    /// are refused as the store's unavailability until a renewal.
    pub(crate) unreachable: bool,
    /// The cost of the first waiting request, while what the wallets hold does not cover it:
    /// the next renewal asks for it whole.
    pub(crate) blocked: Option<crate::cost::Cost>,
    /// The number of the last renewal.
    pub(crate) seq: u64,
    /// Its part of the account at the last division (it keeps as much of every burst).
    pub(crate) part: f64,
    /// The renewal period (nanoseconds): how long a request waiting for a grant waits before
    /// it looks again (a grant wakes it sooner).
    pub(crate) refresh: u64,
    /// Wakes the renewal task to renew sooner (the budget's `wants_more`).
    pub(crate) renew_soon: Arc<tokio::sync::Notify>,
    /// Set with `renew_soon` when a large part of the account was spent at once: the store
    /// should learn of it even while grants fall short.
    pub(crate) spent_much: Arc<std::sync::atomic::AtomicBool>,
}

/// Questions a budget may have on their way to its shared store at once while the store
/// admits, by default; while it refuses, one (the head's), so that the store admits in the
/// ordering's order.
pub(crate) const PIPELINE: usize = 8;

/// Work sent to the store in the background.
#[derive(Debug)]
pub(crate) enum Command {
    Settle(Settle),
    Lower {
        limit: Limit,
        remaining: Option<u64>,
        pause: Duration,
    },
    /// Ends the holds of these limits.
    Lift(Vec<Limit>),
    /// Pauses or resumes a tenant node for every process.
    Paused {
        scope: crate::tenant::Tenant,
        paused: bool,
    },
    /// Answered once every settlement sent before it reached the store (or its retries ran
    /// out).
    Flush(tokio::sync::oneshot::Sender<()>),
}
