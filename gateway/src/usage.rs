//! Per-tenant usage of the current UTC day, and the last refusals, for the admin API and the
//! status page; the same figures go to `/metrics`.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use metrics::counter;
use serde::Serialize;
use tower_llm_quota::Priority;
use tower_llm_quota::usage::ServiceTier;

use super::refusal::{Decision, Refusal};

/// The gateway's own series, described for Prometheus (`HELP` and units).
pub(crate) fn describe() {
    describe_requests();
    describe_gauges();
}

/// The series counted per request (and per alert).
fn describe_requests() {
    use metrics::{describe_counter, describe_histogram};
    describe_histogram!(
        "gateway_request_duration_seconds",
        metrics::Unit::Seconds,
        "From the request's head to the answer's last byte (or the refusal), by API and decision (admitted, local, provider): end to end, queue and call included."
    );
    describe_histogram!(
        "gateway_added_seconds",
        metrics::Unit::Seconds,
        "The gateway's own time to an answer's head, by API: from the request's head, less the time queued for quota and the upstream call's."
    );
    describe_counter!(
        "gateway_spend_alerts_total",
        "Spend alert thresholds crossed, by the alert's node and threshold (percent): once each per period over every replica."
    );
    describe_counter!(
        "gateway_alert_webhook_failures_total",
        "Failed attempts to post a spend alert to the webhook (each retried with backoff)."
    );
    describe_counter!(
        "gateway_alert_webhook_dropped_total",
        "Spend alerts never delivered to the webhook: every attempt failed, or the queue was full."
    );
    describe_counter!(
        "gateway_alert_count_failures_total",
        "Answers whose spend could not be added to a spend alert's count in Redis."
    );
    describe_counter!(
        "gateway_requests_total",
        "Requests the provider answered, by tenant, API, class and status."
    );
    describe_counter!(
        "gateway_tokens_total",
        metrics::Unit::Count,
        "Tokens the answers used, by tenant, kind (input, output) and service tier."
    );
    describe_counter!(
        "gateway_cache_read_tokens_total",
        metrics::Unit::Count,
        "Input tokens the answers read from the provider's prompt cache, by tenant: what the cache keeps off an input limit that does not count cache reads (Anthropic's), or bills at the cached price."
    );
    describe_counter!(
        "gateway_refusals_total",
        "Requests refused, by tenant, decision (local, provider) and limit."
    );
}

/// The gauges `/metrics` sets from the tenants' and accounts' state when it renders.
fn describe_gauges() {
    use metrics::describe_gauge;
    describe_gauge!(
        "gateway_tenant_used_tokens_per_minute",
        "Tokens a tenant used on an account over the last minute."
    );
    describe_gauge!(
        "gateway_tenant_guaranteed_tokens_per_minute",
        "Tokens a minute a tenant's guarantee holds for it on an account."
    );
    describe_gauge!(
        "gateway_tenant_borrowed_tokens_per_minute",
        "Tokens a tenant used beyond its guarantee on an account over the last minute."
    );
    describe_gauge!(
        "gateway_tenant_queued",
        "Requests of a tenant waiting on an account."
    );
    describe_gauge!(
        "gateway_tenant_level",
        "What is left of a tenant's limit's burst on an account."
    );
    describe_gauge!(
        "gateway_tenant_paused",
        "Whether a tenant is paused (1) or not (0)."
    );
    describe_gauge!(
        "gateway_account_in_flight",
        "Calls in flight on an account (or a scope of it)."
    );
    describe_gauge!(
        "gateway_account_queued",
        "Requests waiting on an account (or a scope of it), by class."
    );
    describe_gauge!(
        "gateway_account_level",
        "What is left of an account's (or a scope's) limit's burst."
    );
    describe_gauge!(
        "gateway_account_burst",
        "The burst of an account's (or a scope's) limit: the most it admits at once."
    );
}

/// How many refusals the status page lists.
const LAST_REFUSALS: usize = 20;

/// A tenant's counts for one day.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Counts {
    pub(crate) requests: u64,
    pub(crate) input_tokens: u64,
    pub(crate) output_tokens: u64,
    /// Input and output tokens by the service tier the provider said served them
    /// (`standard`, `flex`, `priority`, ...; `unknown` when it named none).
    pub(crate) tokens_by_tier: std::collections::BTreeMap<&'static str, u64>,
    pub(crate) local_refusals: u64,
    pub(crate) provider_refusals: u64,
}

impl Counts {
    pub(crate) fn add(&mut self, other: &Counts) {
        self.requests += other.requests;
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        for (tier, tokens) in &other.tokens_by_tier {
            *self.tokens_by_tier.entry(tier).or_default() += tokens;
        }
        self.local_refusals += other.local_refusals;
        self.provider_refusals += other.provider_refusals;
    }
}

/// Refusals of one kind (tenant, status, decision, limit, scope), as the status page lists
/// them: how many, and the last one's time.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RefusalRecord {
    /// The last one's time, in seconds since the Unix epoch.
    pub(crate) at: f64,
    /// How many since the gateway started (or since the kind was last listed among the
    /// latest ones).
    pub(crate) count: u64,
    pub(crate) tenant: Option<String>,
    pub(crate) status: u16,
    pub(crate) decision: Decision,
    pub(crate) limit: String,
    pub(crate) scope: String,
}

#[derive(Debug, Default)]
struct Day {
    day: u64,
    counts: HashMap<String, Counts>,
}

/// The usage ledger: counts by tenant path for today, the tokens of the last minute by
/// account and node, and the last refusals.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    today: Mutex<Day>,
    /// Each tenant's counters, their labels resolved once (not per request).
    series: Mutex<HashMap<String, Series>>,
    /// The last minute and the last hour: one lock per answer for both.
    windows: Mutex<Windows>,
    refusals: Mutex<VecDeque<RefusalRecord>>,
}

/// A tenant's counters, registered with the recorder at their first use.
#[derive(Debug, Default)]
struct Series {
    /// `gateway_requests_total` by API, class and status.
    requests: HashMap<(&'static str, &'static str, u16), metrics::Counter>,
    /// `gateway_tokens_total` by service tier: input, output.
    tokens: HashMap<&'static str, [metrics::Counter; 2]>,
    cache_read: Option<metrics::Counter>,
}

/// At most this many tenants' counters are kept; past it they start over.
const MAX_SERIES: usize = 4_096;

/// Sixty slots of time (seconds of the last minute, minutes of the last hour) and the slot of
/// the newest: a slot older than sixty is cleared before it is used again.
#[derive(Debug, Clone)]
struct Ring<T> {
    slots: [T; 60],
    newest: u64,
}

impl<T: Copy + Default> Default for Ring<T> {
    fn default() -> Self {
        Self {
            slots: [T::default(); 60],
            newest: 0,
        }
    }
}

impl<T: Copy + Default> Ring<T> {
    /// Changes the slot of `at` (forgetting the slots more than sixty before it).
    fn add(&mut self, at: u64, change: impl FnOnce(&mut T)) {
        self.forget_before(at);
        change(&mut self.slots[(at % 60) as usize]);
    }

    /// The sixty slots up to `at`, the oldest first.
    fn up_to(&self, at: u64) -> [T; 60] {
        let mut ring = self.clone();
        ring.forget_before(at);
        std::array::from_fn(|i| ring.slots[((at + 1 + i as u64) % 60) as usize])
    }

    /// Clears the slots past since the newest, up to `at` (sixty at most).
    fn forget_before(&mut self, at: u64) {
        if at <= self.newest {
            return;
        }
        for past in (self.newest + 1..=at).take(60) {
            self.slots[(past % 60) as usize] = T::default();
        }
        self.newest = at;
    }
}

/// Values by name, looked up by `&str`: a name is allocated once, when first seen.
#[derive(Debug)]
struct Named<T>(HashMap<String, T>);

impl<T> Default for Named<T> {
    fn default() -> Self {
        Self(HashMap::new())
    }
}

impl<T: Default> Named<T> {
    fn at(&mut self, name: &str) -> &mut T {
        if !self.0.contains_key(name) {
            self.0.insert(name.to_owned(), T::default());
        }
        self.0.get_mut(name).expect("inserted above")
    }

    fn get(&self, name: &str) -> Option<&T> {
        self.0.get(name)
    }
}

/// The recent windows: tokens of the last minute by second, per account then per node, and
/// the last hour by minute, per node (each node above an answer too) and per account.
#[derive(Debug, Default)]
struct Windows {
    minute: Named<Named<Ring<u64>>>,
    nodes: Named<Ring<Tally>>,
    accounts: Named<Ring<Tally>>,
}

impl Windows {
    /// Changes the current minute of each of `nodes` and of `account`.
    fn hour<'a>(
        &mut self,
        nodes: impl Iterator<Item = &'a str>,
        account: Option<&str>,
        change: impl Fn(&mut Tally),
    ) {
        let minute = now() as u64 / 60;
        for node in nodes {
            self.nodes.at(node).add(minute, &change);
        }
        if let Some(account) = account {
            self.accounts.at(account).add(minute, &change);
        }
    }
}

/// Whose hour: a tenant node's or an account's.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Whose<'a> {
    Node(&'a str),
    Account(&'a str),
}

/// One minute of a tenant or an account: tokens answered, their spend, refusals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Tally {
    pub(crate) tokens: u64,
    pub(crate) spend_nano_usd: u64,
    pub(crate) refusals: u64,
}

/// The last hour of a tenant or an account, minute by minute, the oldest first (the last is
/// the current minute): what the status page charts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct HourView {
    pub(crate) tokens: Vec<u64>,
    pub(crate) spend_nano_usd: Vec<u64>,
    pub(crate) refusals: Vec<u64>,
}

impl HourView {
    fn of(minutes: &[Tally; 60]) -> Self {
        Self {
            tokens: minutes.iter().map(|t| t.tokens).collect(),
            spend_nano_usd: minutes.iter().map(|t| t.spend_nano_usd).collect(),
            refusals: minutes.iter().map(|t| t.refusals).collect(),
        }
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Ledger {
    /// Counts `tokens` answered on `account` for `path` and each node above it, in the last
    /// minute's window.
    pub(crate) fn recent(
        &self,
        account: &str,
        path: &tower_llm_quota::tenant::Tenant,
        (tokens, spend_nano_usd): (u64, u64),
    ) {
        let second = now() as u64;
        let mut windows = self.windows();
        let nodes = windows.minute.at(account);
        for node in path.prefixes() {
            nodes.at(node).add(second, |t| *t += tokens);
        }
        windows.hour(path.prefixes(), Some(account), |t| {
            t.tokens += tokens;
            t.spend_nano_usd += spend_nano_usd;
        });
    }

    fn windows(&self) -> std::sync::MutexGuard<'_, Windows> {
        self.windows.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The last hour of a node or an account, minute by minute.
    pub(crate) fn last_hour(&self, whose: Whose<'_>) -> HourView {
        let minute = now() as u64 / 60;
        let windows = self.windows();
        let ring = match whose {
            Whose::Node(path) => windows.nodes.get(path),
            Whose::Account(name) => windows.accounts.get(name),
        };
        let minutes = ring.map(|ring| ring.up_to(minute));
        HourView::of(&minutes.unwrap_or([Tally::default(); 60]))
    }

    /// The tokens answered on `account` for the node at `path` (and below it) over the last
    /// minute.
    pub(crate) fn used_last_minute(&self, account: &str, path: &str) -> u64 {
        let windows = self.windows();
        (windows
            .minute
            .get(account)
            .and_then(|nodes| nodes.get(path)))
        .map_or(0, |minute| minute.up_to(now() as u64).iter().sum())
    }

    fn with_today(&self, tenant: &str, change: impl FnOnce(&mut Counts)) {
        let day = (now() / 86_400.0) as u64;
        let mut today = self
            .today
            .lock()
            .expect("the ledger lock is never poisoned");
        if today.day != day {
            today.day = day;
            today.counts.clear();
        }
        change(today.counts.entry(tenant.to_owned()).or_default());
    }

    /// `record` with `tenant`'s counters.
    fn with_series(&self, tenant: &str, record: impl FnOnce(&mut Series)) {
        let mut all = self.series.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(series) = all.get_mut(tenant) {
            return record(series);
        }
        if all.len() >= MAX_SERIES {
            all.clear();
        }
        record(all.entry(tenant.to_owned()).or_default());
    }

    /// A request of `class` the provider answered (any status but a refusal).
    pub(crate) fn answered(&self, tenant: &str, api: &'static str, class: Priority, status: u16) {
        self.with_today(tenant, |c| c.requests += 1);
        let class = class.as_str();
        self.with_series(tenant, |series| {
            (series.requests.entry((api, class, status)))
                .or_insert_with(|| {
                    counter!("gateway_requests_total", "tenant" => tenant.to_owned(), "api" => api,
                        "class" => class, "status" => status.to_string())
                })
                .increment(1);
        });
    }

    /// The tokens a finished answer used (input, output, read from the prompt cache), and the
    /// service tier that served them.
    pub(crate) fn tokens(
        &self,
        tenant: &str,
        (input, output, cache_read): (u64, u64, u64),
        tier: Option<ServiceTier>,
    ) {
        let tier = tier.map_or("unknown", ServiceTier::as_str);
        self.with_today(tenant, |c| {
            c.input_tokens += input;
            c.output_tokens += output;
            *c.tokens_by_tier.entry(tier).or_default() += input + output;
        });
        self.with_series(tenant, |series| {
            let [inputs, outputs] = series.tokens.entry(tier).or_insert_with(|| {
                ["input", "output"].map(|kind| {
                    counter!("gateway_tokens_total", "tenant" => tenant.to_owned(), "kind" => kind,
                        "service_tier" => tier)
                })
            });
            inputs.increment(input);
            outputs.increment(output);
            if cache_read > 0 {
                (series.cache_read.get_or_insert_with(
                    || counter!("gateway_cache_read_tokens_total", "tenant" => tenant.to_owned()),
                ))
                .increment(cache_read);
            }
        });
    }

    /// A refusal, local or the provider's, of a request of `tenant` (none when unauthenticated).
    pub(crate) fn refused(&self, tenant: Option<&str>, refusal: &Refusal) {
        if let Some(tenant) = tenant {
            self.with_today(tenant, |c| match refusal.gateway_decision {
                Decision::Local => c.local_refusals += 1,
                Decision::Provider => c.provider_refusals += 1,
            });
        }
        // The hour of the tenant (and the nodes above it) and of the account that refused.
        let nodes = tenant.and_then(|t| tower_llm_quota::tenant::Tenant::parse(t).ok());
        let account = (refusal.scope.strip_prefix("account:"))
            .map(|rest| rest.split("/scope:").next().unwrap_or(rest));
        let prefixes = nodes.iter().flat_map(|path| path.prefixes());
        self.windows().hour(prefixes, account, |t| t.refusals += 1);
        let decision = match refusal.gateway_decision {
            Decision::Local => "local",
            Decision::Provider => "provider",
        };
        counter!("gateway_refusals_total", "tenant" => tenant.unwrap_or("-").to_owned(),
            "decision" => decision, "limit" => refusal.limit.to_string())
        .increment(1);
        let mut last = self
            .refusals
            .lock()
            .expect("the ledger lock is never poisoned");
        let status = refusal.status.as_u16();
        let same = |r: &RefusalRecord| {
            r.status == status
                && r.decision == refusal.gateway_decision
                && r.tenant.as_deref() == tenant
                && *r.limit == *refusal.limit
                && *r.scope == *refusal.scope
        };
        // The kind moves to the back (the latest) with its count.
        let count = match last.iter().position(same) {
            Some(index) => last.remove(index).map_or(1, |r| r.count + 1),
            None => 1,
        };
        if last.len() == LAST_REFUSALS {
            last.pop_front();
        }
        last.push_back(RefusalRecord {
            at: now(),
            count,
            tenant: tenant.map(str::to_owned),
            status,
            decision: refusal.gateway_decision,
            limit: refusal.limit.to_string(),
            scope: refusal.scope.to_string(),
        });
    }

    /// Today's counts of one tenant path and every path below it.
    pub(crate) fn counts_under(&self, path: &str) -> Counts {
        let today = self
            .today
            .lock()
            .expect("the ledger lock is never poisoned");
        let mut total = Counts::default();
        for (tenant, counts) in &today.counts {
            if is_under(tenant, path) {
                total.add(counts);
            }
        }
        total
    }

    /// The last refusals, newest first.
    pub(crate) fn last_refusals(&self) -> Vec<RefusalRecord> {
        let last = self
            .refusals
            .lock()
            .expect("the ledger lock is never poisoned");
        last.iter().rev().cloned().collect()
    }
}

/// Whether `tenant` is `path` or below it.
pub(crate) fn is_under(tenant: &str, path: &str) -> bool {
    tenant == path
        || tenant
            .strip_prefix(path)
            .is_some_and(|rest| rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_forgets_what_is_older() {
        let mut minute = Ring::<u64>::default();
        let total = |ring: &Ring<u64>, at| ring.up_to(at).iter().sum::<u64>();
        minute.add(1_000, |t| *t += 10);
        minute.add(1_030, |t| *t += 5);
        assert_eq!(total(&minute, 1_030), 15);
        assert_eq!(total(&minute, 1_059), 15);
        assert_eq!(total(&minute, 1_060), 5, "the second 1,000 is a minute old");
        assert_eq!(total(&minute, 1_090), 0);
        minute.add(5_000, |t| *t += 7);
        assert_eq!(
            total(&minute, 5_000),
            7,
            "a long silence forgets everything"
        );
        let slots = minute.up_to(5_001);
        assert_eq!(
            (slots[58], slots[59]),
            (7, 0),
            "the oldest first, `at` last"
        );
    }
}
