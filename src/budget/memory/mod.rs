//! The in-memory backend: the token buckets of a budget's limits (`bucket.rs`, pure
//! arithmetic), the store that holds them under the budget's lock (`store.rs`, also the
//! buckets of each tenant node and a shared budget's local fallback share), and the adaptive
//! share's controller (`share.rs`).

pub(crate) mod bucket;
pub(crate) mod share;
pub(crate) mod store;
