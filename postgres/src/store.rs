//! The Postgres store: each operation one statement calling one of the schema's functions
//! (`migrations/0001_quota.sql`), its arguments and its answer.

use std::sync::Arc;
use std::time::Duration;

use tower_llm_quota::budget::StoreUnavailable;
use tower_llm_quota::budget::store::fleet::Account;
use tower_llm_quota::budget::store::{
    Control, Decision, Demand, Floor, Grant, PathLimits, QuotaStore, Renewal, Settle, StoreFuture,
    StorePath,
};
use tower_llm_quota::tenant::{CapWindow, PeriodCap, Tenant};
use tower_llm_quota::{Cost, Limit, Priority};

use crate::connection::{Database, Params};
use crate::keys::Keys;

/// How long a settled reservation's tombstone lives, at least and at most: settlements are
/// retried within a few seconds, so a duplicate arrives well within it.
const TOMBSTONE: (Duration, Duration) = (Duration::from_secs(5), Duration::from_secs(30));

/// The longest pause written: a day, a provider's longest wait.
const MAX_PAUSE: Duration = Duration::from_secs(86_400);

/// The longest wait a denial by a hold tells: another process may lift the hold, so the head
/// of each process's ordering asks again at least this often while a hold lasts.
const HOLD_RECHECK: Duration = Duration::from_secs(1);

const RESERVE: &str = "SELECT decision, wait_ms, bucket_index, by_hold, floor_only, \
    first_in_line, control_index, used_so_far FROM llm_quota.reserve(NULL, $1, $2, $3, $4, $5, \
    $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22)";
const SETTLE: &str = "SELECT llm_quota.settle(NULL, $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
    $11, $12, $13, $14, $15, $16)";
const LOWER: &str = "SELECT llm_quota.lower(NULL, $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";
const LIFT: &str = "SELECT llm_quota.lift($1, $2)";
const SET_PAUSED: &str = "SELECT llm_quota.set_paused($1, $2, $3, $4)";
const PAUSED: &str = "SELECT node FROM llm_quota.paused WHERE root = $1";
const DAYS: &str = "SELECT llm_quota.days_used(NULL, $1, $2)";
const HEARTBEAT: &str = "SELECT llm_quota.heartbeat(NULL, $1, $2, $3, $4)";
const LEASE: &str = "SELECT renewal, lasts_ms, part_ppm, hold_ms, plan_ppm, granted_units, \
    ready_ms, spread FROM llm_quota.lease(NULL, $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, \
    $12, $13, $14, $15, $16, $17, $18, $19)";

/// A [`QuotaStore`] in Postgres.
#[derive(Debug)]
pub(crate) struct PostgresStore {
    database: Database,
    keys: Keys,
    lease_ms: i64,
    /// How long a process's slots outlive its last heartbeat (ms).
    slot_lease_ms: i64,
    /// How long past the wait it was told a process keeps its turn (ms).
    grace_ms: i64,
    tombstone_ms: i64,
    /// This process's part of the account in millionths, as its last lease call told it:
    /// what its turns in the line weigh (see `reserve` in migrations 5 and 6).
    part_ppm: Arc<std::sync::atomic::AtomicI64>,
}

fn ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// A count or amount as Postgres's `bigint`.
fn big(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl PostgresStore {
    /// A store whose records last `lease`; a process refused in its turn has `timeout` twice
    /// over (and 100 ms) beyond the wait it was told to come back before it loses its turn.
    pub(crate) fn new(
        database: Database,
        keys: Keys,
        (lease, slot_lease): (Duration, Duration),
        timeout: Duration,
    ) -> Self {
        let lease_ms = ms(lease).max(1);
        Self {
            database,
            keys,
            lease_ms,
            slot_lease_ms: ms(slot_lease).max(1),
            grace_ms: ms(timeout.saturating_mul(2) + Duration::from_millis(100)),
            tombstone_ms: lease_ms.clamp(ms(TOMBSTONE.0), ms(TOMBSTONE.1)),
            part_ppm: Arc::new(std::sync::atomic::AtomicI64::new(1_000_000)),
        }
    }

    /// The reserve statement's parameters for `id`, and the limits it touches (indices into
    /// the account's limits, then the path's nodes'): the buckets of every limit `cost`
    /// touches, the account's first, each with its rate, cost and floor; the record; the path's
    /// nodes from the top; its controls.
    fn reserve_params(
        &self,
        id: &str,
        (cost, floor, class): (Cost, Floor, Priority),
        limits: &[Limit],
        (path, tenant): (&StorePath, Option<&Tenant>),
    ) -> (Params, Vec<usize>) {
        let nodes = &path.limits;
        let limit_of = |i: usize| match i.checked_sub(limits.len()) {
            None => (None, &limits[i]),
            Some(j) => (Some(&nodes[j].0), &nodes[j].1),
        };
        let touched: Vec<usize> = (0..limits.len() + nodes.len())
            .filter(|&i| cost.amount(limit_of(i).1.dimension()) > 0)
            .collect();
        let accounts = touched.iter().filter(|&&i| i < limits.len()).count();
        let mut buckets = Buckets::default();
        for &i in &touched {
            let (node, limit) = limit_of(i);
            let account = Account::of(limit);
            let key = match node {
                None => self.keys.bucket(limit),
                Some(node) => self.keys.node_bucket(node, limit),
            };
            // A class floor keeps a share of the account, not of a tenant's own limits.
            let keep = node.map_or_else(|| floor.of(account.capacity), |_| 0);
            buckets.push(key, account, cost.amount(limit.dimension()), keep);
        }
        let process = id.split('-').next().unwrap_or_default().to_owned();
        let path_nodes: Vec<String> = tenant.map_or_else(Vec::new, |tenant| {
            (1..=tenant.depth())
                .map(|depth| tenant.prefix(depth).to_owned())
                .collect()
        });
        let controls = self.controls(id, cost, &path.controls);
        let params: Params = vec![
            Box::new(self.keys.tag().to_owned()),
            Box::new(self.lease_ms),
            Box::new(process),
            Box::new(i32::try_from(class.index()).unwrap_or(i32::MAX)),
            Box::new(i32::try_from(accounts).unwrap_or(i32::MAX)),
            Box::new(self.grace_ms),
            Box::new(buckets.keys),
            Box::new(buckets.nums),
            Box::new(buckets.dens),
            Box::new(buckets.caps),
            Box::new(buckets.costs),
            Box::new(buckets.floors),
            Box::new(self.keys.record(id)),
            Box::new(self.keys.root().to_owned()),
            Box::new(self.keys.nodes().to_owned()),
            Box::new(path_nodes),
            Box::new(controls.kinds),
            Box::new(controls.keys),
            Box::new(controls.fields),
            Box::new(controls.caps),
            Box::new(controls.amounts),
            Box::new(self.part_ppm.load(std::sync::atomic::Ordering::Relaxed)),
        ];
        (params, touched)
    }

    /// The path's controls in the reserve statement: each one's kind, key, field, cap and the
    /// amount it counts (the cost in the cap's dimension; for slots, the lease on them).
    fn controls(&self, id: &str, cost: Cost, controls: &[(Tenant, Control)]) -> Controls {
        let mut out = Controls::default();
        for (node, control) in controls {
            let (key, kind, field) = self.control(node, control, id);
            let (cap, amount) = match control {
                Control::InFlight(max) => (max.get() as u64, self.slot_lease_ms),
                Control::Daily(cap) => (cap.amount().get(), big(cost.amount(cap.dimension()))),
            };
            out.kinds.push(kind.to_owned());
            out.keys.push(key);
            out.fields.push(field);
            out.caps.push(big(cap));
            out.amounts.push(amount);
        }
        out
    }

    /// The key, kind and field of `node`'s `control` for the reservation `id`: its slots and
    /// the id, or its caps and the cap's field.
    fn control(
        &self,
        node: &Tenant,
        control: &Control,
        id: &str,
    ) -> (String, &'static str, String) {
        match control {
            Control::InFlight(_) => (self.keys.node_slots(node), "s", id.to_owned()),
            Control::Daily(cap) => {
                let kind = match cap.window() {
                    CapWindow::CalendarDayUtc => "c",
                    CapWindow::CalendarMonthUtc => "m",
                    CapWindow::Rolling => "r",
                };
                let field = format!("{kind}:{}", cap.dimension().as_str());
                (self.keys.node_days(node), kind, field)
            }
        }
    }

    /// The settle statement's parameters: every bucket of the batch once, then per
    /// settlement its record, the buckets it touches and its controls.
    fn settle_params(&self, batch: &[Settle]) -> Params {
        let mut buckets = Buckets::default();
        let (mut records, mut touched_counts, mut control_counts) = (vec![], vec![], vec![]);
        let (mut t_buckets, mut t_reserved, mut t_actual) = (vec![], vec![], vec![]);
        let mut controls = Controls::default();
        for settle in batch {
            records.push(self.keys.record(&settle.id));
            let nodes = (settle.path.limits.iter()).map(|(node, limit)| (Some(node), limit));
            let mut touched = 0;
            for (node, limit) in settle.limits.iter().map(|limit| (None, limit)).chain(nodes) {
                let dimension = limit.dimension();
                let (reserved, actual) = (
                    settle.reserved.amount(dimension),
                    settle.actual.amount(dimension),
                );
                if reserved == 0 && actual == 0 {
                    continue;
                }
                let key = match node {
                    None => self.keys.bucket(limit),
                    Some(node) => self.keys.node_bucket(node, limit),
                };
                let index = buckets.index_of(key, Account::of(limit));
                t_buckets.push(i32::try_from(index).unwrap_or(i32::MAX));
                t_reserved.push(big(reserved));
                t_actual.push(big(actual));
                touched += 1;
            }
            touched_counts.push(touched);
            control_counts.push(i32::try_from(settle.path.controls.len()).unwrap_or(0));
            for (node, control) in &settle.path.controls {
                let (key, kind, field) = self.control(node, control, &settle.id);
                let delta = match control {
                    Control::InFlight(_) => 0,
                    Control::Daily(cap) => {
                        let dimension = cap.dimension();
                        let delta = i128::from(settle.actual.amount(dimension))
                            - i128::from(settle.reserved.amount(dimension));
                        i64::try_from(delta).unwrap_or(if delta > 0 { i64::MAX } else { i64::MIN })
                    }
                };
                controls.kinds.push(kind.to_owned());
                controls.keys.push(key);
                controls.fields.push(field);
                controls.amounts.push(delta);
            }
        }
        vec![
            Box::new(self.keys.tag().to_owned()),
            Box::new(self.tombstone_ms),
            Box::new(buckets.keys),
            Box::new(buckets.nums),
            Box::new(buckets.dens),
            Box::new(buckets.caps),
            Box::new(records),
            Box::new(touched_counts),
            Box::new(control_counts),
            Box::new(t_buckets),
            Box::new(t_reserved),
            Box::new(t_actual),
            Box::new(controls.kinds),
            Box::new(controls.keys),
            Box::new(controls.fields),
            Box::new(controls.amounts),
        ]
    }
}

/// Buckets as the statements take them: parallel arrays.
#[derive(Default)]
struct Buckets {
    keys: Vec<String>,
    nums: Vec<i64>,
    dens: Vec<i64>,
    caps: Vec<i64>,
    costs: Vec<i64>,
    floors: Vec<i64>,
}

impl Buckets {
    fn push(&mut self, key: String, account: Account, cost: u64, floor: u64) {
        self.keys.push(key);
        self.nums.push(big(account.num));
        self.dens.push(big(account.den));
        self.caps.push(big(account.capacity));
        self.costs.push(big(cost));
        self.floors.push(big(floor));
    }

    /// The index (from 1) of the bucket `key`, added if it is new.
    fn index_of(&mut self, key: String, account: Account) -> usize {
        match self.keys.iter().position(|k| *k == key) {
            Some(i) => i + 1,
            None => {
                self.push(key, account, 0, 0);
                self.keys.len()
            }
        }
    }
}

/// Controls as the statements take them: parallel arrays.
#[derive(Default)]
struct Controls {
    kinds: Vec<String>,
    keys: Vec<String>,
    fields: Vec<String>,
    caps: Vec<i64>,
    amounts: Vec<i64>,
}

/// The fleet plan's arguments of `limit`: its increase per period (0 for a fixed share: it
/// never climbs), and for an adaptive share its decrease and its least share.
fn adaptive(limit: &Limit) -> (f64, Option<(f64, f64)>) {
    match limit.adaptive_share() {
        Some(share) => (
            share.increase_per_period(),
            Some((share.decrease_factor(), share.min_share())),
        ),
        None => (0.0, None),
    }
}

fn period_ms(limit: &Limit) -> f64 {
    limit.period().as_millis().max(1) as f64
}

impl QuotaStore for PostgresStore {
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
        let (params, touched) =
            self.reserve_params(&id, (cost, floor, class), &limits, (&path, tenant.as_ref()));
        let controls = path.controls.len();
        let database = self.database.clone();
        Box::pin(async move {
            // Nothing to take and nobody who may be paused: nothing to ask.
            if touched.is_empty() && tenant.is_none() {
                return Ok(Decision::Admitted);
            }
            let rows = database.query(RESERVE, &params).await?;
            let row = rows
                .first()
                .ok_or_else(|| StoreUnavailable::new("the reservation answered no row"))?;
            decision(row, &touched, controls)
        })
    }

    fn settle(&self, batch: Vec<Settle>) -> StoreFuture<()> {
        let params = self.settle_params(&batch);
        let database = self.database.clone();
        Box::pin(async move {
            database.query(SETTLE, &params).await?;
            Ok(())
        })
    }

    fn heartbeat(&self, process: u64) -> StoreFuture<Option<u32>> {
        let params: Params = vec![
            Box::new(self.keys.tag().to_owned()),
            Box::new(self.keys.nodes().to_owned()),
            Box::new(format!("{process:016x}")),
            Box::new(self.slot_lease_ms),
        ];
        let database = self.database.clone();
        Box::pin(async move {
            let rows = database.query(HEARTBEAT, &params).await?;
            let live: Option<i32> = rows.first().and_then(|row| row.get(0));
            Ok(live.map(|live| u32::try_from(live).unwrap_or(0)))
        })
    }

    fn lower(&self, limit: Limit, remaining: Option<u64>, pause: Duration) -> StoreFuture<()> {
        let account = Account::of(&limit);
        let (increase, decrease) = adaptive(&limit);
        let params: Params = vec![
            Box::new(self.keys.tag().to_owned()),
            Box::new(self.keys.bucket(&limit)),
            Box::new(big(account.num)),
            Box::new(big(account.den)),
            Box::new(big(account.capacity)),
            Box::new(remaining.map(|r| big(r.min(account.capacity)))),
            Box::new(ms(pause.min(MAX_PAUSE))),
            Box::new(decrease.map(|(decrease, _)| decrease)),
            Box::new(decrease.map_or(0.0, |(_, min)| min)),
            Box::new(increase),
            Box::new(period_ms(&limit)),
        ];
        let database = self.database.clone();
        Box::pin(async move {
            database.query(LOWER, &params).await?;
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
        let lease_ms = ms(lease).max(1);
        let mut l = LeaseLimits::default();
        for (i, limit) in limits.iter().enumerate() {
            let account = Account::of(limit);
            let report = demand.reports.get(i).copied().unwrap_or_default();
            // A debt of one capacity at most, as the store charges anywhere.
            let cap = big(account.capacity);
            l.keys.push(self.keys.bucket(limit));
            l.incs.push(adaptive(limit).0);
            l.periods.push(period_ms(limit));
            l.nums.push(big(account.num));
            l.dens.push(big(account.den));
            l.caps.push(cap);
            l.keeps.push(report.keep.clamp(-cap, cap));
            l.backs.push(big(report.back.min(account.capacity)));
            l.needs.push(big(report.need.min(account.capacity)));
            l.asks.push(big(report.ask.min(account.capacity)));
        }
        let (mut flow_keys, mut flow_weights) = (Vec::new(), Vec::new());
        for (key, weight) in &demand.flows {
            flow_keys.push(format!("{key:x}"));
            flow_weights.push(f64::from(*weight));
        }
        for (key, share_ppm) in &demand.guarantees {
            flow_keys.push(format!("g{key:x}"));
            flow_weights.push(f64::from(*share_ppm));
        }
        let params: Params = vec![
            Box::new(self.keys.tag().to_owned()),
            Box::new(self.keys.root().to_owned()),
            Box::new(format!("{process:016x}")),
            Box::new(lease_ms),
            // Rounded to millionths, as the Redis store passes it.
            Box::new((demand.want * 1e6).round() / 1e6),
            // The account is divided anew every half refresh (a lease is three).
            Box::new((lease_ms / 6).max(1)),
            Box::new(big(demand.seq)),
            Box::new(l.keys),
            Box::new(l.incs),
            Box::new(l.periods),
            Box::new(l.nums),
            Box::new(l.dens),
            Box::new(l.caps),
            Box::new(l.keeps),
            Box::new(l.backs),
            Box::new(l.needs),
            Box::new(l.asks),
            Box::new(flow_keys),
            Box::new(flow_weights),
        ];
        let (database, part) = (self.database.clone(), self.part_ppm.clone());
        Box::pin(async move {
            let rows = database.query(LEASE, &params).await?;
            let row = rows
                .first()
                .ok_or_else(|| StoreUnavailable::new("the lease answered no row"))?;
            let grant = grant(row)?;
            if grant.renewal != Renewal::Stale && grant.renewal != Renewal::Left {
                let ppm = (grant.part * 1e6).round() as i64;
                part.store(ppm, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(grant)
        })
    }

    fn days(&self, caps: Vec<(Tenant, PeriodCap)>) -> StoreFuture<Option<Vec<u64>>> {
        let (mut keys, mut fields) = (Vec::new(), Vec::new());
        for (node, cap) in &caps {
            let (key, _, field) = self.control(node, &Control::Daily(*cap), "");
            keys.push(key);
            fields.push(field);
        }
        let database = self.database.clone();
        Box::pin(async move {
            if keys.is_empty() {
                return Ok(Some(Vec::new()));
            }
            let params: Params = vec![Box::new(keys), Box::new(fields)];
            let used: Vec<i64> = database.value(DAYS, &params).await?;
            Ok(Some(
                used.into_iter()
                    .map(|u| u64::try_from(u).unwrap_or(0))
                    .collect(),
            ))
        })
    }

    fn set_paused(&self, scope: Tenant, paused: bool) -> StoreFuture<()> {
        let params: Params = vec![
            Box::new(self.keys.tag().to_owned()),
            Box::new(self.keys.nodes().to_owned()),
            Box::new(scope.as_str().to_owned()),
            Box::new(paused),
        ];
        let database = self.database.clone();
        Box::pin(async move {
            database.query(SET_PAUSED, &params).await?;
            Ok(())
        })
    }

    fn paused(&self) -> StoreFuture<Option<Vec<Tenant>>> {
        let params: Params = vec![Box::new(self.keys.nodes().to_owned())];
        let database = self.database.clone();
        Box::pin(async move {
            let rows = database.query(PAUSED, &params).await?;
            Ok(Some(
                rows.iter()
                    .filter_map(|row| row.try_get::<_, String>(0).ok())
                    .filter_map(|path| Tenant::parse(&path).ok())
                    .collect(),
            ))
        })
    }

    fn lift(&self, limits: Vec<Limit>) -> StoreFuture<()> {
        let keys: Vec<String> = limits.iter().map(|limit| self.keys.bucket(limit)).collect();
        let params: Params = vec![Box::new(self.keys.tag().to_owned()), Box::new(keys)];
        let database = self.database.clone();
        Box::pin(async move {
            if limits.is_empty() {
                return Ok(());
            }
            database.query(LIFT, &params).await?;
            Ok(())
        })
    }
}

/// The lease statement's per-limit arrays.
#[derive(Default)]
struct LeaseLimits {
    keys: Vec<String>,
    incs: Vec<f64>,
    periods: Vec<f64>,
    nums: Vec<i64>,
    dens: Vec<i64>,
    caps: Vec<i64>,
    keeps: Vec<i64>,
    backs: Vec<i64>,
    needs: Vec<i64>,
    asks: Vec<i64>,
}

fn unexpected(what: impl std::fmt::Display) -> StoreUnavailable {
    StoreUnavailable::new(format_args!("unexpected answer: {what}"))
}

/// Reads the reserve statement's row (see `llm_quota.reserve`): buckets are numbered from 1
/// among the `touched` limits, controls from 1 among the path's `controls`. A wait for a hold
/// is told as [`HOLD_RECHECK`] at most.
fn decision(
    row: &tokio_postgres::Row,
    touched: &[usize],
    controls: usize,
) -> Result<Decision, StoreUnavailable> {
    let column = |name: &str| -> Result<Option<i64>, StoreUnavailable> {
        match row.try_get::<_, Option<i64>>(name) {
            Ok(value) => Ok(value),
            Err(_) => row
                .try_get::<_, Option<i32>>(name)
                .map(|v| v.map(i64::from))
                .map_err(unexpected),
        }
    };
    let flag = |name: &str| row.try_get::<_, Option<bool>>(name).map_err(unexpected);
    let limit = |index: Option<i64>| {
        index
            .and_then(|i| usize::try_from(i - 1).ok())
            .and_then(|i| touched.get(i).copied())
            .ok_or_else(|| unexpected(format_args!("bucket {index:?}")))
    };
    let control = |index: Option<i64>| {
        index
            .and_then(|i| usize::try_from(i - 1).ok())
            .filter(|&i| i < controls)
            .ok_or_else(|| unexpected(format_args!("control {index:?}")))
    };
    let decision: String = row.try_get("decision").map_err(unexpected)?;
    match decision.as_str() {
        "admitted" => Ok(Decision::Admitted),
        "denied" => {
            let wait_ms = column("wait_ms")?.unwrap_or(0);
            let mut wait = Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0));
            let by_hold = flag("by_hold")?.unwrap_or(false);
            if by_hold {
                wait = wait.min(HOLD_RECHECK);
            }
            Ok(Decision::Denied {
                wait,
                limit: limit(column("bucket_index")?)?,
                floor_only: flag("floor_only")?.unwrap_or(false),
                first: flag("first_in_line")?.unwrap_or(false),
            })
        }
        "too_large" => Ok(Decision::TooLarge {
            limit: limit(column("bucket_index")?)?,
        }),
        "paused" => Ok(Decision::Paused {
            depth: column("control_index")?
                .and_then(|d| usize::try_from(d).ok())
                .unwrap_or(1),
        }),
        "capped" => Ok(Decision::DayCapped {
            control: control(column("control_index")?)?,
            used: column("used_so_far")?
                .and_then(|u| u64::try_from(u).ok())
                .unwrap_or(0),
        }),
        "no_slot" => Ok(Decision::NoSlot {
            control: control(column("control_index")?)?,
        }),
        "settled" => Err(StoreUnavailable::new(
            "the reservation id was already settled: ids must not be reused",
        )),
        other => Err(unexpected(other)),
    }
}

/// Reads the lease statement's row (see `llm_quota.lease`).
fn grant(row: &tokio_postgres::Row) -> Result<Grant, StoreUnavailable> {
    let renewal: String = row.try_get("renewal").map_err(unexpected)?;
    let list = |name: &str| {
        row.try_get::<_, Option<Vec<i64>>>(name)
            .map(Option::unwrap_or_default)
            .map_err(unexpected)
    };
    let ms = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    let millionths = |n: i64| (n as f64 / 1e6).clamp(0.0, 1.0);
    let renewal = match renewal.as_str() {
        "renewed" => Renewal::Renewed,
        "new" => Renewal::New,
        "left" => Renewal::Left,
        "stale" => Renewal::Stale,
        other => return Err(unexpected(other)),
    };
    let number = |name: &str| {
        row.try_get::<_, Option<i64>>(name)
            .map(Option::unwrap_or_default)
            .map_err(unexpected)
    };
    Ok(Grant {
        renewal,
        part: millionths(number("part_ppm")?),
        lease: ms(number("lasts_ms")?),
        holds: list("hold_ms")?.into_iter().map(ms).collect(),
        plans: list("plan_ppm")?.into_iter().map(millionths).collect(),
        granted: list("granted_units")?
            .into_iter()
            .map(|g| u64::try_from(g).unwrap_or(0))
            .collect(),
        ready: ms(number("ready_ms")?),
        spread: list("spread")?
            .into_iter()
            .map(|n| u32::try_from(n).unwrap_or(0))
            .collect(),
    })
}
