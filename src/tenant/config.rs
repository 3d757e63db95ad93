//! The tree of quotas: what each node may spend, its weight, its guarantee, its cap.

use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use super::error::InvalidTree;
use super::path::Tenant;
use crate::quota::Limit;
use crate::quota::{PeriodCap, WallClock};

/// One node of a [`TenantTree`]: its own limits, its weight among its siblings, the share of
/// its parent it is guaranteed and the most it may use when borrowing, a cap on calls in
/// flight, daily caps.
///
/// Everything is optional: a node with nothing set only passes its requests up (and can be
/// paused).
#[derive(Debug, Clone, PartialEq)]
pub struct TenantNode {
    pub(crate) limits: Vec<Limit>,
    pub(crate) weight: NonZeroU32,
    pub(crate) guarantee: f64,
    pub(crate) max_share: Option<f64>,
    pub(crate) max_in_flight: Option<NonZeroUsize>,
    pub(crate) daily: Vec<PeriodCap>,
    pub(crate) max_wait: Option<Duration>,
    pub(crate) account: Option<std::sync::Arc<str>>,
}

impl Default for TenantNode {
    fn default() -> Self {
        Self::new()
    }
}

impl TenantNode {
    /// A node with no limit of its own, weight 1, no guarantee, no cap.
    pub const fn new() -> Self {
        Self {
            limits: Vec::new(),
            weight: NonZeroU32::MIN,
            guarantee: 0.0,
            max_share: None,
            max_in_flight: None,
            daily: Vec::new(),
            max_wait: None,
            account: None,
        }
    }

    /// Adds a limit of the node's own (any dimension, any period: a per-key rate, a team's
    /// burst); one of the same dimension and period is replaced. The node keeps the `Limit`
    /// as given ([`limits`](Self::limits) returns it); its bucket plans a fixed share of it
    /// (a node's limits are its operator's, not a provider's: they do not adapt), which the
    /// tenant snapshot reports. Unless the limit sets a burst, the node's bucket holds its
    /// whole amount: "20 requests a minute" admits 20 requests sent together (an account's
    /// limit holds a sixth, [`Limit::DEFAULT_BURST_FRACTION`](crate::Limit::DEFAULT_BURST_FRACTION),
    /// to protect the provider). Defaults to none.
    pub fn with_limit(mut self, limit: Limit) -> Self {
        self.limits.retain(|l| !l.same_bucket(&limit));
        self.limits.push(limit);
        self
    }

    /// The node's weight among its siblings in the fair share of a saturated account.
    /// Defaults to 1.
    pub fn with_weight(self, weight: NonZeroU32) -> Self {
        Self { weight, ..self }
    }

    /// The share of its parent's capacity (the account's, for a top-level tenant) the node is
    /// guaranteed: while its traffic stays below it, its requests go before those of
    /// borrowers in their class. A share outside `[0, 1]` (or NaN) makes the tree invalid:
    /// installing it fails with [`InvalidTree`]. Defaults to 0 (no guarantee).
    pub fn with_guarantee(self, share: f64) -> Self {
        Self {
            guarantee: share,
            ..self
        }
    }

    /// The most of its parent's capacity the node may use, borrowing included: its guarantee
    /// plus what it may borrow of the idle share of others. Enforced as limits of the node's
    /// own: each limit of the parent (the account's, when no ancestor has limits) scaled by
    /// `share`. A share outside `(0, 1]` (or NaN) makes the tree invalid: installing it fails
    /// with [`InvalidTree`]. Defaults to no cap (the whole idle capacity may be borrowed).
    pub fn with_max_share(self, share: f64) -> Self {
        Self {
            max_share: Some(share),
            ..self
        }
    }

    /// Caps the node's calls in flight. Defaults to no cap.
    pub fn with_max_in_flight(self, max: NonZeroUsize) -> Self {
        Self {
            max_in_flight: Some(max),
            ..self
        }
    }

    /// Bounds how long a request may wait for this node's own limits or calls in flight,
    /// counted from when the request arrived: one that cannot be admitted by the node within
    /// `max_wait` is refused at once with [`Refusal::RateLimited`](super::Refusal::RateLimited)
    /// (saying when the node could pay) or [`Refusal::InFlight`](super::Refusal::InFlight),
    /// instead of waiting. `Duration::ZERO` refuses whatever the node cannot pay now: "20 a
    /// minute" then means the 21st request of the minute is told to come back, as a gateway's
    /// caller expects. Defaults to no bound: the request waits for the node (up to its own
    /// deadline), out of the ordering, keeping its place.
    pub fn with_max_wait(self, max_wait: Duration) -> Self {
        Self {
            max_wait: Some(crate::timer::capped(max_wait)),
            ..self
        }
    }

    /// Scopes the node to one provider account: it applies only to requests admitted by the
    /// budget named `account` ([`Quota::with_name`](crate::Quota::with_name); a profile's
    /// budget is named after its profile, a Redis budget after its quota key, an unnamed one
    /// `default`), and the budgets of other accounts that serve the same tenants
    /// ([`Budget::with_tenants_of`](crate::Budget::with_tenants_of)) pass over it: its
    /// limits, calls in flight, daily caps and pause hold on that account alone. Defaults to
    /// every account the tenant uses.
    pub fn for_account(self, account: impl Into<std::sync::Arc<str>>) -> Self {
        Self {
            account: Some(account.into()),
            ..self
        }
    }

    /// The account the node is scoped to, if any ([`TenantNode::for_account`]).
    pub fn account(&self) -> Option<&str> {
        self.account.as_deref()
    }

    /// Adds a daily cap; one of the same dimension and window is replaced. A request that
    /// would take the day's use above it is refused at once (it does not wait for the next
    /// day). Defaults to none.
    pub fn with_cap(mut self, cap: PeriodCap) -> Self {
        self.daily
            .retain(|c| (c.dimension, c.window) != (cap.dimension, cap.window));
        self.daily.push(cap);
        self
    }

    /// The node's own limits.
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// The node's weight.
    pub fn weight(&self) -> NonZeroU32 {
        self.weight
    }

    /// The guaranteed share of the parent.
    pub fn guarantee(&self) -> f64 {
        self.guarantee
    }

    /// The most of the parent the node may use, when capped.
    pub fn max_share(&self) -> Option<f64> {
        self.max_share
    }

    /// The cap on calls in flight.
    pub fn max_in_flight(&self) -> Option<NonZeroUsize> {
        self.max_in_flight
    }

    /// How long a request may wait for this node's own limits and calls in flight, when
    /// bounded.
    pub fn max_wait(&self) -> Option<Duration> {
        self.max_wait
    }

    /// The daily caps.
    pub fn caps(&self) -> &[PeriodCap] {
        &self.daily
    }

    fn validate(&self, node: Option<&Tenant>) -> Result<(), InvalidTree> {
        if !(0.0..=1.0).contains(&self.guarantee) {
            return Err(InvalidTree::new(node, "a guarantee outside [0, 1]"));
        }
        if self.max_share.is_some_and(|max| !(max > 0.0 && max <= 1.0)) {
            return Err(InvalidTree::new(node, "a borrowing cap outside (0, 1]"));
        }
        if let Some(max) = self.max_share {
            if max < self.guarantee {
                return Err(InvalidTree::new(
                    node,
                    "the most a node may use is below its guarantee",
                ));
            }
        }
        Ok(())
    }
}

/// The tree of tenant quotas under one provider account (one [`Budget`](crate::Budget)).
///
/// Nodes are named by their [`Tenant`] path; a node need not have its parent configured.
/// A template per depth gives every node at that depth without its own configuration the same
/// one (every API key 60 requests a minute, say). Only nodes with traffic or a state of their
/// own (a pause, a day's use) hold memory at run time: see the [module docs](super).
///
/// With the `serde` feature, a tree deserializes from a configuration file (see the
/// [module docs](super#configuration-file)).
#[derive(Debug, Clone)]
pub struct TenantTree {
    pub(crate) nodes: HashMap<Tenant, TenantNode>,
    pub(crate) templates: Vec<(usize, TenantNode)>,
    pub(crate) default_tenant: Tenant,
    pub(crate) clock: WallClock,
    pub(crate) label_depth: usize,
}

impl Default for TenantTree {
    fn default() -> Self {
        Self::new()
    }
}

impl TenantTree {
    /// A tree with no node: every request passes the account only.
    pub fn new() -> Self {
        Self {
            nodes: HashMap::new(),
            templates: Vec::new(),
            default_tenant: Tenant::parse("default").expect("a valid path"),
            clock: WallClock::system(),
            label_depth: 1,
        }
    }

    /// Configures the node at `path` (replacing its configuration).
    pub fn with_node(mut self, path: Tenant, node: TenantNode) -> Self {
        self.nodes.insert(path, node);
        self
    }

    /// The nodes configured by path (not the templates), in no particular order.
    ///
    /// ```
    /// use tower_llm_quota::tenant::{TenantNode, TenantTree};
    ///
    /// let tree = TenantTree::new().with_node("acme".parse()?, TenantNode::new());
    /// assert_eq!(tree.nodes().map(|(path, _)| path.as_str()).collect::<Vec<_>>(), ["acme"]);
    /// # Ok::<(), tower_llm_quota::tenant::InvalidTenant>(())
    /// ```
    pub fn nodes(&self) -> impl Iterator<Item = (&Tenant, &TenantNode)> {
        self.nodes.iter()
    }

    /// Gives every node at `depth` (1: top-level tenants) that has no configuration of its
    /// own this one. Defaults to none.
    pub fn with_template(mut self, depth: usize, node: TenantNode) -> Self {
        self.templates.retain(|(d, _)| *d != depth);
        self.templates.push((depth, node));
        self
    }

    /// The tenant of requests that carry no [`Tenant`]. Defaults to `default`.
    pub fn with_default_tenant(self, tenant: Tenant) -> Self {
        Self {
            default_tenant: tenant,
            ..self
        }
    }

    /// The clock the calendar days of [`CapWindow::CalendarDayUtc`](super::CapWindow::CalendarDayUtc) are read from. Defaults to
    /// [`WallClock::system`].
    pub fn with_clock(self, clock: WallClock) -> Self {
        Self { clock, ..self }
    }

    /// How many segments of a path the per-tenant metrics keep as their `tenant` label
    /// (feature `metrics`): 1 labels by top-level tenant, so the series stay as many as
    /// those. Defaults to 1.
    pub fn with_label_depth(self, depth: usize) -> Self {
        Self {
            label_depth: depth.max(1),
            ..self
        }
    }

    /// The configuration of `path`: its own, else its depth's template.
    pub fn node(&self, path: &Tenant) -> Option<&TenantNode> {
        self.nodes.get(path).or_else(|| self.template(path.depth()))
    }

    /// The tenant of requests that carry none.
    pub fn default_tenant(&self) -> &Tenant {
        &self.default_tenant
    }

    /// How many segments of a path the per-tenant metrics keep.
    pub fn label_depth(&self) -> usize {
        self.label_depth
    }

    pub(crate) fn template(&self, depth: usize) -> Option<&TenantNode> {
        self.templates
            .iter()
            .find(|(d, _)| *d == depth)
            .map(|(_, node)| node)
    }

    /// Checks every node, and that the guarantees of configured siblings add up to at most
    /// their parent's whole.
    pub(crate) fn validate(&self) -> Result<(), InvalidTree> {
        let mut sums: HashMap<Option<Tenant>, f64> = HashMap::new();
        for (path, node) in &self.nodes {
            node.validate(Some(path))?;
            *sums.entry(path.parent()).or_default() += node.guarantee;
        }
        for (_, node) in &self.templates {
            node.validate(None)?;
        }
        match sums.into_iter().find(|(_, sum)| *sum > 1.0 + 1e-9) {
            Some((parent, _)) => Err(InvalidTree::new(
                parent.as_ref(),
                "the guarantees of a node's children add up to more than the whole",
            )),
            None => Ok(()),
        }
    }
}
