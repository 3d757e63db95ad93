//! Admission through a shared store: what a budget makes of the store's answer to its
//! question (`Budget::answered`), an abandoned question, and the question itself.

use std::sync::Arc;
use std::task::Waker;

use tokio::time::Instant;

use super::bucket::Floor;
use super::handle::{Budget, State};
use super::remote::{Decision, FailurePolicy, PathLimits, StoreFuture};
use super::store::ReservationId;
use super::waiters::{Ask, WaitList};
use crate::cost::Cost;
use crate::error::InsufficientCapacity;
use crate::error::StoreUnavailable;
use crate::quota::Limit;
use crate::sched::order::{Full, Place};

/// What a shared budget makes of its store's answer.
pub(crate) enum Answer {
    Admitted,
    Never(InsufficientCapacity),
    /// Denied for now: ask again at this instant (unless a refund reaches the store first:
    /// the second field counts them), keeping the place in the queue.
    RetryAt(Instant, u64),
    /// Denied, and the ordering is too deep to wait in.
    Full(usize),
    /// Denied by a node of its tenant path: out of the ordering, keeping its place, until this
    /// instant (or until woken), parked at that node.
    Parked(Instant, (usize, u64)),
    /// Refused by a node of its tenant path that could not pay within its `max_wait`.
    Refused(crate::tenant::TenantRefused),
    /// The store failed: admit from the local fallback share.
    Fallback,
    Unavailable(StoreUnavailable),
}

impl Budget {
    /// What the shared store answered to a question (`Step::Ask`). The asker left the
    /// ordering to ask; refused, it comes back to its place (or joins, if it asked on
    /// arrival).
    pub(crate) fn answered(
        &self,
        place: &mut Option<Place>,
        id: ReservationId,
        answer: Result<Decision, StoreUnavailable>,
        ask: &Ask,
        waker: &Waker,
    ) -> Answer {
        let Some(remote) = &self.shared.remote else {
            unreachable!("only a shared budget asks a shared store")
        };
        let now = Instant::now();
        let ns = self.nanos_since_origin(now);
        let mut state = self.lock();
        let path = state.path_limits(ask.tenant.as_ref());
        let State {
            shared,
            queue,
            slots,
            tenants,
            ..
        } = &mut *state;
        let shared = shared.as_mut().expect("a shared budget has shared state");
        shared.asking = shared.asking.saturating_sub(1);
        let admitted = matches!(answer, Ok(Decision::Admitted));
        slots.fulfil(admitted);
        let mut other = None;
        let mut back = |queue: &mut WaitList| match *place {
            Some(mine) => {
                queue.restore(mine, ask, waker);
                Ok(())
            }
            None => match queue.wait(place, ask, waker) {
                Ok(()) => Ok(()),
                Err(Full(depth)) => Err(depth),
            },
        };
        let answer = match answer {
            Ok(decision) => {
                shared.breaker.succeeded();
                match decision {
                    Decision::Admitted => {
                        shared.refused = false;
                        // A request that waited is served in its tenant's fair share (one
                        // admitted as it arrived, nobody waiting, is not, as in memory).
                        if let Some(mine) = place.take() {
                            queue.serve_away(mine);
                        }
                        // The store took the path's shared buckets; the process's own copy
                        // of the tree (slots, days, meters, local buckets) takes its part.
                        if let (Some(tenants), Some(tenant)) = (tenants, &ask.tenant) {
                            tenants.take(tenant, &ask.cost, ns, now);
                        }
                        Answer::Admitted
                    }
                    Decision::Denied { wait, limit, .. }
                        if limit >= shared.limits().len()
                            && tenants.is_some()
                            && !path.is_empty() =>
                    {
                        // A node of its path cannot pay yet (other processes spent it): it
                        // steps out of the ordering, keeping its place, until then; the
                        // account did not refuse, so the others keep asking.
                        let (node, node_limit) =
                            &path[(limit - shared.limits().len()).min(path.len() - 1)];
                        let (tenants, tenant) = (tenants.as_mut().expect("checked"), &ask.tenant);
                        let tenant = tenant.as_ref().expect("a path was asked for");
                        let depth = node.depth();
                        let arrived = ask.scheduling.enqueued_at;
                        let dimension = node_limit.dimension();
                        match tenants.refuses_after(tenant, depth, dimension, wait, (now, arrived))
                        {
                            // Past the node's `max_wait`: refused, out of the ordering.
                            Some(refused) => {
                                #[cfg(feature = "metrics")]
                                crate::budget::tenants::shared::refused_metric(tenants, &refused);
                                if let Some(mine) = place.take() {
                                    queue.remove(mine, now);
                                }
                                Answer::Refused(refused)
                            }
                            None => {
                                let priority = ask.scheduling.priority;
                                let ticket = tenants.park(tenant, depth, priority, waker);
                                let at =
                                    crate::sched::saturating_deadline(now, remote.jittered(wait));
                                Answer::Parked(at, (depth, ticket))
                            }
                        }
                    }
                    Decision::Denied {
                        wait, floor_only, ..
                    } => {
                        shared.refused = true;
                        let restored = back(queue);
                        if let (Ok(()), Some(mine)) = (&restored, *place) {
                            // Refused only to keep its class floor: a request with a lower
                            // floor behind it may ask instead.
                            other = queue.set_floor_blocked(mine, floor_only, now);
                        }
                        match restored {
                            Ok(()) => Answer::RetryAt(
                                crate::sched::saturating_deadline(now, remote.jittered(wait)),
                                shared.refunds,
                            ),
                            Err(depth) => Answer::Full(depth),
                        }
                    }
                    Decision::TooLarge { limit } => {
                        if let Some(mine) = place.take() {
                            queue.remove(mine, now);
                        }
                        match limit
                            .checked_sub(shared.limits().len())
                            .filter(|_| !path.is_empty())
                        {
                            None => Answer::Never(shared.too_large(limit, &ask.cost)),
                            // A node's limit, as the store knows it, is below the cost.
                            Some(node) => {
                                let (_, limit) = path[node.min(path.len() - 1)];
                                let dimension = limit.dimension();
                                Answer::Never(InsufficientCapacity {
                                    dimension,
                                    period: limit.period(),
                                    cost: ask.cost.amount(dimension),
                                    capacity: limit.capacity(),
                                })
                            }
                        }
                    }
                }
            }
            Err(error) => {
                shared.breaker.failed(ns);
                // The script may have run after all: give back whatever it took.
                remote.release(id, ask.cost, shared.limits().clone(), path.clone());
                tracing::warn!(%error, "the shared quota store did not answer");
                match remote.policy() {
                    FailurePolicy::LocalFallback { .. } => match back(queue) {
                        Ok(()) => Answer::Fallback,
                        Err(depth) => Answer::Full(depth),
                    },
                    FailurePolicy::FailClosed => {
                        if let Some(mine) = place.take() {
                            queue.remove(mine, now);
                        }
                        Answer::Unavailable(error)
                    }
                }
            }
        };
        // A question ended: the head may ask (or be admitted) now, and whoever a floor lets go.
        // The head is woken even when it is a future of the answering task: that task may
        // have polled it earlier in this very pass (`join!`, `join_all`, `select!`), and
        // nothing else would poll it again. An answer happens once, so this cannot spin.
        let head = queue.head_waker(now);
        drop(state);
        for waker in [head, other].into_iter().flatten() {
            waker.wake();
        }
        answer
    }

    /// A question to the shared store was abandoned (its caller left): give back whatever it
    /// may have taken, and let another caller probe the store.
    pub(crate) fn abandoned(&self, id: ReservationId, ask: &Ask) {
        let mut state = self.lock();
        state.slots.fulfil(false);
        let path = state.path_limits(ask.tenant.as_ref());
        if let (Some(shared), Some(remote)) = (state.shared.as_mut(), &self.shared.remote) {
            shared.asking = shared.asking.saturating_sub(1);
            shared.breaker.abandoned(id.get());
            remote.release(id, ask.cost, shared.limits().clone(), path);
        }
        let head = state.queue.head_waker(Instant::now());
        drop(state);
        if let Some(head) = head {
            head.wake();
        }
    }

    /// The question for the shared store, bounded by its timeout.
    pub(crate) fn ask(
        &self,
        id: ReservationId,
        cost: Cost,
        floor: Floor,
        (limits, path): (Arc<[Limit]>, PathLimits),
    ) -> StoreFuture<Decision> {
        let Some(remote) = &self.shared.remote else {
            unreachable!("only a shared budget asks a shared store")
        };
        remote.reserve(id, cost, floor, limits, path)
    }
}
