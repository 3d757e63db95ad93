//! What passes between the planner and a group's call: the group formed, and what its call
//! gave.

use bytes::Bytes;

use crate::cost::Cost;
use crate::priority::{Deadline, Priority};
use crate::quota::Dimension;

/// A group ready to send.
#[derive(Debug, Clone)]
pub(crate) struct FormedGroup {
    pub(crate) members: Vec<usize>,
    pub(crate) priority: Priority,
    pub(crate) deadline: Option<Deadline>,
    pub(crate) cost: Cost,
    /// The request's body: everything the model sees, and its parameters.
    pub(crate) body: Bytes,
    /// Derived from the request (its endpoint and body), the members' own keys and how often
    /// each was regrouped: two groups the model sees differently never share a key, the same
    /// group sent again has the same key.
    pub(crate) key: String,
    /// Transient failures of this very group in a row.
    pub(super) transient: u32,
}

/// What a group's call gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CallResult {
    /// An answer to split: the model's text, the usage reported (input, output), and whether
    /// it came without a call of this grouper (replayed from an idempotency record, or a
    /// call in flight joined).
    Answered {
        text: String,
        usage: Option<(u64, u64)>,
        replayed: bool,
    },
    /// The call failed. A transient failure sends the same group again; a permanent one
    /// bisects it (or fails an item sent alone).
    Failed {
        transient: bool,
        reason: String,
        usage: Option<(u64, u64)>,
    },
    /// The budget below can never admit the group's cost: at most `capacity` of `dimension`.
    /// Nothing was sent.
    TooLarge {
        dimension: Dimension,
        capacity: u64,
        reason: String,
    },
}
