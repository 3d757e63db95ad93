//! One work item of a grouped batch.

use sha2::{Digest, Sha256};

use crate::priority::{Deadline, Priority};

/// One item to answer: an id (unique in the batch), its own text, and optionally the output it
/// needs, its class, its deadline and its own idempotency key.
///
/// # Example
///
/// ```
/// use tower_llm_quota::Priority;
/// use tower_llm_quota::group::GroupItem;
///
/// let item = GroupItem::new("ticket-7", "I was charged twice.")
///     .expected_output(40)
///     .priority(Priority::Async)
///     .key("job-7");
/// assert_eq!(item.idempotency_key(), "job-7");
/// // Without a key of its own, an item is named by its content, not its id.
/// let a = GroupItem::new("1", "Classify: refund please");
/// let b = GroupItem::new("1", "Translate: refund please");
/// assert_ne!(a.idempotency_key(), b.idempotency_key());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupItem {
    id: String,
    text: String,
    expected_output: Option<u64>,
    priority: Priority,
    deadline: Option<Deadline>,
    key: Option<String>,
}

impl GroupItem {
    /// An item of class [`Priority::Batch`], no deadline, named by its content (its id and
    /// text) for idempotency, and the configuration's
    /// [default output](super::GroupConfig::item_output).
    pub fn new(id: impl Into<String>, text: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            text: text.into(),
            expected_output: None,
            priority: Priority::Batch,
            deadline: None,
            key: None,
        }
    }

    /// The output tokens this item's answer needs at most (its share of the group's
    /// `max_tokens`). Defaults to the configuration's [`item_output`](super::GroupConfig::item_output).
    pub fn expected_output(self, tokens: u64) -> Self {
        Self {
            expected_output: Some(tokens),
            ..self
        }
    }

    /// The item's class: a group holds items of one class and is sent with it. Defaults to
    /// [`Priority::Batch`].
    pub fn priority(self, priority: Priority) -> Self {
        Self { priority, ..self }
    }

    /// The instant after which the item is not put in a group any more (it fails with
    /// [`deadline passed`](super::ItemFailure::is_deadline_passed)); a group is sent with the
    /// earliest deadline of its items. Defaults to none.
    pub fn deadline(self, deadline: Deadline) -> Self {
        Self {
            deadline: Some(deadline),
            ..self
        }
    }

    /// The item's own idempotency key (a durable job's id, say): part of its groups' keys,
    /// beside everything the model sees (so two items with the same text but different keys
    /// never share a stored answer). Defaults to a hash of the item's id and text.
    pub fn key(self, key: impl Into<String>) -> Self {
        Self {
            key: Some(key.into()),
            ..self
        }
    }

    /// The item's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The item's own text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The output it needs, if set.
    pub fn output(&self) -> Option<u64> {
        self.expected_output
    }

    /// Its class.
    pub fn class(&self) -> Priority {
        self.priority
    }

    /// Its deadline, if any.
    pub fn due(&self) -> Option<Deadline> {
        self.deadline
    }

    /// Its idempotency key: the one set, or `item-` and 32 hex digits of SHA-256 over its id
    /// and text.
    pub fn idempotency_key(&self) -> String {
        if let Some(key) = &self.key {
            return key.clone();
        }
        let mut hash = Sha256::new();
        for part in [&self.id, &self.text] {
            hash.update((part.len() as u64).to_le_bytes());
            hash.update(part.as_bytes());
        }
        hex_key("item-", &hash.finalize())
    }
}

/// `prefix` and the first 16 bytes of `digest` in hex.
pub(super) fn hex_key(prefix: &str, digest: &[u8]) -> String {
    use std::fmt::Write;
    let mut key = String::with_capacity(prefix.len() + 32);
    key.push_str(prefix);
    for byte in &digest[..16] {
        let _ = write!(key, "{byte:02x}");
    }
    key
}
