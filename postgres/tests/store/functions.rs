//! The schema's functions alone, with the clock argument that only tests pass, against plain
//! models: settlements duplicated, reordered and late conserve tokens, a clock stepping back
//! never adds any, a hold admits nothing before its end and keeps the level; processes refused
//! for capacity take turns; a node's caps match a list of every use; the calendar month turns
//! where the crate's does; slots are full exactly when live processes hold the cap; and the
//! lease function grants what the crate's book of leases
//! ([`Ledger`](tower_llm_quota::budget::store::fleet::Ledger)) grants. The same models the
//! Redis store's scripts are checked against.

use std::collections::HashMap;

use proptest::prelude::*;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;
use tower_llm_quota::budget::store::fleet::{Account, Answer, Claim, Ledger, Report};
use tower_llm_quota::tenant::CapWindow;
use tower_llm_quota_test_support::postgres_server::TestDatabase;
use tower_llm_quota_test_support::store_models::{
    BucketModel as Model, CAP, DEN, DayModel, FULL, LeaseOp, NUM, Reservation, SlotOp, Window,
    lease_op, slot_op,
};

/// A migrated database of its own and a connection to it, driven synchronously.
struct Sql {
    runtime: tokio::runtime::Runtime,
    client: tokio_postgres::Client,
    _database: TestDatabase,
}

impl Sql {
    fn new() -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let database = TestDatabase::create();
        let client = runtime.block_on(async {
            tower_llm_quota_postgres::migrate(database.url())
                .await
                .unwrap();
            let (client, connection) =
                tokio_postgres::connect(database.url(), tokio_postgres::NoTls)
                    .await
                    .unwrap();
            tokio::spawn(connection);
            client
        });
        Self {
            runtime,
            client,
            _database: database,
        }
    }

    fn rows(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Vec<Row> {
        self.runtime
            .block_on(self.client.query(sql, params))
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
    }

    fn run(&self, sql: &str) {
        self.runtime
            .block_on(self.client.batch_execute(sql))
            .unwrap();
    }

    /// Empties every table of the quota store.
    fn reset(&self) {
        self.run(
            "TRUNCATE llm_quota.buckets, llm_quota.holds, llm_quota.plans, llm_quota.records, \
             llm_quota.line, llm_quota.paused, llm_quota.alive, llm_quota.days, \
             llm_quota.slots, llm_quota.shares, llm_quota.holdings, llm_quota.share_sums, \
             llm_quota.share_roots, llm_quota.spreads, llm_quota.sweeps, llm_quota.clocks",
        );
    }
}

thread_local! {
    static SQL: Sql = Sql::new();
}

const TAG: &str = "t";
const BUCKET: &str = "t:total_tokens:1000";
/// One unit per millisecond (num 1, den 3: a unit is 3 ticks, 3 ticks a millisecond).
const LEASE_MS: i64 = 60_000;
const TOMBSTONE_MS: i64 = 30_000;
const GRACE_MS: i64 = 200;

const RESERVE: &str = "SELECT decision, wait_ms, bucket_index, by_hold, floor_only, \
    first_in_line FROM llm_quota.reserve($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, \
    $13, $14, $15, $16, $17, '{}', '{}', '{}', '{}', '{}')";

/// A reserve decision as a test reads it: the decision, the wait, whether the hold is what
/// the wait is for, whether only a floor keeps it out, whether the process is first in line.
type Answered = (String, i64, bool, bool, bool);

/// One reserve call of `cost` units of the one bucket by process `who` (class `rank`; an empty
/// `who` takes no turns) at `now` ms.
fn reserve(sql: &Sql, (who, rank): (&str, i32), id: &str, cost: i64, now: i64) -> Answered {
    let record = format!("t/r/{id}");
    let turns = i32::from(!who.is_empty());
    let rows = sql.rows(
        RESERVE,
        &[
            &now,
            &TAG,
            &LEASE_MS,
            &who,
            &rank,
            &turns,
            &GRACE_MS,
            &vec![BUCKET],
            &vec![NUM],
            &vec![DEN],
            &vec![CAP],
            &vec![cost],
            &vec![0i64],
            &record,
            &"t",
            &"t",
            &Vec::<String>::new(),
        ],
    );
    let row = &rows[0];
    (
        row.get("decision"),
        row.get::<_, Option<i64>>("wait_ms").unwrap_or(0),
        row.get::<_, Option<bool>>("by_hold").unwrap_or(false),
        row.get::<_, Option<bool>>("floor_only").unwrap_or(false),
        row.get::<_, Option<bool>>("first_in_line").unwrap_or(false),
    )
}

/// Settles, in one call, each `(id, reserved, actual)` of the one bucket: the answers.
fn settle(sql: &Sql, settlements: &[(String, i64, i64)], now: i64) -> Vec<i32> {
    let records: Vec<String> = settlements
        .iter()
        .map(|(id, ..)| format!("t/r/{id}"))
        .collect();
    let n = settlements.len();
    let rows = sql.rows(
        "SELECT llm_quota.settle($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, \
         '{}', '{}', '{}', '{}')",
        &[
            &now,
            &TAG,
            &TOMBSTONE_MS,
            &vec![BUCKET],
            &vec![NUM],
            &vec![DEN],
            &vec![CAP],
            &records,
            &vec![1i32; n],
            &vec![0i32; n],
            &vec![1i32; n],
            &settlements.iter().map(|s| s.1).collect::<Vec<_>>(),
            &settlements.iter().map(|s| s.2).collect::<Vec<_>>(),
        ],
    );
    rows[0].get(0)
}

/// A provider's report on the bucket at `now`: `remaining` units left, a pause of `pause` ms.
fn lower(sql: &Sql, remaining: Option<i64>, pause: i64, now: i64) {
    sql.rows(
        "SELECT llm_quota.lower($1, $2, $3, $4, $5, $6, $7, $8, NULL, 0, 0, 60000)",
        &[&now, &TAG, &BUCKET, &NUM, &DEN, &CAP, &remaining, &pause],
    );
}

/// The bucket's level as a reservation reads it at `now` (refilled; absent or expired: full).
fn level(sql: &Sql, now: i64) -> i64 {
    let rows = sql.rows(
        "SELECT tok FROM llm_quota.load($1, $2, $3, $4, $5)",
        &[&BUCKET, &now, &(NUM as f64), &(DEN as f64), &(FULL as f64)],
    );
    rows[0].get::<_, f64>(0) as i64
}

/// The hold's end as stored, if any.
fn held(sql: &Sql) -> Option<i64> {
    let rows = sql.rows(
        "SELECT until_ms FROM llm_quota.holds WHERE key = $1",
        &[&BUCKET],
    );
    rows.first().map(|row| row.get(0))
}

#[derive(Debug, Clone)]
enum Op {
    Reserve(i64),
    /// Settle, in one call, the n-th reservations (modulo) with these actual costs; a
    /// reservation may repeat, in one call or across calls.
    Settle(Vec<(usize, i64)>),
    /// Its record expires (the lease passed).
    Expire(usize),
    Advance(i64),
    StepBack(i64),
    /// A provider's 429: hold for this many ms.
    Pause(i64),
    /// Lift the hold.
    Lift,
    /// A provider reports this many units remaining.
    Remaining(i64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1i64..600).prop_map(Op::Reserve),
        3 => proptest::collection::vec((0usize..8, 0i64..900), 1..4).prop_map(Op::Settle),
        1 => (0usize..8).prop_map(Op::Expire),
        2 => (0i64..400).prop_map(Op::Advance),
        1 => (0i64..5_000).prop_map(Op::StepBack),
        2 => (2_000i64..6_000).prop_map(Op::Pause),
        1 => Just(Op::Lift),
        1 => (0i64..1_200).prop_map(Op::Remaining),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn settlements_conserve_tokens_and_time_never_runs_back(
        ops in proptest::collection::vec(op(), 1..60)
    ) {
        SQL.with(|sql| -> Result<(), TestCaseError> {
            sql.reset();
            let mut now: i64 = 1_000_000;
            let mut model = Model { tok: FULL, ts: None };
            let mut hold: Option<i64> = None;
            let mut reservations: Vec<Reservation> = Vec::new();
            for (step, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Reserve(cost) => {
                        let id = format!("{step}");
                        let (decision, wait, by_hold, floor_only, first) =
                            reserve(sql, ("", 0), &id, cost, now);
                        let read = model.at(now);
                        let held_for = hold.map_or(0, |end| (end - now).max(0));
                        if read.tok >= cost * DEN && held_for == 0 {
                            prop_assert_eq!(decision, "admitted", "step {}: refused though it fits", step);
                            model = Model { tok: read.tok - cost * DEN, ..read }.written(now);
                            reservations.push(Reservation { id, cost, settled: false, expired: false });
                        } else {
                            prop_assert_eq!(decision, "denied", "step {}: admitted beyond the level", step);
                            let refill = if read.tok >= cost * DEN {
                                0
                            } else {
                                (cost * DEN - read.tok + NUM - 1) / NUM
                                    + (read.ts.unwrap_or(now) - now).max(0)
                            };
                            prop_assert_eq!(wait, refill.max(held_for), "step {}: wrong wait", step);
                            prop_assert_eq!(by_hold, held_for >= refill, "step {}: held", step);
                            prop_assert!(!floor_only, "step {}: floor only", step);
                            prop_assert!(!first, "step {}: first", step);
                        }
                    }
                    Op::Settle(settlements) => {
                        if reservations.is_empty() {
                            continue;
                        }
                        let n = reservations.len();
                        let batch: Vec<(String, i64, i64)> = settlements
                            .iter()
                            .map(|(i, actual)| {
                                let r = &reservations[i % n];
                                (r.id.clone(), r.cost, *actual)
                            })
                            .collect();
                        let answers = settle(sql, &batch, now);
                        for ((i, actual), answer) in settlements.iter().zip(answers) {
                            let r = &mut reservations[i % n];
                            let delta = actual - r.cost;
                            if r.settled {
                                prop_assert_eq!(answer, 0, "step {}: settled twice", step);
                            } else if r.expired {
                                prop_assert_eq!(answer, 2, "step {}: a late settlement", step);
                                if delta > 0 {
                                    model = model.charge(delta, now);
                                }
                            } else {
                                prop_assert_eq!(answer, 1, "step {}", step);
                                if delta != 0 {
                                    model = model.charge(delta, now);
                                }
                            }
                            r.settled = true;
                        }
                    }
                    Op::Expire(i) => {
                        if reservations.is_empty() {
                            continue;
                        }
                        let n = reservations.len();
                        let r = &mut reservations[i % n];
                        let record = format!("t/r/{}", r.id);
                        sql.rows("DELETE FROM llm_quota.records WHERE key = $1", &[&record]);
                        r.expired = true;
                        r.settled = false;
                    }
                    Op::Advance(ms) => now += ms,
                    Op::StepBack(ms) => now -= ms,
                    Op::Pause(ms) => {
                        lower(sql, None, ms, now);
                        // A later end extends the hold, an earlier one never shortens it; the
                        // level is not touched.
                        hold = Some(hold.map_or(now + ms, |end| end.max(now + ms)));
                    }
                    Op::Lift => {
                        sql.rows("SELECT llm_quota.lift($1, $2)", &[&TAG, &vec![BUCKET]]);
                        hold = None;
                    }
                    Op::Remaining(units) => {
                        lower(sql, Some(units.min(CAP)), 0, now);
                        let read = model.at(now);
                        model = Model { tok: read.tok.min(units.min(CAP) * DEN), ..read }.written(now);
                    }
                }
                prop_assert_eq!(level(sql, now), model.at(now).tok, "step {}: the level", step);
                prop_assert_eq!(held(sql), hold, "step {}: the hold", step);
            }
            Ok(())
        })?;
    }
}

/// Turns between processes, step by step on a bucket of 1,000 units refilling one a
/// millisecond (the Redis script's case, call for call): the first in line gets the refill
/// before one that asks earlier; one that would leave it short at its turn is refused, one
/// that leaves it its need goes, also while it is late; an admitted process keeps its place
/// for a moment; a clock leads the virtual time by a bounded lead; a higher class goes first;
/// and a process that does not come back within its grace loses its turn and its clock.
#[test]
fn processes_refused_for_capacity_take_turns() {
    let sql = Sql::new();
    let (a, b, c) = (("a", 2), ("b", 2), ("c", 0));
    let mut t = 1_000_000;
    let denied = |wait: i64, first: bool| ("denied".to_owned(), wait, false, false, first);
    let ask = |who, id: &str, cost, now| reserve(&sql, who, id, cost, now);
    // Admitted, leaving `level` units in the bucket.
    let admitted = |answer: Answered, now, level| {
        answer.0 == "admitted" && self::level(&sql, now) / DEN == level
    };
    assert!(admitted(ask(a, "a1", 1_000, t), t, 0));
    assert_eq!(ask(b, "b1", 300, t), denied(300, true));
    t += 100;
    assert_eq!(ask(a, "a2", 100, t), denied(200, false));
    assert_eq!(ask(a, "a3", 50, t), denied(200, false));
    // `b` is late: it keeps its need, `a` takes what is beyond it.
    t += 250;
    assert!(admitted(ask(a, "a3", 50, t), t, 300));
    t += 50;
    assert!(admitted(ask(b, "b1", 300, t), t, 50));
    // `b` keeps its place for a moment; `a`, behind it on its clock, is first.
    assert_eq!(ask(a, "a4", 100, t), denied(50, true));
    t += 5;
    assert_eq!(ask(b, "b2", 50, t), denied(45, false));
    t += 210;
    assert_eq!(ask(b, "b3", 300, t), denied(1, false));
    // `a` does not come back within its grace: it loses its place; `c` ranks before `b`.
    t += 60;
    assert!(admitted(ask(c, "c1", 50, t), t, 275));
    // `a`, silent longer than its grace, lost its clock too.
    t += 300;
    assert!(admitted(ask(a, "a5", 100, t), t, 475));
    let line = sql.rows("SELECT process FROM llm_quota.line ORDER BY score", &[]);
    let line: Vec<String> = line.iter().map(|r| r.get(0)).collect();
    assert_eq!(line, ["a", "b"]);
    let clocks = sql.rows(
        "SELECT process, at FROM llm_quota.clocks WHERE process <> '~' ORDER BY process",
        &[],
    );
    let clocks: Vec<(String, f64)> = clocks.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(
        clocks,
        [
            ("a".to_owned(), 250.0),
            ("b".to_owned(), 250.0),
            ("c".to_owned(), 250.0)
        ]
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// `day_add` and `day_used` against the plain model, over uses, refunds and time passing
    /// by minutes to days, for every kind of window (a month's end among them).
    #[test]
    fn cap_counts_match_a_list_of_every_use(
        window in prop_oneof![Just(Window::Day), Just(Window::Month), Just(Window::Rolling)],
        ops in proptest::collection::vec((-300i64..500, 0i64..6 * 3_600_000), 1..60)
    ) {
        SQL.with(|sql| -> Result<(), TestCaseError> {
            sql.reset();
            let field = window.field();
            let mut model = DayModel::default();
            // 2026-01-25T20:00:00Z: days, and a month, end within the ops.
            let mut now: i64 = 1_769_371_200_000;
            for (step, (delta, wait)) in ops.into_iter().enumerate() {
                now += wait;
                sql.rows(
                    "SELECT llm_quota.day_add($1, $2, $3, $4, $5)",
                    &[&TAG, &"t/t/acme:days", &field, &delta, &now],
                );
                let rows = sql.rows(
                    "SELECT llm_quota.day_used($1, $2, $3)",
                    &[&"t/t/acme:days", &field, &now],
                );
                let used: i64 = rows[0].get(0);
                model.add(window, delta, now);
                prop_assert_eq!(used, model.used(window, now), "step {}", step);
            }
            Ok(())
        })?;
    }
}

/// The functions' calendar month turns at the very millisecond the crate's does, for every
/// month from 1970 to 2400: leap years, century years and the 400-year rule included.
#[test]
fn the_functions_month_turns_where_the_crates_does() {
    let sql = Sql::new();
    let mut boundaries = Vec::new();
    let mut at = 0;
    // 2400-01-01T00:00:00Z.
    while at < 13_569_465_600 {
        let next = CapWindow::CalendarMonthUtc.resets_after(at);
        boundaries.push(i64::try_from(next * 1_000).unwrap());
        at = next;
    }
    let rows = sql.rows(
        "SELECT array_agg(llm_quota.period('m', b - 1) ORDER BY n), \
         array_agg(llm_quota.period('m', b) ORDER BY n) \
         FROM unnest($1::bigint[]) WITH ORDINALITY AS t(b, n)",
        &[&boundaries],
    );
    let (before, after): (Vec<i64>, Vec<i64>) = (rows[0].get(0), rows[0].get(1));
    for (i, (before, after)) in before.into_iter().zip(after).enumerate() {
        let i = i64::try_from(i).unwrap();
        assert_eq!((before, after), (i, i + 1), "month {i}");
    }
    assert_eq!(boundaries.len(), 430 * 12);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// `slots_held` against a plain list of the calls in flight and each process's lease:
    /// every slot free exactly when fewer than the cap are held under leases that still last.
    #[test]
    fn slots_are_full_exactly_when_live_processes_hold_the_cap(
        ops in proptest::collection::vec(slot_op(), 1..80)
    ) {
        const LEASE: i64 = 1_000;
        const SLOTS: &str = "t/t/acme:slots";
        SQL.with(|sql| -> Result<(), TestCaseError> {
            sql.reset();
            let mut calls: Vec<(String, u8, i64)> = Vec::new();
            let mut leases = [None::<(i64, i64)>; 3];
            let mut now: i64 = 1_000_000;
            let mut next = 0;
            let renew = |leases: &mut [Option<(i64, i64)>; 3], process: u8, now: i64| {
                let lease = &mut leases[usize::from(process)];
                let start = match *lease {
                    Some((end, start)) if end > now => start,
                    _ => now,
                };
                *lease = Some((now + LEASE, start));
                start
            };
            for (step, op) in ops.into_iter().enumerate() {
                match op {
                    SlotOp::Take(process) => {
                        next += 1;
                        let id = format!("p{process}-{next}");
                        let rows = sql.rows(
                            "SELECT llm_quota.renew('t', $1, $2, $3)",
                            &[&format!("p{process}"), &now, &LEASE],
                        );
                        let start: i64 = rows[0].get(0);
                        sql.rows(
                            "INSERT INTO llm_quota.slots (key, id, tag, taken) VALUES ($1, $2, 't', $3)",
                            &[&SLOTS, &id, &start],
                        );
                        prop_assert_eq!(start, renew(&mut leases, process, now), "step {}", step);
                        calls.push((id, process, start));
                    }
                    SlotOp::End(i) => {
                        if calls.is_empty() {
                            continue;
                        }
                        let (id, _, _) = calls.remove(i % calls.len());
                        sql.rows("DELETE FROM llm_quota.slots WHERE key = $1 AND id = $2", &[&SLOTS, &id]);
                    }
                    SlotOp::Renew(process) => {
                        let rows = sql.rows(
                            "SELECT llm_quota.renew('t', $1, $2, $3)",
                            &[&format!("p{process}"), &now, &LEASE],
                        );
                        let start: i64 = rows[0].get(0);
                        prop_assert_eq!(start, renew(&mut leases, process, now), "step {}", step);
                    }
                    SlotOp::Advance(ms) => now += ms,
                    SlotOp::Full(max) => {
                        let rows = sql.rows(
                            "SELECT llm_quota.slots_held($1, 't', $2, $3) >= $3",
                            &[&SLOTS, &now, &max],
                        );
                        let full: bool = rows[0].get(0);
                        let live = calls
                            .iter()
                            .filter(|(_, p, taken)| {
                                leases[usize::from(*p)]
                                    .is_some_and(|(end, start)| end > now && start == *taken)
                            })
                            .count() as i64;
                        prop_assert_eq!(full, live >= max, "step {}: {} live", step, live);
                    }
                }
            }
            Ok(())
        })?;
    }
}

/// The lease function against the crate's book of leases over generated renewals (with any
/// report: debts, units given back, needs, asks), renewals that arrive after a later one,
/// departures and time: the same grants, spreads, levels and holdings, and the bucket and the
/// leases together never above the burst.
mod lease_against_the_model {
    use super::*;

    const ROOT: &str = "t";
    const LEASE_BUCKET: &str = "t:total_tokens:60000";
    const LEASE_MS: i64 = 300;
    const EVERY: i64 = 50;
    /// A unit every 10 ms, 200 at most.
    const ACCOUNT: Account = Account {
        num: 1,
        den: 10,
        capacity: 200,
    };

    /// One lease call: its renewal, part, granted units, readiness and spreads.
    fn lease(
        sql: &Sql,
        (process, seq, want): (u8, u64, f64),
        renew: &Report,
        (flow_keys, flow_weights): (Vec<String>, Vec<f64>),
        now: i64,
    ) -> (String, i64, Vec<i64>, i64, Vec<i64>) {
        let i = |n: u64| i64::try_from(n).unwrap();
        let rows = sql.rows(
            "SELECT renewal, part_ppm, granted_units, ready_ms, spread, hold_ms, plan_ppm \
             FROM llm_quota.lease($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, \
             $15, $16, $17, $18, $19, $20)",
            &[
                &now,
                &TAG,
                &ROOT,
                &format!("p{process}"),
                &LEASE_MS,
                &want,
                &EVERY,
                &i(seq),
                &vec![LEASE_BUCKET],
                &vec![0.0f64],
                &vec![60_000.0f64],
                &vec![i(ACCOUNT.num)],
                &vec![i(ACCOUNT.den)],
                &vec![i(ACCOUNT.capacity)],
                &vec![renew.keep],
                &vec![i(renew.back)],
                &vec![i(renew.need)],
                &vec![i(renew.ask)],
                &flow_keys,
                &flow_weights,
            ],
        );
        // The model keeps no expiry: the rows' (a store's cleanup after four silent leases)
        // is pushed past the case, as the Redis scripts' keys' real TTLs are in their test.
        sql.run(
            "UPDATE llm_quota.buckets SET expires = 9000000000000000; \
             UPDATE llm_quota.share_roots SET expires = 9000000000000000",
        );
        let row = &rows[0];
        let renewal: String = row.get("renewal");
        if matches!(renewal.as_str(), "stale" | "left") {
            return (renewal, 0, vec![], 0, vec![]);
        }
        assert_eq!(row.get::<_, Vec<i64>>("hold_ms"), [0], "no hold");
        assert_eq!(
            row.get::<_, Vec<i64>>("plan_ppm"),
            [1_000_000],
            "the whole plan"
        );
        (
            renewal,
            row.get("part_ppm"),
            row.get("granted_units"),
            row.get("ready_ms"),
            row.get("spread"),
        )
    }

    /// The bucket as stored: its level in whole units and what leases hold (absent: full,
    /// nothing held).
    fn bucket(sql: &Sql, now: i64) -> (i64, u64) {
        let rows = sql.rows(
            "SELECT units, held FROM llm_quota.buckets WHERE key = $1 AND expires > $2",
            &[&LEASE_BUCKET, &now],
        );
        rows.first().map_or((ACCOUNT.capacity as i64, 0), |row| {
            (row.get(0), u64::try_from(row.get::<_, i64>(1)).unwrap())
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn the_function_grants_what_the_model_grants(
            ops in proptest::collection::vec(lease_op(), 1..80)
        ) {
            SQL.with(|sql| -> Result<(), TestCaseError> {
                sql.reset();
                let mut now: i64 = 1_000_000;
                let mut model = Ledger::new(ACCOUNT, LEASE_MS as u64, EVERY as u64);
                let mut seqs: HashMap<u8, u64> = HashMap::new();
                for (step, op) in ops.into_iter().enumerate() {
                    let mut wrote = false;
                    match op {
                        LeaseOp::Advance(ms) => now += ms,
                        LeaseOp::Leave(process, keep, back) => {
                            let seq = seqs.entry(process).or_insert(0);
                            *seq += 1;
                            let seq = *seq;
                            let renew = Report { keep, back, need: 0, ask: 0 };
                            let (renewal, ..) =
                                lease(sql, (process, seq, -1.0), &renew, (vec![], vec![]), now);
                            let answer = model.leave(u64::from(process), (seq, renew), now as u64);
                            wrote = answer != Answer::Stale;
                            let expected = if wrote { "left" } else { "stale" };
                            prop_assert_eq!(renewal, expected, "step {}", step);
                        }
                        LeaseOp::Lease { process, want, flows, guarantees, renew, stale } => {
                            let seq = seqs.entry(process).or_insert(0);
                            if !stale || *seq == 0 {
                                *seq += 1;
                            }
                            let seq = *seq;
                            let want = f64::from(want) / 20.0;
                            let keys = flows.iter().map(|(k, _)| format!("{k:x}"))
                                .chain(guarantees.iter().map(|(k, _)| format!("g{k:x}")))
                                .collect();
                            let weights = flows.iter().map(|(_, w)| f64::from(*w))
                                .chain(guarantees.iter().map(|(_, s)| f64::from(*s)))
                                .collect();
                            let (renewal, told, granted_units, ready_ms, spreads) =
                                lease(sql, (process, seq, want), &renew, (keys, weights), now);
                            let claim = flows
                                .iter()
                                .fold(Claim::new(want), |c, &(key, weight)| c.with_flow(key, weight));
                            let claim = guarantees
                                .iter()
                                .fold(claim, |c, &(key, share)| c.with_guarantee(key, share));
                            let mut divided = None;
                            let answer = model.lease(u64::from(process), claim, (seq, renew), now as u64, |part| {
                                divided = Some(part);
                                told as u64
                            });
                            match answer {
                                Answer::Stale => prop_assert_eq!(renewal, "stale", "step {}", step),
                                Answer::Left => prop_assert!(false, "a renewal answered as a leave"),
                                Answer::Granted { known, part, granted, ready, spread } => {
                                    wrote = true;
                                    let divided = divided.unwrap();
                                    prop_assert!(
                                        divided.abs_diff(part) <= 1,
                                        "step {}: part {} by the function, {} by the model", step, part, divided
                                    );
                                    prop_assert_eq!(renewal, if known { "renewed" } else { "new" }, "step {}", step);
                                    prop_assert_eq!(granted_units, vec![granted as i64], "step {}", step);
                                    prop_assert_eq!(ready_ms, ready as i64, "step {}", step);
                                    let spread: Vec<i64> = spread.into_iter().map(i64::from).collect();
                                    prop_assert_eq!(spreads, spread, "step {}", step);
                                }
                            }
                        }
                    }
                    if wrote {
                        prop_assert_eq!(bucket(sql, now), model.level(now as u64), "step {}", step);
                    }
                    prop_assert!(model.holds_at_most_the_burst(now as u64), "step {}", step);
                }
                Ok(())
            })?;
        }
    }
}

/// A process is granted the whole burst of an account that refills slowly and dies before it
/// reports anything; nobody renews for far longer than its leases: a newcomer finds the burst
/// spent (the bucket's row lives until its level would refill the whole capacity).
#[test]
fn a_dead_holder_s_grant_is_not_granted_again_after_a_silence() {
    let sql = Sql::new();
    // 200 tokens, one every 100 s.
    let grant = |process: &str, now: i64| -> Vec<i64> {
        let rows = sql.rows(
            "SELECT granted_units FROM llm_quota.lease($1, 't', 't', $2, 300, 1.0, 50, 1, \
             ARRAY['t:total_tokens:20000000'], ARRAY[0::float8], ARRAY[20000000::float8], \
             ARRAY[1::bigint], ARRAY[100000::bigint], ARRAY[200::bigint], ARRAY[0::bigint], \
             ARRAY[0::bigint], ARRAY[200::bigint], ARRAY[0::bigint], '{}', '{}')",
            &[&now, &process],
        );
        rows[0].get(0)
    };
    assert_eq!(grant("dead", 1_000_000), [200]);
    for silence in [2_000, 60_000, 600_000] {
        assert_eq!(
            grant(&format!("new{silence}"), 1_000_000 + silence),
            [0],
            "after {silence} ms"
        );
    }
}
