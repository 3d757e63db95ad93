//! The response future of [`Idempotency`](super::Idempotency): join a call in flight, replay a
//! record, or lead the call and record it.
//!
//! # Length
//!
//! One `pin_project` state machine over the store's answers (claim, wait for another process,
//! re-check, lead, record) in one loop: the states share the key, the owner and the request's
//! template. The coalescing in one process is `flight.rs`, the records `record.rs`.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use http_body_util::combinators::Collect;
use pin_project_lite::pin_project;
use tower::Service;

use super::IdempotencyError;
use super::Suppressed;
use super::flight::{
    Flight, Handle, Head, HeadState, IdempotentBody, Recording, Upstream, same_request,
};
use super::inner::Inner;
use super::key::{IdempotencyKey, Operation};
use super::store::{Claim, StoreFuture};
use crate::Deadline;
use crate::error::{BoxError, Error};
use crate::timer::{DeadlineTimer, saturating_deadline};
use crate::usage::UsageScanner;

pin_project! {
    /// The response future of [`Idempotency`](super::Idempotency).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe at every point. Dropped while it leads an operation and before the
    /// response head, it releases the claim (a duplicate waiting for it then leads in its
    /// place); dropped while it waits for a duplicate's call, it only stops waiting. Once the
    /// head has arrived, the body holds the call: dropping every body of one operation drops
    /// the upstream body and releases the claim.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
        B: Body,
    {
        #[pin]
        state: State<S::Future, B>,
        service: S,
        layer: Inner,
        request: Option<Request<B>>,
        parts: Option<http::request::Parts>,
        key: Option<IdempotencyKey>,
        // The digest of the request a caller's key came with (its endpoint and body).
        request_digest: Option<String>,
        owner: String,
        task: Option<String>,
        leader: Option<Leader>,
        // How long it may wait as a duplicate (armed on its first wait).
        waiting: DeadlineTimer,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B>
    where
        B: Body,
    {
        Invalid { error: Option<IdempotencyError> },
        // The body is read to derive the key.
        Reading { #[pin] collect: Collect<B> },
        Start,
        Following { handle: Option<Handle> },
        Claiming { claim: StoreFuture<Claim> },
        // Another process holds the key.
        Waiting { changed: StoreFuture<()> },
        Readying,
        Calling { #[pin] future: F },
        Done,
    }
}

/// The local leader's hold on its flight: dropped before the head, it abandons the flight.
struct Leader {
    handle: Option<Handle>,
}

impl Leader {
    fn into_handle(mut self) -> Handle {
        self.handle
            .take()
            .expect("a leader holds its handle until it lets go")
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            handle.abandon();
        }
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
    B: Body<Data = Bytes>,
{
    pub(crate) fn new(service: S, layer: &Inner, request: Request<B>) -> Self {
        let config = &layer.config;
        let operation = request
            .extensions()
            .get::<Operation>()
            .cloned()
            .unwrap_or_default();
        let longest = saturating_deadline(tokio::time::Instant::now(), config.max_wait);
        let deadline = (request.extensions().get::<Deadline>())
            .map_or(longest, |deadline| deadline.instant().min(longest));
        let mut parts = None;
        let mut kept = None;
        let (state, key) = match IdempotencyKey::from_headers(
            request.headers(),
            &config.key_header,
            &operation,
        ) {
            Err(error) => (
                State::Invalid {
                    error: Some(IdempotencyError::invalid_key(error)),
                },
                None,
            ),
            // A caller's key: its request is read (when small) for its digest, so that the
            // key used again for another request is refused rather than answered.
            Ok(Some(key)) => {
                let small = request
                    .body()
                    .size_hint()
                    .upper()
                    .is_some_and(|n| n <= config.max_request_body as u64);
                if small {
                    let (head, body) = request.into_parts();
                    parts = Some(head);
                    (
                        State::Reading {
                            collect: body.collect(),
                        },
                        Some(key),
                    )
                } else {
                    kept = Some(request);
                    (State::Start, Some(key))
                }
            }
            Ok(None) => {
                let small = request
                    .body()
                    .size_hint()
                    .upper()
                    .is_some_and(|n| n <= config.max_request_body as u64);
                if config.derive && small {
                    let (head, body) = request.into_parts();
                    parts = Some(head);
                    (
                        State::Reading {
                            collect: body.collect(),
                        },
                        None,
                    )
                } else {
                    if config.derive {
                        tracing::debug!(
                            "request body too large or of unknown size: sent without deduplication"
                        );
                    }
                    kept = Some(request);
                    (State::Readying, None)
                }
            }
        };
        Self {
            state,
            service,
            layer: layer.clone(),
            request: kept,
            parts,
            key,
            request_digest: None,
            owner: format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..)),
            task: operation.task_name().map(str::to_owned),
            leader: None,
            waiting: DeadlineTimer::new(Some(deadline)),
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + From<Bytes>,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Output = Result<Response<IdempotentBody>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // The layer's own failures become the crate's `Error` (`Error::idempotency_error`);
        // the inner service's pass as `Error::is_inner`, or unchanged if they already are one.
        self.poll_boxed(cx).map_err(Error::from_inner)
    }
}

impl<S, B, ResBody> ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + From<Bytes>,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    fn poll_boxed(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Response<IdempotentBody>, BoxError>> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Invalid { error } => {
                    let error = error.take().expect("polled after completion");
                    this.state.set(State::Done);
                    return Poll::Ready(Err(Box::new(error)));
                }
                StateProj::Reading { collect } => {
                    let collected = ready!(collect.poll(cx));
                    let parts = this.parts.take().expect("polled after completion");
                    match collected {
                        Ok(collected) => {
                            let bytes = collected.to_bytes();
                            let operation = parts
                                .extensions
                                .get::<Operation>()
                                .cloned()
                                .unwrap_or_default();
                            let derived =
                                IdempotencyKey::derived(&operation, parts.uri.path(), &bytes);
                            match this.key {
                                // The caller's key: the request's digest beside it.
                                Some(_) => *this.request_digest = Some(derived.stored().to_owned()),
                                None => *this.key = Some(derived),
                            }
                            *this.request = Some(Request::from_parts(parts, B::from(bytes)));
                            this.state.set(State::Start);
                        }
                        Err(error) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(error.into()));
                        }
                    }
                }
                StateProj::Start => {
                    let key = this.key.as_ref().expect("a keyed request has its key");
                    let joined = this.layer.flights.join_or_lead(
                        key.stored(),
                        this.request_digest.as_deref(),
                        &this.layer.store,
                        this.owner,
                    );
                    let (handle, lead) = match joined {
                        Some(joined) => joined,
                        None => {
                            this.state.set(State::Done);
                            let error = IdempotencyError::key_reused(key.as_str());
                            return Poll::Ready(Err(Box::new(error)));
                        }
                    };
                    if lead {
                        *this.leader = Some(Leader {
                            handle: Some(handle),
                        });
                        let claim = this.layer.store.claim(
                            key.stored(),
                            this.owner,
                            this.layer.config.lease,
                        );
                        this.state.set(State::Claiming { claim });
                    } else {
                        this.state.set(State::Following {
                            handle: Some(handle),
                        });
                    }
                }
                StateProj::Following { handle } => {
                    let head = handle
                        .as_ref()
                        .expect("polled after completion")
                        .poll_head(cx);
                    let Poll::Ready(head) = head else {
                        return waited_enough(this.waiting, this.state, cx);
                    };
                    match head {
                        HeadState::Ready(head) => {
                            let handle = handle.take().expect("polled after completion");
                            this.state.set(State::Done);
                            crate::observe::duplicate_suppressed(this.task.as_deref());
                            tracing::debug!("duplicate joined the operation in flight");
                            return Poll::Ready(Ok(respond(
                                &head,
                                handle.body(),
                                Some(Suppressed::Coalesced),
                            )));
                        }
                        HeadState::Failed(error) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(Box::new(error)));
                        }
                        // The leader was dropped: start again, perhaps as the leader.
                        HeadState::Abandoned => this.state.set(State::Start),
                        HeadState::Pending => unreachable!("poll_head is ready only past Pending"),
                    }
                }
                StateProj::Claiming { claim } => {
                    let key = this.key.as_ref().expect("a keyed request has its key");
                    match ready!(claim.as_mut().poll(cx)) {
                        Ok(Claim::Claimed) => {
                            if let Some(handle) =
                                this.leader.as_ref().and_then(|l| l.handle.as_ref())
                            {
                                handle.keep_claimed(this.layer.config.lease);
                            }
                            this.state.set(State::Readying);
                        }
                        Err(error) => {
                            // The store is out of reach: the call goes, coordinated in this
                            // process only (and upstream, when the provider honours the key).
                            tracing::warn!(%error, "idempotency store unavailable: sending uncoordinated");
                            this.state.set(State::Readying);
                        }
                        Ok(Claim::InFlight) => {
                            let changed = this
                                .layer
                                .store
                                .changed(key.stored(), this.layer.config.recheck);
                            this.state.set(State::Waiting { changed });
                        }
                        Ok(Claim::Completed(record)) => {
                            this.state.set(State::Done);
                            let handle = this
                                .leader
                                .take()
                                .expect("a claiming request leads its flight")
                                .into_handle();
                            let ours = this.request_digest.as_deref();
                            if !same_request(ours, record.request_digest()) {
                                let error = IdempotencyError::key_reused(key.as_str());
                                handle.fail(error.clone());
                                return Poll::Ready(Err(Box::new(error)));
                            }
                            crate::observe::duplicate_suppressed(this.task.as_deref());
                            tracing::debug!("duplicate answered from the stored record");
                            return Poll::Ready(match handle.publish_record(*record) {
                                Ok(head) => {
                                    Ok(respond(&head, handle.body(), Some(Suppressed::Replayed)))
                                }
                                Err(error) => Err(Box::new(error)),
                            });
                        }
                    }
                }
                StateProj::Waiting { changed } => {
                    // A failed wait is a wake-up like another: claiming again tells.
                    if changed.as_mut().poll(cx).is_pending() {
                        return waited_enough(this.waiting, this.state, cx);
                    }
                    let key = this.key.as_ref().expect("a keyed request has its key");
                    let claim =
                        this.layer
                            .store
                            .claim(key.stored(), this.owner, this.layer.config.lease);
                    this.state.set(State::Claiming { claim });
                }
                StateProj::Readying => {
                    if let Err(error) = ready!(this.service.poll_ready(cx)) {
                        let error = error.into();
                        fail(this.leader, &error);
                        this.state.set(State::Done);
                        return Poll::Ready(Err(error));
                    }
                    let mut request = this.request.take().expect("polled after completion");
                    if let Some(key) = this.key.as_ref() {
                        if let (Some(name), Ok(value)) = (
                            this.layer.config.forward.as_ref(),
                            HeaderValue::try_from(key.as_str()),
                        ) {
                            request.headers_mut().insert(name.clone(), value);
                        }
                        request.extensions_mut().insert(key.clone());
                    }
                    let future = this.service.call(request);
                    this.state.set(State::Calling { future });
                }
                StateProj::Calling { future } => {
                    let response = ready!(future.poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(match response {
                        Ok(response) => {
                            let (parts, body) = response.into_parts();
                            let streaming = parts
                                .headers
                                .get(http::header::CONTENT_TYPE)
                                .and_then(|v| v.to_str().ok())
                                .is_some_and(|v| v.starts_with("text/event-stream"));
                            let upstream: Upstream = Box::pin(body.map_err(Into::into));
                            let config = &this.layer.config;
                            let (handle, recording) = match this.leader.take() {
                                Some(leader) => (
                                    leader.into_handle(),
                                    Some(Recording {
                                        ttl: config.ttl,
                                        max_body: config.max_body,
                                        scanner: UsageScanner::new(config.format, streaming),
                                        request: this.request_digest.clone(),
                                    }),
                                ),
                                None => (Flight::unkeyed(), None),
                            };
                            let head = handle.publish(parts, upstream, recording);
                            Ok(respond(&head, handle.body(), None))
                        }
                        Err(error) => {
                            let error = error.into();
                            fail(this.leader, &error);
                            Err(error)
                        }
                    });
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// A duplicate still waiting: pending, or failed once it has waited as long as it may.
fn waited_enough<F, B: Body, T>(
    waiting: &mut DeadlineTimer,
    mut state: Pin<&mut State<F, B>>,
    cx: &mut Context<'_>,
) -> Poll<Result<T, BoxError>> {
    if !waiting.poll_expired(cx) {
        return Poll::Pending;
    }
    tracing::debug!("duplicate gave up waiting for the identical request in flight");
    state.set(State::Done);
    Poll::Ready(Err(Box::new(IdempotencyError::still_in_flight())))
}

/// The leader's call failed without a response: its duplicates get the error's message, and
/// the operation may be tried again.
fn fail(leader: &mut Option<Leader>, error: &BoxError) {
    if let Some(leader) = leader.take() {
        leader
            .into_handle()
            .fail(IdempotencyError::leader_failed(&error.to_string()));
    }
}

fn respond(
    head: &Arc<Head>,
    body: IdempotentBody,
    suppressed: Option<Suppressed>,
) -> Response<IdempotentBody> {
    let mut response = Response::new(body);
    *response.status_mut() = head.status;
    *response.version_mut() = head.version;
    *response.headers_mut() = head.headers.clone();
    *response.extensions_mut() = head.extensions.clone();
    if let Some(suppressed) = suppressed {
        response.extensions_mut().insert(suppressed);
    }
    response
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
    B: Body,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}
