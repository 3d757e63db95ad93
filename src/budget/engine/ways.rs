//! The ways a request is paid for, behind one trait: an in-flight slot, its tenant nodes, a
//! question to the shared store, the buckets in memory.
//!
//! Every admission asks them in that order under the budget's lock ([`State::pay`]): the wait
//! engine's pass at the head of the ordering, `try_reserve`, the would-wait probe and the
//! layers' fast path alike. Each way answers that it can pay now or why not ([`Unpaid`]);
//! only once every way can pay does each take its part, so a request is paid all or nothing,
//! in one place. What a request does about a way that cannot pay (wait in its place, step out,
//! ask the store, sleep until the buckets can pay, give up) is the caller's.

use tokio::time::Instant;

use crate::budget::handle::State;
use crate::budget::memory::bucket::Floor;
use crate::budget::memory::store::{Denial, ReservationId, Store};
use crate::budget::tenants::tree::Check;
use crate::cost::Cost;
use crate::error::StoreUnavailable;
use crate::tenant::Tenant;

/// What an admission asks of every way: its cost, the floor its class keeps, its tenant path
/// and that path's check in this pass, and whether the shared store is to be asked.
pub(crate) struct Bill<'a> {
    pub(crate) cost: &'a Cost,
    pub(crate) floor: Floor,
    pub(crate) path: Option<&'a Tenant>,
    /// The tenant path's check in this pass (a refusal is answered before paying).
    pub(crate) check: Option<&'a Check>,
    /// The budget's clock (nanoseconds) and the instant it stands for.
    pub(crate) ns: u64,
    pub(crate) now: Instant,
    /// The budget is shared and its store is to be asked (not out of reach).
    pub(crate) ask_store: bool,
    /// Paid from a shared budget's local fallback share: why (the metric's reason).
    pub(crate) fallback: Option<&'static str>,
}

impl<'a> Bill<'a> {
    /// A bill for an in-memory budget.
    pub(crate) fn local(
        cost: &'a Cost,
        floor: Floor,
        path: Option<&'a Tenant>,
        check: Option<&'a Check>,
        (ns, now): (u64, Instant),
    ) -> Self {
        Self {
            cost,
            floor,
            path,
            check,
            ns,
            now,
            ask_store: false,
            fallback: None,
        }
    }
}

/// Why a way cannot pay now.
#[derive(Debug)]
pub(crate) enum Unpaid {
    /// Every in-flight slot is taken: one comes back when a call ends.
    NoSlot,
    /// A node of the tenant path cannot pay yet: the path's check (`Check::Blocked`) says
    /// which, and until when.
    Node,
    /// The shared store is to be asked.
    Store,
    /// The buckets cannot pay: not before a time, or never.
    Buckets(Denial),
    /// The shared store is out of reach and the local fallback share can never hold the cost.
    Unavailable(StoreUnavailable),
}

/// One of the ways a request is paid for.
pub(crate) trait Way {
    /// Whether it can pay for `bill` now, or why not. Changes nothing.
    fn can_pay(&self, state: &State, bill: &Bill<'_>) -> Result<(), Unpaid>;

    /// Takes its part of `bill`: every way said it can pay.
    fn take(&self, state: &mut State, bill: &Bill<'_>);
}

/// An in-flight slot ([`Quota::with_max_in_flight`](crate::Quota::with_max_in_flight)).
struct InFlight;

impl Way for InFlight {
    fn can_pay(&self, state: &State, _: &Bill<'_>) -> Result<(), Unpaid> {
        if state.slots.free() {
            Ok(())
        } else {
            Err(Unpaid::NoSlot)
        }
    }

    fn take(&self, state: &mut State, _: &Bill<'_>) {
        state.slots.take();
    }
}

/// The nodes of the request's tenant path (their limits, days and calls in flight).
struct Nodes;

impl Way for Nodes {
    fn can_pay(&self, _: &State, bill: &Bill<'_>) -> Result<(), Unpaid> {
        match bill.check {
            Some(Check::Blocked { .. }) => Err(Unpaid::Node),
            _ => Ok(()),
        }
    }

    fn take(&self, state: &mut State, bill: &Bill<'_>) {
        if let (Some(tenants), Some(path)) = (&mut state.tenants, bill.path) {
            tenants.take(path, bill.cost, bill.ns, bill.now);
        }
    }
}

/// A question to the shared store, for a shared budget: asked by the engine (it answers
/// later); paying from the local fallback share instead is counted here.
struct SharedStore;

impl Way for SharedStore {
    fn can_pay(&self, _: &State, bill: &Bill<'_>) -> Result<(), Unpaid> {
        if bill.ask_store {
            Err(Unpaid::Store)
        } else {
            Ok(())
        }
    }

    fn take(&self, _: &mut State, bill: &Bill<'_>) {
        if let Some(reason) = bill.fallback {
            crate::observe::fallback(reason);
        }
    }
}

/// The buckets in memory: the budget's own, or a shared budget's local fallback share.
struct Buckets;

impl Way for Buckets {
    fn can_pay(&self, state: &State, bill: &Bill<'_>) -> Result<(), Unpaid> {
        let too_large = |state: &State| state.store.check_capacity(bill.cost, bill.floor).is_err();
        let leasing = state.remote.as_ref().filter(|s| s.lease.is_some());
        if let Some((shared, lease)) = leasing.and_then(|s| Some((s, s.lease.as_ref()?))) {
            // Larger than the account: never (a store asked per admission says so itself).
            shared
                .check_capacity(bill.cost, bill.floor)
                .map_err(|e| Unpaid::Buckets(Denial::Never(e)))?;
            if lease.closed(bill.ns) && lease.unreachable {
                return Err(Unpaid::Unavailable(StoreUnavailable::new(
                    "the shared store is out of reach and the lease has ended",
                )));
            }
            if lease.closed(bill.ns) {
                // No grant yet, or it ended and its renewal is late: nothing until one.
                let at = bill.ns.saturating_add(lease.refresh / 8);
                return Err(Unpaid::Buckets(Denial::NotUntil { at, limit: 0 }));
            }
            if !lease.fallback {
                // The wallets hold it, or it waits for a grant that covers it (which wakes it;
                // it looks again after a refresh at the latest). A wallet holds what was
                // granted for the requests waiting in order: no floor is kept in it.
                let next = bill.ns.saturating_add(lease.refresh);
                return state
                    .store
                    .check(bill.cost, Floor::NONE, bill.ns)
                    .map_err(|d| {
                        Unpaid::Buckets(match d {
                            Denial::NotUntil { at, limit } => Denial::NotUntil {
                                at: at.min(next),
                                limit,
                            },
                            never => never,
                        })
                    });
            }
        }
        if state.remote.is_some() && too_large(state) {
            return Err(Unpaid::Unavailable(StoreUnavailable::new(
                "the shared store is out of reach and the cost exceeds the local fallback share",
            )));
        }
        state
            .store
            .check(bill.cost, bill.floor, bill.ns)
            .map_err(Unpaid::Buckets)
    }

    fn take(&self, state: &mut State, bill: &Bill<'_>) {
        if let Some(shared) = state.remote.as_mut() {
            if let Some(lease) = shared.lease.as_mut() {
                lease.spent = lease.spent.saturating_add(*bill.cost);
                lease.blocked = None;
                // A large part of the account spent at once: the store learns of it sooner
                // (until then it counts it as held, and refills the account less).
                let large = (shared.limits.iter())
                    .any(|l| bill.cost.amount(l.dimension()).saturating_mul(8) >= l.capacity());
                if large {
                    (lease.spent_much).store(true, std::sync::atomic::Ordering::Relaxed);
                    lease.renew_soon.notify_one();
                }
            }
        }
        if state.remote.is_none() {
            state.held = state.held.saturating_add(*bill.cost);
        }
        state.store.take(bill.cost, bill.ns);
    }
}

impl State {
    /// Pays `bill` every way, or none: the first way that cannot pay says why. The ways are
    /// asked in order (an in-flight slot, the tenant nodes, the shared store, the buckets),
    /// called directly rather than through a list, so that the fast path stays inlined.
    pub(crate) fn pay(&mut self, bill: &Bill<'_>) -> Result<ReservationId, Unpaid> {
        InFlight.can_pay(self, bill)?;
        Nodes.can_pay(self, bill)?;
        SharedStore.can_pay(self, bill)?;
        Buckets.can_pay(self, bill)?;
        InFlight.take(self, bill);
        Nodes.take(self, bill);
        SharedStore.take(self, bill);
        Buckets.take(self, bill);
        Ok(self.next_id())
    }
}
