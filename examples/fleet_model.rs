//! A virtual-time model of a fleet leasing one account
//! ([`RedisBudget::leased_shares`](tower_llm_quota_redis::RedisBudget::leased_shares)):
//! 10, 100 and 1,000 replicas, one store answering one call at a time, with the store's book
//! of leases ([`Ledger`], the lease script's arithmetic) deciding every grant, under churn.
//!
//! ```text
//! cargo run --release --example fleet_model
//! ```
//!
//! Each replica admits requests of 100 tokens from what it was granted (its wallet, which
//! never refills by itself) and renews every refresh, reporting what it keeps, gives back
//! and asks for ([`Report::of`]). Half the replicas saturate, a third ask a steady 0.3 of an
//! even share, the rest saturate only from 8 s to 14 s; twenty tenants of weights 1 to 4 are
//! spread over the saturating ones. The store is 0.1-1 ms away each way (a round trip of
//! 0.2-2 ms), and spends 23 µs per renewal and 20 µs + 6.2 µs per lease on a division
//! (figures measured on a local `redis-server`). Churn, in the second set of rows: every
//! second 1 % of the replicas are replaced (half die holding what they held, half leave
//! giving it back), and 1 % of the store's replies are lost (the store applied the renewal;
//! the replica never hears of it). Reported over 4-20 s: the account used, the worst excess
//! over the account's bucket in any window (a bucket of the account's rate and burst that
//! every admission is taken from: it goes below zero exactly when some window admits more
//! than the burst and the rate over it), Jain's index of the tokens per weight of the
//! tenants saturating throughout, the store's calls, and the tokens lost with their holders.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use tower_llm_quota::budget::store::fleet::{Account, Answer, Claim, Ledger, Report, jain_index};

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
    /// Its id at the store (a replacement is a new process).
    id: u64,
    demand: Demand,
    /// Its tenants (index, weight), saturating with it.
    tenants: Vec<(usize, u32)>,
    /// What it holds (tokens): only grants fill it.
    level: f64,
    /// Steady demand not yet admitted (tokens).
    backlog: f64,
    ends: Micros,
    spent: f64,
    seq: u64,
    /// Its part of the account, as the store last told.
    part: f64,
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
        id: u64,
        claim: Claim,
        renewal: (u64, Report),
    },
    /// The store's answer reaches the replica.
    Answer {
        replica: usize,
        id: u64,
        granted: u64,
        part: u64,
        spread: Vec<u32>,
        asked: Micros,
    },
    Renew {
        replica: usize,
        id: u64,
    },
    /// A replica leaving cleanly reaches the store with what it gives back.
    Leaves {
        id: u64,
        renewal: (u64, Report),
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
    /// Tokens that left with replicas that died, or with lost replies.
    lost: f64,
}

/// How the fleet churns: replicas replaced a second (a fraction of the fleet), and the share
/// of the store's replies lost.
#[derive(Clone, Copy)]
struct Churn {
    replaced: f64,
    lost_replies: f64,
}

fn replica(id: u64, demand: Demand, hosted: Vec<(usize, u32)>) -> Replica {
    Replica {
        id,
        demand,
        served: vec![0.0; hosted.len()],
        spread: vec![1; hosted.len()],
        tenants: hosted,
        level: 0.0,
        backlog: 0.0,
        ends: 0,
        spent: 0.0,
        seq: 0,
        part: 0.0,
        last_renewal: 0,
    }
}

fn run(replicas: usize, refresh: Micros, churn: Churn, seed: u64) -> Outcome {
    let mut rng = fastrand::Rng::with_seed(seed);
    let rate = RATE_PER_REPLICA * replicas as f64;
    let burst = rate; // a second's worth
    let lease = refresh * 3;
    let account = Account {
        num: (rate / 1_000.0) as u64,
        den: 1,
        capacity: burst as u64,
    };
    let mut ledger = Ledger::new(account, lease / 1_000, (lease / 6 / 1_000).max(1));
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
            replica(i as u64, demand, hosted)
        })
        .collect();
    let mut next_id = replicas as u64;
    let mut agenda = Agenda::default();
    for (i, r) in fleet.iter().enumerate() {
        agenda.schedule(
            rng.u64(..refresh),
            Event::Renew {
                replica: i,
                id: r.id,
            },
        );
    }
    let mut store_free: Micros = 0;
    let (mut store_busy, mut calls, mut admissions) = (0u64, 0u64, 0u64);
    let mut bucket = burst; // the account's bucket, allowed below zero: an excess
    let (mut worst, mut lost): (f64, f64) = (0.0, 0.0);
    let (mut measured, mut by_tenant) = (0.0, vec![0.0; tenants.len()]);
    let one_way = |rng: &mut fastrand::Rng| 100 + rng.u64(..900);
    let mut replaced = 0.0;
    let mut now: Micros = 0;
    while now < RUN {
        while let Some(event) = agenda.due(now) {
            match event {
                Event::Renew { replica, id } if fleet[replica].id == id => {
                    let r = &mut fleet[replica];
                    let elapsed = (now - r.last_renewal).max(1) as f64 / 1e6;
                    let saturating = r.saturating(now);
                    let want = if saturating {
                        1.0
                    } else {
                        (1.5 * r.spent / (rate * elapsed)).min(1.0)
                    };
                    let mut claim = Claim::new(want);
                    if saturating {
                        for &(tenant, weight) in &r.tenants {
                            claim = claim.with_flow(tenant as u64, weight);
                        }
                    }
                    let waiting = saturating || r.backlog >= COST;
                    let blocked = (waiting && r.level < COST).then_some(COST as u64);
                    let refreshes = elapsed * 1e6 / refresh as f64;
                    let flags = (waiting, blocked, now >= r.ends);
                    let report = Report::of(
                        r.level.floor() as i64,
                        (burst as u64, r.part),
                        r.spent as u64,
                        refreshes,
                        flags,
                    );
                    r.level -= report.back as f64;
                    r.seq += 1;
                    (r.spent, r.last_renewal) = (0.0, now);
                    let arrives = now + one_way(&mut rng);
                    let renewal = (r.seq, report);
                    agenda.schedule(
                        arrives,
                        Event::Arrives {
                            replica,
                            id,
                            claim,
                            renewal,
                        },
                    );
                    agenda.schedule(now + refresh, Event::Renew { replica, id });
                }
                Event::Renew { .. } => {}
                Event::Arrives {
                    replica,
                    id,
                    claim,
                    renewal,
                } => {
                    let start = now.max(store_free);
                    let divisions = ledger.divisions();
                    let answer = ledger.lease(id, claim, renewal, start / 1_000, |p| p);
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
                    if let Answer::Granted {
                        granted,
                        part,
                        spread,
                        ..
                    } = answer
                    {
                        if rng.f64() < churn.lost_replies {
                            lost += granted as f64;
                        } else {
                            let answer = Event::Answer {
                                replica,
                                id,
                                granted,
                                part,
                                spread,
                                asked: now,
                            };
                            agenda.schedule(store_free + one_way(&mut rng), answer);
                        }
                    }
                }
                Event::Leaves { id, renewal } => {
                    let start = now.max(store_free);
                    ledger.leave(id, renewal, start / 1_000);
                    store_free = start + RENEWAL;
                    store_busy += RENEWAL;
                    calls += 1;
                }
                Event::Answer {
                    replica,
                    id,
                    granted,
                    part,
                    spread,
                    asked,
                } => {
                    let r = &mut fleet[replica];
                    if r.id != id {
                        // Its replica is gone: what it was granted with it.
                        lost += granted as f64;
                        continue;
                    }
                    if now >= r.ends {
                        // A lease that ended keeps nothing.
                        r.level = r.level.min(0.0);
                    }
                    r.level += granted as f64;
                    r.part = part as f64 / 1e6;
                    r.ends = asked + lease * 9 / 10;
                    if r.saturating(now) && spread.len() == r.tenants.len() {
                        r.spread = spread;
                    }
                }
            }
        }
        // Churn: replicas replaced by new processes, half dying with what they hold.
        replaced += churn.replaced * replicas as f64 * STEP as f64 / 1e6;
        while replaced >= 1.0 {
            replaced -= 1.0;
            let i = rng.usize(..replicas);
            let old = &mut fleet[i];
            let held = old.level.max(0.0);
            if rng.bool() {
                lost += held;
            } else {
                let report = Report {
                    keep: old.level.min(0.0) as i64,
                    back: held as u64,
                    ..Report::default()
                };
                let arrives = now + one_way(&mut rng);
                let renewal = (old.seq + 1, report);
                agenda.schedule(
                    arrives,
                    Event::Leaves {
                        id: old.id,
                        renewal,
                    },
                );
            }
            let (demand, hosted) = (old.demand, old.tenants.clone());
            *old = replica(next_id, demand, hosted);
            agenda.schedule(
                now + rng.u64(..refresh),
                Event::Renew {
                    replica: i,
                    id: next_id,
                },
            );
            next_id += 1;
        }
        let dt = STEP as f64 / 1e6;
        bucket = (bucket + rate * dt).min(burst);
        for r in &mut fleet {
            let saturating = r.saturating(now);
            if let Demand::Steady(fraction) = r.demand {
                r.backlog += fraction * RATE_PER_REPLICA * dt;
            }
            while now < r.ends && r.level >= COST && (saturating || r.backlog >= COST) {
                r.level -= COST;
                r.spent += COST;
                bucket -= COST;
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
        worst = worst.max(-bucket);
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
        lost,
    }
}

fn main() {
    println!(
        "| replicas | refresh | churn | account used | worst excess | Jain's index | store calls/s | calls per admission | store busy | tokens lost (of the run's) |"
    );
    println!("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    let calm = Churn {
        replaced: 0.0,
        lost_replies: 0.0,
    };
    let churning = Churn {
        replaced: 0.01,
        lost_replies: 0.01,
    };
    for (churn, label) in [(calm, "none"), (churning, "1 %/s, 1 % replies")] {
        for (replicas, refresh) in [
            (10, 100_000),
            (100, 100_000),
            (1_000, 100_000),
            (1_000, 1_000_000),
        ] {
            let o = run(replicas, refresh, churn, 7);
            println!(
                "| {replicas} | {} ms | {label} | {:.1} % | {:.0} tokens | {:.3} | {:.0} | {:.4} | {:.1} % | {:.0} ({:.2} %) |",
                refresh / 1_000,
                o.used * 100.0,
                o.worst_excess,
                o.jain,
                o.calls_per_second,
                o.calls_per_admission,
                o.store_busy * 100.0,
                o.lost,
                o.lost / (o.burst * (1.0 + RUN as f64 / 1e6)) * 100.0,
            );
        }
    }
}
