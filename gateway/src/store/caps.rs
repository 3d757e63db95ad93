//! The caps' counts of a single gateway in its SQLite state: recorded as they change, durable
//! before a request they count is sent, restored at start.
//!
//! The budgets count every cap in memory (an admission takes its estimate, a settlement its
//! correction); each change is kept as the period's count as it now is, and committed to the
//! table `caps` by the next request that waits for its counts ([`CapsRecord::durable`], in the
//! request's own thread: one commit for every count changed meanwhile), or a tenth of a
//! second later at most. A request on a path with caps is sent only once the counts of its
//! admission are committed. So after the gateway is killed, a cap restored at the next start
//! is never below what the answers sent used: an answer's settlement committed, or its
//! estimate (never below its usage when `max_tokens` is held to what the caps have left) is.
//! Stopped by SIGTERM, every answer is settled and committed first: the caps restore exactly
//! what was used.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use tower_llm_quota::Dimension;
use tower_llm_quota::tenant::{CapRecord, CapScope, CapWindow, PeriodCap, Tenant, TenantHandle};

use super::{DatabaseError, Sqlite, Statement, Value};

const RECORD: &str = "INSERT INTO caps (scope, dimension, cap_window, since, used) \
    VALUES ($1, $2, $3, $4, $5) ON CONFLICT (scope, dimension, cap_window, since) \
    DO UPDATE SET used = excluded.used";
const CURRENT: &str =
    "SELECT scope, dimension, cap_window, since, used FROM caps WHERE since >= $1";
const PRUNE: &str = "DELETE FROM caps WHERE since < $1";

/// How far back counts are kept: a month and its successor.
const KEEP_SECONDS: i64 = 62 * 86_400;

/// The caps' counts in an SQLite state.
#[derive(Debug)]
pub(crate) struct CapsRecord {
    sqlite: Arc<Sqlite>,
    /// The counts changed since they were last committed, by scope, cap and period: each the
    /// period's count as it now is (a later change replaces an earlier one). Committed whole
    /// by the first [`durable`](Self::durable) that comes.
    pending: Mutex<Pending>,
}

#[derive(Debug, Default)]
struct Pending {
    counts: HashMap<(String, Dimension, CapWindow, u64), u64>,
}

/// How a window is named in the table.
fn window_name(window: CapWindow) -> &'static str {
    match window {
        CapWindow::CalendarDayUtc => "calendar_day_utc",
        CapWindow::CalendarMonthUtc => "calendar_month_utc",
        CapWindow::Rolling => "rolling",
    }
}

fn window_named(name: &str) -> Option<CapWindow> {
    [
        CapWindow::CalendarDayUtc,
        CapWindow::CalendarMonthUtc,
        CapWindow::Rolling,
    ]
    .into_iter()
    .find(|w| window_name(*w) == name)
}

/// How a scope is named in the table: a node's path, or `/` and an account's name (no path
/// starts with `/`).
fn scope_name(scope: CapScope<'_>) -> Option<String> {
    match scope {
        CapScope::Node(node) => Some(node.as_str().to_owned()),
        CapScope::Account(account) => Some(format!("/{account}")),
        _ => None,
    }
}

impl CapRecord for CapsRecord {
    fn counted(&self, scope: CapScope<'_>, cap: &PeriodCap, since: u64, used: u64) {
        let Some(scope) = scope_name(scope) else {
            return;
        };
        let key = (scope, cap.dimension(), cap.window(), since);
        self.pending().counts.insert(key, used);
    }
}

impl CapsRecord {
    pub(crate) fn new(sqlite: Arc<Sqlite>) -> Self {
        Self {
            sqlite,
            pending: Mutex::default(),
        }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Commits every count recorded so far, in the calling thread (one commit for the
    /// counts of every request that waited meanwhile): an error when the database refused
    /// it (a full disk, a read-only file), the counts then kept for the next call.
    ///
    /// A caller that finds nothing pending returns once the commit that took its counts
    /// (made holding the same connection) is done.
    pub(crate) fn durable(&self) -> Result<(), DatabaseError> {
        self.sqlite.inline(|connection| {
            let counts = std::mem::take(&mut self.pending().counts);
            if counts.is_empty() {
                return Ok(());
            }
            let statements: Vec<Statement> = (counts.iter())
                .map(|((scope, dimension, window, since), used)| {
                    Statement::new(
                        RECORD,
                        vec![
                            Value::Text(scope.clone()),
                            dimension.as_str().into(),
                            window_name(*window).into(),
                            (*since).into(),
                            (*used).into(),
                        ],
                    )
                })
                .collect();
            connection.commit(&statements).inspect_err(|_| {
                // Kept for the next commit, unless a later count replaced it meanwhile.
                let mut pending = self.pending();
                for (key, used) in counts {
                    pending.counts.entry(key).or_insert(used);
                }
            })
        })
    }

    /// Restores into `tenants` the counts of every period that has not ended (the caps the
    /// configuration has: a count of a cap removed since is left alone), and forgets those
    /// two months old. Returns how many periods were restored.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: what was restored stays; the rest may be restored again.
    pub(crate) async fn restore(&self, tenants: &TenantHandle) -> Result<usize, DatabaseError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let oldest = now.saturating_sub(KEEP_SECONDS);
        let answers = self
            .sqlite
            .transaction(vec![
                Statement::new(PRUNE, vec![Value::Int(oldest)]),
                Statement::new(CURRENT, vec![Value::Int(oldest)]),
            ])
            .await?;
        let mut restored = 0;
        for row in answers.into_iter().nth(1).unwrap_or_default() {
            let [scope, dimension, window, since, used] = &row[..] else {
                continue;
            };
            let (Some(dimension), Some(window)) = (
                Dimension::ALL
                    .into_iter()
                    .find(|d| d.as_str() == dimension.text()),
                window_named(window.text()),
            ) else {
                continue;
            };
            // The amount is not read back: the cap of this dimension and window is restored.
            let cap = PeriodCap::new(dimension, std::num::NonZeroU64::MIN, window);
            let (since, used) = (since.int().max(0) as u64, used.int().max(0) as u64);
            match scope.text().strip_prefix('/') {
                Some(account) => tenants.restore_cap(CapScope::Account(account), cap, since, used),
                None => match Tenant::parse(scope.text()) {
                    Ok(node) => tenants.restore_cap(CapScope::Node(&node), cap, since, used),
                    Err(_) => continue,
                },
            }
            restored += 1;
        }
        Ok(restored)
    }
}
