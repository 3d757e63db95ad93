//! The layers and the stack they make: admission and settlement around tower-test mocks, the
//! queue, retry and its classification of ambiguous failures, estimation, idempotency,
//! grouping, routing, the public surface as a new user meets it, and a chaos soak through the
//! whole stack, under tokio's paused clock where time matters.

use tower_llm_quota_test_support as support;

mod ambiguity;
mod api;
mod estimate;
mod group;
mod idempotency;
mod in_flight;
mod queue;
mod reconcile;
mod retry;
mod routing;
mod routing_support;
mod soak;
mod stack;
mod token_budget;
