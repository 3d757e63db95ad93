//! The connection to Postgres: a pool of tokio-postgres clients, each statement prepared once
//! per connection, and the database's address with its password hidden.
//!
//! Why this driver: a tokio-postgres client pipelines the statements it is given, and a
//! statement dropped before its answer (a caller's timeout) leaves the connection usable (its
//! answer is read and thrown away), so a timeout never poisons a connection nor costs a round
//! trip to test it. deadpool-postgres recycles a client by checking that it is still open,
//! without a query. Both are small and keep to the crate's minimum Rust version.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;
use tokio_postgres::types::{FromSqlOwned, ToSql};
use tower_llm_quota::budget::StoreUnavailable;

use crate::error::Error;

/// One statement's parameters, owned so that the call's future owns them.
pub(crate) type Params = Vec<Box<dyn ToSql + Send + Sync>>;

/// A pool of connections to one database; clones share it.
#[derive(Clone)]
pub(crate) struct Database {
    pool: Pool,
    address: Arc<str>,
}

impl fmt::Debug for Database {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Database")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

/// How a database is reached: its address, and the bounds on its connections and statements.
#[derive(Debug, Clone)]
pub(crate) struct Reach {
    pub(crate) url: String,
    /// The most connections open at once.
    pub(crate) connections: usize,
    /// The longest wait for a connection to be made.
    pub(crate) connect_timeout: Duration,
    /// The longest a statement runs on the server before it is cancelled there (what a caller
    /// that gave up leaves running is bounded by it).
    pub(crate) statement_timeout: Duration,
}

impl Database {
    /// A pool of connections made when first needed: an unreachable database is an error of
    /// each statement, not of this call. Fails on an invalid address.
    pub(crate) fn connect_lazy(reach: &Reach) -> Result<Self, Error> {
        let address: Arc<str> = redacted(&reach.url).into();
        let mut config: tokio_postgres::Config = reach
            .url
            .parse()
            .map_err(|e| Error::config(&address, format_args!("{e}")))?;
        let statement_ms = reach.statement_timeout.as_millis().max(1);
        config
            .connect_timeout(reach.connect_timeout)
            .options(format!("-c statement_timeout={statement_ms}"));
        if config.get_application_name().is_none() {
            config.application_name("tower-llm-quota");
        }
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(reach.connections.max(1))
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(reach.connect_timeout))
            .wait_timeout(Some(reach.connect_timeout))
            .build()
            .map_err(|e| Error::config(&address, format_args!("{e}")))?;
        Ok(Self { pool, address })
    }

    /// The database's address, its password hidden.
    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    /// Runs `sql` (prepared once per connection) with `params`: its rows.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the statement running on the server (bounded by the
    /// statement timeout), its answer discarded; the connection stays usable.
    pub(crate) async fn query(
        &self,
        sql: &str,
        params: &Params,
    ) -> Result<Vec<tokio_postgres::Row>, Failure> {
        let client = self.pool.get().await.map_err(Failure::Pool)?;
        let statement = client
            .prepare_cached(sql)
            .await
            .map_err(Failure::Postgres)?;
        let refs: Vec<&(dyn ToSql + Sync)> = params
            .iter()
            .map(|p| p.as_ref() as &(dyn ToSql + Sync))
            .collect();
        client
            .query(&statement, &refs)
            .await
            .map_err(Failure::Postgres)
    }

    /// Runs `sql` with `params`: the first column of its one row.
    pub(crate) async fn value<T: FromSqlOwned>(
        &self,
        sql: &str,
        params: &Params,
    ) -> Result<T, Failure> {
        let rows = self.query(sql, params).await?;
        let row = rows.first().ok_or(Failure::NoRow)?;
        row.try_get(0).map_err(Failure::Postgres)
    }

    /// A connection of the pool, for statements that run in a transaction of their own.
    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object, Failure> {
        self.pool.get().await.map_err(Failure::Pool)
    }
}

/// Why a statement failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// No connection could be had: the database is out of reach, or the pool's wait ended.
    Pool(deadpool_postgres::PoolError),
    /// The statement failed: a connection lost, or an error the server answered.
    Postgres(tokio_postgres::Error),
    /// The statement answered no row.
    NoRow,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Pool(deadpool_postgres::PoolError::Backend(error))
            | Failure::Postgres(error) => {
                if let Some(db) = error.as_db_error() {
                    return write!(f, "{}: {}", db.code().code(), db.message());
                }
                // The cause too: "error connecting to server: Connection refused".
                write!(f, "{error}")?;
                let mut source = std::error::Error::source(error);
                while let Some(cause) = source {
                    write!(f, ": {cause}")?;
                    source = cause.source();
                }
                Ok(())
            }
            Failure::Pool(error) => write!(f, "{error}"),
            Failure::NoRow => f.write_str("the statement answered no row"),
        }
    }
}

impl std::error::Error for Failure {}

impl From<Failure> for StoreUnavailable {
    fn from(failure: Failure) -> Self {
        StoreUnavailable::new(failure)
    }
}

/// `url` with its password hidden, in either form Postgres reads: a URL
/// (`postgres://user:secret@host/db` becomes `postgres://user:***@host/db`) or key-value pairs
/// (`password=secret` becomes `password=***`). Any other URL's password is hidden alike.
///
/// ```
/// use tower_llm_quota_postgres::redacted;
///
/// assert_eq!(redacted("postgres://app:hunter2@db/quota"), "postgres://app:***@db/quota");
/// assert_eq!(redacted("redis://:hunter2@cache:6379/0"), "redis://:***@cache:6379/0");
/// ```
pub fn redacted(url: &str) -> String {
    if let Some(rest) = url.split_once("://").map(|(_, rest)| rest) {
        let scheme = &url[..url.len() - rest.len()];
        let (authority, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
        let mut out = String::from(scheme);
        match authority.rsplit_once('@') {
            Some((user_info, host)) => {
                let user = user_info
                    .split_once(':')
                    .map_or(user_info, |(user, _)| user);
                let hidden = if user_info.contains(':') { ":***" } else { "" };
                out.push_str(&format!("{user}{hidden}@{host}"));
            }
            None => out.push_str(authority),
        }
        // A password may also be a query parameter.
        out.push_str(&hide_pairs(tail, '&'));
        return out;
    }
    hide_pairs(url, ' ')
}

/// `text` with the value of each `password=` pair separated by `separator` hidden.
fn hide_pairs(text: &str, separator: char) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, part) in text.split(separator).enumerate() {
        if i > 0 {
            out.push(separator);
        }
        let (lead, pair) = part.split_at(part.rfind(['?', ' ']).map_or(0, |at| at + 1));
        out.push_str(lead);
        match pair.split_once('=') {
            Some((key, _)) if key.trim() == "password" => {
                out.push_str(key);
                out.push_str("=***");
            }
            _ => out.push_str(pair),
        }
    }
    out
}

/// How `url` is reached: `connections` at most, `timeout` to connect (at least a second).
pub(crate) fn reach(url: &str, connections: usize, timeout: Duration) -> Reach {
    Reach {
        url: url.to_owned(),
        connections,
        connect_timeout: timeout.max(Duration::from_secs(1)),
        statement_timeout: Duration::from_secs(5),
    }
}

impl From<(&str, Failure)> for Error {
    fn from((address, failure): (&str, Failure)) -> Self {
        Error::unreachable(address, failure)
    }
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn passwords_never_show() {
        for (url, shown) in [
            (
                "postgres://app:s3cr%40t@db.internal:5432/quota",
                "postgres://app:***@db.internal:5432/quota",
            ),
            (
                "postgresql://app@db/quota?sslmode=require&password=hunter2",
                "postgresql://app@db/quota?sslmode=require&password=***",
            ),
            ("postgres://db/quota", "postgres://db/quota"),
            (
                "host=db user=app password=hunter2 dbname=quota",
                "host=db user=app password=*** dbname=quota",
            ),
        ] {
            assert_eq!(redacted(url), shown);
            assert!(!redacted(url).contains("hunter2") && !redacted(url).contains("s3cr"));
        }
    }
}
