//! The gateway example, run in process on a loopback port: its keys, refusals, admin API,
//! streaming, metrics, shutdown, HTTPS upstreams and status page (in a real browser when one is installed).

use tower_llm_quota_test_support::redis_server;

mod admin;
mod api;
mod audit;
mod browser;
mod connections;
mod delegated;
mod gemini;
mod hard_caps;
mod keys;
mod ops;
#[cfg(feature = "otel")]
mod otel;
mod pushback;
mod replicas;
mod report;
mod restart;
mod routing;
mod scopes;
mod sdk;
mod shutdown;
mod spend;
mod state;
mod support;
mod tiers;
mod tls;
mod walkthrough;
