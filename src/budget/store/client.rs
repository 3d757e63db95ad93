//! The parts of a budget that talk to a shared store: its limits, its breaker, and the
//! background worker that sends settlements and provider reports.
//!
//! Compiled always, used when a shared store is (the `redis` feature).

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::budget::handle::Engine;
use crate::budget::memory::bucket::Floor;
use crate::budget::memory::store::{MemoryStore, Store};
use crate::budget::store::state::{Command, LeaseState, Remote, RemoteOptions, RemoteState};
use crate::budget::store::{
    Breaker, Decision, FailurePolicy, PathLimits, QuotaStore, Settle, StoreFuture,
};
use crate::budget::{Observation, ReservationId};
use crate::cost::Cost;
use crate::error::InsufficientCapacity;
use crate::error::StoreUnavailable;
use crate::priority::Priority;
use crate::quota::{Limit, Quota};
use crate::tenant::Tenant;

/// Tells the budget, if it still exists, that a refund reached the store.
#[derive(Debug, Clone)]
struct Refunded(std::sync::Weak<Engine>);

impl Refunded {
    fn notify(&self) {
        if let Some(engine) = self.0.upgrade() {
            engine.refunded_remotely();
        }
    }

    fn budget(&self) -> Option<Arc<Engine>> {
        self.0.upgrade()
    }
}

/// Renews this process's lease on the account (its slots) and takes the store's count of the
/// live processes ([`FailurePolicy::LiveShare`] follows it); then reads the store's pauses
/// into the budget's tree, unless this process paused or resumed a node since the reading
/// began (the next reading, after that change reached the store, will tell).
async fn sync_with_store(store: &Arc<dyn QuotaStore>, budget: &Refunded, timeout: Duration) {
    let Some(instance) = budget
        .budget()
        .and_then(|b| b.remote.as_ref().map(|r| r.instance))
    else {
        return;
    };
    if let Ok(Some(live)) = bounded(timeout, store.heartbeat(instance)).await {
        if let Some(budget) = budget.budget() {
            budget.live_counted(live);
        }
    }
    let Some(changes) = budget.budget().and_then(|b| b.pause_changes()) else {
        return;
    };
    if let Ok(Some(paused)) = bounded(timeout, store.paused()).await {
        if let Some(budget) = budget.budget() {
            budget.sync_paused(&paused, changes);
        }
    }
    // The day counted for every process, for the snapshots.
    let tenants = budget.budget().and_then(|b| b.lock().tenants.clone());
    let caps = tenants.as_ref().map(|t| t.caps()).unwrap_or_default();
    if let (Some(tenants), false) = (tenants, caps.is_empty()) {
        if let Ok(Some(used)) = bounded(timeout, store.days(caps.clone())).await {
            tenants.set_fleet_days(caps, &used);
        }
    }
}

impl Engine {
    /// A budget whose buckets live in `store`, shared with other processes. Must be called
    /// within a tokio runtime: it spawns the task that sends settlements (the loom models,
    /// which have none, send none).
    ///
    /// When the store is known to be out of reach, the breaker starts open: the first
    /// admissions use the fallback at once, and a probe looks for the store.
    pub(crate) fn with_remote(
        quota: &Quota,
        store: Arc<dyn QuotaStore>,
        options: RemoteOptions,
        reachable: bool,
    ) -> Arc<Self> {
        let share = match (options.leases, options.policy) {
            // Wallets of the account's limits, empty until the first grant (one round trip).
            (Some(_), _) => 1.0,
            (None, policy) => policy.share_with(None).map_or(1.0, valid_share),
        };
        let fallback = quota
            .limits()
            .iter()
            .fold(Quota::new(), |q, limit| q.with_limit(scaled(*limit, share)));
        let (commands, receiver) = mpsc::unbounded_channel();
        let (parting, departure) = tokio::sync::oneshot::channel();
        let worker = store.clone();
        let wants_more: Arc<tokio::sync::Notify> = Arc::default();
        let spent_much: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        let remote = Remote {
            store,
            options,
            instance: instance_id(),
            commands,
            pause_changes: std::sync::atomic::AtomicU64::new(0),
            pauses_seen: std::sync::Mutex::default(),
            wants_more: wants_more.clone(),
            parting: options.leases.map(|_| parting),
            spent_much: spent_much.clone(),
        };
        let mut breaker = Breaker::new(options.breaker_threshold, options.breaker_open_for);
        if !reachable {
            breaker.open(0);
        }
        let shared = RemoteState {
            limits: quota.limits().into(),
            share,
            breaker,
            refunds: 0,
            asking: 0,
            pipeline: options.pipeline.max(1),
            refused: false,
            live: None,
            lease: options.leases.map(|lease| LeaseState {
                refresh: crate::budget::memory::store::nanos(lease.refresh),
                renew_soon: wants_more,
                spent_much,
                ..LeaseState::default()
            }),
        };
        // A leasing budget admits from wallets that only grants fill.
        let store = match options.leases {
            Some(_) => MemoryStore::wallets(quota),
            None => MemoryStore::new(&fallback),
        };
        let budget = Self::new(quota, store, Some(shared), Some(remote));
        let refunded = Refunded(Arc::downgrade(&budget));
        let sending = send_in_background(worker, receiver, options, refunded);
        #[cfg(not(all(test, loom)))]
        tokio::spawn(sending);
        budget.start_leasing(departure);
        #[cfg(not(all(test, loom)))]
        budget.start_claiming();
        // Made but never run: the models send nothing.
        #[cfg(all(test, loom))]
        drop(sending);
        budget
    }

    /// The store counted `live` processes on the account: under
    /// [`FailurePolicy::LiveShare`], the local share becomes `1 / live` (applied at once to
    /// the fallback's buckets; a leasing budget's wallets keep their grants, and its local
    /// share takes it when its lease is lost).
    fn live_counted(&self, live: u32) {
        let Some(remote) = self.remote.as_ref() else {
            return;
        };
        let policy = remote.options.policy;
        let ns = self.nanos_since_origin(tokio::time::Instant::now());
        self.update_state(|state| {
            let Some(shared) = state.remote.as_mut() else {
                return false;
            };
            shared.live = Some(live);
            // Only this policy follows the count; a leasing budget's wallets keep their grants
            // (the share waits for a lost lease).
            let follows = matches!(policy, FailurePolicy::LiveShare { .. });
            let wallets = shared.lease.as_ref().is_some_and(|l| !l.fallback);
            match policy.share_with(Some(live)) {
                Some(share) if follows && !wallets => shared.set_share(share, &mut state.store, ns),
                _ => false,
            }
        });
    }

    /// Whether admissions go through the store: the circuit breaker is closed, and a leasing
    /// budget has not fallen back (or refused) with its lease lost.
    pub(in crate::budget) fn store_reachable(&self) -> bool {
        self.lock().remote.as_ref().is_some_and(|shared| {
            let leased_away = (shared.lease.as_ref()).is_some_and(|l| l.fallback || l.unreachable);
            shared.breaker.is_closed() && !leased_away
        })
    }

    /// A refund reached the shared store: the head of the queue asks again now, rather than
    /// when the store's last wait is over.
    fn refunded_remotely(&self) {
        let mut state = self.lock();
        let head = match state.remote.as_mut() {
            Some(shared) => {
                shared.refunds = shared.refunds.wrapping_add(1);
                shared.refused = false;
                state.queue.head_waker(tokio::time::Instant::now())
            }
            None => None,
        };
        drop(state);
        if let Some(head) = head {
            head.wake();
        }
    }
}

/// An id for this process among those sharing the store: random, mixed with the process id
/// and the time, so that processes seeding `fastrand` alike still differ.
fn instance_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    fastrand::Rng::new().u64(..) ^ (u64::from(std::process::id()) << 32) ^ nanos
}

/// A fallback share in `(0, 1]`: above 1 is the whole quota, and anything else (zero,
/// negative, NaN) the smallest share, a unit of each limit: the safe side.
fn valid_share(share: f64) -> f64 {
    if share >= 1.0 {
        1.0
    } else if share > 0.0 {
        share
    } else {
        f64::MIN_POSITIVE
    }
}

/// `limit` with `share` of its amount and burst, never below one unit.
fn scaled(limit: Limit, share: f64) -> Limit {
    if share >= 1.0 {
        return limit;
    }
    let part =
        |n: u64| NonZeroU64::new(((n as f64) * share).floor() as u64).unwrap_or(NonZeroU64::MIN);
    // The effective amount after headroom and the burst are both scaled: a share of the
    // whole limit.
    let amount = part(limit.amount().get());
    let burst = part(limit.capacity());
    limit.with_amount(amount).with_burst(burst)
}

impl Remote {
    pub(crate) fn policy(&self) -> FailurePolicy {
        self.options.policy
    }

    fn id(&self, id: ReservationId) -> String {
        format!("{:016x}-{}", self.instance, id.get())
    }

    /// `wait`, lengthened by up to a fiftieth (and a millisecond) at random, so that processes
    /// told the same wait do not all ask again at the same instant. Little: while the first
    /// to ask is on its way, the bucket refills for nobody.
    pub(crate) fn jittered(&self, wait: Duration) -> Duration {
        let spread = wait / 50 + Duration::from_millis(1);
        wait.saturating_add(spread.mul_f64(fastrand::f64()))
    }

    pub(crate) fn reserve(
        &self,
        id: ReservationId,
        (cost, floor, class): (Cost, Floor, Priority),
        (limits, path, tenant): (Arc<[Limit]>, PathLimits, Option<Tenant>),
    ) -> StoreFuture<Decision> {
        let call = self
            .store
            .reserve(self.id(id), cost, floor, class, limits, path, tenant);
        bounded(self.options.timeout, call)
    }

    /// Pauses or resumes `scope` in the store, after every pause or lift sent before.
    pub(crate) fn set_paused(&self, scope: Tenant, paused: bool) {
        self.pause_changes
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.send(Command::Paused { scope, paused });
    }

    pub(crate) fn settle(
        &self,
        id: ReservationId,
        reserved: Cost,
        actual: Cost,
        limits: Arc<[Limit]>,
        path: PathLimits,
    ) {
        self.send(Command::Settle(Settle {
            id: self.id(id),
            reserved,
            actual,
            limits,
            path,
        }));
    }

    /// Answered (or closed, if the worker has stopped) once every settlement sent before the
    /// call reached the store, or its retries ran out.
    pub(crate) fn flush(&self) -> tokio::sync::oneshot::Receiver<()> {
        let (done, flushed) = tokio::sync::oneshot::channel();
        self.send(Command::Flush(done));
        flushed
    }

    /// Gives back a reservation that may or may not have been made.
    pub(crate) fn release(
        &self,
        id: ReservationId,
        reserved: Cost,
        limits: Arc<[Limit]>,
        path: PathLimits,
    ) {
        self.settle(id, reserved, Cost::default(), limits, path);
    }

    pub(crate) fn lower(&self, limit: Limit, remaining: Option<u64>, pause: Duration) {
        self.send(Command::Lower {
            limit,
            remaining,
            pause,
        });
    }

    /// Ends the holds of `limits` in the store, after every pause sent before.
    pub(crate) fn lift(&self, limits: Vec<Limit>) {
        self.send(Command::Lift(limits));
    }

    fn send(&self, command: Command) {
        // The worker ends only when every handle on the budget is gone.
        if self.commands.send(command).is_err() {
            tracing::debug!("the shared store's worker has stopped");
        }
    }
}

impl RemoteState {
    pub(crate) fn limits(&self) -> &Arc<[Limit]> {
        &self.limits
    }

    /// Whether one more question may go to the store now.
    pub(crate) fn may_ask(&self) -> bool {
        self.asking == 0 || (!self.refused && self.asking < self.pipeline)
    }

    /// Admits `share` of every limit locally from now on (the fallback's); whether it
    /// changed. Each bucket keeps its level, clamped to its new capacity. A leasing budget's
    /// wallets become refilling buckets, empty.
    pub(crate) fn set_share(&mut self, share: f64, store: &mut MemoryStore, now: u64) -> bool {
        let share = valid_share(share);
        if store.holds_wallets() {
            let quota =
                (self.limits.iter()).fold(Quota::new(), |q, l| q.with_limit(scaled(*l, share)));
            *store = MemoryStore::new(&quota);
            for limit in quota.limits() {
                store.withdraw(limit, limit.capacity(), now);
            }
            self.share = share;
            return true;
        }
        if share == self.share {
            return false;
        }
        self.share = share;
        for limit in self.limits.iter() {
            store.set_limit(self.local(*limit), now);
        }
        true
    }

    /// A leasing budget's wallets again (after the fallback's share): empty, to be filled by
    /// grants.
    pub(crate) fn wallets_again(&mut self, store: &mut MemoryStore) {
        if !store.holds_wallets() {
            self.share = 1.0;
            let quota =
                (self.limits.iter()).fold(Quota::new(), |q, l| q.with_limit(self.local(*l)));
            *store = MemoryStore::wallets(&quota);
        }
    }

    /// This process's part of `limit`: its share, and for a leasing process a fixed one (the
    /// fleet's plan is the limit's adaptive share, kept in the store, not a controller of
    /// each process's own).
    fn local(&self, limit: Limit) -> Limit {
        let local = scaled(limit, self.share);
        match self.lease {
            Some(_) => local.with_headroom(local.headroom()).unwrap_or(local),
            None => local,
        }
    }

    /// Plans each adaptive limit for the fleet's `plans` (in order, a share of its amount);
    /// whether one changed. Its local bucket, this process's share of it, follows.
    pub(crate) fn set_plans(&mut self, plans: &[f64], store: &mut MemoryStore, now: u64) -> bool {
        let mut changed = false;
        let mut limits = self.limits.to_vec();
        for (limit, &plan) in limits.iter_mut().zip(plans) {
            let planned = limit.with_planned_share(plan);
            if limit.adaptive_share().is_some() && planned.headroom() != limit.headroom() {
                *limit = planned;
                changed = true;
            }
        }
        if changed {
            self.limits = limits.into();
            for limit in self.limits.iter() {
                store.set_limit(self.local(*limit), now);
            }
        }
        changed
    }

    /// Replaces (or adds) a shared limit; returns the local fallback's share of it.
    pub(crate) fn set_limit(&mut self, limit: Limit) -> Limit {
        let mut limits = self.limits.to_vec();
        match limits.iter_mut().find(|l| l.same_bucket(&limit)) {
            Some(l) => *l = limit,
            None => limits.push(limit),
        }
        self.limits = limits.into();
        self.local(limit)
    }

    /// Applies a provider's report to the shared limits; returns the levels to lower in the
    /// shared store (each limit with the remaining units it may still use).
    pub(crate) fn observe(&mut self, observation: &Observation) -> Vec<(Limit, u64)> {
        if let Some(amount) = observation.limit() {
            let changed: Vec<Limit> = self
                .limits
                .iter()
                .filter(|l| matches(l, observation) && l.amount() != amount)
                .map(|l| l.with_amount(amount))
                .collect();
            for limit in changed {
                self.set_limit(limit);
            }
        }
        match observation.remaining() {
            Some(remaining) => self
                .limits
                .iter()
                .filter(|l| matches(l, observation))
                .map(|l| (*l, (remaining as f64 * l.headroom()).floor() as u64))
                .collect(),
            None => Vec::new(),
        }
    }

    /// The report as the local fallback share sees it: its limit scaled by the share.
    pub(crate) fn local_observation(&self, observation: &Observation) -> Observation {
        let mut local = Observation::new(observation.dimension(), observation.period());
        if let Some(amount) = observation.limit() {
            let part = ((amount.get() as f64) * self.share).floor() as u64;
            local = local.with_limit(NonZeroU64::new(part).unwrap_or(NonZeroU64::MIN));
        }
        if let Some(remaining) = observation.remaining() {
            // What is left of the whole account, shared like the rest: each process may spend
            // its share of it.
            local = local.with_remaining(((remaining as f64) * self.share).floor() as u64);
        }
        local
    }

    pub(crate) fn check_capacity(
        &self,
        cost: &Cost,
        floor: Floor,
    ) -> Result<(), InsufficientCapacity> {
        for (i, limit) in self.limits.iter().enumerate() {
            let amount = cost.amount(limit.dimension());
            if amount > 0 && amount > usable(limit, floor) {
                return Err(self.too_large(i, cost));
            }
        }
        Ok(())
    }

    /// The error for a cost that exceeds the capacity of the limit at `index`.
    pub(crate) fn too_large(&self, index: usize, cost: &Cost) -> InsufficientCapacity {
        let limit = self.limits[index.min(self.limits.len().saturating_sub(1))];
        InsufficientCapacity {
            dimension: limit.dimension(),
            period: limit.period(),
            cost: cost.amount(limit.dimension()),
            capacity: limit.capacity(),
        }
    }
}

fn matches(limit: &Limit, observation: &Observation) -> bool {
    limit.dimension() == observation.dimension() && limit.period() == observation.period()
}

fn usable(limit: &Limit, floor: Floor) -> u64 {
    limit.capacity() - floor.of(limit.capacity())
}

/// `call`, failing with [`StoreUnavailable`] when it takes longer than `timeout`.
fn bounded<T: Send + 'static>(timeout: Duration, call: StoreFuture<T>) -> StoreFuture<T> {
    // Loom models the locks and wakes, not time: no timer without a runtime.
    #[cfg(all(test, loom))]
    return {
        let _ = timeout;
        call
    };
    #[cfg_attr(all(test, loom), allow(unreachable_code))]
    Box::pin(async move {
        let mut call = call;
        match tokio::time::timeout(timeout, &mut call).await {
            Ok(answer) => answer,
            Err(_) => {
                // On a busy machine the deadline passes while the process waits for a core,
                // the answer already in its socket: after one turn of the runtime (its I/O
                // driver polled, the connection's task run), an answer that came is taken.
                tokio::task::yield_now().await;
                match futures_util::FutureExt::now_or_never(&mut call) {
                    Some(answer) => answer,
                    None => Err(StoreUnavailable::new(format_args!(
                        "no answer within {timeout:?}"
                    ))),
                }
            }
        }
    })
}

/// Settlements sent in one call at most.
const BATCH: usize = 64;

/// Sends settlements and reports in the background. Settlements go one call at a time: those
/// arriving meanwhile wait and go together in the next call, so under load one call settles
/// many. A failed call is retried on its own task (the store's operations are idempotent).
/// Pauses and lifts go to [`in_order`], so that a lift never overtakes an earlier pause.
/// Ends when the budget is dropped.
async fn send_in_background(
    store: Arc<dyn QuotaStore>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    options: RemoteOptions,
    refunded: Refunded,
) {
    let (holds, ordered) = mpsc::unbounded_channel();
    let (timeout, every) = (options.timeout, options.heartbeat);
    tokio::spawn(in_order(
        store.clone(),
        ordered,
        (timeout, every),
        refunded.clone(),
    ));
    // Settlements being retried on their own tasks: a flush waits for them too.
    let mut retrying: Vec<tokio::task::JoinHandle<()>> = Vec::new();
    while let Some(first) = commands.recv().await {
        retrying.retain(|task| !task.is_finished());
        let (mut batch, mut flushes) = (Vec::new(), Vec::new());
        let mut next = Some(first);
        while let Some(command) = next.take() {
            match command {
                Command::Settle(settle) => batch.push(settle),
                Command::Flush(done) => flushes.push(done),
                Command::Lower {
                    limit,
                    remaining,
                    pause,
                } if pause.is_zero() => {
                    let store = store.clone();
                    let call = move || store.lower(limit, remaining, pause);
                    tokio::spawn(with_retries(call, timeout, None));
                }
                // A pause, or a lift: in order. The lane ends with this worker.
                ordered => {
                    let _ = holds.send(ordered);
                }
            }
            if batch.len() < BATCH {
                next = commands.try_recv().ok();
            }
        }
        if batch.is_empty() {
            flushed(flushes, &mut retrying).await;
            continue;
        }
        let refunds = batch.iter().any(|s| {
            s.limits
                .iter()
                .any(|l| s.actual.amount(l.dimension()) < s.reserved.amount(l.dimension()))
        });
        let refunded = refunds.then(|| refunded.clone());
        if bounded(timeout, store.settle(batch.clone())).await.is_ok() {
            if let Some(refunded) = refunded {
                refunded.notify();
            }
        } else {
            let store = store.clone();
            let call = move || store.settle(batch.clone());
            retrying.push(tokio::spawn(with_retries(call, timeout, refunded)));
        }
        flushed(flushes, &mut retrying).await;
    }
}

/// Answers `flushes`, if any, once the settlements being retried are done.
async fn flushed(
    flushes: Vec<tokio::sync::oneshot::Sender<()>>,
    retrying: &mut Vec<tokio::task::JoinHandle<()>>,
) {
    if flushes.is_empty() {
        return;
    }
    for task in retrying.drain(..) {
        let _ = task.await;
    }
    for done in flushes {
        let _ = done.send(());
    }
}

/// Sends pauses and lifts one after the other, each retried before the next, so that the
/// store sees them in the order they were made. A lift that reaches the store tells the
/// budget, whose head then asks again at once rather than when the hold's wait is over.
/// Between them, every `every`, a budget with a tenant tree renews its lease on its slots and
/// reads the pauses the store keeps, to follow the other processes' pauses and resumes in its
/// own view (its snapshots, its local refusals).
async fn in_order(
    store: Arc<dyn QuotaStore>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    (timeout, every): (Duration, Duration),
    refunded: Refunded,
) {
    let mut sync = tokio::time::interval(every.max(Duration::from_millis(1)));
    sync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // A command first; else, when it is time, a reading of the store's pauses.
        let next = std::future::poll_fn(|cx| {
            if let std::task::Poll::Ready(command) = commands.poll_recv(cx) {
                return std::task::Poll::Ready(Some(command));
            }
            sync.poll_tick(cx).map(|_| None)
        })
        .await;
        let command = match next {
            Some(Some(command)) => command,
            Some(None) => return,
            None => {
                sync_with_store(&store, &refunded, timeout).await;
                continue;
            }
        };
        match command {
            Command::Lower {
                limit,
                remaining,
                pause,
            } => {
                let call = || store.lower(limit, remaining, pause);
                with_retries(call, timeout, None).await;
            }
            Command::Lift(limits) => {
                let call = || store.lift(limits.clone());
                with_retries(call, timeout, Some(refunded.clone())).await;
            }
            Command::Paused { scope, paused } => {
                let call = || store.set_paused(scope.clone(), paused);
                with_retries(call, timeout, None).await;
            }
            Command::Settle(settle) => {
                // Not sent here (settlements are batched), but settled all the same.
                let call = || store.settle(vec![settle.clone()]);
                with_retries(call, timeout, None).await;
            }
            // Not sent here either: whatever came before it is done.
            Command::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

/// Calls until a call succeeds, four times at most, with a growing, jittered pause between;
/// then tells `refunded`, if any.
async fn with_retries(
    call: impl Fn() -> StoreFuture<()>,
    timeout: Duration,
    refunded: Option<Refunded>,
) {
    const ATTEMPTS: u32 = 4;
    let mut backoff = Duration::from_millis(50);
    for attempt in 1..=ATTEMPTS {
        match bounded(timeout, call()).await {
            Ok(()) => {
                if let Some(refunded) = &refunded {
                    refunded.notify();
                }
                return;
            }
            Err(error) if attempt == ATTEMPTS => {
                tracing::warn!(%error, "the shared quota store missed an update");
            }
            Err(_) => {
                tokio::time::sleep(backoff.mul_f64(0.5 + fastrand::f64())).await;
                backoff *= 4;
            }
        }
    }
}

/// The admission state machine of a shared budget against a scripted store, under tokio's
/// paused clock: waits, timeouts, fallback, the breaker, releases and settlements, exactly.
#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::num::NonZeroU64;
    use std::sync::Mutex;

    use tokio::time::Instant;

    use super::*;
    use crate::budget::Budget;
    use crate::quota::Dimension;

    /// What the scripted store does with the next reservation.
    #[derive(Debug, Clone, Copy)]
    enum Script {
        Answer(Decision),
        Fail,
        /// Never answers: the budget's timeout ends the question.
        Hang,
    }

    #[derive(Debug, Default)]
    struct ScriptedStore {
        script: Mutex<VecDeque<Script>>,
        asked: Mutex<Vec<(String, Instant)>>,
        settled: Mutex<Vec<Settle>>,
        /// The next settlements that fail.
        failing_settles: Mutex<u32>,
        /// Pauses and lifts as the store saw them; the first `failing_pauses` fail.
        holds: Mutex<Vec<&'static str>>,
        failing_pauses: Mutex<u32>,
        /// Leases: the most units granted at each renewal (after the last, the last again;
        /// a need above it gets nothing), or `None`: the renewal hangs. When asked, and what
        /// was told.
        grants: Mutex<VecDeque<Option<u64>>>,
        renewals: Mutex<Vec<(Instant, super::super::Demand)>>,
    }

    impl ScriptedStore {
        /// Every renewal from now on grants `units` at most (`None`: hangs).
        fn renew_with(&self, units: Option<u64>) {
            let mut grants = self.grants.lock().unwrap();
            grants.clear();
            grants.push_back(units);
        }
    }

    impl QuotaStore for ScriptedStore {
        fn reserve(
            &self,
            id: String,
            _cost: Cost,
            _floor: Floor,
            _class: Priority,
            _limits: Arc<[Limit]>,
            _path: PathLimits,
            _tenant: Option<Tenant>,
        ) -> StoreFuture<Decision> {
            self.asked.lock().unwrap().push((id, Instant::now()));
            let next = self.script.lock().unwrap().pop_front();
            match next.unwrap_or(Script::Answer(Decision::Admitted)) {
                Script::Answer(decision) => Box::pin(async move { Ok(decision) }),
                Script::Fail => Box::pin(async { Err(StoreUnavailable::new("scripted failure")) }),
                Script::Hang => Box::pin(std::future::pending()),
            }
        }

        fn settle(&self, batch: Vec<Settle>) -> StoreFuture<()> {
            let mut failing = self.failing_settles.lock().unwrap();
            if *failing > 0 {
                *failing -= 1;
                return Box::pin(async { Err(StoreUnavailable::new("scripted failure")) });
            }
            self.settled.lock().unwrap().extend(batch);
            Box::pin(async { Ok(()) })
        }

        fn lower(
            &self,
            _limit: Limit,
            _remaining: Option<u64>,
            pause: Duration,
        ) -> StoreFuture<()> {
            if !pause.is_zero() {
                let mut failing = self.failing_pauses.lock().unwrap();
                if *failing > 0 {
                    *failing -= 1;
                    self.holds.lock().unwrap().push("pause failed");
                    return Box::pin(async { Err(StoreUnavailable::new("scripted failure")) });
                }
                self.holds.lock().unwrap().push("pause");
            }
            Box::pin(async { Ok(()) })
        }

        fn set_paused(&self, _scope: Tenant, _paused: bool) -> StoreFuture<()> {
            Box::pin(async { Ok(()) })
        }

        fn paused(&self) -> StoreFuture<Option<Vec<Tenant>>> {
            Box::pin(async { Ok(None) })
        }

        fn lift(&self, _limits: Vec<Limit>) -> StoreFuture<()> {
            self.holds.lock().unwrap().push("lift");
            Box::pin(async { Ok(()) })
        }

        fn lease(
            &self,
            _process: u64,
            lease: Duration,
            limits: Arc<[Limit]>,
            demand: super::super::Demand,
        ) -> StoreFuture<super::super::Grant> {
            self.renewals
                .lock()
                .unwrap()
                .push((Instant::now(), demand.clone()));
            let mut grants = self.grants.lock().unwrap();
            let next = if grants.len() > 1 {
                grants.pop_front().flatten()
            } else {
                grants.front().copied().flatten()
            };
            match next {
                Some(most) => {
                    let granted = (demand.reports.iter())
                        .map(|r| match r.need <= most {
                            true => (r.need + r.ask).min(most),
                            false => 0,
                        })
                        .collect();
                    let grant = super::super::Grant {
                        renewal: super::super::Renewal::Renewed,
                        part: 1.0,
                        lease,
                        holds: vec![Duration::ZERO; limits.len()],
                        plans: vec![1.0; limits.len()],
                        granted,
                        ready: Duration::ZERO,
                        spread: vec![1; demand.flows.len() + demand.guarantees.len()],
                    };
                    Box::pin(async move { Ok(grant) })
                }
                None => Box::pin(std::future::pending()),
            }
        }
    }

    const MS: Duration = Duration::from_millis(1);

    fn budget(store: &Arc<ScriptedStore>, policy: FailurePolicy) -> Budget {
        let limit = Limit::per_second(Dimension::TotalTokens, NonZeroU64::new(1_000).unwrap())
            .with_headroom(1.0)
            .unwrap()
            .with_burst(NonZeroU64::new(1_000).unwrap());
        let options = RemoteOptions {
            policy,
            timeout: 50 * MS,
            breaker_threshold: 3,
            breaker_open_for: 500 * MS,
            pipeline: crate::budget::store::state::PIPELINE,
            leases: None,
            heartbeat: 1_000 * MS,
        };
        let store: Arc<dyn QuotaStore> = store.clone();
        Budget {
            engine: Engine::with_remote(&Quota::new().with_limit(limit), store, options, true),
        }
    }

    /// A budget leasing its share from `store`, renewed every 100 ms (a grant lasts 300).
    fn leasing(
        store: &Arc<ScriptedStore>,
        policy: FailurePolicy,
        grants: &[Option<u64>],
    ) -> Budget {
        store.grants.lock().unwrap().extend(grants.iter().copied());
        let limit = Limit::per_second(Dimension::TotalTokens, NonZeroU64::new(1_000).unwrap())
            .with_headroom(1.0)
            .unwrap()
            .with_burst(NonZeroU64::new(1_000).unwrap());
        let options = RemoteOptions {
            policy,
            timeout: 50 * MS,
            breaker_threshold: 3,
            breaker_open_for: 500 * MS,
            pipeline: crate::budget::store::state::PIPELINE,
            leases: Some(crate::budget::store::state::LeaseOptions {
                refresh: 100 * MS,
                lease: 300 * MS,
            }),
            heartbeat: 1_000 * MS,
        };
        let store: Arc<dyn QuotaStore> = store.clone();
        Budget {
            engine: Engine::with_remote(&Quota::new().with_limit(limit), store, options, true),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_admits_in_memory_and_what_is_not_spent_goes_back() {
        let store = Arc::new(ScriptedStore::default());
        let budget = leasing(&store, FailurePolicy::FailClosed, &[Some(1_000)]);
        let start = Instant::now();
        // The first grant comes at once: the request's cost, and the whole burst while
        // requests wait.
        budget
            .reserve(Cost::new(10, 0))
            .await
            .unwrap()
            .charge_estimate();
        assert!(start.elapsed() <= 100 * MS, "{:?}", start.elapsed());
        for _ in 0..20 {
            budget
                .reserve(Cost::new(10, 0))
                .await
                .unwrap()
                .charge_estimate();
        }
        assert_eq!(
            store.asked.lock().unwrap().len(),
            0,
            "no question per admission"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        let renewals = store.renewals.lock().unwrap();
        // Every 100 ms over 2 s (the first at once, and one sooner for the first request).
        assert!((20..=23).contains(&renewals.len()), "{}", renewals.len());
        assert!(
            renewals.windows(2).all(|w| w[1].1.seq > w[0].1.seq),
            "numbered"
        );
        let first = &renewals[0].1.reports[0];
        assert_eq!(
            (first.need, first.keep),
            (10, 0),
            "the request's cost whole"
        );
        // Idle, it gives back what it holds but its part of the burst (a tenth at most: 100)
        // and asks for nothing.
        let idle = renewals.iter().map(|(_, d)| d.reports[0]).skip(3);
        assert!(idle.clone().any(|r| r.back > 0), "gives back");
        let last = renewals.last().unwrap().1.reports[0];
        assert_eq!((last.keep, last.need, last.ask), (100, 0, 0), "{last:?}");
        assert_eq!(renewals.last().unwrap().1.want, 0.0);
    }

    /// The renewal task finds its budget gone (the last handle's count at zero) a moment
    /// before the budget's drop has made its parting report, which may run on another thread:
    /// the task waits for the report rather than leave with nothing, and what the budget held
    /// reaches the store.
    #[tokio::test(start_paused = true)]
    async fn a_budget_found_gone_before_its_drop_reported_still_gives_back_what_it_held() {
        use super::super::lease::leave;
        use super::super::state::Parting;
        use super::super::{Demand, Report};

        let store = Arc::new(ScriptedStore::default());
        store.renew_with(Some(0));
        let limits: Arc<[Limit]> = Arc::from([Limit::per_second(
            Dimension::TotalTokens,
            NonZeroU64::new(1_000).unwrap(),
        )]);
        let (parting, departure) = tokio::sync::oneshot::channel();
        let leaving = tokio::spawn({
            let store: Arc<dyn QuotaStore> = store.clone();
            async move { leave(&*store, departure, (7, 300 * MS), 50 * MS).await }
        });
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!leaving.is_finished(), "it waits for the report");
        assert!(store.renewals.lock().unwrap().is_empty());
        // The drop reports: 400 held, given back.
        let report = Report {
            back: 400,
            ..Report::default()
        };
        let demand = Demand::leave(9, vec![report]);
        parting.send(Some((limits, demand.clone()))).unwrap();
        leaving.await.unwrap();
        {
            let renewals = store.renewals.lock().unwrap();
            assert_eq!(renewals.len(), 1);
            assert_eq!(renewals[0].1, demand);
        }

        // A budget that had nothing to report (its sender gone unsent): it leaves at once.
        let (parting, departure) = tokio::sync::oneshot::channel::<Option<Parting>>();
        drop(parting);
        let dyn_store: Arc<dyn QuotaStore> = store.clone();
        leave(&*dyn_store, departure, (8, 300 * MS), 50 * MS).await;
        assert_eq!(store.renewals.lock().unwrap().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_renewed_late_admits_nothing_past_its_end() {
        let store = Arc::new(ScriptedStore::default());
        let budget = leasing(&store, FailurePolicy::FailClosed, &[Some(1_000)]);
        tokio::time::sleep(10 * MS).await;
        budget
            .reserve(Cost::new(1, 0))
            .await
            .unwrap()
            .charge_estimate();
        // The renewals hang from now: the grant ends 270 ms after it was asked, and the
        // failure policy (closed) then admits nothing, whatever the wallets hold: refused as
        // the store's unavailability once a renewal failed past the end.
        store.renew_with(None);
        tokio::time::sleep(300 * MS).await;
        let late = tokio::time::timeout(Duration::from_secs(2), budget.reserve(Cost::new(1, 0)));
        let refused = late.await.expect("refused, not waiting").unwrap_err();
        assert!(
            matches!(refused, crate::error::ReserveError::Unavailable(_)),
            "{refused}"
        );
        // Renewals answer again: admitted from the next (every refresh while none waits),
        // which reported nothing kept.
        store.renew_with(Some(1_000));
        // The renewal hanging now ends at its timeout (50 ms); the next comes a refresh
        // after it began.
        tokio::time::sleep(150 * MS).await;
        budget
            .reserve(Cost::new(1, 0))
            .await
            .unwrap()
            .charge_estimate();
        let renewals = store.renewals.lock().unwrap();
        let resumed = renewals.iter().rev().nth(1).unwrap();
        assert_eq!(resumed.1.reports[0].keep, 0, "a closed lease keeps nothing");
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_waits_for_a_grant_that_covers_it_whole() {
        let store = Arc::new(ScriptedStore::default());
        let budget = leasing(&store, FailurePolicy::FailClosed, &[Some(250)]);
        let error = budget.reserve(Cost::new(1_001, 0)).await.unwrap_err();
        assert!(
            matches!(error, crate::error::ReserveError::TooLarge(_)),
            "{error}"
        );
        // 600 where the store grants 250 at most: nothing into debt, nothing granted in part.
        let large = tokio::time::timeout(Duration::from_secs(2), budget.reserve(Cost::new(600, 0)));
        assert!(large.await.is_err(), "never admitted beyond its grant");
        let needs = store.renewals.lock().unwrap().last().unwrap().1.reports[0];
        assert_eq!(needs.need, 600, "asks for its cost whole");
        store.renew_with(Some(1_000));
        let start = Instant::now();
        budget
            .reserve(Cost::new(600, 0))
            .await
            .unwrap()
            .charge_estimate();
        assert!(start.elapsed() <= 150 * MS, "{:?}", start.elapsed());
    }

    #[tokio::test(start_paused = true)]
    async fn an_overrun_is_reported_as_a_debt_and_handed_to_the_store() {
        let store = Arc::new(ScriptedStore::default());
        let budget = leasing(&store, FailurePolicy::FailClosed, &[Some(100)]);
        let mut reservation = budget.reserve(Cost::new(100, 0)).await.unwrap();
        reservation.mark_sent();
        reservation.settle_cost(Cost::new(400, 0));
        // The wallet owes 300 (it held 100 and spent 400): the next renewal reports it, and
        // the wallet is clear of it once the store took it.
        tokio::time::sleep(250 * MS).await;
        let renewals = store.renewals.lock().unwrap();
        let debts: Vec<i64> = renewals.iter().map(|(_, d)| d.reports[0].keep).collect();
        assert!(debts.contains(&-300), "{debts:?}");
        assert_eq!(
            debts.iter().filter(|&&k| k < 0).count(),
            1,
            "once: {debts:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_failing_past_the_grant_fall_back_on_the_policy_s_share() {
        let store = Arc::new(ScriptedStore::default());
        let budget = leasing(&store, FailurePolicy::local_share_of(4), &[Some(1_000)]);
        tokio::time::sleep(10 * MS).await;
        store.renew_with(None);
        tokio::time::sleep(Duration::from_secs(2)).await;
        // A quarter of the burst at once (the fallback starts empty and fills), the rest at a
        // quarter of the rate.
        let start = Instant::now();
        budget
            .reserve(Cost::new(250, 0))
            .await
            .unwrap()
            .charge_estimate();
        assert_eq!(start.elapsed(), Duration::ZERO);
        budget
            .reserve(Cost::new(25, 0))
            .await
            .unwrap()
            .charge_estimate();
        assert_eq!(start.elapsed(), 100 * MS);
    }

    fn scripted(script: &[Script]) -> Arc<ScriptedStore> {
        let store = ScriptedStore::default();
        store.script.lock().unwrap().extend(script.iter().copied());
        Arc::new(store)
    }

    #[tokio::test(start_paused = true)]
    async fn a_denial_waits_for_the_stores_hint_then_asks_again() {
        let wait = Duration::from_millis(200);
        let store = scripted(&[Script::Answer(Decision::Denied {
            wait,
            limit: 0,
            floor_only: false,
            first: false,
        })]);
        let budget = budget(&store, FailurePolicy::FailClosed);
        let start = Instant::now();
        let reservation = budget.reserve(Cost::new(100, 0)).await.unwrap();
        let waited = start.elapsed();
        // The hint, lengthened by at most a fiftieth and a millisecond.
        assert!(waited >= wait && waited <= wait + 5 * MS, "{waited:?}");
        assert_eq!(store.asked.lock().unwrap().len(), 2);
        assert_eq!(budget.waiters(), 0);
        drop(reservation);
    }

    #[tokio::test(start_paused = true)]
    async fn timeouts_fall_back_then_open_the_breaker_which_probes_later() {
        let store = scripted(&[Script::Hang, Script::Hang, Script::Hang, Script::Fail]);
        let budget = budget(&store, FailurePolicy::local_share_of(2));
        for _ in 0..3 {
            let start = Instant::now();
            let reservation = budget.reserve(Cost::new(10, 0)).await.unwrap();
            assert_eq!(
                start.elapsed(),
                50 * MS,
                "admitted locally after the timeout"
            );
            reservation.refund();
        }
        assert!(
            !budget.is_store_reachable(),
            "three failures open the breaker"
        );
        // Open: no question, admitted locally at once.
        let start = Instant::now();
        budget.reserve(Cost::new(10, 0)).await.unwrap().refund();
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(store.asked.lock().unwrap().len(), 3);
        // 500 ms later one probe asks; it fails, so the breaker opens again.
        tokio::time::advance(500 * MS).await;
        budget.reserve(Cost::new(10, 0)).await.unwrap().refund();
        assert_eq!(store.asked.lock().unwrap().len(), 4);
        assert!(!budget.is_store_reachable());
        // The next probe is answered: back on the store.
        tokio::time::advance(500 * MS).await;
        budget.reserve(Cost::new(10, 0)).await.unwrap().refund();
        assert_eq!(store.asked.lock().unwrap().len(), 5);
        assert!(budget.is_store_reachable());
    }

    #[tokio::test(start_paused = true)]
    async fn fail_closed_asks_again_until_the_breaker_opens_then_refuses() {
        // One slow answer is not an outage: asked again, admitted.
        let store = scripted(&[Script::Hang]);
        let slow = budget(&store, FailurePolicy::FailClosed);
        let start = Instant::now();
        slow.reserve(Cost::new(10, 0)).await.unwrap().refund();
        assert_eq!(store.asked.lock().unwrap().len(), 2);
        assert!(
            start.elapsed() >= 50 * MS && start.elapsed() <= 57 * MS,
            "{:?}",
            start.elapsed()
        );
        assert!(slow.is_store_reachable());
        // Three in a row open the breaker: refused then, within three timeouts and two waits.
        let store = scripted(&[Script::Hang, Script::Hang, Script::Hang]);
        let budget = budget(&store, FailurePolicy::FailClosed);
        let start = Instant::now();
        let error = budget.reserve(Cost::new(10, 0)).await.unwrap_err();
        assert!(
            matches!(error, crate::error::ReserveError::Unavailable(_)),
            "{error}"
        );
        assert_eq!(store.asked.lock().unwrap().len(), 3);
        assert!(
            start.elapsed() >= 150 * MS && start.elapsed() <= 164 * MS,
            "{:?}",
            start.elapsed()
        );
        assert!(!budget.is_store_reachable());
        assert_eq!(budget.waiters(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_question_dropped_in_flight_is_released() {
        let store = scripted(&[Script::Hang]);
        let budget = budget(&store, FailurePolicy::FailClosed);
        let dropped = tokio::time::timeout(10 * MS, budget.reserve(Cost::new(300, 0))).await;
        assert!(dropped.is_err(), "still asking when dropped");
        tokio::time::sleep(MS).await; // the worker sends the release
        let settled = store.settled.lock().unwrap();
        let asked = store.asked.lock().unwrap();
        assert_eq!(settled.len(), 1);
        assert_eq!(settled[0].id, asked[0].0, "the same reservation id");
        assert_eq!(settled[0].reserved, Cost::new(300, 0));
        assert_eq!(settled[0].actual, Cost::default(), "nothing was sent");
        assert_eq!(budget.waiters(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flush_waits_for_the_settlements_made_before_it() {
        let store = scripted(&[]);
        let budget = budget(&store, FailurePolicy::FailClosed);
        budget.flush().await; // nothing to send
        *store.failing_settles.lock().unwrap() = 2;
        for tokens in [100, 200] {
            let mut reservation = budget.reserve(Cost::new(tokens, 0)).await.unwrap();
            reservation.mark_sent();
            reservation.settle_cost(Cost::new(tokens / 2, 0));
        }
        budget.flush().await;
        // Refused twice: the retries ran before the flush completed.
        let settled = store.settled.lock().unwrap();
        let actual: Vec<Cost> = settled.iter().map(|s| s.actual).collect();
        assert_eq!(actual, [Cost::new(50, 0), Cost::new(100, 0)]);
    }

    #[tokio::test(start_paused = true)]
    async fn settlements_reach_the_store_and_local_admissions_do_not() {
        let store = scripted(&[Script::Fail]);
        let budget = budget(&store, FailurePolicy::local_share_of(2));
        let mut local = budget.reserve(Cost::new(10, 0)).await.unwrap();
        let mut shared = budget.reserve(Cost::new(20, 0)).await.unwrap();
        local.mark_sent();
        shared.mark_sent();
        local.settle_cost(Cost::new(5, 0));
        shared.settle_cost(Cost::new(15, 0));
        tokio::time::sleep(MS).await;
        let settled = store.settled.lock().unwrap();
        // The failed question's release, then the shared reservation; the local one stays here.
        assert_eq!(settled.len(), 2);
        assert_eq!(settled[0].actual, Cost::default());
        assert_eq!(
            (settled[1].reserved, settled[1].actual),
            (Cost::new(20, 0), Cost::new(15, 0))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_lift_never_overtakes_an_earlier_pause_and_wakes_the_head() {
        let wait = Duration::from_secs(1);
        let store = scripted(&[Script::Answer(Decision::Denied {
            wait,
            limit: 0,
            floor_only: false,
            first: false,
        })]);
        *store.failing_pauses.lock().unwrap() = 1;
        let budget = budget(&store, FailurePolicy::FailClosed);
        budget.pause(
            &[Dimension::TotalTokens],
            Instant::now() + Duration::from_secs(60),
        );
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(Cost::new(100, 0)).await.map(drop) }
        });
        tokio::time::sleep(10 * MS).await;
        budget.lift_pause(&[Dimension::TotalTokens]);
        let start = Instant::now();
        waiting.await.unwrap().unwrap();
        // The pause failed once and was retried before the lift was sent.
        assert_eq!(
            *store.holds.lock().unwrap(),
            ["pause failed", "pause", "lift"]
        );
        // The written lift woke the head, which asked again before the store's second.
        assert!(start.elapsed() < wait / 2, "{:?}", start.elapsed());
        assert_eq!(store.asked.lock().unwrap().len(), 2);
    }
}
