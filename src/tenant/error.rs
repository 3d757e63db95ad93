//! The tenant errors: a bad path or tree, and a refusal by a scope.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::path::Tenant;
use crate::quota::Dimension;
use crate::quota::cap::{CapWindow, Utc};

/// A tenant tree that cannot be enforced: a share outside `[0, 1]`, guarantees of siblings
/// above their parent's whole, a cap below the guarantee.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidTree {
    pub(crate) node: Option<Tenant>,
    pub(crate) reason: &'static str,
}

impl InvalidTree {
    pub(crate) fn new(node: Option<&Tenant>, reason: &'static str) -> Self {
        Self {
            node: node.cloned(),
            reason,
        }
    }

    /// The node at fault, when one is.
    pub fn node(&self) -> Option<&Tenant> {
        self.node.as_ref()
    }

    /// What is wrong, in words.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

impl fmt::Display for InvalidTree {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.node {
            Some(node) => write!(f, "invalid tenant tree at `{node}`: {}", self.reason),
            None => write!(f, "invalid tenant tree: {}", self.reason),
        }
    }
}

impl std::error::Error for InvalidTree {}

/// A request refused by a scope of its tenant path, locally, before anything was sent.
///
/// [`scope`](TenantRefused::scope) names the node that refused (the request's path or one of
/// its ancestors); [`reason`](TenantRefused::reason) says why. A cap of the account itself
/// ([`Quota::with_cap`](crate::Quota::with_cap)) refuses as a scope above every tenant:
/// [`account`](TenantRefused::account) then names the account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantRefused {
    pub(crate) scope: Tenant,
    pub(crate) reason: Refusal,
}

/// Why a scope refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The scope is paused ([`TenantHandle::pause`](super::TenantHandle::pause)): its queued
    /// and new requests are refused until it is resumed.
    Paused,
    /// The scope's cap in `dimension` over a period is spent: `used` of `cap` in the current
    /// `window`, until `resets_at`.
    PeriodCap {
        /// The capped dimension.
        dimension: Dimension,
        /// The cap's period.
        window: CapWindow,
        /// The cap.
        cap: u64,
        /// What the window has used, reservations included.
        used: u64,
        /// When the window admits again: the next calendar day or month (UTC); for a rolling
        /// day, the next quarter hour, when its oldest quarter hour leaves it.
        resets_at: SystemTime,
        /// Whether the cap is soft ([`PeriodCap::soft`](crate::tenant::PeriodCap::soft)):
        /// a request is never reshaped to fit it.
        soft: bool,
    },
    /// The scope's own limit cannot pay the cost within the scope's
    /// [`max_wait`](super::TenantNode::with_max_wait): it could in `retry_after`.
    RateLimited {
        /// The dimension of the limit that binds.
        dimension: Dimension,
        /// That limit's period.
        period: Duration,
        /// When the scope could pay the cost, from now (other requests of the scope
        /// permitting).
        retry_after: Duration,
    },
    /// Every call in flight the scope allows is taken, past the scope's
    /// [`max_wait`](super::TenantNode::with_max_wait).
    InFlight {
        /// The scope's cap on calls in flight.
        max: usize,
    },
    /// The cost exceeds the capacity of one of the scope's limits: it can never be admitted.
    TooLarge {
        /// The dimension of the limit.
        dimension: Dimension,
        /// The amount asked.
        cost: u64,
        /// The limit's capacity.
        capacity: u64,
    },
}

impl TenantRefused {
    /// The node that refused. For a cap of the account itself, `/` and the account's name
    /// (no tenant's path): see [`account`](TenantRefused::account).
    pub fn scope(&self) -> &Tenant {
        &self.scope
    }

    /// The account, when a cap of the account itself refused
    /// ([`Quota::with_cap`](crate::Quota::with_cap)) rather than a node of the tree.
    pub fn account(&self) -> Option<&str> {
        self.scope.account_name()
    }

    /// Why.
    pub fn reason(&self) -> Refusal {
        self.reason
    }

    /// Whether the scope is paused.
    pub fn is_paused(&self) -> bool {
        matches!(self.reason, Refusal::Paused)
    }

    /// Whether a cap of the scope over a period (a day, a month) is spent.
    pub fn is_capped(&self) -> bool {
        matches!(self.reason, Refusal::PeriodCap { .. })
    }

    /// Whether the scope's own limit or cap on calls in flight refused it (its
    /// [`max_wait`](super::TenantNode::with_max_wait) would be passed).
    pub fn is_rate_limited(&self) -> bool {
        matches!(
            self.reason,
            Refusal::RateLimited { .. } | Refusal::InFlight { .. }
        )
    }

    /// What a hard cap over a period that refused the request has left, in its dimension:
    /// the cap less what its period has used (reservations in flight included). A client
    /// may send the request again with a cost within it (a lower `max_tokens`); another
    /// request may take it first. `None` for any other refusal, and for a soft cap.
    ///
    /// ```
    /// # use tower_llm_quota::tenant::TenantRefused;
    /// fn lowered(refused: &TenantRefused) -> Option<u64> {
    ///     let (_dimension, left) = refused.cap_left()?;
    ///     Some(left)
    /// }
    /// ```
    pub fn cap_left(&self) -> Option<(Dimension, u64)> {
        match self.reason {
            Refusal::PeriodCap {
                dimension,
                cap,
                used,
                soft: false,
                ..
            } => Some((dimension, cap.saturating_sub(used))),
            _ => None,
        }
    }

    /// When the scope could pay the cost, when its limit refused it.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.reason {
            Refusal::RateLimited { retry_after, .. } => Some(retry_after),
            _ => None,
        }
    }
}

impl fmt::Display for TenantRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let who = match self.account() {
            Some(account) => format!("account `{account}`"),
            None => format!("tenant `{}`", self.scope),
        };
        match self.reason {
            Refusal::Paused => write!(f, "{who} is paused"),
            Refusal::PeriodCap {
                dimension,
                window,
                cap,
                used,
                resets_at,
                ..
            } => {
                let unix = resets_at.duration_since(UNIX_EPOCH).unwrap_or_default();
                write!(
                    f,
                    "{who} spent its cap of {cap} {dimension} a {window} ({used} used; starts \
                     again at {})",
                    Utc(unix.as_secs())
                )
            }
            Refusal::RateLimited {
                dimension,
                period,
                retry_after,
            } => write!(
                f,
                "{who} is over its {dimension} limit per {period:?} (it could pay in \
                 {retry_after:?})"
            ),
            Refusal::InFlight { max } => {
                write!(f, "{who} has its {max} calls in flight")
            }
            Refusal::TooLarge {
                dimension,
                cost,
                capacity,
            } => write!(
                f,
                "a cost of {cost} {dimension} exceeds the capacity of {capacity} of {who}"
            ),
        }
    }
}

impl std::error::Error for TenantRefused {}
