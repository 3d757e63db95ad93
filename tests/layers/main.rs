//! TokenBudgetLayer and ReconcileLayer around tower-test mocks, under tokio's paused clock.

#[path = "../support/mod.rs"]
mod support;

mod in_flight;
mod queue;
mod reconcile;
mod token_budget;
