//! Settlements of admitted requests, and the statistics.

use std::time::Duration;

use super::*;
use crate::SimStats;
use crate::stats::{self, Counters};
use tower_llm_quota::Dimension;

impl Engine {
    /// Replaces the admission's `max_tokens` with the real completion.
    pub(super) fn settle(&self, settlement: &Settlement) {
        let (mut state, now) = self.lock();
        let unused = settlement
            .max_tokens
            .saturating_sub(settlement.completion_tokens);
        for (i, limit) in self.limits.iter().enumerate() {
            if matches!(
                limit.dimension,
                Dimension::OutputTokens | Dimension::TotalTokens
            ) {
                state.buckets[settlement.organization][i].give_back(now, unused);
            }
        }
        state.counters.completed += 1;
        state.counters.completion_tokens = state
            .counters
            .completion_tokens
            .saturating_add(settlement.completion_tokens);
        let (generation, index) = settlement.entry;
        if generation == state.generation {
            if let Some(entry) = state.entries.get_mut(index) {
                entry.output = settlement.completion_tokens;
            }
        }
    }

    /// A snapshot of the statistics.
    pub(crate) fn stats(&self) -> SimStats {
        let (mut state, now) = self.lock();
        let interval = self
            .config
            .series_interval
            .unwrap_or(self.config.minute / 60)
            .max(Duration::from_millis(1));
        let state = &mut *state;
        let limits = self
            .organizations
            .iter()
            .enumerate()
            .flat_map(|(o, name)| {
                self.limits
                    .iter()
                    .enumerate()
                    .map(move |(i, limit)| (o, name, i, limit))
            })
            .map(|(o, name, i, limit)| stats::LimitStats {
                organization: name.clone(),
                dimension: limit.dimension,
                window: limit.window,
                sub_window: (limit.parts > 1).then_some(limit.parts),
                amount: limit.capacity(state.amounts[i]),
                remaining: state.buckets[o][i].remaining(now),
                rate_limited: state
                    .rejections
                    .iter()
                    .filter(|r| r.organization == o && r.limit == i)
                    .count() as u64,
                max_in_window: stats::max_in_window(
                    &state.entries,
                    o,
                    limit.dimension,
                    nanos(limit.window),
                ),
            })
            .collect();
        stats::snapshot(
            &state.counters,
            limits,
            &state.entries,
            &state.rejections,
            state.stats_since,
            now,
            nanos(interval),
        )
    }

    /// Zeroes the statistics; the quota's state is kept.
    pub(crate) fn reset_stats(&self) {
        let (mut state, now) = self.lock();
        state.counters = Counters::default();
        state.entries.clear();
        state.rejections.clear();
        state.generation += 1;
        state.stats_since = now;
    }
}
