//! A virtual-time model of a fleet leasing shares of one account
//! ([`RedisBudget::leased_shares`](tower_llm_quota::budget::redis::RedisBudget::leased_shares)):
//! 10, 100 and 1,000 replicas, one store answering one call at a time, with the store's book
//! of leases ([`Ledger`], the lease script's arithmetic) deciding every grant.
//!
//! ```text
//! cargo run --release --example fleet_model
//! ```
//!
//! Each replica admits requests of 100 tokens from its share (a bucket of its share of the
//! account's rate and burst) and renews the share every refresh. Half the replicas saturate,
//! a third ask a steady 0.3 of an even share, the rest saturate only from 8 s to 14 s; twenty
//! tenants of weights 1 to 4 are spread over the saturating ones. The store is 0.1-1 ms away
//! each way (a round trip of 0.2-2 ms), and spends 23 µs per renewal and 20 µs + 6.2 µs per
//! lease on a division (figures measured on a local `redis-server`). Reported over 4-20 s:
//! the account used, the worst excess over the account's bucket in any window, Jain's index
//! of the tokens per weight of the tenants saturating throughout, and the store's calls.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use tower_llm_quota::budget::fleet::{Claim, Ledger, jain_index};

/// Virtual time in microseconds.
type Micros = u64;

const STEP: Micros = 500;
const RUN: Micros = 20_000_000;
const MEASURE_FROM: Micros = 4_000_000;
const COST: f64 = 100.0;
/// The account's rate per replica (tokens a second): 1,000 requests a second each.
const RATE_PER_REPLICA: f64 = 100_000.0;
/// The store's cost of a renewal, and of a division per lease (µs).
const RENEWAL: Micros = 23;
const DIVISION: (Micros, f64) = (20, 6.2);

#[derive(Clone, Copy, PartialEq)]
enum Demand {
    Saturating,
    /// A steady fraction of an even share.
    Steady(f64),
    /// Saturating between these times.
    Burst(Micros, Micros),
}

struct Replica {
    demand: Demand,
    /// Its tenants (index, weight), saturating with it.
    tenants: Vec<(usize, u32)>,
    share: f64,
    level: f64,
    /// Steady demand not yet admitted (tokens).
    backlog: f64,
    ends: Micros,
    spent: f64,
    last_renewal: Micros,
    /// Per local tenant, tokens admitted here (its local fair share's clock).
    served: Vec<f64>,
    /// In how many replicas each of its tenants waits, as the store last told.
    spread: Vec<u32>,
}

impl Replica {
    fn saturating(&self, now: Micros) -> bool {
        match self.demand {
            Demand::Saturating => true,
            Demand::Steady(_) => false,
            Demand::Burst(from, to) => now >= from && now < to,
        }
    }
}

enum Event {
    /// A replica's renewal reaches the store.
    Arrives {
        replica: usize,
        claim: Claim,
    },
    /// The store's answer reaches the replica.
    Answer {
        replica: usize,
        share: u64,
        spread: Vec<u32>,
        asked: Micros,
    },
    Renew {
        replica: usize,
    },
}

/// Events by time, in the order they were scheduled at one time.
#[derive(Default)]
struct Agenda {
    heap: BinaryHeap<Reverse<(Micros, u64)>>,
    events: HashMap<u64, Event>,
    next: u64,
}

impl Agenda {
    fn schedule(&mut self, at: Micros, event: Event) {
        self.next += 1;
        self.events.insert(self.next, event);
        self.heap.push(Reverse((at, self.next)));
    }

    /// The next event due by `now`.
    fn due(&mut self, now: Micros) -> Option<Event> {
        let &Reverse((at, id)) = self.heap.peek()?;
        if at > now {
            return None;
        }
        self.heap.pop();
        self.events.remove(&id)
    }
}

struct Outcome {
    used: f64,
    worst_excess: f64,
    burst: f64,
    jain: f64,
    calls_per_second: f64,
    calls_per_admission: f64,
    store_busy: f64,
}

fn run(replicas: usize, refresh: Micros, seed: u64) -> Outcome {
    let mut rng = fastrand::Rng::with_seed(seed);
    let rate = RATE_PER_REPLICA * replicas as f64;
    let burst = rate; // a second's worth
    let lease = refresh * 3;
    let mut ledger = Ledger::new(lease / 1_000, (lease / 6 / 1_000).max(1));
    let tenants: Vec<u32> = (0..20).map(|t| 1 + (t % 4) as u32).collect();
    let mut fleet: Vec<Replica> = (0..replicas)
        .map(|i| {
            let demand = match i % 6 {
                0..=2 => Demand::Saturating,
                3 | 4 => Demand::Steady(0.3),
                _ => Demand::Burst(8_000_000, 14_000_000),
            };
            let hosted = match demand {
                Demand::Steady(_) => Vec::new(),
                _ => (0..1 + rng.usize(..3))
                    .map(|_| {
                        let t = rng.usize(..tenants.len());
                        (t, tenants[t])
                    })
                    .collect::<HashMap<_, _>>()
                    .into_iter()
                    .collect(),
            };
            Replica {
                demand,
                served: vec![0.0; hosted.len()],
                spread: vec![1; hosted.len()],
                tenants: hosted,
                share: 0.0,
                level: 0.0,
                backlog: 0.0,
                ends: 0,
                spent: 0.0,
                last_renewal: 0,
            }
        })
        .collect();
    let mut agenda = Agenda::default();
    for replica in 0..replicas {
        agenda.schedule(rng.u64(..refresh), Event::Renew { replica });
    }
    let mut store_free: Micros = 0;
    let (mut store_busy, mut calls, mut admissions) = (0u64, 0u64, 0u64);
    let mut account = burst; // the account's bucket, allowed below zero: an excess
    let mut worst: f64 = 0.0;
    let (mut measured, mut by_tenant) = (0.0, vec![0.0; tenants.len()]);
    let one_way = |rng: &mut fastrand::Rng| 100 + rng.u64(..900);
    let mut now: Micros = 0;
    while now < RUN {
        while let Some(event) = agenda.due(now) {
            match event {
                Event::Renew { replica } => {
                    let r = &mut fleet[replica];
                    let elapsed = (now - r.last_renewal).max(1) as f64 / 1e6;
                    let want = if r.saturating(now) {
                        1.0
                    } else {
                        (1.5 * r.spent / (rate * elapsed)).min(1.0)
                    };
                    let mut claim = Claim::new(want);
                    if r.saturating(now) {
                        for &(tenant, weight) in &r.tenants {
                            claim = claim.with_flow(tenant as u64, weight);
                        }
                    }
                    (r.spent, r.last_renewal) = (0.0, now);
                    let arrives = now + one_way(&mut rng);
                    agenda.schedule(arrives, Event::Arrives { replica, claim });
                    agenda.schedule(now + refresh, Event::Renew { replica });
                }
                Event::Arrives { replica, claim } => {
                    let start = now.max(store_free);
                    let divisions = ledger.divisions();
                    let granted = ledger.lease(replica as u64, claim, start / 1_000);
                    // A division rewrote every lease: it costs by the fleet's size.
                    let divided = ledger.divisions() != divisions;
                    let cost = RENEWAL
                        + if divided {
                            DIVISION.0 + (DIVISION.1 * replicas as f64) as Micros
                        } else {
                            0
                        };
                    store_free = start + cost;
                    store_busy += cost;
                    calls += 1;
                    let answer = Event::Answer {
                        replica,
                        share: granted.share,
                        spread: granted.spread,
                        asked: now,
                    };
                    agenda.schedule(store_free + one_way(&mut rng), answer);
                }
                Event::Answer {
                    replica,
                    share,
                    spread,
                    asked,
                } => {
                    let r = &mut fleet[replica];
                    r.share = share as f64 / 1e6;
                    r.level = r.level.min(r.share * burst);
                    r.ends = asked + lease * 9 / 10;
                    if r.saturating(now) && spread.len() == r.tenants.len() {
                        r.spread = spread;
                    }
                }
            }
        }
        let dt = STEP as f64 / 1e6;
        account = (account + rate * dt).min(burst);
        for r in &mut fleet {
            if now >= r.ends {
                r.share = 0.0;
            }
            r.level = (r.level + r.share * rate * dt).min(r.share * burst);
            let saturating = r.saturating(now);
            if let Demand::Steady(fraction) = r.demand {
                r.backlog += fraction * RATE_PER_REPLICA * dt;
            }
            while r.level >= COST && (saturating || r.backlog >= COST) {
                r.level -= COST;
                r.spent += COST;
                account -= COST;
                admissions += 1;
                if !saturating {
                    r.backlog -= COST;
                }
                // The local fair share: the tenant furthest behind its fleet weight goes.
                let pick = (0..r.tenants.len()).min_by(|&a, &b| {
                    let key =
                        |i: usize| r.served[i] * f64::from(r.spread[i]) / f64::from(r.tenants[i].1);
                    key(a).total_cmp(&key(b))
                });
                if let (Some(i), true) = (pick, saturating) {
                    r.served[i] += COST;
                    if now >= MEASURE_FROM {
                        by_tenant[r.tenants[i].0] += COST;
                    }
                }
                if now >= MEASURE_FROM {
                    measured += COST;
                }
            }
        }
        worst = worst.max(-account);
        now += STEP;
    }
    let seconds = (RUN - MEASURE_FROM) as f64 / 1e6;
    // The tenants saturating throughout (on a replica that always saturates): each should
    // get tokens by its weight, whatever its spread.
    let mut throughout = vec![false; tenants.len()];
    for r in fleet.iter().filter(|r| r.demand == Demand::Saturating) {
        for &(tenant, _) in &r.tenants {
            throughout[tenant] = true;
        }
    }
    let per_weight: Vec<f64> = (0..tenants.len())
        .filter(|&t| throughout[t])
        .map(|t| by_tenant[t] / f64::from(tenants[t]))
        .collect();
    Outcome {
        used: measured / (rate * seconds),
        worst_excess: worst,
        burst,
        jain: jain_index(&per_weight),
        calls_per_second: calls as f64 / (RUN as f64 / 1e6),
        calls_per_admission: calls as f64 / admissions as f64,
        store_busy: store_busy as f64 / RUN as f64,
    }
}

fn main() {
    println!(
        "| replicas | refresh | account used | worst excess (of the burst) | Jain's index | store calls/s | calls per admission | store busy |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (replicas, refresh) in [
        (10, 100_000),
        (100, 100_000),
        (1_000, 100_000),
        (1_000, 1_000_000),
    ] {
        let o = run(replicas, refresh, 7);
        println!(
            "| {replicas} | {} ms | {:.1} % | {:.0} tokens ({:.3} %) | {:.3} | {:.0} | {:.4} | {:.1} % |",
            refresh / 1_000,
            o.used * 100.0,
            o.worst_excess,
            o.worst_excess / o.burst * 100.0,
            o.jain,
            o.calls_per_second,
            o.calls_per_admission,
            o.store_busy * 100.0,
        );
    }
}
