//! The SQLite state: one connection on a thread of its own, which runs every statement.
//!
//! Writes that need no answer (a cap's count) are queued and committed together: the thread
//! takes every job waiting, runs the queued writes in one transaction (`BEGIN IMMEDIATE`),
//! and tells how far it has committed; a request whose estimate a cap counts waits for that
//! commit before it is sent ([`Sqlite::committed`]). Transactions that answer (an alert's new
//! count, an idempotency claim, the admin state) run one at a time, each in its own.
//!
//! The file is in WAL mode with `synchronous = NORMAL`: a commit survives the process being
//! killed (SIGKILL, a crash, a restart: it is in the log, in the kernel's cache), not a power
//! cut of the machine, which may lose the commits of the last moments. `FULL` would make each
//! commit wait for the disk; a gateway's state is lost with its machine's power only when the
//! machine has no battery-backed cache, and then a cap counts a few less. The file is
//! readable by its owner only.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

use rusqlite::types::Value as Sql;
use rusqlite::{Connection, OpenFlags, TransactionBehavior};
use tokio::sync::{oneshot, watch};

use super::{
    DatabaseError, MIGRATIONS, Row, SCHEMA_VERSION, Statement, Value, newer_refused, sqlite_params,
};
use crate::config::ConfigError;

/// A job for the database's thread.
enum Job {
    /// Writes committed with the others waiting (the last one's number, from 1).
    Write(u64, Vec<Statement>),
    /// Statements run in a transaction of their own, their rows answered.
    Transaction(
        Vec<Statement>,
        oneshot::Sender<Result<Vec<Vec<Row>>, DatabaseError>>,
    ),
}

/// How far the queued writes are committed: the last write committed, and whether a commit
/// failed since (its writes were rolled back).
#[derive(Debug, Clone, Default)]
pub(crate) struct Committed {
    pub(crate) up_to: u64,
    pub(crate) failed: Option<(u64, DatabaseError)>,
}

/// An SQLite state file, its thread, and how far its queued writes are committed.
#[derive(Debug)]
pub(crate) struct Sqlite {
    /// `sqlite:<path>`, as errors name it.
    name: String,
    /// The connection of the writes a request waits for ([`Sqlite::inline`]).
    inline: std::sync::Mutex<Connection>,
    jobs: mpsc::Sender<Job>,
    queued: AtomicU64,
    committed: watch::Receiver<Committed>,
}

/// The most queued writes one transaction carries.
const BATCH: usize = 4_096;

impl Sqlite {
    /// Opens (or creates) the file at `path`, brings its schema to this gateway's, and starts
    /// its thread.
    pub(crate) fn open(path: &Path) -> Result<Self, ConfigError> {
        let error = |what: &str, e: &dyn std::fmt::Display| {
            ConfigError(format!("state sqlite:{}: {what}: {e}", path.display()))
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| error("its folder", &e))?;
        }
        let mut connection = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
        )
        .map_err(|e| error("cannot open", &e))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let owner_only = std::fs::Permissions::from_mode(0o600);
            std::fs::set_permissions(path, owner_only).map_err(|e| error("permissions", &e))?;
        }
        // Pages of 1 KiB (for a new file): a request's commit writes a page or two to the
        // write-ahead log, a quarter of what the default 4 KiB pages write.
        connection
            .execute_batch(
                "PRAGMA page_size = 1024; PRAGMA journal_mode = WAL; \
                 PRAGMA synchronous = NORMAL; PRAGMA busy_timeout = 5000; \
                 PRAGMA foreign_keys = ON;",
            )
            .map_err(|e| error("cannot set it up", &e))?;
        migrate(&mut connection)
            .map_err(|e| ConfigError(format!("state sqlite:{}: {e}", path.display())))?;
        // The connection of the writes a request waits for, made in the caller's thread: it
        // never checkpoints (a checkpoint writes the database file and syncs it), the
        // thread's connection does.
        let inline = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE)
            .and_then(|inline| {
                inline.execute_batch(
                    "PRAGMA synchronous = NORMAL; PRAGMA busy_timeout = 5000; \
                     PRAGMA wal_autocheckpoint = 0;",
                )?;
                Ok(inline)
            })
            .map_err(|e| error("cannot open", &e))?;
        let (jobs, receiver) = mpsc::channel();
        let (progress, committed) = watch::channel(Committed::default());
        let name = format!("sqlite:{}", path.display());
        let thread_name = name.clone();
        std::thread::Builder::new()
            .name("gateway-state".into())
            .spawn(move || run(connection, &receiver, &progress, &thread_name))
            .map_err(|e| error("cannot start its thread", &e))?;
        Ok(Self {
            name,
            inline: std::sync::Mutex::new(inline),
            jobs,
            queued: AtomicU64::new(0),
            committed,
        })
    }

    /// `sqlite:<path>`, as errors and logs name it.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Runs `write` with the connection of the writes a request waits for, in the calling
    /// thread (a commit without a checkpoint: tens of microseconds), one caller at a time:
    /// what it gives [`commit`] is committed when it returns.
    pub(crate) fn inline<T>(&self, write: impl FnOnce(&mut Inline<'_>) -> T) -> T {
        let mut connection = self.inline.lock().unwrap_or_else(|e| e.into_inner());
        write(&mut Inline {
            connection: &mut connection,
            name: &self.name,
        })
    }

    /// Queues `statements`, committed together with the next batch: the number of the last.
    pub(crate) fn write_all(&self, statements: Vec<Statement>) -> u64 {
        let seq = self.queued.fetch_add(1, Ordering::AcqRel) + 1;
        // The thread only ends with the process.
        let _ = self.jobs.send(Job::Write(seq, statements));
        seq
    }

    /// The number of the last write queued.
    pub(crate) fn queued(&self) -> u64 {
        self.queued.load(Ordering::Acquire)
    }

    /// Waits until every write up to `seq` is committed; an error when a commit of one of
    /// them failed (rolled back: the caller decides).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only waits.
    pub(crate) async fn committed(&self, seq: u64) -> Result<(), DatabaseError> {
        let mut committed = self.committed.clone();
        let state = committed
            .wait_for(|c| c.up_to >= seq)
            .await
            .map_err(|_| DatabaseError(format!("{}: its thread stopped", self.name).into()))?;
        match &state.failed {
            Some((at, error)) if *at >= seq => Err(error.clone()),
            _ => Ok(()),
        }
    }

    /// Runs `statements` in one transaction: the rows each answered.
    pub(crate) async fn transaction(
        &self,
        statements: Vec<Statement>,
    ) -> Result<Vec<Vec<Row>>, DatabaseError> {
        let (answer, answered) = oneshot::channel();
        let stopped = || DatabaseError(format!("{}: its thread stopped", self.name).into());
        self.jobs
            .send(Job::Transaction(statements, answer))
            .map_err(|_| stopped())?;
        answered.await.map_err(|_| stopped())?
    }
}

/// The inline connection, lent to [`Sqlite::inline`]'s caller.
pub(crate) struct Inline<'a> {
    connection: &'a mut Connection,
    name: &'a str,
}

impl Inline<'_> {
    /// Runs `statements` in one transaction, all or none.
    pub(crate) fn commit(&mut self, statements: &[Statement]) -> Result<(), DatabaseError> {
        transaction(self.connection, statements, self.name).map(drop)
    }
}

/// The database's thread: every job in turn, the queued writes of each round in one
/// transaction.
fn run(
    mut connection: Connection,
    jobs: &mpsc::Receiver<Job>,
    progress: &watch::Sender<Committed>,
    name: &str,
) {
    let mut writes: Vec<(u64, Vec<Statement>)> = Vec::new();
    while let Ok(first) = jobs.recv() {
        let mut round = vec![first];
        while round.len() < BATCH {
            match jobs.try_recv() {
                Ok(job) => round.push(job),
                Err(_) => break,
            }
        }
        for job in round {
            match job {
                Job::Write(seq, statements) => writes.push((seq, statements)),
                Job::Transaction(statements, answer) => {
                    commit(&mut connection, &mut writes, progress, name);
                    let _ = answer.send(transaction(&mut connection, &statements, name));
                }
            }
        }
        commit(&mut connection, &mut writes, progress, name);
    }
}

/// Commits the queued `writes` in one transaction and tells how far it got.
fn commit(
    connection: &mut Connection,
    writes: &mut Vec<(u64, Vec<Statement>)>,
    progress: &watch::Sender<Committed>,
    name: &str,
) {
    let Some(&(last, _)) = writes.last() else {
        return;
    };
    let statements: Vec<Statement> = writes.drain(..).flat_map(|(_, s)| s).collect();
    let result = transaction(connection, &statements, name);
    progress.send_modify(|committed| {
        committed.up_to = last;
        if let Err(error) = result {
            tracing::error!(%error, "the state's writes were refused (rolled back)");
            committed.failed = Some((last, error));
        }
    });
}

/// Runs `statements` in one immediate transaction, rolled back on any error.
fn transaction(
    connection: &mut Connection,
    statements: &[Statement],
    name: &str,
) -> Result<Vec<Vec<Row>>, DatabaseError> {
    let failed = |e: rusqlite::Error| DatabaseError(format!("{name}: {e}").into());
    let transaction = connection
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(failed)?;
    let mut answers = Vec::with_capacity(statements.len());
    for statement in statements {
        let sql = sqlite_params(statement.sql);
        let mut prepared = transaction.prepare_cached(&sql).map_err(failed)?;
        let params: Vec<Sql> = statement.params.iter().map(to_sql).collect();
        let columns = prepared.column_count();
        let mut rows = prepared
            .query(rusqlite::params_from_iter(params))
            .map_err(failed)?;
        let mut answer = Vec::new();
        while let Some(row) = rows.next().map_err(failed)? {
            let mut values = Vec::with_capacity(columns);
            for i in 0..columns {
                values.push(from_sql(row.get::<_, Sql>(i).map_err(failed)?));
            }
            answer.push(values);
        }
        answers.push(answer);
    }
    transaction.commit().map_err(failed)?;
    Ok(answers)
}

fn to_sql(value: &Value) -> Sql {
    match value {
        Value::Int(n) => Sql::Integer(*n),
        Value::Text(text) => Sql::Text(text.clone()),
        Value::Bytes(bytes) => Sql::Blob(bytes.clone()),
        Value::Null => Sql::Null,
    }
}

fn from_sql(value: Sql) -> Value {
    match value {
        Sql::Integer(n) => Value::Int(n),
        Sql::Real(x) => Value::Int(x as i64),
        Sql::Text(text) => Value::Text(text),
        Sql::Blob(bytes) => Value::Bytes(bytes),
        Sql::Null => Value::Null,
    }
}

/// Brings the file's schema (its `user_version`) to this gateway's, each version in a
/// transaction; refuses a newer one.
fn migrate(connection: &mut Connection) -> Result<(), String> {
    let version: i64 = connection
        .query_row("PRAGMA user_version", [], |row| row.get(0))
        .map_err(|e| e.to_string())?;
    newer_refused("", version).map_err(|e| e.0.replacen("state : ", "", 1))?;
    for &(step, sqlite, _) in MIGRATIONS.iter().filter(|(v, ..)| *v > version) {
        let transaction = connection
            .transaction_with_behavior(TransactionBehavior::Exclusive)
            .map_err(|e| e.to_string())?;
        transaction
            .execute_batch(sqlite)
            .and_then(|()| transaction.execute_batch(&format!("PRAGMA user_version = {step}")))
            .and_then(|()| transaction.commit())
            .map_err(|e| format!("the migration to version {step} was refused: {e}"))?;
        tracing::info!(version = step, "gateway state migrated");
    }
    debug_assert!(SCHEMA_VERSION >= version);
    Ok(())
}
