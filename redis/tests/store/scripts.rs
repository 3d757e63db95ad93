//! The Redis store's scripts alone, on a private `redis-server`, with the clock argument that
//! only tests pass: settlements duplicated, reordered and late conserve tokens, a clock
//! stepping back never adds any, a hold (a provider's pause) admits nothing before its end and
//! keeps the level, and a bucket in the debt an earlier version wrote for a pause refills. An
//! exact model of one bucket and its hold is checked after every step; a plain list of every
//! use checks a tenant node's daily counts.

use tower_llm_quota_test_support::redis_server;

use proptest::prelude::*;
use redis::Script;

use redis_server::RedisServer;
use tower_llm_quota::tenant::CapWindow;
use tower_llm_quota_test_support::store_models::{
    BucketModel as Model, CAP, DEN, DayModel, FULL, NUM, Reservation, SlotOp, Window, slot_op,
};

const BUCKET: &str = "t:{q}:total_tokens:1000";
const HOLD: &str = "t:{q}:total_tokens:1000:held";
/// One unit per millisecond (num 1, den 3: a unit is 3 ticks, 3 ticks a millisecond).
const LEASE_MS: i64 = 60_000;
const TOMBSTONE_MS: i64 = 30_000;

fn script(body: &str) -> Script {
    Script::new(&format!(
        "{}{}{}",
        include_str!("../../src/bucket.lua"),
        include_str!("../../src/controls.lua"),
        body
    ))
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
    /// Lift the hold (what `Budget::lift_pause` sends).
    Lift,
    /// A provider reports this many units remaining.
    Remaining(i64),
    /// The previous version's pause for this many ms: the bucket emptied, the pause's refill
    /// owed as debt (keys written before an upgrade).
    LegacyPause(i64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1i64..600).prop_map(Op::Reserve),
        3 => proptest::collection::vec((0usize..8, 0i64..900), 1..4).prop_map(Op::Settle),
        1 => (0usize..8).prop_map(Op::Expire),
        2 => (0i64..400).prop_map(Op::Advance),
        1 => (0i64..5_000).prop_map(Op::StepBack),
        // At least 2 s: the key's real TTL then outlives any case, whose clock is simulated.
        2 => (2_000i64..6_000).prop_map(Op::Pause),
        1 => Just(Op::Lift),
        1 => (0i64..1_200).prop_map(Op::Remaining),
        1 => (0i64..3_000).prop_map(Op::LegacyPause),
    ]
}

/// The hold's end as stored, if any.
fn held(connection: &mut redis::Connection) -> Option<i64> {
    let value: Option<String> = redis::cmd("GET").arg(HOLD).query(connection).unwrap();
    value.map(|v| v.parse().unwrap())
}

fn level(connection: &mut redis::Connection) -> i64 {
    // "<units>:<ticks>:<den>:<ts>"
    let value: Option<String> = redis::cmd("GET").arg(BUCKET).query(connection).unwrap();
    value.map_or(FULL, |v| {
        let parts: Vec<i64> = v.split(':').map(|p| p.parse().unwrap()).collect();
        assert_eq!(parts[2], DEN);
        parts[0] * DEN + parts[1]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn settlements_conserve_tokens_and_time_never_runs_back(
        ops in proptest::collection::vec(op(), 1..60)
    ) {
        thread_local! {
            static SERVER: RedisServer = RedisServer::start();
        }
        let url = SERVER.with(RedisServer::url);
        let mut connection = redis::Client::open(url).unwrap().get_connection().unwrap();
        let _: () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
        let reserve = script(include_str!("../../src/reserve.lua"));
        let settle = script(include_str!("../../src/settle.lua"));
        let lower = script(include_str!("../../src/lower.lua"));

        let mut now: i64 = 1_000_000;
        let mut model = Model { tok: FULL, ts: None };
        // The hold's end (server ms), as written: the key expires only after the case.
        let mut hold: Option<i64> = None;
        let mut reservations: Vec<Reservation> = Vec::new();
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Reserve(cost) => {
                    let id = format!("t:{{q}}:r:{step}");
                    let reply: Vec<i64> = reserve
                        .key(BUCKET)
                        .key(HOLD)
                        .key(&id)
                        .key("t:{q}:line")
                        .key("t:{q}:line:at")
                        .key("t:{q}:paused")
                        .key("t:{q}:alive")
                        .key("t:{q}:line:clocks")
                        .arg(now)
                        .arg(LEASE_MS)
                        // No turns: one process; one bucket, no tenant path.
                        .arg("").arg(0).arg(1).arg(0).arg(1).arg(0).arg(1_000_000)
                        .arg(NUM).arg(DEN).arg(CAP).arg(cost).arg(0)
                        .invoke(&mut connection)
                        .unwrap();
                    let read = model.at(now);
                    let held_for = hold.map_or(0, |end| (end - now).max(0));
                    if read.tok >= cost * DEN && held_for == 0 {
                        prop_assert_eq!(reply[0], 1, "step {}: refused though it fits", step);
                        model = Model { tok: read.tok - cost * DEN, ..read }.written(now);
                        reservations.push(Reservation { id, cost, settled: false, expired: false });
                    } else {
                        prop_assert_eq!(reply[0], 0, "step {}: admitted beyond the level", step);
                        let refill = if read.tok >= cost * DEN {
                            0
                        } else {
                            (cost * DEN - read.tok + NUM - 1) / NUM
                                + (read.ts.unwrap_or(now) - now).max(0)
                        };
                        // Nothing is written: the level stays what it was.
                        prop_assert_eq!(reply[1], refill.max(held_for), "step {}: wrong wait", step);
                        prop_assert_eq!(reply[3], i64::from(held_for >= refill), "step {}: held", step);
                        // No floor in the model: only a cost the bucket lacks, or a hold, keeps it out.
                        prop_assert_eq!(reply[4], 0, "step {}: floor only", step);
                        // No turns: never first in a line.
                        prop_assert_eq!(reply[5], 0, "step {}: first", step);
                    }
                }
                Op::Settle(settlements) => {
                    if reservations.is_empty() {
                        continue;
                    }
                    let n = reservations.len();
                    // KEYS: the bucket, then one record per settlement (a record may repeat).
                    let mut invocation = settle.key(BUCKET);
                    invocation.arg(now).arg(TOMBSTONE_MS).arg(1).arg(NUM).arg(DEN).arg(CAP);
                    for (k, (i, actual)) in settlements.iter().enumerate() {
                        let r = &reservations[i % n];
                        invocation.key(&r.id).arg(k + 2).arg(1).arg(0).arg(1).arg(r.cost).arg(*actual);
                    }
                    let answers: Vec<i64> = invocation.invoke(&mut connection).unwrap();
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
                    let _: i64 = redis::cmd("DEL").arg(&r.id).query(&mut connection).unwrap();
                    r.expired = true;
                    r.settled = false;
                }
                Op::Advance(ms) => now += ms,
                Op::StepBack(ms) => now -= ms,
                Op::Pause(ms) => {
                    let _: i64 = lower
                        .key(BUCKET).key(HOLD)
                        .arg(now).arg(NUM).arg(DEN).arg(CAP).arg("").arg(ms)
                        .invoke(&mut connection)
                        .unwrap();
                    // A later end extends the hold, an earlier one never shortens it; the
                    // level is not touched.
                    hold = Some(hold.map_or(now + ms, |end| end.max(now + ms)));
                }
                Op::Lift => {
                    let _: i64 = redis::cmd("DEL").arg(HOLD).query(&mut connection).unwrap();
                    hold = None;
                }
                Op::Remaining(units) => {
                    let _: i64 = lower
                        .key(BUCKET).key(HOLD)
                        .arg(now).arg(NUM).arg(DEN).arg(CAP).arg(units.min(CAP)).arg(0)
                        .invoke(&mut connection)
                        .unwrap();
                    let read = model.at(now);
                    model = Model { tok: read.tok.min(units.min(CAP) * DEN), ..read }.written(now);
                }
                Op::LegacyPause(ms) => {
                    // What the previous lower.lua stored for a pause, in the same format.
                    let read = model.at(now);
                    let ts = read.ts.unwrap_or(now);
                    let tok = read.tok.min((-(ms - (ts - now).max(0)) * NUM).min(0));
                    model = Model { tok, ..read }.written(now);
                    if model.ts.is_some() {
                        let value = format!(
                            "{}:{}:{DEN}:{ts}",
                            tok.div_euclid(DEN),
                            tok.rem_euclid(DEN)
                        );
                        let _: () = redis::cmd("SET")
                            .arg(BUCKET).arg(value).arg("PX").arg(60_000)
                            .query(&mut connection)
                            .unwrap();
                    }
                }
            }
            prop_assert_eq!(level(&mut connection), model.tok, "step {}: stored level", step);
            prop_assert_eq!(held(&mut connection), hold, "step {}: stored hold", step);
        }
    }
}

/// One reserve call of `cost` units by process `who` (class `rank`) at `now` ms.
fn reserve_as(
    connection: &mut redis::Connection,
    reserve: &Script,
    (who, rank): (&str, i64),
    id: &str,
    cost: i64,
    now: i64,
) -> Vec<i64> {
    reserve
        .key(BUCKET)
        .key(HOLD)
        .key(format!("t:{{q}}:r:{id}"))
        .key("t:{q}:line")
        .key("t:{q}:line:at")
        .key("t:{q}:paused")
        .key("t:{q}:alive")
        .key("t:{q}:line:clocks")
        .arg(now)
        .arg(LEASE_MS)
        .arg(who)
        .arg(rank)
        .arg(1)
        .arg(GRACE_MS)
        // One bucket, no tenant path, the whole account its part.
        .arg(1)
        .arg(0)
        .arg(1_000_000)
        .arg(NUM)
        .arg(DEN)
        .arg(CAP)
        .arg(cost)
        .arg(0)
        .invoke(connection)
        .unwrap()
}

const GRACE_MS: i64 = 200;

/// Turns between processes, step by step on a bucket of 1,000 units refilling one a
/// millisecond, each process's part the whole account (see `reserve.lua`, Turns): the first in
/// line gets the refill before one that asks earlier; one that would leave it short at its
/// turn is refused, one that leaves it its need goes (backfilling), also while it is late; an
/// admitted process keeps its place for a moment; a clock runs at most a bounded lead ahead
/// of the virtual time; a higher class goes first; and a process that does not come back
/// within its grace loses its turn and, not asking, its clock.
#[test]
fn processes_refused_for_capacity_take_turns() {
    let server = RedisServer::start();
    let mut connection = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let reserve = script(include_str!("../../src/reserve.lua"));
    let (a, b, c) = (("a", 2), ("b", 2), ("c", 0));
    let mut t = 1_000_000;
    let mut ask =
        |who, id: &str, cost, now| reserve_as(&mut connection, &reserve, who, id, cost, now);
    // `a` empties the bucket (its clock: 1,000); `b`, new, starts at the virtual time (0):
    // its 300 rank before `a`'s place. First in line, back in 300 ms, told so exactly.
    assert_eq!(ask(a, "a1", 1_000, t), [1, 0]);
    assert_eq!(ask(b, "b1", 300, t), [0, 300, 1, 0, 0, 1]);
    // 100 ms later `a` asks for 100, then 50: there are 100, but taking either leaves `b`
    // short at its turn (its 1,000 ran its clock far ahead; the lead bounds its stamp at
    // 0 + 200 + 100, still after `b`'s 300). Refused, told to come back at `b`'s turn.
    t += 100;
    assert_eq!(ask(a, "a2", 100, t), [0, 200, 1, 0, 0, 0]);
    assert_eq!(ask(a, "a3", 50, t), [0, 200, 1, 0, 0, 0]);
    // `b` is 50 ms late: it keeps its need, and `a` takes only what is beyond it (350 - 50
    // leaves 300).
    t += 250;
    assert_eq!(ask(a, "a3", 50, t), [1, 300]);
    t += 50;
    assert_eq!(ask(b, "b1", 300, t), [1, 50]);
    // `b` keeps its place for a moment, expected back; `a`, behind it on its clock, ranks
    // before it and is first now (50 of its 100 there).
    assert_eq!(ask(a, "a4", 100, t), [0, 50, 1, 0, 0, 1]);
    // `b` back: its request's own stamp ranks after `a`: refused while `a` waits for its
    // need, also when `a` is late.
    t += 5;
    assert_eq!(ask(b, "b2", 50, t), [0, 45, 1, 0, 0, 0]);
    t += 210;
    assert_eq!(ask(b, "b3", 300, t), [0, 1, 1, 0, 0, 0]);
    // `a` does not come back within its turn and grace (50 + 2 + 200 ms): it loses its place,
    // and `c`, interactive, ranks before `b`: it takes 50 of the 325 there.
    t += 60;
    assert_eq!(ask(c, "c1", 50, t), [1, 275]);
    // `a`, silent longer than its grace, lost its clock too: back, it starts at the virtual
    // time (250), ranks before `b` and finds the moment `c` kept its place over.
    t += 300;
    assert_eq!(ask(a, "a5", 100, t), [1, 475]);
    let clocks: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg("t:{q}:line:clocks")
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut connection)
        .unwrap();
    let line: Vec<String> = redis::cmd("ZRANGE")
        .arg("t:{q}:line")
        .arg(0)
        .arg(-1)
        .query(&mut connection)
        .unwrap();
    // `a` keeps its place after its admission; `b`, whose turn passed, goes once first.
    assert_eq!(line, ["a", "b"]);
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
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// `day_add` and `day_used` of `controls.lua` against the plain model, over uses,
    /// refunds and time passing by minutes to days, for every kind of window (a month's
    /// end among them).
    #[test]
    fn cap_counts_match_a_list_of_every_use(
        window in prop_oneof![Just(Window::Day), Just(Window::Month), Just(Window::Rolling)],
        ops in proptest::collection::vec((-300i64..500, 0i64..6 * 3_600_000), 1..60)
    ) {
        thread_local! {
            static SERVER: RedisServer = RedisServer::start();
        }
        let url = SERVER.with(RedisServer::url);
        let mut connection = redis::Client::open(url).unwrap().get_connection().unwrap();
        let _: () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
        let count = script(
            "local now = tonumber(ARGV[1])
             day_add(KEYS[1], ARGV[2], tonumber(ARGV[3]), now)
             return day_used(KEYS[1], ARGV[2], now)",
        );
        let field = window.field();
        let mut model = DayModel::default();
        // 2026-01-25T20:00:00Z: days, and a month, end within the ops.
        let mut now = 1_769_371_200_000;
        for (step, (delta, wait)) in ops.into_iter().enumerate() {
            now += wait;
            let used: i64 = count
                .key("t:{q}:t:acme:days")
                .arg(now)
                .arg(field)
                .arg(delta)
                .invoke(&mut connection)
                .unwrap();
            model.add(window, delta, now);
            prop_assert_eq!(used, model.used(window, now), "step {}", step);
        }
    }
}

/// The scripts' calendar month (months since the epoch, on the server's clock) turns at the
/// very millisecond the crate's does, for every month from 1970 to 2400: leap years, century
/// years and the 400-year rule included.
#[test]
fn the_scripts_month_turns_where_the_crates_does() {
    let server = RedisServer::start();
    let mut connection = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let period = script("return period('m', tonumber(ARGV[1]))");
    let mut month = |ms: u64| -> i64 { period.arg(ms).invoke(&mut connection).unwrap() };
    assert_eq!(month(0), 0);
    let (mut at, mut expected) = (0, 0);
    // 2400-01-01T00:00:00Z.
    while at < 13_569_465_600 {
        let next = CapWindow::CalendarMonthUtc.resets_after(at);
        assert_eq!(month(next * 1_000 - 1), expected, "before {next}");
        expected += 1;
        assert_eq!(month(next * 1_000), expected, "at {next}");
        at = next;
    }
    assert_eq!(expected, 430 * 12);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// `slots_held` of `controls.lua` against a plain list of the calls in flight and each
    /// process's lease: every slot free exactly when fewer than the cap are held under leases
    /// that still last (a lease that ended and was renewed is a new one: the slots taken
    /// under the old one stay given back), whatever the slots it dropped before.
    #[test]
    fn slots_are_full_exactly_when_live_processes_hold_the_cap(
        ops in proptest::collection::vec(slot_op(), 1..80)
    ) {
        const LEASE: i64 = 1_000;
        thread_local! {
            static SERVER: RedisServer = RedisServer::start();
        }
        let url = SERVER.with(RedisServer::url);
        let mut connection = redis::Client::open(url).unwrap().get_connection().unwrap();
        let _: () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
        let full = script(
            "local max = tonumber(ARGV[2])
             return slots_held(KEYS[1], KEYS[2], tonumber(ARGV[1]), max) >= max and 1 or 0",
        );
        // As the reserve script takes a slot (`id` given) and the heartbeat renews a lease.
        let take = script(
            "local start = renew(KEYS[2], ARGV[2], tonumber(ARGV[1]), tonumber(ARGV[3]))
             if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], ARGV[4], start) end
             return start",
        );
        let (slots, alive) = ("t:{q}:t:acme:slots", "t:{q}:alive");
        // The calls in flight (id, process, the start of the lease taken under), and each
        // process's lease (end, start).
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
                    let start: i64 = take.key(slots).key(alive)
                        .arg(now).arg(format!("p{process}")).arg(LEASE).arg(&id)
                        .invoke(&mut connection)
                        .unwrap();
                    prop_assert_eq!(start, renew(&mut leases, process, now), "step {}", step);
                    calls.push((id, process, start));
                }
                SlotOp::End(i) => {
                    if calls.is_empty() {
                        continue;
                    }
                    let (id, _, _) = calls.remove(i % calls.len());
                    let _: () = redis::cmd("HDEL").arg(slots).arg(&id).query(&mut connection).unwrap();
                }
                SlotOp::Renew(process) => {
                    let start: i64 = take.key(slots).key(alive)
                        .arg(now).arg(format!("p{process}")).arg(LEASE).arg("")
                        .invoke(&mut connection)
                        .unwrap();
                    prop_assert_eq!(start, renew(&mut leases, process, now), "step {}", step);
                }
                SlotOp::Advance(ms) => now += ms,
                SlotOp::Full(max) => {
                    let answer: i64 = full.key(slots).key(alive).arg(now).arg(max)
                        .invoke(&mut connection)
                        .unwrap();
                    let live = calls
                        .iter()
                        .filter(|(_, p, taken)| {
                            leases[usize::from(*p)]
                                .is_some_and(|(end, start)| end > now && start == *taken)
                        })
                        .count() as i64;
                    prop_assert_eq!(answer, i64::from(live >= max), "step {}: {} live", step, live);
                }
            }
        }
    }
}
