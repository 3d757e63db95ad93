//! What became of each item, and of the whole run.

use std::fmt;

/// Tokens attributed to an item: its share of every call it took part in (the shared
/// instructions split evenly between a group's items, each item's own text and answer whole).
/// Over a run, the items' usage adds up to what the provider reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ItemUsage {
    /// Input (prompt) tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
}

impl ItemUsage {
    /// Input plus output tokens.
    pub fn total(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    pub(crate) fn add(&mut self, input: u64, output: u64) {
        self.input_tokens = self.input_tokens.saturating_add(input);
        self.output_tokens = self.output_tokens.saturating_add(output);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// The answers were missing, duplicated or invalid on every attempt.
    Rejected,
    /// Its calls failed: a permanent error alone, or transient errors of its group in a row.
    Call,
    /// The item's deadline passed before it could be put in a group.
    Deadline,
}

/// Why an item has no result: its last reason, after its attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemFailure {
    pub(crate) kind: FailureKind,
    pub(crate) reason: String,
}

impl ItemFailure {
    /// Its answer was missing, duplicated or failed validation on its last attempt.
    pub fn is_rejected(&self) -> bool {
        self.kind == FailureKind::Rejected
    }

    /// Its last call failed (an error, or a status other than success).
    pub fn is_call_failed(&self) -> bool {
        self.kind == FailureKind::Call
    }

    /// Its deadline passed before it was sent (again).
    pub fn is_deadline_passed(&self) -> bool {
        self.kind == FailureKind::Deadline
    }

    /// The reason, in words.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for ItemFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for ItemFailure {}

/// How one item ended.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemOutcome<T> {
    /// The item's id.
    pub id: String,
    /// Its validated result, or why it has none.
    pub result: Result<T, ItemFailure>,
    /// Requests it took part in (those the stack refused before sending included, answers
    /// replayed from an idempotency record aside).
    pub attempts: u32,
    /// Whether it was sent again after a bad answer or a failed call.
    pub resent: bool,
    /// Whether it was sent again on its own.
    pub resent_alone: bool,
    /// Its share of the tokens of its calls.
    pub usage: ItemUsage,
}

/// The figures of a run of groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupStats {
    /// Requests sent (groups sent, a group sent again included).
    pub calls: u64,
    /// Requests answered without a call of their own: a record an idempotency layer below
    /// replayed, or a call in flight it joined (the provider's calls are `calls -
    /// replayed_calls`).
    pub replayed_calls: u64,
    /// Calls whose answer was read (whatever it held), replays aside.
    pub answered_calls: u64,
    /// Input tokens the provider reported over every call.
    pub input_tokens: u64,
    /// Output tokens the provider reported over every call.
    pub output_tokens: u64,
    /// Items sent again at least once.
    pub items_resent: u64,
    /// Items sent again on their own at least once.
    pub items_resent_alone: u64,
    /// Items with no result in the end.
    pub items_failed: u64,
    /// Answers that held no readable JSON array.
    pub malformed_answers: u64,
    /// Answer elements naming no item of their group (a wrong id).
    pub unknown_answers: u64,
}

/// A run's outcomes, one per item in the order given, and its figures.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupReport<T> {
    /// One outcome per item.
    pub outcomes: Vec<ItemOutcome<T>>,
    /// The run's figures.
    pub stats: GroupStats,
}
