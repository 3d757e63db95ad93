//! Where operation records live: the seam every store implements.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

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

    /// Extends `owner`'s claim on `key` to `lease` from now: the layer renews a claim while
    /// its call is alive, so that a short lease frees the claims of a process that died
    /// without making a long call lose its own. Answers whether `owner` still held the claim
    /// (false when its lease lapsed and another took the key, or the operation finished).
    ///
    /// The default renews nothing and answers false: a store without it keeps each claim for
    /// the lease it was made with.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the claim extended.
    fn renew(&self, key: &str, owner: &str, lease: Duration) -> StoreFuture<bool> {
        let _ = (key, owner, lease);
        Box::pin(async { Ok(false) })
    }

    /// Resolves when `key` may have changed (completed, released, or its lease ended), at the
    /// latest after `within`; the caller then claims again to learn what happened.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future only stops waiting.
    fn changed(&self, key: &str, within: Duration) -> StoreFuture<()>;
}
