//! The Postgres store against a database of its own on the machine's server (and private
//! clusters it kills and restarts): the shared-store suite, per admission and leasing.

#[path = "../common/mod.rs"]
mod common;
mod failures;
mod functions;
mod lease_churn;
mod suite;
mod support;
