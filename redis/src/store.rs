//! The Redis store: the three scripts, their arguments and their replies.

use std::sync::Arc;
use std::time::Duration;

use ::redis::Script;

use super::connection::Connection;
use super::keys::Keys;
use tower_llm_quota::budget::StoreUnavailable;
use tower_llm_quota::budget::store::fleet::Account;
use tower_llm_quota::budget::store::{
    Control, Decision, Demand, Floor, Grant, PathLimits, QuotaStore, Renewal, Settle, StoreFuture,
    StorePath,
};
use tower_llm_quota::tenant::{CapWindow, PeriodCap, Tenant};
use tower_llm_quota::{Cost, Limit, Priority};

/// How long a settled reservation's tombstone lives, at least and at most: settlements are
/// retried within a few seconds, so a duplicate arrives well within it.
const TOMBSTONE: (Duration, Duration) = (Duration::from_secs(5), Duration::from_secs(30));

/// The longest pause written.
const MAX_PAUSE: Duration = Duration::from_secs(86_400);

/// The longest wait a denial by a hold tells: another process may lift the hold (see
/// [`Budget::lift_pause`](tower_llm_quota::Budget::lift_pause)), so the head of each process's ordering
/// asks again at least this often while a hold lasts (one script call).
const HOLD_RECHECK: Duration = Duration::from_secs(1);

/// The scripts, each with the shared bucket functions in front.
#[derive(Debug)]
struct Scripts {
    reserve: Script,
    settle: Script,
    lower: Script,
    lease: Script,
    heartbeat: Script,
    days: Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            reserve: Script::new(concat!(
                include_str!("bucket.lua"),
                include_str!("controls.lua"),
                include_str!("reserve.lua")
            )),
            settle: Script::new(concat!(
                include_str!("bucket.lua"),
                include_str!("controls.lua"),
                include_str!("settle.lua")
            )),
            lower: Script::new(concat!(
                include_str!("bucket.lua"),
                include_str!("lower.lua")
            )),
            lease: Script::new(concat!(
                include_str!("bucket.lua"),
                include_str!("lease.lua")
            )),
            heartbeat: Script::new(concat!(
                include_str!("bucket.lua"),
                include_str!("controls.lua"),
                include_str!("heartbeat.lua")
            )),
            days: Script::new(concat!(
                include_str!("bucket.lua"),
                include_str!("controls.lua"),
                include_str!("days.lua")
            )),
        }
    }
}

/// A [`QuotaStore`] in Redis. Scripts run with `EVALSHA`, reloaded after `NOSCRIPT` (a
/// restart, a failover, a `SCRIPT FLUSH`).
#[derive(Debug)]
pub(super) struct RedisStore {
    connection: Connection,
    keys: Keys,
    lease_ms: u64,
    /// How long a process's slots outlive its last heartbeat (ms).
    slot_lease_ms: u64,
    /// How long past the wait it was told a process keeps its turn (ms).
    grace_ms: u64,
    tombstone_ms: u64,
    scripts: Arc<Scripts>,
    /// This process's part of the account in millionths, as its last lease call told it:
    /// what its turns in the line weigh (see reserve.lua).
    part_ppm: Arc<std::sync::atomic::AtomicU64>,
}

impl RedisStore {
    /// A store whose records last `lease`; a process refused in its turn has `timeout` twice
    /// over (and 100 ms) beyond the wait it was told to come back before it loses its turn.
    pub(super) fn new(
        connection: Connection,
        keys: Keys,
        (lease, slot_lease): (Duration, Duration),
        timeout: Duration,
    ) -> Self {
        let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1);
        let grace = timeout.saturating_mul(2) + Duration::from_millis(100);
        Self {
            connection,
            keys,
            lease_ms,
            slot_lease_ms: u64::try_from(slot_lease.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
            grace_ms: u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
            tombstone_ms: lease_ms.clamp(
                TOMBSTONE.0.as_millis() as u64,
                TOMBSTONE.1.as_millis() as u64,
            ),
            scripts: Arc::new(Scripts::new()),
            part_ppm: Arc::new(std::sync::atomic::AtomicU64::new(1_000_000)),
        }
    }

    /// Loads every script: a health check that exercises the scripting engine and reaches the
    /// node of the quota's keys, not a PING.
    pub(super) async fn load(&self) -> Result<(), ::redis::RedisError> {
        let mut connection = self.connection.clone();
        for script in [
            &self.scripts.reserve,
            &self.scripts.settle,
            &self.scripts.lower,
            &self.scripts.lease,
            &self.scripts.heartbeat,
        ] {
            script.prepare_invoke().load_async(&mut connection).await?;
        }
        // A cluster loads the scripts on every primary that answers: ask the one holding this
        // quota's slot too.
        let _: bool = ::redis::cmd("EXISTS")
            .arg(self.keys.record("0"))
            .query_async(&mut connection)
            .await?;
        Ok(())
    }
}

/// One script call: its keys and arguments, made before the call so the future owns them.
struct Call {
    keys: Vec<String>,
    args: Vec<String>,
}

impl Call {
    fn new() -> Self {
        Self {
            keys: Vec::with_capacity(5),
            args: Vec::with_capacity(16),
        }
    }

    fn arg(&mut self, value: impl ToString) -> &mut Self {
        self.args.push(value.to_string());
        self
    }

    async fn run<T: ::redis::FromRedisValue>(
        self,
        script: &Script,
        connection: &mut Connection,
    ) -> Result<T, StoreUnavailable> {
        let mut invocation = script.prepare_invoke();
        for key in &self.keys {
            invocation.key(key);
        }
        for arg in &self.args {
            invocation.arg(arg);
        }
        invocation
            .invoke_async(connection)
            .await
            .map_err(StoreUnavailable::new)
    }
}

impl RedisStore {
    /// The reserve script's call for `id`, and the limits it touches (indices into the
    /// account's limits, then the path's nodes'): the buckets of every limit `cost` touches,
    /// their holds, the record, the line of processes, the paused nodes, the processes'
    /// leases, their clocks, the controls' keys; the clock override (empty), the lease, the asking process,
    /// its class, how many buckets are the account's, the grace, how many buckets and path
    /// nodes, then each bucket's rate, cost and floor, the path's nodes and its controls.
    fn reserve_call(
        &self,
        id: &str,
        (cost, floor, class): (Cost, Floor, Priority),
        limits: &[Limit],
        (path, tenant): (&StorePath, Option<&Tenant>),
    ) -> (Call, Vec<usize>) {
        // The account's limits, then the path's nodes': one list of buckets, numbered on.
        let nodes = &path.limits;
        let all = limits.len() + nodes.len();
        let limit_of = |i: usize| match i.checked_sub(limits.len()) {
            None => (None, &limits[i]),
            Some(j) => (Some(&nodes[j].0), &nodes[j].1),
        };
        let touched: Vec<usize> = (0..all)
            .filter(|&i| cost.amount(limit_of(i).1.dimension()) > 0)
            .collect();
        let mut call = Call::new();
        // The clock override is for tests of the script alone; the server's clock is used.
        // The account's buckets come first among those touched: they decide the turns.
        let accounts = touched.iter().filter(|&&i| i < limits.len()).count();
        let process = id.split('-').next().unwrap_or_default();
        call.arg("")
            .arg(self.lease_ms)
            .arg(process)
            .arg(class.index())
            .arg(accounts)
            .arg(self.grace_ms)
            .arg(touched.len())
            .arg(tenant.map_or(0, Tenant::depth))
            .arg(self.part_ppm.load(std::sync::atomic::Ordering::Relaxed));
        for &i in &touched {
            let (node, limit) = limit_of(i);
            let rate = Account::of(limit);
            call.keys.push(match node {
                None => self.keys.bucket(limit),
                Some(node) => self.keys.node_bucket(node, limit),
            });
            // A class floor keeps a share of the account, not of a tenant's own limits.
            let keep = if node.is_none() {
                floor.of(rate.capacity)
            } else {
                0
            };
            call.arg(rate.num)
                .arg(rate.den)
                .arg(rate.capacity)
                .arg(cost.amount(limit.dimension()))
                .arg(keep);
        }
        // A node's bucket is never held (a provider pause holds the account): its hold key
        // stays absent.
        let holds: Vec<String> = touched
            .iter()
            .map(|&i| match limit_of(i) {
                (None, limit) => self.keys.hold(limit),
                (Some(node), limit) => format!("{}:held", self.keys.node_bucket(node, limit)),
            })
            .collect();
        call.keys.extend(holds);
        call.keys.push(self.keys.record(id));
        call.keys.push(self.keys.line());
        call.keys.push(self.keys.line_details());
        // Every node of the request's path, from the top: any of them may be paused.
        call.keys.push(self.keys.paused());
        call.keys.push(self.keys.alive());
        call.keys.push(self.keys.clocks());
        if let Some(tenant) = tenant {
            for depth in 1..=tenant.depth() {
                call.arg(tenant.prefix(depth));
            }
        }
        self.push_controls(&mut call, id, cost, &path.controls);
        (call, touched)
    }

    /// The controls of the path in the reserve call: each one's key, then its kind, key index,
    /// field, cap and the amount it counts.
    fn push_controls(&self, call: &mut Call, id: &str, cost: Cost, controls: &[(Tenant, Control)]) {
        for (node, control) in controls {
            let (key, kind, field) = self.control(node, control, id);
            let (cap, amount) = match control {
                Control::InFlight(max) => (max.get() as u64, self.slot_lease_ms),
                Control::Daily(daily) => (daily.amount().get(), cost.amount(daily.dimension())),
            };
            call.keys.push(key);
            let index = call.keys.len();
            call.arg(kind).arg(index).arg(field).arg(cap).arg(amount);
        }
    }

    /// The key, kind and field of `node`'s `control` for the reservation `id` (see
    /// `controls.lua`): its slots and the id, or its days and the cap's field.
    fn control(
        &self,
        node: &Tenant,
        control: &Control,
        id: &str,
    ) -> (String, &'static str, String) {
        match control {
            Control::InFlight(_) => (self.keys.node_slots(node), "s", id.to_owned()),
            Control::Daily(daily) => {
                let kind = match daily.window() {
                    CapWindow::CalendarDayUtc => "c",
                    CapWindow::CalendarMonthUtc => "m",
                    CapWindow::Rolling => "r",
                };
                let field = format!("{kind}:{}", daily.dimension().as_str());
                (self.keys.node_days(node), kind, field)
            }
        }
    }

    /// The buckets a batch of settlements touches, each once (key and rate), and per
    /// settlement the buckets it touches (numbered from 1), what it reserved and used.
    #[allow(
        clippy::type_complexity,
        reason = "the script's arguments, in their order"
    )]
    fn settled_buckets(
        &self,
        batch: &[Settle],
    ) -> (Vec<(String, Account)>, Vec<Vec<(usize, u64, u64)>>) {
        let mut buckets: Vec<(String, Account)> = Vec::new();
        let mut index = |node: Option<&Tenant>, limit: &Limit| {
            let key = match node {
                None => self.keys.bucket(limit),
                Some(node) => self.keys.node_bucket(node, limit),
            };
            match buckets.iter().position(|(k, _)| *k == key) {
                Some(i) => i + 1,
                None => {
                    buckets.push((key, Account::of(limit)));
                    buckets.len()
                }
            }
        };
        let mut settlements = Vec::with_capacity(batch.len());
        for settle in batch {
            let nodes = (settle.path.limits.iter()).map(|(node, limit)| (Some(node), limit));
            let touched: Vec<(usize, u64, u64)> = settle
                .limits
                .iter()
                .map(|limit| (None, limit))
                .chain(nodes)
                .filter_map(|(node, limit)| {
                    let dimension = limit.dimension();
                    let (reserved, actual) = (
                        settle.reserved.amount(dimension),
                        settle.actual.amount(dimension),
                    );
                    (reserved > 0 || actual > 0).then(|| (index(node, limit), reserved, actual))
                })
                .collect();
            settlements.push(touched);
        }
        (buckets, settlements)
    }

    /// What settling `settle` does to its path's controls: per control, its key, kind, field
    /// and the actual use less the reserved (nothing for a slot: it is given back).
    fn settled_controls(&self, settle: &Settle) -> Vec<(String, &'static str, String, i128)> {
        (settle.path.controls.iter())
            .map(|(node, control)| {
                let (key, kind, field) = self.control(node, control, &settle.id);
                let delta = match control {
                    Control::InFlight(_) => 0,
                    Control::Daily(daily) => {
                        let dimension = daily.dimension();
                        i128::from(settle.actual.amount(dimension))
                            - i128::from(settle.reserved.amount(dimension))
                    }
                };
                (key, kind, field, delta)
            })
            .collect()
    }
}

impl QuotaStore for RedisStore {
    fn reserve(
        &self,
        id: String,
        cost: Cost,
        floor: Floor,
        class: Priority,
        limits: Arc<[Limit]>,
        path: PathLimits,
        tenant: Option<Tenant>,
    ) -> StoreFuture<Decision> {
        let (call, touched) =
            self.reserve_call(&id, (cost, floor, class), &limits, (&path, tenant.as_ref()));
        let controls = path.controls.len();
        let (scripts, mut connection) = (self.scripts.clone(), self.connection.clone());
        Box::pin(async move {
            // Nothing to take and nobody who may be paused: nothing to ask.
            if touched.is_empty() && tenant.is_none() {
                return Ok(Decision::Admitted);
            }
            let reply: Vec<i64> = call.run(&scripts.reserve, &mut connection).await?;
            decision(&reply, &touched, controls)
        })
    }

    fn settle(&self, batch: Vec<Settle>) -> StoreFuture<()> {
        // Every bucket once, then every record, then the controls' keys.
        let (buckets, settlements) = self.settled_buckets(&batch);
        let controls: Vec<_> = batch.iter().map(|s| self.settled_controls(s)).collect();
        let mut call = Call::new();
        call.arg("").arg(self.tombstone_ms).arg(buckets.len());
        for (_, rate) in &buckets {
            call.arg(rate.num).arg(rate.den).arg(rate.capacity);
        }
        let records = buckets.len();
        let mut control_keys = Vec::new();
        for (i, (touched, controls)) in settlements.iter().zip(&controls).enumerate() {
            call.arg(records + i + 1)
                .arg(touched.len())
                .arg(controls.len());
            for (bucket, reserved, actual) in touched {
                call.arg(bucket).arg(reserved).arg(actual);
            }
            for (key, kind, field, delta) in controls {
                control_keys.push(key.clone());
                call.arg(kind)
                    .arg(records + batch.len() + control_keys.len())
                    .arg(field)
                    .arg(delta);
            }
        }
        call.keys.extend(buckets.into_iter().map(|(key, _)| key));
        call.keys
            .extend(batch.iter().map(|settle| self.keys.record(&settle.id)));
        call.keys.extend(control_keys);
        let (scripts, mut connection) = (self.scripts.clone(), self.connection.clone());
        Box::pin(async move {
            let _: Vec<i64> = call.run(&scripts.settle, &mut connection).await?;
            Ok(())
        })
    }

    fn heartbeat(&self, process: u64) -> StoreFuture<Option<u32>> {
        let mut call = Call::new();
        call.keys.push(self.keys.alive());
        call.arg("")
            .arg(format!("{process:016x}"))
            .arg(self.slot_lease_ms);
        let (scripts, mut connection) = (self.scripts.clone(), self.connection.clone());
        Box::pin(async move {
            let live: i64 = call.run(&scripts.heartbeat, &mut connection).await?;
            Ok(Some(u32::try_from(live).unwrap_or(u32::MAX)))
        })
    }

    fn lower(&self, limit: Limit, remaining: Option<u64>, pause: Duration) -> StoreFuture<()> {
        let rate = Account::of(&limit);
        let mut call = Call::new();
        call.keys.push(self.keys.bucket(&limit));
        call.keys.push(self.keys.hold(&limit));
        call.keys.push(self.keys.plan(&limit));
        call.arg("").arg(rate.num).arg(rate.den).arg(rate.capacity);
        match remaining {
            Some(remaining) => call.arg(remaining.min(rate.capacity)),
            None => call.arg(""),
        };
        // A day at most: a provider's longest wait.
        call.arg(pause.min(MAX_PAUSE).as_millis());
        if let (increase, Some((decrease, min))) = adaptive_args(&limit) {
            call.arg(decrease)
                .arg(min)
                .arg(increase)
                .arg(limit.period().as_millis().max(1));
        }
        let (scripts, mut connection) = (self.scripts.clone(), self.connection.clone());
        Box::pin(async move {
            let _: i64 = call.run(&scripts.lower, &mut connection).await?;
            Ok(())
        })
    }

    fn lease(
        &self,
        process: u64,
        lease: Duration,
        limits: Arc<[Limit]>,
        demand: Demand,
    ) -> StoreFuture<Grant> {
        let mut call = Call::new();
        call.keys.push(self.keys.shares());
        call.keys
            .extend(limits.iter().map(|limit| self.keys.hold(limit)));
        call.keys
            .extend(limits.iter().map(|limit| self.keys.plan(limit)));
        call.keys
            .extend(limits.iter().map(|limit| self.keys.bucket(limit)));
        let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1);
        call.arg("")
            .arg(format!("{process:016x}"))
            .arg(lease_ms)
            .arg(format!("{:.6}", demand.want))
            // The account is divided anew every half refresh (a lease is three).
            .arg((lease_ms / 6).max(1))
            .arg(demand.seq);
        for (i, limit) in limits.iter().enumerate() {
            let (increase, _) = adaptive_args(limit);
            let rate = Account::of(limit);
            let report = demand.reports.get(i).copied().unwrap_or_default();
            // A debt of one capacity at most, as the store charges anywhere.
            let cap = i64::try_from(rate.capacity).unwrap_or(i64::MAX);
            call.arg(increase)
                .arg(limit.period().as_millis().max(1))
                .arg(rate.num)
                .arg(rate.den)
                .arg(rate.capacity)
                .arg(report.keep.clamp(-cap, cap))
                .arg(report.back.min(rate.capacity))
                .arg(report.need.min(rate.capacity))
                .arg(report.ask.min(rate.capacity));
        }
        for (key, weight) in &demand.flows {
            call.arg(format!("{key:x}")).arg(weight);
        }
        for (key, share_ppm) in &demand.guarantees {
            call.arg(format!("g{key:x}")).arg(share_ppm);
        }
        let (scripts, mut connection) = (self.scripts.clone(), self.connection.clone());
        let (count, flows) = (limits.len(), demand.flows.len() + demand.guarantees.len());
        let part = self.part_ppm.clone();
        Box::pin(async move {
            let reply: Vec<i64> = call.run(&scripts.lease, &mut connection).await?;
            let grant = grant(&reply, count, flows)?;
            if grant.renewal != Renewal::Stale && grant.renewal != Renewal::Left {
                let ppm = (grant.part * 1e6).round() as u64;
                part.store(ppm, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(grant)
        })
    }

    fn days(&self, caps: Vec<(Tenant, PeriodCap)>) -> StoreFuture<Option<Vec<u64>>> {
        let mut call = Call::new();
        call.arg("");
        for (node, cap) in &caps {
            let (key, _, field) = self.control(node, &Control::Daily(*cap), "");
            call.keys.push(key);
            call.arg(field);
        }
        let (scripts, mut connection) = (self.scripts.clone(), self.connection.clone());
        Box::pin(async move {
            if caps.is_empty() {
                return Ok(Some(Vec::new()));
            }
            let used: Vec<i64> = call.run(&scripts.days, &mut connection).await?;
            Ok(Some(
                used.into_iter()
                    .map(|u| u64::try_from(u).unwrap_or(0))
                    .collect(),
            ))
        })
    }

    fn set_paused(&self, scope: Tenant, paused: bool) -> StoreFuture<()> {
        let mut command = ::redis::cmd(if paused { "SADD" } else { "SREM" });
        command.arg(self.keys.paused()).arg(scope.as_str());
        let mut connection = self.connection.clone();
        Box::pin(async move {
            let _: i64 = command
                .query_async(&mut connection)
                .await
                .map_err(StoreUnavailable::new)?;
            Ok(())
        })
    }

    fn paused(&self) -> StoreFuture<Option<Vec<Tenant>>> {
        let mut members = ::redis::cmd("SMEMBERS");
        members.arg(self.keys.paused());
        let mut connection = self.connection.clone();
        Box::pin(async move {
            let paths: Vec<String> = members
                .query_async(&mut connection)
                .await
                .map_err(StoreUnavailable::new)?;
            Ok(Some(
                paths.iter().filter_map(|p| Tenant::parse(p).ok()).collect(),
            ))
        })
    }

    fn lift(&self, limits: Vec<Limit>) -> StoreFuture<()> {
        let mut delete = ::redis::cmd("DEL");
        for limit in &limits {
            delete.arg(self.keys.hold(limit));
        }
        let mut connection = self.connection.clone();
        Box::pin(async move {
            if limits.is_empty() {
                return Ok(());
            }
            let _: i64 = delete
                .query_async(&mut connection)
                .await
                .map_err(StoreUnavailable::new)?;
            Ok(())
        })
    }
}

/// The fleet plan's arguments of `limit`: its increase per period (0 for a fixed share: it
/// never climbs), and for an adaptive share its decrease and its least share.
fn adaptive_args(limit: &Limit) -> (f64, Option<(f64, f64)>) {
    match limit.adaptive_share() {
        Some(share) => (
            share.increase_per_period(),
            Some((share.decrease_factor(), share.min_share())),
        ),
        None => (0.0, None),
    }
}

/// Reads the lease script's reply: `{status, lease ms, part in millionths, hold ms per
/// limit..., plan in millionths per limit..., granted units per limit..., ready ms, spread per
/// flow...}`;
/// `{0, 0, 0}` for a leave, `{-1}` for a stale renewal.
fn grant(reply: &[i64], limits: usize, flows: usize) -> Result<Grant, StoreUnavailable> {
    let unexpected = || StoreUnavailable::new(format_args!("unexpected reply {reply:?}"));
    let ms = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    let millionths = |n: i64| (n as f64 / 1e6).clamp(0.0, 1.0);
    let empty = |renewal| Grant {
        renewal,
        part: 0.0,
        lease: Duration::ZERO,
        holds: Vec::new(),
        plans: Vec::new(),
        granted: Vec::new(),
        ready: Duration::ZERO,
        spread: Vec::new(),
    };
    let (status, lease, part, rest) = match reply {
        [-1] => return Ok(empty(Renewal::Stale)),
        [0, 0, 0] => return Ok(empty(Renewal::Left)),
        [status @ (1 | 2), lease, part, rest @ ..] if rest.len() == 3 * limits + 1 + flows => {
            (*status, *lease, *part, rest)
        }
        _ => return Err(unexpected()),
    };
    let (hold, rest) = rest.split_at(limits);
    let (plans, rest) = rest.split_at(limits);
    let (granted, rest) = rest.split_at(limits);
    let (ready, spread) = rest.split_at(1);
    Ok(Grant {
        renewal: match status {
            1 => Renewal::Renewed,
            _ => Renewal::New,
        },
        part: millionths(part),
        lease: ms(lease),
        holds: hold.iter().map(|&h| ms(h)).collect(),
        plans: plans.iter().map(|&p| millionths(p)).collect(),
        granted: granted
            .iter()
            .map(|&g| u64::try_from(g).unwrap_or(0))
            .collect(),
        ready: ms(ready[0]),
        spread: spread
            .iter()
            .map(|&n| u32::try_from(n).unwrap_or(0))
            .collect(),
    })
}

/// Reads the reserve script's reply: `{1, levels...}`, `{0, wait_ms, bucket, held,
/// floor_only, first}` or `{-1, bucket}`, buckets numbered from 1 among the `touched` limits;
/// `{-3, depth}`, `{-4, control, used}` or `{-5, control}`, controls numbered from 1 among the
/// path's `controls`. A wait for a hold is told as [`HOLD_RECHECK`] at most.
fn decision(
    reply: &[i64],
    touched: &[usize],
    controls: usize,
) -> Result<Decision, StoreUnavailable> {
    let control = |c: i64| {
        usize::try_from(c - 1)
            .ok()
            .filter(|&c| c < controls)
            .ok_or_else(|| StoreUnavailable::new(format_args!("unexpected reply {reply:?}")))
    };
    let limit = |bucket: i64| {
        usize::try_from(bucket - 1)
            .ok()
            .and_then(|b| touched.get(b).copied())
            .ok_or_else(|| StoreUnavailable::new(format_args!("unexpected reply {reply:?}")))
    };
    match *reply {
        [1, ..] => Ok(Decision::Admitted),
        [
            0,
            wait,
            bucket,
            held @ (0 | 1),
            floor @ (0 | 1),
            first @ (0 | 1),
        ] => {
            let mut wait = Duration::from_millis(u64::try_from(wait).unwrap_or(0));
            if held == 1 {
                wait = wait.min(HOLD_RECHECK);
            }
            Ok(Decision::Denied {
                wait,
                limit: limit(bucket)?,
                floor_only: floor == 1,
                first: first == 1,
            })
        }
        [-1, bucket] => Ok(Decision::TooLarge {
            limit: limit(bucket)?,
        }),
        [-3, depth] => Ok(Decision::Paused {
            depth: usize::try_from(depth).unwrap_or(1),
        }),
        [-4, c, used] => Ok(Decision::DayCapped {
            control: control(c)?,
            used: u64::try_from(used).unwrap_or(0),
        }),
        [-5, c] => Ok(Decision::NoSlot {
            control: control(c)?,
        }),
        [-2] => Err(StoreUnavailable::new(
            "the reservation id was already settled: ids must not be reused",
        )),
        _ => Err(StoreUnavailable::new(format_args!(
            "unexpected reply {reply:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_map_back_to_the_limits_asked_about() {
        let touched = [0, 2];
        assert_eq!(
            decision(&[1, 5, 7], &touched, 2).unwrap(),
            Decision::Admitted
        );
        assert_eq!(
            decision(&[0, 250, 2, 0, 0, 0], &touched, 2).unwrap(),
            Decision::Denied {
                wait: Duration::from_millis(250),
                limit: 2,
                floor_only: false,
                first: false,
            }
        );
        assert_eq!(
            decision(&[0, 250, 1, 0, 1, 0], &touched, 2).unwrap(),
            Decision::Denied {
                wait: Duration::from_millis(250),
                limit: 0,
                floor_only: true,
                first: false,
            }
        );
        // Held: the wait is told a second at most, so that a lift elsewhere is seen.
        assert_eq!(
            decision(&[0, 60_000, 1, 1, 0, 0], &touched, 2).unwrap(),
            Decision::Denied {
                wait: HOLD_RECHECK,
                limit: 0,
                floor_only: false,
                first: false,
            }
        );
        assert_eq!(
            decision(&[0, 60_000, 1, 0, 0, 0], &touched, 2).unwrap(),
            Decision::Denied {
                wait: Duration::from_secs(60),
                limit: 0,
                floor_only: false,
                first: false,
            }
        );
        assert!(decision(&[0, 250, 2, 7, 0, 0], &touched, 2).is_err());
        assert!(decision(&[0, 250, 2, 0, 7, 0], &touched, 2).is_err());
        assert_eq!(
            decision(&[-1, 1], &touched, 2).unwrap(),
            Decision::TooLarge { limit: 0 }
        );
        assert!(decision(&[0, 250, 3, 0, 0, 0], &touched, 2).is_err());
        assert!(decision(&[0, 250, 2, 0], &touched, 2).is_err());
        assert!(decision(&[], &touched, 2).is_err());
    }

    #[test]
    fn control_replies_map_back_to_the_path_s_controls() {
        let touched = [0, 2];
        // Controls are numbered from 1 among the path's.
        assert_eq!(
            decision(&[-4, 2, 900], &touched, 2).unwrap(),
            Decision::DayCapped {
                control: 1,
                used: 900
            }
        );
        assert_eq!(
            decision(&[-5, 1], &touched, 2).unwrap(),
            Decision::NoSlot { control: 0 }
        );
        assert!(decision(&[-5, 3], &touched, 2).is_err());
        assert!(decision(&[-4, 0, 5], &touched, 2).is_err());
    }
}
