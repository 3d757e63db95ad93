//! The wait engine against a reference model: given the same events (arrivals with class,
//! tenant and cost; cancellations; settlements that refund; time steps), a deliberately
//! simple scheduler says who is admitted next and when, and the budget must agree on every
//! admission: the same requests, in the same order, at the same instant (within one timer
//! tick).
//!
//! The model keeps every waiting request in one `Vec` and decides by a linear scan over all of
//! them at each instant: no index, no cached front, no forgotten state. It states the rules
//! the engine promises, in the textbook form:
//!
//! - classes first; the front of a class moves up a class after the class's aging ceiling
//!   (async 30 s, batch 120 s) counted from when it became the front; fronts rank by effective
//!   class, then first arrival, then ticket;
//! - inside a class, a tenant owed its guarantee first (it earns `share × cost` of each cost
//!   the class serves, spends what it is served, and while it has nothing waiting is owed
//!   one request at most), then the smallest
//!   weighted-fair-queuing tag (a flow's turn starts at `max(F, V)` when its oldest request
//!   becomes its oldest; `V` the largest start served by tag; weights in the fleet's units,
//!   840 a unit of weight), then arrival; each tenant's
//!   requests in arrival order;
//! - a request is admitted when it is the head and the bucket holds its cost; a request that
//!   arrives while nobody waits and fits is admitted at once;
//! - a request not admitted before an instant (a retry waiting out `Retry-After`) takes its
//!   place when it arrives, keeps its tenant's turn, and is out of the ordering until a
//!   millisecond before that instant (the others go meanwhile), then back in its place, a
//!   front since its enqueue time; it is admitted from that instant on.
//!
//! Two drivers run each case: every reservation in its own task, and every reservation polled
//! by one task (as `join_all` does), whose wakers are all the same.
//!
//! Over Redis (a private `redis-server`, real time) the order is compared: requests of every
//! class and tenant arrive together at a drained budget with one call in flight and one
//! question at a time ([`RedisBudget::questions_in_flight`]), and the store must admit them
//! in the model's order (the order the budget asked, read from the reservation ids).
//!
//! [`RedisBudget::questions_in_flight`]: tower_llm_quota_redis::RedisBudget::questions_in_flight
//!
//! The grid keeps instants apart: events fall on 5 (mod 10) ms, costs and refunds are
//! multiples of 10 tokens at one token a millisecond, and the burst is 5 (mod 10), so a head
//! becomes affordable only on 0 (mod 10) ms: no event and no timer share an instant.
//!
//! `ENGINE_MODEL_CASES` sets the number of generated sequences of each test (1,000 by
//! default).

use std::collections::HashMap;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use tower_llm_quota_test_support as support;
use tower_llm_quota_test_support::redis_server;

use proptest::prelude::*;
use support::limit;
use tokio::time::Instant;
use tower_llm_quota::tenant::{Tenant, TenantNode, TenantTree};
use tower_llm_quota::{Budget, Cost, Dimension, Priority, Quota, Reservation, Usage};

const CLASSES: [Priority; 3] = [Priority::Interactive, Priority::Async, Priority::Batch];
/// The default aging of each class, in ms (`QueueConfig`'s defaults).
const AGING_MS: [Option<u64>; 3] = [None, Some(30_000), Some(120_000)];
/// Tag units per unit of cost and weight (the engine's scale; any would do for the order).
const SCALE: u128 = 1 << 20;

/// A tenant's weight as the engine weighs it: in the fleet's units (840 a unit), so that a
/// leasing budget's flows keep one scale before and after the fleet tells their weights.
fn fleet_units(weight: u32) -> u128 {
    u128::from(weight) * 840
}
/// Events fall on this offset of every 10 ms.
const PHASE_MS: u64 = 5;

// ---------------------------------------------------------------------------------------------
// The generated case.

#[derive(Debug, Clone, Copy)]
struct TenantSpec {
    weight: u32,
    /// In thousandths of the account.
    guarantee: u32,
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Arrive {
        class: usize,
        tenant: usize,
        cost: u64,
        /// Not admitted before this many ms after its arrival (a retry waiting out
        /// `Retry-After`): 10k + 2, so that its instant, and its return a millisecond before,
        /// fall on no other event's.
        later: Option<u64>,
    },
    /// Cancels the `n`-th (modulo) request still waiting, by arrival.
    Cancel {
        n: usize,
    },
    /// Settles the `n`-th (modulo) reservation still held with `keep` tenths of its cost: the
    /// rest is refunded.
    Settle {
        n: usize,
        keep: u64,
    },
    Advance {
        ms: u64,
    },
}

#[derive(Debug, Clone)]
struct Case {
    burst: u64,
    /// The bucket starts empty (else full).
    drained: bool,
    tenants: Vec<TenantSpec>,
    events: Vec<Event>,
}

fn case() -> impl Strategy<Value = Case> {
    let burst = prop_oneof![Just(205u64), Just(505), Just(1_005)];
    let tenants = prop::collection::vec(
        (
            1u32..=4,
            prop_oneof![Just(0u32), Just(100), Just(250), Just(400)],
        ),
        1..=4,
    );
    (burst, tenants).prop_flat_map(|(burst, tenants)| {
        // Siblings' guarantees add up to at most the whole account.
        let mut left = 1_000;
        let tenants: Vec<TenantSpec> = tenants
            .into_iter()
            .map(|(weight, guarantee)| {
                let guarantee = guarantee.min(left);
                left -= guarantee;
                TenantSpec { weight, guarantee }
            })
            .collect();
        let count = tenants.len();
        let event = prop_oneof![
            6 => (0..3usize, 0..count, 1..=(burst / 10)).prop_map(|(class, tenant, cost)| {
                Event::Arrive { class, tenant, cost: cost * 10, later: None }
            }),
            1 => (0..3usize, 0..count, 1..=(burst / 10), 0..=40u64).prop_map(
                |(class, tenant, cost, tens)| {
                    Event::Arrive { class, tenant, cost: cost * 10, later: Some(tens * 10 + 2) }
                }
            ),
            1 => (0..64usize).prop_map(|n| Event::Cancel { n }),
            1 => (0..64usize, 0..=9u64).prop_map(|(n, keep)| Event::Settle { n, keep }),
            3 => prop_oneof![
                4 => Just(0u64),
                4 => (1..=50u64).prop_map(|t| t * 10),
                1 => Just(31_000u64),
                1 => Just(125_000u64),
            ]
            .prop_map(|ms| Event::Advance { ms }),
        ];
        (
            Just(burst),
            Just(tenants),
            prop::collection::vec(event, 1..48),
        )
            .prop_map(|(burst, tenants, events)| Case {
                burst,
                drained: false,
                tenants,
                events,
            })
    })
}

// ---------------------------------------------------------------------------------------------
// The reference model.

#[derive(Debug, Clone)]
struct Waiting {
    id: usize,
    class: usize,
    tenant: usize,
    cost: u64,
    at: u64,
    ticket: u64,
    /// Not admitted before; out of the ordering (its place and its tenant's turn kept) until
    /// a millisecond before.
    not_before: Option<u64>,
}

/// One class's fair-share clocks, never forgotten.
#[derive(Debug, Default, Clone)]
struct ClassClocks {
    virtual_time: u128,
    finish: HashMap<usize, u128>,
    /// Where the turn of each tenant's oldest waiting request starts.
    turn: HashMap<usize, u128>,
    credit: HashMap<usize, i128>,
    front_since: Option<u64>,
}

#[derive(Debug)]
struct Model {
    tenants: Vec<TenantSpec>,
    burst: u64,
    /// The bucket's level and when it was last computed (one token a millisecond).
    level: u64,
    level_at: u64,
    now: u64,
    waiting: Vec<Waiting>,
    /// Held back until a millisecond before their time.
    away: Vec<Waiting>,
    clocks: [ClassClocks; 3],
    next_ticket: u64,
    held: Vec<(usize, u64)>,
    admitted: Vec<(usize, u64)>,
    /// A planted violation for the oracle's self-test: heads ranked by arrival alone, as if
    /// classes did not exist.
    classless: bool,
}

impl Model {
    fn new(case: &Case) -> Self {
        Self {
            tenants: case.tenants.clone(),
            burst: case.burst,
            level: if case.drained { 0 } else { case.burst },
            level_at: 0,
            now: 0,
            waiting: Vec::new(),
            away: Vec::new(),
            clocks: Default::default(),
            next_ticket: 0,
            held: Vec::new(),
            admitted: Vec::new(),
            classless: false,
        }
    }

    fn level(&self, t: u64) -> u64 {
        (self.level + (t - self.level_at)).min(self.burst)
    }

    fn set_level(&mut self, level: u64) {
        self.level = level;
        self.level_at = self.now;
    }

    /// Whether `w` is the oldest waiting request of its tenant in its class.
    fn is_flow_head(&self, w: &Waiting) -> bool {
        !self.waiting.iter().any(|o| {
            o.class == w.class && o.tenant == w.tenant && (o.at, o.ticket) < (w.at, w.ticket)
        })
    }

    /// Whether `tenant` has a request in `class`, waiting or held back (its turn is kept).
    fn waits_in(&self, class: usize, tenant: usize) -> bool {
        (self.waiting.iter().chain(&self.away)).any(|w| w.class == class && w.tenant == tenant)
    }

    fn guarantee_waits(&self, class: usize, tenant: usize) -> bool {
        self.tenants[tenant].guarantee > 0 && self.waits_in(class, tenant)
    }

    /// The request a class serves next: owed first, then the smallest tag, then arrival.
    fn front(&self, class: usize) -> Option<&Waiting> {
        let clocks = &self.clocks[class];
        self.waiting
            .iter()
            .filter(|w| w.class == class && self.is_flow_head(w))
            .min_by_key(|w| {
                let spec = self.tenants[w.tenant];
                let owed =
                    spec.guarantee > 0 && clocks.credit.get(&w.tenant).copied().unwrap_or(0) > 0;
                let tag =
                    clocks.turn[&w.tenant] + u128::from(w.cost) * SCALE / fleet_units(spec.weight);
                (!owed, tag, w.at, w.ticket)
            })
    }

    /// The class a front has reached at `t`.
    fn effective(&self, class: usize, t: u64) -> usize {
        let (mut c, mut from) = (class, self.clocks[class].front_since.expect("a front"));
        while c > 0 {
            match AGING_MS[c] {
                Some(after) if from + after <= t => {
                    from += after;
                    c -= 1;
                }
                _ => break,
            }
        }
        c
    }

    /// The head at `t`: the fronts ranked by effective class, first arrival, ticket.
    fn head(&self, t: u64) -> Option<Waiting> {
        (0..3)
            .filter_map(|class| self.front(class).map(|f| (class, f)))
            .min_by_key(|(class, f)| match self.classless {
                true => (0, f.at, f.ticket),
                false => (self.effective(*class, t), f.at, f.ticket),
            })
            .map(|(_, f)| f.clone())
    }

    /// The next instant after `t` at which a front moves up a class, if fronts of two classes
    /// wait.
    fn next_promotion(&self, t: u64) -> Option<u64> {
        let classes: Vec<usize> = (0..3).filter(|&c| self.front(c).is_some()).collect();
        if classes.len() < 2 {
            return None;
        }
        classes
            .into_iter()
            .filter_map(|class| {
                let (mut c, mut from) = (class, self.clocks[class].front_since?);
                while c > 0 {
                    let at = from + AGING_MS[c]?;
                    if at > t {
                        return Some(at);
                    }
                    (c, from) = (c - 1, at);
                }
                None
            })
            .min()
    }

    fn join(&mut self, id: usize, class: usize, tenant: usize, cost: u64, later: Option<u64>) {
        if later.is_none() && !self.waiting.iter().any(|w| w.class == class) {
            self.clocks[class].front_since = Some(self.now);
        }
        if !self.waits_in(class, tenant) {
            let clocks = &mut self.clocks[class];
            let finish = clocks.finish.get(&tenant).copied().unwrap_or(0);
            clocks.turn.insert(tenant, finish.max(clocks.virtual_time));
            if self.tenants[tenant].guarantee > 0 {
                // A new guarantor is owed its first request.
                clocks.credit.entry(tenant).or_insert(1);
            }
        }
        let waiting = Waiting {
            id,
            class,
            tenant,
            cost,
            at: self.now,
            ticket: self.next_ticket,
            not_before: later.map(|ms| self.now + ms),
        };
        self.next_ticket += 1;
        match later {
            Some(_) => self.away.push(waiting),
            None => self.waiting.push(waiting),
        }
    }

    /// Brings back to their places the requests held back whose time is a millisecond away:
    /// a front since its enqueue time when its class waited for none (or for later ones).
    fn bring_back(&mut self) {
        let now = self.now;
        while let Some(i) =
            (self.away.iter()).position(|w| w.not_before.is_some_and(|at| at - 1 <= now))
        {
            let w = self.away.remove(i);
            let first = (self.waiting.iter())
                .filter(|o| o.class == w.class)
                .map(|o| o.at)
                .min();
            let clocks = &mut self.clocks[w.class];
            clocks.front_since = match (clocks.front_since, first) {
                (Some(since), Some(first)) if first <= w.at => Some(since),
                (Some(since), Some(_)) => Some(since.min(w.at)),
                _ => Some(w.at),
            };
            self.waiting.push(w);
        }
    }

    /// Takes `id` out of the waiting list, served or not.
    fn take(&mut self, id: usize, served: bool) {
        if let Some(i) = self.away.iter().position(|w| w.id == id) {
            // Held back, cancelled: its tenant's turn goes if it has nothing else there.
            let w = self.away.remove(i);
            if !self.waits_in(w.class, w.tenant) {
                self.clocks[w.class].turn.remove(&w.tenant);
            }
            return;
        }
        let i = self.waiting.iter().position(|w| w.id == id).unwrap();
        let was_front = self.front(self.waiting[i].class).map(|f| f.id) == Some(id);
        let w = self.waiting.remove(i);
        if served {
            let spec = self.tenants[w.tenant];
            let owed = spec.guarantee > 0 && self.clocks[w.class].credit[&w.tenant] > 0;
            let clocks = &mut self.clocks[w.class];
            let start = clocks.turn[&w.tenant];
            let tag = start + u128::from(w.cost) * SCALE / fleet_units(spec.weight);
            clocks.finish.insert(w.tenant, tag);
            if !owed {
                clocks.virtual_time = clocks.virtual_time.max(start);
            }
            let v = clocks.virtual_time;
            clocks.turn.insert(w.tenant, tag.max(v));
            for tenant in 0..self.tenants.len() {
                let share = i128::from(self.tenants[tenant].guarantee) * 1_000;
                let waits = self.guarantee_waits(w.class, tenant);
                let Some(credit) = self.clocks[w.class].credit.get_mut(&tenant) else {
                    continue;
                };
                *credit += share * i128::from(w.cost);
                if tenant == w.tenant {
                    // A surplus is forgotten beyond the request just served.
                    let served = 1_000_000 * i128::from(w.cost);
                    *credit = (*credit - served).max(-served);
                }
                if !waits {
                    // Away, it banks nothing beyond its first request.
                    *credit = (*credit).min(1);
                }
            }
        }
        let front = self.front(w.class).map(|f| f.at);
        let clocks = &mut self.clocks[w.class];
        match front {
            None => clocks.front_since = None,
            Some(at) if was_front => clocks.front_since = Some(at.max(self.now)),
            Some(_) => {}
        }
    }

    fn admit(&mut self, id: usize, cost: u64) {
        let level = self.level(self.now) - cost;
        self.set_level(level);
        self.held.push((id, cost));
        self.admitted.push((id, self.now));
    }

    /// Admits every head that fits now (and whose time has come).
    fn admit_ready(&mut self) {
        self.bring_back();
        while let Some(head) = self.head(self.now) {
            if self.level(self.now) < head.cost || head.not_before.is_some_and(|at| at > self.now) {
                break;
            }
            self.take(head.id, true);
            self.admit(head.id, head.cost);
        }
    }

    /// Runs the admissions and promotions of `(now, until]`.
    fn run_until(&mut self, until: u64) {
        loop {
            self.admit_ready();
            let ready = self.head(self.now).map(|head| {
                let level = self.level(self.now);
                (self.now + head.cost.saturating_sub(level)).max(head.not_before.unwrap_or(0))
            });
            let back = self
                .away
                .iter()
                .filter_map(|w| w.not_before)
                .map(|at| at - 1)
                .min();
            let next = [ready, self.next_promotion(self.now), back]
                .into_iter()
                .flatten()
                .min();
            match next {
                Some(at) if at <= until => self.now = at.max(self.now),
                _ => break,
            }
        }
        self.now = until;
    }

    fn apply(&mut self, id: usize, event: Event) {
        match event {
            Event::Arrive {
                class,
                tenant,
                cost,
                later,
            } => {
                if later.is_none() && self.waiting.is_empty() && self.level(self.now) >= cost {
                    self.admit(id, cost);
                } else {
                    self.join(id, class, tenant, cost, later);
                }
            }
            Event::Cancel { n } => {
                if !self.waiting.is_empty() || !self.away.is_empty() {
                    let everyone = self.waiting.iter().chain(&self.away);
                    let mut ids: Vec<usize> = everyone.map(|w| w.id).collect();
                    ids.sort_unstable();
                    self.take(ids[n % ids.len()], false);
                }
            }
            Event::Settle { n, keep } => {
                if !self.held.is_empty() {
                    let (_, cost) = self.held.remove(n % self.held.len());
                    let refund = cost - kept(cost, keep);
                    let level = (self.level(self.now) + refund).min(self.burst);
                    self.set_level(level);
                }
            }
            Event::Advance { .. } => {}
        }
        self.admit_ready();
    }
}

/// The model's admissions: `(request, ms)`, in order.
fn model(case: &Case) -> Vec<(usize, u64)> {
    run_model(Model::new(case), case)
}

fn run_model(mut model: Model, case: &Case) -> Vec<(usize, u64)> {
    let mut t = PHASE_MS;
    for (id, event) in case.events.iter().enumerate() {
        model.run_until(t);
        model.apply(id, *event);
        if let Event::Advance { ms } = event {
            t += ms;
        }
    }
    model.run_until(u64::MAX / 4);
    model.admitted
}

// ---------------------------------------------------------------------------------------------
// The engine, driven by the same events.

fn budget(case: &Case) -> Budget {
    let limit = limit(
        Dimension::TotalTokens,
        60_000,
        Duration::from_secs(60),
        case.burst,
    );
    Budget::with_tenants(Quota::new().with_limit(limit), tree(case)).unwrap()
}

/// The case's tenants: one node each, its weight and guarantee.
fn tree(case: &Case) -> TenantTree {
    let mut tree = TenantTree::new();
    for (i, spec) in case.tenants.iter().enumerate() {
        let mut node = TenantNode::new().with_weight(NonZeroU32::new(spec.weight).unwrap());
        if spec.guarantee > 0 {
            node = node.with_guarantee(f64::from(spec.guarantee) / 1_000.0);
        }
        tree = tree.with_node(tenant(i), node);
    }
    tree
}

fn tenant(i: usize) -> Tenant {
    format!("t{i}").parse().unwrap()
}

/// The reservation of an arrival at `now`.
fn reserve(
    budget: &Budget,
    event: Event,
    now: Instant,
) -> Option<tower_llm_quota::budget::Reserve> {
    let Event::Arrive {
        class,
        tenant: t,
        cost,
        later,
    } = event
    else {
        return None;
    };
    let reserve = budget
        .reserve(Cost::new(cost, 0))
        .priority(CLASSES[class])
        .tenant(tenant(t));
    Some(match later {
        Some(ms) => reserve.not_before(now + Duration::from_millis(ms)),
        None => reserve,
    })
}

fn settle(reservation: Reservation, keep: u64) {
    let cost = reservation.cost().input_tokens();
    reservation.settle(&Usage::new(kept(cost, keep), 0));
}

/// What a settlement keeping `keep` tenths of `cost` charges: a multiple of 10 tokens.
fn kept(cost: u64, keep: u64) -> u64 {
    cost * keep / 100 * 10
}

fn ms_since(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_millis()).unwrap()
}

type Log = Arc<Mutex<Vec<(usize, u64)>>>;

/// Every reservation in a task of its own.
async fn engine_tasks(case: &Case) -> Vec<(usize, u64)> {
    let budget = budget(case);
    let start = Instant::now();
    let log: Log = Log::default();
    let held: Arc<Mutex<Vec<(usize, Reservation)>>> = Arc::default();
    let mut tasks: HashMap<usize, tokio::task::JoinHandle<()>> = HashMap::new();
    let mut t = PHASE_MS;
    for (id, &event) in case.events.iter().enumerate() {
        tokio::time::sleep_until(start + Duration::from_millis(t)).await;
        if let Some(reserve) = reserve(&budget, event, start + Duration::from_millis(t)) {
            let (log, held) = (log.clone(), held.clone());
            tasks.insert(
                id,
                tokio::spawn(async move {
                    let reservation = watched(id, reserve).await.expect("admitted");
                    log.lock().unwrap().push((id, ms_since(start)));
                    held.lock().unwrap().push((id, reservation));
                }),
            );
        }
        match event {
            Event::Cancel { n } => {
                let admitted: Vec<usize> = log.lock().unwrap().iter().map(|(id, _)| *id).collect();
                let mut waiting: Vec<usize> = tasks
                    .keys()
                    .copied()
                    .filter(|id| !admitted.contains(id))
                    .collect();
                waiting.sort_unstable();
                if !waiting.is_empty() {
                    tasks[&waiting[n % waiting.len()]].abort();
                    tasks.remove(&waiting[n % waiting.len()]);
                }
            }
            Event::Settle { n, keep } => {
                let mut held = held.lock().unwrap();
                if !held.is_empty() {
                    let i = n % held.len();
                    settle(held.remove(i).1, keep);
                }
            }
            Event::Advance { ms } => t += ms,
            Event::Arrive { .. } => {}
        }
        // Everything this event causes happens at its instant, before the next event (each
        // admission wakes the next head: a chain as long as the waiting list at most).
        for _ in 0..256 {
            tokio::task::yield_now().await;
        }
    }
    for (_, task) in tasks {
        task.await.unwrap();
    }
    assert_eq!(budget.waiters(), 0);
    Arc::try_unwrap(log).unwrap().into_inner().unwrap()
}

/// Every reservation polled by one task, in arrival order, as `join_all` polls its futures:
/// one waker for all.
async fn engine_one_task(case: &Case) -> Vec<(usize, u64)> {
    let budget = budget(case);
    let start = Instant::now();
    let mut log = Vec::new();
    let mut pending: Vec<(usize, Pin<Box<Watched<tower_llm_quota::budget::Reserve>>>)> = Vec::new();
    let mut held: Vec<(usize, Reservation)> = Vec::new();
    let poll_all =
        |pending: &mut Vec<(usize, Pin<Box<Watched<tower_llm_quota::budget::Reserve>>>)>,
         held: &mut Vec<(usize, Reservation)>,
         log: &mut Vec<(usize, u64)>,
         cx: &mut Context<'_>| {
            let mut i = 0;
            while i < pending.len() {
                if let Poll::Ready(result) = pending[i].1.as_mut().poll(cx) {
                    let (id, _) = pending.remove(i);
                    log.push((id, ms_since(start)));
                    held.push((id, result.expect("admitted")));
                } else {
                    i += 1;
                }
            }
        };
    let mut t = PHASE_MS;
    let mut next = 0;
    let mut sleep = Box::pin(tokio::time::sleep_until(start + Duration::from_millis(t)));
    // Woken while polling: polled again before the next event, so that everything an event
    // causes happens at its instant. One waker for all, the same at every poll, as a task's.
    let mut woken: Option<(Arc<Woken>, Waker)> = None;
    std::future::poll_fn(|cx| {
        let (woken, waker) = match &woken {
            Some((w, _)) if w.inner.lock().unwrap().will_wake(cx.waker()) => {
                woken.as_ref().unwrap()
            }
            _ => {
                let w = Arc::new(Woken {
                    flag: AtomicBool::new(false),
                    inner: Mutex::new(cx.waker().clone()),
                });
                let waker = Waker::from(w.clone());
                woken.insert((w, waker))
            }
        };
        let cx = &mut Context::from_waker(waker);
        loop {
            let mut passes = 0;
            loop {
                woken.flag.store(false, Ordering::SeqCst);
                poll_all(&mut pending, &mut held, &mut log, cx);
                if !woken.flag.load(Ordering::SeqCst) {
                    break;
                }
                passes += 1;
                assert!(
                    passes < 1_000,
                    "the reservations keep waking their task: a spin"
                );
            }
            if next == case.events.len() {
                return if pending.is_empty() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                };
            }
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let event = case.events[next];
            if let Some(reserve) = reserve(&budget, event, start + Duration::from_millis(t)) {
                pending.push((next, Box::pin(watched(next, reserve))));
            }
            match event {
                Event::Cancel { n } => {
                    if !pending.is_empty() {
                        // `pending` is in arrival order.
                        drop(pending.remove(n % pending.len()));
                    }
                }
                Event::Settle { n, keep } => {
                    if !held.is_empty() {
                        let i = n % held.len();
                        settle(held.remove(i).1, keep);
                    }
                }
                Event::Advance { ms } => t += ms,
                Event::Arrive { .. } => {}
            }
            next += 1;
            sleep.as_mut().reset(start + Duration::from_millis(t));
        }
    })
    .await;
    assert_eq!(budget.waiters(), 0);
    log
}

/// A waker that remembers it was woken, and passes the wake on.
struct Woken {
    flag: AtomicBool,
    inner: Mutex<Waker>,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.flag.store(true, Ordering::SeqCst);
        self.inner.lock().unwrap().wake_by_ref();
    }
}

pin_project_lite::pin_project! {
    /// A reservation that fails the test when it is polled without end: a spin (futures waking
    /// each other at one instant) would otherwise stop the paused clock for ever.
    struct Watched<F> {
        #[pin]
        inner: F,
        polls: u32,
        id: usize,
    }
}

impl<F: Future> Future for Watched<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        *this.polls += 1;
        assert!(
            *this.polls < 100_000,
            "request {} was polled {} times: a spin",
            this.id,
            this.polls
        );
        this.inner.poll(cx)
    }
}

fn watched<F>(id: usize, inner: F) -> Watched<F> {
    Watched {
        inner,
        polls: 0,
        id,
    }
}

/// Runs `f` on a paused clock; `None` if a request was still waiting after a virtual year
/// (nothing would ever admit it).
fn paused<F: Future>(f: F) -> Option<F::Output> {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
        .block_on(async {
            tokio::time::timeout(Duration::from_secs(365 * 86_400), f)
                .await
                .ok()
        })
}

fn agree(
    driver: &str,
    model: &[(usize, u64)],
    engine: &[(usize, u64)],
) -> Result<(), TestCaseError> {
    let ids = |log: &[(usize, u64)]| log.iter().map(|(id, _)| *id).collect::<Vec<_>>();
    prop_assert_eq!(
        ids(engine),
        ids(model),
        "order of admission ({}): engine {:?}, model {:?}",
        driver,
        engine,
        model
    );
    for (&(id, m), &(_, e)) in model.iter().zip(engine) {
        prop_assert!(
            e >= m && e - m <= 1,
            "request {} admitted at {} ms, the model says {} ms ({}): engine {:?}, model {:?}",
            id,
            e,
            m,
            driver,
            engine,
            model
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The engine over Redis: the order it asks the store in.

/// Arrivals all at one instant into a drained budget: everyone waits, and the order of
/// admission is the scheduler's alone, whatever the store's round trips take. Costs of 10 to
/// 100 tokens at 10 a millisecond: the smallest takes a millisecond to refill, more than a
/// round trip.
fn burst_case() -> impl Strategy<Value = Case> {
    case().prop_flat_map(|case| {
        let count = case.tenants.len();
        let arrival =
            (0..3usize, 0..count, 1..=10u64).prop_map(|(class, tenant, cost)| Event::Arrive {
                class,
                tenant,
                cost: cost * 10,
                later: None,
            });
        prop::collection::vec(arrival, 2..24).prop_map(move |events| Case {
            drained: true,
            events,
            ..case.clone()
        })
    })
}

/// The store's budget: 100 tokens a millisecond (only the order is compared, and a case's
/// waits for the refill, in real time, stay a few milliseconds), the case's burst, one call
/// in flight, under a key of its own.
async fn redis_budget(url: &str, key: &str, case: &Case) -> Budget {
    let limit = limit(
        Dimension::TotalTokens,
        100_000,
        Duration::from_secs(1),
        case.burst,
    );
    let quota = Quota::new()
        .with_limit(limit)
        .with_max_in_flight(std::num::NonZeroUsize::MIN);
    tower_llm_quota_redis::RedisBudget::new(url, key)
        .timeout(Duration::from_secs(5))
        // One question at a time: the store admits in the ordering's order.
        .questions_in_flight(1)
        .connect(&quota)
        .await
        .unwrap()
        .with_tenant_tree(tree(case))
        .unwrap()
}

/// The requests in the order the budget asked the store for them (reservation ids are taken
/// as each question leaves), all polled by one task.
async fn redis_order(url: &str, key: &str, case: &Case) -> Vec<usize> {
    let budget = redis_budget(url, key, case).await;
    // Drain the bucket, holding the one call in flight: everyone arrives and waits in the
    // ordering (none can ask the store without a free slot) until it is given back.
    let held = budget.reserve(Cost::new(case.burst, 0)).await.unwrap();
    let reserves = case.events.iter().enumerate().filter_map(|(id, &event)| {
        let reserve = reserve(&budget, event, Instant::now())?;
        Some(async move {
            let reservation = reserve.await.expect("admitted");
            let order = reservation.id();
            // The call ends at once: the slot goes to the next.
            reservation.charge_estimate();
            (order, id)
        })
    });
    let mut all = std::pin::pin!(futures::future::join_all(reserves));
    let arrivals = case.events.len();
    std::future::poll_fn(|cx| {
        assert!(all.as_mut().poll(cx).is_pending());
        if budget.waiters() == arrivals {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    held.charge_estimate();
    let mut admitted = all.await;
    admitted.sort_unstable();
    admitted.into_iter().map(|(_, id)| id).collect()
}

fn cases() -> u32 {
    std::env::var("ENGINE_MODEL_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        ..ProptestConfig::default()
    })]

    /// Over Redis, the order is the model's (times are the store's, in real time).
    #[test]
    fn over_redis_the_engine_asks_in_the_model_s_order(case in burst_case()) {
        let expected: Vec<usize> = model(&case).into_iter().map(|(id, _)| id).collect();
        // One server for the cases, stopped with the test's thread (a process-wide static
        // is never dropped: the server would outlive the test binary).
        thread_local! {
            static SERVER: redis_server::RedisServer = redis_server::RedisServer::start();
        }
        let url = SERVER.with(redis_server::RedisServer::url);
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let key = format!("model-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let order = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(redis_order(&url, &key, &case));
        prop_assert_eq!(order, expected);
    }

    #[test]
    fn the_engine_admits_as_the_model_says(case in case()) {
        let expected = model(&case);
        let one_task = paused(engine_one_task(&case));
        prop_assert!(one_task.is_some(), "a request waits forever (one task for all)");
        agree("one task for all", &expected, &one_task.unwrap())?;
        let tasks = paused(engine_tasks(&case));
        prop_assert!(tasks.is_some(), "a request waits forever (a task per reservation)");
        agree("a task per reservation", &expected, &tasks.unwrap())?;
    }
}

/// The oracle's self-test: a model with a planted violation (classes ignored) disagrees with
/// the engine on some of the generated cases, so the comparison can fail.
#[test]
fn the_comparison_catches_a_model_that_ignores_classes() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRng, TestRunner};
    let rng = TestRng::deterministic_rng(Config::default().rng_algorithm);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let caught = (0..200).any(|_| {
        let case = case().new_tree(&mut runner).unwrap().current();
        let planted = Model {
            classless: true,
            ..Model::new(&case)
        };
        let planted = run_model(planted, &case);
        let engine = paused(engine_one_task(&case)).expect("every request admitted");
        agree("one task for all", &planted, &engine).is_err()
    });
    assert!(caught, "no case told a classless model from the engine");
}
