//! The schema, versioned: the migrations shipped with the crate, applied in order by
//! [`migrate`], each in a transaction of its own.
//!
//! The applied versions are kept in `llm_quota.schema_migrations`. Processes migrating at once
//! take turns on an advisory lock, so each migration runs once. A database whose schema is
//! newer than the crate's (a newer version of the crate migrated it) is refused: an older
//! binary would call functions whose meaning changed.

use crate::connection::{Database, Failure, Params, reach};
use crate::error::Error;

/// The migrations, in order: a version and its SQL.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "quota", include_str!("../migrations/0001_quota.sql")),
    (
        2,
        "idempotency",
        include_str!("../migrations/0002_idempotency.sql"),
    ),
    (
        3,
        "live_count",
        include_str!("../migrations/0003_live_count.sql"),
    ),
    (
        4,
        "fair_division",
        include_str!("../migrations/0004_fair_division.sql"),
    ),
    (
        5,
        "turn_clocks",
        include_str!("../migrations/0005_turn_clocks.sql"),
    ),
    (
        6,
        "turns_kept",
        include_str!("../migrations/0006_turns_kept.sql"),
    ),
];

/// The schema version this crate needs: its last migration.
pub const SCHEMA_VERSION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].0;

const LOCK: &str = "SELECT pg_advisory_xact_lock(hashtextextended('llm_quota:migrations', 0))";

const VERSION: &str = "SELECT coalesce(max(version), 0) FROM llm_quota.schema_migrations";

/// Brings the database at `url` to the crate's schema: creates the schema `llm_quota` and
/// applies every migration it lacks, each in one transaction (nothing half applied). Safe to
/// call from every process at start: they take turns, and a migration runs once. Returns the
/// version the database now has.
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), tower_llm_quota_postgres::Error> {
/// tower_llm_quota_postgres::migrate("postgres://app@db.internal/quota").await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// An invalid address; a database out of reach (the error names its address, the password
/// hidden); a schema newer than this crate's; a migration the database refused (a read-only
/// or full database: the transaction is rolled back).
///
/// # Cancel safety
///
/// Dropping the future rolls back the migration in progress; those committed stay.
pub async fn migrate(url: &str) -> Result<i32, Error> {
    let database = Database::connect_lazy(&reach(url, 1, std::time::Duration::from_secs(60)))?;
    apply(&database).await
}

/// Applies the missing migrations through `database`.
pub(crate) async fn apply(database: &Database) -> Result<i32, Error> {
    let unreachable = |failure: Failure| Error::unreachable(database.address(), failure);
    let mut client = database.client().await.map_err(unreachable)?;
    let refused =
        |e: tokio_postgres::Error| Error::migration(database.address(), Failure::Postgres(e));
    loop {
        let transaction = client.transaction().await.map_err(refused)?;
        transaction.execute(LOCK, &[]).await.map_err(refused)?;
        // Under the lock: two processes creating the schema at once would collide.
        transaction
            .batch_execute(
                "CREATE SCHEMA IF NOT EXISTS llm_quota;
                 CREATE TABLE IF NOT EXISTS llm_quota.schema_migrations (
                     version integer PRIMARY KEY,
                     name text NOT NULL,
                     applied_at timestamptz NOT NULL DEFAULT now()
                 );",
            )
            .await
            .map_err(refused)?;
        let current: i32 = transaction
            .query_one(VERSION, &[])
            .await
            .map_err(refused)?
            .get(0);
        newer_refused(database.address(), current)?;
        let Some(&(version, name, sql)) = MIGRATIONS.iter().find(|(v, ..)| *v > current) else {
            transaction.commit().await.map_err(refused)?;
            return Ok(current);
        };
        // The schema exists already (created above): the first migration's
        // `CREATE SCHEMA IF NOT EXISTS` is harmless.
        transaction.batch_execute(sql).await.map_err(refused)?;
        transaction
            .execute(
                "INSERT INTO llm_quota.schema_migrations (version, name) VALUES ($1, $2)",
                &[&version, &name],
            )
            .await
            .map_err(refused)?;
        transaction.commit().await.map_err(refused)?;
        tracing::info!(version, name, "llm_quota schema migrated");
    }
}

/// The database's schema version: 0 before any migration.
pub(crate) async fn version(database: &Database) -> Result<i32, Failure> {
    let exists: bool = database
        .value(
            "SELECT to_regclass('llm_quota.schema_migrations') IS NOT NULL",
            &Params::new(),
        )
        .await?;
    if !exists {
        return Ok(0);
    }
    database.value(VERSION, &Params::new()).await
}

/// Checks that `database` has the crate's schema: a clear error when it is older (migrate
/// first) or newer (a newer crate migrated it).
pub(crate) async fn check(database: &Database) -> Result<(), Error> {
    let current = version(database)
        .await
        .map_err(|failure| Error::unreachable(database.address(), failure))?;
    newer_refused(database.address(), current)?;
    if current < SCHEMA_VERSION {
        return Err(Error::schema(
            database.address(),
            format_args!(
                "the schema is at version {current} and this crate needs {SCHEMA_VERSION}: \
                 apply the migrations first (tower_llm_quota_postgres::migrate)"
            ),
        ));
    }
    Ok(())
}

fn newer_refused(address: &str, current: i32) -> Result<(), Error> {
    if current > SCHEMA_VERSION {
        return Err(Error::schema(
            address,
            format_args!(
                "the schema is at version {current}, newer than this crate's {SCHEMA_VERSION}: \
                 a newer version of tower-llm-quota-postgres migrated it; upgrade this one"
            ),
        ));
    }
    Ok(())
}
