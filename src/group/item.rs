//! One work item of a grouped batch.

use crate::priority::{Deadline, Priority};

/// One item to answer: an id (unique in the batch), its own text, and optionally the output it
/// needs, its class, its deadline and its idempotency key.
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
    /// An item of class [`Priority::Batch`], no deadline, its id as its idempotency key, and
    /// the configuration's [default output](super::GroupConfig::item_output).
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

    /// The item's idempotency key (a durable job's id, say), from which its groups' keys are
    /// derived. Defaults to the item's id.
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

    /// Its idempotency key: the one set, or its id.
    pub fn idempotency_key(&self) -> &str {
        self.key.as_deref().unwrap_or(&self.id)
    }
}
