//! When the provider pushes back: the governed stack, with its defaults, against the
//! simulated provider in virtual time: a 429 with a short wait, a quota halved without notice,
//! an unseen neighbour on the key, and injected faults.

use crate::{run, workload};

use std::num::NonZeroU64;
use std::time::Duration;

use tokio::time::Instant;
use tower::Layer;
use tower_llm_quota::provider::Profile;
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{Dimension, Limit, Priority, Quota};
use tower_llm_quota_sim::{Faults, SimConfig, SimStats, Simulator};

use run::{Meter, Metered, Outcome, Target};
use workload::{Item, TicketShape};

const SEC: Duration = Duration::from_secs(1);
/// The compressed minute of the simulator, the tests and the benchmarks.
const MINUTE: Duration = Duration::from_secs(2);
const RPM: u64 = 500;
const TPM: u64 = 30_000;

fn quota(rpm: u64, tpm: u64, minute: Duration) -> Quota {
    let limit = |dimension, amount| {
        Limit::new(dimension, NonZeroU64::new(amount).unwrap(), minute).unwrap()
    };
    Quota::new()
        .with_limit(limit(Dimension::Requests, rpm))
        .with_limit(limit(Dimension::TotalTokens, tpm))
}

/// The stack with every default, for a provider whose minute lasts `minute`.
fn governed(quota: Quota, minute: Duration) -> QuotaStack {
    QuotaStack::for_profile(Profile::openai().windows(minute, minute), quota)
}

fn target(key: &str) -> Target {
    Target {
        url: String::from("/v1/chat/completions"),
        api_key: key.to_owned(),
    }
}

/// Runs `items` through the default stack over `simulator`, with `key`; returns the outcomes,
/// the provider 429s this client met and the wall time.
async fn run_governed(
    simulator: &Simulator,
    stack: QuotaStack,
    key: &str,
    items: &[Item],
) -> (Vec<Outcome>, u64, Duration) {
    let start = Instant::now();
    let meter = Meter::new(start);
    let client = stack.layer(Metered::new(simulator.service(), meter.clone()));
    let outcomes = run::run_all(client, items, &target(key), None, start, &|_| {}).await;
    (
        outcomes,
        meter.rate_limited_at().len() as u64,
        start.elapsed(),
    )
}

fn failures(outcomes: &[Outcome]) -> Vec<String> {
    outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().err().map(|e| format!("{}: {e}", o.id)))
        .collect()
}

/// Tokens the provider admitted from `from` on (each admission with its final usage), and the
/// end of the last admission's series interval.
fn tokens_since(stats: &SimStats, from: Duration) -> (u64, Duration) {
    let points: Vec<_> = stats.series.iter().filter(|p| p.start >= from).collect();
    let tokens = points
        .iter()
        .map(|p| p.input_tokens + p.output_tokens)
        .sum();
    let end = points
        .iter()
        .rev()
        .find(|p| p.requests > 0)
        .map_or(from, |p| p.start + stats.series_interval);
    (tokens, end)
}

#[tokio::test(start_paused = true)]
async fn a_short_retry_after_costs_a_short_wait_not_the_time_to_a_full_bucket() {
    // 60 RPM over a real minute, drained by another key of the same organisation.
    let simulator = Simulator::new(
        SimConfig::openai(60, 1_000_000)
            .latency(Duration::from_millis(100), Duration::ZERO)
            .key("sk-other", "org")
            .key("sk-ours", "org"),
    );
    let minute = Duration::from_secs(60);
    let drain = workload::tickets("other", 60, TicketShape::SUPPORT, Priority::Batch, 9);
    let outcomes = run::run_all(
        simulator.service(),
        &drain,
        &target("sk-other"),
        None,
        Instant::now(),
        &|_| {},
    )
    .await;
    assert!(failures(&outcomes).is_empty());
    assert_eq!(simulator.stats().admitted, 60);

    // Interactive work arrives: a request now, then one every half second.
    let mut items = workload::tickets("i", 4, TicketShape::SUPPORT, Priority::Interactive, 10);
    for (n, item) in items.iter_mut().enumerate() {
        item.arrive = SEC / 2 * n as u32;
    }
    let stack = governed(quota(60, 1_000_000, minute), minute);
    let (outcomes, rate_limited, _) = run_governed(&simulator, stack, "sk-ours", &items).await;
    // The provider's bucket is empty: the first call meets a 429 with `retry-after: 1`
    // while its reset says 60 s.
    assert_eq!(rate_limited, 1);
    assert_eq!(
        failures(&outcomes),
        Vec::<String>::new(),
        "interactive work succeeds"
    );
    let mut sent: Vec<Duration> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok().map(|done| done.sent_at))
        .collect();
    sent.sort();
    let first = sent[0];
    eprintln!(
        "429 with retry-after 1 s, reset 60 s: next call after {first:?}, calls at {sent:?}, \
         {} of {} interactive requests done",
        sent.len(),
        items.len()
    );
    assert!(
        first >= SEC && first <= 2 * SEC,
        "the next call went at {first:?}"
    );
    // One a second from there, as the provider refills.
    assert!(*sent.last().unwrap() <= 6 * SEC, "{sent:?}");
}

#[tokio::test(start_paused = true)]
async fn a_quota_halved_without_notice_loses_no_item() {
    let drop_at = 6 * SEC;
    let lowered = TPM / 2;
    let simulator = Simulator::new(
        SimConfig::openai(RPM, TPM)
            .minute(MINUTE)
            .lower_limit_at(drop_at, Dimension::TotalTokens, lowered)
            .series_interval(Duration::from_millis(100)),
    );
    let items = workload::tickets("t", 500, TicketShape::SUPPORT, Priority::Batch, 1);
    let stack = governed(quota(RPM, TPM, MINUTE), MINUTE);
    let budget = stack.budget().clone();
    let (outcomes, rate_limited, wall) = run_governed(&simulator, stack, "sk-a", &items).await;
    let stats = simulator.stats();
    let (tokens, end) = tokens_since(&stats, drop_at);
    let rate = lowered as f64 / MINUTE.as_secs_f64();
    let used = tokens as f64 / (rate * (end - drop_at).as_secs_f64());
    eprintln!(
        "quota halved at {drop_at:?}: {} lost, {rate_limited} × 429, {:.1} % of the lowered \
         quota used after the drop, wall {wall:?}",
        failures(&outcomes).len(),
        100.0 * used
    );
    assert_eq!(failures(&outcomes), Vec::<String>::new());
    assert!(rate_limited <= 5, "{rate_limited} provider 429s");
    assert!(
        used >= 0.9,
        "{:.1} % of the lowered quota used",
        100.0 * used
    );
    // The budget follows the lowered limit.
    let tpm = budget.snapshot().limits()[1].limit().amount().get();
    assert_eq!(tpm, lowered);
}

/// By default (`spend_reported_burst`), a job alone on the key spends the provider's initial
/// bucket (a whole minute of quota) once the headers have agreed with the budget for a sixth
/// of a minute, instead of spending its own burst and then only the refill.
#[tokio::test(start_paused = true)]
async fn the_burst_the_provider_reports_is_spent_by_default() {
    let items = workload::tickets("t", 500, TicketShape::SUPPORT, Priority::Batch, 1);
    let run = |spend: bool| {
        let items = &items;
        async move {
            // Answers in 10 ms, so that the wall time is the quota's.
            let simulator = Simulator::new(
                SimConfig::openai(RPM, TPM)
                    .minute(MINUTE)
                    .latency(Duration::from_millis(10), Duration::ZERO),
            );
            let share = tower_llm_quota::budget::AdaptiveShare::new().spend_reported_burst(spend);
            let quota = quota(RPM, TPM, MINUTE)
                .limits()
                .iter()
                .fold(Quota::new(), |q, limit| {
                    q.with_limit(limit.with_adaptive_share(share))
                });
            let (outcomes, rate_limited, wall) =
                run_governed(&simulator, governed(quota, MINUTE), "sk-a", items).await;
            let stats = simulator.stats();
            assert_eq!(failures(&outcomes), Vec::<String>::new());
            assert_eq!(rate_limited, 0, "provider 429s");
            (wall, stats.prompt_tokens + stats.completion_tokens)
        }
    };
    let (own, _) = run(false).await;
    let (reported, tokens) = run(true).await;
    // The bound: the tokens beyond the provider's full bucket (one minute), at the rate.
    let bound = MINUTE.mul_f64((tokens - TPM) as f64 / TPM as f64);
    eprintln!(
        "reported burst: wall {:.3} × the bound ({bound:?}); own burst only: {:.3} ×",
        reported.as_secs_f64() / bound.as_secs_f64(),
        own.as_secs_f64() / bound.as_secs_f64()
    );
    assert!(
        reported <= bound.mul_f64(1.05),
        "{reported:?} against {bound:?}"
    );
    assert!(own >= bound.mul_f64(1.05), "{own:?} against {bound:?}");
}

/// What a neighbour spending `share` of the quota meets, alone on the key for `span`.
async fn neighbour_alone(share: f64, span: Duration) -> SimStats {
    let simulator = Simulator::new(
        SimConfig::openai(RPM, TPM)
            .minute(MINUTE)
            .neighbour("default", share, 300),
    );
    tokio::time::sleep(span).await;
    simulator.stats()
}

#[tokio::test(start_paused = true)]
async fn an_unseen_neighbour_on_the_key_is_left_its_share() {
    let share = 0.3;
    let simulator = Simulator::new(
        SimConfig::openai(RPM, TPM)
            .minute(MINUTE)
            .neighbour("default", share, 300)
            .series_interval(Duration::from_millis(100)),
    );
    let items = workload::tickets("t", 500, TicketShape::SUPPORT, Priority::Batch, 2);
    let stack = governed(quota(RPM, TPM, MINUTE), MINUTE);
    let (outcomes, rate_limited, wall) = run_governed(&simulator, stack, "sk-a", &items).await;
    let stats = simulator.stats();
    let alone = neighbour_alone(share, stats.elapsed).await;
    let (tokens, end) = tokens_since(&stats, Duration::ZERO);
    let rate = TPM as f64 / MINUTE.as_secs_f64();
    // The neighbour's tokens until the governed client's last admission (it paces evenly).
    let neighbour = stats.neighbour_tokens as f64 * end.as_secs_f64() / stats.elapsed.as_secs_f64();
    let left = rate * end.as_secs_f64() - neighbour;
    let used = tokens as f64 / left;
    eprintln!(
        "neighbour at {share}: governed {rate_limited} × 429, neighbour {} × 429 ({} alone), \
         {:.1} % of what the neighbour leaves used, wall {wall:?}",
        stats.neighbour_rate_limited,
        alone.neighbour_rate_limited,
        100.0 * used
    );
    assert_eq!(failures(&outcomes), Vec::<String>::new());
    assert!(rate_limited <= 5, "{rate_limited} provider 429s");
    assert!(
        stats.neighbour_rate_limited <= alone.neighbour_rate_limited + 5,
        "the neighbour met {} 429s, {} alone",
        stats.neighbour_rate_limited,
        alone.neighbour_rate_limited
    );
    assert!(
        used >= 0.9,
        "{:.1} % of what the neighbour leaves",
        100.0 * used
    );
}

/// Tokens the governed client spent in `[from, to)`, from the simulator's series.
fn tokens_between(stats: &SimStats, from: Duration, to: Duration) -> u64 {
    stats
        .series
        .iter()
        .filter(|p| p.start >= from && p.start < to)
        .map(|p| p.input_tokens + p.output_tokens)
        .sum()
}

/// A real one-minute quota behind a neighbour spending 30 % of it for ten minutes, then
/// stopping: the budget uses what the neighbour leaves while it spends, and the whole quota
/// again within two minutes of its end.
#[tokio::test(start_paused = true)]
async fn the_share_follows_what_a_neighbour_leaves_and_comes_back_when_it_stops() {
    let minute = Duration::from_secs(60);
    let stop = 10 * minute;
    let config = || {
        SimConfig::openai(RPM, TPM)
            .neighbour("default", 0.3, 300)
            .neighbour_until(stop)
            .series_interval(SEC)
    };
    let simulator = Simulator::new(config());
    // About fifteen minutes of work: ten behind the neighbour, five alone.
    let items = workload::tickets("t", 500, TicketShape::SUPPORT, Priority::Batch, 6);
    let stack = governed(quota(RPM, TPM, minute), minute);
    let (outcomes, rate_limited, wall) = run_governed(&simulator, stack, "sk-a", &items).await;
    let stats = simulator.stats();
    let rate = TPM as f64 / minute.as_secs_f64();
    let left = rate * stop.as_secs_f64() - stats.neighbour_tokens as f64;
    let behind = tokens_between(&stats, Duration::ZERO, stop) as f64 / left;
    let back_from = stop + 2 * minute;
    let (_, end) = tokens_since(&stats, back_from);
    let alone =
        tokens_between(&stats, back_from, end) as f64 / (rate * (end - back_from).as_secs_f64());
    let neighbour_alone = {
        let simulator = Simulator::new(config());
        tokio::time::sleep(stop).await;
        simulator.stats().neighbour_rate_limited
    };
    eprintln!(
        "neighbour at 0.3 for ten minutes: {:.1} % of what it leaves used; alone again, \
         from two minutes after its end: {:.1} % of the quota; governed {rate_limited} × 429, \
         neighbour {} × 429 ({neighbour_alone} alone); wall {wall:?}",
        100.0 * behind,
        100.0 * alone,
        stats.neighbour_rate_limited,
    );
    assert_eq!(failures(&outcomes), Vec::<String>::new());
    assert_eq!(rate_limited, 0, "provider 429s");
    assert_eq!(stats.neighbour_rate_limited, neighbour_alone);
    assert!(
        end > back_from + minute,
        "the work lasted too short a time: {end:?}"
    );
    assert!(
        behind >= 0.95,
        "{:.1} % of what the neighbour leaves",
        100.0 * behind
    );
    assert!(
        alone >= 0.95,
        "{:.1} % of the quota once alone",
        100.0 * alone
    );
}

#[tokio::test(start_paused = true)]
async fn server_errors_and_resets_lose_no_item() {
    let simulator = Simulator::new(
        SimConfig::openai(RPM, TPM)
            .minute(MINUTE)
            .faults(Faults::none().server_errors(0.05).connection_resets(0.02))
            .seed(13),
    );
    let items = workload::tickets("t", 500, TicketShape::SUPPORT, Priority::Batch, 3);
    let stack = governed(quota(RPM, TPM, MINUTE), MINUTE);
    let (outcomes, rate_limited, _) = run_governed(&simulator, stack, "sk-a", &items).await;
    let stats = simulator.stats();
    eprintln!(
        "faults: {} server errors, {} resets, {} lost, {rate_limited} × 429",
        stats.server_errors,
        stats.connection_resets,
        failures(&outcomes).len()
    );
    assert!(stats.server_errors >= 15 && stats.connection_resets >= 5);
    assert_eq!(failures(&outcomes), Vec::<String>::new());
    assert_eq!(rate_limited, 0);
}

#[tokio::test(start_paused = true)]
async fn a_streamed_error_body_over_the_read_limit_is_retried_as_a_server_error() {
    // 10 % of the answers are 500, 503 or 529 with a body of 100 KiB streamed with no length.
    let simulator = Simulator::new(
        SimConfig::openai(RPM, TPM)
            .minute(MINUTE)
            .faults(
                Faults::none()
                    .server_errors(0.1)
                    .streamed_error_bodies(100 * 1_024),
            )
            .seed(5),
    );
    let items = workload::tickets("t", 200, TicketShape::SUPPORT, Priority::Batch, 4);
    // A retry budget above the share of failures (the default's 10 % is this test's failure
    // rate, where a burst of failures may spend it): the test is about how the failures are
    // classified, not about the budget's edge.
    let retry = tower_llm_quota::retry::RetryPolicy::new()
        .retry_budget(0.2, 1)
        .unwrap();
    let stack = governed(quota(RPM, TPM, MINUTE), MINUTE).retry(retry);
    let (outcomes, _, _) = run_governed(&simulator, stack, "sk-a", &items).await;
    let stats = simulator.stats();
    eprintln!(
        "streamed 100 KiB error bodies: {} server errors, {} lost",
        stats.server_errors,
        failures(&outcomes).len()
    );
    assert!(
        stats.server_errors >= 10,
        "{} server errors",
        stats.server_errors
    );
    assert_eq!(failures(&outcomes), Vec::<String>::new());
    assert_eq!(
        stats.admitted, 200,
        "each item admitted once, after its retries"
    );
}

#[tokio::test(start_paused = true)]
async fn a_daily_quotas_429_is_not_retried_and_pauses_the_budget_only_up_to_the_cap() {
    // Two requests a day, which the client's quota does not know about.
    let day = Duration::from_secs(86_400);
    let simulator = Simulator::new(
        SimConfig::openai(600, 1_000_000)
            .latency(Duration::from_millis(10), Duration::ZERO)
            .limit(Dimension::Requests, 2, day),
    );
    let minute = Duration::from_secs(60);
    let mut items = workload::tickets("t", 3, TicketShape::SUPPORT, Priority::Async, 5);
    for (n, item) in items.iter_mut().enumerate() {
        item.arrive = SEC * n as u32;
    }
    let stack = governed(quota(600, 1_000_000, minute), minute);
    let budget = stack.budget().clone();
    let (outcomes, rate_limited, _) = run_governed(&simulator, stack, "sk-a", &items).await;
    assert_eq!(rate_limited, 1);
    let failed = failures(&outcomes);
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(
        failed[0].contains("after 1 attempt(s)")
            && failed[0].contains("a wait beyond the honoured maximum"),
        "{failed:?}"
    );
    // `retry-after: 43200` pauses the requests for the honoured maximum (60 s), not half a day.
    let paused = |budget: &tower_llm_quota::Budget| {
        let snapshot = budget.snapshot();
        snapshot.limits()[0].available_at() - snapshot.taken_at()
    };
    let left = paused(&budget);
    assert!(
        left > Duration::ZERO && left <= 60 * SEC,
        "paused for {left:?}"
    );
    // An operator who knows better lifts it.
    budget.lift_pause(&[Dimension::Requests]);
    assert_eq!(paused(&budget), Duration::ZERO);
}
