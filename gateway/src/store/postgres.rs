//! The Postgres state: a pool of connections whose search path is the schema `llm_gateway`
//! (the gateway's tables), beside the quota store's schema `llm_quota`.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;
use tokio_postgres::types::{ToSql, Type};

use super::{DatabaseError, MIGRATIONS, Row, Statement, Value, newer_refused};
use crate::config::ConfigError;

/// A pool of connections to the gateway's schema; clones share it.
#[derive(Clone)]
pub(crate) struct Postgres {
    pool: Pool,
    address: Arc<str>,
}

impl std::fmt::Debug for Postgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postgres")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

/// How long a statement may run on the server.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

impl Postgres {
    /// Connects to `url`, migrates the quota store's schema and the gateway's: an error
    /// naming the database (its password hidden) when it cannot be reached, refuses the
    /// migration, or has a schema newer than this gateway's.
    pub(crate) async fn open(url: &str) -> Result<Self, ConfigError> {
        let address: Arc<str> = tower_llm_quota_postgres::redacted(url).into();
        let error = |message: String| ConfigError(format!("state {address}: {message}"));
        tower_llm_quota_postgres::migrate(url)
            .await
            .map_err(|e| ConfigError(format!("state: {e}")))?;
        let mut config: tokio_postgres::Config = url.parse().map_err(|e| error(format!("{e}")))?;
        config
            .connect_timeout(Duration::from_secs(5))
            .options(format!(
                "-c search_path=llm_gateway -c statement_timeout={}",
                STATEMENT_TIMEOUT.as_millis()
            ))
            .application_name("llm-quota-gateway");
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(8)
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(Duration::from_secs(5)))
            .wait_timeout(Some(Duration::from_secs(5)))
            .build()
            .map_err(|e| error(e.to_string()))?;
        let postgres = Self { pool, address };
        postgres.migrate().await?;
        Ok(postgres)
    }

    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    /// Brings the schema `llm_gateway` to this gateway's version, each step in a transaction
    /// under an advisory lock (replicas starting together take turns).
    async fn migrate(&self) -> Result<(), ConfigError> {
        let error = |e: &dyn std::fmt::Display| ConfigError(format!("state {}: {e}", self.address));
        let mut client = self.pool.get().await.map_err(|e| error(&e))?;
        loop {
            let transaction = client.transaction().await.map_err(|e| error(&e))?;
            transaction
                .batch_execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended('llm_gateway:migrations', 0));
                     CREATE SCHEMA IF NOT EXISTS llm_gateway;
                     CREATE TABLE IF NOT EXISTS llm_gateway.schema_migrations (
                         version bigint PRIMARY KEY,
                         applied_at timestamptz NOT NULL DEFAULT now());",
                )
                .await
                .map_err(|e| error(&described(&e)))?;
            let version: i64 = transaction
                .query_one(
                    "SELECT coalesce(max(version), 0) FROM llm_gateway.schema_migrations",
                    &[],
                )
                .await
                .map_err(|e| error(&described(&e)))?
                .get(0);
            newer_refused(&self.address, version)?;
            let Some(&(step, _, sql)) = MIGRATIONS.iter().find(|(v, ..)| *v > version) else {
                transaction.commit().await.map_err(|e| error(&e))?;
                return Ok(());
            };
            transaction.batch_execute(sql).await.map_err(|e| {
                error(&format!(
                    "the migration to version {step} was refused: {}",
                    described(&e)
                ))
            })?;
            transaction
                .execute(
                    "INSERT INTO llm_gateway.schema_migrations (version) VALUES ($1)",
                    &[&step],
                )
                .await
                .map_err(|e| error(&described(&e)))?;
            transaction.commit().await.map_err(|e| error(&e))?;
            tracing::info!(version = step, "gateway state migrated");
        }
    }

    /// Runs `statements` in one transaction: the rows each answered.
    pub(crate) async fn transaction(
        &self,
        statements: Vec<Statement>,
    ) -> Result<Vec<Vec<Row>>, DatabaseError> {
        let failed =
            |e: &dyn std::fmt::Display| DatabaseError(format!("{}: {e}", self.address).into());
        let mut client = self.pool.get().await.map_err(|e| failed(&e))?;
        let transaction = client
            .transaction()
            .await
            .map_err(|e| failed(&described(&e)))?;
        let mut answers = Vec::with_capacity(statements.len());
        for statement in &statements {
            let prepared = transaction
                .prepare_cached(statement.sql)
                .await
                .map_err(|e| failed(&described(&e)))?;
            let params: Vec<Box<dyn ToSql + Sync + Send>> = statement
                .params
                .iter()
                .zip(prepared.params())
                .map(|(value, kind)| to_sql(value, kind))
                .collect();
            let refs: Vec<&(dyn ToSql + Sync)> = params
                .iter()
                .map(|p| p.as_ref() as &(dyn ToSql + Sync))
                .collect();
            let rows = transaction
                .query(&prepared, &refs)
                .await
                .map_err(|e| failed(&described(&e)))?;
            answers.push(rows.iter().map(row).collect());
        }
        transaction
            .commit()
            .await
            .map_err(|e| failed(&described(&e)))?;
        Ok(answers)
    }
}

/// A parameter as the statement's type for it wants it.
fn to_sql(value: &Value, kind: &Type) -> Box<dyn ToSql + Sync + Send> {
    match (value, kind) {
        (Value::Int(n), &Type::INT4) => Box::new(i32::try_from(*n).unwrap_or(i32::MAX)),
        (Value::Int(n), &Type::TEXT) => Box::new(n.to_string()),
        (Value::Int(n), _) => Box::new(*n),
        (Value::Text(text), _) => Box::new(text.clone()),
        (Value::Bytes(bytes), _) => Box::new(bytes.clone()),
        (Value::Null, &Type::BYTEA) => Box::new(None::<Vec<u8>>),
        (Value::Null, &Type::TEXT) => Box::new(None::<String>),
        (Value::Null, _) => Box::new(None::<i64>),
    }
}

fn row(row: &tokio_postgres::Row) -> Row {
    (0..row.len())
        .map(|i| match *row.columns()[i].type_() {
            Type::INT8 => row
                .try_get::<_, Option<i64>>(i)
                .ok()
                .flatten()
                .map_or(Value::Null, Value::Int),
            Type::INT4 => row
                .try_get::<_, Option<i32>>(i)
                .ok()
                .flatten()
                .map_or(Value::Null, |n| Value::Int(i64::from(n))),
            Type::BOOL => row
                .try_get::<_, Option<bool>>(i)
                .ok()
                .flatten()
                .map_or(Value::Null, |b| Value::Int(i64::from(b))),
            Type::BYTEA => row
                .try_get::<_, Option<Vec<u8>>>(i)
                .ok()
                .flatten()
                .map_or(Value::Null, Value::Bytes),
            _ => row
                .try_get::<_, Option<String>>(i)
                .ok()
                .flatten()
                .map_or(Value::Null, Value::Text),
        })
        .collect()
}

/// A Postgres error with what the server said.
fn described(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => error.to_string(),
    }
}
