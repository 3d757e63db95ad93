//! The server loop: accept connections up to the cap, hold each to its timeouts, serve its
//! requests with the gateway's routes, and drain on stop.
//!
//! A connection is closed when it does not send a whole request head within the header
//! timeout (counted from its accept, or from its first byte after idling), when it idles
//! past the idle timeout, or, when the cap is reached and a new connection comes, if it is the
//! oldest not serving a request (one still sending its head goes before an idle one). A
//! request whose body does not arrive within the body timeout is answered 408. While every
//! connection at the cap is serving, new ones wait in the listen backlog.

mod body;
pub(crate) mod limits;
mod watch;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use super::Gateway;
pub(crate) use body::BodyTimeout;
use body::{AnswerBody, TimedBody};
use limits::{AcceptBackoff, ConnectionLimits};
use watch::{Phase, Watch, WatchedIo};

/// Serves `gateway` on `listener` until `stop` completes, then drains: new connections are
/// refused, requests still queued get a 503, answers already streaming finish, idle
/// connections close.
///
/// # Cancel safety
///
/// Dropping the future stops accepting at once; the connections already accepted are served
/// to their end by their own tasks (their reservations are settled as their bodies drop).
///
/// # Errors
///
/// An I/O error of the listener that accepting cannot go on after.
pub async fn serve(
    gateway: Arc<Gateway>,
    listener: TcpListener,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = gateway.connection_limits;
    let server = Arc::new(Server {
        router: gateway.router(),
        http: http1_builder(&limits),
        limits,
        open: Open::default(),
        stopping: gateway.shutdown.clone(),
    });
    {
        let mut stop = pin!(stop);
        let mut backoff = AcceptBackoff::new();
        loop {
            tokio::select! {
                () = &mut stop => break,
                () = server.open.room(limits.max_connections) => {}
            }
            let accepted = tokio::select! {
                () = &mut stop => break,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, _)) => {
                    backoff.reset();
                    server.admit(stream);
                }
                Err(error) => {
                    if let Some(pause) = backoff.after(&error) {
                        tracing::warn!(%error, pause_ms = pause.as_millis() as u64, "accept failed; pausing");
                        tokio::time::sleep(pause).await;
                    } else {
                        tracing::debug!(%error, "a connection failed before it was accepted");
                    }
                }
            }
        }
    }
    drop(listener);
    server.stopping.cancel();
    server.open.drained().await;
    gateway.stopped().await;
    Ok(())
}

/// hyper's HTTP/1 server, with the head size limit; the timeouts are the connection task's.
fn http1_builder(limits: &ConnectionLimits) -> http1::Builder {
    let mut http = http1::Builder::new();
    http.keep_alive(true)
        .header_read_timeout(None)
        .max_header_size(limits.max_header_bytes)
        .max_buf_size(limits.max_header_bytes.max(8192) + 8192);
    http
}

/// What every connection task shares.
struct Server {
    router: Router,
    http: http1::Builder,
    limits: ConnectionLimits,
    open: Open,
    /// Cancelled on stop: every connection finishes its request and closes.
    stopping: CancellationToken,
}

impl Server {
    /// Registers `stream`, makes room for it if the cap is reached, and serves it on a task.
    fn admit(self: &Arc<Self>, stream: TcpStream) {
        // Small writes (a head, then an event) go out at once, not after a delayed ACK.
        let _ = stream.set_nodelay(true);
        let watch = Arc::new(Watch::accepted());
        let id = self.open.insert(watch.clone());
        if self.open.len() > self.limits.max_connections && !self.open.evict_one(id) {
            tracing::warn!("connection cap reached with every connection serving");
        }
        let server = self.clone();
        tokio::spawn(async move {
            server.connection(stream, watch).await;
            server.open.remove(id);
        });
    }

    /// Serves one connection to its end: closed by the client, timed out, evicted, or
    /// drained on stop.
    async fn connection(&self, stream: TcpStream, watch: Arc<Watch>) {
        let service = {
            let (router, watch, body_timeout) =
                (self.router.clone(), watch.clone(), self.limits.body_timeout);
            hyper::service::service_fn(move |request: http::Request<Incoming>| {
                watch.request_started();
                let request = request.map(|body| {
                    axum::body::Body::new(TimedBody::watched(body, body_timeout, watch.clone()))
                });
                let (router, watch) = (router.clone(), watch.clone());
                async move {
                    let response = router.oneshot(request).await?;
                    // A route that reads no body is served once it answers.
                    watch.serving();
                    Ok::<_, Infallible>(
                        response.map(|body| axum::body::Body::new(AnswerBody::new(body, watch))),
                    )
                }
            })
        };
        let io = TokioIo::new(WatchedIo::new(stream, watch.clone()));
        let mut conn = pin!(self.http.serve_connection(io, service));
        let mut stopping = pin!(self.stopping.cancelled());
        let mut evicted = pin!(watch.evicted.notified());
        let mut timer = pin!(tokio::time::sleep_until(Instant::now()));
        let mut draining = false;
        let end = poll_fn(|cx| {
            if !draining && stopping.as_mut().poll(cx).is_ready() {
                conn.as_mut().graceful_shutdown();
                draining = true;
            }
            if let Poll::Ready(result) = conn.as_mut().poll(cx) {
                return Poll::Ready(result.err().map_or("closed", |_| "failed"));
            }
            // Only a connection not serving is evicted or timed out: its phase is read after
            // the connection's own poll, which is what moves it.
            if watch.phase() == Phase::Busy {
                return Poll::Pending;
            }
            if evicted.as_mut().poll(cx).is_ready() {
                return Poll::Ready("evicted");
            }
            if let Some(deadline) = watch.deadline(&self.limits) {
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
                if timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(match watch.phase() {
                        Phase::Head => "header timeout",
                        _ => "idle timeout",
                    });
                }
            }
            Poll::Pending
        })
        .await;
        tracing::trace!(end, "connection ended");
    }
}

/// The open connections, by accept order.
#[derive(Debug, Default)]
struct Open {
    watches: Mutex<BTreeMap<u64, Arc<Watch>>>,
    next_id: std::sync::atomic::AtomicU64,
    /// Notified whenever a connection ends.
    closed: Notify,
}

impl Open {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Watch>>> {
        self.watches
            .lock()
            .expect("the connection registry is never poisoned")
    }

    fn insert(&self, watch: Arc<Watch>) -> u64 {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.lock().insert(id, watch);
        id
    }

    fn remove(&self, id: u64) {
        self.lock().remove(&id);
        self.closed.notify_waiters();
    }

    fn len(&self) -> usize {
        self.lock().len()
    }

    /// Asks the oldest connection not serving a request, other than `keep`, to close: one
    /// still waiting for its head first, else the longest idle or still sending its body.
    /// False when all are serving.
    fn evict_one(&self, keep: u64) -> bool {
        let open = self.lock();
        let victim = open
            .iter()
            .filter(|(id, watch)| **id != keep && watch.evictable())
            .min_by_key(|(_, watch)| (watch.phase() != Phase::Head, watch.since()));
        match victim {
            Some((_, watch)) => {
                watch.evict();
                true
            }
            None => false,
        }
    }

    /// Completes when a new connection may be accepted: below `max`, or at it with one that
    /// can be evicted. Rechecks every 50 ms while all are serving (a request ending does not
    /// notify).
    async fn room(&self, max: usize) {
        loop {
            let closed = self.closed.notified();
            {
                let open = self.lock();
                if open.len() < max || open.values().any(|w| w.evictable()) {
                    return;
                }
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), closed).await;
        }
    }

    /// Completes when every connection has ended.
    async fn drained(&self) {
        loop {
            let mut closed = pin!(self.closed.notified());
            closed.as_mut().enable();
            if self.lock().is_empty() {
                return;
            }
            closed.await;
        }
    }
}
