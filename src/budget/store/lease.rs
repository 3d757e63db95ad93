//! Leases: a process admits from units it was granted, held in memory, and renews its grant
//! from the shared store every refresh instead of asking it per admission.
//!
//! A grant is a debit: the units leave the account's bucket in the store when they are
//! granted, and the store counts them as held by the process until it reports them spent or
//! gives them back, or its lease ends. The bucket refills to its capacity less what leases
//! hold, so that the fleet never admits more than the account's burst plus its rate over any
//! window (plus the debts its processes report, real usage beyond estimates). Locally the
//! grant is the budget's buckets as wallets, which never refill by themselves: priority, fair
//! share and settlement work in memory as for an in-memory budget.
//!
//! At each renewal a process tells the store what it keeps (a debt it owes, charged to the
//! account), gives back what it holds beyond what it expects to spend before the next renewal,
//! and asks for the cost of its first waiting request whole (in every limit, or nothing) and
//! for more to spend until the next renewal. The store divides the account's rate between the
//! processes by demand, tenants' weights and guarantees (a credit per process, in turn by
//! deficit, so whole units reach every process even when the parts are below a unit).
//!
//! Every failure errs toward less: a process that dies, stalls past its lease, or loses a
//! renewal's reply loses what it held (it stops admitting at its lease's end, measured from
//! before the renewal was sent, a tenth early); a renewal that reaches the store after a later
//! one changes nothing (each carries a number). What was lost comes back as the bucket
//! refills.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::budget::handle::{Engine, State};
use crate::budget::memory::store::Store;
use crate::budget::store::state::{LeaseOptions, Parting};
use crate::budget::store::{Demand, FailurePolicy, Grant, QuotaStore, Renewal, Report};
use crate::cost::Cost;
use crate::quota::Limit;

/// The fraction of the account a process wants, from what it spent over `elapsed`: all of it
/// while requests wait; else what it spent, as a fraction of each limit's rate, with half
/// again as margin, so that a growing demand asks for more before it waits.
pub(crate) fn wanted(waiting: bool, spent: &Cost, limits: &[Limit], elapsed: Duration) -> f64 {
    const MARGIN: f64 = 1.5;
    if waiting {
        return 1.0;
    }
    let elapsed = elapsed.as_secs_f64();
    if elapsed <= 0.0 {
        return 0.0;
    }
    let fraction = limits
        .iter()
        .map(|limit| {
            let rate =
                limit.amount().get() as f64 * limit.headroom() / limit.period().as_secs_f64();
            spent.amount(limit.dimension()) as f64 / (rate * elapsed)
        })
        .fold(0.0, f64::max);
    (fraction * MARGIN).clamp(0.0, 1.0)
}

/// A grant ends a tenth before the store's record of it, so that a process never spends units
/// the store counts as lost already (the call's own time is counted from before it was sent).
pub(crate) fn local_end(asked: Instant, lease: Duration) -> Instant {
    asked + lease.mul_f64(0.9)
}

/// Keys with a number each: flows and their weights, guarantees and their shares (millionths).
type Keyed = Vec<(u64, u32)>;

/// The flows waiting in `state` with their configured weights, and the guarantees waiting:
/// what a claim tells the fleet's division.
fn waiting_claim(state: &State) -> (Keyed, Keyed) {
    let (mut flows, mut guarantors) = (Vec::new(), Vec::new());
    state.queue.waiting_flows(&mut flows, &mut guarantors);
    let mut guarantees = Vec::new();
    if let Some(tenants) = &state.tenants {
        tenants.unspread(&mut flows);
        // A flow's own guarantee is the division's to lift: it waits as a flow.
        guarantors.extend(flows.iter().map(|(key, _)| *key));
        guarantors.sort_unstable();
        guarantors.dedup();
        guarantees = tenants.guarantees_of(&guarantors);
    }
    (flows, guarantees)
}

/// Tells the tenants of `state` the fleet's answer to `demand`: each flow's weight here, each
/// guarantee's spread, this process's part.
fn tell_tenants(state: &State, grant: &Grant, demand: &Demand) {
    if let Some(tenants) = &state.tenants {
        let keys = (demand.flows.iter())
            .chain(&demand.guarantees)
            .map(|(key, _)| *key);
        let mut spread = keys.zip(grant.spread.iter().copied());
        let flows = spread.by_ref().take(demand.flows.len()).collect::<Vec<_>>();
        tenants.spread(flows.into_iter(), spread, grant.part);
    }
}

impl Engine {
    /// Whether the budget leases from a shared store.
    pub(in crate::budget) fn leases(&self) -> bool {
        self.remote.as_ref().is_some_and(|r| r.leases())
    }

    /// Whether an admission asks the shared store (a shared budget that does not lease).
    pub(in crate::budget) fn asks_per_admission(&self) -> bool {
        self.remote.as_ref().is_some_and(|r| !r.leases())
    }

    /// The account's limits, and this process's renewal: what it wants of the account now
    /// (from what it spent in the `elapsed` since the last renewal and the flows waiting), and
    /// per limit what it keeps, gives back (taken out of its wallets now) and asks for.
    pub(crate) fn lease_demand(&self, elapsed: Duration) -> (Arc<[Limit]>, Demand) {
        let ns = self.nanos_since_origin(Instant::now());
        let mut state = self.lock();
        let state = &mut *state;
        // The requests the lease pays: a request whose tenant path has limits or controls kept
        // in the store is asked of it per admission and paid by the account's bucket there,
        // so it must not make this process want the whole account (its lease would hold what
        // that request waits for, and it would wait for ever).
        let waiting = {
            let state: &State = state;
            (state.queue.order().iter())
                .any(|(_, waiter)| !self.kept_in_store(state, waiter.tenant.as_ref()))
        };
        let (flows, guarantees) = waiting_claim(state);
        let Some(shared) = state.remote.as_mut() else {
            return (Arc::from([]), Demand::leave(0, Vec::new()));
        };
        let limits = shared.limits().clone();
        let Some(lease) = shared.lease.as_mut() else {
            return (limits, Demand::leave(0, Vec::new()));
        };
        let spent = std::mem::take(&mut lease.spent);
        lease.seq += 1;
        let closed = lease.closed(ns);
        let refresh = Duration::from_nanos(lease.refresh);
        // A request waiting keeps asking; one that only tried (`try_reserve`) asks once.
        let blocked = match waiting {
            true => lease.blocked,
            false => lease.blocked.take(),
        };
        let part = lease.part;
        let wallets = state.store.holds_wallets();
        let reports = (limits.iter())
            .map(|limit| {
                let level = match wallets {
                    true => state.store.level_of(limit, ns),
                    false => 0,
                };
                let spent = spent.amount(limit.dimension());
                let need = blocked.map(|cost| cost.amount(limit.dimension()));
                let refreshes = elapsed.as_secs_f64() / refresh.as_secs_f64().max(1e-9);
                let flags = (waiting, need, closed);
                let held = (limit.capacity(), part);
                let report = Report::of(level, held, spent, refreshes, flags);
                state.store.withdraw(limit, report.back, ns);
                report
            })
            .collect();
        let demand = Demand {
            seq: lease.seq,
            want: wanted(waiting, &spent, &limits, elapsed),
            flows,
            guarantees,
            reports,
        };
        (limits, demand)
    }

    /// Puts `grant` (answering `demand`) in the wallets, admitting from them until `end`;
    /// takes over the debts the store charged, holds what the provider holds, and weighs each
    /// flow and guarantee of `demand` by its spread over the processes. A stale renewal
    /// changes nothing.
    pub(crate) fn apply_lease(
        &self,
        grant: &Grant,
        limits: &[Limit],
        demand: &Demand,
        end: Instant,
    ) {
        if matches!(grant.renewal, Renewal::Stale | Renewal::Left) {
            return;
        }
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let end = self.nanos_since_origin(end);
        self.update_state(|state| {
            tell_tenants(state, grant, demand);
            let Some(shared) = state.remote.as_mut() else {
                return false;
            };
            if let Some(lease) = &mut shared.lease {
                lease.ends = Some(end);
                (lease.fallback, lease.unreachable) = (false, false);
                lease.part = grant.part;
            }
            shared.wallets_again(&mut state.store);
            shared.set_plans(&grant.plans, &mut state.store, ns);
            let granted = grant.granted.iter().copied();
            for ((limit, report), granted) in limits.iter().zip(&demand.reports).zip(granted) {
                // The debt it reported is the account's now.
                let debt = report.keep.min(0).unsigned_abs();
                state.store.deposit(limit, granted.saturating_add(debt));
            }
            // A provider's pause the store holds is held here until the grant ends at most:
            // each renewal extends it while the store still holds it, so a pause lifted in the
            // store (by any process) ends here within a lease.
            for (limit, hold) in limits.iter().zip(&grant.holds) {
                if !hold.is_zero() {
                    let hold = (*hold).min(grant.lease);
                    let until = ns.saturating_add(crate::budget::memory::store::nanos(hold));
                    state.store.pause(limit.dimension(), until, ns, false);
                }
            }
            true
        });
    }

    /// The lease ended and its renewals failed (the last for `cause`): the failure policy's
    /// local share applies until a renewal (with [`FailurePolicy::FailClosed`], nothing);
    /// logged once, with the cause.
    pub(crate) fn lease_lost(&self, policy: FailurePolicy, cause: &str) {
        let ns = self.nanos_since_origin(Instant::now());
        self.update_state(|state| {
            let Some(shared) = state.remote.as_mut() else {
                return false;
            };
            let live = shared.live;
            let Some(lease) = shared.lease.as_mut() else {
                return false;
            };
            match policy.share_with(live) {
                // Closed: the waiting requests are refused as the store's unavailability.
                None if !lease.unreachable => {
                    tracing::warn!(
                        cause,
                        "the lease on the shared quota ended with its renewals failing: \
                         requests are refused until the store answers (fail closed)"
                    );
                    lease.unreachable = true;
                    true
                }
                Some(share) if !lease.fallback => {
                    tracing::warn!(
                        cause,
                        share,
                        live,
                        "the lease on the shared quota ended with its renewals failing: \
                         admitting from the local share until the store answers"
                    );
                    lease.fallback = true;
                    shared.set_share(share, &mut state.store, ns);
                    true
                }
                _ => false,
            }
        });
    }

    /// What a leasing process reports when it leaves: it keeps nothing (but its debts) and
    /// gives back what its wallets hold.
    fn parting(state: &mut crate::budget::handle::State, now: u64) -> Option<Parting> {
        let shared = state.remote.as_mut()?;
        let lease = shared.lease.as_mut()?;
        lease.seq += 1;
        let wallets = state.store.holds_wallets();
        let reports = (shared.limits.iter())
            .map(|limit| {
                let level = if wallets {
                    state.store.level_of(limit, now)
                } else {
                    0
                };
                Report {
                    keep: level.min(0),
                    back: u64::try_from(level).unwrap_or(0),
                    ..Report::default()
                }
            })
            .collect();
        Some((shared.limits.clone(), Demand::leave(lease.seq, reports)))
    }
}

impl Drop for Engine {
    /// The last handle on a leasing budget is gone: its renewal task wakes to give back what
    /// it holds now, rather than letting it lapse at its lease's end.
    fn drop(&mut self) {
        let Some(remote) = self.remote.as_mut() else {
            return;
        };
        let Some(parting) = remote.parting.take() else {
            return;
        };
        let now = crate::budget::memory::store::nanos(
            Instant::now().saturating_duration_since(self.origin),
        );
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        // The task may have gone already (its runtime shut down): nobody to give it to.
        let _ = parting.send(Engine::parting(state, now));
        remote.wants_more.notify_one();
    }
}

/// How often a budget asking per admission tells the fleet's division which flows wait in it.
const CLAIM_EVERY: Duration = Duration::from_millis(100);

impl Engine {
    /// A budget asking per admission, with tenants: a claim of the account (all of it: its
    /// turns in the store's line weigh its part), the flows and guarantees waiting in it, and
    /// nothing held or asked for.
    fn claim_demand(&self, seq: u64) -> Option<(Arc<[Limit]>, Demand)> {
        let state = self.lock();
        state.tenants.as_ref()?;
        let limits = state.remote.as_ref()?.limits().clone();
        let (flows, guarantees) = waiting_claim(&state);
        let reports = vec![Report::default(); limits.len()];
        let demand = Demand {
            seq,
            want: 1.0,
            flows,
            guarantees,
            reports,
        };
        Some((limits, demand))
    }

    /// Starts telling the fleet's division, every [`CLAIM_EVERY`], which flows wait in a
    /// budget asking per admission (a lease call granted nothing): it weighs the budget's
    /// tenants by their weights over the fleet, and its turns in the store's line by its part
    /// of the account. A store that does not lease answers with an error: the budget goes on
    /// without.
    pub(in crate::budget) fn start_claiming(self: &Arc<Self>) {
        let Some(remote) = self.remote.as_ref().filter(|r| !r.leases()) else {
            return;
        };
        let (store, budget, process) =
            (remote.store.clone(), Arc::downgrade(self), remote.instance);
        let timeout = remote.options.timeout;
        tokio::spawn(async move {
            let lease = CLAIM_EVERY * 3;
            let mut seq = 0u64;
            let mut ticks = tokio::time::interval(CLAIM_EVERY);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(engine) = budget.upgrade() else {
                    return;
                };
                seq += 1;
                let Some((limits, demand)) = engine.claim_demand(seq) else {
                    continue;
                };
                drop(engine);
                let call = store.lease(process, lease, limits, demand.clone());
                let Ok(Ok(grant)) = tokio::time::timeout(timeout, call).await else {
                    continue;
                };
                if matches!(grant.renewal, Renewal::Stale | Renewal::Left) {
                    continue;
                }
                let Some(engine) = budget.upgrade() else {
                    return;
                };
                engine.update_state(|state| {
                    tell_tenants(state, &grant, &demand);
                    false
                });
            }
        });
    }

    /// Starts renewing the lease of a budget that leases; `parting` receives the report its
    /// drop sends (see `Remote::parting`).
    pub(in crate::budget) fn start_leasing(
        self: &Arc<Self>,
        parting: tokio::sync::oneshot::Receiver<Option<Parting>>,
    ) {
        let Some(remote) = self.remote.as_ref() else {
            return;
        };
        let Some(lease) = remote.options.leases else {
            return;
        };
        let budget = Leasing {
            budget: Arc::downgrade(self),
            wants_more: remote.wants_more.clone(),
            parting,
            spent_much: remote.spent_much.clone(),
        };
        let failing = (
            remote.options.policy,
            remote.options.timeout,
            remote.options.breaker_threshold,
        );
        let store = remote.store.clone();
        tokio::spawn(keep_leasing(store, budget, remote.instance, lease, failing));
    }
}

/// What the renewal task holds of its budget: a weak handle (the task ends with the budget),
/// its signal for more, and where the budget's drop sends what it gives back.
struct Leasing {
    budget: Weak<Engine>,
    wants_more: Arc<tokio::sync::Notify>,
    parting: tokio::sync::oneshot::Receiver<Option<Parting>>,
    spent_much: Arc<std::sync::atomic::AtomicBool>,
}

/// Renews the budget's lease every refresh (sooner when requests wait for more) until the
/// budget is dropped, then gives back what it held. A renewal that fails (or whose reply comes
/// after `timeout`) grants nothing, and what it gave back is gone; the grant held lasts until
/// its lease ends, then nothing is admitted until a renewal succeeds or `threshold` have
/// failed in a row (the breaker's count: one slow answer is not an outage), and then the
/// failure policy applies. A lease that ends before it
/// is renewed (this task ran late) admits nothing meanwhile: the admissions check its end.
async fn keep_leasing(
    store: Arc<dyn QuotaStore>,
    leasing: Leasing,
    process: u64,
    options: LeaseOptions,
    (policy, timeout, threshold): (FailurePolicy, Duration, u32),
) {
    let mut last = Instant::now();
    let mut failures = 0u32;
    let mut ends: Option<Instant> = None;
    // The last grant fell short of what was asked (the account binds): the next renewal waits
    // until the store expects its need covered (a whole refresh at most), rather than asking
    // sooner.
    let mut short: Option<Duration> = None;
    loop {
        let Some(budget_now) = leasing.budget.upgrade() else {
            return leave(&*store, leasing.parting, (process, options.lease), timeout).await;
        };
        let asked = Instant::now();
        let (limits, demand) = budget_now.lease_demand(asked.saturating_duration_since(last));
        last = asked;
        let call = store.lease(process, options.lease, limits.clone(), demand.clone());
        let answer = tokio::time::timeout(timeout, call).await;
        let failed: Option<String> = match answer {
            Ok(Ok(grant)) if grant.renewal != Renewal::Stale => {
                let lacking = (demand.reports.iter().zip(&grant.granted))
                    .any(|(report, &granted)| granted < report.need + report.ask);
                short = lacking.then(|| match grant.ready.is_zero() {
                    true => options.refresh,
                    false => grant.ready.min(options.refresh),
                });
                let end = local_end(asked, grant.lease);
                ends = Some(end);
                budget_now.apply_lease(&grant, &limits, &demand, end);
                None
            }
            Ok(Ok(_)) => Some("a renewal arrived after a later one".to_owned()),
            Ok(Err(error)) => Some(error.to_string()),
            Err(_) => Some(format!("no answer within the timeout ({timeout:?})")),
        };
        failures = match &failed {
            Some(cause) => {
                tracing::debug!(cause, "a lease was not renewed");
                failures.saturating_add(1)
            }
            None => 0,
        };
        let renewed = ends.is_some_and(|end| Instant::now() < end);
        if let (false, Some(cause)) = (renewed, failed) {
            if failures >= threshold.max(1) {
                budget_now.lease_lost(policy, &cause);
            }
        }
        drop(budget_now);
        let live = ends.is_some_and(|end| Instant::now() < end);
        let short = short.filter(|_| live).map_or(asked, |wait| asked + wait);
        until_next(&leasing, asked, options.refresh, short).await;
    }
}

/// The budget is gone: gives back what it held (its parting report), within `timeout`.
///
/// The report is awaited, not read: the weak handle fails to upgrade as soon as the last
/// handle's count reaches zero, a moment before the budget's drop makes the report (on
/// another thread, maybe). It always comes: the drop sends it, or the sender goes with the
/// budget (it then had nothing to give back).
pub(super) async fn leave(
    store: &dyn QuotaStore,
    parting: tokio::sync::oneshot::Receiver<Option<Parting>>,
    (process, lease): (u64, Duration),
    timeout: Duration,
) {
    if let Ok(Some((limits, parting))) = parting.await {
        let leave = store.lease(process, lease, limits, parting);
        let _ = tokio::time::timeout(timeout, leave).await;
    }
}

/// Waits for the next renewal of one asked at `asked`: every `refresh`; sooner (an eighth of
/// it at least after the last call) when requests wait for more: from `short` on (when the
/// store expects their need covered, the last grant having fallen short), at once when a
/// large part of the account was spent (the store should learn of it: it counts it as held
/// until told).
async fn until_next(leasing: &Leasing, asked: Instant, refresh: Duration, short: Instant) {
    use std::future::Future;
    use std::task::Poll;

    tokio::time::sleep_until(asked + refresh / 8).await;
    let due = asked + refresh;
    let mut wanted = false;
    loop {
        let deadline = if wanted { short.min(due) } else { due };
        if Instant::now() >= deadline {
            return;
        }
        let mut more = std::pin::pin!(leasing.wants_more.notified());
        let mut timer = std::pin::pin!(tokio::time::sleep_until(deadline));
        let notified = std::future::poll_fn(|cx| {
            if timer.as_mut().poll(cx).is_ready() {
                Poll::Ready(false)
            } else {
                more.as_mut().poll(cx).map(|()| true)
            }
        })
        .await;
        if !notified
            || leasing
                .spent_much
                .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        wanted = true;
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;

    use super::*;
    use crate::quota::Dimension;

    fn limits() -> Vec<Limit> {
        vec![
            Limit::per_minute(Dimension::Requests, NonZeroU64::new(600).unwrap())
                .with_headroom(1.0)
                .unwrap(),
            Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(60_000).unwrap())
                .with_headroom(1.0)
                .unwrap(),
        ]
    }

    #[test]
    fn waiting_requests_want_the_whole_account() {
        assert_eq!(
            wanted(true, &Cost::default(), &limits(), Duration::from_secs(1)),
            1.0
        );
    }

    #[test]
    fn the_busiest_limit_sets_the_want_with_a_margin() {
        // 2 requests of 10 a second, 300 tokens of 1,000 a second: the tokens bind.
        let spent = Cost::new(300, 0).with_requests(2);
        let want = wanted(false, &spent, &limits(), Duration::from_secs(1));
        assert!((want - 0.45).abs() < 1e-9, "{want}");
        assert_eq!(
            wanted(false, &Cost::default(), &limits(), Duration::ZERO),
            0.0
        );
        let all = Cost::new(5_000, 0);
        assert_eq!(wanted(false, &all, &limits(), Duration::from_secs(1)), 1.0);
    }
}
