//! Where operation records live: the seam, and the in-memory store.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::record::Record;
use crate::error::BoxError;

/// The future of a store operation: `'static`, so that a response future can hold it.
pub type StoreFuture<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send + 'static>>;

/// The answer to [`IdempotencyStore::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// Nobody holds the key: the caller now does, until it completes, releases, or the lease
    /// ends.
    Claimed,
    /// Another caller holds the key and has not finished.
    InFlight,
    /// The operation completed within the record's time to live.
    Completed(Box<Record>),
}

/// Where [`IdempotencyLayer`](super::IdempotencyLayer) keeps operation records.
///
/// A record is in flight (claimed by an owner, with a lease) or completed (with a time to
/// live). Every operation on one key is atomic. Object safe: the layer holds an
/// `Arc<dyn IdempotencyStore>`.
///
/// `complete` and `release` start their write and return at once: a store that needs I/O
/// finishes it in the background, so that the end of a response body never waits for it.
/// Until the write lands, a duplicate sees the operation in flight and waits for it.
pub trait IdempotencyStore: fmt::Debug + Send + Sync + 'static {
    /// Claims `key` for `owner` for `lease`, or says who has it.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the claim made: it then lapses when the lease ends.
    fn claim(&self, key: &str, owner: &str, lease: Duration) -> StoreFuture<Claim>;

    /// Completes `owner`'s claim on `key` with `record`, kept for `ttl`. A claim whose lease
    /// ended with nobody else claiming is completed too; when another caller claimed the key
    /// meanwhile, nothing is written.
    fn complete(&self, key: &str, owner: &str, record: Record, ttl: Duration);

    /// Gives up `owner`'s claim on `key`: the operation failed or was abandoned and may be
    /// tried again.
    fn release(&self, key: &str, owner: &str);

    /// Resolves when `key` may have changed (completed, released, or its lease ended), at the
    /// latest after `within`; the caller then claims again to learn what happened.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future only stops waiting.
    fn changed(&self, key: &str, within: Duration) -> StoreFuture<()>;
}

/// Records in this process's memory: for one process, or several layers of one process
/// sharing a store. Clones share the records.
///
/// Expired records are removed lazily: on access, and in a sweep whenever the number of
/// records has doubled since the last one, so memory stays proportional to the live records.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<Records>>,
}

#[derive(Debug, Default)]
struct Records {
    entries: HashMap<String, Entry>,
    /// The number of entries after the last sweep.
    swept_at: usize,
}

#[derive(Debug)]
enum Entry {
    InFlight {
        owner: String,
        until: Instant,
        changed: Arc<Notify>,
    },
    Completed {
        record: Record,
        until: Instant,
    },
}

impl Entry {
    fn until(&self) -> Instant {
        match self {
            Entry::InFlight { until, .. } | Entry::Completed { until, .. } => *until,
        }
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of records, live or not yet swept.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The same claim, synchronously.
    fn claim_now(&self, key: &str, owner: &str, lease: Duration) -> Claim {
        let now = Instant::now();
        let mut records = self.lock();
        if records.entries.len() >= 2 * records.swept_at + 64 {
            records.entries.retain(|_, entry| entry.until() > now);
            records.swept_at = records.entries.len();
        }
        match records.entries.get(key) {
            Some(entry) if entry.until() > now => match entry {
                Entry::InFlight { .. } => return Claim::InFlight,
                Entry::Completed { record, .. } => {
                    return Claim::Completed(Box::new(record.clone()));
                }
            },
            _ => {}
        }
        let until = crate::sched::saturating_deadline(now, lease);
        let previous = records.entries.insert(
            key.to_owned(),
            Entry::InFlight {
                owner: owner.to_owned(),
                until,
                changed: Arc::new(Notify::new()),
            },
        );
        drop(records);
        // A lapsed claim's waiters learn that it changed hands.
        if let Some(Entry::InFlight { changed, .. }) = previous {
            changed.notify_waiters();
        }
        Claim::Claimed
    }

    /// Replaces `owner`'s claim on `key` by `next` (or removes it), waking its waiters. A
    /// completion also replaces a claim that lapsed (or a record that expired).
    fn finish(&self, key: &str, owner: &str, next: Option<Entry>) {
        let now = Instant::now();
        let mut records = self.lock();
        let held = match records.entries.get(key) {
            Some(Entry::InFlight {
                owner: o, until, ..
            }) => o == owner || (*until <= now && next.is_some()),
            Some(Entry::Completed { until, .. }) => *until <= now && next.is_some(),
            None => next.is_some(),
        };
        if !held {
            return;
        }
        let previous = match next {
            Some(next) => records.entries.insert(key.to_owned(), next),
            None => records.entries.remove(key),
        };
        drop(records);
        if let Some(Entry::InFlight { changed, .. }) = previous {
            changed.notify_waiters();
        }
    }
}

impl IdempotencyStore for MemoryStore {
    fn claim(&self, key: &str, owner: &str, lease: Duration) -> StoreFuture<Claim> {
        let claim = self.claim_now(key, owner, lease);
        Box::pin(async move { Ok(claim) })
    }

    fn complete(&self, key: &str, owner: &str, record: Record, ttl: Duration) {
        let now = Instant::now();
        let until = crate::sched::saturating_deadline(now, ttl);
        self.finish(key, owner, Some(Entry::Completed { record, until }));
    }

    fn release(&self, key: &str, owner: &str) {
        self.finish(key, owner, None);
    }

    fn changed(&self, key: &str, within: Duration) -> StoreFuture<()> {
        let records = self.lock();
        let (notified, until) = match records.entries.get(key) {
            Some(Entry::InFlight { changed, until, .. }) => {
                let mut notified = Box::pin(Arc::clone(changed).notified_owned());
                // Registered under the lock: a completion after it cannot be missed.
                notified.as_mut().enable();
                (notified, *until)
            }
            _ => return Box::pin(async { Ok(()) }),
        };
        drop(records);
        let deadline = until.min(crate::sched::saturating_deadline(Instant::now(), within));
        Box::pin(async move {
            let _ = tokio::time::timeout_at(deadline, notified).await;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    fn record() -> Record {
        Record::new(
            StatusCode::OK,
            &HeaderMap::new(),
            None,
            Some(Bytes::from("x")),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn claim_complete_expire() {
        let store = MemoryStore::new();
        let lease = Duration::from_secs(60);
        assert_eq!(store.claim("k", "a", lease).await.unwrap(), Claim::Claimed);
        assert_eq!(store.claim("k", "b", lease).await.unwrap(), Claim::InFlight);
        // Only the owner completes, or releases.
        store.complete("k", "b", record(), Duration::from_secs(10));
        store.release("k", "b");
        assert_eq!(store.claim("k", "b", lease).await.unwrap(), Claim::InFlight);
        store.complete("k", "a", record(), Duration::from_secs(10));
        assert_eq!(
            store.claim("k", "b", lease).await.unwrap(),
            Claim::Completed(Box::new(record()))
        );
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(store.claim("k", "b", lease).await.unwrap(), Claim::Claimed);
        store.release("k", "b");
        assert_eq!(store.claim("k", "c", lease).await.unwrap(), Claim::Claimed);
        // A lapsed lease lets another caller in; the first can no longer release it.
        tokio::time::advance(lease).await;
        assert_eq!(store.claim("k", "d", lease).await.unwrap(), Claim::Claimed);
        store.release("k", "c");
        assert_eq!(store.claim("k", "e", lease).await.unwrap(), Claim::InFlight);
        // A completion after a lapse that nobody took over still records the operation.
        tokio::time::advance(lease).await;
        store.complete("k", "d", record(), Duration::from_secs(10));
        assert_eq!(
            store.claim("k", "e", lease).await.unwrap(),
            Claim::Completed(Box::new(record()))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_wake_on_completion_not_before() {
        let store = MemoryStore::new();
        let lease = Duration::from_secs(60);
        store.claim("k", "a", lease).await.unwrap();
        let start = Instant::now();
        let waiter = tokio::spawn(store.changed("k", Duration::from_secs(30)));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiter.is_finished());
        store.complete("k", "a", record(), Duration::from_secs(10));
        waiter.await.unwrap().unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        // Nothing in flight: at once.
        store.changed("k", Duration::from_secs(30)).await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn expired_records_are_swept() {
        let store = MemoryStore::new();
        for i in 0..100 {
            store
                .claim(&i.to_string(), "o", Duration::from_secs(1))
                .await
                .unwrap();
        }
        tokio::time::advance(Duration::from_secs(2)).await;
        for i in 100..200 {
            store
                .claim(&i.to_string(), "o", Duration::from_secs(1))
                .await
                .unwrap();
        }
        assert!(store.len() < 200, "{}", store.len());
    }
}
