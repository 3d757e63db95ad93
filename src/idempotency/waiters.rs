//! The local waiters of a shared store's records, by key: for a store that hears of
//! completions over a channel (Redis publish and subscribe, Postgres `LISTEN`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;
use tokio::sync::futures::Notified;

/// The waiters of a store's records in this process, by key. A waiter registers for its key
/// ([`KeyWaiters::register`]) and listens to its notification; the store's listener wakes a
/// key's waiters when a message names it ([`wake`](Self::wake)), and every waiter after it
/// lost its channel and may have missed messages ([`wake_all`](Self::wake_all)): a woken
/// waiter looks at the record again. A key's entry lasts as long as it has waiters.
///
/// # Example
///
/// ```
/// use std::sync::Arc;
/// use tower_llm_quota::idempotency::KeyWaiters;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let waiters = Arc::new(KeyWaiters::default());
/// {
///     let waiter = KeyWaiters::register(&waiters, b"op-1");
///     let mut notified = std::pin::pin!(waiter.notified());
///     notified.as_mut().enable(); // listening before looking at the record
///     waiters.wake(b"op-1"); // what the listener does when a message names the key
///     notified.await;
/// }
/// assert_eq!(waiters.keys(), 0, "the last waiter gone, the key is forgotten");
/// # }
/// ```
#[derive(Debug, Default)]
pub struct KeyWaiters {
    waiters: Mutex<ByKey>,
}

/// Per key: the notification its waiters listen to, and how many they are.
type ByKey = HashMap<Vec<u8>, (Arc<Notify>, usize)>;

/// A waiter registered for a key; unregistered when dropped.
#[derive(Debug)]
pub struct KeyWaiter {
    waiters: Arc<KeyWaiters>,
    key: Vec<u8>,
    notify: Arc<Notify>,
}

impl KeyWaiters {
    fn lock(&self) -> std::sync::MutexGuard<'_, ByKey> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a waiter for `key`.
    pub fn register(waiters: &Arc<Self>, key: &[u8]) -> KeyWaiter {
        let notify = {
            let mut all = waiters.lock();
            let entry = all
                .entry(key.to_vec())
                .or_insert_with(|| (Arc::new(Notify::new()), 0));
            entry.1 += 1;
            Arc::clone(&entry.0)
        };
        KeyWaiter {
            waiters: Arc::clone(waiters),
            key: key.to_vec(),
            notify,
        }
    }

    /// Wakes the waiters of `key`, if any.
    pub fn wake(&self, key: &[u8]) {
        let notify = self.lock().get(key).map(|w| Arc::clone(&w.0));
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }

    /// Wakes every waiter.
    pub fn wake_all(&self) {
        let all: Vec<_> = self.lock().values().map(|w| Arc::clone(&w.0)).collect();
        for notify in all {
            notify.notify_waiters();
        }
    }

    /// How many keys have waiters now.
    pub fn keys(&self) -> usize {
        self.lock().len()
    }
}

impl KeyWaiter {
    /// The next wake-up of its key (enable it before looking at the record, so that a wake
    /// in between is not missed).
    pub fn notified(&self) -> Notified<'_> {
        self.notify.notified()
    }
}

impl Drop for KeyWaiter {
    fn drop(&mut self) {
        let mut all = self.waiters.lock();
        if let Some(entry) = all.get_mut(&self.key) {
            entry.1 -= 1;
            if entry.1 == 0 {
                all.remove(&self.key);
            }
        }
    }
}
