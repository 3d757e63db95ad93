//! What one connection is doing, and since when: waiting for a request head, serving a
//! request, or idle between requests. Its reads, its requests and its answers move it from
//! one phase to the next; its deadline follows from the phase.

use std::io;
use std::pin::Pin;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::limits::ConnectionLimits;

/// What a connection is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Waiting for a request head: since its accept, or since its first byte after idling.
    Head = 0,
    /// Serving a request: waiting in a queue, calling the provider, streaming its answer.
    Busy = 1,
    /// Between an answer and the next request's first byte.
    Idle = 2,
    /// Reading a request's body, its head read: nothing is served, reserved or sent yet, so
    /// a slow body may be closed to make room like a slow head.
    Body = 3,
}

impl Phase {
    fn from_u8(value: u8) -> Self {
        match value {
            0 => Phase::Head,
            1 => Phase::Busy,
            3 => Phase::Body,
            _ => Phase::Idle,
        }
    }
}

/// A connection's phase and when it began, shared by its reads, its requests and the server.
#[derive(Debug)]
pub(crate) struct Watch {
    phase: AtomicU8,
    /// When the phase began, in milliseconds from [`epoch`].
    since: AtomicU64,
    /// Set, and notified, when the server closes this connection to make room for a new one.
    evicting: AtomicBool,
    pub(crate) evicted: Notify,
}

/// The instant the phases' times count from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    u64::try_from(epoch().elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl Watch {
    /// A connection just accepted: it waits for its first request head.
    pub(crate) fn accepted() -> Self {
        Self {
            phase: AtomicU8::new(Phase::Head as u8),
            since: AtomicU64::new(now_ms()),
            evicting: AtomicBool::new(false),
            evicted: Notify::new(),
        }
    }

    pub(crate) fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Ordering::Acquire))
    }

    /// Milliseconds from the epoch to the start of the phase.
    pub(crate) fn since(&self) -> u64 {
        self.since.load(Ordering::Acquire)
    }

    fn enter(&self, phase: Phase) {
        self.since.store(now_ms(), Ordering::Release);
        self.phase.store(phase as u8, Ordering::Release);
    }

    /// Whether the connection may be closed to make room: not serving, not already asked.
    pub(crate) fn evictable(&self) -> bool {
        self.phase() != Phase::Busy && !self.evicting.load(Ordering::Acquire)
    }

    /// Asks the connection to close.
    pub(crate) fn evict(&self) {
        self.evicting.store(true, Ordering::Release);
        self.evicted.notify_one();
    }

    /// A request's head was read: its body comes next.
    pub(crate) fn request_started(&self) {
        self.enter(Phase::Body);
    }

    /// The request's body was read whole, or its answer began: the request is served.
    pub(crate) fn serving(&self) {
        if self.phase.load(Ordering::Relaxed) == Phase::Body as u8 {
            self.enter(Phase::Busy);
        }
    }

    /// The request's answer ended (or was dropped).
    pub(crate) fn request_ended(&self) {
        self.enter(Phase::Idle);
    }

    /// Bytes came: an idle connection starts a request head.
    fn bytes_read(&self) {
        if self.phase.load(Ordering::Relaxed) == Phase::Idle as u8 {
            self.enter(Phase::Head);
        }
    }

    /// When the connection is closed unless its phase changes first; none while it serves.
    pub(crate) fn deadline(&self, limits: &ConnectionLimits) -> Option<Instant> {
        let allowed = match self.phase() {
            Phase::Head => limits.header_timeout,
            Phase::Idle => limits.idle_timeout,
            // A body has its own timeout, counted by its reader.
            Phase::Busy | Phase::Body => return None,
        };
        Some(epoch() + Duration::from_millis(self.since()) + allowed)
    }
}

pin_project_lite::pin_project! {
    /// A connection's socket, telling its [`Watch`] when bytes come.
    #[derive(Debug)]
    pub(crate) struct WatchedIo<T> {
        #[pin]
        inner: T,
        watch: std::sync::Arc<Watch>,
    }
}

impl<T> WatchedIo<T> {
    pub(crate) fn new(inner: T, watch: std::sync::Arc<Watch>) -> Self {
        Self { inner, watch }
    }
}

impl<T: AsyncRead> AsyncRead for WatchedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let read = this.inner.poll_read(cx, buf);
        if buf.filled().len() > before {
            this.watch.bytes_read();
        }
        read
    }
}

impl<T: AsyncWrite> AsyncWrite for WatchedIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.project().inner.poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.project().inner.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnectionLimits {
        ConnectionLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: 10,
            max_header_bytes: 32_768,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_follows_the_phase() {
        let watch = Watch::accepted();
        let start = Instant::now();
        let deadline = |watch: &Watch| watch.deadline(&limits()).map(|d| d - start);
        // Accepted: ten seconds for the first head (to the millisecond the phase is kept in).
        let head = deadline(&watch).unwrap();
        assert!(head.abs_diff(Duration::from_secs(10)) <= Duration::from_millis(1));
        watch.request_started();
        assert_eq!(deadline(&watch), None);
        assert!(
            watch.evictable(),
            "its body is not read yet: nothing is served"
        );
        watch.serving();
        assert!(!watch.evictable());
        tokio::time::advance(Duration::from_secs(100)).await;
        watch.request_ended();
        let idle = deadline(&watch).unwrap();
        assert!(idle.abs_diff(Duration::from_secs(160)) <= Duration::from_millis(1));
        // A byte after 5 s of idling: ten seconds from it for the rest of the head.
        tokio::time::advance(Duration::from_secs(5)).await;
        watch.bytes_read();
        assert_eq!(watch.phase(), Phase::Head);
        let head = deadline(&watch).unwrap();
        assert!(head.abs_diff(Duration::from_secs(115)) <= Duration::from_millis(1));
        // More bytes of the same head do not extend it.
        tokio::time::advance(Duration::from_secs(5)).await;
        watch.bytes_read();
        assert_eq!(deadline(&watch), Some(head));
    }
}
