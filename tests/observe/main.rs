//! What the stack tells: its metrics through the `metrics` facade (feature `metrics`), per
//! tenant and per route.

mod metrics;
mod routing_metrics;
mod tenant_metrics;
