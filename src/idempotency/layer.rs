use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use tower::Layer;

use super::inner::{Config, Inner};
use super::memory::MemoryStore;
use super::service::Idempotency;
use super::store::IdempotencyStore;
use crate::usage::WireFormat;

/// Deduplicates operations: see the [module documentation](super).
///
/// Clones share the store and the calls in flight: a duplicate sent through any service of
/// one layer joins the call of the first.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    state: Inner,
}

/// How long a duplicate waits for the identical request in flight by default: 10 minutes.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(600);

/// The header the key is read from and forwarded under by default.
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

impl IdempotencyLayer {
    /// A layer keeping its records in `store`.
    pub fn new(store: impl IdempotencyStore) -> Self {
        Self {
            state: Inner {
                store: Arc::new(store),
                flights: Arc::default(),
                config: Arc::new(Config {
                    ttl: Duration::from_secs(24 * 3600),
                    lease: Duration::from_secs(30),
                    recheck: Duration::from_secs(5),
                    max_wait: DEFAULT_MAX_WAIT,
                    max_body: 1024 * 1024,
                    max_request_body: 4 * 1024 * 1024,
                    key_header: IDEMPOTENCY_KEY,
                    forward: Some(IDEMPOTENCY_KEY),
                    derive: true,
                    format: WireFormat::OpenAiChat,
                }),
            },
        }
    }

    /// A layer keeping its records in this process's memory ([`MemoryStore`]).
    pub fn in_memory() -> Self {
        Self::new(MemoryStore::new())
    }

    fn with(mut self, change: impl FnOnce(&mut Config)) -> Self {
        change(Arc::make_mut(&mut self.state.config));
        self
    }

    /// How long a completed operation's record is kept: a duplicate within it gets the stored
    /// response, one after it is sent again. Defaults to 24 hours.
    pub fn ttl(self, ttl: Duration) -> Self {
        self.with(|c| c.ttl = crate::timer::capped(ttl))
    }

    /// How long a claim in flight holds the key without renewal. The claim is renewed every
    /// third of it while the call is alive (waiting for its answer, or its body streaming),
    /// so a call may last longer; a process that dies mid-call blocks its duplicates at most
    /// this long (plus [`recheck`](Self::recheck) for those in other processes). Defaults to
    /// 30 s.
    pub fn lease(self, lease: Duration) -> Self {
        self.with(|c| c.lease = crate::timer::capped(lease))
    }

    /// The longest a duplicate waiting for another process sleeps before it asks the store
    /// again, in case a wake-up was lost (a reconnection). Defaults to 5 s.
    pub fn recheck(self, recheck: Duration) -> Self {
        self.with(|c| c.recheck = crate::timer::capped(recheck).max(Duration::from_millis(1)))
    }

    /// The longest a duplicate waits for the identical request in flight: for its response
    /// head (a call of this layer), or for its record (a call of another process or layer,
    /// whose body may stream for a long time, or be held unread). A request's
    /// [`Deadline`](crate::Deadline) ends the wait sooner. Past it the duplicate fails with
    /// [`IdempotencyError::is_still_in_flight`](super::IdempotencyError::is_still_in_flight)
    /// and sends nothing: a second call would be billed twice, so the caller decides (the
    /// gateway answers 409). Capped at [`MAX_DURATION`](crate::MAX_DURATION). Defaults to
    /// [`DEFAULT_MAX_WAIT`] (10 minutes).
    pub fn max_wait(self, max_wait: Duration) -> Self {
        self.with(|c| c.max_wait = crate::timer::capped(max_wait))
    }

    /// The largest response body kept in a record, in bytes. A larger body still reaches
    /// every duplicate in flight with it, and the operation is recorded as completed, but
    /// without its body: a duplicate after completion gets an error
    /// ([`IdempotencyError::is_not_replayable`](super::IdempotencyError::is_not_replayable))
    /// rather than a second, billed call. Defaults to 1 MiB.
    pub fn max_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_body = bytes)
    }

    /// The largest request body hashed to derive a key. A request without a key whose body
    /// may be larger (or whose size is unknown) is sent without deduplication. Defaults to
    /// 4 MiB.
    pub fn max_request_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_request_body = bytes)
    }

    /// The request header holding the caller's key. Defaults to `idempotency-key`.
    pub fn key_header(self, name: HeaderName) -> Self {
        self.with(|c| c.key_header = name)
    }

    /// The header the key is sent upstream under, for providers that honour one, or `None`
    /// to send none. Defaults to `idempotency-key`.
    pub fn forward_as(self, name: Option<HeaderName>) -> Self {
        self.with(|c| c.forward = name)
    }

    /// Whether a request without a key gets one derived from its tenant, task, path and
    /// body (see [`IdempotencyKey::derived`](super::IdempotencyKey::derived)). Defaults to
    /// `true`; with `false`, only requests carrying a key are deduplicated.
    pub fn derive_keys(self, derive: bool) -> Self {
        self.with(|c| c.derive = derive)
    }

    /// The wire format of the responses, to read the usage a record keeps. Defaults to
    /// [`WireFormat::OpenAiChat`].
    pub fn wire_format(self, format: WireFormat) -> Self {
        self.with(|c| c.format = format)
    }

    /// Operations in flight in this process (through this layer and its clones).
    pub fn in_flight(&self) -> usize {
        self.state.flights.len()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.state.clone())
    }
}
