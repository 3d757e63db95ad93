//! What a connection may take: its timeouts, the size of its head, how many connections are
//! held at once (kept below the process's open-file limit), and how the accept loop backs off
//! when the system refuses a connection.

use std::io;
use std::time::Duration;

use super::super::config::{ConfigError, ServerConfig};

/// The limits every connection is held to, resolved at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConnectionLimits {
    /// From a connection's accept, or from its first byte after an idle spell, to a complete
    /// request head.
    pub(crate) header_timeout: Duration,
    /// From a request's head to the end of its body.
    pub(crate) body_timeout: Duration,
    /// Between the end of an answer and the next request's first byte.
    pub(crate) idle_timeout: Duration,
    /// The most connections held at once.
    pub(crate) max_connections: usize,
    /// The largest request head.
    pub(crate) max_header_bytes: usize,
}

impl ConnectionLimits {
    /// The limits of `server`, with the connections capped below `open_files` (the process's
    /// limit on open files, when it has one). Returns the limits and, when the configured
    /// cap was lowered to fit, a note saying so.
    pub(crate) fn new(
        server: &ServerConfig,
        open_files: Option<u64>,
    ) -> Result<(Self, Option<String>), ConfigError> {
        let [header_timeout, body_timeout, idle_timeout] = server.timeouts()?;
        let within = open_files.map(connections_within);
        let configured = server.max_connections.map(std::num::NonZeroUsize::get);
        let (max_connections, note) = match (configured, within) {
            (Some(asked), Some(fits)) if asked > fits => (
                fits,
                Some(format!(
                    "server.max_connections {asked} lowered to {fits}: the open-file limit is {}",
                    open_files.unwrap_or_default()
                )),
            ),
            (Some(asked), _) => (asked, None),
            (None, Some(fits)) => (fits, None),
            (None, None) => (UNLIMITED_FILES_CONNECTIONS, None),
        };
        let limits = Self {
            header_timeout,
            body_timeout,
            idle_timeout,
            max_connections,
            max_header_bytes: server.max_header_bytes,
        };
        Ok((limits, note))
    }
}

/// The cap when the process has no open-file limit.
const UNLIMITED_FILES_CONNECTIONS: usize = 100_000;

/// The connections held below an open-file limit of `limit`: one descriptor each, less a
/// reserve for the listener, the runtime, upstream and Redis connections (an eighth of the
/// limit, at least 64).
pub(crate) fn connections_within(limit: u64) -> usize {
    let reserve = (limit / 8).max(64);
    usize::try_from(limit.saturating_sub(reserve))
        .unwrap_or(usize::MAX)
        .max(1)
}

/// The process's soft limit on open files (`RLIMIT_NOFILE`), when it has one.
pub(crate) fn open_files_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        rustix::process::getrlimit(rustix::process::Resource::Nofile).current
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// How long the accept loop waits after an error: nothing after an error of one connection
/// (it is gone, the next may be fine), and a doubling pause, from 5 ms to 1 s, after an error
/// of the process or the system (no file descriptor, no memory), so it never spins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AcceptBackoff {
    next: Duration,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(5);
    const MAX: Duration = Duration::from_secs(1);

    pub(crate) fn new() -> Self {
        Self { next: Self::FIRST }
    }

    /// The pause after `error`, if any.
    pub(crate) fn after(&mut self, error: &io::Error) -> Option<Duration> {
        use io::ErrorKind::*;
        if matches!(
            error.kind(),
            ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted | WouldBlock
        ) {
            return None;
        }
        let pause = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        Some(pause)
    }

    /// A connection was accepted: the next error starts from the shortest pause.
    pub(crate) fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_stay_below_the_open_file_limit() {
        assert_eq!(connections_within(1024), 896);
        assert_eq!(connections_within(20_000), 17_500);
        assert_eq!(connections_within(256), 192);
        assert_eq!(connections_within(10), 1);
    }

    #[test]
    fn a_configured_cap_above_the_limit_is_lowered_and_said() {
        let server = ServerConfig {
            max_connections: std::num::NonZeroUsize::new(5_000),
            ..ServerConfig::default()
        };
        let (limits, note) = ConnectionLimits::new(&server, Some(1024)).unwrap();
        assert_eq!(limits.max_connections, 896);
        assert!(note.unwrap().contains("lowered to 896"));
        let (limits, note) = ConnectionLimits::new(&server, Some(65_536)).unwrap();
        assert_eq!((limits.max_connections, note), (5_000, None));
        let (limits, _) = ConnectionLimits::new(&ServerConfig::default(), Some(1024)).unwrap();
        assert_eq!(limits.max_connections, 896);
        assert_eq!(limits.header_timeout, Duration::from_secs(10));
    }

    #[test]
    fn absurd_timeouts_are_refused() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e9] {
            let server = ServerConfig {
                idle_timeout_seconds: bad,
                ..ServerConfig::default()
            };
            let error = ConnectionLimits::new(&server, None).unwrap_err();
            assert!(error.0.contains("idle_timeout_seconds"), "{}", error.0);
        }
    }

    #[test]
    fn accept_errors_back_off_without_spinning() {
        let mut backoff = AcceptBackoff::new();
        let reset = io::Error::from(io::ErrorKind::ConnectionReset);
        assert_eq!(backoff.after(&reset), None);
        // EMFILE: too many open files.
        let no_files = io::Error::from_raw_os_error(24);
        let pauses: Vec<u64> = (0..10)
            .map(|_| backoff.after(&no_files).unwrap().as_millis() as u64)
            .collect();
        assert_eq!(pauses, [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        backoff.reset();
        assert_eq!(backoff.after(&no_files), Some(Duration::from_millis(5)));
    }
}
