//! Weighted fair queuing over token cost: the stamps that order the requests of one class.
//! Pure, no clock, no I/O.
//!
//! Self-clocked fair queuing (Golestani, 1994): each flow (tenant) keeps the finish tag of
//! its last request; a request joining gets `start = max(V, last finish)` and
//! `finish = start + cost / weight`, and requests are served by finish tag. `V`, the virtual
//! time, is the tag of the last request served. A flow that was idle starts at `V`: it is
//! neither punished for its past use nor credited for its idleness, so when it returns it is
//! served at once in its share, ahead of borrowers whose tags ran past `V`.
//!
//! # Fairness bound
//!
//! Over any interval in which two flows `i` and `j` both wait, the tokens admitted for them,
//! `S_i` and `S_j`, satisfy `|S_i / w_i - S_j / w_j| <= L_i / w_i + L_j / w_j`, with `L` the
//! largest cost of each flow: the share of a flow drifts from its weight by at most one
//! request of each, whatever the interval's length (the drift in *shares* shrinks as the
//! interval grows). The tags count reserved costs; settlement refunds the unused estimate,
//! so shares of actual tokens also drift by the difference between the flows' estimate
//! errors.
//!
//! Only flows with requests waiting hold state: a flow's tag is dropped when its last request
//! leaves (it equals `V` then, unless that request was cancelled), so the state is bounded by
//! the number of waiting requests, not the number of tenants.

use std::collections::HashMap;

use crate::sched::Flow;

/// One unit of cost per weight unit, in tag units: costs divided by weights stay exact enough
/// (weights up to 2^20 and costs up to 2^64 fit a `u128`).
const SCALE: u128 = 1 << 20;

/// The fair-queuing clocks of an ordering's classes.
#[derive(Debug, Default)]
pub(crate) struct FairClock {
    classes: [Class; 3],
}

#[derive(Debug, Default)]
struct Class {
    virtual_time: u128,
    flows: HashMap<u64, FlowState>,
}

#[derive(Debug, Clone, Copy)]
struct FlowState {
    finish: u128,
    waiting: u32,
}

impl FairClock {
    /// The finish tag of a request of `flow` costing `cost` joining class `class`.
    pub(crate) fn join(&mut self, class: usize, flow: Flow, cost: u64) -> u128 {
        let class = &mut self.classes[class];
        let v = class.virtual_time;
        let state = class.flows.entry(flow.key).or_insert(FlowState {
            finish: v,
            waiting: 0,
        });
        let start = state.finish.max(v);
        let finish = start + u128::from(cost.max(1)) * SCALE / u128::from(flow.weight.max(1));
        state.finish = finish;
        state.waiting += 1;
        finish
    }

    /// A request of `key` with tag `tag` comes back to its place (it left to ask a store).
    pub(crate) fn rejoin(&mut self, class: usize, key: u64, tag: u128) {
        let class = &mut self.classes[class];
        let state = class.flows.entry(key).or_insert(FlowState {
            finish: tag,
            waiting: 0,
        });
        state.finish = state.finish.max(tag);
        state.waiting += 1;
    }

    /// A request of `key` with tag `tag` leaves class `class`; `served` when it was the front
    /// (so it is the one served: the virtual time moves to its tag).
    pub(crate) fn leave(&mut self, class: usize, key: u64, tag: u128, served: bool) {
        let class = &mut self.classes[class];
        if served {
            class.virtual_time = class.virtual_time.max(tag);
        }
        if let Some(state) = class.flows.get_mut(&key) {
            state.waiting -= 1;
            if state.waiting == 0 {
                class.flows.remove(&key);
            }
        }
    }

    /// How many flows hold state.
    #[cfg(test)]
    pub(crate) fn flows(&self) -> usize {
        self.classes.iter().map(|c| c.flows.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(key: u64, weight: u32) -> Flow {
        Flow {
            key,
            weight,
            below_guarantee: false,
        }
    }

    /// Serves `n` requests from two always-backlogged flows of weights 3 and 1, the second
    /// with costs ten times larger, and returns the tokens each got.
    fn serve(n: usize) -> (u64, u64) {
        let mut clock = FairClock::default();
        let (a, b) = (flow(1, 3), flow(2, 1));
        let mut waiting: Vec<(u128, u64, u64)> = Vec::new();
        for _ in 0..2 {
            waiting.push((clock.join(0, a, 100), 1, 100));
            waiting.push((clock.join(0, b, 1_000), 2, 1_000));
        }
        let mut got = (0, 0);
        for _ in 0..n {
            waiting.sort();
            let (tag, key, cost) = waiting.remove(0);
            clock.leave(0, key, tag, true);
            let (f, c) = if key == 1 { (a, 100) } else { (b, 1_000) };
            if key == 1 {
                got.0 += cost;
            } else {
                got.1 += cost;
            }
            waiting.push((clock.join(0, f, c), key, c));
        }
        got
    }

    #[test]
    fn shares_follow_weights_over_token_cost_within_the_bound() {
        let (a, b) = serve(10_000);
        // |S_a/3 - S_b/1| <= 100/3 + 1000/1.
        let drift = (a as f64 / 3.0 - b as f64).abs();
        assert!(drift <= 100.0 / 3.0 + 1_000.0, "{a} {b}");
        let share = a as f64 / (a + b) as f64;
        assert!((share - 0.75).abs() < 0.005, "{share}");
    }

    #[test]
    fn a_returning_flow_starts_at_the_virtual_time() {
        let mut clock = FairClock::default();
        let busy = flow(1, 1);
        let mut last = 0;
        for _ in 0..100 {
            last = clock.join(0, busy, 10);
        }
        // 50 of them served: V is the 50th tag.
        let v = 50 * 10 * SCALE;
        clock.leave(0, 1, v, true);
        // A flow idle until now goes ahead of the busy flow's backlog.
        let back = clock.join(0, flow(2, 1), 10);
        assert_eq!(back, v + 10 * SCALE);
        assert!(back < last);
        clock.leave(0, 2, back, true);
        assert_eq!(clock.flows(), 1, "an idle flow holds no state");
    }
}
