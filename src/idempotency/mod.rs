//! One provider call per logical operation: idempotency keys, in-flight deduplication and
//! stored responses.
//!
//! [`IdempotencyLayer`] gives every request an operation key: the caller's
//! `Idempotency-Key` header, or a SHA-256 of the request's [`Operation`] (tenant and task),
//! its path and its body in canonical form (JSON with sorted keys), so that a retried or
//! double-clicked request is recognised however its JSON was laid out. Then:
//!
//! - **The first request** claims the key in the [store](IdempotencyStore) and is sent, with
//!   the key forwarded upstream (header `idempotency-key` by default) for providers that
//!   honour one.
//! - **A duplicate while it is in flight** waits for it and receives the same response: the
//!   same head and every byte of the same body, streamed as it arrives (a duplicate joining
//!   mid-stream receives it from the first byte). One provider call, one reservation: the
//!   duplicate never reaches the layers inside.
//! - **A duplicate after completion**, within the record's TTL (24 hours by default), receives
//!   the stored response (status, headers, body up to [`IdempotencyLayer::max_body`]), with the
//!   usage the provider reported as a [`RawUsage`](crate::usage::RawUsage) extension.
//! - **A failed operation may be tried again**: an error status is shared with the duplicates
//!   in flight but not stored, and a call that failed without a response gives its duplicates
//!   an error ([`IdempotencyError::is_leader_failed`]) and releases the key.
//! - **A caller's key used again for another request** (another path or body, its JSON
//!   compared in canonical form) is refused, nothing sent
//!   ([`IdempotencyError::is_key_reused`]; an HTTP front answers 422, as Stripe does), in
//!   flight or after completion. The request's digest is kept with the record; a body too
//!   large to read first (above `max_request_body`, or of unknown size) is not compared.
//!
//! Responses answered without a call carry a [`Suppressed`] extension, and count in
//! `llm_duplicate_suppressed_total{task_type}`.
//!
//! **Name the tenant.** A derived key is only as narrow as the request's [`Operation`]:
//! requests without one share the empty tenant, so two users sending the same body would share
//! one answer. Put an `Operation` in every request of a multi-tenant service, or turn
//! derivation off ([`IdempotencyLayer::derive_keys`]) and deduplicate only requests carrying
//! a key. A regeneration that must not be deduplicated changes its body (or its key).
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Full};
//! use tower::{Layer, Service, ServiceExt, service_fn};
//! use tower_llm_quota::idempotency::{IdempotencyLayer, Operation, Suppressed};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_llm_quota::BoxError> {
//! let calls = Arc::new(AtomicUsize::new(0));
//! let counted = Arc::clone(&calls);
//! let client = service_fn(move |request: http::Request<Full<Bytes>>| {
//!     counted.fetch_add(1, Ordering::SeqCst);
//!     // The provider sees the operation's key.
//!     assert!(request.headers().contains_key("idempotency-key"));
//!     async { Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("{}")))) }
//! });
//! let mut llm = IdempotencyLayer::in_memory().layer(client);
//!
//! let request = |body: &'static str| {
//!     http::Request::post("/v1/chat/completions")
//!         .extension(Operation::new("acme", "classify"))
//!         .body(Full::new(Bytes::from(body)))
//! };
//! let first = llm.ready().await?.call(request(r#"{"model":"m","max_tokens":5}"#)?).await?;
//! first.into_body().collect().await?;
//! // The same operation, its keys in another order: answered from the record.
//! let again = llm.ready().await?.call(request(r#"{"max_tokens":5,"model":"m"}"#)?).await?;
//! assert_eq!(again.extensions().get::<Suppressed>(), Some(&Suppressed::Replayed));
//! assert_eq!(again.into_body().collect().await?.to_bytes(), "{}");
//! assert_eq!(calls.load(Ordering::SeqCst), 1);
//! # Ok(()) }
//! ```
//!
//! # Where it goes
//!
//! Outermost, outside [`QuotaStack`](crate::stack::QuotaStack) (or the retry layer): a
//! duplicate then neither queues nor reserves, and the retries of the first call stay one
//! operation. Inside the retry layer, each attempt would be an operation of its own, and an
//! attempt retried after an ambiguous failure would find its own claim in flight.
//!
//! # Across processes
//!
//! The `tower-llm-quota-redis` crate's `RedisIdempotencyStore` shares records between processes:
//! the claim is one Lua script (set the key in flight with a lease, or return what holds it);
//! completing writes the record and publishes the key on one channel, in the same script. A
//! duplicate in another process sleeps until that message arrives (each store keeps one
//! subscribed connection, and dispatches messages to its local waiters), then claims again to
//! read the record: no polling. A message lost to a reconnection costs at most
//! [`IdempotencyLayer::recheck`]. A claim is renewed (one more script) every third of
//! [`IdempotencyLayer::lease`] while its call is alive, so a long call keeps it and a process
//! dying mid-call blocks its duplicates at most one lease (30 s by default; a worker sets it
//! from its heartbeat) plus a recheck. Duplicates in other processes receive the stored
//! response once the first has completed, not a live stream.
//!
//! # How long a duplicate waits
//!
//! At most [`IdempotencyLayer::max_wait`] (10 minutes by default), or its own
//! [`Deadline`](crate::Deadline) when sooner: then it fails with
//! [`IdempotencyError::is_still_in_flight`] and sends nothing. A first call whose body is
//! held unread keeps its claim as long as the body lives; its duplicates do not wait for it
//! without end.
//!
//! # Why
//!
//! An ambiguous failure (the connection drops after the provider processed the call)
//! followed by a retry bills twice; identical requests in flight at once (a double click, two
//! workers picking the same job) each pay for a call. The key makes the second of each free.

mod flight;
mod future;
mod inner;
mod key;
mod layer;
mod memory;
mod record;
mod service;
mod store;
mod waiters;

pub use crate::error::idempotency::{IdempotencyError, InvalidKey};
pub use flight::IdempotentBody;
pub use future::ResponseFuture;
pub use key::{IdempotencyKey, Operation};
pub use layer::{DEFAULT_MAX_WAIT, IdempotencyLayer};
pub use memory::{DEFAULT_MAX_BYTES, DEFAULT_MAX_RECORDS, MemoryStore};
pub use record::Record;
pub use service::Idempotency;
pub use store::{Claim, IdempotencyStore, StoreFuture};
pub use waiters::{KeyWaiter, KeyWaiters};

/// How a response was answered without its own call: a response extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Suppressed {
    /// It joined an identical request in flight and received its response.
    Coalesced,
    /// It received the stored response of a completed operation.
    Replayed,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<IdempotencyLayer>();
        send_sync::<IdempotencyError>();
        send_sync::<IdempotentBody>();
    }
}
