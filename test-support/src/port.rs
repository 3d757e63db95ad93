//! Loopback ports for the servers a test starts (and stops, and starts again on the same
//! port).
//!
//! Asking the system for a free port (binding port 0) hands out one of its ephemeral ports,
//! the range it also takes the local end of every outgoing connection from. Between the moment
//! the port is read and the moment the server binds it, or while a test restarts its server,
//! any connection of the machine may take it: the server then cannot start, and a client
//! reconnecting to the stopped server may even connect to itself (TCP's simultaneous open) and
//! read its own request as the reply. So the ports here come from below the ephemeral range,
//! where nothing takes a port unasked, and one process never hands out a port twice: a port
//! stays its server's across restarts.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// The first port handed out, and the end of the range (exclusive): below 32768, where
/// Linux's ephemeral range starts (BSDs and macOS start at 49152).
const FIRST: u32 = 10_000;
const END: u32 = 32_768;

/// Where this process's next port is looked for: a start spread by the process id, so that
/// test binaries running side by side look in different places (each still checks that the
/// port is free).
static NEXT: AtomicU32 = AtomicU32::new(0);

/// A loopback port below the ephemeral range that nobody listens on now and that this process
/// has not handed out before.
///
/// # Panics
///
/// When every port of the range is taken (some thousands of servers).
pub fn free_port() -> u16 {
    let span = END - FIRST;
    let start = std::process::id().wrapping_mul(7_919) % span;
    // Zero means "not started": the first call begins at `start`.
    let _ = NEXT.compare_exchange(0, start + 1, Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..span {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed) - 1;
        let port = u16::try_from(FIRST + offset % span).expect("below 32768");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port between {FIRST} and {END}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_free_below_the_ephemeral_range_and_never_handed_out_twice() {
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "a port handed out twice");
        assert!(ports.iter().all(|&p| (FIRST..END).contains(&u32::from(p))));
        // One taken by a listener is skipped.
        let next = NEXT.load(Ordering::Relaxed) - 1;
        let taken = u16::try_from(FIRST + next % (END - FIRST)).unwrap();
        let _listener = TcpListener::bind(("127.0.0.1", taken));
        assert_ne!(free_port(), taken);
    }
}
