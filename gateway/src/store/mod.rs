//! Where the gateway's state lives, so that a restart loses nothing that matters: one option
//! (`--state`, or `[server] state`) names it.
//!
//! | state | for | what it keeps |
//! |---|---|---|
//! | `sqlite:FILE` | one gateway (the default with a configuration file) | admin changes and keys (as digests), the caps' counts, the alerts raised, the report's counters and the spend ledger, idempotency records |
//! | `postgres://...` | a fleet of replicas | the same, and every account's quota (`tower-llm-quota-postgres`: caps counted per admission for every replica) |
//! | `redis://...` | a fleet of replicas | the same in Redis; durable only when Redis keeps its data (the gateway says at start whether it does) |
//! | `memory` | the demo | nothing over a restart |
//!
//! The SQL stores keep one schema, versioned: an older one is migrated at start (each step in
//! a transaction), a newer one (a newer gateway wrote it) is refused with a clear message.
//! Every statement is written once, with `$1`-style parameters, for both SQLite and Postgres;
//! names reach SQL only as parameters.

pub(crate) mod caps;
pub(crate) mod idempotency;
mod postgres;
mod sqlite;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(crate) use postgres::Postgres;
pub(crate) use sqlite::Sqlite;

use super::config::ConfigError;

/// Where the gateway's state lives: the admin changes, caller keys made through the API, caps'
/// usage, idempotency records and the report's rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Persistence {
    /// Nothing outlives the process (the demo's).
    Memory,
    /// An SQLite file, for one gateway.
    Sqlite(PathBuf),
    /// A Postgres database shared by the replicas (its URL).
    Postgres(String),
    /// A Redis server shared by the replicas (its URL).
    Redis(String),
}

impl Persistence {
    /// Where the state of a gateway started with the configuration at `config` (none: the
    /// demo) lives: `state` (`--state`), else the configuration's `server.state`, else an
    /// SQLite file beside the configuration named after it (`gateway.toml`:
    /// `gateway.state.db`), else (the demo) memory.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for a `state` that names no known store.
    pub fn choose(
        state: Option<&str>,
        (config, configured): (Option<&Path>, Option<&str>),
    ) -> Result<Self, ConfigError> {
        let base = config.and_then(Path::parent);
        if let Some(state) = state.or(configured) {
            return Self::parse(state, base);
        }
        Ok(match config {
            Some(path) => Persistence::Sqlite(path.with_extension("state.db")),
            None => Persistence::Memory,
        })
    }

    /// Reads `memory`, `sqlite:FILE`, `postgres://...` (or `postgresql://...`) or
    /// `redis://...` (or `rediss://...`); a relative SQLite file is taken from `base` (the
    /// configuration file's folder).
    pub(crate) fn parse(text: &str, base: Option<&Path>) -> Result<Self, ConfigError> {
        if text == "memory" {
            return Ok(Persistence::Memory);
        }
        if let Some(path) = text.strip_prefix("sqlite:") {
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                return Err(ConfigError("state: `sqlite:` needs a file".into()));
            }
            let path = PathBuf::from(path);
            let path = match base {
                Some(base) if path.is_relative() => base.join(path),
                _ => path,
            };
            return Ok(Persistence::Sqlite(path));
        }
        if text.starts_with("postgres://") || text.starts_with("postgresql://") {
            return Ok(Persistence::Postgres(text.to_owned()));
        }
        if text.starts_with("redis://") || text.starts_with("rediss://") {
            return Ok(Persistence::Redis(text.to_owned()));
        }
        Err(ConfigError(format!(
            "state: `{}` is not `memory`, `sqlite:FILE`, `postgres://...` or `redis://...`",
            tower_llm_quota_postgres::redacted(text)
        )))
    }

    /// The Redis URL, for a Redis state.
    pub(crate) fn redis(&self) -> Option<&str> {
        match self {
            Persistence::Redis(url) => Some(url),
            _ => None,
        }
    }

    /// Whether the replicas share it (each account's quota kept in it).
    pub fn is_shared(&self) -> bool {
        matches!(self, Persistence::Postgres(_) | Persistence::Redis(_))
    }
}

impl fmt::Display for Persistence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Persistence::Memory => f.write_str("memory (nothing kept over a restart)"),
            Persistence::Sqlite(path) => write!(f, "sqlite:{}", path.display()),
            Persistence::Postgres(url) => f.write_str(&tower_llm_quota_postgres::redacted(url)),
            Persistence::Redis(url) => f.write_str(&tower_llm_quota_postgres::redacted(url)),
        }
    }
}

/// A value a statement takes or answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value {
    Int(i64),
    Text(String),
    Bytes(Vec<u8>),
    Null,
}

impl Value {
    pub(crate) fn int(&self) -> i64 {
        match self {
            Value::Int(n) => *n,
            _ => 0,
        }
    }

    pub(crate) fn text(&self) -> &str {
        match self {
            Value::Text(text) => text,
            _ => "",
        }
    }

    pub(crate) fn into_bytes(self) -> Option<Vec<u8>> {
        match self {
            Value::Bytes(bytes) => Some(bytes),
            Value::Text(text) => Some(text.into_bytes()),
            _ => None,
        }
    }
}

impl From<i64> for Value {
    fn from(n: i64) -> Self {
        Value::Int(n)
    }
}

impl From<u64> for Value {
    fn from(n: u64) -> Self {
        Value::Int(i64::try_from(n).unwrap_or(i64::MAX))
    }
}

impl From<&str> for Value {
    fn from(text: &str) -> Self {
        Value::Text(text.to_owned())
    }
}

impl From<String> for Value {
    fn from(text: String) -> Self {
        Value::Text(text)
    }
}

impl From<Vec<u8>> for Value {
    fn from(bytes: Vec<u8>) -> Self {
        Value::Bytes(bytes)
    }
}

/// A row answered.
pub(crate) type Row = Vec<Value>;

/// A statement and its parameters (`$1`, `$2`, ...).
#[derive(Debug, Clone)]
pub(crate) struct Statement {
    pub(crate) sql: &'static str,
    pub(crate) params: Vec<Value>,
}

impl Statement {
    pub(crate) fn new(sql: &'static str, params: Vec<Value>) -> Self {
        Self { sql, params }
    }
}

/// A state database's failure: its message names the database (its password hidden) and
/// what the database answered.
#[derive(Debug, Clone)]
pub(crate) struct DatabaseError(pub(crate) Arc<str>);

impl fmt::Display for DatabaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DatabaseError {}

/// The gateway's SQL state: an SQLite file, or a Postgres database. Clones share it.
#[derive(Debug, Clone)]
pub(crate) enum Database {
    Sqlite(Arc<Sqlite>),
    Postgres(Postgres),
}

impl Database {
    /// Opens the database of `persistence` (none for memory or Redis) and brings its schema
    /// to this gateway's; fails naming the database when it cannot be reached, its schema is
    /// newer than this gateway's, or it refuses the migration.
    pub(crate) async fn open(persistence: &Persistence) -> Result<Option<Self>, ConfigError> {
        match persistence {
            Persistence::Sqlite(path) => Ok(Some(Database::Sqlite(Arc::new(Sqlite::open(path)?)))),
            Persistence::Postgres(url) => Ok(Some(Database::Postgres(Postgres::open(url).await?))),
            Persistence::Memory | Persistence::Redis(_) => Ok(None),
        }
    }

    /// Runs `statements` in one transaction, all or none: the rows each answered.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the transaction committed or not (Postgres: rolled back
    /// unless its commit was sent; SQLite: it runs to its end on the database's thread).
    pub(crate) async fn transaction(
        &self,
        statements: Vec<Statement>,
    ) -> Result<Vec<Vec<Row>>, DatabaseError> {
        match self {
            Database::Sqlite(sqlite) => sqlite.transaction(statements).await,
            Database::Postgres(postgres) => postgres.transaction(statements).await,
        }
    }

    /// Waits until every write queued so far is committed (SQLite's writes are queued;
    /// Postgres's are done when their call returns).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only waits.
    pub(crate) async fn flushed(&self) -> Result<(), DatabaseError> {
        match self {
            Database::Sqlite(sqlite) => sqlite.committed(sqlite.queued()).await,
            Database::Postgres(_) => Ok(()),
        }
    }

    /// The database, as logs name it.
    pub(crate) fn name(&self) -> String {
        match self {
            Database::Sqlite(sqlite) => sqlite.name().to_owned(),
            Database::Postgres(postgres) => postgres.address().to_owned(),
        }
    }
}

/// The schema's versions, in order; a version's statements for SQLite and for Postgres. The
/// tables' names are the same in both (Postgres keeps them in the schema `llm_gateway`, its
/// connections' search path).
const MIGRATIONS: &[(i64, &str, &str)] = &[(1, SCHEMA_1_SQLITE, SCHEMA_1_POSTGRES)];

/// The schema version this gateway needs.
pub(crate) const SCHEMA_VERSION: i64 = MIGRATIONS[MIGRATIONS.len() - 1].0;

/// The tables of version 1 (SQLite's types).
const SCHEMA_1_SQLITE: &str = "
CREATE TABLE admin (field TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE alerts (alert TEXT NOT NULL, period INTEGER NOT NULL, spent INTEGER NOT NULL,
    PRIMARY KEY (alert, period));
CREATE TABLE report_rows (hour INTEGER NOT NULL, account TEXT NOT NULL, tenant TEXT NOT NULL,
    model TEXT NOT NULL, counter TEXT NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (hour, account, tenant, model, counter));
CREATE TABLE report_minutes (minute INTEGER NOT NULL, account TEXT NOT NULL,
    counter TEXT NOT NULL, n INTEGER NOT NULL, PRIMARY KEY (minute, account, counter));
CREATE TABLE ledger (day TEXT NOT NULL, tenant TEXT NOT NULL, key TEXT NOT NULL,
    model TEXT NOT NULL, tier TEXT NOT NULL, requests INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL, cache_read_tokens INTEGER NOT NULL,
    cache_write_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
    spend_nano_usd INTEGER NOT NULL, PRIMARY KEY (day, tenant, key, model, tier));
CREATE TABLE caps (scope TEXT NOT NULL, dimension TEXT NOT NULL, cap_window TEXT NOT NULL,
    since INTEGER NOT NULL, used INTEGER NOT NULL,
    PRIMARY KEY (scope, dimension, cap_window, since)) WITHOUT ROWID;
CREATE TABLE operations (key TEXT PRIMARY KEY, completed INTEGER NOT NULL, owner TEXT NOT NULL,
    meta BLOB, body BLOB, expires INTEGER NOT NULL);
";

/// The tables of version 1 (Postgres's types).
const SCHEMA_1_POSTGRES: &str = "
CREATE TABLE admin (field text PRIMARY KEY, value text NOT NULL);
CREATE TABLE meta (name text PRIMARY KEY, value bigint NOT NULL);
CREATE TABLE alerts (alert text NOT NULL, period bigint NOT NULL, spent bigint NOT NULL,
    PRIMARY KEY (alert, period));
CREATE TABLE report_rows (hour bigint NOT NULL, account text NOT NULL, tenant text NOT NULL,
    model text NOT NULL, counter text NOT NULL, n bigint NOT NULL,
    PRIMARY KEY (hour, account, tenant, model, counter));
CREATE TABLE report_minutes (minute bigint NOT NULL, account text NOT NULL,
    counter text NOT NULL, n bigint NOT NULL, PRIMARY KEY (minute, account, counter));
CREATE TABLE ledger (day text NOT NULL, tenant text NOT NULL, key text NOT NULL,
    model text NOT NULL, tier text NOT NULL, requests bigint NOT NULL,
    input_tokens bigint NOT NULL, cache_read_tokens bigint NOT NULL,
    cache_write_tokens bigint NOT NULL, output_tokens bigint NOT NULL,
    spend_nano_usd bigint NOT NULL, PRIMARY KEY (day, tenant, key, model, tier));
CREATE TABLE caps (scope text NOT NULL, dimension text NOT NULL, cap_window text NOT NULL,
    since bigint NOT NULL, used bigint NOT NULL,
    PRIMARY KEY (scope, dimension, cap_window, since));
CREATE TABLE operations (key text PRIMARY KEY, completed bigint NOT NULL, owner text NOT NULL,
    meta bytea, body bytea, expires bigint NOT NULL);
";

/// Refuses a schema newer than this gateway's, naming `database`.
fn newer_refused(database: &str, version: i64) -> Result<(), ConfigError> {
    if version > SCHEMA_VERSION {
        return Err(ConfigError(format!(
            "state {database}: the schema is at version {version}, newer than this gateway's \
             {SCHEMA_VERSION}: a newer llm-quota-gateway wrote it; run that version, or \
             point this one at another state"
        )));
    }
    Ok(())
}

/// `sql` with `$N` parameters written `?N`, as SQLite reads them (every parameter then has
/// its number, whatever the order it appears in).
pub(crate) fn sqlite_params(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) {
            out.push('?');
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_are_read_from_their_urls() {
        let base = Path::new("/etc/gateway");
        assert_eq!(
            Persistence::parse("memory", None).unwrap(),
            Persistence::Memory
        );
        assert_eq!(
            Persistence::parse("sqlite:state.db", Some(base)).unwrap(),
            Persistence::Sqlite("/etc/gateway/state.db".into())
        );
        assert_eq!(
            Persistence::parse("sqlite:///var/lib/gw.db", Some(base)).unwrap(),
            Persistence::Sqlite("/var/lib/gw.db".into())
        );
        assert!(
            Persistence::parse("postgres://u:p@h/db", None)
                .unwrap()
                .is_shared()
        );
        assert!(Persistence::parse("redis://h/", None).unwrap().is_shared());
        let error = Persistence::parse("mysql://u:secret@h/db", None).unwrap_err();
        assert!(!error.0.contains("secret"), "{error}");
        assert!(Persistence::parse("sqlite:", None).is_err());
        let shown = Persistence::Postgres("postgres://u:secret@h/db".into()).to_string();
        assert_eq!(shown, "postgres://u:***@h/db");
    }

    #[test]
    fn a_configuration_file_keeps_its_state_beside_it_unless_told() {
        let config = Some(Path::new("/etc/gw/gateway.toml"));
        assert_eq!(
            Persistence::choose(None, (config, None)).unwrap(),
            Persistence::Sqlite("/etc/gw/gateway.state.db".into())
        );
        assert_eq!(
            Persistence::choose(None, (config, Some("sqlite:state/gw.db"))).unwrap(),
            Persistence::Sqlite("/etc/gw/state/gw.db".into())
        );
        assert_eq!(
            Persistence::choose(Some("memory"), (config, Some("sqlite:x.db"))).unwrap(),
            Persistence::Memory,
            "--state wins"
        );
        assert_eq!(
            Persistence::choose(None, (None, None)).unwrap(),
            Persistence::Memory
        );
    }

    #[test]
    fn parameters_are_numbered_for_sqlite() {
        assert_eq!(
            sqlite_params("SELECT $2, $10 WHERE a = $1 AND b = '$x'"),
            "SELECT ?2, ?10 WHERE a = ?1 AND b = '$x'"
        );
    }
}
