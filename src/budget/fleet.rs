//! How an account is divided between the processes that lease shares of it
//! ([`RedisBudget::leased_shares`](crate::budget::redis::RedisBudget::leased_shares)): the
//! arithmetic the store's lease script runs, as plain functions, for capacity planning and
//! simulation (the crate's fleet model runs on them, and its tests check the script against
//! them).
//!
//! Each process claims a fraction of the account (all of it while requests wait, else what it
//! spent of late with a margin) and names its flows with requests waiting (a tenant, or all of
//! a process's requests without tenants), each with its weight. A flow waiting in several
//! processes spreads its weight evenly over them; a process weighs the sum of its flows' parts
//! (1 when none waits). The account goes by weighted max-min fairness: nobody gets more than
//! it claims, those claiming more share the rest by weight, and what nobody claims is spread
//! over everyone by weight. A tenant's guarantee (its share of the account, as in memory)
//! lifts the processes where it waits: a process is owed, of what it claims, the guarantees
//! waiting in it, each spread evenly over the processes where it waits; one whose weighted
//! part falls below what it is owed gets that instead, and the others share the rest by
//! weight. A process is then granted its part less what the others hold beyond theirs, so
//! that the shares held never add up to more than one.
//!
//! ```
//! use tower_llm_quota::budget::fleet::{Claim, divide};
//!
//! // Tenant 1 (weight 1) waits in the first process only, tenant 2 (weight 1) in both.
//! let first = Claim::new(1.0).with_flow(1, 1).with_flow(2, 1);
//! let second = Claim::new(1.0).with_flow(2, 1);
//! let parts = divide(&[first, second]);
//! // Tenant 1 gets half in the first process; tenant 2 a quarter in each.
//! assert!((parts[0] - 0.75).abs() < 1e-9 && (parts[1] - 0.25).abs() < 1e-9);
//!
//! // Tenant 1 is guaranteed 90 % of the account: the first process gets it.
//! let first = Claim::new(1.0).with_flow(1, 1).with_guarantee(1, 900_000).with_flow(2, 1);
//! let parts = divide(&[first, Claim::new(1.0).with_flow(2, 1)]);
//! assert!((parts[0] - 0.9).abs() < 1e-9 && (parts[1] - 0.1).abs() < 1e-9);
//! ```

use std::collections::{BTreeMap, HashMap};

/// What a process claims of the account at a renewal.
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    want: f64,
    flows: Vec<(u64, u32)>,
    guarantees: Vec<(u64, u32)>,
}

impl Claim {
    /// A claim of `want` of the account (clamped to `[0, 1]`; NaN claims nothing).
    pub fn new(want: f64) -> Self {
        let want = if want.is_nan() {
            0.0
        } else {
            want.clamp(0.0, 1.0)
        };
        Self {
            want,
            flows: Vec::new(),
            guarantees: Vec::new(),
        }
    }

    /// With a flow `key` of `weight` (0 counts as 1) waiting in this process.
    pub fn with_flow(mut self, key: u64, weight: u32) -> Self {
        self.flows.push((key, weight.max(1)));
        self
    }

    /// With a guarantee `key` (a tenant node with a guarantee) of `share_ppm` millionths of
    /// the account (at most a million), with requests waiting in this process.
    pub fn with_guarantee(mut self, key: u64, share_ppm: u32) -> Self {
        self.guarantees.push((key, share_ppm.min(1_000_000)));
        self
    }

    /// The guarantees waiting, with their shares in millionths.
    pub fn guarantees(&self) -> &[(u64, u32)] {
        &self.guarantees
    }

    /// The fraction of the account claimed.
    pub fn want(&self) -> f64 {
        self.want
    }

    /// The flows waiting, with their weights.
    pub fn flows(&self) -> &[(u64, u32)] {
        &self.flows
    }
}

/// In how many of `claims` each flow waits.
pub fn spread(claims: &[Claim]) -> HashMap<u64, u32> {
    count(claims.iter().flat_map(|claim| &claim.flows))
}

/// In how many of `claims` each guarantee waits.
pub fn guarantee_spread(claims: &[Claim]) -> HashMap<u64, u32> {
    count(claims.iter().flat_map(|claim| &claim.guarantees))
}

fn count<'a>(keys: impl Iterator<Item = &'a (u64, u32)>) -> HashMap<u64, u32> {
    let mut spread = HashMap::new();
    for &(key, _) in keys {
        *spread.entry(key).or_insert(0) += 1;
    }
    spread
}

/// What each of `claims` is owed: of what it claims, the guarantees waiting in it, each
/// divided by the number of claims it waits in; scaled down together should they add up to
/// more than the account.
pub fn owed(claims: &[Claim]) -> Vec<f64> {
    let spread = guarantee_spread(claims);
    let mut owed: Vec<f64> = claims
        .iter()
        .map(|claim| {
            let guaranteed: f64 = (claim.guarantees.iter())
                .map(|(key, ppm)| f64::from(*ppm) / 1e6 / f64::from(spread[key]))
                .sum();
            guaranteed.min(claim.want)
        })
        .collect();
    let total: f64 = owed.iter().sum();
    if total > 1.0 {
        owed.iter_mut().for_each(|o| *o /= total);
    }
    owed
}

/// What each of `claims` weighs: the sum of its flows' weights, each divided by the number of
/// claims it waits in; 1 without flows.
pub fn weights(claims: &[Claim]) -> Vec<f64> {
    let spread = spread(claims);
    claims
        .iter()
        .map(|claim| match claim.flows.is_empty() {
            true => 1.0,
            false => claim
                .flows
                .iter()
                .map(|(key, weight)| f64::from(*weight) / f64::from(spread[key]))
                .sum(),
        })
        .collect()
}

/// Each claim's part of the account: weighted max-min fairness on the claims, each lifted to
/// what it is owed ([`owed`]) when its weighted part is less (the others sharing the rest),
/// then what nobody claimed spread by weight. The parts add up to one (for any claim at all).
pub fn divide(claims: &[Claim]) -> Vec<f64> {
    let weights = weights(claims);
    let owed = owed(claims);
    let mut lifted = vec![false; claims.len()];
    loop {
        let left = 1.0
            - (0..claims.len())
                .filter(|&i| lifted[i])
                .map(|i| owed[i])
                .sum::<f64>();
        let others: Vec<usize> = (0..claims.len()).filter(|&i| !lifted[i]).collect();
        let (mut parts, left) = max_min(claims, &weights, &others, left);
        for i in (0..claims.len()).filter(|&i| lifted[i]) {
            parts[i] = owed[i];
        }
        // Those whose part falls short of what they are owed are lifted to it, and the rest
        // shared again.
        let short: Vec<usize> = others
            .into_iter()
            .filter(|&i| parts[i] + 1e-12 < owed[i])
            .collect();
        if short.is_empty() {
            if left > 1e-9 {
                let total: f64 = weights.iter().sum();
                for (part, weight) in parts.iter_mut().zip(&weights) {
                    *part += left * weight / total;
                }
            }
            return parts;
        }
        short.into_iter().for_each(|i| lifted[i] = true);
    }
}

/// Weighted max-min fairness of `left` over the `members` of `claims` that claim something:
/// their parts (0 for the others), and what is left once every claim is met.
fn max_min(claims: &[Claim], weights: &[f64], members: &[usize], mut left: f64) -> (Vec<f64>, f64) {
    let mut parts = vec![0.0; claims.len()];
    let mut wanting: Vec<usize> = members
        .iter()
        .copied()
        .filter(|&i| claims[i].want > 0.0)
        .collect();
    while !wanting.is_empty() && left > 1e-9 {
        let per_weight = left / wanting.iter().map(|&i| weights[i]).sum::<f64>();
        let mut still = Vec::new();
        let mut satisfied = false;
        for &i in &wanting {
            let need = claims[i].want - parts[i];
            if need <= per_weight * weights[i] {
                parts[i] = claims[i].want;
                left -= need;
                satisfied = true;
            } else {
                still.push(i);
            }
        }
        if !satisfied {
            for &i in &still {
                parts[i] += per_weight * weights[i];
            }
            left = 0.0;
            still.clear();
        }
        wanting = still;
    }
    (parts, left.max(0.0))
}

/// What a process whose part is `part` is granted while the others hold `others` in all, in
/// millionths of the account (whole numbers, so that sums never drift): its part rounded
/// down, less what they hold beyond theirs.
pub fn grant(part: f64, others: u64) -> u64 {
    // After a thousandth of a millionth, for a fraction's last binary digit (0.4 is a hair
    // below 0.4 in binary).
    let part = (part.clamp(0.0, 1.0) * 1e6 + 0.001).floor() as u64;
    part.min(1_000_000u64.saturating_sub(others))
}

/// The store's book of leases, as the lease script keeps it: every process's entry (an
/// expired one stays until the next division), when the account was last divided, the sum of
/// the shares held (in millionths), and each flow's spread at that division. Times are
/// milliseconds on the store's clock.
#[derive(Debug, Clone)]
pub struct Ledger {
    entries: BTreeMap<u64, Entry>,
    divided: Option<u64>,
    held: u64,
    spread: HashMap<u64, u32>,
    guarantee_spread: HashMap<u64, u32>,
    lease: u64,
    every: u64,
    divisions: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    held: u64,
    part: f64,
    claim: Claim,
    ends: u64,
}

/// A renewal's answer: the share granted, in millionths of the account, and the spread of
/// each flow, then of each guarantee, of the claim (1 for one unknown at the last division).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    /// The share, in millionths.
    pub share: u64,
    /// Per flow of the claim, then per guarantee, in how many processes it waited at the
    /// last division.
    pub spread: Vec<u32>,
}

impl Ledger {
    /// A book whose leases last `lease` ms, dividing the account anew every `every` ms.
    pub fn new(lease: u64, every: u64) -> Self {
        Self {
            entries: BTreeMap::new(),
            divided: None,
            held: 0,
            spread: HashMap::new(),
            guarantee_spread: HashMap::new(),
            lease,
            every,
            divisions: 0,
        }
    }

    /// `process` renews with `claim` at `now`: the account is divided anew when the last
    /// division is `every` old (a process that just came has no part before the next); then
    /// it is granted its part, less what the others hold.
    pub fn lease(&mut self, process: u64, claim: Claim, now: u64) -> Granted {
        let lease = self.lease;
        let entry = self.entries.entry(process).or_insert(Entry {
            held: 0,
            part: 0.0,
            claim: claim.clone(),
            ends: 0,
        });
        (entry.claim, entry.ends) = (claim, now.saturating_add(lease));
        if self
            .divided
            .is_none_or(|at| now.saturating_sub(at) >= self.every || now < at)
        {
            self.divide(now);
        }
        let entry = self.entries.get_mut(&process).expect("entered above");
        let others = self.held.saturating_sub(entry.held);
        entry.held = grant(entry.part, others);
        self.held = others + entry.held;
        let flows = (entry.claim.flows.iter()).map(|(key, _)| self.spread.get(key));
        let guarantees =
            (entry.claim.guarantees.iter()).map(|(key, _)| self.guarantee_spread.get(key));
        let spread = flows
            .chain(guarantees)
            .map(|n| n.copied().unwrap_or(1))
            .collect();
        Granted {
            share: entry.held,
            spread,
        }
    }

    /// `process` leaves, giving its share back.
    pub fn leave(&mut self, process: u64) {
        if let Some(entry) = self.entries.remove(&process) {
            self.held = self.held.saturating_sub(entry.held);
        }
    }

    /// The sum of the shares held, in millionths: never above a million.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// How many times the account was divided: each division reads and rewrites every
    /// lease, the store's costly call.
    pub fn divisions(&self) -> u64 {
        self.divisions
    }

    fn divide(&mut self, now: u64) {
        self.entries.retain(|_, entry| entry.ends > now);
        let claims: Vec<Claim> = self.entries.values().map(|e| e.claim.clone()).collect();
        for (entry, part) in self.entries.values_mut().zip(divide(&claims)) {
            entry.part = part;
        }
        self.spread = spread(&claims);
        self.guarantee_spread = guarantee_spread(&claims);
        self.held = self.entries.values().map(|e| e.held).sum();
        self.divided = Some(now);
        self.divisions += 1;
    }
}

/// Jain's fairness index of `allocations`: 1 when they are all equal, `1 / n` when one has
/// everything. 1 for none.
pub fn jain_index(allocations: &[f64]) -> f64 {
    let sum: f64 = allocations.iter().sum();
    let squares: f64 = allocations.iter().map(|x| x * x).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (allocations.len() as f64 * squares)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn equal_claims_share_equally() {
        let claims = vec![Claim::new(1.0).with_flow(0, 1); 4];
        assert!(divide(&claims).iter().all(|&p| close(p, 0.25)));
    }

    #[test]
    fn a_small_claim_gets_what_it_claims_and_the_others_the_rest() {
        let claims = [
            Claim::new(0.1),
            Claim::new(1.0).with_flow(0, 1),
            Claim::new(1.0).with_flow(0, 1),
        ];
        let parts = divide(&claims);
        assert!(close(parts[0], 0.1) && close(parts[1], 0.45) && close(parts[2], 0.45));
    }

    #[test]
    fn what_nobody_claims_is_spread_by_weight() {
        let parts = divide(&[Claim::new(0.2), Claim::new(0.0)]);
        assert!(close(parts[0], 0.6) && close(parts[1], 0.4), "{parts:?}");
        assert!(divide(&[]).is_empty());
    }

    #[test]
    fn weights_hold_over_the_fleet_whatever_the_spread() {
        // Tenant 1 (weight 3) in the first process, tenant 2 (weight 1) in both.
        let claims = [
            Claim::new(1.0).with_flow(1, 3).with_flow(2, 1),
            Claim::new(1.0).with_flow(2, 1),
        ];
        assert_eq!(weights(&claims), [3.5, 0.5]);
        let parts = divide(&claims);
        assert!(close(parts[0], 0.875) && close(parts[1], 0.125));
    }

    #[test]
    fn a_guarantee_lifts_the_processes_where_it_waits() {
        // Tenant 1 (weight 1, guaranteed 60 %) in the first process; tenant 2 (weight 3) in
        // both: by weight the first would get 1 + 1.5 of 4 = 62.5 %, above what it is owed.
        let claims = |g| {
            [
                Claim::new(1.0)
                    .with_flow(1, 1)
                    .with_guarantee(1, g)
                    .with_flow(2, 3),
                Claim::new(1.0).with_flow(2, 3),
            ]
        };
        assert!(close(divide(&claims(600_000))[0], 0.625));
        // Guaranteed 80 %: lifted to it, the second gets the rest.
        let parts = divide(&claims(800_000));
        assert!(close(parts[0], 0.8) && close(parts[1], 0.2), "{parts:?}");
        // A guarantee waiting in both processes is owed half in each.
        let both = [
            Claim::new(1.0).with_flow(1, 1).with_guarantee(1, 800_000),
            Claim::new(1.0)
                .with_flow(1, 1)
                .with_guarantee(1, 800_000)
                .with_flow(2, 8),
        ];
        assert_eq!(owed(&both), [0.4, 0.4]);
        let parts = divide(&both);
        assert!(close(parts[0], 0.4) && close(parts[1], 0.6), "{parts:?}");
        // Never more than claimed; guarantees over the whole are scaled down together.
        assert_eq!(owed(&[Claim::new(0.1).with_guarantee(1, 900_000)]), [0.1]);
        let over = [
            Claim::new(1.0).with_guarantee(1, 900_000),
            Claim::new(1.0).with_guarantee(2, 900_000),
        ];
        assert_eq!(owed(&over), [0.5, 0.5]);
        assert!(close(divide(&over).iter().sum(), 1.0));
    }

    #[test]
    fn a_grant_never_takes_what_others_hold() {
        assert_eq!(grant(0.5, 750_000), 250_000);
        assert_eq!(grant(0.5, 1_200_000), 0);
        assert_eq!(grant(0.3333333333, 0), 333_333);
    }

    #[test]
    fn nan_and_out_of_range_claims_are_clamped() {
        assert_eq!(Claim::new(f64::NAN).want(), 0.0);
        assert_eq!(Claim::new(7.0).want(), 1.0);
        assert_eq!(Claim::new(-1.0).want(), 0.0);
    }

    #[test]
    fn jain_is_one_when_equal_and_one_over_n_when_one_has_all() {
        assert!(close(jain_index(&[2.0, 2.0, 2.0]), 1.0));
        assert!(close(jain_index(&[1.0, 0.0, 0.0, 0.0]), 0.25));
    }
}
