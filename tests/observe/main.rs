//! What the stack tells: its metrics through the `metrics` facade (feature `metrics`), per
//! tenant and per route, and its tracing spans.

mod metrics;
mod routing_metrics;
mod tenant_metrics;
mod tracing;
