//! What the simulator counted: totals, per-limit peaks, and a time series to plot.

use std::time::Duration;

use tower_llm_quota::Dimension;

/// A snapshot of a simulator's statistics since it started (or since
/// [`Simulator::reset_stats`](super::Simulator::reset_stats)).
///
/// Instants are simulated time since the simulator was created.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SimStats {
    /// Simulated time since the simulator was created.
    pub elapsed: Duration,
    /// Requests received, whatever their outcome.
    pub received: u64,
    /// Requests admitted (charged to the quota).
    pub admitted: u64,
    /// Admitted requests whose completion ended (or whose response was dropped).
    pub completed: u64,
    /// Requests refused with 429; by limit in [`LimitStats::rate_limited`].
    pub rate_limited: u64,
    /// Requests refused with 401.
    pub unauthorized: u64,
    /// Requests refused with 400 (malformed, or too large for a limit), 404 or 405.
    pub bad_requests: u64,
    /// Injected server errors (500, 503, 529).
    pub server_errors: u64,
    /// Flex requests refused for want of capacity (429 "Resource Unavailable", not charged).
    pub tier_unavailable: u64,
    /// Injected connection resets.
    pub connection_resets: u64,
    /// Injected latency spikes.
    pub latency_spikes: u64,
    /// Prompt tokens of the admitted requests.
    pub prompt_tokens: u64,
    /// Completion tokens of the completed requests.
    pub completion_tokens: u64,
    /// Every enforced limit of every organisation.
    pub limits: Vec<LimitStats>,
    /// The width of each point of [`series`](Self::series).
    pub series_interval: Duration,
    /// Per interval, from the first to the last event: what was admitted and refused.
    pub series: Vec<SeriesPoint>,
    /// The instant of each 429, in order.
    pub rate_limited_at: Vec<Duration>,
    /// Requests of the [neighbour](super::SimConfig::neighbour) the quota admitted.
    pub neighbour_admitted: u64,
    /// Requests of the neighbour the quota could not pay (its 429s).
    pub neighbour_rate_limited: u64,
    /// Tokens the neighbour spent.
    pub neighbour_tokens: u64,
    /// Admitted requests whose prompt was a group of marked items (answered with a JSON
    /// array; see [`GroupFaults`](super::GroupFaults)).
    pub grouped_answers: u64,
}

/// One enforced limit of one organisation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitStats {
    /// The organisation.
    pub organization: String,
    /// The dimension.
    pub dimension: Dimension,
    /// The window the limit counts over: the simulated minute, `1/n` of it for a sub-window,
    /// or the period given to [`SimConfig::limit`](super::SimConfig::limit).
    pub window: Duration,
    /// `Some(n)` for a sub-window of `1/n` of the minute.
    pub sub_window: Option<u32>,
    /// The bucket's capacity now: the amount per window (after any lowering).
    pub amount: u64,
    /// What the bucket holds now.
    pub remaining: u64,
    /// 429s this limit caused (the limit with the longest wait is blamed).
    pub rate_limited: u64,
    /// The largest amount admitted in any sliding window of [`window`](Self::window): each
    /// admission counts at its admission instant, with its final usage (requests 1; input the
    /// prompt; output the completion, or `max_tokens` while it runs; total their sum).
    ///
    /// A token bucket admits at most its capacity at once plus its refill over a window, so a
    /// provider enforcing this limit lets through up to twice `amount` in one window. It is
    /// what the provider finally counted, not what it held at admission (prompt plus
    /// `max_tokens` for tokens): a client keeping it at or below `amount` consumed no more than
    /// the quota in any window; whether it was ever refused is [`SimStats::rate_limited`].
    pub max_in_window: u64,
}

/// What happened in one interval of the time series.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SeriesPoint {
    /// The interval's start.
    pub start: Duration,
    /// Requests admitted.
    pub requests: u64,
    /// Prompt tokens admitted.
    pub input_tokens: u64,
    /// Output tokens of those admissions (final usage, or `max_tokens` while running).
    pub output_tokens: u64,
    /// 429s.
    pub rate_limited: u64,
}

impl SimStats {
    /// The first whole-window limit of `dimension` (the first organisation's, per-minute limits
    /// first, as configured).
    pub fn limit(&self, dimension: Dimension) -> Option<&LimitStats> {
        self.limits
            .iter()
            .find(|l| l.dimension == dimension && l.sub_window.is_none())
    }

    /// 429s caused by limits of `dimension`, over all organisations and windows.
    pub fn rate_limited_by(&self, dimension: Dimension) -> u64 {
        self.limits
            .iter()
            .filter(|l| l.dimension == dimension)
            .map(|l| l.rate_limited)
            .sum()
    }
}

/// The counters kept as requests arrive.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counters {
    pub(crate) received: u64,
    pub(crate) admitted: u64,
    pub(crate) completed: u64,
    pub(crate) rate_limited: u64,
    pub(crate) unauthorized: u64,
    pub(crate) bad_requests: u64,
    pub(crate) server_errors: u64,
    pub(crate) tier_unavailable: u64,
    pub(crate) connection_resets: u64,
    pub(crate) latency_spikes: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) neighbour_admitted: u64,
    pub(crate) neighbour_rate_limited: u64,
    pub(crate) neighbour_tokens: u64,
    pub(crate) grouped_answers: u64,
}

/// One admission (32 bytes on 64-bit targets).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry {
    /// Nanoseconds since the simulator started.
    pub(crate) at: u64,
    pub(crate) organization: usize,
    pub(crate) input: u64,
    /// `max_tokens` until settled, then the completion.
    pub(crate) output: u64,
}

impl Entry {
    fn amount(&self, dimension: Dimension) -> u64 {
        match dimension {
            Dimension::Requests => 1,
            Dimension::InputTokens => self.input,
            Dimension::OutputTokens => self.output,
            Dimension::TotalTokens => self.input.saturating_add(self.output),
            // Spend, and any dimension a later core adds.
            _ => 0,
        }
    }
}

/// One 429.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rejection {
    pub(crate) at: u64,
    pub(crate) organization: usize,
    /// The index of the limit blamed.
    pub(crate) limit: usize,
}

/// The largest sum of `dimension` over `organization`'s entries in any window of `window`
/// nanoseconds (entries less than `window` apart). Entries are in time order.
pub(crate) fn max_in_window(
    entries: &[Entry],
    organization: usize,
    dimension: Dimension,
    window: u64,
) -> u64 {
    let ours: Vec<(u64, u64)> = entries
        .iter()
        .filter(|e| e.organization == organization)
        .map(|e| (e.at, e.amount(dimension)))
        .collect();
    let (mut left, mut sum, mut best) = (0, 0u64, 0u64);
    for &(at, amount) in &ours {
        sum = sum.saturating_add(amount);
        while at.saturating_sub(ours[left].0) >= window {
            sum -= ours[left].1;
            left += 1;
        }
        best = best.max(sum);
    }
    best
}

/// Assembles the snapshot.
pub(crate) fn snapshot(
    counters: &Counters,
    limits: Vec<LimitStats>,
    entries: &[Entry],
    rejections: &[Rejection],
    since: u64,
    now: u64,
    interval: u64,
) -> SimStats {
    let index = |at: u64| usize::try_from((at.saturating_sub(since)) / interval).unwrap_or(0);
    let last = entries
        .iter()
        .map(|e| e.at)
        .chain(rejections.iter().map(|r| r.at))
        .max();
    let mut series: Vec<SeriesPoint> = match last {
        Some(last) => (0..=index(last))
            .map(|i| SeriesPoint {
                start: Duration::from_nanos(
                    since.saturating_add(interval.saturating_mul(i as u64)),
                ),
                ..SeriesPoint::default()
            })
            .collect(),
        None => Vec::new(),
    };
    for entry in entries {
        if let Some(point) = series.get_mut(index(entry.at)) {
            point.requests += 1;
            point.input_tokens = point.input_tokens.saturating_add(entry.input);
            point.output_tokens = point.output_tokens.saturating_add(entry.output);
        }
    }
    for rejection in rejections {
        if let Some(point) = series.get_mut(index(rejection.at)) {
            point.rate_limited += 1;
        }
    }
    SimStats {
        elapsed: Duration::from_nanos(now),
        received: counters.received,
        admitted: counters.admitted,
        completed: counters.completed,
        rate_limited: counters.rate_limited,
        unauthorized: counters.unauthorized,
        bad_requests: counters.bad_requests,
        server_errors: counters.server_errors,
        tier_unavailable: counters.tier_unavailable,
        connection_resets: counters.connection_resets,
        latency_spikes: counters.latency_spikes,
        prompt_tokens: counters.prompt_tokens,
        completion_tokens: counters.completion_tokens,
        limits,
        series_interval: Duration::from_nanos(interval),
        series,
        rate_limited_at: rejections
            .iter()
            .map(|r| Duration::from_nanos(r.at))
            .collect(),
        neighbour_admitted: counters.neighbour_admitted,
        neighbour_rate_limited: counters.neighbour_rate_limited,
        neighbour_tokens: counters.neighbour_tokens,
        grouped_answers: counters.grouped_answers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(at: u64, input: u64) -> Entry {
        Entry {
            at,
            organization: 0,
            input,
            output: 0,
        }
    }

    #[test]
    fn the_sliding_window_maximum_counts_entries_less_than_a_window_apart() {
        let entries = [
            entry(0, 5),
            entry(5, 5),
            entry(10, 7),
            entry(14, 1),
            entry(30, 2),
        ];
        // Windows of 10: {0, 5} = 10, {5} + {10, 14} = 13, {10, 14} = 8, {30} = 2.
        assert_eq!(max_in_window(&entries, 0, Dimension::InputTokens, 10), 13);
        assert_eq!(max_in_window(&entries, 0, Dimension::Requests, 10), 3);
        assert_eq!(max_in_window(&entries, 0, Dimension::InputTokens, 1), 7);
        assert_eq!(max_in_window(&entries, 0, Dimension::InputTokens, 100), 20);
        assert_eq!(max_in_window(&entries, 1, Dimension::InputTokens, 100), 0);
        assert_eq!(max_in_window(&[], 0, Dimension::Requests, 10), 0);
    }

    #[test]
    fn the_series_spans_the_first_to_the_last_event() {
        let entries = [entry(0, 5), entry(25, 5)];
        let rejections = [Rejection {
            at: 12,
            organization: 0,
            limit: 0,
        }];
        let stats = snapshot(
            &Counters::default(),
            Vec::new(),
            &entries,
            &rejections,
            0,
            30,
            10,
        );
        let requests: Vec<u64> = stats.series.iter().map(|p| p.requests).collect();
        assert_eq!(requests, vec![1, 0, 1]);
        assert_eq!(stats.series[1].rate_limited, 1);
        assert_eq!(stats.series[2].start, Duration::from_nanos(20));
        assert_eq!(stats.rate_limited_at, vec![Duration::from_nanos(12)]);
    }
}
