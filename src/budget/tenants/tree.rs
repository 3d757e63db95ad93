//! The run-time tenant tree of one budget: the configuration, the live nodes, and the checks
//! of a request's path. Plain data under the budget's mutex; times in nanoseconds on the
//! budget's clock, days from the tree's wall clock.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::task::Waker;

use tokio::time::Instant;

use super::node::{
    Node, NodeWait, Parked, cap_refusal, limits_of, recount, settle_caps, take_caps,
};
use crate::budget::memory::store::{LimitState, Store};
use crate::budget::store::{Control, PathLimits, StorePath};
use crate::cost::Cost;
use crate::priority::Priority;
use crate::quota::cap::CapCount;
use crate::quota::{Dimension, Limit};
use crate::sched::Flow;
use crate::tenant::Tenant;
use crate::tenant::path::within;
use crate::tenant::{CapRecord, CapScope, PeriodCap};
use crate::tenant::{Refusal, TenantRefused};
use crate::tenant::{TenantNode, TenantTree};

/// A flow's key for a node's path text: a hash, never 0 (the flow of requests without a
/// tenant tree).
fn flow_key(prefix: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    prefix.hash(&mut hasher);
    hasher.finish() | 1
}

/// What the nodes of a path say to a cost.
#[derive(Debug)]
pub(crate) enum Check {
    /// Every node can pay now.
    Fits,
    /// A node refuses: the request fails at once.
    Refused(TenantRefused),
    /// The node at `depth` cannot pay yet: at `at` (nanoseconds, with the limit that binds),
    /// or when one of its calls in flight ends (`None`); past `give_up` (its `max_wait`, for
    /// calls in flight), it refuses.
    Blocked {
        depth: usize,
        at: Option<(u64, Limit)>,
        give_up: Option<u64>,
    },
}

/// The tenants' run-time state, shared by every budget that serves them (see
/// [`Tenants`](super::state::Tenants), the handle each budget holds). Times are nanoseconds
/// on the clock of the budget that made it.
#[derive(Debug)]
pub(crate) struct TenantState {
    pub(crate) tree: TenantTree,
    live: HashMap<Tenant, Node>,
    /// The live nodes, in the order the sweep looks at them (one per admission).
    sweep: VecDeque<Tenant>,
    /// The account's limits: what a top-level borrowing cap scales.
    account: Vec<Limit>,
    /// The dimension guarantees and meters count, and the account's rate of it per minute.
    pub(crate) reference: (Dimension, u64),
    next_ticket: u64,
    /// For a budget leasing its share of a fleet's account, the fleet as its last renewal
    /// told it (`None`: not leasing, weights and guarantees as configured).
    fleet: Option<Fleet>,
    /// For a leasing budget, each guarantee's share of the account (millionths), by its key,
    /// as flows named it.
    guarantees: HashMap<u64, u32>,
    /// For a budget shared through a store, what each node's daily caps have used over every
    /// process, as the store last told (a node's view shows the larger of it and its own).
    fleet_days: HashMap<Tenant, Vec<(PeriodCap, u64)>>,
    /// See [`TenantState::keeps_any_in_store`].
    keeps_in_store: bool,
    /// Each account's own caps ([`Quota::with_cap`](crate::Quota::with_cap)), by the
    /// account's name: every request its budget admits counts, whatever its path.
    accounts: HashMap<Arc<str>, AccountCaps>,
    /// Where every change of a cap's count is written, if anywhere.
    record: Option<Arc<dyn CapRecord>>,
}

/// Whether two caps count the same thing (their amounts may differ: a cap raised since).
fn same(a: &PeriodCap, b: &PeriodCap) -> bool {
    (a.dimension(), a.window()) == (b.dimension(), b.window())
}

/// An account's own caps: their counts, and the scope that names them (`/<account>`).
#[derive(Debug)]
struct AccountCaps {
    scope: Tenant,
    counts: Vec<CapCount>,
}

/// A leasing budget's fleet, as its last renewal told it. A flow weighs what the division
/// made of it in this process (its part of the account over the processes where it waits,
/// its own guarantee included: `fleet::local_weights`); one the division did not know yet
/// weighs its weight times [`FLEET_SCALE`]. A guarantee of a node above the flows is its
/// share of the account divided by the number of processes where it waits, as a share of this
/// process's part of the account.
#[derive(Debug, Default)]
struct Fleet {
    /// Each flow's weight in this process, by key (0: not known at the last division).
    flows: HashMap<u64, u32>,
    /// In how many processes each guarantee waits, by key.
    guarantees: HashMap<u64, u32>,
    /// This process's share of the account.
    share: f64,
    /// Each flow's configured weight, by key: what this process tells the fleet.
    configured: HashMap<u64, u32>,
}

/// The scale of fleet weights: divisible by every spread up to 8 (and most beyond), so that
/// a weight divided by its spread stays exact enough as an integer.
pub(crate) const FLEET_SCALE: u32 = crate::budget::store::fleet::LOCAL_SCALE;

impl TenantState {
    pub(crate) fn new(tree: TenantTree, account: &[Limit]) -> Self {
        let keeps_in_store = Self::tree_keeps_any(&tree);
        Self {
            tree,
            live: HashMap::new(),
            sweep: VecDeque::new(),
            account: account.to_vec(),
            reference: reference(account),
            next_ticket: 0,
            fleet: None,
            guarantees: HashMap::new(),
            fleet_days: HashMap::new(),
            keeps_in_store,
            accounts: HashMap::new(),
            record: None,
        }
    }

    /// Writes every later change of a cap's count to `record`.
    pub(crate) fn record_caps(&mut self, record: Arc<dyn CapRecord>) {
        self.record = Some(record);
    }

    /// Counts at least `used` in `scope`'s cap of `cap`'s dimension and window for the
    /// period that began at `since` (restored from a record): raised, never lowered; nothing
    /// for a cap `scope` does not have, or a period that ended.
    pub(crate) fn restore_cap(
        &mut self,
        scope: CapScope<'_>,
        cap: &PeriodCap,
        since: u64,
        used: u64,
        at: Instant,
    ) {
        let unix = self.tree.clock.unix_seconds(at);
        let counts = match scope {
            CapScope::Account(account) => match self.accounts.get_mut(account) {
                Some(own) => &mut own.counts,
                None => return,
            },
            CapScope::Node(node) => {
                let configured = |config: &TenantNode| config.daily.iter().any(|c| same(c, cap));
                if !self.tree.node(node).is_some_and(configured) {
                    return;
                }
                &mut self.node(node.as_str()).days
            }
        };
        if let Some(count) = counts.iter_mut().find(|count| same(&count.cap, cap)) {
            count.restore(since, used, unix);
        }
    }

    /// Writes what changed of the caps of `account` and of the nodes of `path` to the record.
    fn report_caps(&mut self, account: &str, path: &Tenant) {
        let Some(record) = self.record.clone() else {
            return;
        };
        if let Some(own) = self.accounts.get_mut(account) {
            for count in &mut own.counts {
                let cap = count.cap;
                count.report(|since, used| {
                    record.counted(CapScope::Account(account), &cap, since, used);
                });
            }
        }
        for prefix in path.prefixes() {
            let Some(node) = self
                .live
                .get_key_value(prefix)
                .map(|(node, _)| node.clone())
            else {
                continue;
            };
            let live = self.live.get_mut(prefix).expect("just seen");
            for count in &mut live.days {
                let cap = count.cap;
                count.report(|since, used| {
                    record.counted(CapScope::Node(&node), &cap, since, used);
                });
            }
        }
    }

    /// Sets the caps of `account` itself (none: it has none), keeping the count of each that
    /// stays.
    pub(crate) fn set_account_caps(&mut self, account: &Arc<str>, caps: &[PeriodCap]) {
        if caps.is_empty() {
            self.accounts.remove(account);
        } else {
            let own = self
                .accounts
                .entry(account.clone())
                .or_insert_with(|| AccountCaps {
                    scope: Tenant::account(account),
                    counts: Vec::new(),
                });
            recount(&mut own.counts, caps);
        }
        self.keeps_in_store = self.any_kept_in_store();
    }

    /// What `account`'s own caps have used in their periods (for a budget shared through a
    /// store, the larger of its own count and the fleet's, as the store last told).
    pub(crate) fn account_caps(&mut self, account: &str, at: Instant) -> Vec<(PeriodCap, u64)> {
        let unix = self.tree.clock.unix_seconds(at);
        let Some(own) = self.accounts.get_mut(account) else {
            return Vec::new();
        };
        let fleet = self.fleet_days.get(&own.scope);
        (own.counts.iter_mut())
            .map(|count| {
                let seen = (fleet.into_iter().flatten())
                    .find(|(cap, _)| *cap == count.cap)
                    .map_or(0, |(_, used)| *used);
                (count.cap, count.used(unix).max(seen))
            })
            .collect()
    }

    /// Whether any node (configured by path or by depth) has limits or controls a shared
    /// store keeps (its own limits, a borrowing cap, daily caps, a cap on calls in flight):
    /// else no path has any, and a leasing budget need not build one to know. Kept as the
    /// tree changes.
    pub(crate) fn keeps_any_in_store(&self) -> bool {
        self.keeps_in_store
    }

    fn any_kept_in_store(&self) -> bool {
        Self::tree_keeps_any(&self.tree) || !self.accounts.is_empty()
    }

    fn tree_keeps_any(tree: &TenantTree) -> bool {
        let keeps = |node: &TenantNode| {
            !node.limits.is_empty()
                || node.max_share.is_some()
                || !node.daily.is_empty()
                || node.max_in_flight.is_some()
        };
        tree.nodes.values().any(keeps) || tree.templates.iter().any(|(_, t)| keeps(t))
    }

    /// The daily caps a store may count for every process: those of the nodes configured by
    /// path and of the live nodes, for `account`.
    pub(crate) fn caps(&self, account: &str) -> Vec<(Tenant, PeriodCap)> {
        let own = (self.accounts.get(account).into_iter()).flat_map(|own| {
            own.counts
                .iter()
                .map(|count| (own.scope.clone(), count.cap))
        });
        let configured = (self.tree.nodes.iter())
            .filter(|(path, _)| self.applies(path.as_str(), account))
            .flat_map(|(path, node)| node.daily.iter().map(|cap| (path.clone(), *cap)));
        let live = (self.live.iter())
            .filter(|(path, _)| !self.tree.nodes.contains_key(*path))
            .filter(|(path, _)| self.applies(path.as_str(), account))
            .flat_map(|(path, node)| node.days.iter().map(|day| (path.clone(), day.cap)));
        own.chain(configured).chain(live).collect()
    }

    /// What the store counts of `caps` for every process (`used`, in the same order).
    pub(crate) fn set_fleet_days(&mut self, caps: Vec<(Tenant, PeriodCap)>, used: &[u64]) {
        self.fleet_days.clear();
        for ((path, cap), &used) in caps.into_iter().zip(used) {
            self.fleet_days.entry(path).or_default().push((cap, used));
        }
    }

    /// Records each flow's weight in this process and in how many processes each guarantee
    /// waits, and this process's share of the account (a lease's renewal).
    pub(crate) fn spread(
        &mut self,
        flows: impl Iterator<Item = (u64, u32)>,
        guarantees: impl Iterator<Item = (u64, u32)>,
        share: f64,
    ) {
        let fleet = self.fleet.get_or_insert_with(Fleet::default);
        fleet.flows.clear();
        fleet.flows.extend(flows);
        fleet.guarantees.clear();
        fleet
            .guarantees
            .extend(guarantees.map(|(key, n)| (key, n.max(1))));
        fleet.share = share;
    }

    /// The guarantees of `keys` as shares of the account (millionths): what this process
    /// tells the fleet of its waiting guarantees.
    pub(crate) fn guarantees_of(&self, keys: &[u64]) -> Vec<(u64, u32)> {
        (keys.iter())
            .filter_map(|key| self.guarantees.get(key).map(|&ppm| (*key, ppm)))
            .collect()
    }

    /// Turns the fleet weights of `flows` back into their configured weights.
    pub(crate) fn unspread(&self, flows: &mut [(u64, u32)]) {
        let Some(fleet) = &self.fleet else { return };
        for (key, weight) in flows {
            *weight = match fleet.configured.get(key) {
                Some(&configured) => configured,
                None => (*weight / FLEET_SCALE).max(1),
            };
        }
    }

    /// The path of a request: its own, else the tree's default.
    pub(crate) fn path_of(&self, tenant: Option<&Tenant>) -> Tenant {
        tenant
            .cloned()
            .unwrap_or_else(|| self.tree.default_tenant.clone())
    }

    /// How many nodes hold state now.
    pub(crate) fn live(&self) -> usize {
        self.live.len()
    }

    /// The live node at `prefix`, made if needed.
    fn node(&mut self, prefix: &str) -> &mut Node {
        if !self.live.contains_key(prefix) {
            let path = Tenant::parse(prefix).expect("a prefix of a valid path");
            let node = self.make(&path);
            self.sweep.push_back(path.clone());
            self.live.insert(path, node);
        }
        self.live.get_mut(prefix).expect("just made")
    }

    fn make(&self, path: &Tenant) -> Node {
        let config = self.tree.node(path);
        Node::new(
            config,
            &self.parent_limits(path),
            self.guaranteed(path),
            self.weight(path),
        )
    }

    /// The limits a borrowing cap of `path` scales: its nearest ancestor's with limits, else
    /// the account's.
    fn parent_limits(&self, path: &Tenant) -> Vec<Limit> {
        let mut ancestor = path.parent();
        while let Some(p) = ancestor {
            if let Some(config) = self.tree.node(&p).filter(|c| !c.limits.is_empty()) {
                return config.limits.clone();
            }
            ancestor = p.parent();
        }
        self.account.clone()
    }

    /// The guarantee of `path` in the reference dimension per minute: the product of the
    /// guarantees set on its path, times the account's rate; 0 for a node that sets none of
    /// its own (its traffic counts in its nearest guaranteed ancestor's meter, which is the
    /// one that decides whether it is below its guarantee: a child does not claim its
    /// parent's whole guarantee for itself).
    fn guaranteed(&self, path: &Tenant) -> u64 {
        if self
            .config(path.as_str())
            .is_none_or(|c| c.guarantee <= 0.0)
        {
            return 0;
        }
        let mut share = 1.0;
        let mut any = false;
        for prefix in path.prefixes() {
            if let Some(config) = self.config(prefix).filter(|c| c.guarantee > 0.0) {
                share *= config.guarantee;
                any = true;
            }
        }
        if any {
            (self.reference.1 as f64 * share).floor() as u64
        } else {
            0
        }
    }

    fn weight(&self, path: &Tenant) -> u32 {
        path.prefixes()
            .filter_map(|prefix| self.config(prefix))
            .fold(1u32, |w, c| w.saturating_mul(c.weight.get()))
    }

    /// Whether the node at `prefix` applies to the requests `account` admits: a node scoped
    /// to another account is passed over.
    fn applies(&self, prefix: &str, account: &str) -> bool {
        self.config(prefix)
            .and_then(|config| config.account.as_deref())
            .is_none_or(|scope| scope == account)
    }

    fn config(&self, prefix: &str) -> Option<&TenantNode> {
        self.tree.nodes.get(prefix).or_else(|| {
            let depth = prefix.split('/').count();
            self.tree.template(depth)
        })
    }

    /// Checks every node of `path` for `cost`, top-down: refusals (a pause, a spent day, a
    /// cost above a capacity) anywhere first, then what would make it wait. A request that
    /// arrived at `arrived` and would wait for a node past the node's `max_wait` is refused by
    /// it instead.
    pub(crate) fn check(
        &mut self,
        account: &str,
        path: &Tenant,
        cost: &Cost,
        now: u64,
        at: Instant,
        arrived: Instant,
    ) -> Check {
        let unix = self.tree.clock.unix_seconds(at);
        let waited =
            u64::try_from(at.saturating_duration_since(arrived).as_nanos()).unwrap_or(u64::MAX);
        // The first node that cannot pay yet makes the request wait; every node may refuse.
        if let Some(own) = self.accounts.get_mut(account) {
            if let Some(reason) = cap_refusal(&mut own.counts, cost, unix) {
                let scope = own.scope.clone();
                return Check::Refused(TenantRefused { scope, reason });
            }
        }
        let mut blocked = None;
        for (i, prefix) in path.prefixes().enumerate() {
            if !self.applies(prefix, account) {
                continue;
            }
            let node = self.node(prefix);
            if let Some(reason) = node.refusal(cost, unix) {
                return Check::Refused(refused(prefix, reason));
            }
            if blocked.is_some() {
                continue;
            }
            match node.wait(cost, now, waited) {
                Err(reason) => return Check::Refused(refused(prefix, reason)),
                Ok(wait) => blocked = wait.map(|wait| (i + 1, wait)),
            }
        }
        match blocked {
            Some((depth, NodeWait { at, give_up })) => Check::Blocked { depth, at, give_up },
            None => Check::Fits,
        }
    }

    /// Debits every node of `path` (checked by [`Tenants::check`] under the same lock), and
    /// lets the sweep look at one live node.
    pub(crate) fn take(
        &mut self,
        account: &str,
        path: &Tenant,
        cost: &Cost,
        now: u64,
        at: Instant,
    ) {
        let unix = self.tree.clock.unix_seconds(at);
        let reference = self.reference.0;
        if let Some(own) = self.accounts.get_mut(account) {
            take_caps(&mut own.counts, cost, unix);
        }
        for prefix in path.prefixes() {
            if !self.applies(prefix, account) {
                continue;
            }
            self.node(prefix).take(cost, reference, now, unix);
        }
        self.report_caps(account, path);
        self.sweep_one(now, unix);
    }

    /// Settles a reservation on every node of `path`; returns the wakers of requests parked
    /// for a node that freed capacity.
    pub(crate) fn settle(
        &mut self,
        account: &str,
        path: &Tenant,
        (reserved, actual): (&Cost, &Cost),
        now: u64,
        at: Instant,
        wakers: &mut Vec<Waker>,
    ) {
        let unix = self.tree.clock.unix_seconds(at);
        let reference = self.reference.0;
        if let Some(own) = self.accounts.get_mut(account) {
            settle_caps(
                &mut own.counts,
                (reserved, actual),
                unix,
                &format_args!("account:{account}"),
            );
        }
        for prefix in path.prefixes() {
            if !self.applies(prefix, account) {
                continue;
            }
            let node = self.node(prefix);
            let scope = format_args!("tenant:{prefix}");
            if node.settle((reserved, actual), reference, (now, unix), &scope) {
                wakers.extend(node.unpark_all());
            }
        }
        self.report_caps(account, path);
        #[cfg(feature = "metrics")]
        self.count_settled(path, actual, now);
    }

    /// Counts a settlement's tokens as guaranteed (the path's use of the last minute within
    /// its guarantee) or borrowed, for the label-depth prefix of the path.
    #[cfg(feature = "metrics")]
    fn count_settled(&mut self, path: &Tenant, actual: &Cost, now: u64) {
        let amount = actual.amount(self.reference.0);
        if amount == 0 {
            return;
        }
        // The nearest node of the path with a guarantee decides, as in `flow`.
        let guarantor = path
            .prefixes()
            .filter(|prefix| self.live.get(*prefix).is_some_and(|n| n.guaranteed > 0))
            .last();
        let share = match guarantor.and_then(|prefix| self.live.get_mut(prefix)) {
            Some(node) => {
                if node.meter.get(now) <= node.guaranteed {
                    "guaranteed"
                } else {
                    "borrowed"
                }
            }
            None => "none",
        };
        super::metrics::settled(path.prefix(self.tree.label_depth), share, amount);
    }

    /// The fair-share flow of `path`: its deepest configured node (else its top-level
    /// tenant), the product of the weights on the path, and its nearest node with a guarantee
    /// with that guarantee's share of the account (the product of the guarantees on its path).
    pub(crate) fn flow(&mut self, path: &Tenant) -> Flow {
        let mut key = path.prefix(1);
        let (mut guarantor, mut share) = (None, 1.0);
        for prefix in path.prefixes() {
            if self.node(prefix).configured {
                key = prefix;
            }
            if let Some(config) = self.config(prefix).filter(|c| c.guarantee > 0.0) {
                share *= config.guarantee;
                guarantor = Some(prefix);
            }
        }
        let configured = self.live.get(path.as_str()).map_or(1, |n| n.weight).max(1);
        // Always in fleet units, leasing or not: a flow's tags must not change scale when the
        // first renewal tells its weight in the fleet.
        let mut weight = configured.saturating_mul(FLEET_SCALE);
        let key = flow_key(key);
        let mut share = if guarantor.is_some() { share } else { 0.0 };
        let mut guarantor = guarantor.map(flow_key);
        if let Some(fleet) = &mut self.fleet {
            // What this process tells the fleet of the guarantee at its next renewal.
            if let Some(guarantor) = guarantor {
                let ppm = (share * 1e6).round() as u32;
                self.guarantees.insert(guarantor, ppm);
            }
            if fleet.configured.len() >= 4_096 {
                // Bounded: a flow forgotten here is told at its local weight over the scale.
                fleet.configured.clear();
            }
            fleet.configured.insert(key, configured);
            let divided = fleet.flows.get(&key).copied().filter(|&w| w > 0);
            weight = divided.unwrap_or(weight);
            match guarantor {
                // Its own guarantee is in its weight: the division lifted it over the fleet.
                Some(own) if own == key && divided.is_some() => {
                    guarantor = None;
                    share = 0.0;
                }
                // A guarantee above it (or one not divided yet): its part of the guarantee,
                // of what this process serves.
                Some(above) if fleet.share > 0.0 => {
                    let n = fleet.guarantees.get(&above).copied().unwrap_or(1);
                    share = (share / f64::from(n) / fleet.share).min(1.0);
                }
                _ => {}
            }
        }
        Flow {
            // Never 0: the key of requests without a tenant tree, served first come.
            key,
            weight: weight.max(1),
            guarantor: guarantor.unwrap_or(0),
            share_ppm: (share * 1e6).round() as u32,
        }
    }

    /// Parks a request blocked by the node at `depth` of `path` until it frees capacity;
    /// returns its ticket.
    pub(crate) fn park(
        &mut self,
        path: &Tenant,
        depth: usize,
        priority: Priority,
        waker: &Waker,
    ) -> u64 {
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        let node = self.node(path.prefix(depth));
        node.parked.push(Parked {
            ticket,
            priority,
            path: path.clone(),
            waker: waker.clone(),
        });
        ticket
    }

    /// The requests at or below `scope` parked for a node's limits, by class.
    pub(crate) fn parked_within(&self, scope: &Tenant) -> [usize; 3] {
        let mut queued = [0; 3];
        for parked in self.live.values().flat_map(|node| &node.parked) {
            if parked.path.is_within(scope) {
                queued[parked.priority.index()] += 1;
            }
        }
        queued
    }

    /// The refusal of the node at `depth` of `path` for a request that arrived at `arrived`
    /// and that the node (as a shared store counts it) could admit only in `wait` from `at`:
    /// `None` while that is within the node's `max_wait`.
    pub(crate) fn refuses_after(
        &mut self,
        path: &Tenant,
        depth: usize,
        refusal: Refusal,
        wait: std::time::Duration,
        (at, arrived): (Instant, Instant),
    ) -> Option<TenantRefused> {
        let prefix = path.prefix(depth);
        let max = self.node(prefix).max_wait?;
        let waited = at.saturating_duration_since(arrived);
        let total = u64::try_from((waited + wait).as_nanos()).unwrap_or(u64::MAX);
        (total > max).then(|| refused(prefix, refusal))
    }

    /// Ends a parking.
    pub(crate) fn unpark(&mut self, path: &Tenant, depth: usize, ticket: u64) {
        if let Some(node) = self.live.get_mut(path.prefix(depth)) {
            node.parked.retain(|parked| parked.ticket != ticket);
        }
    }

    /// Pauses or resumes `scope`; returns the wakers of requests parked at or below it, or
    /// above it (their path may cross it), so they look again.
    pub(crate) fn set_paused(&mut self, scope: &Tenant, paused: bool, wakers: &mut Vec<Waker>) {
        self.node(scope.as_str()).paused = paused;
        for (path, node) in &mut self.live {
            if within(path.as_str(), scope.as_str()) || scope.is_within(path) {
                wakers.extend(node.unpark_all());
            }
        }
    }

    /// Replaces the configuration of `path`; a live node takes it at once, keeping its levels.
    pub(crate) fn set_node(
        &mut self,
        path: Tenant,
        config: TenantNode,
        now: u64,
        wakers: &mut Vec<Waker>,
    ) {
        self.tree.nodes.insert(path.clone(), config);
        self.keeps_in_store = self.any_kept_in_store();
        // Weights, guarantees and borrowing caps of the nodes below may change too.
        let affected: Vec<Tenant> = self
            .live
            .keys()
            .filter(|p| p.is_within(&path))
            .cloned()
            .collect();
        for p in affected {
            let (parent, guaranteed, weight) =
                (self.parent_limits(&p), self.guaranteed(&p), self.weight(&p));
            let config = self.tree.node(&p).cloned();
            if let Some(node) = self.live.get_mut(&p) {
                // Parked requests look again under the new limits.
                wakers.extend(node.unpark_all());
                match config {
                    Some(config) => node.reconfigure(&config, &parent, guaranteed, weight, now),
                    None => (node.guaranteed, node.weight) = (guaranteed, weight),
                }
            }
        }
    }

    /// What a shared store keeps of every node of `path`: its limits and its controls, each
    /// with its node (empty without any).
    pub(crate) fn shared_path(&self, account: &str, path: &Tenant) -> PathLimits {
        let mut shared = StorePath::default();
        // The account's own caps first: above every node.
        if let Some(own) = self.accounts.get(account) {
            let controls = own
                .counts
                .iter()
                .map(|c| (own.scope.clone(), Control::Daily(c.cap)));
            shared.controls.extend(controls);
        }
        for prefix in path.prefixes() {
            let Some(config) = self
                .config(prefix)
                .filter(|_| self.applies(prefix, account))
            else {
                continue;
            };
            let node = Tenant::parse(prefix).expect("a prefix of a valid path");
            let own = limits_of(config, &self.parent_limits(&node));
            shared
                .limits
                .extend(own.into_iter().map(|limit| (node.clone(), limit)));
            let controls = (config.max_in_flight.map(Control::InFlight).into_iter())
                .chain(config.daily.iter().copied().map(Control::Daily));
            shared
                .controls
                .extend(controls.map(|control| (node.clone(), control)));
        }
        Arc::new(shared)
    }

    /// What a snapshot of `path` shows; a node without state reads as fresh.
    pub(crate) fn view(&mut self, path: &Tenant, now: u64, at: Instant) -> NodeView {
        let unix = self.tree.clock.unix_seconds(at);
        let mut fresh;
        let node = match self.live.get_mut(path.as_str()) {
            Some(node) => node,
            None => {
                fresh = self.make(path);
                &mut fresh
            }
        };
        NodeView {
            limits: node.store.snapshot(now),
            weight: node.weight,
            paused: node.paused,
            in_flight: node.in_flight,
            used: node.meter.get(now),
            guaranteed: node.guaranteed,
            today: node
                .days
                .iter_mut()
                .map(|day| {
                    let fleet = (self.fleet_days.get(path).into_iter().flatten())
                        .find(|(cap, _)| *cap == day.cap)
                        .map_or(0, |(_, used)| *used);
                    (day.cap, day.used(unix).max(fleet))
                })
                .collect(),
        }
    }

    /// Looks at the live node the sweep reached: forgotten if idle, else looked at later.
    fn sweep_one(&mut self, now: u64, unix: u64) {
        let Some(path) = self.sweep.pop_front() else {
            return;
        };
        let idle = match self.live.get_mut(&path) {
            Some(node) => node.is_idle(now, unix),
            None => return,
        };
        if idle {
            self.live.remove(&path);
        } else {
            self.sweep.push_back(path);
        }
    }

    /// Forgets every idle node now (a snapshot or a test of memory).
    pub(crate) fn sweep_all(&mut self, now: u64, at: Instant) {
        let unix = self.tree.clock.unix_seconds(at);
        self.live.retain(|_, node| !node.is_idle(now, unix));
        let live = &self.live;
        self.sweep.retain(|path| live.contains_key(path));
    }
}

/// One node's state, for a snapshot.
#[derive(Debug)]
pub(crate) struct NodeView {
    pub(crate) limits: Vec<LimitState>,
    pub(crate) weight: u32,
    pub(crate) paused: bool,
    pub(crate) in_flight: usize,
    pub(crate) used: u64,
    pub(crate) guaranteed: u64,
    pub(crate) today: Vec<(PeriodCap, u64)>,
}

impl NodeView {
    /// A budget without tenants: nothing.
    pub(crate) fn empty() -> Self {
        Self {
            limits: Vec::new(),
            weight: 1,
            paused: false,
            in_flight: 0,
            used: 0,
            guaranteed: 0,
            today: Vec::new(),
        }
    }
}

/// The refusal of `path` because its node at `depth` is paused.
pub(crate) fn paused(path: &Tenant, depth: usize) -> TenantRefused {
    refused(path.prefix(depth.clamp(1, path.depth())), Refusal::Paused)
}

fn refused(prefix: &str, reason: Refusal) -> TenantRefused {
    TenantRefused {
        scope: Tenant::parse(prefix).expect("a prefix of a valid path"),
        reason,
    }
}

/// The dimension guarantees count in (total tokens, else input tokens, else requests) and the
/// account's rate of it per minute, from its shortest limit of that dimension.
fn reference(account: &[Limit]) -> (Dimension, u64) {
    for dimension in [
        Dimension::TotalTokens,
        Dimension::InputTokens,
        Dimension::Requests,
    ] {
        let shortest = account
            .iter()
            .filter(|l| l.dimension() == dimension)
            .min_by_key(|l| l.period());
        if let Some(limit) = shortest {
            let per_minute = limit.effective_amount() as f64 * 60.0 / limit.period().as_secs_f64();
            return (dimension, per_minute.floor() as u64);
        }
    }
    (Dimension::TotalTokens, 0)
}
