//! Coalescing in one process: the calls of one operation in flight share one upstream call,
//! its head and every byte of its body.
//!
//! A [`Flight`] is the shared state of one operation. Its leader makes the call and publishes
//! the head; the upstream body then lives in the flight, and every reader (the leader's body
//! and each duplicate's) is a cursor over the chunks received so far. Whichever reader needs a
//! chunk nobody has received polls the upstream body, under the flight's lock, and wakes the
//! others after unlocking; a reader dropped while it was the one the upstream body would wake
//! wakes the others, so one of them takes over. The chunks stay until the flight ends, so a
//! duplicate arriving mid-stream still receives the body from its first byte.
//!
//! # Length
//!
//! The flight, its readers and their one lock protocol (who polls the upstream body, who
//! wakes whom) belong together: a reader's correctness depends on every other reader's.

use std::collections::HashMap;
use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::response::Parts;
use http::{Extensions, HeaderMap, StatusCode, Version};
use http_body::{Body, Frame};

use super::IdempotencyError;
use super::record::Record;
use super::store::IdempotencyStore;
use crate::error::BoxError;
use crate::usage::UsageScanner;

pub(crate) type Upstream = Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send + 'static>>;

/// The flights in progress, by stored key. Inner by the clones of one layer.
#[derive(Debug, Default)]
pub(crate) struct Flights {
    map: Mutex<HashMap<String, Arc<Flight>>>,
}

impl Flights {
    /// Joins the flight of `key`, or starts one and returns `true` (the caller leads it).
    /// `request` is the digest of the request a caller's key came with: a flight of the same
    /// key for another request is not joined (the key was reused: `None`).
    pub(crate) fn join_or_lead(
        self: &Arc<Self>,
        key: &str,
        request: Option<&str>,
        store: &Arc<dyn IdempotencyStore>,
        owner: &str,
    ) -> Option<(Handle, bool)> {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(flight) = map.get(key).filter(|flight| flight.joinable()) {
            let theirs = flight.keyed.as_ref().and_then(|k| k.request.as_deref());
            if !same_request(request, theirs) {
                return None;
            }
            return Some((Handle::new(Arc::clone(flight)), false));
        }
        let flight = Arc::new(Flight::new(Some(Keyed {
            key: key.to_owned(),
            owner: owner.to_owned(),
            request: request.map(str::to_owned),
            store: Arc::clone(store),
            flights: Arc::downgrade(self),
        })));
        map.insert(key.to_owned(), Arc::clone(&flight));
        Some((Handle::new(flight), true))
    }

    /// Removes `flight` if it is still the one registered under its key.
    fn remove(&self, key: &str, flight: &Flight) {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if map
            .get(key)
            .is_some_and(|f| std::ptr::eq(Arc::as_ptr(f), flight))
        {
            map.remove(key);
        }
    }

    /// The flights in progress.
    pub(crate) fn len(&self) -> usize {
        self.map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// What a keyed flight reports to the store when it ends.
struct Keyed {
    key: String,
    owner: String,
    /// The digest of the request a caller's key came with.
    request: Option<String>,
    store: Arc<dyn IdempotencyStore>,
    flights: std::sync::Weak<Flights>,
}

/// How the end of a successful body is recorded.
pub(crate) struct Recording {
    pub(crate) ttl: Duration,
    pub(crate) max_body: usize,
    pub(crate) scanner: UsageScanner,
    /// The digest of the request a caller's key came with, kept in the record.
    pub(crate) request: Option<String>,
}

pub(crate) struct Flight {
    keyed: Option<Keyed>,
    state: Mutex<State>,
}

/// The head every reader of a flight receives.
#[derive(Debug, Clone)]
pub(crate) struct Head {
    pub(crate) status: StatusCode,
    pub(crate) version: Version,
    pub(crate) headers: HeaderMap,
    pub(crate) extensions: Extensions,
}

#[derive(Debug, Clone)]
pub(crate) enum HeadState {
    Pending,
    Ready(Arc<Head>),
    /// The leader's call failed without a response, or the record cannot be replayed.
    Failed(IdempotencyError),
    /// The leader was dropped before the head: a duplicate may lead instead.
    Abandoned,
}

struct State {
    head: HeadState,
    chunks: Vec<Bytes>,
    size: usize,
    /// `Some` once the body ended: `Ok`, or the error every reader gets after the last chunk.
    end: Option<Result<(), IdempotencyError>>,
    upstream: Option<Upstream>,
    recording: Option<Recording>,
    wakers: Vec<Waker>,
    /// Handles alive: the leader's, each duplicate's, each body's.
    interested: usize,
    /// The task renewing the claim while the call is alive; stopped when the flight ends.
    renewal: Option<Renewal>,
}

/// A claim's renewal task, aborted when dropped.
struct Renewal(tokio::task::AbortHandle);

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What to tell the store after the flight's lock is released.
enum Outcome {
    Complete(Box<Record>),
    Release,
}

impl Flight {
    fn new(keyed: Option<Keyed>) -> Self {
        Self {
            keyed,
            state: Mutex::new(State {
                head: HeadState::Pending,
                chunks: Vec::new(),
                size: 0,
                end: None,
                upstream: None,
                recording: None,
                wakers: Vec::new(),
                interested: 0,
                renewal: None,
            }),
        }
    }

    /// A flight of a call that is not deduplicated (no key): it only adapts the body.
    pub(crate) fn unkeyed() -> Handle {
        Handle::new(Arc::new(Self::new(None)))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a duplicate may still join: a flight that failed, was abandoned or was cut is
    /// on its way out of the map, and the operation may be tried again instead.
    fn joinable(&self) -> bool {
        let state = self.lock();
        !matches!(state.head, HeadState::Failed(_) | HeadState::Abandoned)
            && !matches!(state.end, Some(Err(_)))
    }

    /// Renews the claim every third of `lease` while the flight lives, so that the claim
    /// outlasts a long call and lapses within `lease` of this process dying. Stops when the
    /// flight finishes, or when the store says the claim is no longer this owner's.
    fn keep_claimed(&self, lease: Duration) {
        let Some(keyed) = &self.keyed else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = Arc::clone(&keyed.store);
        let (key, owner) = (keyed.key.clone(), keyed.owner.clone());
        let every = (lease / 3).max(Duration::from_millis(1));
        let task = runtime.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match store.renew(&key, &owner, lease).await {
                    Ok(true) => {}
                    Ok(false) => return,
                    // Unreachable for now: the next turn tries again, within the lease.
                    Err(error) => tracing::debug!(%error, "idempotency claim not renewed"),
                }
            }
        });
        self.lock().renewal = Some(Renewal(task.abort_handle()));
    }

    /// Reports `outcome` to the store and leaves the map. Called without the lock.
    fn finish(&self, outcome: Outcome) {
        let Some(keyed) = &self.keyed else { return };
        drop(self.lock().renewal.take());
        match outcome {
            Outcome::Complete(record) => {
                let ttl = self
                    .lock()
                    .recording
                    .as_ref()
                    .map_or(Duration::ZERO, |r| r.ttl);
                keyed.store.complete(&keyed.key, &keyed.owner, *record, ttl);
            }
            Outcome::Release => keyed.store.release(&keyed.key, &keyed.owner),
        }
        if let Some(flights) = keyed.flights.upgrade() {
            flights.remove(&keyed.key, self);
        }
    }
}

/// Whether two requests of one key are the same as far as their digests tell (a key without
/// a digest, derived or its body unread, is not compared).
pub(crate) fn same_request(ours: Option<&str>, theirs: Option<&str>) -> bool {
    match (ours, theirs) {
        (Some(ours), Some(theirs)) => ours == theirs,
        _ => true,
    }
}

fn wake(wakers: Vec<Waker>) {
    for waker in wakers {
        waker.wake();
    }
}

fn register(wakers: &mut Vec<Waker>, waker: &Waker) {
    if !wakers.iter().any(|w| w.will_wake(waker)) {
        wakers.push(waker.clone());
    }
}

/// One party's interest in a flight. When the last handle goes before the body ended, the
/// upstream body is dropped and the operation released: nobody in this process wants it.
pub(crate) struct Handle {
    flight: Arc<Flight>,
}

impl Handle {
    fn new(flight: Arc<Flight>) -> Self {
        flight.lock().interested += 1;
        Self { flight }
    }

    /// The leader holds the store's claim: renew it while the call is alive (see
    /// [`Flight::keep_claimed`]).
    pub(crate) fn keep_claimed(&self, lease: Duration) {
        self.flight.keep_claimed(lease);
    }

    /// The leader's response head and body: every reader receives them.
    pub(crate) fn publish(
        &self,
        parts: Parts,
        body: Upstream,
        recording: Option<Recording>,
    ) -> Arc<Head> {
        let head = Arc::new(Head {
            status: parts.status,
            version: parts.version,
            headers: parts.headers,
            extensions: parts.extensions,
        });
        let mut state = self.flight.lock();
        state.head = HeadState::Ready(Arc::clone(&head));
        state.upstream = Some(body);
        state.recording = recording;
        let wakers = std::mem::take(&mut state.wakers);
        drop(state);
        wake(wakers);
        head
    }

    /// A stored record, for every reader. A record without its body fails them all.
    pub(crate) fn publish_record(&self, record: Record) -> Result<Arc<Head>, IdempotencyError> {
        let mut state = self.flight.lock();
        let result = match record.body {
            Some(body) => {
                let mut extensions = Extensions::new();
                if let Some(usage) = record.usage {
                    extensions.insert(usage);
                }
                let head = Arc::new(Head {
                    status: record.status,
                    version: Version::HTTP_11,
                    headers: record.headers,
                    extensions,
                });
                state.head = HeadState::Ready(Arc::clone(&head));
                state.size = body.len();
                if !body.is_empty() {
                    state.chunks.push(body);
                }
                state.end = Some(Ok(()));
                Ok(head)
            }
            None => {
                let error = IdempotencyError::not_replayable();
                state.head = HeadState::Failed(error.clone());
                Err(error)
            }
        };
        let wakers = std::mem::take(&mut state.wakers);
        drop(state);
        wake(wakers);
        // The record is the store's: nothing to write, only the map to leave.
        if let Some(keyed) = &self.flight.keyed {
            if let Some(flights) = keyed.flights.upgrade() {
                flights.remove(&keyed.key, &self.flight);
            }
        }
        result
    }

    /// The leader's call failed without a response: duplicates get `error`.
    pub(crate) fn fail(&self, error: IdempotencyError) {
        let mut state = self.flight.lock();
        if !matches!(state.head, HeadState::Pending) {
            return;
        }
        state.head = HeadState::Failed(error);
        let wakers = std::mem::take(&mut state.wakers);
        drop(state);
        wake(wakers);
        self.flight.finish(Outcome::Release);
    }

    /// The leader gave up before the head (its future was dropped): a duplicate may lead.
    pub(crate) fn abandon(&self) {
        let mut state = self.flight.lock();
        if !matches!(state.head, HeadState::Pending) {
            return;
        }
        state.head = HeadState::Abandoned;
        let wakers = std::mem::take(&mut state.wakers);
        drop(state);
        wake(wakers);
        self.flight.finish(Outcome::Release);
    }

    /// The head, once there.
    pub(crate) fn poll_head(&self, cx: &mut Context<'_>) -> Poll<HeadState> {
        let mut state = self.flight.lock();
        match &state.head {
            HeadState::Pending => {
                register(&mut state.wakers, cx.waker());
                Poll::Pending
            }
            head => Poll::Ready(head.clone()),
        }
    }

    /// A body reading this flight from its first byte.
    pub(crate) fn body(self) -> IdempotentBody {
        IdempotentBody {
            handle: self,
            next: 0,
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let mut state = self.flight.lock();
        state.interested -= 1;
        let wakers = std::mem::take(&mut state.wakers);
        let abandoned = state.interested == 0 && state.end.is_none();
        // Before the head, `fail` and `abandon` released the key already.
        let release = abandoned && matches!(state.head, HeadState::Ready(_));
        let mut upstream = None;
        if abandoned {
            upstream = state.upstream.take();
            state.end = Some(Err(IdempotencyError::interrupted(
                "every reader was dropped",
            )));
            if matches!(state.head, HeadState::Pending) {
                state.head = HeadState::Abandoned;
            }
        }
        drop(state);
        // The upstream body is dropped outside the lock: its drop may settle a reservation.
        drop(upstream);
        // Whoever the upstream body would have woken may be gone: the others take over.
        wake(wakers);
        if release {
            self.flight.finish(Outcome::Release);
        }
    }
}

impl fmt::Debug for Flight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Flight")
            .field("key", &self.keyed.as_ref().map(|k| &k.key))
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle").finish_non_exhaustive()
    }
}

/// The response body of [`Idempotency`](super::Idempotency): the upstream body for the first
/// call of an operation and every duplicate in flight with it (each receives every byte), or
/// a stored body for a duplicate after completion.
///
/// Trailers are not passed on. A body whose upstream fails after its first byte ends every
/// reader with the same error ([`IdempotencyError::is_interrupted`]).
pub struct IdempotentBody {
    handle: Handle,
    next: usize,
}

impl Body for IdempotentBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let flight = Arc::clone(&this.handle.flight);
        loop {
            let mut state = flight.lock();
            if let Some(chunk) = state.chunks.get(this.next) {
                let chunk = chunk.clone();
                this.next += 1;
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
            if let Some(end) = &state.end {
                return Poll::Ready(match end {
                    Ok(()) => None,
                    Err(error) => Some(Err(Box::new(error.clone()))),
                });
            }
            let Some(upstream) = state.upstream.as_mut() else {
                // Before the head: nothing to read yet.
                register(&mut state.wakers, cx.waker());
                return Poll::Pending;
            };
            let outcome = match upstream.as_mut().poll_frame(cx) {
                Poll::Pending => {
                    register(&mut state.wakers, cx.waker());
                    return Poll::Pending;
                }
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        if !data.is_empty() {
                            state.size = state.size.saturating_add(data.len());
                            if let Some(recording) = state.recording.as_mut() {
                                recording.scanner.data(&data);
                            }
                            state.chunks.push(data);
                        }
                    }
                    // A body that knows it ended (its `Content-Length` read whole) ends here:
                    // a server writing a known length stops polling once it has written it,
                    // and would never ask for the end that completes the record.
                    if state.upstream.as_ref().is_some_and(|u| u.is_end_stream()) {
                        state.end = Some(Ok(()));
                        Some(record(&mut state))
                    } else {
                        None
                    }
                }
                Poll::Ready(Some(Err(error))) => {
                    let error = IdempotencyError::interrupted(&error.to_string());
                    state.end = Some(Err(error));
                    Some(Outcome::Release)
                }
                Poll::Ready(None) => {
                    state.end = Some(Ok(()));
                    Some(record(&mut state))
                }
            };
            // An ended upstream body is dropped outside the lock: its drop may settle.
            let ended = if outcome.is_some() {
                state.upstream.take()
            } else {
                None
            };
            let wakers = std::mem::take(&mut state.wakers);
            drop(state);
            drop(ended);
            wake(wakers);
            if let Some(outcome) = outcome {
                flight.finish(outcome);
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        let state = self.handle.flight.lock();
        self.next >= state.chunks.len() && matches!(state.end, Some(Ok(())))
    }
}

/// The record of a body that ended: completed when its status is a success, else released
/// (a failed operation may be tried again).
fn record(state: &mut State) -> Outcome {
    let (HeadState::Ready(head), Some(recording)) = (&state.head, &state.recording) else {
        return Outcome::Release;
    };
    if !head.status.is_success() {
        return Outcome::Release;
    }
    let body = (state.size <= recording.max_body).then(|| {
        let mut body = BytesMut::with_capacity(state.size);
        for chunk in &state.chunks {
            body.extend_from_slice(chunk);
        }
        body.freeze()
    });
    let usage = recording.scanner.usage();
    Outcome::Complete(Box::new(
        Record::new(head.status, &head.headers, usage, body)
            .with_request_digest(recording.request.clone()),
    ))
}

impl fmt::Debug for IdempotentBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentBody")
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}
