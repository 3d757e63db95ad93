//! The in-memory store: records in this process's memory, bounded in number and bytes.

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::record::Record;
use super::store::{Claim, IdempotencyStore, StoreFuture};

/// The records a [`MemoryStore::new`] keeps at most: 100,000.
pub const DEFAULT_MAX_RECORDS: usize = 100_000;

/// The bytes of completed records a [`MemoryStore::new`] keeps at most: 256 MiB.
pub const DEFAULT_MAX_BYTES: usize = 256 << 20;

/// What a record costs beyond its body and headers: the entry, its key's copy in the
/// eviction order, the map's slot (counted, so that many small records are bounded too).
const ENTRY_OVERHEAD: usize = 160;

/// Records in this process's memory: for one process, or several layers of one process
/// sharing a store. Clones share the records.
///
/// # Bounds
///
/// At most [`DEFAULT_MAX_RECORDS`] records and [`DEFAULT_MAX_BYTES`] of completed records by
/// default ([`with_limits`](Self::with_limits) sets others). A record's bytes are its key,
/// body and headers plus 160 bytes of bookkeeping. Past a bound, the oldest completed records
/// are evicted (an evicted key is answered as new: its next request is sent again, as after
/// its TTL); a record in flight is never evicted, so claims in flight may exceed the record
/// bound while they last. A completed record larger than the byte bound on its own is not
/// kept. Expired records are also removed lazily: on access, and in a sweep whenever the
/// number of records has doubled since the last one.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<Records>>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Debug)]
struct Records {
    entries: HashMap<String, Entry>,
    /// Completed records, oldest first, by their sequence number (stale ones are skipped).
    completed: VecDeque<(u64, String)>,
    next_seq: u64,
    /// Bytes of the completed records.
    bytes: usize,
    max_records: usize,
    max_bytes: usize,
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
        record: Box<Record>,
        until: Instant,
        seq: u64,
        bytes: usize,
    },
}

impl Entry {
    fn until(&self) -> Instant {
        match self {
            Entry::InFlight { until, .. } | Entry::Completed { until, .. } => *until,
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Entry::InFlight { .. } => 0,
            Entry::Completed { bytes, .. } => *bytes,
        }
    }
}

impl Records {
    /// Inserts `entry` at `key`, keeping the byte count; returns the entry it replaced.
    fn insert(&mut self, key: &str, entry: Entry) -> Option<Entry> {
        self.bytes += entry.bytes();
        let previous = self.entries.insert(key.to_owned(), entry);
        self.bytes -= previous.as_ref().map_or(0, Entry::bytes);
        previous
    }

    fn remove(&mut self, key: &str) -> Option<Entry> {
        let previous = self.entries.remove(key);
        self.bytes -= previous.as_ref().map_or(0, Entry::bytes);
        previous
    }

    /// Removes the expired records when their number has doubled since the last sweep.
    fn sweep(&mut self, now: Instant) {
        if self.entries.len() < 2 * self.swept_at + 64 {
            return;
        }
        let mut freed = 0;
        self.entries.retain(|_, entry| {
            let live = entry.until() > now;
            if !live {
                freed += entry.bytes();
            }
            live
        });
        self.bytes -= freed;
        let entries = &self.entries;
        self.completed
            .retain(|(seq, key)| is_current(entries, key, *seq));
        self.swept_at = self.entries.len();
    }

    /// Evicts the oldest completed records while a bound is exceeded.
    fn evict(&mut self) {
        while self.entries.len() > self.max_records || self.bytes > self.max_bytes {
            let Some((seq, key)) = self.completed.pop_front() else {
                return;
            };
            if is_current(&self.entries, &key, seq) {
                self.remove(&key);
            }
        }
    }
}

/// Whether the completed record `seq` is still the one at `key`.
fn is_current(entries: &HashMap<String, Entry>, key: &str, seq: u64) -> bool {
    matches!(entries.get(key), Some(Entry::Completed { seq: s, .. }) if *s == seq)
}

/// The bytes a completed record of `key` holds.
fn record_bytes(key: &str, record: &Record) -> usize {
    let headers: usize = record
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    let body = record.body().map_or(0, |body| body.len());
    2 * key.len() + headers + body + ENTRY_OVERHEAD
}

impl MemoryStore {
    /// An empty store with the default bounds ([`DEFAULT_MAX_RECORDS`],
    /// [`DEFAULT_MAX_BYTES`]).
    pub fn new() -> Self {
        Self::with_limits(
            NonZeroUsize::new(DEFAULT_MAX_RECORDS).expect("not zero"),
            NonZeroUsize::new(DEFAULT_MAX_BYTES).expect("not zero"),
        )
    }

    /// An empty store keeping at most `max_records` records and `max_bytes` of completed
    /// records (see [Bounds](Self#bounds)).
    pub fn with_limits(max_records: NonZeroUsize, max_bytes: NonZeroUsize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Records {
                entries: HashMap::new(),
                completed: VecDeque::new(),
                next_seq: 0,
                bytes: 0,
                max_records: max_records.get(),
                max_bytes: max_bytes.get(),
                swept_at: 0,
            })),
        }
    }

    /// The number of records, live or not yet swept.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes the completed records hold, as counted against the byte bound.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The same claim, synchronously.
    fn claim_now(&self, key: &str, owner: &str, lease: Duration) -> Claim {
        let now = Instant::now();
        let mut records = self.lock();
        records.sweep(now);
        match records.entries.get(key) {
            Some(entry) if entry.until() > now => match entry {
                Entry::InFlight { .. } => return Claim::InFlight,
                Entry::Completed { record, .. } => return Claim::Completed(record.clone()),
            },
            _ => {}
        }
        let until = crate::sched::saturating_deadline(now, lease);
        let previous = records.insert(
            key,
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

    /// Replaces `owner`'s claim on `key` by a completed `record` (or removes it), waking its
    /// waiters. A completion also replaces a claim that lapsed (or a record that expired).
    fn finish(&self, key: &str, owner: &str, record: Option<(Record, Instant)>) {
        let now = Instant::now();
        let mut records = self.lock();
        let held = match records.entries.get(key) {
            Some(Entry::InFlight {
                owner: o, until, ..
            }) => o == owner || (*until <= now && record.is_some()),
            Some(Entry::Completed { until, .. }) => *until <= now && record.is_some(),
            None => record.is_some(),
        };
        if !held {
            return;
        }
        let bytes = record.as_ref().map_or(0, |(r, _)| record_bytes(key, r));
        let previous = match record {
            // Larger than the whole byte bound: not kept, the key is free again.
            Some(_) if bytes > records.max_bytes => records.remove(key),
            Some((record, until)) => {
                let seq = records.next_seq;
                records.next_seq += 1;
                let entry = Entry::Completed {
                    record: Box::new(record),
                    until,
                    seq,
                    bytes,
                };
                let previous = records.insert(key, entry);
                records.completed.push_back((seq, key.to_owned()));
                records.evict();
                previous
            }
            None => records.remove(key),
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
        let until = crate::sched::saturating_deadline(Instant::now(), ttl);
        self.finish(key, owner, Some((record, until)));
    }

    fn release(&self, key: &str, owner: &str) {
        self.finish(key, owner, None);
    }

    fn renew(&self, key: &str, owner: &str, lease: Duration) -> StoreFuture<bool> {
        let now = Instant::now();
        let mut records = self.lock();
        let held = match records.entries.get_mut(key) {
            Some(Entry::InFlight {
                owner: holder,
                until,
                ..
            }) if holder == owner && *until > now => {
                *until = crate::sched::saturating_deadline(now, lease);
                true
            }
            _ => false,
        };
        Box::pin(async move { Ok(held) })
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
    use std::num::NonZeroUsize;

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
        // A renewed claim holds past its first lease; a renewal by another owner does not.
        assert!(!store.renew("k", "x", lease).await.unwrap());
        tokio::time::advance(lease / 2).await;
        assert!(store.renew("k", "c", lease).await.unwrap());
        tokio::time::advance(lease * 3 / 4).await;
        assert_eq!(store.claim("k", "d", lease).await.unwrap(), Claim::InFlight);
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

    #[tokio::test(start_paused = true)]
    async fn the_oldest_completed_records_are_evicted_past_a_bound() {
        let lease = Duration::from_secs(60);
        let ttl = Duration::from_secs(3_600);
        // Three records at most.
        let store = MemoryStore::with_limits(
            NonZeroUsize::new(3).unwrap(),
            NonZeroUsize::new(1 << 20).unwrap(),
        );
        store.claim("in-flight", "o", lease).await.unwrap();
        for key in ["a", "b", "c"] {
            store.claim(key, "o", lease).await.unwrap();
            store.complete(key, "o", record(), ttl);
        }
        // Four claims, one in flight: the oldest completed ones went, never the claim.
        assert_eq!(store.len(), 3);
        assert_eq!(
            store.claim("in-flight", "x", lease).await.unwrap(),
            Claim::InFlight
        );
        assert_eq!(
            store.claim("a", "x", lease).await.unwrap(),
            Claim::Claimed,
            "evicted"
        );
        store.release("a", "x");
        assert!(matches!(
            store.claim("c", "x", lease).await.unwrap(),
            Claim::Completed(_)
        ));

        // A byte bound: records of 1 KiB bodies, 4 KiB of them at most.
        let store = MemoryStore::with_limits(
            NonZeroUsize::new(1_000).unwrap(),
            NonZeroUsize::new(4 * 1_400).unwrap(),
        );
        let big = || {
            Record::new(
                StatusCode::OK,
                &HeaderMap::new(),
                None,
                Some(Bytes::from(vec![b'x'; 1_024])),
            )
        };
        for i in 0..100 {
            let key = i.to_string();
            store.claim(&key, "o", lease).await.unwrap();
            store.complete(&key, "o", big(), ttl);
            assert!(store.bytes() <= 4 * 1_400, "{}", store.bytes());
        }
        assert_eq!(store.len(), 4);
        assert!(matches!(
            store.claim("99", "x", lease).await.unwrap(),
            Claim::Completed(_)
        ));
        // Larger than the whole bound: not kept, the key is free.
        let huge = Record::new(
            StatusCode::OK,
            &HeaderMap::new(),
            None,
            Some(Bytes::from(vec![b'x'; 10_000])),
        );
        store.claim("huge", "o", lease).await.unwrap();
        store.complete("huge", "o", huge, ttl);
        assert_eq!(
            store.claim("huge", "x", lease).await.unwrap(),
            Claim::Claimed
        );
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_are_given_back_when_records_expire_or_are_replaced() {
        let store = MemoryStore::new();
        let lease = Duration::from_secs(1);
        for i in 0..200 {
            let key = i.to_string();
            store.claim(&key, "o", lease).await.unwrap();
            store.complete(&key, "o", record(), Duration::from_secs(1));
        }
        assert!(store.bytes() > 0);
        tokio::time::advance(Duration::from_secs(2)).await;
        // Expired records replaced by claims, the rest swept.
        for i in 0..200 {
            store.claim(&i.to_string(), "o", lease).await.unwrap();
        }
        assert_eq!(store.bytes(), 0);
    }
}
