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
//! Each request carries a [`Flow`]: a tenant key and a weight. Inside a class, requests are
//! ordered by a *stamp*: for a budget without tenants the enqueue time (first in, first out);
//! with a [`TenantTree`](crate::tenant::TenantTree), requests of flows below their guarantee
//! first, then by the flow's virtual finish tag over token cost (weighted fair queuing, see
//! `tenant/fair.rs` for the bound), then by enqueue time.

pub(crate) mod order;
mod scheduling;
mod snapshot;

pub(crate) use crate::timer::saturating_deadline;
pub(crate) use scheduling::{Aging, Flow, Scheduling, depth};
pub use snapshot::{ClassSnapshot, QueueSnapshot};
