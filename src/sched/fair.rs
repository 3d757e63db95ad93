//! The fair share inside one class: who of the waiting flows (tenants) goes next. Pure, no
//! clock, no I/O.
//!
//! Every decision is taken when the next request is chosen, from the state at that moment;
//! nothing is frozen when a request starts waiting:
//!
//! - **Arrival order within a flow.** A flow's requests are served in the order they came
//!   (enqueue time, then ticket): only a flow's oldest request competes.
//! - **Guarantees first.** A flow under a guarantor (its nearest node with a guarantee) is
//!   *owed* service while its guarantor has earned more than it was served: each time the
//!   class serves a cost `c`, every guarantor earns `share × c`, and a request of its own
//!   served spends `c`. The owed flows go first. A guarantor without requests waiting keeps
//!   no more than one request's worth owed, so idleness is never banked; a surplus (it was
//!   served above its guarantee, by its weight) is kept up to the request just served and
//!   forgotten beyond, so a guarantee holds as soon as the weights stop covering it rather
//!   than after a long surplus is paid back; and it earns from what the class actually
//!   serves, so a guarantee can never starve a tenant that has none, whatever the account's
//!   real throughput (a lowered share, other processes).
//! - **Then weighted fair queuing over cost**: when a request becomes its flow's oldest, its
//!   flow's turn starts at `max(F, V)`, `F` the tag of the flow's last request served and `V`
//!   the virtual time (the largest *start* served by tag, as in start-time fair queuing, Goyal
//!   1996); its tag is that start plus `cost / weight` (the weight as it is now). The smallest
//!   tag goes; a flow that was idle starts at `V`, neither punished for its past use nor
//!   credited for its idleness. With `V` at the last start rather than the last tag (Golestani's
//!   self-clocked queuing), a flow whose next request arrives just after its last was served
//!   (a single caller: not waiting while it is being served) keeps its turn, even when several
//!   requests are admitted at once meanwhile (a leased grant arriving). Only a service moves the clocks: a request that leaves unserved (cancelled,
//!   refused by a shared store, waiting for its own node) hands its flow's turn to the next.
//!
//! # Fairness bound
//!
//! `S` is the cost served over an interval, `w` a weight, `L` a largest cost (`L` alone:
//! the class's largest).
//!
//! - **Weights.** Over any interval in which flows `i` and `j` both wait, the costs served to
//!   them satisfy `|S_i / w_i - S_j / w_j| <= L_i / w_i + L_j / w_j`.
//! - **A guarantee**, whatever the weights: over any interval in which a guaranteed flow `g`
//!   waits, `S_g >= share_g × S - (share_g × L + L_g)`. Its credit stays within
//!   `[-L_g, share_g × L]`: it goes first while its credit is positive (so it earns one
//!   other request at most meanwhile), and a surplus is forgotten beyond one request of its
//!   own. With several guaranteed flows in a class, an owed flow also waits for the others
//!   owed: `S_g >= share_g × S - (L + Σ_h L_h)` (the sum over the guaranteed flows).
//! - **Guarantees proportional to the weights** keep `|S_i / w_i - S_j / w_j|` within three
//!   times the weights' bound (an owed flow goes ahead of its tag; measured at 2.5 times at
//!   worst over 50,000 generated backlogs, not proved).
//!
//! The property tests of this module check each statement over generated backlogs
//! (`FAIR_BOUND_CASES` sets their number).
//!
//! State is held only for flows with requests waiting, for idle flows whose last tag is still
//! ahead of the virtual time, and for the configured guarantors.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use tokio::time::Instant;

use super::scheduling::Flow;

/// A request's place in arrival order: enqueue time, then ticket.
pub(crate) type Slot = (Instant, u64);

/// One unit of cost per weight unit, in tag units: costs divided by weights stay exact enough
/// (weights up to 2^20 and costs up to 2^64 fit a `u128`).
const SCALE: u128 = 1 << 20;

/// A guarantee's share, in millionths.
const PPM: i128 = 1_000_000;

/// The most a guarantor without requests waiting is owed (and the credit of a new one): its
/// next request goes first, nothing more.
const RETURNING: i128 = 1;

/// The fair-share state of one class.
#[derive(Debug, Default, Clone)]
pub(crate) struct FairQueue {
    virtual_time: u128,
    flows: HashMap<u64, FlowState>,
    /// Idle flows whose last tag is ahead of the virtual time, by that tag: forgotten once the
    /// virtual time passes it (a flow starting at `V` then is the same).
    idle_ahead: BTreeSet<(u128, u64)>,
    guarantors: HashMap<u64, Guarantor>,
}

#[derive(Debug, Clone)]
struct FlowState {
    /// The tag of its last request served.
    finish: u128,
    /// Where the turn of its oldest waiting request starts (while it has one).
    start: Option<u128>,
    /// Its requests out of the class for a while (asking a shared store, waiting for their
    /// node), keeping their turn: they come back, are served, or give up.
    away: u32,
    weight: u32,
    guarantor: u64,
    /// Its waiting requests by arrival, with their costs.
    waiting: BTreeMap<Slot, u64>,
}

#[derive(Debug, Clone, Copy)]
struct Guarantor {
    share_ppm: u32,
    /// Earned less served, in millionths of a cost unit; positive: owed service.
    credit: i128,
    /// Requests waiting under it.
    waiting: u32,
}

impl FairQueue {
    /// A request of `flow` costing `cost` starts waiting at `slot`.
    pub(crate) fn join(&mut self, flow: Flow, slot: Slot, cost: u64) {
        let v = self.virtual_time;
        let state = self.flow_mut(flow);
        if state.waiting.is_empty() && state.away == 0 {
            state.start = Some(state.finish.max(v));
        }
        state.waiting.insert(slot, cost);
        if flow.guarantor != 0 {
            let guarantor = self.guarantors.entry(flow.guarantor).or_insert(Guarantor {
                share_ppm: flow.share_ppm,
                credit: RETURNING,
                waiting: 0,
            });
            guarantor.share_ppm = flow.share_ppm;
            guarantor.waiting += 1;
        }
    }

    /// A waiting request leaves for good without being served (cancelled, refused).
    pub(crate) fn leave(&mut self, key: u64, slot: Slot) {
        let Some(state) = self.flows.get_mut(&key) else {
            return;
        };
        if state.waiting.remove(&slot).is_none() {
            return;
        }
        self.gone(key);
    }

    /// A waiting request steps out for a while (to ask a shared store, to wait for its own
    /// node), keeping its flow's turn and its guarantor's standing: it comes back
    /// ([`rejoin`](Self::rejoin)), is served ([`serve`](Self::serve) with no slot) or gives up
    /// ([`abandon`](Self::abandon)).
    pub(crate) fn step_out(&mut self, key: u64, slot: Slot) {
        if let Some(state) = self.flows.get_mut(&key) {
            if state.waiting.remove(&slot).is_some() {
                state.away += 1;
            }
        }
    }

    /// A request that stepped out comes back to its place.
    pub(crate) fn rejoin(&mut self, flow: Flow, slot: Slot, cost: u64) {
        let v = self.virtual_time;
        let state = self.flow_mut(flow);
        state.away = state.away.saturating_sub(1);
        if state.start.is_none() {
            state.start = Some(state.finish.max(v));
        }
        state.waiting.insert(slot, cost);
    }

    /// A request that stepped out gives up (cancelled, refused while away).
    pub(crate) fn abandon(&mut self, key: u64) {
        if let Some(state) = self.flows.get_mut(&key) {
            state.away = state.away.saturating_sub(1);
            self.gone(key);
        }
    }

    /// One of `key`'s requests is gone unserved.
    fn gone(&mut self, key: u64) {
        let Some(state) = self.flows.get_mut(&key) else {
            return;
        };
        if state.waiting.is_empty() && state.away == 0 {
            state.start = None;
        }
        let guarantor = state.guarantor;
        if let Some(g) = self.guarantors.get_mut(&guarantor) {
            g.waiting = g.waiting.saturating_sub(1);
        }
        self.forget_if_idle(key);
    }

    /// A request of `flow` costing `cost` was served: waiting at `slot`, or from outside the
    /// class (admitted by a shared store after it left to ask, `None`).
    pub(crate) fn serve(&mut self, flow: Flow, slot: Option<Slot>, cost: u64) {
        let owed = self.owed(flow.guarantor);
        let v = self.virtual_time;
        let state = self.flow_mut(flow);
        // It takes its flow's turn (one away took it with it).
        let start = state.start.unwrap_or(state.finish.max(v));
        let tag = tag(start, cost, state.weight);
        state.finish = tag;
        match slot {
            Some(slot) => {
                state.waiting.remove(&slot);
            }
            None => state.away = state.away.saturating_sub(1),
        }
        if !owed {
            // Served by its tag: the virtual time follows. (A flow served for its guarantee
            // runs ahead of it instead, and waits for it by tag.)
            self.virtual_time = v.max(start);
        }
        let v = self.virtual_time;
        let state = self.flows.get_mut(&flow.key).expect("just made");
        let waits = !state.waiting.is_empty() || state.away > 0;
        state.start = waits.then(|| state.finish.max(v));
        if let Some(g) = self.guarantors.get_mut(&flow.guarantor) {
            g.waiting = g.waiting.saturating_sub(1);
        }
        for (&key, g) in &mut self.guarantors {
            g.credit += i128::from(g.share_ppm) * i128::from(cost);
            if key == flow.guarantor {
                // A surplus (served above its guarantee, by its weight) is forgotten beyond
                // the request just served: paying back more would hold its guarantee off
                // for as long as its weight once favoured it.
                let served = i128::from(cost) * PPM;
                g.credit = (g.credit - served).max(-served);
            }
            if g.waiting == 0 {
                // Away, it banks nothing: back, it is owed its first request at most.
                g.credit = g.credit.min(RETURNING);
            }
        }
        self.forget_if_idle(flow.key);
        while let Some(&(finish, key)) = self.idle_ahead.first() {
            if finish > self.virtual_time {
                break;
            }
            self.idle_ahead.pop_first();
            // The entry may be stale: the flow waited and was served again since, its tag
            // further ahead (a later entry of its own forgets it then).
            let passed = |s: &FlowState| {
                s.waiting.is_empty() && s.away == 0 && s.finish <= self.virtual_time
            };
            if self.flows.get(&key).is_some_and(passed) {
                self.flows.remove(&key);
            }
        }
    }

    /// The request to serve next: `(flow key, slot)` of the oldest request of the flow that
    /// goes first (owed service first, then the smallest tag, then the earliest arrival).
    pub(crate) fn next(&self) -> Option<(u64, Slot)> {
        let mut best: Option<((bool, u128, Slot), u64)> = None;
        for (&key, state) in &self.flows {
            let (Some((&slot, &cost)), Some(start)) =
                (state.waiting.first_key_value(), state.start)
            else {
                continue;
            };
            let rank = (
                !self.owed(state.guarantor),
                tag(start, cost, state.weight),
                slot,
            );
            if best.is_none_or(|(ahead, _)| rank < ahead) {
                best = Some((rank, key));
            }
        }
        best.map(|((_, _, slot), key)| (key, slot))
    }

    /// The order in which the waiting requests would be served if nothing changed.
    pub(crate) fn service_order(&self) -> impl Iterator<Item = Slot> + '_ {
        let mut first = self.next();
        let mut rest: Option<FairQueue> = None;
        std::iter::from_fn(move || {
            if let Some((_, slot)) = first.take() {
                return Some(slot);
            }
            let sim = rest.get_or_insert_with(|| {
                // Past the first, the rest is a simulation on a copy (rarely needed).
                let mut sim = self.clone();
                if let Some((key, slot)) = self.next() {
                    sim.serve_waiting(key, slot);
                }
                sim
            });
            let (key, slot) = sim.next()?;
            sim.serve_waiting(key, slot);
            Some(slot)
        })
    }

    fn serve_waiting(&mut self, key: u64, slot: Slot) {
        let Some(state) = self.flows.get(&key) else {
            return;
        };
        let cost = state.waiting.get(&slot).copied().unwrap_or(0);
        let flow = Flow {
            key,
            weight: state.weight,
            guarantor: state.guarantor,
            share_ppm: self
                .guarantors
                .get(&state.guarantor)
                .map_or(0, |g| g.share_ppm),
        };
        self.serve(flow, Some(slot), cost);
    }

    /// Whether the flows under `guarantor` are owed service.
    fn owed(&self, guarantor: u64) -> bool {
        guarantor != 0
            && self
                .guarantors
                .get(&guarantor)
                .is_some_and(|g| g.credit > 0)
    }

    fn flow_mut(&mut self, flow: Flow) -> &mut FlowState {
        let state = self.flows.entry(flow.key).or_insert_with(|| FlowState {
            finish: 0,
            start: None,
            away: 0,
            weight: 1,
            guarantor: 0,
            waiting: BTreeMap::new(),
        });
        // The latest configuration of the flow counts (a weight changed live). Its requests
        // waiting or away move to its new guarantor, if it changed.
        let before = state.guarantor;
        (state.weight, state.guarantor) = (flow.weight.max(1), flow.guarantor);
        if before != flow.guarantor {
            let moved = u32::try_from(state.waiting.len())
                .unwrap_or(u32::MAX)
                .saturating_add(state.away);
            if let Some(g) = self.guarantors.get_mut(&before) {
                g.waiting = g.waiting.saturating_sub(moved);
            }
            if flow.guarantor != 0 && moved > 0 {
                let g = self.guarantors.entry(flow.guarantor).or_insert(Guarantor {
                    share_ppm: flow.share_ppm,
                    credit: RETURNING,
                    waiting: 0,
                });
                g.waiting = g.waiting.saturating_add(moved);
            }
        }
        state
    }

    /// Drops an idle flow's state once it says nothing a newcomer would not: its tag is not
    /// ahead of the virtual time.
    fn forget_if_idle(&mut self, key: u64) {
        let Some(state) = self.flows.get(&key) else {
            return;
        };
        if !state.waiting.is_empty() || state.away > 0 {
            return;
        }
        if state.finish > self.virtual_time {
            self.idle_ahead.insert((state.finish, key));
        } else {
            self.flows.remove(&key);
        }
    }

    /// Adds to `out` every flow with requests waiting or away, with its weight (the larger,
    /// for a flow already there), and to `guarantors` their guarantors (once each).
    pub(crate) fn waiting_flows(&self, out: &mut Vec<(u64, u32)>, guarantors: &mut Vec<u64>) {
        let waiting = self
            .flows
            .iter()
            .filter(|(_, state)| !state.waiting.is_empty() || state.away > 0);
        for (&key, state) in waiting {
            match out.iter_mut().find(|(k, _)| *k == key) {
                Some((_, weight)) => *weight = (*weight).max(state.weight),
                None => out.push((key, state.weight)),
            }
            if state.guarantor != 0 && !guarantors.contains(&state.guarantor) {
                guarantors.push(state.guarantor);
            }
        }
    }

    /// How many flows hold state.
    #[cfg(test)]
    pub(crate) fn flows(&self) -> usize {
        self.flows.len()
    }
}

fn tag(start: u128, cost: u64, weight: u32) -> u128 {
    start.saturating_add(u128::from(cost.max(1)) * SCALE / u128::from(weight.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(key: u64, weight: u32) -> Flow {
        Flow {
            key,
            weight,
            ..Flow::DEFAULT
        }
    }

    fn guaranteed(key: u64, weight: u32, share: f64) -> Flow {
        Flow {
            key,
            weight,
            guarantor: key,
            share_ppm: (share * 1e6) as u32,
        }
    }

    /// Serves `n` requests from always-backlogged flows (each keeps two waiting), and returns
    /// the cost each got.
    fn serve(flows: &[(Flow, u64)], n: usize) -> Vec<u64> {
        let t0 = Instant::now();
        let mut queue = FairQueue::default();
        let mut ticket = 0;
        for &(flow, cost) in flows {
            for _ in 0..2 {
                ticket += 1;
                queue.join(flow, (t0, ticket), cost);
            }
        }
        let mut got = vec![0; flows.len()];
        for _ in 0..n {
            let (key, slot) = queue.next().unwrap();
            let i = flows.iter().position(|(f, _)| f.key == key).unwrap();
            let (flow, cost) = flows[i];
            queue.serve(flow, Some(slot), cost);
            got[i] += cost;
            ticket += 1;
            queue.join(flow, (t0, ticket), cost);
        }
        got
    }

    #[test]
    fn shares_follow_weights_over_cost_within_the_bound() {
        let got = serve(&[(flow(1, 3), 100), (flow(2, 1), 1_000)], 10_000);
        let (a, b) = (got[0] as f64, got[1] as f64);
        assert!((a / 3.0 - b).abs() <= 100.0 / 3.0 + 1_000.0, "{a} {b}");
        let share = a / (a + b);
        assert!((share - 0.75).abs() < 0.005, "{share}");
    }

    #[test]
    fn a_guarantee_never_starves_a_heavier_flow() {
        // small: weight 1, guaranteed 25 %; big: weight 3, no guarantee. Of 300 admissions,
        // about 75 and 225.
        let got = serve(&[(guaranteed(1, 1, 0.25), 100), (flow(2, 3), 100)], 300);
        assert_eq!(got, [7_500, 22_500]);
    }

    #[test]
    fn a_guarantee_above_the_weight_lifts_the_flow_to_it() {
        let got = serve(&[(guaranteed(1, 1, 0.5), 100), (flow(2, 3), 100)], 1_000);
        assert_eq!(got, [50_000, 50_000]);
    }

    #[test]
    fn a_guarantee_holds_at_once_when_its_weighted_share_falls_below_it() {
        // A guaranteed 30 % while its weight gave it half for 10,000 requests (a surplus of
        // 2,000 over its guarantee), then three more flows arrive: its weight now gives 20 %,
        // and of the next 1,000 requests it gets its 30 % at once, not after paying back
        // what its weight gave it before.
        let t0 = Instant::now();
        let mut queue = FairQueue::default();
        let a = guaranteed(1, 1, 0.3);
        let mut ticket = 0;
        let mut join = |queue: &mut FairQueue, flow: Flow| {
            ticket += 1;
            queue.join(flow, (t0, ticket), 1);
        };
        for f in [a, flow(2, 1)] {
            join(&mut queue, f);
        }
        let mut flows = vec![a, flow(2, 1)];
        let mut served_a = 0;
        for round in 0..11_000 {
            if round == 10_000 {
                for key in 3..=5 {
                    flows.push(flow(key, 1));
                    join(&mut queue, flow(key, 1));
                }
                served_a = 0;
            }
            let (key, slot) = queue.next().unwrap();
            let f = *flows.iter().find(|f| f.key == key).unwrap();
            queue.serve(f, Some(slot), 1);
            served_a += u32::from(key == 1);
            join(&mut queue, f);
        }
        assert!(served_a >= 299, "{served_a} of 1,000");
    }

    #[test]
    fn a_flow_is_served_in_arrival_order() {
        let t0 = Instant::now();
        let mut queue = FairQueue::default();
        let a = flow(1, 1);
        // A later arrival with a smaller cost does not pass an earlier one of its flow.
        queue.join(a, (t0 + std::time::Duration::from_secs(5), 2), 10);
        queue.join(a, (t0, 1), 1_000);
        assert_eq!(queue.next(), Some((1, (t0, 1))));
        let order: Vec<Slot> = queue.service_order().collect();
        assert_eq!(
            order,
            [(t0, 1), (t0 + std::time::Duration::from_secs(5), 2)]
        );
    }

    #[test]
    fn leaving_unserved_moves_no_clock_and_a_returning_flow_starts_at_the_virtual_time() {
        let t0 = Instant::now();
        let mut queue = FairQueue::default();
        let busy = flow(1, 1);
        for i in 0..10 {
            queue.join(busy, (t0, i), 10);
        }
        for i in 0..5 {
            queue.serve(busy, Some((t0, i)), 10);
        }
        let v = queue.virtual_time;
        // The start of the last request served.
        assert_eq!(v, 40 * SCALE);
        // A request that leaves to ask a store and is refused moves nothing.
        queue.leave(1, (t0, 5));
        assert_eq!(queue.virtual_time, v);
        // An idle flow arriving now starts at V: it goes first (its tag, 50, is below the
        // busy flow's next, 60), then the busy flow's backlog.
        queue.join(flow(2, 1), (t0, 100), 10);
        let order: Vec<u64> = queue.service_order().map(|(_, ticket)| ticket).collect();
        assert_eq!(order, [100, 6, 7, 8, 9]);
        queue.serve(flow(2, 1), Some((t0, 100)), 10);
        queue.serve(flow(1, 1), Some((t0, 6)), 10);
        assert_eq!(queue.flows(), 1, "an idle flow level with V holds no state");
    }
}

#[cfg(test)]
mod bound {
    //! The fairness bounds the module documents, over generated backlogs: flows that always
    //! wait, costs drawn per request, every interval of the service checked.
    use super::*;
    use proptest::prelude::*;

    /// Serves `n` requests from flows that always wait; returns who was served, and at what
    /// cost, in order.
    fn service(flows: &[Flow], costs: &[Vec<u64>], n: usize) -> Vec<(usize, u64)> {
        let t0 = Instant::now();
        let mut queue = FairQueue::default();
        let mut ticket = 0;
        let mut next_cost = vec![0usize; flows.len()];
        let mut cost_of = |i: usize| {
            let c = costs[i][next_cost[i] % costs[i].len()];
            next_cost[i] += 1;
            c
        };
        let mut slots: Vec<std::collections::VecDeque<(Slot, u64)>> =
            vec![Default::default(); flows.len()];
        for (i, flow) in flows.iter().enumerate() {
            for _ in 0..2 {
                ticket += 1;
                let cost = cost_of(i);
                queue.join(*flow, (t0, ticket), cost);
                slots[i].push_back(((t0, ticket), cost));
            }
        }
        let mut served = Vec::new();
        for _ in 0..n {
            let (key, slot) = queue.next().unwrap();
            let i = flows.iter().position(|f| f.key == key).unwrap();
            let (oldest, cost) = slots[i].pop_front().unwrap();
            assert_eq!(oldest, slot, "a flow's requests in arrival order");
            queue.serve(flows[i], Some(slot), cost);
            served.push((i, cost));
            ticket += 1;
            let cost = cost_of(i);
            queue.join(flows[i], (t0, ticket), cost);
            slots[i].push_back(((t0, ticket), cost));
        }
        served
    }

    /// The largest drift `|S_i/w_i - S_j/w_j|` over every interval of `served`, against the
    /// bound `factor × (L_i/w_i + L_j/w_j)`: the worst ratio of drift to bound.
    fn worst_drift(
        flows: &[Flow],
        costs: &[Vec<u64>],
        served: &[(usize, u64)],
        factor: f64,
    ) -> f64 {
        let mut worst: f64 = 0.0;
        for i in 0..flows.len() {
            for j in (i + 1)..flows.len() {
                let (wi, wj) = (f64::from(flows[i].weight), f64::from(flows[j].weight));
                let li = *costs[i].iter().max().unwrap() as f64;
                let lj = *costs[j].iter().max().unwrap() as f64;
                let bound = factor * (li / wi + lj / wj);
                // The drift over [a, b) is the difference of prefix sums: the extremes of the
                // running difference bound every interval.
                let (mut d, mut low, mut high) = (0.0f64, 0.0f64, 0.0f64);
                for &(k, c) in served {
                    if k == i {
                        d += c as f64 / wi;
                    } else if k == j {
                        d -= c as f64 / wj;
                    }
                    low = low.min(d);
                    high = high.max(d);
                }
                // Tags are rounded down to 1/SCALE of a unit a request: that much slack.
                let rounding = served.len() as f64 / SCALE as f64;
                worst = worst.max((high - low) / (bound + rounding));
            }
        }
        worst
    }

    /// Cases per property: 300, or `FAIR_BOUND_CASES` (a long run).
    fn cases() -> u32 {
        std::env::var("FAIR_BOUND_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(300)
    }

    fn flows_and_costs() -> impl Strategy<Value = (Vec<u32>, Vec<Vec<u64>>)> {
        prop::collection::vec((1u32..=8, prop::collection::vec(1u64..=1_000, 1..6)), 2..=4)
            .prop_map(|flows| flows.into_iter().unzip())
    }

    /// The largest shortfall `share × S - S_g` of the first flow (guaranteed `share`) over
    /// any interval of `served`.
    fn shortfall(served: &[(usize, u64)], share: f64) -> f64 {
        // S_g - share × S as a running sum: its drop over an interval is the shortfall there.
        let (mut d, mut high, mut worst) = (0.0f64, 0.0f64, 0.0f64);
        for &(k, c) in served {
            d += if k == 0 { c as f64 } else { 0.0 } - share * c as f64;
            high = high.max(d);
            worst = worst.max(high - d);
        }
        worst
    }

    /// The flows of a case where the first is guaranteed `share` tenths, whatever its weight.
    fn first_guaranteed(weights: &[u32], share: u32) -> Vec<Flow> {
        (weights.iter().enumerate())
            .map(|(i, &weight)| Flow {
                key: i as u64 + 1,
                weight,
                guarantor: if i == 0 { 1 } else { 0 },
                share_ppm: if i == 0 { share * 100_000 } else { 0 },
            })
            .collect()
    }

    /// The bound on a guarantee's shortfall: `share × L + L_g` (and the millionth of a unit a
    /// newcomer is owed).
    fn guarantee_bound(costs: &[Vec<u64>], share: f64) -> f64 {
        let largest = costs.iter().flatten().copied().max().unwrap() as f64;
        let own = costs[0].iter().copied().max().unwrap() as f64;
        share * largest + own + 1e-6
    }

    /// A case the property test once found: the guaranteed flow, ahead of its guarantee by
    /// its weight while the flows of larger requests waited for the virtual time (a surplus
    /// of about 0.1 × 9,000), paid that surplus back in full afterwards, a shortfall of
    /// 1,935 over an interval. Its surplus is now forgotten beyond one request of its own.
    #[test]
    fn a_surplus_from_the_weights_is_not_paid_back_beyond_one_request() {
        let costs = vec![vec![45], vec![221, 668], vec![967, 916], vec![915]];
        let flows = first_guaranteed(&[8, 2, 1, 1], 7);
        let served = service(&flows, &costs, 400);
        let worst = shortfall(&served, 0.7);
        let bound = guarantee_bound(&costs, 0.7);
        assert!(worst <= bound, "shortfall {worst:.1} against {bound:.1}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn without_guarantees_the_drift_is_at_most_one_request_of_each(
            (weights, costs) in flows_and_costs()
        ) {
            let flows: Vec<Flow> = weights.iter().enumerate()
                .map(|(i, &weight)| Flow { key: i as u64 + 1, weight, ..Flow::DEFAULT })
                .collect();
            let served = service(&flows, &costs, 400);
            let worst = worst_drift(&flows, &costs, &served, 1.0);
            prop_assert!(worst <= 1.0, "drift {worst:.3} of the bound");
        }

        #[test]
        fn guarantees_proportional_to_the_weights_add_one_request_of_each(
            (weights, costs) in flows_and_costs(), whole in prop::bool::ANY
        ) {
            // Guarantees in the weights' proportions, adding up to the whole account or half.
            let total: u32 = weights.iter().sum();
            let scale = if whole { 1.0 } else { 0.5 };
            let flows: Vec<Flow> = weights.iter().enumerate()
                .map(|(i, &weight)| Flow {
                    key: i as u64 + 1,
                    weight,
                    guarantor: i as u64 + 1,
                    share_ppm: (scale * 1e6 * f64::from(weight) / f64::from(total)) as u32,
                })
                .collect();
            let served = service(&flows, &costs, 400);
            let worst = worst_drift(&flows, &costs, &served, 3.0);
            prop_assert!(worst <= 1.0, "drift {worst:.3} of three times the bound");
        }

        #[test]
        fn several_guarantees_hold_within_one_request_of_each_guaranteed_flow_and_the_largest(
            (weights, costs) in flows_and_costs(), tenths in prop::collection::vec(0u32..=4, 4)
        ) {
            // Every flow guaranteed 0 to 4 tenths, scaled down to the whole account at most.
            let tenths = &tenths[..weights.len()];
            let total = tenths.iter().sum::<u32>().max(10);
            let shares: Vec<f64> = tenths.iter().map(|&t| f64::from(t) / f64::from(total)).collect();
            let flows: Vec<Flow> = weights.iter().enumerate()
                .map(|(i, &weight)| Flow {
                    key: i as u64 + 1,
                    weight,
                    guarantor: if tenths[i] > 0 { i as u64 + 1 } else { 0 },
                    share_ppm: (shares[i] * 1e6) as u32,
                })
                .collect();
            let served = service(&flows, &costs, 400);
            let largest = costs.iter().flatten().copied().max().unwrap() as f64;
            let own_largest: Vec<f64> = (costs.iter().zip(tenths))
                .filter(|&(_, &t)| t > 0)
                .map(|(c, _)| *c.iter().max().unwrap() as f64)
                .collect();
            for (g, &share) in shares.iter().enumerate().filter(|&(_, &s)| s > 0.0) {
                let ordered: Vec<(usize, u64)> = served.iter()
                    .map(|&(k, c)| (usize::from(k != g), c))
                    .collect();
                let worst = shortfall(&ordered, share);
                let bound = largest + own_largest.iter().sum::<f64>();
                prop_assert!(worst <= bound, "flow {g}: shortfall {worst:.1} against {bound:.1}");
            }
        }

        #[test]
        fn a_guarantee_holds_over_every_interval_within_one_request_of_each(
            (weights, costs) in flows_and_costs(), share in 1u32..=9
        ) {
            let flows = first_guaranteed(&weights, share);
            let served = service(&flows, &costs, 400);
            let share = f64::from(share) / 10.0;
            let worst = shortfall(&served, share);
            let bound = guarantee_bound(&costs, share);
            prop_assert!(worst <= bound, "shortfall {worst:.1} against {bound:.1}");
        }
    }
}
