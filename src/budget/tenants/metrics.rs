//! Per-tenant series (feature `metrics`), labelled by the first segments of the path (the
//! tree's label depth), so their number stays that of the tenants at that depth.
//!
//! - `llm_tenant_tokens_total{tenant, share}`: tokens settled, `share` `guaranteed` while the
//!   tenant's use of the last minute is within its guarantee, else `borrowed`.
//! - `llm_tenant_refusals_total{scope, reason}`: requests refused by a scope (`paused`,
//!   `cap` (a cap over a day or a month spent), `too_large`, `rate_limited`, `in_flight`), the scope cut to the label depth.

use crate::tenant::{Refusal, TenantRefused};

/// Counts a settlement's `amount` of tokens for `tenant` (the label-depth prefix of its
/// path), as `share` (`guaranteed`, `borrowed` or `none`).
pub(crate) fn settled(tenant: &str, share: &'static str, amount: u64) {
    metrics::counter!("llm_tenant_tokens_total", "tenant" => tenant.to_owned(), "share" => share)
        .increment(amount);
}

/// Counts a refusal by a scope.
pub(crate) fn refused(label_depth: usize, refusal: &TenantRefused) {
    let reason = match refusal.reason {
        Refusal::Paused => "paused",
        Refusal::PeriodCap { .. } => "cap",
        Refusal::TooLarge { .. } => "too_large",
        Refusal::RateLimited { .. } => "rate_limited",
        Refusal::InFlight { .. } => "in_flight",
    };
    let scope = refusal.scope.prefix(label_depth).to_owned();
    metrics::counter!("llm_tenant_refusals_total", "scope" => scope, "reason" => reason)
        .increment(1);
}
