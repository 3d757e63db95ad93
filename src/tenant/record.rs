//! Caps' counts that outlive a process: the seam a budget writes them to as they change, and
//! restores them from.

use std::fmt;

use crate::quota::PeriodCap;
use crate::tenant::Tenant;

/// What a cap over a period belongs to: a tenant node, or a provider account's own caps
/// ([`Quota::with_cap`](crate::Quota::with_cap)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CapScope<'a> {
    /// A node of the tenant tree.
    Node(&'a Tenant),
    /// An account, named as its budget's quota is.
    Account(&'a str),
}

/// Where a budget writes the counts of its caps over a period as they change, so that they
/// outlive its process: a gateway restarted mid-month finds its spend caps as they were
/// (restored with [`TenantHandle::restore_cap`](crate::tenant::TenantHandle::restore_cap)).
///
/// [`counted`](CapRecord::counted) is called under the budget's lock at every change
/// (an admission counts its estimate, a settlement its correction, a refund its return): it
/// must not block. A durable record queues the write and commits it on a thread of its own;
/// whoever must know a count is durable before acting (a gateway sending a request whose
/// estimate a cap counts) waits for that commit.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use tower_llm_quota::tenant::{CapRecord, CapScope, PeriodCap};
///
/// /// Keeps the last count of each period, as a database table would.
/// #[derive(Debug, Default)]
/// struct Counts(Mutex<Vec<(String, u64, u64)>>);
///
/// impl CapRecord for Counts {
///     fn counted(&self, scope: CapScope<'_>, _cap: &PeriodCap, since: u64, used: u64) {
///         let name = match scope {
///             CapScope::Node(node) => node.as_str().to_owned(),
///             CapScope::Account(account) => format!("account:{account}"),
///             _ => return,
///         };
///         self.0.lock().unwrap().push((name, since, used));
///     }
/// }
/// # let _ = Arc::new(Counts::default());
/// ```
pub trait CapRecord: Send + Sync + fmt::Debug + 'static {
    /// `scope`'s `cap` holds `used` in the period that began at `since` (seconds since the
    /// epoch: the calendar day's or month's first second, or for a rolling cap the quarter
    /// hour's). A later call for the same period replaces an earlier one.
    fn counted(&self, scope: CapScope<'_>, cap: &PeriodCap, since: u64, used: u64);
}
