//! Operation records in Postgres, shared by every process naming the same database.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{StreamExt, stream};
use tokio::sync::{oneshot, watch};
use tokio_postgres::AsyncMessage;

use tower_llm_quota::idempotency::{Claim, IdempotencyStore, KeyWaiters, Record, StoreFuture};

use crate::connection::{Database, Params, reach};
use crate::error::Error;
use tower_llm_quota::{capped_duration as capped, saturating_deadline};

const CLAIM: &str = "SELECT state, meta, body FROM llm_quota.claim($1, $2, $3)";
const RENEW: &str = "SELECT llm_quota.renew_claim($1, $2, $3)";
const FINISH: &str = "SELECT llm_quota.finish_claim($1, $2, $3, $4, $5)";
const LOOK: &str = "SELECT in_flight, lasts_ms FROM llm_quota.claim_state($1)";
/// The channel a completion or a release is announced on, with the key.
const CHANNEL: &str = "llm_quota_operations";

/// Records of [`IdempotencyLayer`](tower_llm_quota::IdempotencyLayer) in Postgres
/// (`llm_quota.operations`, created by [`migrate`](crate::migrate)): every process naming
/// the same database shares them. Clones share the connections.
///
/// A record is a row: in flight (claimed by an owner until its lease ends) or completed (the
/// answer's metadata and body, kept for the record's time to live). Each operation on one key
/// is one statement taking the key's advisory lock, so two processes claiming one key take
/// turns and exactly one gets it. Waiters are woken by `LISTEN`: a completion or a release
/// notifies the channel `llm_quota_operations` with the key. Notifications sent while the
/// listener is disconnected are lost, so after each reconnection every local waiter is woken
/// and claims again to see what it missed. Keys reach SQL only as parameters.
#[derive(Clone)]
pub struct PostgresIdempotencyStore {
    inner: Arc<Inner>,
}

struct Inner {
    database: Database,
    config: tokio_postgres::Config,
    waiters: Arc<KeyWaiters>,
    /// Whether the listener is listening now; `None` until it is started.
    listening: Mutex<Option<watch::Receiver<bool>>>,
    /// Dropped with the store: the listener stops.
    _shutdown: Mutex<Option<oneshot::Sender<()>>>,
}

impl PostgresIdempotencyStore {
    /// A store in the database at `url` (its schema migrated by [`migrate`](crate::migrate)).
    /// Connects lazily: an unreachable database is an error of each call (the layer then
    /// sends uncoordinated), not of this one. Fails on an invalid address. Must be called
    /// within a tokio runtime.
    pub fn open(url: &str) -> Result<Self, Error> {
        Self::open_with_timeout(url, Duration::from_secs(1))
    }

    /// [`PostgresIdempotencyStore::open`], with connecting bounded by `timeout` (1 s by
    /// default).
    pub fn open_with_timeout(url: &str, timeout: Duration) -> Result<Self, Error> {
        let database = Database::connect_lazy(&reach(url, 4, capped(timeout)))?;
        let config = url
            .parse()
            .map_err(|e| Error::config(database.address(), format_args!("{e}")))?;
        Ok(Self {
            inner: Arc::new(Inner {
                database,
                config,
                waiters: Arc::default(),
                listening: Mutex::default(),
                _shutdown: Mutex::default(),
            }),
        })
    }

    /// Completes (with a record) or releases (without) the claim, in the background.
    fn finish(&self, key: &str, owner: &str, record: Option<(Record, Duration)>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no tokio runtime: the claim lapses with its lease");
            return;
        };
        let (ttl, meta, body) = match record {
            Some((record, ttl)) => (
                i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX).max(1),
                Some(record.encode_meta().into_bytes()),
                Some(record.body().map(|b| b.to_vec()).unwrap_or_default()),
            ),
            None => (0, None, None),
        };
        let params: Params = vec![
            Box::new(key.to_owned()),
            Box::new(owner.to_owned()),
            Box::new(ttl),
            Box::new(meta),
            Box::new(body),
        ];
        let database = self.inner.database.clone();
        runtime.spawn(async move {
            if let Err(error) = database.query(FINISH, &params).await {
                tracing::warn!(%error, "idempotency record not written: the claim lapses with its lease");
            }
        });
    }

    /// Starts the listener if it is not running; returns whether it is listening.
    fn listener(&self) -> watch::Receiver<bool> {
        let mut listening = self
            .inner
            .listening
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(receiver) = listening.as_ref() {
            return receiver.clone();
        }
        let self_inner = Arc::downgrade(&self.inner);
        let (sender, receiver) = watch::channel(false);
        let (shutdown, stop) = oneshot::channel();
        *self
            .inner
            ._shutdown
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(shutdown);
        *listening = Some(receiver.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = listen(self_inner, sender) => {}
                _ = stop => {}
            }
        });
        receiver
    }
}

/// The listener: one connection per store running `LISTEN`, reconnecting until the store is
/// dropped.
async fn listen(inner: Weak<Inner>, listening: watch::Sender<bool>) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let Some(store) = inner.upgrade() else { return };
        let config = store.config.clone();
        drop(store);
        let connected = tokio::time::timeout(
            Duration::from_secs(2),
            config.connect(tokio_postgres::NoTls),
        );
        if let Ok(Ok((client, mut connection))) = connected.await {
            let mut messages = stream::poll_fn(move |cx| connection.poll_message(cx));
            // The connection runs while its messages are read; LISTEN is answered through it.
            let listen = format!("LISTEN {CHANNEL}");
            let mut subscribe = std::pin::pin!(client.batch_execute(&listen));
            let subscribed = loop {
                tokio::select! {
                    result = &mut subscribe => break result.is_ok(),
                    message = messages.next() => if !matches!(message, Some(Ok(_))) { break false },
                }
            };
            if subscribed {
                backoff = Duration::from_millis(50);
                // Anything announced while nobody listened is found by claiming again. Woken
                // before listening is announced: a waiter that registers after it looks at
                // the key itself.
                wake_all(&inner);
                let _ = listening.send(true);
                while let Some(Ok(message)) = messages.next().await {
                    let Some(store) = inner.upgrade() else { return };
                    if let AsyncMessage::Notification(note) = message {
                        store.waiters.wake(note.payload().as_bytes());
                    }
                }
            }
        }
        let _ = listening.send(false);
        wake_all(&inner);
        if inner.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

fn wake_all(inner: &Weak<Inner>) {
    if let Some(store) = inner.upgrade() {
        store.waiters.wake_all();
    }
}

fn lease_ms(lease: Duration) -> i64 {
    i64::try_from(lease.as_millis()).unwrap_or(i64::MAX).max(1)
}

impl IdempotencyStore for PostgresIdempotencyStore {
    fn claim(&self, key: &str, owner: &str, lease: Duration) -> StoreFuture<Claim> {
        let params: Params = vec![
            Box::new(key.to_owned()),
            Box::new(owner.to_owned()),
            Box::new(lease_ms(lease)),
        ];
        let database = self.inner.database.clone();
        Box::pin(async move {
            let rows = database.query(CLAIM, &params).await?;
            let row = rows.first().ok_or("the claim answered no row")?;
            let state: String = row.try_get("state")?;
            match state.as_str() {
                "claimed" => Ok(Claim::Claimed),
                "in_flight" => Ok(Claim::InFlight),
                "completed" => {
                    let meta: Option<Vec<u8>> = row.try_get("meta")?;
                    let body: Option<Vec<u8>> = row.try_get("body")?;
                    let body = Bytes::from(body.unwrap_or_default());
                    match Record::decode(&meta.unwrap_or_default(), body) {
                        Some(record) => Ok(Claim::Completed(Box::new(record))),
                        None => Err("an idempotency record in Postgres is not readable".into()),
                    }
                }
                other => Err(format!("unexpected claim state {other:?}").into()),
            }
        })
    }

    fn renew(&self, key: &str, owner: &str, lease: Duration) -> StoreFuture<bool> {
        let params: Params = vec![
            Box::new(key.to_owned()),
            Box::new(owner.to_owned()),
            Box::new(lease_ms(lease)),
        ];
        let database = self.inner.database.clone();
        Box::pin(async move { Ok(database.value::<bool>(RENEW, &params).await?) })
    }

    fn complete(&self, key: &str, owner: &str, record: Record, ttl: Duration) {
        self.finish(key, owner, Some((record, ttl)));
    }

    fn release(&self, key: &str, owner: &str) {
        self.finish(key, owner, None);
    }

    fn changed(&self, key: &str, within: Duration) -> StoreFuture<()> {
        let store = self.clone();
        let key = key.to_owned();
        Box::pin(async move {
            let deadline = saturating_deadline(tokio::time::Instant::now(), within);
            let waiter = KeyWaiters::register(&store.inner.waiters, key.as_bytes());
            let mut listening = store.listener();
            let ready = tokio::time::timeout_at(deadline, async {
                listening.wait_for(|l| *l).await.is_ok()
            })
            .await;
            if ready != Ok(true) {
                return Ok(());
            }
            // Listening before looking: a completion after the look is heard, one before it
            // is seen.
            let mut notified = std::pin::pin!(waiter.notified());
            notified.as_mut().enable();
            let params: Params = vec![Box::new(key)];
            let looked = store.inner.database.query(LOOK, &params).await;
            // A failed look waits like a claim in flight: returning at once would make the
            // caller claim and look again in a loop while Postgres half-answers.
            let within_ms = i64::try_from(within.as_millis()).unwrap_or(i64::MAX);
            let (in_flight, lasts_ms) = looked
                .ok()
                .and_then(|rows| rows.into_iter().next())
                .map_or((true, within_ms), |row| {
                    (
                        row.try_get("in_flight").unwrap_or(true),
                        row.try_get("lasts_ms").unwrap_or(within_ms),
                    )
                });
            if in_flight {
                // No later than the lease's end: a claim of a dead process lapses then.
                let lease_end = tokio::time::Instant::now()
                    + Duration::from_millis(u64::try_from(lasts_ms).unwrap_or(0));
                let _ = tokio::time::timeout_at(deadline.min(lease_end), notified).await;
            }
            Ok(())
        })
    }
}

impl fmt::Debug for PostgresIdempotencyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresIdempotencyStore")
            .field("database", &self.inner.database.address())
            .finish_non_exhaustive()
    }
}
