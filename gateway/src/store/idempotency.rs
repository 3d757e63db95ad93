//! A single gateway's idempotency records in its SQLite state (`operations`): a restart
//! keeps the answers already given, so a duplicate sent after it is still answered from the
//! record, without a second upstream call.
//!
//! Each operation is one transaction on the database's thread (which runs them one at a
//! time: a claim and another of the same key never interleave); a waiter is woken by the
//! completion or release made in this process (the only one writing the file).

use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::Notify;
use tower_llm_quota::idempotency::{Claim, IdempotencyStore, Record, StoreFuture};

use super::{Sqlite, Statement, Value};

const EXPIRED: &str = "DELETE FROM operations WHERE key = $1 AND expires <= $2";
const CLAIM: &str = "INSERT INTO operations (key, completed, owner, expires) \
    VALUES ($1, 0, $2, $3) ON CONFLICT (key) DO NOTHING RETURNING key";
const LOOK: &str = "SELECT completed, meta, body, expires FROM operations WHERE key = $1";
const RENEW: &str = "UPDATE operations SET expires = $3 \
    WHERE key = $1 AND owner = $2 AND completed = 0 AND expires > $4 RETURNING key";
/// Drops the owner's claim, or a record that lapsed.
const DROP_CLAIM: &str = "DELETE FROM operations \
    WHERE key = $1 AND (expires <= $2 OR (completed = 0 AND owner = $3))";
/// Completes, unless another caller holds the key (its live claim stays).
const COMPLETE: &str = "INSERT INTO operations (key, completed, owner, meta, body, expires) \
    VALUES ($1, 1, $2, $3, $4, $5) ON CONFLICT (key) DO NOTHING";
const SWEEP: &str = "DELETE FROM operations WHERE expires <= $1";

/// How many notifications waiters share: a key's waiters listen to one of them (woken by
/// another key's now and then, they look again).
const SHARDS: usize = 64;

/// The records of [`IdempotencyLayer`](tower_llm_quota::IdempotencyLayer) in an SQLite
/// state. Clones share it.
#[derive(Debug, Clone)]
pub(crate) struct SqliteRecords {
    sqlite: Arc<Sqlite>,
    waiters: Arc<([Notify; SHARDS], RandomState)>,
}

/// Milliseconds since the epoch, and `after` later.
fn ms(after: Duration) -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .saturating_add(after);
    i64::try_from(now.as_millis()).unwrap_or(i64::MAX)
}

impl SqliteRecords {
    pub(crate) fn new(sqlite: Arc<Sqlite>) -> Self {
        let records = Self {
            sqlite,
            waiters: Arc::new((std::array::from_fn(|_| Notify::new()), RandomState::new())),
        };
        // Records that lapsed are dropped now and then.
        let sweeper = records.sqlite.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(600));
            loop {
                every.tick().await;
                let sweep = Statement::new(SWEEP, vec![Value::Int(ms(Duration::ZERO))]);
                if sweeper.transaction(vec![sweep]).await.is_err() {
                    continue;
                }
            }
        });
        records
    }

    /// The notification the waiters of `key` listen to.
    fn notify(&self, key: &str) -> &Notify {
        let (shards, hasher) = &*self.waiters;
        &shards[(hasher.hash_one(key) % SHARDS as u64) as usize]
    }

    fn finish(&self, key: &str, owner: &str, record: Option<(Record, Duration)>) {
        let (key, owner, store) = (key.to_owned(), owner.to_owned(), self.clone());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let now = ms(Duration::ZERO);
            let mut statements = vec![Statement::new(
                DROP_CLAIM,
                vec![key.as_str().into(), Value::Int(now), owner.as_str().into()],
            )];
            if let Some((record, ttl)) = record {
                statements.push(Statement::new(
                    COMPLETE,
                    vec![
                        key.as_str().into(),
                        owner.as_str().into(),
                        Value::Bytes(record.encode_meta().into_bytes()),
                        Value::Bytes(record.body().map(|b| b.to_vec()).unwrap_or_default()),
                        Value::Int(ms(ttl.max(Duration::from_millis(1)))),
                    ],
                ));
            }
            if let Err(error) = store.sqlite.transaction(statements).await {
                tracing::warn!(%error, "idempotency record not written: the claim lapses with its lease");
            }
            store.notify(&key).notify_waiters();
        });
    }
}

impl IdempotencyStore for SqliteRecords {
    fn claim(&self, key: &str, owner: &str, lease: Duration) -> StoreFuture<Claim> {
        let statements = vec![
            Statement::new(EXPIRED, vec![key.into(), Value::Int(ms(Duration::ZERO))]),
            Statement::new(
                CLAIM,
                vec![
                    key.into(),
                    owner.into(),
                    Value::Int(ms(lease.max(Duration::from_millis(1)))),
                ],
            ),
            Statement::new(LOOK, vec![key.into()]),
        ];
        let sqlite = self.sqlite.clone();
        Box::pin(async move {
            let answers = sqlite.transaction(statements).await?;
            if answers.get(1).is_some_and(|claimed| !claimed.is_empty()) {
                return Ok(Claim::Claimed);
            }
            let Some(mut row) = answers
                .into_iter()
                .nth(2)
                .and_then(|rows| rows.into_iter().next())
            else {
                return Err("the idempotency record vanished".into());
            };
            if row[0].int() == 0 {
                return Ok(Claim::InFlight);
            }
            let body = std::mem::replace(&mut row[2], Value::Null)
                .into_bytes()
                .unwrap_or_default();
            let meta = std::mem::replace(&mut row[1], Value::Null)
                .into_bytes()
                .unwrap_or_default();
            match Record::decode(&meta, Bytes::from(body)) {
                Some(record) => Ok(Claim::Completed(Box::new(record))),
                None => Err("an idempotency record in the state is not readable".into()),
            }
        })
    }

    fn renew(&self, key: &str, owner: &str, lease: Duration) -> StoreFuture<bool> {
        let renew = Statement::new(
            RENEW,
            vec![
                key.into(),
                owner.into(),
                Value::Int(ms(lease.max(Duration::from_millis(1)))),
                Value::Int(ms(Duration::ZERO)),
            ],
        );
        let sqlite = self.sqlite.clone();
        Box::pin(async move {
            let answers = sqlite.transaction(vec![renew]).await?;
            Ok(answers.first().is_some_and(|rows| !rows.is_empty()))
        })
    }

    fn complete(&self, key: &str, owner: &str, record: Record, ttl: Duration) {
        self.finish(key, owner, Some((record, ttl)));
    }

    fn release(&self, key: &str, owner: &str) {
        self.finish(key, owner, None);
    }

    fn changed(&self, key: &str, within: Duration) -> StoreFuture<()> {
        let (store, key) = (self.clone(), key.to_owned());
        Box::pin(async move {
            let look = Statement::new(LOOK, vec![key.as_str().into()]);
            let sqlite = store.sqlite.clone();
            // Listening before looking: a completion after the look is heard.
            let mut notified = std::pin::pin!(store.notify(&key).notified());
            notified.as_mut().enable();
            let row = sqlite
                .transaction(vec![look])
                .await
                .ok()
                .and_then(|answers| answers.into_iter().next())
                .and_then(|rows| rows.into_iter().next());
            let Some(row) = row else {
                return Ok(());
            };
            if row[0].int() != 0 {
                return Ok(());
            }
            // No later than the claim's lease: a claim of an abandoned call lapses then.
            let left = Duration::from_millis(
                u64::try_from(row[3].int() - ms(Duration::ZERO)).unwrap_or(0),
            );
            let _ = tokio::time::timeout(within.min(left), notified).await;
            Ok(())
        })
    }
}
