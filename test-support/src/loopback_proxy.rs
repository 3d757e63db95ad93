//! A loopback TCP proxy in front of a server, whose replies can be held back for a while (a
//! latency spike that makes a client's timeout fire after the server did the work) and whose
//! connections can be cut (a reset on the network).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// The proxy: accepts on a port of its own, connects each client to the server's port.
#[derive(Debug)]
pub struct LoopbackProxy {
    port: u16,
    /// How long each chunk of a reply is held before it is passed on (ms).
    delay_ms: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    /// Every connection accepted, its two ends: cut by [`LoopbackProxy::reset_connections`].
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl LoopbackProxy {
    /// A proxy to `127.0.0.1:<upstream>`.
    pub fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let port = listener.local_addr().expect("bound").port();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let open: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (delay, stopped, opened) = (delay_ms.clone(), stop.clone(), open.clone());
        thread::spawn(move || {
            for client in listener.incoming() {
                if stopped.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else { continue };
                // A server that is down (restarting): the client's connection is closed, and
                // it connects again.
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                if let (Ok(a), Ok(b)) = (client.try_clone(), server.try_clone()) {
                    let mut opened = opened.lock().unwrap_or_else(|e| e.into_inner());
                    // Ends already shut are dropped as new ones come.
                    opened.retain(|s| s.peer_addr().is_ok());
                    opened.extend([a, b]);
                }
                pipe(client.try_clone(), server.try_clone(), None);
                pipe(server.try_clone(), client.try_clone(), Some(delay.clone()));
            }
        });
        Self {
            port,
            delay_ms,
            stop,
            open,
        }
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Cuts every connection open now, both ends (the clients see a reset or an end of
    /// stream, and connect again).
    pub fn reset_connections(&self) {
        let open = std::mem::take(&mut *self.open.lock().unwrap_or_else(|e| e.into_inner()));
        for stream in open {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// `redis://127.0.0.1:<port>` through the proxy.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Holds every reply back by `delay` from now on (zero: passes them on at once).
    pub fn delay_replies(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.delay_ms.store(ms, Ordering::Relaxed);
    }
}

impl Drop for LoopbackProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accepting thread so that it sees the stop.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Copies `from` to `to` on a thread of its own, holding each chunk back by `delay` (ms) when
/// given; shuts both down when either side ends.
fn pipe(
    from: std::io::Result<TcpStream>,
    to: std::io::Result<TcpStream>,
    delay: Option<Arc<AtomicU64>>,
) {
    let (Ok(mut from), Ok(mut to)) = (from, to) else {
        return;
    };
    thread::spawn(move || {
        let mut buffer = [0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buffer) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let held = delay.as_ref().map_or(0, |d| d.load(Ordering::Relaxed));
            if held > 0 {
                thread::sleep(Duration::from_millis(held));
            }
            if to.write_all(&buffer[..n]).is_err() {
                break;
            }
        }
        let _ = from.shutdown(Shutdown::Both);
        let _ = to.shutdown(Shutdown::Both);
    });
}
