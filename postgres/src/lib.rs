//! One quota shared by several processes, kept in PostgreSQL: the Postgres store of
//! [tower-llm-quota](tower_llm_quota), its schema migrations, and its idempotency records.
//!
//! [`PostgresBudget`] builds a [`Budget`] whose buckets live in a Postgres database: the same
//! handle, layers and API as an in-memory budget or one kept in Redis, for every instance of a
//! service that spends one provider account. Each admission is **one statement**: a function
//! refills and checks every dimension of the request with the database's clock and takes the
//! cost from all of them or from none, in the statement's own transaction. With
//! [leased shares](PostgresBudget::leased_shares) the database sees renewals, not admissions.
//!
//! ```no_run
//! use std::num::NonZeroU64;
//! use tower_llm_quota::{Cost, Dimension, Limit, Quota, Usage};
//! use tower_llm_quota_postgres::PostgresBudget;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let nz = |n| NonZeroU64::new(n).unwrap();
//! let quota = Quota::new()
//!     .with_limit(Limit::per_minute(Dimension::Requests, nz(500)))
//!     .with_limit(Limit::per_minute(Dimension::TotalTokens, nz(30_000)));
//! let url = "postgres://app@db.internal/quota";
//! // Once per deployment (every process may call it at start: they take turns).
//! tower_llm_quota_postgres::migrate(url).await?;
//! // Every process naming the same account shares its quota.
//! let budget = PostgresBudget::new(url, "openai-org-1")
//!     .expected_instances(4)
//!     .connect(&quota)
//!     .await?;
//! let mut reservation = budget.reserve(Cost::new(1_200, 200)).await?;
//! reservation.mark_sent();
//! reservation.settle(&Usage::new(1_200, 50)); // the refund is written in the background
//! # Ok(()) }
//! ```
//!
//! # The schema
//!
//! Everything lives in the schema `llm_quota`, created and brought up to date by [`migrate`]
//! (each migration one transaction; a schema newer than the crate's is refused). Many accounts
//! and budgets share one database: every row is named after its account (and the
//! [prefix](PostgresBudget::prefix)), and the names reach SQL only as parameters. The tables
//! are plain (logged) tables: an `UNLOGGED` table is emptied by crash recovery, and a bucket
//! that comes back full after a crash admits twice; keep `synchronous_commit` on for the same
//! reason (a commit the server forgets after a crash under-counts).
//!
//! # Atomicity and the clock
//!
//! Each operation is one call of a PL/pgSQL function, in the statement's own transaction. It
//! first takes the transaction-level advisory lock of the account (or of its
//! [tenant plane](PostgresBudget::tenant_plane)), so the calls on one account run one after
//! another, as a Redis script runs on its slot: no lost update, no deadlock (one lock per
//! transaction, released at commit), nothing held past the statement. Then it reads the
//! database's clock with `clock_timestamp()` (never `now()`, the transaction's start, and
//! never a caller's clock). Behind a transaction-pooling pgbouncer, transaction-level locks
//! work; the statements are prepared by name once per connection, which needs pgbouncer 1.21
//! or later (`max_prepared_statements`).
//!
//! # Exactness, turns, pauses, a tenant's controls
//!
//! As for the Redis store (`tower-llm-quota-redis`), whose scripts these functions follow
//! step for step: levels are integers (a unit is `den` ticks, a millisecond adds `num`,
//! [`Account::of`](tower_llm_quota::budget::store::fleet::Account::of)); a settlement is
//! idempotent by reservation id and a late one refunds nothing; processes refused for the
//! account's capacity take turns by class and arrival; a provider's pause holds every process
//! until its end; a tenant node's paused state, caps over a calendar day or month (UTC) or a
//! rolling day, and cap on calls in flight hold over every process, the slots of a process
//! that dies coming back within the [slot lease](PostgresBudget::slot_lease).
//!
//! # When Postgres fails
//!
//! Every call is bounded by a timeout (200 ms by default: a commit waits for the write-ahead
//! log to reach the disk) and a circuit breaker; while the database cannot answer, the
//! [`FailurePolicy`] decides (a local share of the quota, or refusals). A statement the caller
//! gave up on may still commit ("maybe done"): every reservation, settlement and renewal
//! carries an id, so its retry changes nothing, and until it is settled it counts as spent.
//! The server cancels a statement after the [statement timeout](PostgresBudget::statement_timeout).

mod connection;
mod error;
mod idempotency;
mod keys;
mod migrate;
mod store;

use std::sync::Arc;
use std::time::Duration;

use tower_llm_quota::budget::store::{FailurePolicy, StoreOptions};
use tower_llm_quota::{Budget, Quota};

pub use connection::redacted;
use connection::{Database, reach};
pub use error::Error;
pub use idempotency::PostgresIdempotencyStore;
use keys::Keys;
pub use migrate::{SCHEMA_VERSION, migrate};
use store::PostgresStore;
use tower_llm_quota::capped_duration as capped;

/// How long a process's slots outlive its last heartbeat, by default.
const DEFAULT_SLOT_LEASE: Duration = Duration::from_secs(5);
/// How often a process reads the pauses the store keeps (and renews its slots), at most.
const PAUSE_READING: Duration = Duration::from_millis(500);
/// The timeout by default: a commit waits for the log to reach the disk.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(200);

/// Builds a [`Budget`] kept in Postgres; see the [crate documentation](crate).
#[derive(Debug, Clone)]
pub struct PostgresBudget {
    url: String,
    quota_key: String,
    prefix: String,
    plane: Option<String>,
    options: StoreOptions,
    lease: Duration,
    slot_lease: Duration,
    connections: usize,
    statement_timeout: Duration,
}

impl PostgresBudget {
    /// A budget in the database at `url` (`postgres://user:password@host:port/database`, or
    /// `host=... dbname=...`), under `quota_key`: the provider account (or any name) whose
    /// quota every process naming it shares.
    pub fn new(url: impl Into<String>, quota_key: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            quota_key: quota_key.into(),
            prefix: "llmq".to_owned(),
            plane: None,
            options: StoreOptions::new().timeout(DEFAULT_TIMEOUT),
            lease: Duration::from_secs(600),
            slot_lease: DEFAULT_SLOT_LEASE,
            connections: 8,
            statement_timeout: Duration::from_secs(5),
        }
    }

    /// The prefix of every row's name (default `llmq`): deployments with different prefixes
    /// share nothing in one database.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Puts this account in the tenant plane `plane`: the accounts of one plane keep their
    /// tenant nodes' buckets together, so a node's limits hold over every account a tenant
    /// uses, across processes. Every call on the plane's accounts takes the plane's lock.
    pub fn tenant_plane(mut self, plane: impl Into<String>) -> Self {
        self.plane = Some(plane.into());
        self
    }

    /// The longest an admission waits for Postgres before the failure policy applies (default
    /// 200 ms). Also bounds each background settlement.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.options = self.options.timeout(timeout);
        self
    }

    /// The longest a statement runs on the server before the server cancels it (default 5 s):
    /// what a caller that gave up leaves running is bounded by it.
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = capped(timeout).max(Duration::from_millis(1));
        self
    }

    /// The most connections this budget opens at once (default 8).
    pub fn connections(mut self, connections: usize) -> Self {
        self.connections = connections.max(1);
        self
    }

    /// The most admission questions this process has on their way to Postgres at once while
    /// it admits them (default 8); see
    /// [`StoreOptions::questions_in_flight`](tower_llm_quota::budget::store::StoreOptions::questions_in_flight).
    pub fn questions_in_flight(mut self, questions: usize) -> Self {
        self.options = self.options.questions_in_flight(questions);
        self
    }

    /// What to do when Postgres does not answer (default: a local fallback holding half of
    /// the quota; see [`PostgresBudget::expected_instances`]).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.options = self.options.failure_policy(policy);
        self
    }

    /// How many processes are expected to share the quota: while Postgres is out of reach, each
    /// falls back to `1 / n` of it, `n` the live processes Postgres last counted, and
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
    /// Postgres per admission: one statement per process per refresh (and sooner when
    /// requests wait for units), whatever the rate of admissions. The guarantees are those of
    /// the Redis store's leases: a grant is a debit, taken from the account's bucket when
    /// granted; a process that dies, stalls past its lease (three refreshes) or loses a
    /// renewal's reply takes what it held with it until the bucket refills it, never granted
    /// twice; renewals are numbered, so a late one changes nothing; a process leaving gives
    /// back what it holds; real usage beyond the estimates is charged at the next renewal. A
    /// tenant with limits, caps or caps on calls in flight is asked of Postgres per admission,
    /// so they hold over the fleet.
    pub fn leased_shares(mut self, refresh: Duration) -> Self {
        self.options = self.options.leased_shares(refresh);
        self
    }

    /// How long a process's slots on tenant nodes' caps on calls in flight outlive its last
    /// heartbeat (default 5 s); a `lease` of zero counts as 3 ms.
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

    /// Connects, checks the schema, and returns the budget, named after the quota key unless
    /// the quota has a name ([`Quota::with_name`]). Must be called within a tokio runtime.
    ///
    /// # Errors
    ///
    /// An invalid address. A schema older than the crate's ([`migrate`] first) or newer. A
    /// database out of reach only under [`FailurePolicy::FailClosed`]: with a local fallback
    /// the budget starts on it and moves to Postgres when Postgres answers. Every error names
    /// the database's address, its password hidden.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves nothing behind: no budget or background
    /// task exists until it returns.
    pub async fn connect(self, quota: &Quota) -> Result<Budget, Error> {
        let keys = match &self.plane {
            Some(plane) => Keys::in_plane(&self.prefix, plane, &self.quota_key),
            None => Keys::new(&self.prefix, &self.quota_key),
        };
        let mut reach = reach(&self.url, self.connections, self.options.get_timeout());
        reach.statement_timeout = self.statement_timeout;
        let database = Database::connect_lazy(&reach)?;
        let reachable = self.reach(&database).await?;
        let leases = (self.lease, self.slot_lease);
        let store = PostgresStore::new(database, keys, leases, self.options.get_timeout());
        let options = self
            .options
            .heartbeat((self.slot_lease / 3).min(PAUSE_READING))
            .reachable(reachable);
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

    /// Whether Postgres answers with the crate's schema within the timeout (or at least a
    /// second): a wrong schema is an error; an unreachable database an error under
    /// [`FailurePolicy::FailClosed`], else `false` and a warning.
    async fn reach(&self, database: &Database) -> Result<bool, Error> {
        let wait = self.options.get_timeout().max(Duration::from_secs(1));
        let fail_closed = self.options.get_failure_policy() == FailurePolicy::FailClosed;
        match tokio::time::timeout(wait, migrate::check(database)).await {
            Ok(Ok(())) => Ok(true),
            Ok(Err(error)) if fail_closed || !error.is_unreachable() => Err(error),
            Err(_) if fail_closed => Err(Error::unreachable(
                database.address(),
                format_args!("no answer within {wait:?}"),
            )),
            Ok(Err(error)) => {
                tracing::warn!(%error, "Postgres is out of reach: starting on the local fallback");
                Ok(false)
            }
            Err(_) => {
                tracing::warn!(
                    address = database.address(),
                    "Postgres did not answer: starting on the local fallback"
                );
                Ok(false)
            }
        }
    }
}

// The README's example compiles as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
