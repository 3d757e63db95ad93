//! How groups are formed and how bad answers are sent again.

use std::fmt;
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

/// The item limit of the [default](GroupConfig::default) configuration: the batch articles'
/// "comfortable" group size. Test before going higher: answers get worse as groups grow.
pub const DEFAULT_MAX_ITEMS: usize = 10;

/// The largest item limit accepted.
pub const MAX_ITEMS_LIMIT: usize = 1_000;

/// How items are sent again after a bad answer in a group (their element missing, named
/// twice or rejected, or the whole answer malformed). Alone, an item is always sent again
/// alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Resend {
    /// Regrouped with other items to send again (groups of at most
    /// [`max_items`](GroupConfig::max_items)), and alone once such a group has failed them
    /// too (the default: few calls, and a sure answer in the end).
    #[default]
    Regroup,
    /// Each on its own, in a group of one, at once.
    Alone,
    /// In groups at most half the size of the one that failed them (one at the least).
    Smaller,
}

/// Why a [`GroupConfig`] was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidGroupConfig(&'static str);

impl fmt::Display for InvalidGroupConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid grouping configuration: {}", self.0)
    }
}

impl std::error::Error for InvalidGroupConfig {}

/// How groups are formed.
///
/// # Example
///
/// ```
/// use std::num::{NonZeroU32, NonZeroU64};
/// use tower_llm_quota::group::{GroupConfig, Resend};
///
/// let config = GroupConfig::new()
///     .max_items(20)?
///     .max_cost(NonZeroU64::new(12_000).unwrap())
///     .max_attempts(NonZeroU32::new(4).unwrap())
///     .resend(Resend::Smaller);
/// assert_eq!(config.items_limit(), 20);
/// # Ok::<(), tower_llm_quota::group::InvalidGroupConfig>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupConfig {
    pub(crate) max_items: NonZeroUsize,
    pub(crate) max_cost: Option<u64>,
    pub(crate) max_attempts: NonZeroU32,
    pub(crate) resend: Resend,
    pub(crate) item_output: u64,
    pub(crate) answer_overhead: u64,
    pub(crate) linger: Duration,
    pub(crate) regroup_wait: Duration,
    pub(crate) max_in_flight: NonZeroUsize,
}

impl Default for GroupConfig {
    fn default() -> Self {
        Self {
            max_items: NonZeroUsize::new(DEFAULT_MAX_ITEMS).expect("ten is not zero"),
            max_cost: None,
            max_attempts: NonZeroU32::new(3).expect("three is not zero"),
            resend: Resend::Regroup,
            item_output: 100,
            answer_overhead: 16,
            linger: Duration::from_millis(20),
            regroup_wait: Duration::from_secs(30),
            max_in_flight: NonZeroUsize::new(256).expect("256 is not zero"),
        }
    }
}

impl GroupConfig {
    /// The defaults: groups of at most 10 items, no cost cap, 3 attempts per item, bad answers
    /// regrouped with the other items to send again (then alone), 100 output tokens per item,
    /// 16 tokens of answer overhead per item, a linger of 20 ms, a regroup wait of 30 s, 256
    /// groups in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// Items per group at most. Defaults to [`DEFAULT_MAX_ITEMS`].
    ///
    /// # Errors
    ///
    /// When `items` is 0 or above [`MAX_ITEMS_LIMIT`].
    pub fn max_items(self, items: usize) -> Result<Self, InvalidGroupConfig> {
        match NonZeroUsize::new(items) {
            Some(max_items) if items <= MAX_ITEMS_LIMIT => Ok(Self { max_items, ..self }),
            Some(_) => Err(InvalidGroupConfig("more than 1,000 items per group")),
            None => Err(InvalidGroupConfig("a group of zero items")),
        }
    }

    /// The largest estimated cost (input plus reserved output tokens) of a group: a group is
    /// closed before an item that would take it past this. An item that costs more on its own
    /// is sent alone. Keep it below the budget's token capacity, or a group can never be
    /// admitted. Defaults to no cap.
    pub fn max_cost(self, tokens: std::num::NonZeroU64) -> Self {
        Self {
            max_cost: Some(tokens.get()),
            ..self
        }
    }

    /// Caps the estimated cost of a group at what `budget` can admit at once: the smallest
    /// capacity (burst) of its token limits. An item that costs more on its own is still sent
    /// alone, and refused by the budget as too large.
    pub fn fit_budget(self, budget: &crate::budget::Budget) -> Self {
        let capacity = budget
            .snapshot()
            .limits()
            .iter()
            .filter(|limit| limit.limit().dimension() != crate::quota::Dimension::Requests)
            .map(|limit| limit.capacity())
            .min();
        Self {
            max_cost: capacity.or(self.max_cost),
            ..self
        }
    }

    /// Failed calls an item may have alone before it fails with its last reason (a permanent
    /// failure alone fails it at once); and transient failures in a row of one group before
    /// its items fail with the provider's reason. A group's other failures are charged to
    /// none of its items: a permanent failure bisects the group until the item that fails
    /// stands alone, a bad answer sends its items again as [`resend`](Self::resend) says,
    /// so an item never fails for a neighbour. Defaults to 3.
    pub fn max_attempts(self, attempts: NonZeroU32) -> Self {
        Self {
            max_attempts: attempts,
            ..self
        }
    }

    /// How items with a bad answer in a group are sent again. Defaults to
    /// [`Resend::Regroup`].
    pub fn resend(self, resend: Resend) -> Self {
        Self { resend, ..self }
    }

    /// The output tokens of an item that does not say ([`GroupItem::expected_output`](super::GroupItem::expected_output)).
    /// Defaults to 100.
    pub fn item_output(self, tokens: u64) -> Self {
        Self {
            item_output: tokens,
            ..self
        }
    }

    /// Output tokens reserved per item on top of its answer: its id and the JSON around it.
    /// Defaults to 16.
    pub fn answer_overhead(self, tokens: u64) -> Self {
        Self {
            answer_overhead: tokens,
            ..self
        }
    }

    /// How long a [`GroupQueue`](super::GroupQueue) waits for more items before it sends a
    /// group that is not full (items submitted one by one, by job handlers say). Defaults to
    /// 20 ms.
    ///
    /// # Errors
    ///
    /// When `linger` is above one hour.
    pub fn linger(self, linger: Duration) -> Result<Self, InvalidGroupConfig> {
        if linger > Duration::from_secs(3_600) {
            return Err(InvalidGroupConfig("a linger of more than an hour"));
        }
        Ok(Self { linger, ..self })
    }

    /// How long items to send again wait for others to fill their group while calls are in
    /// flight (a group of them goes at once when full, or when nothing is in flight that could
    /// add to it). Defaults to 30 s.
    ///
    /// # Errors
    ///
    /// When `wait` is above one hour.
    pub fn regroup_wait(self, wait: Duration) -> Result<Self, InvalidGroupConfig> {
        if wait > Duration::from_secs(3_600) {
            return Err(InvalidGroupConfig("a regroup wait of more than an hour"));
        }
        Ok(Self {
            regroup_wait: wait,
            ..self
        })
    }

    /// Groups handed to the service and not answered yet, at most: the rest wait in the
    /// grouper, formed when a call ends, so a batch of a million items does not fill the
    /// stack's queue (whose depth is bounded) with groups. Keep it above the calls the stack
    /// lets run at once. Defaults to 256.
    pub fn max_in_flight(self, groups: NonZeroUsize) -> Self {
        Self {
            max_in_flight: groups,
            ..self
        }
    }

    /// The item limit.
    pub fn items_limit(&self) -> usize {
        self.max_items.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_values_are_refused_with_a_reason() {
        let config = GroupConfig::new();
        assert_eq!(
            config.clone().max_items(0).unwrap_err().to_string(),
            "invalid grouping configuration: a group of zero items"
        );
        assert!(config.clone().max_items(MAX_ITEMS_LIMIT + 1).is_err());
        assert_eq!(config.clone().max_items(1).unwrap().items_limit(), 1);
        assert!(config.clone().linger(Duration::MAX).is_err());
        assert!(config.clone().regroup_wait(Duration::MAX).is_err());
        assert_eq!(config.items_limit(), DEFAULT_MAX_ITEMS);
    }
}
