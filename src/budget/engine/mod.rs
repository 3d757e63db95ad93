//! The wait engine: how a waiting request is admitted, read top to bottom.
//!
//! Every admission of a budget goes through [`Engine::poll_admission`], one *pass* under the
//! budget's lock. A pass asks, in this order:
//!
//! 1. **the tenant path** ([`Pass::check_path`]): a node that refuses the request (paused,
//!    its day spent, past its `max_wait`) ends it at once, waiting or not; then, once, **its
//!    deadline** ([`Pass::predict`]): a deadline the costs waiting ahead of it and the
//!    quota's rate say it cannot meet ends it at once, with the predicted wait;
//! 2. **the ordering** ([`Pass::join`]): while others wait, a newcomer takes its place in the
//!    one ordering (`sched::order`: class, aging, fair share, arrival) rather than overtaking;
//! 3. **its turn** ([`Pass::take_turn`]): only the head may go (or a request behind heads that
//!    wait only for a higher class floor); the others wait without a timer; a head that may
//!    not go yet ([`Pass::not_yet`], a retry waiting out `Retry-After`) holds its place until
//!    its time;
//! 4. **the ways the request is paid for** ([`Pass::pay`], [`ways`]): an in-flight slot, its
//!    tenant nodes, a question to the shared store, the buckets in memory, all paid or none.
//!    The first that cannot pay says how the request waits: in its place for a slot, woken
//!    when a call ends; out of the ordering, keeping its place, for a node of its tenant path
//!    ([`Pass::park`]), so that the others go meanwhile; out of the ordering to ask the shared
//!    store ([`Pass::ask_store`], and [`answer`] handles the reply); asleep until the buckets
//!    can pay ([`Pass::wait_for_buckets`]).
//!
//! Wakers are collected during a pass and woken after the lock is released. A head is told to
//! look once per turn (`WaitList::tell_head`), so futures polled by one task cannot keep waking
//! each other.
//!
//! `immediate.rs` answers without waiting (`try_reserve`, the would-wait probe, the layers'
//! fast path), paying the same ways; `waiters.rs` is the ordering's data (the waiting requests and the in-flight
//! slots), plain, with no clock and no lock.

mod answer;
mod immediate;
pub(crate) mod waiters;
pub(crate) mod ways;

use std::convert::Infallible;
use std::ops::ControlFlow::{self, Break, Continue};
use std::sync::Arc;
use std::task::Waker;

use tokio::time::Instant;

use super::handle::{Engine, State};
use super::store::{FailurePolicy, PathLimits};
use crate::budget::memory::bucket::Floor;
use crate::budget::memory::store::{Denial, Origin, ReservationId, Store};
use crate::budget::tenants::tree::Check;
use crate::error::{InsufficientCapacity, StoreUnavailable};
use crate::loom::MutexGuard;
use crate::quota::Limit;
use crate::sched::order::{Full, Place};
use crate::tenant::{Tenant, TenantRefused};

pub(crate) use answer::Answer;
pub(crate) use waiters::{Ask, Slots, WaitList};
use ways::{Bill, Unpaid};

/// How long before its time a request held back ([`Pass::hold_back`]) comes back to its
/// place: a millisecond.
const RETURN_LEAD: std::time::Duration = std::time::Duration::from_millis(1);

/// What a waiting admission carries from one pass to the next: what it asks, its place, and
/// what the shared store told it.
#[derive(Debug)]
pub(crate) struct Waiting {
    pub(crate) ask: Ask,
    /// The place in the budget's ordering, while in it (also while stepped out).
    pub(crate) place: Option<Place>,
    /// The store's hint: not to be asked again before this instant, unless a refund (the
    /// second field counts them) reached it since.
    pub(crate) retry_at: Option<(Instant, u64)>,
    /// The store failed: admit from the local fallback share.
    pub(crate) local: bool,
    /// Out of the ordering (keeping its place) until a node of its tenant path can pay: the
    /// depth of that node and the parking's ticket.
    pub(crate) parked: Option<(usize, u64)>,
    /// Out of the ordering (keeping its place) until shortly before it may go.
    pub(crate) held_back: bool,
    /// Its deadline was checked against the predicted wait (once, on arrival).
    pub(crate) predicted: bool,
}

impl Waiting {
    pub(crate) fn new(ask: Ask) -> Self {
        Self {
            ask,
            place: None,
            retry_at: None,
            local: false,
            parked: None,
            held_back: false,
            predicted: false,
        }
    }
}

/// One step of a waiting admission.
pub(crate) enum Step {
    Admitted(ReservationId, Origin),
    Never(InsufficientCapacity),
    /// The ordering holds as many requests as the request's configuration allows.
    Full(usize),
    /// The shared store could not be asked, and the policy is to refuse.
    Unavailable(StoreUnavailable),
    /// At the head of the queue of a shared budget: ask the shared store, under this id, for
    /// the account's limits and those of the tenant path's nodes.
    Ask(ReservationId, Arc<[Limit]>, PathLimits),
    /// At the head of the queue: the cost fits at this instant.
    WaitUntil(Instant),
    /// Behind others, or waiting for an in-flight slot or a question to the store: woken
    /// when it may go.
    Queued,
    /// A node of its tenant path refused it.
    Refused(TenantRefused),
    /// It would wait this long (predicted on arrival), past its deadline.
    Late(std::time::Duration, crate::Limit),
    /// Out of the ordering, keeping its place, until a node of its tenant path can pay: at
    /// this instant, or when woken (one of the node's calls ended).
    Parked(Option<Instant>),
}

impl Engine {
    /// One pass of [`Reserve`](super::Reserve): admit, queue, or say when to look again. See
    /// the [module documentation](self) for the order of the questions.
    pub(crate) fn poll_admission(&self, waiting: &mut Waiting, waker: &Waker) -> Step {
        let mut pass = Pass::new(self, waker);
        let step = match pass.admit(waiting) {
            Break(step) => step,
            Continue(never) => match never {},
        };
        pass.finish();
        step
    }

    /// Gives up a place in the ordering.
    pub(crate) fn cancel(&self, place: Place) {
        let mut pass = Pass::new(self, Waker::noop());
        pass.leave(&mut Some(place));
        pass.finish();
    }
}

/// One pass under the budget's lock, and the wakers to wake once it is released.
pub(crate) struct Pass<'a> {
    engine: &'a Engine,
    state: MutexGuard<'a, State>,
    waker: &'a Waker,
    now: Instant,
    /// `now` on the budget's clock.
    ns: u64,
    wake: [Option<Waker>; 3],
}

impl<'a> Pass<'a> {
    pub(crate) fn new(engine: &'a Engine, waker: &'a Waker) -> Self {
        let now = Instant::now();
        Self {
            engine,
            ns: engine.nanos_since_origin(now),
            state: engine.lock(),
            waker,
            now,
            wake: [None, None, None],
        }
    }

    /// The questions of a pass, in order; each ends the pass (`Break`) or lets the next ask.
    fn admit(&mut self, waiting: &mut Waiting) -> ControlFlow<Step, Infallible> {
        let path = self.check_path(waiting)?;
        self.predict(waiting)?;
        self.hold_back(waiting)?;
        self.join(waiting)?;
        self.take_turn(waiting)?;
        self.not_yet(waiting)?;
        Break(self.pay(waiting, path))
    }

    /// Releases the lock, then wakes whoever the pass named.
    pub(crate) fn finish(self) {
        let Self { state, wake, .. } = self;
        drop(state);
        for waker in wake.into_iter().flatten() {
            waker.wake();
        }
    }

    /// Wakes `waker` once the lock is released.
    fn wake(&mut self, waker: Option<Waker>) {
        let Some(waker) = waker else { return };
        match self.wake.iter_mut().find(|slot| slot.is_none()) {
            Some(slot) => *slot = Some(waker),
            // A pass names at most three; should that change, waking under the lock is only
            // slower.
            None => waker.wake(),
        }
    }

    /// 1. The tenant path: resolved (the tree's default when the request named none) and
    ///    checked; a refusal ends the request here, in the ordering or not.
    fn check_path(&mut self, waiting: &mut Waiting) -> ControlFlow<Step, Option<Check>> {
        let State { tenants, queue, .. } = &mut *self.state;
        let Some(tenants) = tenants.as_mut() else {
            return Continue(None);
        };
        let ask = &mut waiting.ask;
        let path = ask.tenant.get_or_insert_with(|| tenants.path_of(None));
        if let Some((depth, ticket)) = waiting.parked.take() {
            // Back from parking, to its place.
            tenants.unpark(path, depth, ticket);
            if let Some(mine) = waiting.place {
                queue.restore(mine, ask, self.waker);
            }
        } else if waiting.place.is_none() {
            ask.scheduling.flow = tenants.flow(path);
        }
        let path = ask.tenant.as_ref().expect("resolved above");
        let arrived = ask.scheduling.enqueued_at;
        match tenants.check(path, &ask.cost, self.ns, self.now, arrived) {
            Check::Refused(refused) => {
                #[cfg(feature = "metrics")]
                crate::budget::tenants::state::refused_metric(tenants, &refused);
                self.leave(&mut waiting.place);
                Break(Step::Refused(refused))
            }
            check => Continue(Some(check)),
        }
    }

    /// 1a. Its deadline, once, on arrival: when the buckets' refill cannot pay before it, the
    ///     request is refused at once with the predicted wait, rather than after waiting it
    ///     out. A caller's own deadline counts the costs waiting ahead of it (its class and
    ///     those above, and lower fronts aged to its class) at their estimates, and nothing of
    ///     what calls in flight will refund: refunds make the real wait shorter, later
    ///     arrivals of a higher class longer. A class's longest wait is refused early only
    ///     when it cannot be met at all: its own cost, with nobody ahead and everything the
    ///     calls in flight hold given back at once (a spent limit of 2 requests a minute
    ///     refuses at once with the 30 s until it refills, not after the class's 5 s with a
    ///     guess). A shared budget cannot tell from here (its buckets live in its store): its
    ///     requests wait up to their deadline.
    fn predict(&mut self, waiting: &mut Waiting) -> ControlFlow<Step> {
        if waiting.place.is_some() || std::mem::replace(&mut waiting.predicted, true) {
            return Continue(());
        }
        let ask = &waiting.ask;
        let Some(deadline) = ask.scheduling.deadline else {
            return Continue(());
        };
        if self.state.remote.is_some() || self.state.check_capacity(&ask.cost, ask.floor).is_err() {
            // A cost that never fits is refused as such when it is paid.
            return Continue(());
        }
        let need = if ask.scheduling.own_deadline {
            (self.state.queue)
                .queued_ahead_of(ask.scheduling.priority, self.now)
                .saturating_add(ask.cost)
        } else {
            ask.cost.saturating_sub(self.state.held)
        };
        let Some((at, binding)) = (self.state.store).not_before(&need, self.ns) else {
            return Continue(());
        };
        let from = ask.scheduling.not_before.unwrap_or(self.now);
        let at = self.engine.instant(at).max(from);
        if at <= deadline {
            return Continue(());
        }
        let limit = self.state.store.limit(binding);
        Break(Step::Late(at.saturating_duration_since(self.now), limit))
    }

    /// 2. The ordering: while others wait, a newcomer takes a place (it may be the head's: a
    ///    higher class goes first), unless its cost can never fit; so does one that may not
    ///    go yet, whoever waits.
    fn join(&mut self, waiting: &mut Waiting) -> ControlFlow<Step> {
        let later = self.later(waiting).is_some();
        if waiting.place.is_some() || (self.state.queue.is_empty() && !later) {
            return Continue(());
        }
        if let Err(e) = self
            .state
            .check_capacity(&waiting.ask.cost, waiting.ask.floor)
        {
            return Break(Step::Never(e));
        }
        match self.wait(waiting) {
            Step::Full(depth) => Break(Step::Full(depth)),
            _ => Continue(()),
        }
    }

    /// 3. Its turn: only the head goes on (or a request behind heads that wait only for a
    ///    higher class floor).
    fn take_turn(&mut self, waiting: &mut Waiting) -> ControlFlow<Step> {
        let Some(mine) = waiting.place else {
            return Continue(());
        };
        if self.state.queue.may_go(mine, self.now) {
            self.state.queue.told(mine);
            return Continue(());
        }
        // Aging may have made another the head since the last event, and nobody else would
        // tell it: make sure it looks (once per turn, so that waiters polled together cannot
        // keep waking each other, whatever their wakers compare as).
        let step = self.wait(waiting);
        let head = self.state.queue.tell_head(self.now);
        self.wake(head);
        Break(step)
    }

    /// 1b. Not before its time (a retry waiting out `Retry-After`): the request takes its
    ///     place (its first attempt's), and steps out of the ordering keeping it, so that the
    ///     others go meanwhile; it comes back [`RETURN_LEAD`] before its time, so that a
    ///     request behind it whose cost fits at that very instant does not take its turn.
    fn hold_back(&mut self, waiting: &mut Waiting) -> ControlFlow<Step> {
        let Some(at) = waiting.ask.scheduling.not_before else {
            return Continue(());
        };
        let back = at.checked_sub(RETURN_LEAD).unwrap_or(at);
        if self.now >= back {
            if std::mem::take(&mut waiting.held_back) {
                let mine = waiting.place.expect("held back in its place");
                self.state.queue.restore(mine, &waiting.ask, self.waker);
            }
            return Continue(());
        }
        if !waiting.held_back {
            if let Step::Full(depth) = self.wait(waiting) {
                return Break(Step::Full(depth));
            }
            let mine = waiting.place.expect("placed above");
            let next = self.state.queue.step_out(mine, self.now);
            self.wake(next);
            waiting.held_back = true;
        }
        Break(Step::WaitUntil(back))
    }

    /// 3b. Not before its time: back in its place, the head waits for its time, and those
    ///     behind it wait behind it.
    fn not_yet(&mut self, waiting: &mut Waiting) -> ControlFlow<Step> {
        match self.later(waiting) {
            Some(at) => Break(Step::WaitUntil(at)),
            None => Continue(()),
        }
    }

    /// When the request may go, if not now.
    fn later(&self, waiting: &Waiting) -> Option<Instant> {
        (waiting.ask.scheduling.not_before).filter(|&at| at > self.now)
    }

    /// 4. The ways the request is paid for ([`ways`]): every one, or none. A shared budget
    ///    whose store answers asks it; out of its reach, the local fallback share pays.
    fn pay(&mut self, waiting: &mut Waiting, path: Option<Check>) -> Step {
        let ask_store =
            !waiting.local && (self.engine.asks_per_admission() || self.kept_in_store(waiting));
        let unpaid = match self.pay_every_way(waiting, path.as_ref(), ask_store) {
            Err(Unpaid::Store) => match self.ask_store(waiting) {
                Break(step) => return step,
                // The breaker is open and the policy fails open: the local share pays.
                Continue(()) => self.pay_every_way(waiting, path.as_ref(), false),
            },
            paid_or_not => paid_or_not,
        };
        match unpaid {
            Ok(id) => {
                let next = waiting
                    .place
                    .take()
                    .and_then(|mine| self.state.queue.serve(mine, self.now));
                self.wake(next);
                Step::Admitted(id, Origin::Local)
            }
            Err(unpaid) => self.unpaid(waiting, unpaid, path),
        }
    }

    /// A leasing budget asks the store per admission for a request whose tenant path has
    /// limits or controls (daily caps, caps on calls in flight) kept there: so they hold over
    /// every process. The account's bucket pays it, beside what the leases hold of it.
    fn kept_in_store(&self, waiting: &Waiting) -> bool {
        self.engine
            .kept_in_store(&self.state, waiting.ask.tenant.as_ref())
    }

    /// Pays `waiting` every way, asking the shared store or not.
    fn pay_every_way(
        &mut self,
        waiting: &Waiting,
        path: Option<&Check>,
        ask_store: bool,
    ) -> Result<ReservationId, Unpaid> {
        let ask = &waiting.ask;
        // A lease is no fallback.
        let shared = self
            .state
            .remote
            .as_ref()
            .is_some_and(|s| s.lease.is_none());
        let fallback = match (shared && !ask_store, waiting.local) {
            (false, _) => None,
            (true, true) => Some("store_unavailable"),
            (true, false) => Some("breaker_open"),
        };
        let bill = Bill {
            ask_store,
            fallback,
            ..Bill::local(
                &ask.cost,
                ask.floor,
                ask.tenant.as_ref(),
                path,
                (self.ns, self.now),
            )
        };
        self.state.pay(&bill)
    }

    /// How the request waits for the first way that could not pay, or gives up.
    fn unpaid(&mut self, waiting: &mut Waiting, unpaid: Unpaid, path: Option<Check>) -> Step {
        match unpaid {
            // The store is asked only on the first try: it did not answer `Continue`.
            Unpaid::NoSlot | Unpaid::Store => self.wait(waiting),
            Unpaid::Node => {
                let Some(Check::Blocked { depth, at, give_up }) = path else {
                    unreachable!("a node cannot pay only when the path's check says so")
                };
                let wake = match (at.map(|(at, _)| at), give_up) {
                    (Some(at), Some(give_up)) => Some(at.min(give_up)),
                    (at, give_up) => at.or(give_up),
                };
                self.park(waiting, depth, wake)
            }
            Unpaid::Buckets(Denial::NotUntil { at, .. }) => self.wait_for_buckets(waiting, at),
            Unpaid::Buckets(Denial::Never(e)) => {
                // Too large from the start, or a limit shrank below it while it waited.
                self.leave(&mut waiting.place);
                Step::Never(e)
            }
            Unpaid::Unavailable(e) => {
                self.leave(&mut waiting.place);
                Step::Unavailable(e)
            }
        }
    }

    /// A node of its tenant path cannot pay yet: the request steps out of the ordering,
    /// keeping its place, so that the others go meanwhile, and comes back when that node can
    /// pay (at `wake` on the budget's clock, or when one of the node's calls ends).
    fn park(&mut self, waiting: &mut Waiting, depth: usize, wake: Option<u64>) -> Step {
        if let Step::Full(depth) = self.wait(waiting) {
            return Step::Full(depth);
        }
        let mine = waiting.place.expect("placed above");
        let next = self.state.queue.step_out(mine, self.now);
        self.wake(next);
        let tenants = self.state.tenants.as_mut().expect("a budget with tenants");
        let path = waiting.ask.tenant.as_ref().expect("resolved");
        let priority = waiting.ask.scheduling.priority;
        waiting.parked = Some((depth, tenants.park(path, depth, priority, self.waker)));
        Step::Parked(wake.map(|at| self.engine.instant(at)))
    }

    /// The shared store, for a shared budget whose store answers: the head leaves the
    /// ordering to ask it (and comes back to its place if refused), so the next may ask too
    /// while the store admits; while the store refuses, one asks at a time. `Continue`: the
    /// breaker is open and the policy fails open, the local fallback share pays.
    fn ask_store(&mut self, waiting: &mut Waiting) -> ControlFlow<Step> {
        let (Some(remote), Some(shared)) = (&self.engine.remote, &self.state.remote) else {
            return Continue(());
        };
        // The store's wait, unless a refund reached the store since it told it.
        let refunds = shared.refunds;
        let now = self.now;
        if let Some((at, _)) = waiting
            .retry_at
            .filter(|(at, told)| *at > now && *told == refunds)
        {
            return Break(match self.wait(waiting) {
                Step::Queued => Step::WaitUntil(self.state.until_reorder(at, now)),
                other => other,
            });
        }
        let id = self.state.peek_id();
        let shared = self.state.remote.as_mut().expect("checked above");
        if !shared.may_ask() {
            // Another question is on its way while the store refuses.
            return Break(self.wait(waiting));
        }
        if shared.breaker.allow(id.get(), self.ns) {
            shared.asking += 1;
            let limits = shared.limits().clone();
            let path = self.state.path_limits(waiting.ask.tenant.as_ref());
            self.state.slots.promise();
            let next = waiting
                .place
                .and_then(|mine| self.state.queue.step_out(mine, now));
            self.wake(next);
            return Break(Step::Ask(self.state.next_id(), limits, path));
        }
        if remote.policy() == FailurePolicy::FailClosed {
            self.leave(&mut waiting.place);
            return Break(Step::Unavailable(StoreUnavailable::breaker_open()));
        }
        Continue(())
    }

    /// The head's buckets cannot pay before `at`: it sleeps until then (or until aging may
    /// reorder the fronts). Blocked only by its floor, it lets whoever may go instead look.
    fn wait_for_buckets(&mut self, waiting: &mut Waiting, at: u64) -> Step {
        let step = self.wait(waiting);
        if let Some(remote) = self.engine.remote.as_ref().filter(|r| r.leases()) {
            // Its wallets do not cover it (or the lease ended): the next renewal, sooner, asks
            // for its cost whole.
            if let Some(lease) = self.state.remote.as_mut().and_then(|s| s.lease.as_mut()) {
                lease.blocked = Some(waiting.ask.cost);
            }
            remote.wants_more.notify_one();
        }
        let Some(mine) = waiting.place else {
            return step;
        };
        let ask = &waiting.ask;
        let fits = self
            .state
            .store
            .not_before(&ask.cost, self.ns)
            .is_none_or(|(at, _)| at <= self.ns);
        let floor_only = ask.floor != Floor::NONE && fits;
        let other = self
            .state
            .queue
            .set_floor_blocked(mine, floor_only, self.now);
        self.wake(other);
        match step {
            Step::Queued => {
                Step::WaitUntil(self.state.until_reorder(self.engine.instant(at), self.now))
            }
            other => other,
        }
    }

    /// Joins the ordering, or refreshes the waker of a waiter already in it.
    fn wait(&mut self, waiting: &mut Waiting) -> Step {
        self.state
            .wait(&mut waiting.place, &waiting.ask, self.waker)
    }

    /// Leaves the ordering unserved, if in it; whoever may go instead is woken.
    fn leave(&mut self, place: &mut Option<Place>) {
        let next = place
            .take()
            .and_then(|mine| self.state.queue.remove(mine, self.now));
        self.wake(next);
    }
}

impl State {
    /// Fails when `cost` exceeds a capacity (less `floor`): of the shared limits for a shared
    /// budget, of the buckets for an in-memory one.
    pub(super) fn check_capacity(
        &self,
        cost: &crate::cost::Cost,
        floor: Floor,
    ) -> Result<(), InsufficientCapacity> {
        match &self.remote {
            Some(shared) => shared.check_capacity(cost, floor),
            None => self.store.check_capacity(cost, floor),
        }
    }

    /// Joins the ordering, or refreshes the waker of a waiter already in it: `Step::Queued`,
    /// or `Step::Full` when the ordering is as deep as the request allows.
    pub(super) fn wait(&mut self, place: &mut Option<Place>, ask: &Ask, waker: &Waker) -> Step {
        match self.queue.wait(place, ask, waker) {
            Ok(()) => Step::Queued,
            Err(Full(depth)) => Step::Full(depth),
        }
    }

    /// The limits and controls of the tenant nodes of `path` (the tree's default without one)
    /// and of the account's own caps, for the shared store (none without tenants).
    pub(super) fn path_limits(&self, path: Option<&Tenant>) -> PathLimits {
        match (&self.tenants, path) {
            (Some(tenants), Some(path)) => tenants.shared_path(path),
            (Some(tenants), None) => tenants.shared_path(&tenants.path_of(None)),
            (None, _) => PathLimits::default(),
        }
    }

    pub(super) fn next_id(&mut self) -> ReservationId {
        self.next_id += 1;
        ReservationId(self.next_id)
    }

    /// The id [`State::next_id`] will give.
    pub(super) fn peek_id(&self) -> ReservationId {
        ReservationId(self.next_id + 1)
    }

    /// `at`, or sooner when aging may change who goes first before then: the head sleeping
    /// until its cost fits looks again then, and hands over if it is no longer the head.
    pub(super) fn until_reorder(&self, at: Instant, now: Instant) -> Instant {
        self.queue
            .next_reorder(now)
            .map_or(at, |reorder| reorder.min(at))
    }
}
