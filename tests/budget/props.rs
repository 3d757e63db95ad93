//! Property tests of a [`Budget`] under tokio's paused clock, against an exact model.
//!
//! - **Rate bound**: requests that wait in `reserve` are admitted so that, in every interval
//!   ending at an admission, what a limit charged (estimates at admission, settlement
//!   adjustments, debt included, at settlement) is at most `capacity + rate × length`.
//! - **Admission timing**: the same schedules replayed on an exact bucket model: every
//!   admission finds its cost available, in arrival order, and at most one timer tick after it
//!   became available.
//! - **Conservation**: under random `try_reserve`, settle, refund, drop, `charge_estimate` and
//!   clock advances, every level, admission decision and reported time equals the model's, and
//!   a full refill brings every level back to capacity.

use tower_llm_quota_test_support as support;

use std::num::NonZeroU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use support::levels;
use tokio::time::Instant;
use tower_llm_quota::{
    Budget, Cost, Dimension, Limit, Quota, Reservation, Usage, error::TryReserveError,
};

/// One timer tick of tokio's clock: how late a sleeping waiter may be woken.
const TICK_NS: u64 = 1_000_000;

fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Limits.

#[derive(Debug, Clone, Copy)]
enum BurstSpec {
    Fraction(f64),
    Exact(u64),
}

/// A generated limit: `amount` of `dimension` per `period_ns`, with headroom and burst rule.
#[derive(Debug, Clone, Copy)]
struct LimitSpec {
    dimension: Dimension,
    amount: u64,
    period_ns: u64,
    headroom: f64,
    burst: BurstSpec,
}

impl LimitSpec {
    fn build(&self) -> Limit {
        let limit = Limit::new(
            self.dimension,
            NonZeroU64::new(self.amount).unwrap(),
            Duration::from_nanos(self.period_ns),
        )
        .unwrap()
        .with_headroom(self.headroom)
        .unwrap();
        match self.burst {
            BurstSpec::Fraction(f) => limit.with_burst_fraction(f).unwrap(),
            BurstSpec::Exact(b) => limit.with_burst(NonZeroU64::new(b).unwrap()),
        }
    }
}

fn limit_spec(
    dimension: Dimension,
    max_amount: u64,
    periods_ns: std::ops::RangeInclusive<u64>,
) -> impl Strategy<Value = LimitSpec> {
    let burst = prop_oneof![
        prop::sample::select(vec![1.0, 0.5, 0.25]).prop_map(BurstSpec::Fraction),
        (1..=2 * max_amount).prop_map(BurstSpec::Exact),
    ];
    (
        1..=max_amount,
        periods_ns,
        prop::sample::select(vec![1.0, 0.85, 0.5, 0.3]),
        burst,
    )
        .prop_map(move |(amount, period_ns, headroom, burst)| LimitSpec {
            dimension,
            amount,
            period_ns,
            headroom,
            burst,
        })
}

fn quota_of(specs: &[LimitSpec]) -> Quota {
    specs
        .iter()
        .fold(Quota::new(), |quota, spec| quota.with_limit(spec.build()))
}

// ---------------------------------------------------------------------------------------------
// The model.

/// One bucket, modelled exactly: the level is kept in *ticks*, where one unit is `period` ticks
/// and one nanosecond `rate` ticks, so refill is exact integer arithmetic.
#[derive(Debug, Clone)]
struct ModelBucket {
    dimension: Dimension,
    capacity: u64,
    rate: u64,
    period: u64,
    /// The level at `at`, in ticks; never above `capacity × period`.
    level: i128,
    /// Nanoseconds since the budget was created.
    at: u64,
}

impl ModelBucket {
    fn new(limit: &Limit) -> Self {
        let capacity = limit.capacity();
        let period = nanos(limit.period());
        Self {
            dimension: limit.dimension(),
            capacity,
            rate: limit.effective_amount(),
            period,
            level: i128::from(capacity) * i128::from(period),
            at: 0,
        }
    }

    fn full(&self) -> i128 {
        i128::from(self.capacity) * i128::from(self.period)
    }

    fn units(&self, amount: u64) -> i128 {
        i128::from(amount) * i128::from(self.period)
    }

    /// Refills up to `t`.
    fn advance_to(&mut self, t: u64) {
        assert!(t >= self.at, "the model's clock runs backwards");
        let refill = i128::from(t - self.at) * i128::from(self.rate);
        self.level = (self.level + refill).min(self.full());
        self.at = t;
    }

    /// Takes `amount`; debt stops at one capacity (what is beyond is forgiven). Returns the
    /// ticks really taken.
    fn debit(&mut self, amount: u64) -> i128 {
        let floor = (-self.full()).min(self.level);
        let level = (self.level - self.units(amount)).max(floor);
        let taken = self.level - level;
        self.level = level;
        taken
    }

    /// A refund never raises the level above capacity.
    fn refund(&mut self, amount: u64) {
        self.level = (self.level + self.units(amount)).min(self.full());
    }

    /// What a snapshot reports: the level rounded down (towards minus infinity).
    fn reported(&self) -> i64 {
        i64::try_from(self.level.div_euclid(i128::from(self.period))).unwrap()
    }

    /// The first nanosecond (at or after `at`) at which the level reaches `amount`.
    fn ready_at(&self, amount: u64) -> u64 {
        let missing = self.units(amount) - self.level;
        if missing <= 0 {
            return self.at;
        }
        let wait = (missing as u128).div_ceil(u128::from(self.rate));
        self.at + u64::try_from(wait).unwrap()
    }

    /// When the bucket is full again.
    fn full_at(&self) -> u64 {
        self.ready_at(self.capacity)
    }
}

/// Every bucket of a quota, in the quota's order.
#[derive(Debug, Clone)]
struct Model {
    buckets: Vec<ModelBucket>,
}

impl Model {
    fn new(quota: &Quota) -> Self {
        Self {
            buckets: quota.limits().iter().map(ModelBucket::new).collect(),
        }
    }

    fn advance_to(&mut self, t: u64) {
        self.buckets.iter_mut().for_each(|b| b.advance_to(t));
    }

    /// Whether `cost` exceeds a capacity.
    fn never(&self, cost: &Cost) -> bool {
        self.buckets
            .iter()
            .any(|b| cost.amount(b.dimension) > b.capacity)
    }

    /// When every bucket `cost` touches holds its amount.
    fn ready_at(&self, cost: &Cost) -> u64 {
        self.buckets
            .iter()
            .filter(|b| cost.amount(b.dimension) > 0)
            .map(|b| b.ready_at(cost.amount(b.dimension)))
            .fold(self.buckets.first().map_or(0, |b| b.at), u64::max)
    }

    fn debit(&mut self, cost: &Cost) {
        for b in &mut self.buckets {
            b.debit(cost.amount(b.dimension));
        }
    }

    /// What each event charged each bucket, in ticks, as the model applies it: the log's
    /// amounts, except that forgiven debt is not charged.
    fn charges(quota: &Quota, log: &[Event]) -> Vec<Vec<i128>> {
        let mut model = Model::new(quota);
        log.iter()
            .map(|event| {
                model.advance_to(event.at);
                match &event.kind {
                    EventKind::Admission { cost, .. } => {
                        let charged = model
                            .buckets
                            .iter()
                            .map(|b| b.units(cost.amount(b.dimension)))
                            .collect();
                        model.debit(cost);
                        charged
                    }
                    EventKind::Settlement { reserved, actual } => model.settle(reserved, actual),
                }
            })
            .collect()
    }

    /// `actual` replaces `reserved`: the difference is refunded or charged as debt (a usage
    /// more than twice above both the estimate and the capacity counts as the larger of the
    /// two). Returns what each bucket was charged, in ticks (negative: refunded).
    fn settle(&mut self, reserved: &Cost, actual: &Cost) -> Vec<i128> {
        let mut charged = Vec::new();
        for b in &mut self.buckets {
            let (reserved, actual) = (reserved.amount(b.dimension), actual.amount(b.dimension));
            let bound = reserved.max(b.capacity);
            let actual = if actual / 2 > bound { bound } else { actual };
            if actual < reserved {
                b.refund(reserved - actual);
                charged.push(-b.units(reserved - actual));
            } else {
                charged.push(b.debit(actual - reserved));
            }
        }
        charged
    }

    fn levels(&self) -> Vec<i64> {
        self.buckets.iter().map(ModelBucket::reported).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Rate bound and admission timing, through the waiting path.

/// How an admitted request ends.
#[derive(Debug, Clone, Copy)]
enum End {
    ChargeEstimate,
    SendAndDrop,
    /// Settled with this usage (input, output) after the hold.
    Settle(u64, u64),
}

/// One request of a schedule: it arrives `gap_ns` after the previous one, reserves its cost,
/// holds the reservation for `hold_ns`, then ends.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    gap_ns: u64,
    requests: u64,
    input: u64,
    output: u64,
    hold_ns: u64,
    end: End,
}

impl Arrival {
    fn cost(&self) -> Cost {
        Cost::new(self.input, self.output).with_requests(self.requests)
    }
}

/// A quota of requests and total tokens (and maybe input tokens), and a schedule whose costs
/// fit every capacity. With `settle`, some requests end settled with any usage (often above
/// the estimate: debt).
fn schedule(settle: bool) -> impl Strategy<Value = (Vec<LimitSpec>, Vec<Arrival>)> {
    let periods = 1_000_000..=2_000_000_000;
    (
        limit_spec(Dimension::Requests, 10, periods.clone()),
        limit_spec(Dimension::TotalTokens, 300, periods.clone()),
        prop::option::of(limit_spec(Dimension::InputTokens, 300, periods)),
    )
        .prop_flat_map(move |(requests, tokens, input)| {
            let specs: Vec<LimitSpec> = [Some(requests), Some(tokens), input]
                .into_iter()
                .flatten()
                .collect();
            let quota = quota_of(&specs);
            let cap = |d: Dimension| {
                quota
                    .limits()
                    .iter()
                    .filter(|l| l.dimension() == d)
                    .map(Limit::capacity)
                    .min()
                    .unwrap_or(u64::MAX)
            };
            let (max_requests, max_total) = (cap(Dimension::Requests), cap(Dimension::TotalTokens));
            let max_input = max_total.min(cap(Dimension::InputTokens));
            let end = if settle {
                prop_oneof![
                    1 => Just(End::ChargeEstimate),
                    1 => Just(End::SendAndDrop),
                    3 => (0..=2 * max_total, 0..=2 * max_total)
                        .prop_map(|(i, o)| End::Settle(i, o)),
                ]
                .boxed()
            } else {
                prop_oneof![Just(End::ChargeEstimate), Just(End::SendAndDrop)].boxed()
            };
            let arrival = (
                prop_oneof![Just(0u64), 0..=200_000_000u64],
                1..=max_requests,
                0..=max_input,
                any::<u64>(),
                0..=300_000_000u64,
                end,
            )
                .prop_map(
                    move |(gap_ns, requests, input, output, hold_ns, end)| Arrival {
                        gap_ns,
                        requests,
                        input,
                        output: output % (max_total - input + 1),
                        hold_ns,
                        end,
                    },
                );
            (Just(specs), prop::collection::vec(arrival, 1..40))
        })
}

/// Something that changed the buckets, in the order the budget saw it.
#[derive(Debug, Clone)]
struct Event {
    /// Nanoseconds since the budget was created.
    at: u64,
    /// What was charged (negative: refunded), per limit, in the quota's order.
    amounts: Vec<i128>,
    kind: EventKind,
}

#[derive(Debug, Clone)]
enum EventKind {
    /// The admission of the `seq`-th arrival, which arrived at `arrived`.
    Admission {
        seq: usize,
        arrived: u64,
        cost: Cost,
    },
    /// A settlement: `actual` replaced `reserved`.
    Settlement { reserved: Cost, actual: Cost },
}

/// Runs `arrivals` against a budget for `quota` on a paused clock; returns the event log.
fn run_schedule(quota: &Quota, arrivals: &[Arrival]) -> Vec<Event> {
    let runtime = paused_runtime();
    runtime.block_on(async {
        let budget = Budget::new(quota.clone());
        let start = Instant::now();
        let dims: Vec<Dimension> = quota.limits().iter().map(Limit::dimension).collect();
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (seq, arrival) in arrivals.iter().copied().enumerate() {
            if arrival.gap_ns > 0 {
                tokio::time::sleep(Duration::from_nanos(arrival.gap_ns)).await;
            }
            let (budget, log, dims) = (budget.clone(), log.clone(), dims.clone());
            tasks.push(tokio::spawn(async move {
                let signed = |cost: &Cost| -> Vec<i128> {
                    dims.iter().map(|d| i128::from(cost.amount(*d))).collect()
                };
                let arrived = nanos(start.elapsed());
                let cost = arrival.cost();
                let mut reservation = budget.reserve(cost).await.expect("the cost fits");
                log.lock().unwrap().push(Event {
                    at: nanos(start.elapsed()),
                    amounts: signed(&cost),
                    kind: EventKind::Admission { seq, arrived, cost },
                });
                tokio::time::sleep(Duration::from_nanos(arrival.hold_ns)).await;
                match arrival.end {
                    End::ChargeEstimate => {
                        reservation.charge_estimate();
                    }
                    End::SendAndDrop => {
                        reservation.mark_sent();
                        drop(reservation);
                    }
                    End::Settle(input, output) => {
                        let settlement = reservation.settle(&Usage::new(input, output));
                        let (reserved, actual) = (settlement.reserved(), settlement.actual());
                        let amounts = signed(&actual)
                            .into_iter()
                            .zip(signed(&reserved))
                            .map(|(a, r)| a - r)
                            .collect();
                        log.lock().unwrap().push(Event {
                            at: nanos(start.elapsed()),
                            amounts,
                            kind: EventKind::Settlement { reserved, actual },
                        });
                    }
                }
            }));
        }
        let joined = tokio::time::timeout(Duration::from_secs(1 << 40), async {
            for task in tasks {
                task.await.unwrap();
            }
        })
        .await;
        assert!(joined.is_ok(), "a waiter was never admitted");
        assert_eq!(budget.waiters(), 0);
        Arc::try_unwrap(log).unwrap().into_inner().unwrap()
    })
}

/// In every interval `[t_i, t_j]` from event `i` to an admission `j` that touches a limit, the
/// events `i..=j` charged that limit at most `capacity + rate × (t_j − t_i)`.
///
/// The level before `i` is at most the capacity, refill adds at most `rate × (t_j − t_i)`, a
/// refund adds at most its amount, and the level after an admission is not negative. Debt
/// beyond one capacity is forgiven, so what a settlement charged is what the model took.
fn check_rate_bound(quota: &Quota, log: &[Event]) -> Result<(), TestCaseError> {
    let charges = Model::charges(quota, log);
    for (d, limit) in quota.limits().iter().enumerate() {
        let period = i128::from(nanos(limit.period()));
        let (capacity, rate) = (
            i128::from(limit.capacity()),
            i128::from(limit.effective_amount()),
        );
        let mut prefix = vec![0i128];
        for charge in &charges {
            prefix.push(prefix.last().unwrap() + charge[d]);
        }
        for (j, end) in log.iter().enumerate() {
            if !matches!(end.kind, EventKind::Admission { .. }) || end.amounts[d] == 0 {
                continue;
            }
            for (i, begin) in log[..=j].iter().enumerate() {
                let charged = prefix[j + 1] - prefix[i];
                let elapsed = i128::from(end.at - begin.at);
                prop_assert!(
                    charged <= capacity * period + rate * elapsed,
                    "{limit:?}: {charged} ticks charged in {elapsed} ns, from event {i} to {j}"
                );
            }
        }
    }
    Ok(())
}

/// Replays the log on the model: arrivals are admitted in order, each when its cost is
/// available (never before) and at most one timer tick after.
fn check_admission_times(quota: &Quota, log: &[Event]) -> Result<(), TestCaseError> {
    let mut model = Model::new(quota);
    let mut last = 0;
    let mut next_seq = 0;
    for event in log {
        prop_assert!(event.at >= last, "the log is ordered by time");
        match &event.kind {
            EventKind::Admission { seq, arrived, cost } => {
                prop_assert_eq!(*seq, next_seq, "first in, first out");
                next_seq += 1;
                // It is at the head since its arrival or the last change, whichever is later.
                model.advance_to(last.max(*arrived));
                let ready = model.ready_at(cost);
                prop_assert!(
                    ready <= event.at,
                    "arrival {seq} admitted at {} ns, before its cost is available at {ready} ns",
                    event.at
                );
                prop_assert!(
                    event.at <= ready + TICK_NS,
                    "arrival {seq} admitted at {} ns, its cost available since {ready} ns",
                    event.at
                );
                model.advance_to(event.at);
                model.debit(cost);
            }
            EventKind::Settlement { reserved, actual } => {
                model.advance_to(event.at);
                model.settle(reserved, actual);
            }
        }
        last = event.at;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Waiting requests that keep their estimates charged never exceed the rate bound.
    #[test]
    fn rate_bound_with_charged_estimates((specs, arrivals) in schedule(false)) {
        let quota = quota_of(&specs);
        let log = run_schedule(&quota, &arrivals);
        prop_assert_eq!(log.len(), arrivals.len());
        check_rate_bound(&quota, &log)?;
        check_admission_times(&quota, &log)?;
    }

    /// With settlements (debt above the estimate, refunds below it) counted when they happen,
    /// the charges still never exceed the rate bound.
    #[test]
    fn rate_bound_with_settled_debt((specs, arrivals) in schedule(true)) {
        let quota = quota_of(&specs);
        let log = run_schedule(&quota, &arrivals);
        check_rate_bound(&quota, &log)?;
        check_admission_times(&quota, &log)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Conservation, through try_reserve.

#[derive(Debug, Clone)]
enum Op {
    Reserve {
        requests: u64,
        input: u64,
        output: u64,
    },
    MarkSent(usize),
    Settle {
        index: usize,
        input: u64,
        output: u64,
    },
    SettleCost {
        index: usize,
        requests: u64,
        input: u64,
        output: u64,
    },
    Refund(usize),
    Drop(usize),
    ChargeEstimate(usize),
    Advance(u64),
}

fn any_limit() -> impl Strategy<Value = LimitSpec> {
    let periods = 1_000_000..=2_000_000_000;
    prop_oneof![
        limit_spec(Dimension::Requests, 10, periods.clone()),
        limit_spec(Dimension::InputTokens, 200, periods.clone()),
        limit_spec(Dimension::OutputTokens, 200, periods.clone()),
        limit_spec(Dimension::TotalTokens, 200, periods),
    ]
}

fn ops(advance: bool) -> impl Strategy<Value = Vec<Op>> {
    let advance_weight = if advance { 2 } else { 0 };
    let op = prop_oneof![
        6 => (0..=3u64, 0..=80u64, 0..=80u64)
            .prop_map(|(requests, input, output)| Op::Reserve { requests, input, output }),
        2 => any::<usize>().prop_map(Op::MarkSent),
        2 => (any::<usize>(), 0..=150u64, 0..=150u64)
            .prop_map(|(index, input, output)| Op::Settle { index, input, output }),
        1 => (any::<usize>(), 0..=4u64, 0..=150u64, 0..=150u64).prop_map(
            |(index, requests, input, output)| Op::SettleCost { index, requests, input, output }
        ),
        1 => any::<usize>().prop_map(Op::Refund),
        2 => any::<usize>().prop_map(Op::Drop),
        1 => any::<usize>().prop_map(Op::ChargeEstimate),
        advance_weight => prop_oneof![0..=5_000_000u64, 0..=3_000_000_000u64].prop_map(Op::Advance),
    ];
    prop::collection::vec(op, 1..80)
}

/// A live reservation and whether the model considers it sent.
struct Live {
    reservation: Reservation,
    sent: bool,
}

fn take(live: &mut Vec<Live>, index: usize) -> Option<Live> {
    (!live.is_empty()).then(|| live.remove(index % live.len()))
}

/// Applies `ops` to a budget for `quota` and to the model, comparing them after every step;
/// then drops what is left and refills.
fn check_conservation(quota: &Quota, ops: &[Op]) -> Result<(), TestCaseError> {
    let runtime = paused_runtime();
    runtime.block_on(async {
        let budget = Budget::new(quota.clone());
        let start = Instant::now();
        let mut model = Model::new(quota);
        let mut now = 0u64;
        let mut live: Vec<Live> = Vec::new();
        for (step, op) in ops.iter().enumerate() {
            match *op {
                Op::Reserve {
                    requests,
                    input,
                    output,
                } => {
                    let cost = Cost::new(input, output).with_requests(requests);
                    let result = budget.try_reserve(cost);
                    if model.never(&cost) {
                        prop_assert!(
                            matches!(result, Err(TryReserveError::Never(_))),
                            "step {step}: {cost:?} exceeds a capacity, got {result:?}"
                        );
                        continue;
                    }
                    let ready = model.ready_at(&cost);
                    match result {
                        Ok(reservation) => {
                            prop_assert_eq!(ready, now, "step {}: admitted too early", step);
                            prop_assert_eq!(reservation.cost(), cost);
                            model.debit(&cost);
                            live.push(Live {
                                reservation,
                                sent: false,
                            });
                        }
                        Err(TryReserveError::NotYet(not_until)) => {
                            prop_assert!(ready > now, "step {}: refused, but it fits", step);
                            prop_assert_eq!(
                                not_until.earliest(),
                                start + Duration::from_nanos(ready),
                                "step {}: wrong retry time",
                                step
                            );
                            let slowest = model.buckets.iter().any(|b| {
                                b.dimension == not_until.dimension()
                                    && b.period == nanos(not_until.period())
                                    && b.ready_at(cost.amount(b.dimension)) == ready
                            });
                            prop_assert!(
                                slowest,
                                "step {}: {:?} is not the slowest limit",
                                step,
                                not_until
                            );
                        }
                        Err(e) => {
                            prop_assert!(false, "step {step}: {cost:?} fits, got {e:?}");
                        }
                    }
                }
                Op::MarkSent(index) => {
                    if !live.is_empty() {
                        let n = live.len();
                        let entry = &mut live[index % n];
                        entry.reservation.mark_sent();
                        entry.sent = true;
                    }
                }
                Op::Settle {
                    index,
                    input,
                    output,
                } => {
                    if let Some(entry) = take(&mut live, index) {
                        let reserved = entry.reservation.cost();
                        let actual = Cost::new(input, output).with_requests(reserved.requests());
                        let settlement = entry.reservation.settle(&Usage::new(input, output));
                        prop_assert_eq!(settlement.reserved(), reserved);
                        prop_assert_eq!(settlement.actual(), actual);
                        model.settle(&reserved, &actual);
                    }
                }
                Op::SettleCost {
                    index,
                    requests,
                    input,
                    output,
                } => {
                    if let Some(entry) = take(&mut live, index) {
                        let reserved = entry.reservation.cost();
                        let actual = Cost::new(input, output).with_requests(requests);
                        let settlement = entry.reservation.settle_cost(actual);
                        prop_assert_eq!(settlement.actual(), actual);
                        model.settle(&reserved, &actual);
                    }
                }
                Op::Refund(index) => {
                    if let Some(entry) = take(&mut live, index) {
                        let reserved = entry.reservation.cost();
                        let settlement = entry.reservation.refund();
                        prop_assert_eq!(settlement.actual(), Cost::default());
                        model.settle(&reserved, &Cost::default());
                    }
                }
                Op::Drop(index) => {
                    if let Some(entry) = take(&mut live, index) {
                        let reserved = entry.reservation.cost();
                        drop(entry.reservation);
                        if !entry.sent {
                            model.settle(&reserved, &Cost::default());
                        }
                    }
                }
                Op::ChargeEstimate(index) => {
                    if let Some(entry) = take(&mut live, index) {
                        let settlement = entry.reservation.charge_estimate();
                        prop_assert_eq!(settlement.actual(), settlement.reserved());
                    }
                }
                Op::Advance(ns) => {
                    tokio::time::advance(Duration::from_nanos(ns)).await;
                    now += ns;
                    prop_assert_eq!(start.elapsed(), Duration::from_nanos(now));
                    model.advance_to(now);
                }
            }
            prop_assert_eq!(levels(&budget), model.levels(), "step {}: {:?}", step, op);
            prop_assert_eq!(budget.waiters(), 0);
        }

        // Whatever is still held ends by the drop rule.
        for entry in live.drain(..) {
            let reserved = entry.reservation.cost();
            drop(entry.reservation);
            if !entry.sent {
                model.settle(&reserved, &Cost::default());
            }
        }
        prop_assert_eq!(levels(&budget), model.levels(), "after the last drops");

        // Reported times agree with the model.
        let snapshot = budget.snapshot();
        for (limit, bucket) in snapshot.limits().iter().zip(&model.buckets) {
            prop_assert_eq!(limit.capacity(), bucket.capacity);
            prop_assert_eq!(limit.debt(), bucket.reported().min(0).unsigned_abs());
            prop_assert_eq!(
                limit.full_at(),
                start + Duration::from_nanos(bucket.full_at())
            );
            prop_assert_eq!(
                limit.available_at(),
                start + Duration::from_nanos(bucket.ready_at(1))
            );
        }

        // A full refill brings every bucket back to capacity, and nobody waits.
        let full = model
            .buckets
            .iter()
            .map(ModelBucket::full_at)
            .max()
            .unwrap_or(now);
        tokio::time::advance(Duration::from_nanos(full - now)).await;
        let snapshot = budget.snapshot();
        for limit in snapshot.limits() {
            prop_assert_eq!(limit.level(), i64::try_from(limit.capacity()).unwrap());
            prop_assert_eq!(limit.full_at(), snapshot.taken_at());
        }
        prop_assert_eq!(budget.waiters(), 0);
        prop_assert_eq!(snapshot.queued(), Cost::default());
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// At one instant (no refill), every level is the capacity minus what was charged, with
    /// refunds capped at the capacity.
    #[test]
    fn conservation_at_one_instant(
        specs in prop::collection::vec(any_limit(), 1..=4),
        ops in ops(false),
    ) {
        check_conservation(&quota_of(&specs), &ops)?;
    }

    /// With the clock advancing between operations, levels follow the exact refill model.
    #[test]
    fn conservation_with_refill(
        specs in prop::collection::vec(any_limit(), 1..=4),
        ops in ops(true),
    ) {
        check_conservation(&quota_of(&specs), &ops)?;
    }
}

// ---------------------------------------------------------------------------------------------
// The adaptive share.

#[derive(Debug, Clone)]
enum ShareOp {
    /// The provider reports this share (in thousandths) of the nominal limit remaining.
    Report(u64),
    /// A 429.
    Pause,
    Advance(u64),
}

fn share_ops() -> impl Strategy<Value = Vec<ShareOp>> {
    let op = prop_oneof![
        4 => (0..=1_200u64).prop_map(ShareOp::Report),
        1 => Just(ShareOp::Pause),
        3 => (0..=2_000_000_000u64).prop_map(ShareOp::Advance),
    ];
    prop::collection::vec(op, 1..60)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the provider reports, the planned share stays within its bounds, the bucket's
    /// rate follows it, the level never exceeds the capacity, nor the level and the extra what
    /// the provider last reported (right after a report: never above the larger of the two),
    /// and once the provider's reports show nobody else spending the quota, the share climbs
    /// back to the whole quota.
    #[test]
    fn the_adaptive_share_stays_in_bounds_and_recovers(
        amount in 60..=100_000u64,
        ops in share_ops(),
    ) {
        paused_runtime().block_on(async {
            let period = Duration::from_secs(1);
            let limit = Limit::new(Dimension::TotalTokens, NonZeroU64::new(amount).unwrap(), period)
                .unwrap();
            let budget = Budget::new(Quota::new().with_limit(limit));
            let report = |thousandths: u64| {
                tower_llm_quota::budget::Observation::new(Dimension::TotalTokens, period)
                    .with_remaining(amount * thousandths / 1_000)
            };
            // `reported`: what the provider reported last, and whether that was the last event.
            let check = |budget: &Budget, reported: u64, just: bool| -> Result<(), TestCaseError> {
                let snapshot = budget.snapshot();
                let state = &snapshot.limits()[0];
                let share = state.limit().headroom();
                prop_assert!((0.2..=1.0).contains(&share), "share {share}");
                let planned = ((amount as f64 * share).floor() as u64).clamp(1, amount);
                prop_assert_eq!(state.limit().effective_amount(), planned);
                prop_assert_eq!(state.capacity(), state.limit().capacity());
                let (capacity, level) = (state.capacity(), state.level());
                prop_assert!(level <= i64::try_from(capacity).unwrap());
                // With the extra the provider's report allows: right after a report, never
                // more than the larger of the capacity and the report.
                let spendable = level + i64::try_from(state.extra()).unwrap();
                let most = if just { capacity.max(reported) } else { capacity + reported };
                prop_assert!(spendable <= i64::try_from(most).unwrap(), "{spendable}, most {most}");
                Ok(())
            };
            let mut reported = 0;
            for op in &ops {
                let just = match *op {
                    ShareOp::Report(thousandths) => {
                        budget.observe(&report(thousandths));
                        reported = amount * thousandths / 1_000;
                        true
                    }
                    ShareOp::Pause => {
                        budget.pause(&[Dimension::TotalTokens], Instant::now());
                        false
                    }
                    ShareOp::Advance(ns) => {
                        tokio::time::advance(Duration::from_nanos(ns)).await;
                        false
                    }
                };
                check(&budget, reported, just)?;
            }
            // Nobody else: the provider reports its whole quota, for long enough.
            for _ in 0..200 {
                tokio::time::advance(period / 10).await;
                budget.observe(&report(1_000));
                check(&budget, amount, true)?;
            }
            let share = budget.snapshot().limits()[0].limit().headroom();
            prop_assert_eq!(share, 1.0);
            Ok(())
        })?;
    }
}
