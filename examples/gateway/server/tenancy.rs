//! The tenant tree: each node's limits, weight and pause, and the admission of a request by
//! every node on its path.
//!
//! A request of `acme/search` is admitted by `acme`, then by `acme/search`: each node with
//! limits has a [`Budget`] of its own, asked with [`Budget::try_reserve`], all or nothing (the
//! reservations taken before a refusal are dropped unsent, so refunded whole). A refusal
//! names the node that ran out. The reservations travel with the response and are settled
//! with the usage the provider reported when the body ends (charged their estimate if the
//! usage never came).
//!
//! This module is the gateway's only view of tenants: swapping it for the crate's own tenant
//! tree changes this file and no other.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use serde::Serialize;
use tokio::time::Instant;
use tower_llm_quota::{Budget, Cost, LimitSnapshot, Reservation, TryReserveError, Usage};

use super::config::{ConfigError, Limits, TenantConfig};
use super::refusal::{Refusal, limit_name};

#[derive(Debug)]
struct Node {
    weight: AtomicU32,
    limits: Mutex<Limits>,
    budget: Budget,
    paused: AtomicBool,
}

/// The tenant tree of a gateway.
#[derive(Debug)]
pub(crate) struct Tenancy {
    nodes: BTreeMap<String, Node>,
    paused_keys: Mutex<HashSet<String>>,
}

/// What a request holds from its tenants until its answer ends.
#[derive(Debug)]
#[must_use = "dropped, the tenants' reservations are charged their estimate"]
pub(crate) struct TenantPass {
    reservations: Vec<Reservation>,
}

impl TenantPass {
    /// The answer ended: settle with the usage reported, or charge the estimate.
    pub(crate) fn settle(self, usage: Option<&Usage>) {
        for reservation in self.reservations {
            match usage {
                Some(usage) => {
                    let _ = reservation.settle(usage);
                }
                None => {
                    let _ = reservation.charge_estimate();
                }
            }
        }
    }

    /// Nothing was sent: everything goes back.
    pub(crate) fn refund(self) {
        for reservation in self.reservations {
            let _ = reservation.refund();
        }
    }

    /// The request is about to leave: dropping the pass now charges the estimate.
    pub(crate) fn mark_sent(&mut self) {
        self.reservations
            .iter_mut()
            .for_each(Reservation::mark_sent);
    }
}

/// One node as the admin API and the status page show it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct NodeView {
    pub(crate) path: String,
    pub(crate) weight: u32,
    pub(crate) paused: bool,
    pub(crate) limits: Limits,
    /// For each limit: its dimension, capacity and level now.
    pub(crate) levels: Vec<LevelView>,
}

/// A limit's state now.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LevelView {
    pub(crate) limit: String,
    pub(crate) capacity: u64,
    pub(crate) level: i64,
}

impl From<&LimitSnapshot> for LevelView {
    fn from(snapshot: &LimitSnapshot) -> Self {
        Self {
            limit: limit_name(
                snapshot.limit().dimension().as_str(),
                snapshot.limit().period(),
            ),
            capacity: snapshot.capacity(),
            level: snapshot.level(),
        }
    }
}

/// The path of every node from the root down to `path`: `a`, `a/b`, `a/b/c`.
fn ancestry(path: &str) -> impl Iterator<Item = &str> {
    path.match_indices('/')
        .map(|(i, _)| &path[..i])
        .chain(std::iter::once(path))
}

impl Tenancy {
    pub(crate) fn new(tenants: &[TenantConfig]) -> Result<Self, ConfigError> {
        let mut nodes = BTreeMap::new();
        for tenant in tenants {
            let node = Node {
                weight: AtomicU32::new(tenant.weight),
                limits: Mutex::new(tenant.limits),
                budget: Budget::new(tenant.limits.quota()?),
                paused: AtomicBool::new(false),
            };
            if nodes.insert(tenant.path.clone(), node).is_some() {
                return Err(ConfigError(format!(
                    "tenant `{}` is given twice",
                    tenant.path
                )));
            }
        }
        Ok(Self {
            nodes,
            paused_keys: Mutex::new(HashSet::new()),
        })
    }

    /// Admits `cost` for a request of key `key` spending `path`, at every node on its path.
    pub(crate) fn admit(&self, key: &str, path: &str, cost: Cost) -> Result<TenantPass, Refusal> {
        if self
            .paused_keys
            .lock()
            .expect("never poisoned")
            .contains(key)
        {
            return Err(Refusal::rate_limited("paused", format!("key:{key}"))
                .message(format!("the key {key} is paused by an operator")));
        }
        let mut reservations = Vec::new();
        for node_path in ancestry(path) {
            let Some(node) = self.nodes.get(node_path) else {
                continue;
            };
            if node.paused.load(Ordering::Acquire) {
                return Err(
                    Refusal::rate_limited("paused", format!("tenant:{node_path}"))
                        .message(format!("the tenant {node_path} is paused by an operator")),
                );
            }
            if node.budget.snapshot().limits().is_empty() {
                continue;
            }
            match node.budget.try_reserve(cost) {
                Ok(reservation) => reservations.push(reservation),
                Err(error) => return Err(refusal(node_path, &error)),
            }
        }
        Ok(TenantPass { reservations })
    }

    /// Pauses (or resumes) a tenant node; `false` if there is no such node.
    pub(crate) fn set_paused(&self, path: &str, paused: bool) -> bool {
        let Some(node) = self.nodes.get(path) else {
            return false;
        };
        node.paused.store(paused, Ordering::Release);
        true
    }

    /// Pauses (or resumes) a key by its name.
    pub(crate) fn set_key_paused(&self, key: &str, paused: bool) {
        let mut keys = self.paused_keys.lock().expect("never poisoned");
        if paused {
            keys.insert(key.to_owned());
        } else {
            keys.remove(key);
        }
    }

    /// Replaces a node's limits and, if given, its weight; `Ok(false)` if there is no such
    /// node. A limit set before keeps its level; a limit no longer named stops binding.
    pub(crate) fn set_limits(
        &self,
        path: &str,
        limits: Limits,
        weight: Option<u32>,
    ) -> Result<bool, ConfigError> {
        let Some(node) = self.nodes.get(path) else {
            return Ok(false);
        };
        let named = limits.limits()?;
        if let Some(weight) = weight.filter(|w| *w > 0) {
            node.weight.store(weight, Ordering::Release);
        }
        let mut current = node.limits.lock().expect("never poisoned");
        for old in current.limits()? {
            if !named
                .iter()
                .any(|l| l.dimension() == old.dimension() && l.period() == old.period())
            {
                // No removal in the budget's API: an unnamed limit is set out of reach.
                node.budget
                    .set_limit(old.with_amount(std::num::NonZeroU64::MAX));
            }
        }
        named
            .into_iter()
            .for_each(|limit| node.budget.set_limit(limit));
        *current = limits;
        Ok(true)
    }

    /// Every node, in path order.
    pub(crate) fn snapshot(&self) -> Vec<NodeView> {
        self.nodes
            .iter()
            .map(|(path, node)| NodeView {
                path: path.clone(),
                weight: node.weight.load(Ordering::Acquire),
                paused: node.paused.load(Ordering::Acquire),
                limits: *node.limits.lock().expect("never poisoned"),
                levels: node
                    .budget
                    .snapshot()
                    .limits()
                    .iter()
                    .map(LevelView::from)
                    .collect(),
            })
            .collect()
    }
}

/// The normalized refusal of a node's budget.
fn refusal(path: &str, error: &TryReserveError) -> Refusal {
    let scope = format!("tenant:{path}");
    match error {
        TryReserveError::NotYet(not_until) => {
            let dimension = not_until.dimension().as_str();
            let limit = limit_name(dimension, not_until.period());
            let wait = not_until.wait_time_from(Instant::now());
            Refusal::rate_limited(limit.clone(), scope)
                .dimension(Some(dimension))
                .retry_after(Some(wait))
                .message(format!(
                    "tenant {path} is over its {}; retry in {:.1} s",
                    limit.replace('_', " "),
                    wait.as_secs_f64()
                ))
        }
        TryReserveError::NoSlot => Refusal::rate_limited("max_in_flight", scope).message(format!(
            "tenant {path} has every call in flight it may have"
        )),
        TryReserveError::Never(capacity) => {
            let dimension = capacity.dimension().as_str();
            Refusal::bad_request(format!(
                "the request's {dimension} ({}) exceed what tenant {path} may ever spend at once ({})",
                capacity.cost(),
                capacity.capacity()
            ))
            .scope(format!("tenant:{path}"))
            .dimension(Some(dimension))
        }
        other => Refusal::unavailable("store", other.to_string()).scope(format!("tenant:{path}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ancestry_runs_from_the_root() {
        assert_eq!(ancestry("a/b/c").collect::<Vec<_>>(), ["a", "a/b", "a/b/c"]);
        assert_eq!(ancestry("a").collect::<Vec<_>>(), ["a"]);
    }
}
