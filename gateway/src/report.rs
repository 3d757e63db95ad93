//! The review of a period (`GET /admin/report?since=...`): per account, tenant and model, the
//! requests, tokens by kind, the estimate against the usage, requests that queued, refusals by
//! scope and limit, the provider's 429s; per account, the idle quota: the share of its
//! capacity nobody used in the minutes nobody waited.
//!
//! Every finished request adds to counters by the hour (its row: account, tenant, model) and,
//! for its account, by the minute (use per dimension; whether anyone queued). They are added
//! to the gateway's state every [`Report::flush_every`]: in Redis (one pipeline of `HINCRBY`,
//! the hour's hash kept [`KEEP_HOURS`]), or in the SQL state's tables `report_rows` and
//! `report_minutes` (one transaction of upserts), so the report covers every replica and
//! survives a restart (a process killed loses what waited for the next flush, a fraction of a
//! second); in memory (the demo) they are kept for as long. An account's minute counts as
//! served when a replica was up in it (each flush marks its minute), so hours without traffic
//! count as idle.
//!
//! With `[prices]`, every answered request whose usage was read also adds to the spend
//! export's counters (its row: tenant, key, model, tier): requests, tokens by the kind each
//! is priced as, and the spend its reservation settled, in nano-dollars. The export
//! (`table=spend`) adds them up by day (UTC). In an SQL state they go to the **ledger**,
//! `ledger`, a row per day (`YYYY-MM-DD`, UTC), tenant, key, model and tier, which a finance
//! user can query as it is: `SELECT day, tenant, sum(spend_nano_usd) / 1e9 AS usd FROM ledger
//! GROUP BY 1, 2`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use serde::Serialize;

use super::audit::Entry;
use super::config::ConfigError;
use super::store::{Database, Persistence, Statement, Value};

/// How often counters go to Redis.
const REDIS_FLUSH: Duration = Duration::from_secs(2);

/// How often counters go to an SQL state: the most a process killed loses.
const SQL_FLUSH: Duration = Duration::from_millis(250);

/// How long an hour's counters are kept: 35 days (a month's review and some).
pub(crate) const KEEP_HOURS: u64 = 35 * 24;

/// The most rows an hour holds; past it, a new model is counted as `other` (a caller naming
/// a new model per request must not grow the report without bound).
const MAX_ROWS_PER_HOUR: usize = 10_000;

/// Separates the parts of a stored field.
const SEP: char = '\u{1f}';

/// A row of the report: an account (`-` for a request refused before one was chosen), a
/// tenant (`-` without a key) and a model.
type RowKey = (String, String, String);

/// A row of the spend export: a tenant, a key, a model and the tier that served it.
type SpendKey = (String, String, String, String);

/// Counters by name.
type Counters = BTreeMap<String, u64>;

/// An account's limits: each one's name and amount a minute.
pub(crate) type AccountLimits = (String, Vec<(String, f64)>);

/// What waits to be added (Redis) or is kept (memory): the rows' counters by hour, and the
/// accounts' by minute.
#[derive(Debug, Default)]
struct Tally {
    rows: BTreeMap<u64, HashMap<RowKey, Counters>>,
    /// By minute, then account: requests, input and output tokens used; `waited`; `up`.
    minutes: BTreeMap<u64, HashMap<String, Counters>>,
    /// The spend export's rows by hour.
    spend: BTreeMap<u64, HashMap<SpendKey, Counters>>,
}

impl Tally {
    fn add_row<N: AsRef<str>>(&mut self, hour: u64, key: RowKey, counters: &[(N, u64)]) {
        let rows = self.rows.entry(hour).or_default();
        let key = if rows.len() >= MAX_ROWS_PER_HOUR && !rows.contains_key(&key) {
            (key.0, key.1, "other".to_owned())
        } else {
            key
        };
        let row = rows.entry(key).or_default();
        for (name, n) in counters {
            let name = name.as_ref();
            match row.get_mut(name) {
                Some(value) => *value += n,
                None => {
                    row.insert(name.to_owned(), *n);
                }
            }
        }
    }

    fn add_spend<N: AsRef<str>>(&mut self, hour: u64, key: SpendKey, counters: &[(N, u64)]) {
        let rows = self.spend.entry(hour).or_default();
        let key = if rows.len() >= MAX_ROWS_PER_HOUR && !rows.contains_key(&key) {
            (key.0, key.1, "other".to_owned(), key.3)
        } else {
            key
        };
        let row = rows.entry(key).or_default();
        for (name, n) in counters {
            *row.entry(name.as_ref().to_owned()).or_default() += n;
        }
    }

    fn add_minute(&mut self, minute: u64, account: &str, counters: &[(&str, u64)]) {
        let accounts = self.minutes.entry(minute).or_default();
        let counts = accounts.entry(account.to_owned()).or_default();
        for (name, n) in counters {
            let value = match counts.get_mut(*name) {
                Some(value) => value,
                None => counts.entry((*name).to_owned()).or_default(),
            };
            // `waited` and `up` are flags: they do not add up over replicas.
            if matches!(*name, "waited" | "up") {
                *value = (*value).max(*n);
            } else {
                *value += n;
            }
        }
    }

    /// Drops what is older than [`KEEP_HOURS`].
    fn prune(&mut self, hour: u64) {
        let oldest = hour.saturating_sub(KEEP_HOURS);
        self.rows = self.rows.split_off(&oldest);
        self.minutes = self.minutes.split_off(&(oldest * 60));
        self.spend = self.spend.split_off(&oldest);
    }

    fn merge(&mut self, other: &Tally) {
        for (hour, rows) in &other.rows {
            for (key, counters) in rows {
                let counters: Vec<(String, u64)> =
                    counters.iter().map(|(k, v)| (k.clone(), *v)).collect();
                self.add_row(*hour, key.clone(), &counters);
            }
        }
        for (minute, accounts) in &other.minutes {
            for (account, counters) in accounts {
                let counters: Vec<(&str, u64)> =
                    counters.iter().map(|(k, v)| (k.as_str(), *v)).collect();
                self.add_minute(*minute, account, &counters);
            }
        }
        self.merge_spend(&other.spend, ..);
    }

    /// Adds `spend`'s rows of the hours in `hours`.
    fn merge_spend(
        &mut self,
        spend: &BTreeMap<u64, HashMap<SpendKey, Counters>>,
        hours: impl std::ops::RangeBounds<u64>,
    ) {
        for (hour, rows) in spend.range(hours) {
            for (key, counters) in rows {
                let counters: Vec<(&str, u64)> =
                    counters.iter().map(|(k, v)| (k.as_str(), *v)).collect();
                self.add_spend(*hour, key.clone(), &counters);
            }
        }
    }
}

/// The report's counters, and where they are kept.
pub(crate) struct Report {
    /// Memory: everything; kept in the state: what the next flush adds.
    tally: Mutex<Tally>,
    redis: Option<ConnectionManager>,
    database: Option<Database>,
}

impl std::fmt::Debug for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Report")
            .field("redis", &self.redis.is_some())
            .field("database", &self.database.is_some())
            .finish_non_exhaustive()
    }
}

fn unix(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// A connection to the Redis at `url` for counters (`what`, in errors), made at its first
/// use: a second to connect, two for an answer, one retry.
pub(crate) fn connection(url: &str, what: &str) -> Result<ConnectionManager, ConfigError> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(2)))
        .set_number_of_retries(1);
    redis::Client::open(url)
        .and_then(|client| ConnectionManager::new_lazy_with_config(client, config))
        .map_err(|e| ConfigError(format!("redis ({what}): {e}")))
}

fn hour_key(hour: u64) -> String {
    format!("{{gateway:report}}:h:{hour}")
}

impl Report {
    /// The report's counters: in the state of `persistence` (Redis, or the SQL `database`),
    /// else in memory.
    pub(crate) fn open(
        persistence: &Persistence,
        database: Option<&Database>,
    ) -> Result<Self, ConfigError> {
        let redis = (persistence.redis())
            .map(|url| connection(url, "report"))
            .transpose()?;
        Ok(Self {
            tally: Mutex::default(),
            redis,
            database: database.cloned(),
        })
    }

    /// How often the counters are added to the state.
    pub(crate) fn flush_every(&self) -> Duration {
        match &self.database {
            Some(_) => SQL_FLUSH,
            None => REDIS_FLUSH,
        }
    }

    /// Whether the counters are kept in the state (else in memory).
    fn kept(&self) -> bool {
        self.redis.is_some() || self.database.is_some()
    }

    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a finished request, as its audit line tells it.
    pub(crate) fn record(&self, entry: &Entry, at: SystemTime) {
        let now = unix(at);
        let account = entry.account.clone().unwrap_or_else(|| "-".to_owned());
        let tenant = entry.tenant.clone().unwrap_or_else(|| "-".to_owned());
        let model = entry.model.clone().unwrap_or_else(|| "-".to_owned());
        let waited = entry.queue_ms.is_some_and(|ms| ms > 0.0);
        let counters = row_counters(entry, waited);
        let mut tally = self.tally();
        tally.add_row(now / 3_600, (account.clone(), tenant, model), &counters);
        if let (Some(spend), Some(tokens)) = (entry.spend_nano_usd, entry.priced) {
            add_spend(&mut tally, now, entry, (spend, tokens));
        }
        if entry.account.is_some() {
            let (input, output) = entry.used.map_or((0, 0), |u| (u.input, u.output));
            let admitted = u64::from(entry.decision == "admitted");
            tally.add_minute(
                now / 60,
                &account,
                &[
                    ("requests", admitted),
                    ("input_tokens", input),
                    ("output_tokens", output),
                    ("waited", u64::from(waited)),
                    ("up", 1),
                ],
            );
        }
        if !self.kept() {
            tally.prune(now / 3_600);
        }
    }

    /// Marks `accounts` as served in the minute of `at` (a replica is up).
    pub(crate) fn mark_up<'a>(&self, accounts: impl IntoIterator<Item = &'a str>, at: SystemTime) {
        let minute = unix(at) / 60;
        let mut tally = self.tally();
        for account in accounts {
            tally.add_minute(minute, account, &[("up", 1)]);
        }
    }

    /// Adds what waits to the state, in one transaction (Redis's `MULTI`/`EXEC`, or an SQL
    /// transaction: all of it or none); what a refused connection kept from Redis, or what an
    /// SQL state refused, waits for the next flush. After any other Redis failure (a timeout:
    /// it may have been added) it is dropped: counted once at most.
    ///
    /// # Cancel safety
    ///
    /// Dropped while the transaction is under way, what it carried may be added or not; it is
    /// not added again (counted once at most).
    pub(crate) async fn flush(&self) -> Result<(), String> {
        if !self.kept() {
            return Ok(());
        }
        let tally = std::mem::take(&mut *self.tally());
        if tally.rows.is_empty() && tally.minutes.is_empty() && tally.spend.is_empty() {
            return Ok(());
        }
        if let Some(database) = &self.database {
            let result = database.transaction(sql_flush(&tally)).await;
            if result.is_err() {
                // Rolled back: put back, to be added by the next flush.
                self.tally().merge(&tally);
            }
            return result.map(drop).map_err(|e| e.to_string());
        }
        let Some(redis) = &self.redis else {
            return Ok(());
        };
        let pipe = redis_flush(&tally);
        let mut connection = redis.clone();
        let result: redis::RedisResult<()> = pipe.query_async(&mut connection).await;
        if result
            .as_ref()
            .is_err_and(redis::RedisError::is_connection_refusal)
        {
            // Never sent: put back, to be added by the next flush.
            self.tally().merge(&tally);
        }
        result.map_err(|e| e.to_string())
    }

    /// The counters of the hours from `since` to `until`: the state's and what waits to be
    /// added, or memory's.
    async fn read(&self, since: u64, until: u64) -> Result<Tally, String> {
        let (first, last) = (since / 3_600, until / 3_600);
        let mut tally = Tally::default();
        if let Some(database) = &self.database {
            tally = sql_read(database, (first, last)).await?;
        }
        if let Some(redis) = &self.redis {
            let mut pipe = redis::pipe();
            for hour in first..=last {
                pipe.hgetall(hour_key(hour));
            }
            let mut connection = redis.clone();
            let hours: Vec<HashMap<String, u64>> = pipe
                .query_async(&mut connection)
                .await
                .map_err(|e| e.to_string())?;
            add_redis_hours(&mut tally, (first..=last).zip(hours));
        }
        let local = self.tally();
        for (hour, rows) in local.rows.range(first..=last) {
            for (key, counters) in rows {
                let counters: Vec<(String, u64)> =
                    counters.iter().map(|(k, v)| (k.clone(), *v)).collect();
                tally.add_row(*hour, key.clone(), &counters);
            }
        }
        for (minute, accounts) in local.minutes.range(first * 60..(last + 1) * 60) {
            for (account, counters) in accounts {
                let counters: Vec<(&str, u64)> =
                    counters.iter().map(|(k, v)| (k.as_str(), *v)).collect();
                tally.add_minute(*minute, account, &counters);
            }
        }
        tally.merge_spend(&local.spend, first..=last);
        Ok(tally)
    }

    /// The review of the hours from `since` to `until` (whole hours: the first and the last
    /// included), its rows those `keep` accepts (a delegated admin's tenants); the accounts'
    /// capacity from `limits` (each account's limits: name, amount a minute), or none.
    pub(crate) async fn review(
        &self,
        (since, until): (SystemTime, SystemTime),
        keep: impl Fn(&str) -> bool,
        limits: Option<&[AccountLimits]>,
    ) -> Result<Review, String> {
        let (since, until) = (unix(since), unix(until).max(unix(since)));
        let tally = self.read(since, until).await?;
        let mut rows: BTreeMap<RowKey, Counters> = BTreeMap::new();
        for hours in tally.rows.values() {
            for (key, counters) in hours {
                if !keep(&key.1) {
                    continue;
                }
                let row = rows.entry(key.clone()).or_default();
                for (name, n) in counters {
                    *row.entry(name.clone()).or_default() += n;
                }
            }
        }
        let rows = rows.into_iter().map(|(key, c)| Row::new(key, &c)).collect();
        let mut days: BTreeMap<(u64, SpendKey), Counters> = BTreeMap::new();
        for (hour, hours) in &tally.spend {
            for (key, counters) in hours {
                if !keep(&key.0) {
                    continue;
                }
                let day = days.entry((hour / 24, key.clone())).or_default();
                for (name, n) in counters {
                    *day.entry(name.clone()).or_default() += n;
                }
            }
        }
        let spend = days
            .into_iter()
            .map(|((day, key), c)| SpendRow::new(day, key, &c))
            .collect();
        let accounts = limits
            .map(|limits| {
                limits
                    .iter()
                    .map(|(account, limits)| idle(account, limits, &tally))
                    .collect()
            })
            .unwrap_or_default();
        Ok(Review {
            since: super::audit::rfc3339(UNIX_EPOCH + Duration::from_secs(since / 3_600 * 3_600)),
            until: super::audit::rfc3339(
                UNIX_EPOCH + Duration::from_secs((until / 3_600 + 1) * 3_600),
            ),
            rows,
            accounts,
            spend,
        })
    }
}

/// An account's idle quota over the minutes it was served.
fn idle(account: &str, limits: &[(String, f64)], tally: &Tally) -> AccountReview {
    let minutes: Vec<&Counters> = tally
        .minutes
        .values()
        .filter_map(|accounts| accounts.get(account))
        .filter(|c| c.get("up").copied().unwrap_or(0) > 0)
        .collect();
    let waited = minutes
        .iter()
        .filter(|c| c.get("waited").copied().unwrap_or(0) > 0)
        .count();
    let limits = limits
        .iter()
        .map(|(limit, per_minute)| {
            let used_in = |c: &Counters| -> f64 {
                let get = |name: &str| c.get(name).copied().unwrap_or(0) as f64;
                if limit.starts_with("requests") {
                    get("requests")
                } else if limit.starts_with("input") {
                    get("input_tokens")
                } else if limit.starts_with("output") {
                    get("output_tokens")
                } else {
                    get("input_tokens") + get("output_tokens")
                }
            };
            let capacity = per_minute * minutes.len() as f64;
            let used: f64 = minutes.iter().map(|c| used_in(c)).sum();
            let idle: f64 = minutes
                .iter()
                .filter(|c| c.get("waited").copied().unwrap_or(0) == 0)
                .map(|c| (per_minute - used_in(c)).max(0.0))
                .sum();
            IdleView {
                limit: limit.clone(),
                capacity: capacity.round() as u64,
                used: used.round() as u64,
                idle: idle.round() as u64,
                idle_share: if capacity > 0.0 {
                    (idle / capacity * 1e4).round() / 1e4
                } else {
                    0.0
                },
            }
        })
        .collect();
    AccountReview {
        account: account.to_owned(),
        minutes_served: minutes.len(),
        minutes_with_waiting: waited,
        limits,
    }
}

/// The review of a period.
#[derive(Debug, Serialize)]
pub(crate) struct Review {
    /// The first hour counted (RFC 3339).
    pub(crate) since: String,
    /// The end of the last hour counted.
    pub(crate) until: String,
    pub(crate) rows: Vec<Row>,
    /// The accounts' idle quota (the operator's report only).
    pub(crate) accounts: Vec<AccountReview>,
    /// The spend export: per day, tenant, key, model and tier (with `[prices]`).
    pub(crate) spend: Vec<SpendRow>,
}

/// A day of a tenant's key on a model at a tier: requests, tokens by the kind each is priced
/// as, and spend.
#[derive(Debug, Serialize)]
pub(crate) struct SpendRow {
    /// The day (UTC), `2026-12-03`.
    pub(crate) day: String,
    pub(crate) tenant: String,
    pub(crate) key: String,
    pub(crate) model: String,
    pub(crate) tier: String,
    pub(crate) requests: u64,
    /// Input tokens neither read from nor written to the prompt cache.
    pub(crate) input_tokens: u64,
    pub(crate) cache_read_tokens: u64,
    pub(crate) cache_write_tokens: u64,
    pub(crate) output_tokens: u64,
    /// In nano-dollars (10⁻⁹ USD), exact.
    pub(crate) spend_nano_usd: u64,
    /// The same in dollars, as a decimal string (exact: nine decimals).
    pub(crate) spend_usd: String,
}

impl SpendRow {
    fn new(day: u64, (tenant, key, model, tier): SpendKey, c: &Counters) -> Self {
        let get = |name: &str| c.get(name).copied().unwrap_or(0);
        let spend = get("spend");
        let date = super::audit::rfc3339(UNIX_EPOCH + Duration::from_secs(day * 86_400));
        Self {
            day: date.get(..10).unwrap_or(&date).to_owned(),
            tenant,
            key,
            model,
            tier,
            requests: get("requests"),
            input_tokens: get("input_tokens"),
            cache_read_tokens: get("cache_read_tokens"),
            cache_write_tokens: get("cache_write_tokens"),
            output_tokens: get("output_tokens"),
            spend_nano_usd: spend,
            spend_usd: format!("{}.{:09}", spend / 1_000_000_000, spend % 1_000_000_000),
        }
    }

    /// The CSV header of [`csv_line`](Self::csv_line).
    pub(crate) const CSV_HEADER: &'static str = "day,tenant,key,model,tier,requests,input_tokens,\
cache_read_tokens,cache_write_tokens,output_tokens,spend_nano_usd,spend_usd";

    /// The row as a CSV line (RFC 4180 quoting).
    pub(crate) fn csv_line(&self) -> String {
        let fields = [
            self.day.clone(),
            quote(&self.tenant),
            quote(&self.key),
            quote(&self.model),
            quote(&self.tier),
            self.requests.to_string(),
            self.input_tokens.to_string(),
            self.cache_read_tokens.to_string(),
            self.cache_write_tokens.to_string(),
            self.output_tokens.to_string(),
            self.spend_nano_usd.to_string(),
            self.spend_usd.clone(),
        ];
        fields.join(",")
    }
}

/// An account, tenant and model over the period.
#[derive(Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) account: String,
    pub(crate) tenant: String,
    pub(crate) model: String,
    pub(crate) requests: u64,
    pub(crate) input_tokens: u64,
    pub(crate) output_tokens: u64,
    pub(crate) cached_tokens: u64,
    /// The requests whose usage settled an estimate, and both sums.
    pub(crate) settled_requests: u64,
    pub(crate) estimated_tokens: u64,
    pub(crate) settled_tokens: u64,
    /// Estimated ÷ used over the settled requests: 1 is exact, above 1 reserved too much.
    pub(crate) estimate_ratio: Option<f64>,
    pub(crate) queued_requests: u64,
    pub(crate) local_refusals: u64,
    pub(crate) provider_refusals: u64,
    pub(crate) provider_429s: u64,
    /// Refusals by scope and limit: `{"tenant:globex requests_per_minute": 2}`.
    pub(crate) refusals: BTreeMap<String, u64>,
}

impl Row {
    fn new((account, tenant, model): RowKey, c: &Counters) -> Self {
        let get = |name: &str| c.get(name).copied().unwrap_or(0);
        let estimated = get("estimated_input_tokens") + get("estimated_output_tokens");
        let settled = get("settled_input_tokens") + get("settled_output_tokens");
        let refusals = c
            .iter()
            .filter_map(|(name, n)| {
                let rest = name.strip_prefix(&format!("refused{SEP}"))?;
                let (scope, limit) = rest.split_once(SEP)?;
                Some((format!("{scope} {limit}"), *n))
            })
            .collect();
        Self {
            account,
            tenant,
            model,
            requests: get("requests"),
            input_tokens: get("input_tokens"),
            output_tokens: get("output_tokens"),
            cached_tokens: get("cached_tokens"),
            settled_requests: get("settled"),
            estimated_tokens: estimated,
            settled_tokens: settled,
            estimate_ratio: (settled > 0)
                .then(|| (estimated as f64 / settled as f64 * 1e4).round() / 1e4),
            queued_requests: get("queued_requests"),
            local_refusals: get("local_refusals"),
            provider_refusals: get("provider_refusals"),
            provider_429s: get("provider_429s"),
            refusals,
        }
    }

    /// The CSV header of [`csv_line`](Self::csv_line).
    pub(crate) const CSV_HEADER: &'static str = "account,tenant,model,requests,input_tokens,\
output_tokens,cached_tokens,settled_requests,estimated_tokens,settled_tokens,estimate_ratio,\
queued_requests,local_refusals,provider_refusals,provider_429s,refusals";

    /// The row as a CSV line (RFC 4180 quoting); refusals as `scope limit=count` joined by `;`.
    pub(crate) fn csv_line(&self) -> String {
        let refusals: Vec<String> = self
            .refusals
            .iter()
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        let fields = [
            quote(&self.account),
            quote(&self.tenant),
            quote(&self.model),
            self.requests.to_string(),
            self.input_tokens.to_string(),
            self.output_tokens.to_string(),
            self.cached_tokens.to_string(),
            self.settled_requests.to_string(),
            self.estimated_tokens.to_string(),
            self.settled_tokens.to_string(),
            self.estimate_ratio
                .map(|r| r.to_string())
                .unwrap_or_default(),
            self.queued_requests.to_string(),
            self.local_refusals.to_string(),
            self.provider_refusals.to_string(),
            self.provider_429s.to_string(),
            quote(&refusals.join(";")),
        ];
        fields.join(",")
    }
}

/// A CSV field, quoted when it must be.
fn quote(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_owned()
    }
}

/// An account over the period: the minutes it was served, those in which a request queued,
/// and per limit its capacity, what was used and what nobody used while nobody waited.
#[derive(Debug, Serialize)]
pub(crate) struct AccountReview {
    pub(crate) account: String,
    pub(crate) minutes_served: usize,
    pub(crate) minutes_with_waiting: usize,
    pub(crate) limits: Vec<IdleView>,
}

/// A limit's idle quota over the period.
#[derive(Debug, Serialize)]
pub(crate) struct IdleView {
    pub(crate) limit: String,
    /// Its amount over the minutes served.
    pub(crate) capacity: u64,
    pub(crate) used: u64,
    /// What nobody used in the minutes nobody waited.
    pub(crate) idle: u64,
    /// `idle ÷ capacity`.
    pub(crate) idle_share: f64,
}

const ADD_ROW: &str = "INSERT INTO report_rows (hour, account, tenant, model, counter, n) \
    VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (hour, account, tenant, model, counter) \
    DO UPDATE SET n = report_rows.n + excluded.n";
const ADD_MINUTE: &str = "INSERT INTO report_minutes (minute, account, counter, n) \
    VALUES ($1, $2, $3, $4) ON CONFLICT (minute, account, counter) \
    DO UPDATE SET n = report_minutes.n + excluded.n";
/// A flag (`waited`, `up`): set, never added up over replicas.
const SET_FLAG: &str = "INSERT INTO report_minutes (minute, account, counter, n) \
    VALUES ($1, $2, $3, 1) ON CONFLICT (minute, account, counter) DO NOTHING";
const ADD_LEDGER: &str = "INSERT INTO ledger (day, tenant, key, model, tier, requests, \
    input_tokens, cache_read_tokens, cache_write_tokens, output_tokens, spend_nano_usd) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) \
    ON CONFLICT (day, tenant, key, model, tier) DO UPDATE SET \
    requests = ledger.requests + excluded.requests, \
    input_tokens = ledger.input_tokens + excluded.input_tokens, \
    cache_read_tokens = ledger.cache_read_tokens + excluded.cache_read_tokens, \
    cache_write_tokens = ledger.cache_write_tokens + excluded.cache_write_tokens, \
    output_tokens = ledger.output_tokens + excluded.output_tokens, \
    spend_nano_usd = ledger.spend_nano_usd + excluded.spend_nano_usd";
const ROWS: &str = "SELECT hour, account, tenant, model, counter, n FROM report_rows \
    WHERE hour >= $1 AND hour <= $2";
const MINUTES: &str = "SELECT minute, account, counter, n FROM report_minutes \
    WHERE minute >= $1 AND minute < $2";
const LEDGER: &str = "SELECT day, tenant, key, model, tier, requests, input_tokens, \
    cache_read_tokens, cache_write_tokens, output_tokens, spend_nano_usd FROM ledger \
    WHERE day >= $1 AND day <= $2";
const PRUNE_ROWS: &str = "DELETE FROM report_rows WHERE hour < $1";
const PRUNE_MINUTES: &str = "DELETE FROM report_minutes WHERE minute < $1";

/// The ledger's counters, in the order of its columns.
const LEDGER_COUNTERS: [&str; 6] = [
    "requests",
    "input_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "output_tokens",
    "spend",
];

/// The day (UTC) of the hour `hour` since the epoch, `2026-12-03`.
fn day_of_hour(hour: u64) -> String {
    let date = super::audit::rfc3339(UNIX_EPOCH + Duration::from_secs(hour / 24 * 86_400));
    date.get(..10).unwrap_or(&date).to_owned()
}

/// The hour since the epoch of the day `day` (`2026-12-03`) began, if it reads.
fn hour_of_day(day: &str) -> Option<u64> {
    let mut parts = day.splitn(3, '-').map(str::parse::<u64>);
    let (year, month, date) = (
        parts.next()?.ok()?,
        parts.next()?.ok()?,
        parts.next()?.ok()?,
    );
    // Days from 1970-01-01 (H. Hinnant's days_from_civil).
    let year = if month <= 2 {
        year.checked_sub(1)?
    } else {
        year
    };
    let era = year / 400;
    let yoe = year - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + date.checked_sub(1)?;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = (era * 146_097 + doe).checked_sub(719_468)?;
    Some(days * 24)
}

/// The statements adding `tally` to an SQL state, the oldest counters dropped.
fn sql_flush(tally: &Tally) -> Vec<Statement> {
    let mut statements = Vec::new();
    for (hour, rows) in &tally.rows {
        for ((account, tenant, model), counters) in rows {
            for (name, n) in counters {
                statements.push(Statement::new(
                    ADD_ROW,
                    vec![
                        Value::from(*hour),
                        account.as_str().into(),
                        tenant.as_str().into(),
                        model.as_str().into(),
                        name.as_str().into(),
                        Value::from(*n),
                    ],
                ));
            }
        }
    }
    statements.extend(sql_minutes(tally));
    for (hour, rows) in &tally.spend {
        for ((tenant, key, model, tier), counters) in rows {
            let mut params = vec![
                Value::from(day_of_hour(*hour)),
                tenant.as_str().into(),
                key.as_str().into(),
                model.as_str().into(),
                tier.as_str().into(),
            ];
            for name in LEDGER_COUNTERS {
                params.push(Value::from(counters.get(name).copied().unwrap_or(0)));
            }
            statements.push(Statement::new(ADD_LEDGER, params));
        }
    }
    if let Some(&newest) = tally.rows.keys().next_back() {
        let oldest = newest.saturating_sub(KEEP_HOURS);
        statements.push(Statement::new(PRUNE_ROWS, vec![Value::from(oldest)]));
        statements.push(Statement::new(
            PRUNE_MINUTES,
            vec![Value::from(oldest * 60)],
        ));
    }
    statements
}

/// The counters of the hours `first` to `last` in an SQL state; the ledger's days that hold
/// them, each day's rows counted in its first hour.
async fn sql_read(database: &Database, (first, last): (u64, u64)) -> Result<Tally, String> {
    let answers = database
        .transaction(vec![
            Statement::new(ROWS, vec![Value::from(first), Value::from(last)]),
            Statement::new(
                MINUTES,
                vec![Value::from(first * 60), Value::from((last + 1) * 60)],
            ),
            Statement::new(
                LEDGER,
                vec![day_of_hour(first).into(), day_of_hour(last).into()],
            ),
        ])
        .await
        .map_err(|e| e.to_string())?;
    let count = |v: &Value| u64::try_from(v.int()).unwrap_or(0);
    let mut tally = Tally::default();
    let mut answers = answers.into_iter();
    for row in answers.next().unwrap_or_default() {
        let [hour, account, tenant, model, name, n] = &row[..] else {
            continue;
        };
        let key = (
            account.text().into(),
            tenant.text().into(),
            model.text().into(),
        );
        tally.add_row(count(hour), key, &[(name.text(), count(n))]);
    }
    for row in answers.next().unwrap_or_default() {
        let [minute, account, name, n] = &row[..] else {
            continue;
        };
        tally.add_minute(count(minute), account.text(), &[(name.text(), count(n))]);
    }
    for row in answers.next().unwrap_or_default() {
        let [day, tenant, key, model, tier, counters @ ..] = &row[..] else {
            continue;
        };
        let Some(hour) = hour_of_day(day.text()) else {
            continue;
        };
        let key = (
            tenant.text().into(),
            key.text().into(),
            model.text().into(),
            tier.text().into(),
        );
        let counters: Vec<(&str, u64)> = LEDGER_COUNTERS
            .iter()
            .zip(counters)
            .map(|(name, n)| (*name, count(n)))
            .collect();
        tally.add_spend(hour, key, &counters);
    }
    Ok(tally)
}

/// A finished request's counters in its row of the report: requests, tokens used and
/// estimated, or its refusal by kind, scope and limit.
fn row_counters(entry: &Entry, waited: bool) -> Vec<(std::borrow::Cow<'static, str>, u64)> {
    let mut counters: Vec<(std::borrow::Cow<'static, str>, u64)> = Vec::with_capacity(10);
    match entry.decision {
        "admitted" => {
            counters.push(("requests".into(), 1));
            if let Some(used) = entry.used {
                counters.push(("input_tokens".into(), used.input));
                counters.push(("output_tokens".into(), used.output));
                counters.push(("cached_tokens".into(), used.cached.unwrap_or(0)));
                if let Some(estimated) = entry.estimated {
                    counters.push(("settled".into(), 1));
                    counters.push(("estimated_input_tokens".into(), estimated.input));
                    counters.push(("estimated_output_tokens".into(), estimated.output));
                    counters.push(("settled_input_tokens".into(), used.input));
                    counters.push(("settled_output_tokens".into(), used.output));
                }
            }
            counters.push(("queued_requests".into(), u64::from(waited)));
        }
        decision => {
            let kind = if decision == "provider" {
                "provider_refusals"
            } else {
                "local_refusals"
            };
            counters.push((kind.into(), 1));
            if entry.provider_status == Some(429) {
                counters.push(("provider_429s".into(), 1));
            }
            let scope = entry.scope.as_deref().unwrap_or("-");
            let limit = entry.limit.as_deref().unwrap_or("-");
            counters.push((format!("refused{SEP}{scope}{SEP}{limit}").into(), 1));
        }
    }
    counters
}

/// A priced answer's spend, by tenant, key, model and service tier.
fn add_spend(
    tally: &mut Tally,
    now: u64,
    entry: &Entry,
    (spend, tokens): (u64, tower_llm_quota::pricing::PricedTokens),
) {
    let key = (
        entry.tenant.clone().unwrap_or_else(|| "-".to_owned()),
        entry.key.clone().unwrap_or_else(|| "-".to_owned()),
        entry.model.clone().unwrap_or_else(|| "-".to_owned()),
        entry.service_tier.unwrap_or("standard").to_owned(),
    );
    tally.add_spend(
        now / 3_600,
        key,
        &[
            ("requests", 1),
            ("input_tokens", tokens.input),
            ("cache_read_tokens", tokens.cache_read),
            ("cache_write_tokens", tokens.cache_write),
            ("output_tokens", tokens.output),
            ("spend", spend),
        ],
    );
}

/// The Redis pipeline (one transaction) adding `tally` to the hours' hashes, each kept
/// `KEEP_HOURS`.
fn redis_flush(tally: &Tally) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    pipe.atomic();
    let keep = i64::try_from(KEEP_HOURS * 3_600).unwrap_or(i64::MAX);
    for (hour, rows) in &tally.rows {
        let key = hour_key(*hour);
        for ((account, tenant, model), counters) in rows {
            for (name, n) in counters {
                let field = format!("r{SEP}{account}{SEP}{tenant}{SEP}{model}{SEP}{name}");
                pipe.hincr(&key, field, *n).ignore();
            }
        }
        pipe.expire(&key, keep).ignore();
    }
    for (hour, rows) in &tally.spend {
        let key = hour_key(*hour);
        for ((tenant, name, model, tier), counters) in rows {
            for (counter, n) in counters {
                let field =
                    format!("s{SEP}{tenant}{SEP}{name}{SEP}{model}{SEP}{tier}{SEP}{counter}");
                pipe.hincr(&key, field, *n).ignore();
            }
        }
        pipe.expire(&key, keep).ignore();
    }
    for (minute, accounts) in &tally.minutes {
        let key = hour_key(minute / 60);
        for (account, counters) in accounts {
            for (name, n) in counters {
                let field = format!("m{SEP}{minute}{SEP}{account}{SEP}{name}");
                if matches!(name.as_str(), "waited" | "up") {
                    if *n > 0 {
                        pipe.hset(&key, field, 1).ignore();
                    }
                } else {
                    pipe.hincr(&key, field, *n).ignore();
                }
            }
        }
        pipe.expire(&key, keep).ignore();
    }
    pipe
}

/// Adds the fields of the hours' hashes read from Redis to `tally`.
fn add_redis_hours(tally: &mut Tally, hours: impl Iterator<Item = (u64, HashMap<String, u64>)>) {
    for (hour, fields) in hours {
        for (field, n) in fields {
            let parts: Vec<&str> = field.split(SEP).collect();
            match parts.as_slice() {
                ["r", account, tenant, model, name @ ..] => {
                    let key = ((*account).into(), (*tenant).into(), (*model).into());
                    tally.add_row(hour, key, &[(name.join(&SEP.to_string()), n)]);
                }
                ["m", minute, account, name] => {
                    if let Ok(minute) = minute.parse() {
                        tally.add_minute(minute, account, &[(name, n)]);
                    }
                }
                ["s", tenant, key, model, tier, name] => {
                    let key = (
                        (*tenant).into(),
                        (*key).into(),
                        (*model).into(),
                        (*tier).into(),
                    );
                    tally.add_spend(hour, key, &[(name, n)]);
                }
                _ => {}
            }
        }
    }
}

/// The statements adding `tally`'s minutes (their counters, and the flags set once).
fn sql_minutes(tally: &Tally) -> Vec<Statement> {
    let mut statements = Vec::new();
    for (minute, accounts) in &tally.minutes {
        for (account, counters) in accounts {
            for (name, n) in counters {
                let flag = matches!(name.as_str(), "waited" | "up");
                if flag && *n == 0 {
                    continue;
                }
                let mut params = vec![
                    Value::from(*minute),
                    account.as_str().into(),
                    name.as_str().into(),
                ];
                if !flag {
                    params.push(Value::from(*n));
                }
                statements.push(Statement::new(
                    if flag { SET_FLAG } else { ADD_MINUTE },
                    params,
                ));
            }
        }
    }
    statements
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::Tokens;

    fn admitted(tenant: &str, used: (u64, u64), estimated: (u64, u64), queued: f64) -> Entry {
        Entry {
            tenant: Some(tenant.into()),
            account: Some("acct".into()),
            model: Some("m".into()),
            decision: "admitted",
            used: Some(Tokens {
                input: used.0,
                output: used.1,
                cached: Some(0),
            }),
            estimated: Some(Tokens {
                input: estimated.0,
                output: estimated.1,
                cached: None,
            }),
            queue_ms: Some(queued),
            ..Entry::default()
        }
    }

    #[tokio::test]
    #[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
    async fn rows_add_up_and_idle_quota_counts_the_minutes_nobody_waited() {
        let report = Report::open(&Persistence::Memory, None).unwrap();
        let t0 = UNIX_EPOCH + Duration::from_secs(1_796_256_000); // a minute's start
        // Minute 1: 2 requests of 100 tokens, none queued. Minute 2: one that queued.
        report.record(&admitted("a", (60, 40), (60, 90), 0.0), t0);
        report.record(&admitted("b", (60, 40), (60, 90), 0.0), t0);
        report.record(
            &admitted("a", (60, 40), (60, 40), 12.0),
            t0 + Duration::from_secs(60),
        );
        // Minute 3: up, no traffic.
        report.mark_up(["acct"], t0 + Duration::from_secs(120));
        let refused = Entry {
            tenant: Some("a".into()),
            account: None,
            model: Some("m".into()),
            decision: "local",
            scope: Some("tenant:a".into()),
            limit: Some("requests_per_minute".into()),
            ..Entry::default()
        };
        report.record(&refused, t0);
        report.record(&refused, t0);
        let limits = vec![(
            "acct".to_owned(),
            vec![
                ("requests_per_minute".to_owned(), 10.0),
                ("total_tokens_per_minute".to_owned(), 1_000.0),
            ],
        )];
        let review = report
            .review((t0, t0 + Duration::from_secs(180)), |_| true, Some(&limits))
            .await
            .unwrap();
        let row = |account: &str, tenant: &str| {
            review
                .rows
                .iter()
                .find(|r| r.account == account && r.tenant == tenant)
                .unwrap()
        };
        let a = row("acct", "a");
        assert_eq!((a.requests, a.input_tokens, a.output_tokens), (2, 120, 80));
        assert_eq!((a.estimated_tokens, a.settled_tokens), (250, 200));
        assert_eq!(a.estimate_ratio, Some(1.25));
        assert_eq!(a.queued_requests, 1);
        let refusals = row("-", "a");
        assert_eq!(refusals.local_refusals, 2);
        assert_eq!(
            refusals.refusals.get("tenant:a requests_per_minute"),
            Some(&2)
        );
        let account = &review.accounts[0];
        assert_eq!(
            (account.minutes_served, account.minutes_with_waiting),
            (3, 1)
        );
        // Tokens: 3,000 of capacity; minute 1 left 800 idle, minute 3 all 1,000; minute 2's
        // idle does not count (a request waited).
        let tokens = &account.limits[1];
        assert_eq!(
            (tokens.capacity, tokens.used, tokens.idle),
            (3_000, 300, 1_800)
        );
        assert_eq!(tokens.idle_share, 0.6);
        let requests = &account.limits[0];
        assert_eq!(
            (requests.capacity, requests.used, requests.idle),
            (30, 3, 18)
        );
        // A delegated admin's review: its tenants' rows only.
        let only_b = report
            .review((t0, t0 + Duration::from_secs(180)), |t| t == "b", None)
            .await
            .unwrap();
        assert_eq!(only_b.rows.len(), 1);
        assert!(only_b.accounts.is_empty());
    }

    #[test]
    fn csv_fields_are_quoted_when_they_must_be() {
        assert_eq!(quote("plain"), "plain");
        assert_eq!(quote("a,b"), "\"a,b\"");
        assert_eq!(quote("say \"hi\""), "\"say \"\"hi\"\"\"");
    }
}
