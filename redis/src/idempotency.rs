//! Operation records in Redis, shared by every process naming the same prefix.
//!
//! # Length
//!
//! The store's operations are each one script call with its arguments and its reply's
//! decoding; the scripts and their replies read best side by side.

use std::fmt;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::Poll;
use std::time::Duration;

use ::redis::{RedisError, Script, Value};
use bytes::Bytes;
use futures_core::Stream;
use tokio::sync::{oneshot, watch};

use tower_llm_quota::idempotency::{Claim, IdempotencyStore, KeyWaiters, Record, StoreFuture};

use crate::connection::{Connection, Servers, Timeouts};
use tower_llm_quota::{capped_duration as capped, saturating_deadline};

/// Sets the key in flight for an owner, or returns what holds it.
/// KEYS[1] the record; ARGV owner, lease (ms).
const CLAIM: &str = r"
local state = redis.call('HGET', KEYS[1], 's')
if state == 'f' then return {'f'} end
if state == 'd' then
  local r = redis.call('HMGET', KEYS[1], 'm', 'b')
  return {'d', r[1], r[2]}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 's', 'f', 'o', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'c'}
";

/// Extends the owner's claim to a new lease from now; 1 when it still held it.
/// KEYS[1] the record; ARGV owner, lease (ms).
const RENEW: &str = r"
if redis.call('HGET', KEYS[1], 's') == 'f' and redis.call('HGET', KEYS[1], 'o') == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
";

/// Completes (with a record) or releases (without) the owner's claim, and publishes the key.
/// A claim whose lease lapsed with nobody else claiming is still completed: the operation did
/// complete. KEYS[1] the record; ARGV owner, channel, key, then ttl (ms), metadata, body to
/// complete.
const FINISH: &str = r"
local state = redis.call('HGET', KEYS[1], 's')
local held = state == 'f' and redis.call('HGET', KEYS[1], 'o') == ARGV[1]
if not held and not (state == false and ARGV[4]) then
  return 0
end
redis.call('DEL', KEYS[1])
if ARGV[4] and tonumber(ARGV[4]) > 0 then
  redis.call('HSET', KEYS[1], 's', 'd', 'm', ARGV[5], 'b', ARGV[6])
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
";

/// Records of [`IdempotencyLayer`](tower_llm_quota::IdempotencyLayer) in Redis:
/// every process naming the same server and prefix shares them. Clones share the
/// connections.
///
/// A record is a hash at `<prefix>:idem:{<key>}` (its own Redis Cluster hash tag, and the
/// only key of each script, so records spread over a cluster's slots): `s` (`f`
/// in flight, `d` done), the owner `o` of a claim, the metadata `m` and the body `b` of a
/// completed operation. Its TTL is the lease while in flight, the record's TTL once done: an
/// idle store empties itself.
///
/// Waiters are woken by one message on the channel `<prefix>:idem:done`, published by the
/// script that completes or releases a claim. The store keeps one subscribed connection,
/// started by the first wait, and wakes the local waiters of the key a message names; after a
/// reconnection it wakes every waiter, which claims again to see what it missed. On a Redis
/// Cluster ([`RedisIdempotencyStore::open_cluster`]) a message published on one node reaches
/// the subscribers of every node: the listener subscribes on one node, and on the next after
/// losing it.
#[derive(Clone)]
pub struct RedisIdempotencyStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// A client per known node: the listener subscribes through one of them.
    subscribers: Vec<::redis::Client>,
    connection: Connection,
    prefix: String,
    channel: String,
    claim: Script,
    renew: Script,
    finish: Script,
    waiters: Arc<KeyWaiters>,
    /// Whether the listener is subscribed now; `None` until it is started.
    subscribed: Mutex<Option<watch::Receiver<bool>>>,
    /// Dropped with the store: the listener stops.
    _shutdown: Mutex<Option<oneshot::Sender<()>>>,
}

impl RedisIdempotencyStore {
    /// A store at `url` (`redis://host:port/db`) under keys starting with `prefix`. Connects
    /// lazily: an unreachable server is an error of each call (the layer then sends
    /// uncoordinated), not of this one. Fails on an invalid URL. Must be called within a
    /// tokio runtime.
    pub fn open(url: &str, prefix: &str) -> Result<Self, RedisError> {
        Self::open_with_timeout(url, prefix, Duration::from_secs(1))
    }

    /// [`RedisIdempotencyStore::open`], with every command bounded by `timeout` (1 s by
    /// default).
    pub fn open_with_timeout(
        url: &str,
        prefix: &str,
        timeout: Duration,
    ) -> Result<Self, RedisError> {
        Self::connect(Servers::Node(url.to_owned()), prefix, capped(timeout))
    }

    /// A store in a Redis Cluster, given the addresses of some of its nodes
    /// (`redis://host:port`), under keys starting with `prefix`. Connects lazily, like
    /// [`RedisIdempotencyStore::open`]; fails on an invalid address or no address at all.
    /// Must be called within a tokio runtime.
    pub fn open_cluster<N: AsRef<str>>(
        nodes: impl IntoIterator<Item = N>,
        prefix: &str,
    ) -> Result<Self, RedisError> {
        Self::open_cluster_with_timeout(nodes, prefix, Duration::from_secs(1))
    }

    /// [`RedisIdempotencyStore::open_cluster`], with every command bounded by `timeout` (1 s
    /// by default).
    pub fn open_cluster_with_timeout<N: AsRef<str>>(
        nodes: impl IntoIterator<Item = N>,
        prefix: &str,
        timeout: Duration,
    ) -> Result<Self, RedisError> {
        let nodes = nodes.into_iter().map(|n| n.as_ref().to_owned()).collect();
        Self::connect(Servers::Cluster(nodes), prefix, capped(timeout))
    }

    fn connect(servers: Servers, prefix: &str, timeout: Duration) -> Result<Self, RedisError> {
        let connection = servers.connect_lazy(Timeouts {
            connect: timeout,
            response: timeout,
            max_delay: Duration::from_millis(200),
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                subscribers: servers.subscription_clients()?,
                connection,
                prefix: prefix.to_owned(),
                channel: format!("{prefix}:idem:done"),
                claim: Script::new(CLAIM),
                renew: Script::new(RENEW),
                finish: Script::new(FINISH),
                waiters: Arc::default(),
                subscribed: Mutex::default(),
                _shutdown: Mutex::default(),
            }),
        })
    }

    fn record_key(&self, key: &str) -> String {
        format!("{}:idem:{{{key}}}", self.inner.prefix)
    }

    /// Runs `script` (the claim's or the renewal's) on `key`'s record for `owner` and `lease`.
    fn on_claim<T: ::redis::FromRedisValue + Send + 'static>(
        &self,
        script: fn(&Inner) -> &Script,
        key: &str,
        owner: &str,
        lease: Duration,
    ) -> StoreFuture<T> {
        let record_key = self.record_key(key);
        let owner = owner.to_owned();
        let lease = lease.as_millis().max(1) as u64;
        let store = Arc::clone(&self.inner);
        Box::pin(async move {
            let mut connection = store.connection.clone();
            let reply = script(&store)
                .key(record_key)
                .arg(owner)
                .arg(lease)
                .invoke_async(&mut connection)
                .await?;
            Ok(reply)
        })
    }

    /// Runs the finishing script in the background (complete with `record`, or release).
    fn finish(&self, key: &str, owner: &str, record: Option<(Record, Duration)>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no tokio runtime: the claim lapses with its lease");
            return;
        };
        let record_key = self.record_key(key);
        let mut args: Vec<Vec<u8>> = vec![
            owner.as_bytes().to_vec(),
            self.inner.channel.as_bytes().to_vec(),
            key.as_bytes().to_vec(),
        ];
        if let Some((record, ttl)) = record {
            args.push((ttl.as_millis().max(1) as u64).to_string().into_bytes());
            args.push(record.encode_meta().into_bytes());
            args.push(record.body().map(|b| b.to_vec()).unwrap_or_default());
        }
        let store = Arc::clone(&self.inner);
        runtime.spawn(async move {
            let mut connection = store.connection.clone();
            let mut invocation = store.finish.key(record_key);
            for arg in &args {
                invocation.arg(arg.as_slice());
            }
            if let Err(error) = invocation.invoke_async::<i64>(&mut connection).await {
                tracing::warn!(%error, "idempotency record not written: the claim lapses with its lease");
            }
        });
    }

    /// Starts the listener if it is not running; returns whether it is subscribed.
    fn listener(&self) -> watch::Receiver<bool> {
        let mut subscribed = self
            .inner
            .subscribed
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(receiver) = subscribed.as_ref() {
            return receiver.clone();
        }
        let (sender, receiver) = watch::channel(false);
        let (shutdown, stop) = oneshot::channel();
        *self
            .inner
            ._shutdown
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(shutdown);
        *subscribed = Some(receiver.clone());
        tokio::spawn(listen(Arc::downgrade(&self.inner), sender, stop));
        receiver
    }
}

/// The listener: one subscribed connection per store, reconnecting until the store is
/// dropped.
async fn listen(
    inner: Weak<Inner>,
    subscribed: watch::Sender<bool>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut backoff = Duration::from_millis(50);
    for turn in 0.. {
        let Some(store) = inner.upgrade() else { return };
        // The next node after one was lost (one node: always the same).
        let client = store.subscribers[turn % store.subscribers.len()].clone();
        let channel = store.channel.clone();
        drop(store);
        let connected = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, RedisError>(pubsub)
        };
        let connected = tokio::time::timeout(Duration::from_secs(2), connected).await;
        if let Ok(Ok(pubsub)) = connected {
            backoff = Duration::from_millis(50);
            // Anything published while no connection listened is found by claiming again.
            // Woken before the subscription is announced: a waiter that registers after it
            // looks at the key itself, and must not take this wake-up for a completion.
            wake_all(&inner);
            let _ = subscribed.send(true);
            let mut messages = pubsub.into_on_message();
            loop {
                let next = poll_fn(|cx| {
                    if Pin::new(&mut stop).poll(cx).is_ready() {
                        return Poll::Ready(None);
                    }
                    Pin::new(&mut messages).poll_next(cx).map(Some)
                })
                .await;
                match next {
                    None => return,
                    Some(Some(message)) => {
                        let Some(store) = inner.upgrade() else { return };
                        store.waiters.wake(message.get_payload_bytes());
                    }
                    // The connection dropped.
                    Some(None) => break,
                }
            }
        }
        let _ = subscribed.send(false);
        wake_all(&inner);
        let mut wait = std::pin::pin!(tokio::time::sleep(backoff));
        let stopped = poll_fn(|cx| {
            if Pin::new(&mut stop).poll(cx).is_ready() {
                return Poll::Ready(true);
            }
            wait.as_mut().poll(cx).map(|()| false)
        })
        .await;
        if stopped {
            return;
        }
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

use std::future::Future as _;

fn wake_all(inner: &Weak<Inner>) {
    if let Some(store) = inner.upgrade() {
        store.waiters.wake_all();
    }
}

fn bytes(value: &Value) -> Option<Bytes> {
    match value {
        Value::BulkString(b) => Some(Bytes::copy_from_slice(b)),
        Value::SimpleString(s) => Some(Bytes::copy_from_slice(s.as_bytes())),
        _ => None,
    }
}

fn parse_claim(value: Value) -> Result<Claim, tower_llm_quota::BoxError> {
    let Value::Array(items) = value else {
        return Err("unexpected reply to the claim script".into());
    };
    let tag = items.first().and_then(bytes).unwrap_or_default();
    match &tag[..] {
        b"c" => Ok(Claim::Claimed),
        b"f" => Ok(Claim::InFlight),
        b"d" => {
            let meta = items.get(1).and_then(bytes).unwrap_or_default();
            let body = items.get(2).and_then(bytes).unwrap_or_default();
            match Record::decode(&meta, body) {
                Some(record) => Ok(Claim::Completed(Box::new(record))),
                None => Err("an idempotency record in Redis is not readable".into()),
            }
        }
        _ => Err("unexpected reply to the claim script".into()),
    }
}

impl IdempotencyStore for RedisIdempotencyStore {
    fn claim(&self, key: &str, owner: &str, lease: Duration) -> StoreFuture<Claim> {
        let reply = self.on_claim::<Value>(|store| &store.claim, key, owner, lease);
        Box::pin(async move { parse_claim(reply.await?) })
    }

    fn renew(&self, key: &str, owner: &str, lease: Duration) -> StoreFuture<bool> {
        let held = self.on_claim::<i64>(|store| &store.renew, key, owner, lease);
        Box::pin(async move { Ok(held.await? == 1) })
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
            let mut subscribed = store.listener();
            let ready = tokio::time::timeout_at(deadline, async {
                subscribed.wait_for(|s| *s).await.is_ok()
            })
            .await;
            if ready != Ok(true) {
                return Ok(());
            }
            // Listening before looking: a completion after the look is heard, one before it
            // is seen. (Enabled only now, so that the listener's own wake-up when it
            // subscribes is not taken for a completion.)
            let mut notified = std::pin::pin!(waiter.notified());
            notified.as_mut().enable();
            let mut connection = store.inner.connection.clone();
            let record = store.record_key(&key);
            let looked: Result<(Option<String>, i64), RedisError> = ::redis::pipe()
                .cmd("HGET")
                .arg(&record)
                .arg("s")
                .cmd("PTTL")
                .arg(&record)
                .query_async(&mut connection)
                .await;
            // A failed look waits like a claim in flight: returning at once would make the
            // caller claim and look again in a loop while Redis half-answers.
            let within_ms = i64::try_from(within.as_millis()).unwrap_or(i64::MAX);
            let (state, pttl) = looked.unwrap_or_else(|_| (Some("f".to_owned()), within_ms));
            if state.as_deref() == Some("f") {
                // No later than the lease's end: a claim of a dead process lapses then.
                let lease_end = tokio::time::Instant::now()
                    + Duration::from_millis(u64::try_from(pttl).unwrap_or(0));
                let _ = tokio::time::timeout_at(deadline.min(lease_end), notified).await;
            }
            Ok(())
        })
    }
}

impl fmt::Debug for RedisIdempotencyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisIdempotencyStore")
            .field("prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}
