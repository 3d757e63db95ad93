//! How an account is divided between the processes that lease shares of it
//! (`RedisBudget::leased_shares`, or any store's [`StoreOptions::leased_shares`](super::StoreOptions::leased_shares)): the
//! arithmetic the store's lease script runs, as plain functions, for capacity planning and
//! simulation (the crate's fleet model runs on them, and its tests check the script against
//! them).
//!
//! Each process claims a fraction of the account (all of it while requests wait, else what it
//! spent of late with a margin) and names its flows with requests waiting (a tenant, or all of
//! a process's requests without tenants), each with its weight, and its waiting guarantees.
//!
//! The account is divided by tenant first, whatever the processes: every waiting flow gets
//! its weighted part of the account, and a flow with a guarantee of its own is lifted to it
//! when that part is less, the others sharing the rest by weight ([`allocate`]), as one
//! process would serve them. A flow's part is spread evenly over the processes where it
//! waits, and a process weighs what its flows' parts add up to (1 when none waits). Each
//! process serves its flows by their parts there ([`local_weights`], told with every
//! renewal), so a tenant alone on a process gets no more than a tenant spread over several.
//! A guarantee of a node above the flows (no flow's own) lifts the processes where it waits:
//! a process is owed, of what it claims, those guarantees, each spread evenly over the
//! processes where it waits. The account then goes to the processes by weighted max-min
//! fairness: nobody gets more than it claims (or less than it is owed), those claiming more
//! share the rest by weight, and what nobody claims is spread over everyone by weight. A
//! process is then granted its part less what the others hold beyond theirs, so that the
//! shares held never add up to more than one.
//!
//! ```
//! use tower_llm_quota::budget::store::fleet::{Claim, divide};
//!
//! // Tenant 1 (weight 1) waits in the first process only, tenant 2 (weight 1) in both.
//! let first = Claim::new(1.0).with_flow(1, 1).with_flow(2, 1);
//! let second = Claim::new(1.0).with_flow(2, 1);
//! let parts = divide(&[first, second]);
//! // Tenant 1 gets half in the first process; tenant 2 a quarter in each.
//! assert!((parts[0] - 0.75).abs() < 1e-9 && (parts[1] - 0.25).abs() < 1e-9);
//!
//! // Tenant 1 is guaranteed 90 % of the account: it gets it in the first process, and
//! // tenant 2 the rest, half in each.
//! let first = Claim::new(1.0).with_flow(1, 1).with_guarantee(1, 900_000).with_flow(2, 1);
//! let parts = divide(&[first, Claim::new(1.0).with_flow(2, 1)]);
//! assert!((parts[0] - 0.95).abs() < 1e-9 && (parts[1] - 0.05).abs() < 1e-9);
//! ```

use std::collections::{BTreeMap, HashMap};

use crate::quota::Limit;

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

/// The scale of the flows' weights in a process ([`local_weights`]): divisible by every
/// spread up to 8 (and most beyond), so that a weight divided by its spread stays exact
/// enough as an integer.
pub const LOCAL_SCALE: u32 = 840;

/// Each flow's part of the account with every waiting flow backlogged: weighted max-min
/// fairness over the flows (by tenant, whatever the processes they wait in), each flow
/// with a guarantee of its own (a guarantee whose key is the flow's) lifted to it when its
/// weighted part is less, the others sharing the rest by weight (guarantees adding up to
/// more than the account scaled down together). A flow's weight and guarantee are the
/// largest any claim tells. Returns the parts by flow, and the flows' total weight.
pub fn allocate(claims: &[Claim]) -> (BTreeMap<u64, f64>, f64) {
    let mut flows: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for &(key, weight) in claims.iter().flat_map(|c| &c.flows) {
        let entry = flows.entry(key).or_insert((0.0, 0.0));
        entry.0 = entry.0.max(f64::from(weight.max(1)));
    }
    for &(key, ppm) in claims.iter().flat_map(|c| &c.guarantees) {
        if let Some(entry) = flows.get_mut(&key) {
            entry.1 = entry.1.max(f64::from(ppm) / 1e6);
        }
    }
    let floors: f64 = flows.values().map(|f| f.1).sum();
    if floors > 1.0 {
        flows.values_mut().for_each(|f| f.1 /= floors);
    }
    let total: f64 = flows.values().map(|f| f.0).sum();
    let mut lifted: BTreeMap<u64, bool> = flows.keys().map(|&k| (k, false)).collect();
    loop {
        let left = 1.0
            - (flows.iter())
                .filter(|(k, _)| lifted[*k])
                .map(|(_, f)| f.1)
                .sum::<f64>();
        let weight: f64 = (flows.iter())
            .filter(|(k, _)| !lifted[*k])
            .map(|(_, f)| f.0)
            .sum();
        let parts: BTreeMap<u64, f64> = (flows.iter())
            .map(|(&k, f)| match lifted[&k] {
                true => (k, f.1),
                false => (k, left.max(0.0) * f.0 / weight),
            })
            .collect();
        let short: Vec<u64> = (flows.iter())
            .filter(|(k, f)| !lifted[*k] && parts[*k] + 1e-12 < f.1)
            .map(|(&k, _)| k)
            .collect();
        if short.is_empty() {
            return (parts, total);
        }
        for key in short {
            lifted.insert(key, true);
        }
    }
}

/// Each flow's weight in the processes where it waits: its part of the account
/// ([`allocate`]) over the number of processes where it waits, in units of the flows' total
/// weight times [`LOCAL_SCALE`] (with no guarantee lifted: its weight times the scale over its
/// spread). A process serving its flows by these weights gives each its part.
pub fn local_weights(claims: &[Claim]) -> HashMap<u64, u32> {
    let spread = spread(claims);
    let (parts, total) = allocate(claims);
    (parts.into_iter())
        .map(|(key, part)| {
            let weight = part * total * f64::from(LOCAL_SCALE) / f64::from(spread[&key]);
            (key, ((weight + 0.5).floor() as u32).max(1))
        })
        .collect()
}

/// What each of `claims` is owed: of what it claims, the guarantees waiting in it that are
/// no flow's own ([`allocate`] lifts those), each divided by the number of claims it waits
/// in; scaled down together should they add up to more than the account.
pub fn owed(claims: &[Claim]) -> Vec<f64> {
    let spread = guarantee_spread(claims);
    let flows = self::spread(claims);
    let mut owed: Vec<f64> = claims
        .iter()
        .map(|claim| {
            let guaranteed: f64 = (claim.guarantees.iter())
                .filter(|(key, _)| !flows.contains_key(key))
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

/// The least a process with flows weighs (its flows may get nothing: guarantees took all).
const LEAST_WEIGHT: f64 = 1e-6;

/// What each of `claims` weighs: its flows' parts of the account ([`allocate`]), each over
/// the number of claims it waits in, times the flows' total weight (with no guarantee lifted:
/// the sum of its flows' weights, each over its spread), a millionth at least; 1 without
/// flows.
pub fn weights(claims: &[Claim]) -> Vec<f64> {
    let spread = spread(claims);
    let (parts, total) = allocate(claims);
    claims
        .iter()
        .map(|claim| match claim.flows.is_empty() {
            true => 1.0,
            false => (claim.flows.iter())
                .map(|(key, _)| parts[key] * total / f64::from(spread[key]))
                .sum::<f64>()
                .max(LEAST_WEIGHT),
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

/// One limit of the account as the store keeps it: a bucket refilled by `num` units every
/// `den` milliseconds up to `capacity` units, less what leases hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Account {
    /// Units added per `den` milliseconds.
    pub num: u64,
    /// Milliseconds per `num` units (ticks of a unit).
    pub den: u64,
    /// The burst: the most the bucket and the leases together hold.
    pub capacity: u64,
}

/// A bucket's ticks, a debt of one capacity included, stay below this: a store computing in
/// doubles (Lua, PL/pgSQL) then computes exactly.
const MAX_TICKS: u64 = 1 << 51;

impl Account {
    /// `limit` in a store's integer arithmetic: its rate reduced to lowest terms (a unit is
    /// `den` ticks, a millisecond adds `num` ticks, so refill never drifts), its burst the
    /// capacity. A denominator too fine for doubles is made coarser, the rate rounded down
    /// (slower, never faster, than the limit).
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use tower_llm_quota::budget::store::fleet::Account;
    /// use tower_llm_quota::{Dimension, Limit};
    ///
    /// // 500 requests a minute at 85 %: 425 per 60,000 ms, 17 per 2,400 ms.
    /// let rpm = Limit::per_minute(Dimension::Requests, NonZeroU64::new(500).unwrap())
    ///     .with_headroom(0.85)
    ///     .unwrap();
    /// let account = Account::of(&rpm);
    /// assert_eq!((account.num, account.den, account.capacity), (17, 2_400, 71));
    /// ```
    pub fn of(limit: &Limit) -> Self {
        let amount = limit.effective_amount().max(1);
        let period_ms = u64::try_from(limit.period().as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let g = gcd(amount, period_ms);
        let (mut num, mut den) = (amount / g, period_ms / g);
        let capacity = limit.capacity();
        if capacity.saturating_mul(den) > MAX_TICKS {
            let coarse = (MAX_TICKS / capacity.max(1)).max(1);
            let scaled = u128::from(num) * u128::from(coarse) / u128::from(den);
            num = u64::try_from(scaled).unwrap_or(u64::MAX).max(1);
            den = coarse;
        }
        Self { num, den, capacity }
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// A leasing process's report on one limit at a renewal: what it keeps, gives back and asks
/// for (see [`Report::of`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    /// The units it keeps of what it held; negative: a debt (real usage beyond the estimates)
    /// that the store charges to the account.
    pub keep: i64,
    /// The units it gives back (it holds them no more).
    pub back: u64,
    /// The units its first waiting request lacks: granted whole, or not at all.
    pub need: u64,
    /// The units it would like beyond its need.
    pub ask: u64,
}

impl Report {
    /// What a process reports on a limit of `capacity` units, its wallet holding `level`
    /// (negative: in debt), its `part` of the account at the last division, having spent
    /// `spent` over the last `elapsed` refreshes (a fraction, or more than one): it keeps what
    /// it expects to spend before the next renewal (twice that pace, and at least its part
    /// of the capacity, a tenth at most, so that a burst after a quiet spell starts at once,
    /// in memory; the whole capacity
    /// while requests wait and what it holds covers the first), gives back the rest, and asks
    /// for what it keeps to be topped up to that. With its first waiting request lacking units
    /// (`blocked`, that request's cost here) or its lease ended (`closed`), it keeps nothing but
    /// a debt, and asks for the cost whole.
    ///
    /// ```
    /// use tower_llm_quota::budget::store::fleet::Report;
    ///
    /// // 40 spent over the last refresh, 100 held, a tenth of a burst of 1,000 its part: it
    /// // keeps 100 and gives nothing back; with 10 spent, it keeps its part (a tenth at most).
    /// let steady = Report::of(100, (1_000, 0.1), 40, 1.0, (false, None, false));
    /// assert_eq!((steady.keep, steady.back, steady.need, steady.ask), (100, 0, 0, 0));
    /// let quiet = Report::of(300, (1_000, 0.1), 10, 1.0, (false, None, false));
    /// assert_eq!((quiet.keep, quiet.back, quiet.ask), (100, 200, 0));
    /// // Its first request (300) is not covered: it gives back all and asks for 300 whole.
    /// let blocked = Report::of(100, (1_000, 0.1), 40, 1.0, (true, Some(300), false));
    /// assert_eq!((blocked.keep, blocked.back, blocked.need, blocked.ask), (0, 100, 300, 100));
    /// ```
    pub fn of(
        level: i64,
        (capacity, part): (u64, f64),
        spent: u64,
        elapsed: f64,
        (waiting, blocked, closed): (bool, Option<u64>, bool),
    ) -> Self {
        let expected = match elapsed > 0.0 {
            true => 2.0 * spent as f64 / elapsed,
            false => 0.0,
        };
        // What it holds in a quiet spell: its part of the burst, a tenth at most.
        let standing = (part.clamp(0.0, 0.1) * capacity as f64).floor();
        let target = match waiting && blocked.is_none() {
            true => capacity,
            false => (expected.ceil().max(standing) as u64).min(capacity),
        };
        let keep = match blocked.is_some() || closed {
            true => level.min(0),
            false => level.min(i64::try_from(target).unwrap_or(i64::MAX)),
        };
        let kept = u64::try_from(keep).unwrap_or(0);
        Self {
            keep,
            back: u64::try_from(level).unwrap_or(0) - kept,
            need: blocked.map_or(0, |cost| cost.min(capacity)),
            ask: target.saturating_sub(kept),
        }
    }
}

/// How the store answered a renewal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A later renewal of the process was seen first: nothing changed.
    Stale,
    /// The process left.
    Left,
    /// Renewed (`known`: the store knew the process): its part in millionths, the units
    /// granted (taken from the bucket), and for each flow of the claim its weight in the
    /// process ([`local_weights`]; 0 for one unknown at the last division), then for each
    /// guarantee the number of processes where it waited (1 for one unknown).
    Granted {
        /// The store knew the process.
        known: bool,
        /// Its part of the account at the last division, in millionths.
        part: u64,
        /// The units granted.
        granted: u64,
        /// A need not granted: how soon (ms) the bucket, or the process's credit, should
        /// cover it (0 when granted).
        ready: u64,
        /// Per flow its weight in the process, then per guarantee in how many processes it
        /// waited.
        spread: Vec<u32>,
    },
}

/// The store's book of leases on one limit, as the lease script keeps it (the same
/// arithmetic, in the same order, so that the script can be checked against it): the bucket,
/// what each process holds of it and its credit, every process's entry (an expired one stays
/// until the next division), when the account was last divided, and each flow's weight in the
/// processes then.
/// Times are milliseconds on the store's clock.
///
/// Granting is a debit: units leave the bucket when granted and are held by the process until
/// it reports them spent or gives them back, or its lease ends (then they are lost, never
/// granted twice). The bucket refills to its capacity less what is held, so the bucket and the
/// leases together never hold more than the capacity ([`Ledger::holds_at_most_the_burst`]).
#[derive(Debug, Clone)]
pub struct Ledger {
    account: Account,
    /// The bucket's level in ticks (`den` a unit) and the instant it was refilled to.
    tok: f64,
    ts: u64,
    /// What the leases hold, in units.
    held: f64,
    entries: BTreeMap<u64, Entry>,
    /// Per process, what it holds and its credit (thousandths of a unit).
    holdings: BTreeMap<u64, (f64, f64)>,
    credits: f64,
    divided: Option<u64>,
    local: HashMap<u64, u32>,
    guarantee_spread: HashMap<u64, u32>,
    lease: u64,
    every: u64,
    divisions: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    part: f64,
    claim: Claim,
    ends: u64,
    seq: u64,
    at: u64,
}

impl Ledger {
    /// A book of `account` whose leases last `lease` ms, dividing the account anew every
    /// `every` ms. The bucket starts full.
    pub fn new(account: Account, lease: u64, every: u64) -> Self {
        Self {
            tok: (account.capacity * account.den) as f64,
            ts: 0,
            held: 0.0,
            account,
            entries: BTreeMap::new(),
            holdings: BTreeMap::new(),
            credits: 0.0,
            divided: None,
            local: HashMap::new(),
            guarantee_spread: HashMap::new(),
            lease,
            every,
            divisions: 0,
        }
    }

    fn full(&self) -> f64 {
        (self.account.capacity * self.account.den) as f64
    }

    /// Refills the bucket to `now` (as `load` in the store): never above the capacity less
    /// what is held; time going back adds nothing.
    fn refill(&mut self, now: u64) {
        let (num, den) = (self.account.num as f64, self.account.den as f64);
        let top = self.full() - self.held * den;
        self.tok = self.tok.min(top);
        if now > self.ts {
            let deficit = top - self.tok;
            if deficit > 0.0 {
                let dt = (now - self.ts) as f64;
                self.tok = match dt > deficit / num {
                    true => top,
                    false => top.min(self.tok + dt * num),
                };
            }
            self.ts = now;
        }
    }

    /// Applies `process`'s report: a debt charged to the bucket, what it keeps held, what it
    /// gives back returned (never above what the leases leave).
    fn report(&mut self, process: u64, renew: &Report, known: bool) {
        let (full, den) = (self.full(), self.account.den as f64);
        let (mine, _) = match known {
            true => self.holdings.get(&process).copied().unwrap_or((0.0, 0.0)),
            false => (0.0, 0.0),
        };
        if renew.keep < 0 {
            self.tok = (self.tok + renew.keep as f64 * den).max(self.tok.min(-full));
        }
        let kept = renew.keep.max(0) as f64;
        self.held = (self.held - mine + kept).max(0.0);
        let entry = self.holdings.entry(process).or_insert((0.0, 0.0));
        if !known {
            *entry = (0.0, 0.0);
        }
        entry.0 = kept;
        self.tok = (self.tok + renew.back as f64 * den).min(full - self.held * den);
    }

    /// `process` renews with `claim` and its renewal numbered `seq` reporting `renew` at
    /// `now`. The account is divided anew when
    /// the last division is `every` old; the process's part in millionths is then
    /// `part(its part as divided here)` (a checker may hand in the store's own, which sums
    /// the same fractions in another order); its credit grows, and it is granted.
    pub fn lease(
        &mut self,
        process: u64,
        claim: Claim,
        (seq, renew): (u64, Report),
        now: u64,
        part: impl FnOnce(u64) -> u64,
    ) -> Answer {
        if self.entries.get(&process).is_some_and(|e| seq <= e.seq) {
            return Answer::Stale;
        }
        self.refill(now);
        let known = self.entries.contains_key(&process);
        self.report(process, &renew, known);
        let lease = self.lease;
        let entry = self.entries.entry(process).or_insert(Entry {
            part: 0.0,
            claim: claim.clone(),
            ends: 0,
            seq: 0,
            at: now,
        });
        (entry.claim, entry.ends, entry.seq) = (claim, now.saturating_add(lease), seq);
        if self
            .divided
            .is_none_or(|at| now.saturating_sub(at) >= self.every || now < at)
        {
            self.divide(now, process);
        }
        let entry = self.entries.get_mut(&process).expect("entered above");
        let ppm = part((entry.part * 1e6 + 0.5).floor() as u64);
        let share = ppm as f64 / 1e6;
        let since = now.saturating_sub(entry.at) as f64;
        entry.at = now;
        let flows =
            (entry.claim.flows.iter()).map(|(key, _)| self.local.get(key).copied().unwrap_or(0));
        let guarantees = (entry.claim.guarantees.iter())
            .map(|(key, _)| self.guarantee_spread.get(key).copied().unwrap_or(1));
        let spread = flows.chain(guarantees).collect();
        let (granted, ready) = self.grant(process, &renew, share, since);
        Answer::Granted {
            known,
            part: ppm,
            granted,
            ready,
            spread,
        }
    }

    /// Grows `process`'s credit by its `share` of the rate over `since` ms (and what it gave
    /// back), then grants it (as the script does): its need whole, then up to its ask, from
    /// its credit and what the others' credits do not claim (all of the bucket when it is
    /// full). The units granted, and when a need not granted should be covered (ms).
    fn grant(&mut self, process: u64, renew: &Report, share: f64, since: f64) -> (u64, u64) {
        let Account { num, den, capacity } = self.account;
        let (num, den, cap) = (num as f64, den as f64, capacity as f64);
        let holding = self.holdings.entry(process).or_insert((0.0, 0.0));
        let before = holding.1;
        let grown =
            holding.1 + renew.back as f64 * 1000.0 + (share * num / den * since * 1000.0).floor();
        let most = (share * cap * 1000.0)
            .floor()
            .max(renew.need as f64 * 1000.0);
        holding.1 = grown.min(most);
        self.credits = (self.credits - before + holding.1).max(0.0);
        let pool = (self.tok / den).floor().max(0.0);
        let mut unclaimed = (pool - ((self.credits - holding.1) / 1000.0).floor()).max(0.0);
        if self.tok + den > cap * den - self.held * den {
            // The bucket is full: whoever asks may take it.
            unclaimed = pool;
        }
        let may = pool.min((holding.1 / 1000.0).floor() + unclaimed);
        let need = renew.need as f64;
        if need > may {
            let filled = ((need * den - self.tok).max(0.0) / num).ceil();
            let per_ms = share * num / den * 1000.0;
            let owed = match per_ms > 0.0 {
                true => ((need * 1000.0 - holding.1).max(0.0) / per_ms).ceil(),
                false => filled,
            };
            return (0, filled.min(owed) as u64);
        }
        let granted = need + (renew.ask as f64).min(may - need).max(0.0);
        let before = holding.1;
        holding.1 = (holding.1 - granted * 1000.0).max(0.0);
        self.credits = (self.credits - before + holding.1).max(0.0);
        holding.0 += granted;
        self.tok -= granted * den;
        self.held += granted;
        (granted as u64, 0)
    }

    /// `process` leaves at `now` with its last report (a debt charged, what it holds given
    /// back), numbered `seq`.
    pub fn leave(&mut self, process: u64, (seq, renew): (u64, Report), now: u64) -> Answer {
        if self.entries.get(&process).is_some_and(|e| seq <= e.seq) {
            return Answer::Stale;
        }
        self.refill(now);
        let known = self.entries.contains_key(&process);
        let renew = Report {
            keep: renew.keep.min(0),
            ..renew
        };
        self.report(process, &renew, known);
        if let Some((_, credit)) = self.holdings.remove(&process) {
            self.credits = (self.credits - credit).max(0.0);
        }
        self.entries.remove(&process);
        Answer::Left
    }

    /// The bucket's level (whole units, negative in debt) and what the leases hold, at `now`.
    pub fn level(&mut self, now: u64) -> (i64, u64) {
        self.refill(now);
        let level = (self.tok / self.account.den as f64).floor() as i64;
        (level, self.held as u64)
    }

    /// Whether the bucket and the leases together hold at most the burst at `now`: what makes
    /// every window's admissions at most the burst plus the rate over it.
    pub fn holds_at_most_the_burst(&mut self, now: u64) -> bool {
        self.refill(now);
        self.tok + self.held * self.account.den as f64 <= self.full()
    }

    /// How many times the account was divided: each division reads and rewrites every
    /// lease, the store's costly call.
    pub fn divisions(&self) -> u64 {
        self.divisions
    }

    fn divide(&mut self, now: u64, caller: u64) {
        let gone: Vec<u64> = (self.entries.iter())
            .filter(|(_, e)| e.ends <= now)
            .map(|(&p, _)| p)
            .collect();
        for process in gone {
            self.entries.remove(&process);
            if let Some((held, _)) = self.holdings.remove(&process) {
                if process != caller {
                    self.held = (self.held - held).max(0.0);
                }
            }
        }
        self.credits = self.holdings.values().map(|h| h.1).sum();
        let claims: Vec<Claim> = self.entries.values().map(|e| e.claim.clone()).collect();
        for (entry, part) in self.entries.values_mut().zip(divide(&claims)) {
            entry.part = part;
        }
        self.local = local_weights(&claims);
        self.guarantee_spread = guarantee_spread(&claims);
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
    fn a_guarantee_lifts_its_tenant_over_the_fleet() {
        // Tenant 1 (weight 1, guaranteed 60 %) in the first process; tenant 2 (weight 3) in
        // both: by weight tenant 1 would get 25 %; lifted to 60 %, tenant 2 gets 40 %, half
        // in each process.
        let claims = |g| {
            [
                Claim::new(1.0)
                    .with_flow(1, 1)
                    .with_guarantee(1, g)
                    .with_flow(2, 3),
                Claim::new(1.0).with_flow(2, 3),
            ]
        };
        let parts = divide(&claims(600_000));
        assert!(close(parts[0], 0.8) && close(parts[1], 0.2), "{parts:?}");
        // In the first process the tenants are served 60 : 20 (weights in units of the total
        // weight, 4, times the scale).
        let local = local_weights(&claims(600_000));
        assert_eq!((local[&1], local[&2]), (2_016, 672));
        // A guarantee below the weighted part changes nothing.
        let parts = divide(&claims(200_000));
        assert!(close(parts[0], 0.625), "{parts:?}");
        // Never more than the account: guarantees over the whole are scaled down together.
        let over = [Claim::new(1.0)
            .with_flow(1, 1)
            .with_guarantee(1, 900_000)
            .with_flow(2, 1)
            .with_guarantee(2, 900_000)];
        let (parts, _) = allocate(&over);
        assert!(close(parts[&1], 0.5) && close(parts[&2], 0.5));
    }

    /// The case the process-level division got wrong: tenant 0 (weight 2, guaranteed 30 %)
    /// alone on one process with part of tenant 1 (weight 5, guaranteed 20 %), tenants 2 and 3
    /// (weights 1 and 4) spread. By tenant: 30 %, then 70 % by weight 5 : 1 : 4.
    #[test]
    fn tenants_get_their_parts_whatever_the_processes() {
        let claims = [
            Claim::new(1.0).with_flow(2, 1).with_flow(3, 4),
            Claim::new(1.0)
                .with_flow(0, 2)
                .with_guarantee(0, 300_000)
                .with_flow(1, 5)
                .with_guarantee(1, 200_000)
                .with_flow(2, 1),
            Claim::new(1.0)
                .with_flow(1, 5)
                .with_guarantee(1, 200_000)
                .with_flow(2, 1)
                .with_flow(3, 4),
        ];
        let (parts, total) = allocate(&claims);
        let expected = [0.3, 0.35, 0.07, 0.28];
        for (key, part) in expected.iter().enumerate() {
            assert!(close(parts[&(key as u64)], *part), "{parts:?}");
        }
        assert!(close(total, 12.0));
        // Each process serves its flows by their parts there: the tenants' totals are theirs.
        let divided = divide(&claims);
        let local = local_weights(&claims);
        let mut served = [0.0; 4];
        for (claim, part) in claims.iter().zip(&divided) {
            let weight: f64 = claim.flows().iter().map(|(k, _)| f64::from(local[k])).sum();
            for (key, _) in claim.flows() {
                served[*key as usize] += part * f64::from(local[key]) / weight;
            }
        }
        for (got, want) in served.iter().zip(expected) {
            assert!((got - want).abs() < 1e-3, "{served:?}");
        }
        // A guarantee of a node above the flows still lifts the processes where it waits.
        let above = [
            Claim::new(1.0).with_flow(1, 1).with_guarantee(9, 800_000),
            Claim::new(1.0).with_flow(2, 3),
        ];
        assert_eq!(owed(&above), [0.8, 0.0]);
        let parts = divide(&above);
        assert!(close(parts[0], 0.8) && close(parts[1], 0.2), "{parts:?}");
    }

    /// A process spends the burst and dies (or leaves, or loses its renewal's reply); a
    /// newcomer starts 50 ms later: the fleet gets the burst once, plus the refill.
    #[test]
    fn a_grant_is_a_debit_spent_once_whatever_becomes_of_its_holder() {
        // The issue's account: a burst of 1,000 tokens, 0.03 tokens a second.
        let account = Account {
            num: 3,
            den: 100_000,
            capacity: 1_000,
        };
        let blocked = |need| Report {
            need,
            ..Report::default()
        };
        for fate in ["dies", "leaves", "loses its reply"] {
            let mut ledger = Ledger::new(account, 300, 50);
            let first = ledger.lease(1, Claim::new(1.0), (1, blocked(1_000)), 0, |p| p);
            assert!(
                matches!(first, Answer::Granted { granted: 1_000, .. }),
                "{first:?}"
            );
            // It spent the 1,000.
            match fate {
                "leaves" => {
                    ledger.leave(1, (2, Report::default()), 40);
                }
                "loses its reply" => {
                    // Its renewal ran; its reply was lost: what it was granted is gone.
                    ledger.lease(1, Claim::new(1.0), (2, blocked(1_000)), 40, |p| p);
                }
                _ => {}
            }
            let mut admitted = 1_000;
            for ms in (50..10_000).step_by(100) {
                if let Answer::Granted { granted, .. } =
                    ledger.lease(2, Claim::new(1.0), (ms, blocked(1)), ms, |p| p)
                {
                    admitted += granted;
                }
                assert!(ledger.holds_at_most_the_burst(ms), "{fate} at {ms} ms");
            }
            assert_eq!(admitted, 1_000, "{fate}: nothing refills in 10 s");
        }
    }

    /// Twenty requests a minute (a burst of 4), five processes each with a request waiting:
    /// four go at once, whole units, and the fifth when the bucket has refilled one.
    #[test]
    fn whole_units_reach_every_process_in_turn() {
        let account = Account {
            num: 1,
            den: 3_000,
            capacity: 4,
        };
        let mut ledger = Ledger::new(account, 300, 50);
        let mut first = [None; 5];
        let mut total = 0;
        for ms in (0..12_000u64).step_by(100) {
            for p in 0..5u64 {
                let need = u64::from(first[p as usize].is_none());
                let report = Report {
                    need,
                    ..Report::default()
                };
                let claim = Claim::new(f64::from(need as u32));
                let seq = ms / 100 + 1;
                if let Answer::Granted { granted, .. } =
                    ledger.lease(p, claim, (seq, report), ms + p, |x| x)
                {
                    total += granted;
                    if granted > 0 {
                        first[p as usize] = Some(ms);
                    }
                }
            }
        }
        assert!(first.iter().all(Option::is_some), "{first:?}");
        assert_eq!(
            first.iter().filter(|f| **f == Some(0)).count(),
            4,
            "{first:?}"
        );
        // The fifth within a refill (3 s) and a division's turn.
        assert!(first.iter().all(|f| f.unwrap() <= 3_500), "{first:?}");
        assert_eq!(total, 5);
    }

    #[test]
    fn a_report_keeps_what_it_expects_to_spend_and_gives_back_the_rest() {
        let idle = Report::of(500, (1_000, 0.0), 0, 1.0, (false, None, false));
        assert_eq!((idle.keep, idle.back, idle.ask), (0, 500, 0));
        let standing = Report::of(500, (1_000, 0.25), 0, 1.0, (false, None, false));
        assert_eq!((standing.keep, standing.back, standing.ask), (100, 400, 0));
        let small = Report::of(4, (4, 1.0), 0, 1.0, (false, None, false));
        assert_eq!((small.keep, small.back), (0, 4), "a tenth of 4 is no unit");
        let closed = Report::of(500, (1_000, 0.25), 400, 1.0, (false, None, true));
        assert_eq!(
            (closed.keep, closed.back),
            (0, 500),
            "nothing kept past the lease"
        );
        let debt = Report::of(-300, (1_000, 0.25), 400, 1.0, (true, Some(50), false));
        assert_eq!((debt.keep, debt.back, debt.need), (-300, 0, 50));
        let waiting = Report::of(100, (1_000, 0.25), 0, 1.0, (true, None, false));
        assert_eq!(
            (waiting.keep, waiting.ask),
            (100, 900),
            "the whole capacity"
        );
    }

    #[test]
    fn nan_and_out_of_range_claims_are_clamped() {
        assert_eq!(Claim::new(f64::NAN).want(), 0.0);
        assert_eq!(Claim::new(7.0).want(), 1.0);
        assert_eq!(Claim::new(-1.0).want(), 0.0);
    }

    #[test]
    fn huge_daily_limits_stay_below_2_pow_53() {
        let tpd = Limit::new(
            crate::Dimension::TotalTokens,
            std::num::NonZeroU64::new(10_000_000_007).unwrap(),
            std::time::Duration::from_secs(86_401),
        )
        .unwrap();
        let account = Account::of(&tpd);
        assert!(u128::from(account.capacity) * u128::from(account.den) * 2 < 1 << 53);
        let exact = tpd.effective_amount() as f64 / 86_401_000.0;
        let coarse = account.num as f64 / account.den as f64;
        assert!(
            coarse <= exact && coarse > exact * 0.999,
            "{coarse} vs {exact}"
        );
    }

    #[test]
    fn jain_is_one_when_equal_and_one_over_n_when_one_has_all() {
        assert!(close(jain_index(&[2.0, 2.0, 2.0]), 1.0));
        assert!(close(jain_index(&[1.0, 0.0, 0.0, 0.0]), 0.25));
    }
}
