//! The store seam from the outside: a quota store over a mutex, written against the public
//! `budget::store` module alone, passes the shared-store suite that Redis passes; the same
//! store with a rule broken fails it.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tower_llm_quota::budget::StoreUnavailable;
use tower_llm_quota::budget::store::{
    Decision, Floor, PathLimits, QuotaStore, Settle, StoreFuture, StoreOptions,
};
use tower_llm_quota::tenant::Tenant;
use tower_llm_quota::{Budget, Cost, Dimension, Limit, Priority, Quota};
use tower_llm_quota_test_support::store_suite::{self, Processes};

/// A rule the store breaks, to show that the suite notices.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Planted {
    None,
    /// Tenant nodes' limits are neither checked nor taken.
    IgnoresPath,
    /// Settlements change nothing: refunds never come back.
    DropsSettlements,
}

/// A bucket: its node (none for the account's) and its limit.
type Key = (Option<Tenant>, Limit);

/// What names a bucket: its node, dimension and period.
fn name((node, limit): &Key) -> (Option<Tenant>, Dimension, Duration) {
    (node.clone(), limit.dimension(), limit.period())
}

/// Each bucket's level and when it was last refilled; the holds of the account's limits;
/// the reservations not yet settled; the paused nodes.
#[derive(Debug, Default)]
struct Ledger {
    levels: HashMap<(Option<Tenant>, Dimension, Duration), (f64, Instant)>,
    holds: HashMap<(Option<Tenant>, Dimension, Duration), Instant>,
    records: HashMap<String, (Cost, Vec<Key>)>,
    paused: HashSet<Tenant>,
}

impl Ledger {
    /// The bucket's level now, refilled at the limit's rate up to its capacity.
    fn level(&mut self, key: &Key, now: Instant) -> &mut f64 {
        let limit = key.1;
        let capacity = limit.capacity() as f64;
        let rate = limit.effective_amount() as f64 / limit.period().as_secs_f64();
        let (level, at) = self.levels.entry(name(key)).or_insert((capacity, now));
        *level = (*level + rate * now.duration_since(*at).as_secs_f64()).min(capacity);
        *at = now;
        level
    }

    fn reserve(
        &mut self,
        id: String,
        cost: Cost,
        floor: Floor,
        keys: Vec<Key>,
        accounts: usize,
    ) -> Decision {
        let now = Instant::now();
        let mut denial: Option<(Duration, usize, bool)> = None;
        for (i, key) in keys.iter().enumerate() {
            let limit = key.1;
            let need = cost.amount(limit.dimension()) as f64;
            if need > limit.capacity() as f64 {
                return Decision::TooLarge { limit: i };
            }
            let keep = if i < accounts {
                floor.of(limit.capacity()) as f64
            } else {
                0.0
            };
            let rate = limit.effective_amount() as f64 / limit.period().as_secs_f64();
            let level = *self.level(key, now);
            let held = self
                .holds
                .get(&name(key))
                .filter(|end| i < accounts && **end > now);
            let wait = match held {
                Some(end) => (*end - now).min(Duration::from_secs(1)),
                None if level - need < keep => {
                    Duration::from_secs_f64((need + keep - level) / rate)
                }
                None => continue,
            };
            if denial.is_none_or(|(longest, _, _)| wait > longest) {
                denial = Some((wait, i, held.is_none() && level >= need));
            }
        }
        if let Some((wait, limit, floor_only)) = denial {
            return Decision::Denied {
                wait,
                limit,
                floor_only,
                first: false,
            };
        }
        for key in &keys {
            *self.level(key, now) -= cost.amount(key.1.dimension()) as f64;
        }
        self.records.insert(id, (cost, keys));
        Decision::Admitted
    }

    fn settle(&mut self, settle: &Settle) {
        let Some((reserved, keys)) = self.records.remove(&settle.id) else {
            return; // a duplicate
        };
        let now = Instant::now();
        for key in keys {
            let dimension = key.1.dimension();
            let back = reserved.amount(dimension) as f64 - settle.actual.amount(dimension) as f64;
            let capacity = key.1.capacity() as f64;
            let level = self.level(&key, now);
            *level = (*level + back).min(capacity);
        }
    }
}

/// A quota store over a mutex: one process's memory stands in for the shared medium.
#[derive(Debug)]
struct MutexStore {
    ledger: Mutex<Ledger>,
    planted: Planted,
}

fn answer<T: Send + 'static>(value: T) -> StoreFuture<T> {
    Box::pin(async move { Ok(value) })
}

impl QuotaStore for MutexStore {
    fn reserve(
        &self,
        id: String,
        cost: Cost,
        floor: Floor,
        _class: Priority,
        limits: Arc<[Limit]>,
        path: PathLimits,
        tenant: Option<Tenant>,
    ) -> StoreFuture<Decision> {
        if !path.controls.is_empty() {
            let unkept = StoreUnavailable::new("this store keeps no daily caps or slots");
            return Box::pin(async move { Err(unkept) });
        }
        let mut ledger = self.ledger.lock().unwrap();
        if let Some(tenant) = &tenant {
            let paused = (1..=tenant.depth()).find(|&depth| {
                ledger
                    .paused
                    .iter()
                    .any(|p| p.as_str() == tenant.prefix(depth))
            });
            if let Some(depth) = paused {
                return answer(Decision::Paused { depth });
            }
        }
        let mut keys: Vec<_> = limits.iter().map(|limit| (None, *limit)).collect();
        if self.planted != Planted::IgnoresPath {
            keys.extend(
                path.limits
                    .iter()
                    .map(|(node, limit)| (Some(node.clone()), *limit)),
            );
        }
        answer(ledger.reserve(id, cost, floor, keys, limits.len()))
    }

    fn settle(&self, batch: Vec<Settle>) -> StoreFuture<()> {
        if self.planted != Planted::DropsSettlements {
            let mut ledger = self.ledger.lock().unwrap();
            batch.iter().for_each(|settle| ledger.settle(settle));
        }
        answer(())
    }

    fn lower(&self, limit: Limit, remaining: Option<u64>, pause: Duration) -> StoreFuture<()> {
        let mut ledger = self.ledger.lock().unwrap();
        let now = Instant::now();
        if let Some(remaining) = remaining {
            let level = ledger.level(&(None, limit), now);
            *level = level.min(remaining as f64);
        }
        let end = ledger.holds.entry(name(&(None, limit))).or_insert(now);
        *end = (*end).max(now + pause);
        answer(())
    }

    fn lift(&self, limits: Vec<Limit>) -> StoreFuture<()> {
        let mut ledger = self.ledger.lock().unwrap();
        limits.iter().for_each(|limit| {
            ledger.holds.remove(&name(&(None, *limit)));
        });
        answer(())
    }

    fn set_paused(&self, scope: Tenant, paused: bool) -> StoreFuture<()> {
        let mut ledger = self.ledger.lock().unwrap();
        if paused {
            ledger.paused.insert(scope);
        } else {
            ledger.paused.remove(&scope);
        }
        answer(())
    }

    fn paused(&self) -> StoreFuture<Option<Vec<Tenant>>> {
        answer(Some(
            self.ledger.lock().unwrap().paused.iter().cloned().collect(),
        ))
    }
}

/// Budgets over one mutex store per account, as processes over one shared medium.
struct OverMutex {
    planted: Planted,
    stores: Mutex<HashMap<String, Arc<MutexStore>>>,
}

impl OverMutex {
    fn new(planted: Planted) -> Self {
        Self {
            planted,
            stores: Mutex::default(),
        }
    }
}

impl Processes for OverMutex {
    fn budget(
        &self,
        account: &str,
        quota: Quota,
    ) -> Pin<Box<dyn Future<Output = Budget> + Send + '_>> {
        let store = self
            .stores
            .lock()
            .unwrap()
            .entry(account.to_owned())
            .or_insert_with(|| {
                Arc::new(MutexStore {
                    ledger: Mutex::default(),
                    planted: self.planted,
                })
            })
            .clone();
        Box::pin(async move { Budget::with_store(&quota, store, StoreOptions::new()) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_over_a_mutex_passes_the_shared_store_suite() {
    store_suite::run(&OverMutex::new(Planted::None)).await;
}

/// Runs one check of the suite on its own task: whether it failed.
async fn fails<F>(check: F) -> bool
where
    F: Future<Output = ()> + Send + 'static,
{
    tokio::spawn(check)
        .await
        .is_err_and(|error| error.is_panic())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_fails_a_store_that_breaks_a_rule() {
    assert!(
        fails(async {
            let processes = OverMutex::new(Planted::IgnoresPath);
            store_suite::tenant_limits_hold_across_processes(&processes).await;
        })
        .await,
        "a store ignoring the tenants' limits passed"
    );
    assert!(
        fails(async {
            let processes = OverMutex::new(Planted::DropsSettlements);
            store_suite::refunds_reach_every_process(&processes).await;
        })
        .await,
        "a store dropping settlements passed"
    );
}
