//! What the stack traces: one span per logical request with its waits, attempts, usage and
//! decision, and every routing decision as an event.
//!
//! A binary of its own, whose every test reads through a subscriber of its thread: tracing
//! caches each callsite's interest across threads, so a test emitting unobserved on another
//! thread at the moment a callsite is first seen could hide its events from these.

use tower_llm_quota_test_support as support;

#[path = "../layers/routing_support.rs"]
mod routing_support;

mod routing;
mod spans;
