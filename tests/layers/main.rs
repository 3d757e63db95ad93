//! TokenBudgetLayer and ReconcileLayer around tower-test mocks, under tokio's paused clock.

use tower_llm_quota_test_support as support;

mod in_flight;
mod queue;
mod reconcile;
mod token_budget;
