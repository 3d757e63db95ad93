//! Snapshots as data for health and debug endpoints (feature `serde`).
//!
//! Instants are given relative to the snapshot (`available_in_ms`, `full_in_ms`), since a
//! monotonic instant means nothing outside the process.

use serde::ser::{Serialize, Serializer};

use crate::budget::BudgetSnapshot;
use crate::queue::QueueSnapshot;

#[derive(serde::Serialize)]
struct Budget {
    waiters: usize,
    queued: Cost,
    limits: Vec<Limit>,
    #[serde(skip_serializing_if = "Option::is_none")]
    live_processes: Option<u32>,
}

#[derive(serde::Serialize)]
struct Cost {
    requests: u64,
    input_tokens: u64,
    output_tokens: u64,
}

#[derive(serde::Serialize)]
struct Limit {
    dimension: &'static str,
    period_seconds: f64,
    amount: u64,
    /// The share of `amount` planned now.
    share: f64,
    /// Whether the share is adaptive (else fixed).
    adaptive: bool,
    effective_amount: u64,
    capacity: u64,
    level: i64,
    debt: u64,
    available_in_ms: u64,
    full_in_ms: u64,
}

#[derive(serde::Serialize)]
struct Queue {
    depth: usize,
    classes: Vec<Class>,
}

#[derive(serde::Serialize)]
struct Class {
    priority: &'static str,
    depth: usize,
    oldest_wait_ms: u64,
}

/// A budget's snapshot as data (feature `serde`). The field names are part of the API:
///
/// | Field | Meaning |
/// |---|---|
/// | `waiters` | requests waiting for the budget now |
/// | `queued` | their summed cost: `requests`, `input_tokens`, `output_tokens` |
/// | `live_processes` | for a budget shared through a store, the live processes on the account at the store's last count (absent before it) |
/// | `limits` | one object per limit, in the quota's order: |
/// | `limits[].dimension` | `requests`, `input_tokens`, `output_tokens` or `total_tokens` ([`Dimension::as_str`](crate::Dimension::as_str)) |
/// | `limits[].period_seconds` | the limit's period, in seconds (a float) |
/// | `limits[].amount` | the nominal amount per period, as the provider states it |
/// | `limits[].share` | the share of `amount` planned now (fixed, or where the adaptive share stands) |
/// | `limits[].adaptive` | whether that share is adaptive |
/// | `limits[].effective_amount` | the amount refilled per period: `amount × share` |
/// | `limits[].capacity` | the most the bucket holds, and the largest cost it admits |
/// | `limits[].level` | what the bucket holds now (negative while in debt) |
/// | `limits[].debt` | usage settled above what was reserved, still to be paid back |
/// | `limits[].available_in_ms` | milliseconds until one unit is available (0: now) |
/// | `limits[].full_in_ms` | milliseconds until the bucket is full again |
///
/// Times are relative to the snapshot: a monotonic instant means nothing outside the
/// process.
impl Serialize for BudgetSnapshot {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let at = self.taken_at();
        let millis = |i: tokio::time::Instant| {
            u64::try_from(i.saturating_duration_since(at).as_millis()).unwrap_or(u64::MAX)
        };
        Budget {
            waiters: self.waiters(),
            queued: Cost {
                requests: self.queued().requests(),
                input_tokens: self.queued().input_tokens(),
                output_tokens: self.queued().output_tokens(),
            },
            limits: self
                .limits()
                .iter()
                .map(|l| Limit {
                    dimension: l.limit().dimension().as_str(),
                    period_seconds: l.limit().period().as_secs_f64(),
                    amount: l.limit().amount().get(),
                    share: l.limit().headroom(),
                    adaptive: l.limit().adaptive_share().is_some(),
                    effective_amount: l.limit().effective_amount(),
                    capacity: l.capacity(),
                    level: l.level(),
                    debt: l.debt(),
                    available_in_ms: millis(l.available_at()),
                    full_in_ms: millis(l.full_at()),
                })
                .collect(),
            live_processes: self.live_processes(),
        }
        .serialize(serializer)
    }
}

/// A queue's snapshot as data (feature `serde`). The field names are part of the API:
///
/// | Field | Meaning |
/// |---|---|
/// | `depth` | requests waiting, every class together |
/// | `classes` | one object per class, highest first: |
/// | `classes[].priority` | `interactive`, `async` or `batch` ([`Priority::as_str`](crate::Priority::as_str)) |
/// | `classes[].depth` | requests of the class waiting |
/// | `classes[].oldest_wait_ms` | how long the oldest of them has waited, in milliseconds |
impl Serialize for QueueSnapshot {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        Queue {
            depth: self.depth(),
            classes: self
                .classes()
                .iter()
                .map(|c| Class {
                    priority: c.priority().as_str(),
                    depth: c.depth(),
                    oldest_wait_ms: u64::try_from(c.oldest_wait().as_millis()).unwrap_or(u64::MAX),
                })
                .collect(),
        }
        .serialize(serializer)
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;
    use std::time::Duration;

    use crate::{Budget, Cost, Dimension, Limit, PriorityQueueLayer, Quota};

    #[tokio::test(start_paused = true)]
    async fn snapshots_serialize_with_relative_times() {
        let limit = Limit::new(
            Dimension::TotalTokens,
            NonZeroU64::new(600).unwrap(),
            Duration::from_secs(60),
        )
        .unwrap()
        .with_headroom(1.0)
        .unwrap()
        .with_burst(NonZeroU64::new(100).unwrap());
        let budget = Budget::new(Quota::new().with_limit(limit));
        budget.try_reserve(Cost::new(150, 0)).unwrap_err();
        budget
            .try_reserve(Cost::new(40, 0))
            .unwrap()
            .charge_estimate();
        let json = serde_json::to_value(budget.snapshot()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "waiters": 0,
                "queued": {"requests": 0, "input_tokens": 0, "output_tokens": 0},
                "limits": [{
                    "dimension": "total_tokens", "period_seconds": 60.0, "amount": 600,
                    "share": 1.0, "adaptive": false, "effective_amount": 600, "capacity": 100, "level": 60, "debt": 0,
                    "available_in_ms": 0, "full_in_ms": 4000
                }]
            })
        );
        let queue = PriorityQueueLayer::default().handle().snapshot();
        let json = serde_json::to_value(queue).unwrap();
        assert_eq!(json["depth"], 0);
        assert_eq!(json["classes"][0]["priority"], "interactive");
    }
}
