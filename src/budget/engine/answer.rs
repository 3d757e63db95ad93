//! The shared store's answer to a head's question (`Step::Ask`), an abandoned question, and
//! the question itself. The asker left the ordering to ask; refused, it comes back to its
//! place (or joins, if it asked on arrival).

use std::sync::Arc;
use std::task::Waker;

use super::{Pass, Waiting};
use crate::budget::handle::Engine;
use crate::budget::memory::store::ReservationId;
use crate::budget::store::state::{Remote, RemoteState};
use crate::budget::store::{Control, Decision, FailurePolicy, PathLimits, StoreFuture};
use crate::error::{InsufficientCapacity, StoreUnavailable};
use crate::quota::Limit;
use crate::sched::order::Full;
use crate::sched::saturating_deadline;
use crate::tenant::{Refusal, Tenant, TenantRefused};

/// About how long a request waits before asking again for a slot that every process's calls
/// hold (another process's call ending tells nobody here): between half and one and a half
/// of it, at random, so that the waiting processes do not ask together.
const SLOT_RECHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// How soon a question the store failed to answer is asked again, under
/// [`FailurePolicy::FailClosed`] while the breaker stays closed.
const AGAIN_AFTER_FAILURE: std::time::Duration = std::time::Duration::from_millis(5);

/// What a shared budget makes of its store's answer.
pub(crate) enum Answer {
    Admitted,
    Never(InsufficientCapacity),
    /// Denied for now: ask again at this instant (unless a refund reaches the store first:
    /// the second field counts them), keeping the place in the queue.
    RetryAt(tokio::time::Instant, u64),
    /// Denied, and the ordering is too deep to wait in.
    Full(usize),
    /// Denied by a node of its tenant path: out of the ordering, keeping its place, until this
    /// instant (or until woken), parked at that node.
    Parked(tokio::time::Instant, (usize, u64)),
    /// Refused by a node of its tenant path that could not pay within its `max_wait`.
    Refused(crate::tenant::TenantRefused),
    /// The store failed: admit from the local fallback share.
    Fallback,
    Unavailable(StoreUnavailable),
}

impl Engine {
    /// What the shared store answered to the question `id` of `waiting`.
    pub(crate) fn answered(
        &self,
        waiting: &mut Waiting,
        id: ReservationId,
        answer: Result<Decision, StoreUnavailable>,
        waker: &Waker,
    ) -> Answer {
        let mut pass = Pass::new(self, waker);
        let answer = pass.answered(waiting, id, answer);
        // A question ended: the head may ask (or be admitted) now. It is woken even when it
        // is a future of the answering task: that task may have polled it earlier in this
        // very pass (`join!`, `join_all`, `select!`), and nothing else would poll it again.
        // An answer happens once, so this cannot spin.
        let head = pass.state.queue.head_waker(pass.now);
        pass.wake(head);
        pass.finish();
        answer
    }

    /// A question to the shared store was abandoned (its caller left): give back whatever it
    /// may have taken, and let another caller probe the store.
    pub(crate) fn abandoned(&self, id: ReservationId, waiting: &Waiting) {
        let mut pass = Pass::new(self, Waker::noop());
        pass.state.slots.fulfil(false);
        let shared = pass.remote();
        shared.asking = shared.asking.saturating_sub(1);
        shared.breaker.abandoned(id.get());
        pass.give_back(id, waiting);
        let head = pass.state.queue.head_waker(pass.now);
        pass.wake(head);
        pass.finish();
    }

    /// The question for the shared store, bounded by its timeout.
    pub(crate) fn ask(
        &self,
        id: ReservationId,
        ask: &super::Ask,
        (limits, path): (Arc<[Limit]>, PathLimits),
    ) -> StoreFuture<Decision> {
        let what = (ask.cost, ask.floor, ask.scheduling.priority);
        self.remote()
            .reserve(id, what, (limits, path, ask.tenant.clone()))
    }

    fn remote(&self) -> &Remote {
        match &self.remote {
            Some(remote) => remote,
            None => unreachable!("only a shared budget asks a shared store"),
        }
    }
}

impl Pass<'_> {
    fn answered(
        &mut self,
        waiting: &mut Waiting,
        id: ReservationId,
        answer: Result<Decision, StoreUnavailable>,
    ) -> Answer {
        let shared = self.remote();
        shared.asking = shared.asking.saturating_sub(1);
        self.state
            .slots
            .fulfil(matches!(answer, Ok(Decision::Admitted)));
        let decision = match answer {
            Ok(decision) => decision,
            Err(error) => return self.store_failed(waiting, id, error),
        };
        self.remote().breaker.succeeded();
        match decision {
            Decision::Admitted => self.admitted_by_store(waiting),
            Decision::Denied { wait, limit, .. } if self.is_node_limit(limit, waiting) => {
                self.denied_by_node(waiting, wait, limit)
            }
            Decision::Denied {
                wait,
                floor_only,
                first,
                ..
            } => self.denied(waiting, wait, floor_only, first),
            Decision::TooLarge { limit } => self.too_large(waiting, limit),
            Decision::Paused { depth } => self.paused_by_store(waiting, depth),
            Decision::DayCapped { control, used } => self.capped_by_store(waiting, control, used),
            Decision::NoSlot { control } => self.no_slot_in_store(waiting, control),
        }
    }

    /// The store's control `control` of the request's path, as this process sent it.
    fn control(&self, waiting: &Waiting, control: usize) -> Option<(Tenant, Control)> {
        let path = self.state.path_limits(waiting.ask.tenant.as_ref());
        path.controls.get(control).cloned()
    }

    /// A daily cap of its path is spent over every process: refused, as a local cap refuses.
    fn capped_by_store(&mut self, waiting: &mut Waiting, control: usize, used: u64) -> Answer {
        let (scope, reason) = match self.control(waiting, control) {
            Some((node, Control::Daily(cap))) => (
                node,
                Refusal::PeriodCap {
                    dimension: cap.dimension(),
                    window: cap.window(),
                    cap: cap.amount().get(),
                    used,
                    resets_at: cap.window().resets_at(self.unix_seconds()),
                    soft: cap.is_soft(),
                },
            ),
            // The tree changed since the question left: the store's word stands, as the
            // request's own node's pause.
            _ => (self.tenant(waiting).clone(), Refusal::Paused),
        };
        self.leave(&mut waiting.place);
        Answer::Refused(TenantRefused { scope, reason })
    }

    /// Every slot of an in-flight cap of its path is held by a live process: past the node's
    /// `max_wait` it is refused; else it steps out of the ordering, keeping its place, and
    /// asks again a little later (another process's call ending tells nobody here).
    fn no_slot_in_store(&mut self, waiting: &mut Waiting, control: usize) -> Answer {
        let (node, max) = match self.control(waiting, control) {
            Some((node, Control::InFlight(max))) => (node, max.get()),
            _ => (self.tenant(waiting).clone(), 0),
        };
        let wait = SLOT_RECHECK.mul_f64(0.5 + fastrand::f64());
        let ask = &waiting.ask;
        let tenant = ask.tenant.as_ref().expect("a path was asked for");
        let tenants = self.state.tenants.as_mut().expect("a path was asked for");
        let times = (self.now, ask.scheduling.enqueued_at);
        let refusal = Refusal::InFlight { max };
        if let Some(refused) = tenants.refuses_after(tenant, node.depth(), refusal, wait, times) {
            #[cfg(feature = "metrics")]
            crate::budget::tenants::state::refused_metric(tenants, &refused);
            self.leave(&mut waiting.place);
            return Answer::Refused(refused);
        }
        let ticket = tenants.park(tenant, node.depth(), ask.scheduling.priority, self.waker);
        Answer::Parked(saturating_deadline(self.now, wait), (node.depth(), ticket))
    }

    /// The tenants' wall clock now, in seconds since the epoch (when a cap starts again).
    fn unix_seconds(&self) -> u64 {
        (self.state.tenants.as_ref()).map_or(0, |tenants| tenants.unix_seconds(self.now))
    }

    fn tenant<'w>(&self, waiting: &'w Waiting) -> &'w Tenant {
        waiting
            .ask
            .tenant
            .as_ref()
            .expect("only a tenant's request meets a node's control")
    }

    /// A node of its path is paused in the store (by this process or another): refused, as
    /// a local pause refuses. Not remembered here: a resume in any process lifts it.
    fn paused_by_store(&mut self, waiting: &mut Waiting, depth: usize) -> Answer {
        let tenant = waiting
            .ask
            .tenant
            .as_ref()
            .expect("only a tenant's request is paused");
        let refused = crate::budget::tenants::tree::paused(tenant, depth);
        self.leave(&mut waiting.place);
        Answer::Refused(refused)
    }

    /// Admitted by the store, which took the path's shared buckets: a request that waited is
    /// served in its tenant's fair share (one admitted as it arrived, nobody waiting, is not,
    /// as in memory), and this process's part of the tree (slots, days, meters, local
    /// buckets) takes its share.
    fn admitted_by_store(&mut self, waiting: &mut Waiting) -> Answer {
        self.remote().refused = false;
        if let Some(mine) = waiting.place.take() {
            self.state.queue.serve_away(mine);
        }
        let ask = &waiting.ask;
        if let (Some(tenants), Some(tenant)) = (&mut self.state.tenants, &ask.tenant) {
            tenants.take(tenant, &ask.cost, self.ns, self.now);
        }
        Answer::Admitted
    }

    /// Whether the store's `limit` (an index past the account's) is a node of the path.
    fn is_node_limit(&mut self, limit: usize, waiting: &Waiting) -> bool {
        limit >= self.remote().limits().len()
            && self.state.tenants.is_some()
            && !self
                .state
                .path_limits(waiting.ask.tenant.as_ref())
                .limits
                .is_empty()
    }

    /// A node of its path cannot pay yet (other processes spent it): past the node's
    /// `max_wait` it is refused; else it steps out of the ordering, keeping its place, until
    /// then. The account did not refuse, so the others keep asking.
    fn denied_by_node(
        &mut self,
        waiting: &mut Waiting,
        wait: std::time::Duration,
        limit: usize,
    ) -> Answer {
        let path = self.state.path_limits(waiting.ask.tenant.as_ref());
        let account = self.remote().limits().len();
        let nodes = &path.limits;
        let (node, node_limit) = &nodes[(limit - account).min(nodes.len() - 1)];
        let ask = &waiting.ask;
        let tenant = ask.tenant.as_ref().expect("a path was asked for");
        let tenants = self.state.tenants.as_mut().expect("checked");
        let (depth, dimension) = (node.depth(), node_limit.dimension());
        let times = (self.now, ask.scheduling.enqueued_at);
        let refusal = Refusal::RateLimited {
            dimension,
            period: node_limit.period(),
            retry_after: wait,
        };
        if let Some(refused) = tenants.refuses_after(tenant, depth, refusal, wait, times) {
            #[cfg(feature = "metrics")]
            crate::budget::tenants::state::refused_metric(tenants, &refused);
            self.leave(&mut waiting.place);
            return Answer::Refused(refused);
        }
        let ticket = tenants.park(tenant, depth, ask.scheduling.priority, self.waker);
        let at = saturating_deadline(self.now, self.engine.remote().jittered(wait));
        Answer::Parked(at, (depth, ticket))
    }

    /// Denied for now by the account: back to its place until the store's wait is over.
    /// Refused only to keep its class floor, it lets a request with a lower floor ask instead.
    fn denied(
        &mut self,
        waiting: &mut Waiting,
        wait: std::time::Duration,
        floor_only: bool,
        first: bool,
    ) -> Answer {
        self.remote().refused = true;
        if let Err(depth) = self.back(waiting) {
            return Answer::Full(depth);
        }
        if let Some(mine) = waiting.place {
            let other = self
                .state
                .queue
                .set_floor_blocked(mine, floor_only, self.now);
            self.wake(other);
        }
        // First in the store's line, it asks exactly when told: the others wait for it.
        let wait = if first {
            wait
        } else {
            self.engine.remote().jittered(wait)
        };
        let at = saturating_deadline(self.now, wait);
        Answer::RetryAt(at, self.remote().refunds)
    }

    /// A limit, as the store knows it (the account's or a node's), is below the cost.
    fn too_large(&mut self, waiting: &mut Waiting, limit: usize) -> Answer {
        self.leave(&mut waiting.place);
        let path = self.state.path_limits(waiting.ask.tenant.as_ref());
        let shared = self.remote();
        let cost = &waiting.ask.cost;
        let nodes = &path.limits;
        match limit
            .checked_sub(shared.limits().len())
            .filter(|_| !nodes.is_empty())
        {
            None => Answer::Never(shared.too_large(limit, cost)),
            Some(node) => {
                let (_, limit) = nodes[node.min(nodes.len() - 1)];
                let dimension = limit.dimension();
                Answer::Never(InsufficientCapacity {
                    dimension,
                    period: limit.period(),
                    cost: cost.amount(dimension),
                    capacity: limit.capacity(),
                })
            }
        }
    }

    /// The store did not answer: the script may have run after all, so whatever it took is
    /// given back; then the local fallback share, or under [`FailurePolicy::FailClosed`] a
    /// new question soon while the breaker stays closed (one slow answer is not an outage)
    /// and a refusal once it opens. Each failure is logged with its cause.
    fn store_failed(
        &mut self,
        waiting: &mut Waiting,
        id: ReservationId,
        error: StoreUnavailable,
    ) -> Answer {
        let ns = self.ns;
        let breaker = &mut self.remote().breaker;
        let was_closed = breaker.is_closed();
        breaker.failed(id.get(), ns);
        let closed = breaker.is_closed();
        self.give_back(id, waiting);
        let policy = self.engine.remote().policy();
        if was_closed && !closed {
            tracing::warn!(%error, ?policy, "the shared quota store failed repeatedly: its breaker opened");
        } else {
            tracing::warn!(%error, ?policy, "the shared quota store did not answer");
        }
        match policy {
            FailurePolicy::LocalFallback { .. } | FailurePolicy::LiveShare { .. } => {
                match self.back(waiting) {
                    Ok(()) => Answer::Fallback,
                    Err(depth) => Answer::Full(depth),
                }
            }
            FailurePolicy::FailClosed if closed => match self.back(waiting) {
                Ok(()) => {
                    let wait = self.engine.remote().jittered(AGAIN_AFTER_FAILURE);
                    Answer::RetryAt(saturating_deadline(self.now, wait), self.remote().refunds)
                }
                Err(depth) => Answer::Full(depth),
            },
            FailurePolicy::FailClosed => {
                self.leave(&mut waiting.place);
                Answer::Unavailable(error)
            }
        }
    }

    /// Releases in the store whatever question `id` may have taken.
    fn give_back(&mut self, id: ReservationId, waiting: &Waiting) {
        let path = self.state.path_limits(waiting.ask.tenant.as_ref());
        let limits = self.remote().limits().clone();
        self.engine
            .remote()
            .release(id, waiting.ask.cost, limits, path);
    }

    /// Back to its place in the ordering (or into it, if it asked on arrival); the depth when
    /// the ordering is full.
    fn back(&mut self, waiting: &mut Waiting) -> Result<(), usize> {
        match waiting.place {
            Some(mine) => {
                self.state.queue.restore(mine, &waiting.ask, self.waker);
                Ok(())
            }
            None => match self
                .state
                .queue
                .wait(&mut waiting.place, &waiting.ask, self.waker)
            {
                Ok(()) => Ok(()),
                Err(Full(depth)) => Err(depth),
            },
        }
    }

    fn remote(&mut self) -> &mut RemoteState {
        self.state
            .remote
            .as_mut()
            .expect("a budget kept in a store has its remote state")
    }
}
