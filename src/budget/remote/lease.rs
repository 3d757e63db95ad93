//! Leased shares: a process admits from its share of the account, in memory, and renews the
//! share from the shared store every refresh instead of asking it per admission.
//!
//! The store divides the account between the processes that lease it, by what each wants and
//! by the weights of the tenants waiting in each (a tenant waiting in several processes
//! spreads its weight over them), and never grants more than what the others do not hold:
//! the shares held add up to one at most, so the processes together admit within the account.
//! A process holds its share (of every limit's rate and burst) until its lease ends; one that
//! dies loses it then. Locally the share is the budget's buckets, scaled: priority, fair share
//! and settlement work in memory as for an in-memory budget; a tenant waiting in several
//! processes weighs, in each, its weight divided by their number, so that its fleet-wide share
//! follows its weight.
//!
//! The cost: a store call per process per refresh instead of one per admission; a process
//! whose demand grows waits up to a refresh (and a round trip) for a larger share; a request
//! larger than this process's share of a burst is admitted once the share is full, into debt
//! (one request beyond its share of the burst per process, at most).
#![cfg_attr(not(feature = "redis"), allow(dead_code, unused_imports))]

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::budget::Budget;
use crate::budget::handle::Shared;
use crate::budget::memory::store::Store;
use crate::budget::remote::state::LeaseOptions;
use crate::budget::remote::{Demand, FailurePolicy, Grant, RemoteStore};
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

/// A grant ends a tenth before the store's record of it, so that a process never uses a share
/// the store already gave away (the call's own time is counted from before it was sent).
pub(crate) fn local_end(asked: Instant, lease: Duration) -> Instant {
    asked + lease.mul_f64(0.9)
}

impl Budget {
    /// Whether an admission asks the shared store (a shared budget that does not lease).
    pub(in crate::budget) fn asks_per_admission(&self) -> bool {
        self.shared.remote.as_ref().is_some_and(|r| !r.leases())
    }

    /// The account's limits, and what this process wants of them now, from what it spent in
    /// the `elapsed` since the last renewal and the flows waiting.
    pub(crate) fn lease_demand(&self, elapsed: Duration) -> (Arc<[Limit]>, Demand) {
        let mut state = self.lock();
        let waiting = !state.queue.is_empty();
        let (mut flows, mut guarantors) = (Vec::new(), Vec::new());
        state.queue.waiting_flows(&mut flows, &mut guarantors);
        let mut guarantees = Vec::new();
        if let Some(tenants) = &state.tenants {
            tenants.unspread(&mut flows);
            guarantees = tenants.guarantees_of(&guarantors);
        }
        let Some(shared) = state.shared.as_mut() else {
            return (Arc::from([]), Demand::leave());
        };
        let spent = (shared.lease.as_mut())
            .map(|l| std::mem::take(&mut l.spent))
            .unwrap_or_default();
        let limits = shared.limits().clone();
        let want = wanted(waiting, &spent, &limits, elapsed);
        let spent = limits.iter().map(|l| spent.amount(l.dimension())).collect();
        let demand = Demand {
            want,
            flows,
            guarantees,
            spent,
        };
        (limits, demand)
    }

    /// Admits from `grant`'s share of every limit until `end`, holds what the provider
    /// holds, and weighs each flow and guarantee of `demand` by its spread over the
    /// processes.
    pub(crate) fn apply_lease(
        &self,
        grant: &Grant,
        limits: &[Limit],
        demand: &Demand,
        end: Instant,
    ) {
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let end = self.nanos_since_origin(end);
        self.update_state(|state| {
            if let Some(tenants) = &state.tenants {
                let keys = (demand.flows.iter())
                    .chain(&demand.guarantees)
                    .map(|(key, _)| *key);
                let mut spread = keys.zip(grant.spread.iter().copied());
                let flows = spread.by_ref().take(demand.flows.len()).collect::<Vec<_>>();
                tenants.spread(flows.into_iter(), spread, grant.share);
            }
            let Some(shared) = state.shared.as_mut() else {
                return false;
            };
            let joining = shared.lease.as_ref().is_some_and(|l| !l.joined);
            if let Some(lease) = &mut shared.lease {
                lease.ends = Some(end);
                lease.joined |= grant.share > 0.0;
            }
            let mut changed = shared.set_plans(&grant.plans, &mut state.store, ns);
            changed |= shared.set_share(grant.share, &mut state.store, ns);
            if joining && grant.share > 0.0 {
                // What the fleet's buckets hold beyond what the others may hold (their shares
                // of the burst, at most), rather than nothing: the fleet never holds more
                // than its buckets.
                for (limit, &level) in limits.iter().zip(&grant.levels) {
                    let others = (1.0 - grant.share) * limit.capacity() as f64;
                    let part = (level as f64 - others).max(0.0).floor() as u64;
                    state.store.fill_to(limit, part, ns);
                    changed = true;
                }
            }
            for (limit, hold) in limits.iter().zip(&grant.holds) {
                if !hold.is_zero() {
                    let until = ns.saturating_add(crate::budget::memory::store::nanos(*hold));
                    changed |= state.store.pause(limit.dimension(), until, ns, false);
                }
            }
            changed
        });
    }

    /// The lease ended and its renewals failed: the failure policy's local share applies until
    /// a renewal.
    pub(crate) fn lease_lost(&self, policy: FailurePolicy) {
        let share = match policy {
            FailurePolicy::LocalFallback { share } => share,
            FailurePolicy::FailClosed => 0.0,
        };
        let ns = self.nanos_since_origin(Instant::now());
        self.update_state(|state| match state.shared.as_mut() {
            Some(shared) => {
                // The fallback's share has no end: it lasts until a renewal.
                if let Some(lease) = &mut shared.lease {
                    lease.ends = None;
                }
                shared.set_share(share, &mut state.store, ns);
                true
            }
            None => false,
        });
    }
}

impl Drop for Shared {
    /// The last handle on a leasing budget is gone: its renewal task wakes to give the share
    /// back now, rather than letting it lapse at its lease's end.
    fn drop(&mut self) {
        if let Some(remote) = self.remote.as_ref().filter(|r| r.leases()) {
            remote.wants_more.notify_one();
        }
    }
}

#[cfg(feature = "redis")]
impl Budget {
    /// Starts renewing the leased share of a budget that leases one.
    pub(in crate::budget) fn start_leasing(&self) {
        let Some(remote) = self.shared.remote.as_ref() else {
            return;
        };
        let Some(lease) = remote.options.leases else {
            return;
        };
        let budget = (Arc::downgrade(&self.shared), remote.wants_more.clone());
        let failing = (remote.options.policy, remote.options.timeout);
        let store = remote.store.clone();
        tokio::spawn(keep_leasing(store, budget, remote.instance, lease, failing));
    }
}

#[cfg(feature = "redis")]
/// Renews the budget's leased share every refresh (sooner when requests wait for more) until
/// the budget is dropped, then gives it back. A renewal that fails leaves the share as it is
/// until its lease ends; then the failure policy's local share applies. A lease that ends
/// before it is renewed (this task ran late) admits nothing meanwhile: the admissions check
/// its end.
async fn keep_leasing(
    store: Arc<dyn RemoteStore>,
    (budget, wants_more): (Weak<Shared>, Arc<tokio::sync::Notify>),
    process: u64,
    options: LeaseOptions,
    (policy, timeout): (FailurePolicy, Duration),
) {
    use std::future::Future;
    use std::task::Poll;

    let mut last = Instant::now();
    let mut ends: Option<Instant> = None;
    loop {
        let Some(shared) = budget.upgrade() else {
            let leave = store.lease(process, options.lease, Arc::from([]), Demand::leave());
            let _ = tokio::time::timeout(timeout, leave).await;
            return;
        };
        let budget_now = Budget { shared };
        let asked = Instant::now();
        let (limits, demand) = budget_now.lease_demand(asked.saturating_duration_since(last));
        last = asked;
        let call = store.lease(process, options.lease, limits.clone(), demand.clone());
        let answer = tokio::time::timeout(timeout, call).await;
        let failed = !matches!(answer, Ok(Ok(_)));
        match answer {
            Ok(Ok(grant)) => {
                let end = local_end(asked, grant.lease);
                ends = Some(end);
                budget_now.apply_lease(&grant, &limits, &demand, end);
            }
            Ok(Err(error)) => tracing::debug!(%error, "a leased share was not renewed"),
            Err(_) => tracing::debug!("a leased share was not renewed in time"),
        }
        let renewed = ends.is_some_and(|end| Instant::now() < end);
        if !renewed && failed {
            budget_now.lease_lost(policy);
        }
        drop(budget_now);
        // Every refresh; sooner (an eighth of it at least after the last call) when requests
        // wait for more.
        tokio::time::sleep_until(asked + options.refresh / 8).await;
        let mut more = std::pin::pin!(wants_more.notified());
        let mut due = std::pin::pin!(tokio::time::sleep_until(asked + options.refresh));
        std::future::poll_fn(|cx| {
            if more.as_mut().poll(cx).is_ready() || due.as_mut().poll(cx).is_ready() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
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
