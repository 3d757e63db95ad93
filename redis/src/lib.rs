//! One quota shared by several processes, kept in Redis: the Redis store of
//! [tower-llm-quota](tower_llm_quota), and its idempotency records.
//!
//! [`RedisBudget`] builds a [`Budget`] whose buckets live in Redis: the same handle, layers
//! and API as an in-memory budget, for every instance of a service that spends one provider
//! account. Each admission is **one round trip**: a Lua script refills and checks every
//! dimension of the request with the Redis server's clock and takes the cost from all of them
//! or from none. A denial writes nothing and tells how long to wait; the request then waits
//! in its process's own queue (first in, first out, or by priority with the queue layer) and
//! asks again when the wait is over, so no process polls in a loop.
//!
//! ```no_run
//! use std::num::NonZeroU64;
//! use tower_llm_quota_redis::RedisBudget;
//! use tower_llm_quota::{Cost, Dimension, Limit, Quota, Usage};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let nz = |n| NonZeroU64::new(n).unwrap();
//! let quota = Quota::new()
//!     .with_limit(Limit::per_minute(Dimension::Requests, nz(500)))
//!     .with_limit(Limit::per_minute(Dimension::TotalTokens, nz(30_000)));
//! // Every process naming the same account shares its quota.
//! let budget = RedisBudget::new("redis://127.0.0.1:6379", "openai-org-1")
//!     .expected_instances(4)
//!     .connect(&quota)
//!     .await?;
//! let mut reservation = budget.reserve(Cost::new(1_200, 200)).await?;
//! reservation.mark_sent();
//! reservation.settle(&Usage::new(1_200, 50)); // the refund is written in the background
//! # Ok(()) }
//! ```
//!
//! # Keys
//!
//! A bucket per limit, `<prefix>:{<quota key>}:<dimension>:<period in ms>` (a string holding its
//! level and refill time), its hold while a provider's pause lasts, `<bucket>:held` (the server
//! instant of the pause's end, expiring then), and a record per reservation,
//! `<prefix>:{<quota key>}:r:<id>`; a tenant node's buckets are
//! `<prefix>:{<quota key>}:t:<node>:<dimension>:<period in ms>`, or, for the accounts of a
//! [tenant plane](RedisBudget::tenant_plane), `<prefix>:{<plane>}:t:...` beside the accounts'
//! `<prefix>:{<plane>}:<quota key>:...`; the paused tenant nodes are a set beside the nodes'
//! buckets, `<prefix>:{<quota key or plane>}:paused`, and so are a node's daily counts,
//! `...:t:<node>:days`, the slots of its calls in flight, `...:t:<node>:slots`, and the
//! processes' leases on their slots, `...:alive`. Processes waiting for a saturated account
//! take turns in `...:line` (with `...:line:at` and their clocks, `...:line:clocks`). The quota
//! key (or the plane) is a Redis Cluster hash tag, so every key of one account lives in one slot and the
//! scripts run on a cluster. A bucket's TTL is its time to refill: an absent key is a full
//! bucket, so an idle account leaves nothing behind. A record lives for the lease (ten
//! minutes by default) until it is settled, then as a tombstone for 30 s, long enough to
//! recognise a duplicate settlement.
//!
//! # Turns between processes
//!
//! A process refused for want of the account's capacity joins a line kept beside the buckets
//! (a sorted set and a hash under the quota's hash tag), ranked by its request's class, then
//! by when it was first refused, with what its request needs of each bucket. Until the instant
//! the first in line was told to come back (and 5 ms of slack), another process is admitted
//! only if the first would still find its need then; else it is refused and told to come back
//! then. The first comes back without jitter, is admitted and leaves the line. So every
//! process's head gets its turn as the store refills, whoever asks first after a refund; a
//! process that does not come back within twice the timeout and 100 ms past its wait loses
//! its place (its requests ended, or it died). The line costs nothing while the store admits.
//!
//! # Exactness
//!
//! Levels are integers: a unit (a request, a token) is `den` ticks and a millisecond adds `num`
//! ticks, `num / den` being the limit's rate reduced to lowest terms, so refill never drifts.
//! The clock is the Redis server's `TIME`, never a caller's; a clock stepping back (a
//! failover) adds nothing. Settlement is idempotent by reservation id: a duplicate neither
//! refunds nor charges twice, and a settlement arriving after its record expired charges an
//! overrun but refunds nothing. Debt is bounded at one capacity.
//!
//! # Pauses
//!
//! [`Budget::pause`] (a provider's 429) holds the paused windows for every process until the
//! pause's end, by the server's clock: nothing is admitted in them before, the level is kept
//! and keeps refilling, and a refund never shortens the hold. [`Budget::lift_pause`] lifts it
//! for every process; the others notice within a second.
//!
//! # A tenant's controls over every process
//!
//! With a [tenant tree](tower_llm_quota::Budget::with_tenant_tree), each admission's script also checks
//! the request's path against what the tree sets for every process: a paused node refuses;
//! a node's [daily cap](tower_llm_quota::tenant::PeriodCap) is one count per node and day in Redis
//! (calendar UTC by the server's clock, or rolling in quarter hours, as in memory), taken at
//! admission and corrected at settlement, so the fleet together spends the cap, not each
//! process; a node's [cap on calls in flight](tower_llm_quota::tenant::TenantNode::with_max_in_flight)
//! is a set of slots in Redis, one per call, given back when the call settles. A slot counts
//! only while the lease its process held when taking it lasts (renewed by a heartbeat every
//! half second), so the slots of a process that dies come back within the
//! [slot lease](RedisBudget::slot_lease) (5 s by default), and those of a process cut off
//! for longer stay given back when it returns; a request that finds every slot held by live processes waits out of its
//! process's ordering, asking again about every 100 ms, within the node's `max_wait`. With
//! [leases](RedisBudget::leased_shares) admissions do not ask Redis, but a tenant with these
//! controls is still asked of Redis per admission, so they hold over every process (and pauses
//! reach every process within half a second).
//!
//! # When Redis fails
//!
//! Every call has a timeout (50 ms by default), and a circuit breaker stops asking after three
//! failures in a row, letting one probe through every 500 ms. While Redis cannot answer, the
//! [`FailurePolicy`] decides: by default each process admits from a local bucket holding its
//! share of the quota (`1 / expected_instances`), and returns to Redis as soon as a probe
//! succeeds; [`FailurePolicy::FailClosed`] refuses with a typed error instead. Either way no
//! request waits longer than the timeout for Redis, and a deadline set on the request still
//! holds. Replication to a replica is asynchronous: a failover may lose the last writes, at
//! most about one burst per limit.
//!
//! # Redis Cluster
//!
//! [`RedisBudget::cluster`] connects through redis-rs's cluster client, given the addresses of
//! some of the nodes; [`RedisBudget::new`] connects to one server (or a proxy). Every key of one
//! quota shares the hash tag `{<quota key>}`, so every script touches one slot and runs on the
//! primary holding it: accounts spread over the primaries, and each account is one hot slot by
//! design (its admissions are serialised there, which is what makes them exact). `connect`
//! refuses a [prefix](RedisBudget::prefix) whose braces would move keys of one script to
//! different slots; a prefix with its own tag (`{app}`) puts every account in one slot.
//!
//! When a node fails, only the accounts in its slots are affected: their calls fail or time
//! out, so their budgets move to the failure policy (a local share, or refusals) within the
//! timeout, while accounts on the other primaries keep working through Redis (with
//! `cluster-require-full-coverage no` on the servers; with the default `yes` the whole cluster
//! stops answering until the slots are served again). The client reads the slot map again
//! after a lost connection or a `MOVED` reply, so once a replica is promoted or the node is
//! back, the breaker's next probe finds it and the budget returns to Redis; a promoted replica
//! without the scripts loads them on the first `NOSCRIPT`. The writes a failed primary had not
//! yet replicated are lost, as above.

mod connection;
mod idempotency;
mod keys;
mod store;

use std::sync::Arc;
use std::time::Duration;

use tower_llm_quota::budget::store::{FailurePolicy, StoreOptions};
use tower_llm_quota::{Budget, Quota, capped_duration as capped};

use connection::{Servers, Timeouts};
pub use idempotency::RedisIdempotencyStore;
use keys::Keys;
use store::RedisStore;

/// How long a process's slots outlive its last heartbeat, by default.
const DEFAULT_SLOT_LEASE: Duration = Duration::from_secs(5);
/// How often a process reads the pauses the store keeps (and renews its slots), at most: a
/// pause or a resume made through any process holds on every process within it (and a round
/// trip).
const PAUSE_READING: Duration = Duration::from_millis(500);

/// Builds a [`Budget`] kept in Redis; see the [module documentation](self).
#[derive(Debug, Clone)]
pub struct RedisBudget {
    servers: Servers,
    quota_key: String,
    prefix: String,
    plane: Option<String>,
    options: StoreOptions,
    lease: Duration,
    slot_lease: Duration,
}

impl RedisBudget {
    /// A budget in the Redis server at `url`, under `quota_key`: the provider account (or any
    /// name) whose quota every process naming it shares.
    pub fn new(url: impl Into<String>, quota_key: impl Into<String>) -> Self {
        Self::with_servers(Servers::Node(url.into()), quota_key.into())
    }

    /// A budget in a Redis Cluster, under `quota_key`: `nodes` are addresses of some of its
    /// nodes (`redis://host:port`), from which the cluster client learns the others and which
    /// node holds which slot. Every key of one quota shares its hash tag, so each script runs
    /// on the one primary that holds the quota's slot; see
    /// [Redis Cluster](self#redis-cluster).
    ///
    /// ```no_run
    /// # use std::num::NonZeroU64;
    /// # use tower_llm_quota_redis::RedisBudget;
    /// # use tower_llm_quota::{Dimension, Limit, Quota};
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let quota = Quota::new()
    /// #     .with_limit(Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap()));
    /// let budget = RedisBudget::cluster(
    ///     ["redis://10.0.0.5:7000", "redis://10.0.0.6:7000", "redis://10.0.0.7:7000"],
    ///     "openai-org-1",
    /// )
    /// .connect(&quota)
    /// .await?;
    /// # Ok(()) }
    /// ```
    pub fn cluster<N: Into<String>>(
        nodes: impl IntoIterator<Item = N>,
        quota_key: impl Into<String>,
    ) -> Self {
        let nodes = nodes.into_iter().map(Into::into).collect();
        Self::with_servers(Servers::Cluster(nodes), quota_key.into())
    }

    fn with_servers(servers: Servers, quota_key: String) -> Self {
        Self {
            servers,
            quota_key,
            prefix: "llmq".to_owned(),
            plane: None,
            options: StoreOptions::new(),
            lease: Duration::from_secs(600),
            slot_lease: DEFAULT_SLOT_LEASE,
        }
    }

    /// The prefix of every key (default `llmq`). On a cluster, braces in it must not make an
    /// empty hash tag (`{}`), which would hash each key whole: [`RedisBudget::connect`]
    /// refuses it. A prefix with a tag of its own (`{app}`) puts every account in one slot.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Puts this account in the tenant plane `plane`: the accounts of one plane keep their
    /// tenant nodes' buckets together, so a node's limits hold over every account a tenant
    /// uses, across processes (a tenant of 20 requests a minute gets 20 in all, not 20 on each
    /// account); nodes scoped to one account ([`TenantNode::for_account`]) still hold on it
    /// alone. Every key of the plane's accounts shares the hash tag `{<plane>}`: on a Redis
    /// Cluster they live in one slot, on one primary. By default an account is a plane of
    /// its own. Pair it with [`Budget::with_tenants_of`] between the budgets of one process,
    /// so that calls in flight, daily caps and pauses also hold over the accounts there.
    ///
    /// [`TenantNode::for_account`]: tower_llm_quota::tenant::TenantNode::for_account
    pub fn tenant_plane(mut self, plane: impl Into<String>) -> Self {
        self.plane = Some(plane.into());
        self
    }

    /// The longest an admission waits for Redis before the failure policy applies (default
    /// 50 ms). Also bounds each background settlement.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.options = self.options.timeout(timeout);
        self
    }

    /// The most admission questions this process has on their way to Redis at once while
    /// Redis admits them (default 8); while Redis refuses, one at a time, the head's. With
    /// more than one, a later, smaller request may be admitted while an earlier, larger one
    /// asked just before it finds its cost missing (at most this many of them, and only as
    /// capacity runs out); with 1, the store admits exactly in the ordering's order, at one
    /// round trip per admission. Clamped to at least 1.
    pub fn questions_in_flight(mut self, questions: usize) -> Self {
        self.options = self.options.questions_in_flight(questions);
        self
    }

    /// What to do when Redis does not answer (default: a local fallback holding half of the
    /// quota; see [`RedisBudget::expected_instances`]).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.options = self.options.failure_policy(policy);
        self
    }

    /// How many processes are expected to share the quota: while Redis is out of reach, each
    /// falls back to `1 / n` of it, `n` the live processes Redis last counted, and
    /// `1 / instances` before it has ([`FailurePolicy::live_share`]), so together they stay
    /// within it.
    pub fn expected_instances(self, instances: u32) -> Self {
        self.failure_policy(FailurePolicy::live_share(instances))
    }

    /// How long a reservation's record lives (default 10 minutes): longer than the longest
    /// call. A settlement after it refunds nothing.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = capped(lease);
        self
    }

    /// Admits from leases taken from the account, renewed every `refresh`, instead of asking
    /// Redis per admission: one script call per process per refresh (and sooner when requests
    /// wait for units), whatever the rate of admissions, which then run at in-memory speed.
    ///
    /// A grant is a debit: units leave the account's bucket when they are granted, and a
    /// process admits only units it holds. What it holds counts in the bucket until it reports
    /// them spent or gives them back, or its lease (three refreshes) ends; the bucket refills
    /// only to its capacity less that. Over every window the fleet admits at most the
    /// account's burst plus its rate over the window (plus the real usage beyond estimates
    /// that processes report, charged to the bucket). Every failure errs toward less: a
    /// process that dies, stalls past its lease or loses a renewal's reply takes what it held
    /// with it until the bucket refills it; a renewal reaching Redis after a later one changes
    /// nothing; a process whose renewal is late admits nothing past its lease's end, and one
    /// whose renewals fail then follows the [failure policy](RedisBudget::failure_policy)
    /// (its local share, outside the fleet's bound, or with [`FailurePolicy::FailClosed`]
    /// refusals). A Redis restarted without its data forgets the leases: the bound then holds
    /// only with persistence (`appendfsync always`).
    ///
    /// Redis divides the account's rate between the processes by what each wants (all of it
    /// while requests wait) and by the weights and guarantees of the tenants waiting in each,
    /// in whole units and in turn, so that parts below a unit still reach every process. The
    /// first waiting request's cost is asked for whole: a request larger than what its process
    /// holds waits for a grant that covers it. A tenant with limits, daily caps or caps on calls
    /// in flight is asked of Redis per admission even here, so they hold over the fleet; pauses
    /// reach every process within half a second.
    ///
    /// What it costs: a process whose demand grows waits up to a refresh (and a round trip)
    /// for more; what a process was granted counts as held until its next report, so the
    /// bucket refills less meanwhile: keep `refresh` well below the time the burst takes to
    /// refill (a third of it or less). Processes may differ in `refresh` (each lease ends by
    /// its own), and processes asking per admission may share the account with leasing ones
    /// (the bucket they take from leaves what leases hold). A `refresh` of zero counts as one
    /// millisecond.
    ///
    /// ```no_run
    /// # use std::num::NonZeroU64;
    /// # use std::time::Duration;
    /// # use tower_llm_quota_redis::RedisBudget;
    /// # use tower_llm_quota::{Dimension, Limit, Quota};
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let quota = Quota::new()
    /// #     .with_limit(Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap()));
    /// let budget = RedisBudget::new("redis://127.0.0.1/", "openai-org-1")
    ///     .leased_shares(Duration::from_millis(100))
    ///     .connect(&quota)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn leased_shares(mut self, refresh: Duration) -> Self {
        self.options = self.options.leased_shares(refresh);
        self
    }

    /// How long a process's slots on tenant nodes' caps on calls in flight outlive its last
    /// heartbeat (default 5 s). Such a cap holds for every process: each call in flight
    /// holds a slot in Redis, given back when it settles, and counted only while its process
    /// renews its lease on its slots (every half second, or every third of `lease` if
    /// shorter):
    /// the slots of a process that dies come back within `lease`. A process cut off from
    /// Redis for longer loses its slots too, so its calls then in flight stop counting. A
    /// `lease` of zero counts as 3 ms.
    pub fn slot_lease(mut self, lease: Duration) -> Self {
        self.slot_lease = capped(lease).max(Duration::from_millis(3));
        self
    }

    /// The circuit breaker: it opens after `failures` failures in a row, and lets one probe
    /// through every `open_for` (defaults 3 and 500 ms).
    pub fn breaker(mut self, failures: u32, open_for: Duration) -> Self {
        self.options = self.options.breaker(failures, open_for);
        self
    }

    /// Connects and loads the scripts, then returns the budget, named after the quota key
    /// unless the quota has a name ([`Quota::with_name`]). Must be called within a tokio
    /// runtime.
    ///
    /// # Errors
    ///
    /// Fails on an invalid URL, on a cluster without nodes, and on a cluster when braces in
    /// the [prefix](RedisBudget::prefix) would put keys of one script in different slots (all
    /// [`ErrorKind::InvalidClientConfig`](::redis::ErrorKind::InvalidClientConfig)). When
    /// Redis does not answer, fails only under [`FailurePolicy::FailClosed`]: with a local
    /// fallback the budget starts on it and moves to Redis when Redis answers.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves nothing behind: the connection made so
    /// far is closed, and no budget or background task exists until it returns.
    pub async fn connect(self, quota: &Quota) -> Result<Budget, ::redis::RedisError> {
        let keys = match &self.plane {
            Some(plane) => Keys::in_plane(&self.prefix, plane, &self.quota_key),
            None => Keys::new(&self.prefix, &self.quota_key),
        };
        if self.servers.is_cluster() {
            connection::same_slot(script_keys(&keys, quota).iter().map(String::as_str))?;
        }
        let connection = self.servers.connect_lazy(Timeouts {
            connect: self.options.get_timeout().max(Duration::from_millis(100)),
            response: self.options.get_timeout(),
            max_delay: Duration::from_millis(100),
        })?;
        let leases = (self.lease, self.slot_lease);
        let store = RedisStore::new(connection, keys, leases, self.options.get_timeout());
        let reachable = self.reach(&store).await?;
        let options = self
            .options
            .heartbeat((self.slot_lease / 3).min(PAUSE_READING))
            .reachable(reachable);
        // Named after its quota key unless the quota has a name (the depth gauge's label).
        let named;
        let quota = match quota.name() {
            Some(_) => quota,
            None => {
                named = quota.clone().with_name(self.quota_key.as_str());
                &named
            }
        };
        Ok(Budget::with_store(quota, Arc::new(store), options))
    }

    /// Whether Redis answers (the scripts load) within the timeout, or at least 500 ms: an
    /// error under [`FailurePolicy::FailClosed`], else `false` and a warning (the budget
    /// starts on its local fallback).
    async fn reach(&self, store: &RedisStore) -> Result<bool, ::redis::RedisError> {
        let answer = tokio::time::timeout(
            self.options.get_timeout().max(Duration::from_millis(500)),
            store.load(),
        );
        match answer.await {
            Ok(Ok(())) => Ok(true),
            Ok(Err(error)) if self.options.get_failure_policy() == FailurePolicy::FailClosed => {
                Err(error)
            }
            Err(_) if self.options.get_failure_policy() == FailurePolicy::FailClosed => {
                Err(::redis::RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "Redis did not answer",
                )))
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "Redis is out of reach: starting on the local fallback");
                Ok(false)
            }
            Err(_) => {
                tracing::warn!("Redis did not answer: starting on the local fallback");
                Ok(false)
            }
        }
    }
}

/// Every key a script of `quota` may touch: each limit's bucket and hold, a record, the line
/// of processes, and a tenant node's bucket (which must all be in one slot on a cluster).
fn script_keys(keys: &Keys, quota: &Quota) -> Vec<String> {
    let limits = quota.limits();
    let node = tower_llm_quota::tenant::Tenant::parse("node").expect("a valid path");
    std::iter::once(keys.record("0"))
        .chain(limits.iter().map(|l| keys.bucket(l)))
        .chain(limits.iter().map(|l| keys.hold(l)))
        .chain([
            keys.line(),
            keys.line_details(),
            keys.clocks(),
            keys.shares(),
        ])
        .chain(limits.first().map(|l| keys.node_bucket(&node, l)))
        .collect()
}

// The README's example compiles as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
