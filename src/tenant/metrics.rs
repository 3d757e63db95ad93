//! Per-tenant series (feature `metrics`), labelled by the first segments of the path (the
//! tree's label depth), so their number stays that of the tenants at that depth.
//!
//! - `llm_tenant_tokens_total{tenant, share}`: tokens settled, `share` `guaranteed` while the
//!   tenant's use of the last minute is within its guarantee, else `borrowed`.
//! - `llm_tenant_refusals_total{scope, reason}`: requests refused by a scope (`paused`,
//!   `daily_cap`, `too_large`), the scope cut to the label depth.

use super::error::{Refusal, TenantRefused};
use super::path::Tenant;
use super::tree::Tenants;
use crate::cost::Cost;

/// Counts a settlement's tokens as guaranteed or borrowed, for the label-depth node.
pub(crate) fn settled(tenants: &mut Tenants, path: &Tenant, actual: &Cost, now: u64) {
    let label = path.prefix(tenants.tree.label_depth).to_owned();
    let amount = actual.amount(tenants.reference.0);
    if amount == 0 {
        return;
    }
    let share = match tenants.get_mut(path.as_str()) {
        Some(node) if node.guaranteed > 0 => {
            if node.meter.get(now) <= node.guaranteed {
                "guaranteed"
            } else {
                "borrowed"
            }
        }
        _ => "none",
    };
    metrics::counter!("llm_tenant_tokens_total", "tenant" => label, "share" => share)
        .increment(amount);
}

/// Counts a refusal by a scope.
pub(crate) fn refused(label_depth: usize, refusal: &TenantRefused) {
    let reason = match refusal.reason {
        Refusal::Paused => "paused",
        Refusal::DailyCap { .. } => "daily_cap",
        Refusal::TooLarge { .. } => "too_large",
    };
    let scope = refusal.scope.prefix(label_depth).to_owned();
    metrics::counter!("llm_tenant_refusals_total", "scope" => scope, "reason" => reason)
        .increment(1);
}
