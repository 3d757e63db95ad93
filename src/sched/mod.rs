//! The one ordering every waiting request follows, wherever it waits.
//!
//! A request can wait for several things: the quota (in memory or in a shared store), a
//! concurrency slot, the share of a bucket a class floor keeps, an inner service that is not
//! ready. Each of these waits is an [`Order`](order::Order): effective class first (a class's
//! front ages up, see [`QueueConfig::promote_after`](crate::QueueConfig::promote_after)),
//! then enqueue time, then arrival. The next request served is always the one the order names,
//! whatever the binding resource, because every resource is admitted at one place: a budget
//! admits tokens and its in-flight slot together, from the head of its order.
//!
//! Plain data, no clock of its own and no locking: the owner (a budget, a queue) holds it under
//! its mutex and passes the time in.
//!
//! # Tenants
//!
//! Each request carries a [`Flow`]: a tenant key, a weight and the node guaranteeing it a
//! share. Inside a class, a budget without tenants serves requests in the order they came;
//! with a [`TenantTree`](crate::tenant::TenantTree), the class's fair share (`sched/fair.rs`,
//! with its bound) chooses at each admission: a flow owed its guarantee first, then the
//! smallest weighted-fair-queuing tag over token cost, each flow's requests in the order they
//! came.

// No function of the admission path is longer than a screen (clippy.toml).
#![warn(clippy::too_many_lines)]

mod fair;
pub(crate) mod order;
mod scheduling;
mod snapshot;

pub(crate) use crate::timer::saturating_deadline;
pub(crate) use scheduling::{Aging, Flow, Scheduling, depth};
pub use snapshot::{ClassSnapshot, QueueSnapshot};
