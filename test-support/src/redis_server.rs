//! A private `redis-server` on a free loopback port, which a test may kill and restart, and
//! a private Redis Cluster of such servers ([`cluster`]).

pub mod cluster;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::port::free_port;

/// A `redis-server` child process; killed when dropped.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    /// Options after the port and before the defaults, kept for a restart.
    options: Vec<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server that keeps nothing on disk, on a free port.
    pub fn start() -> Self {
        Self::start_with(free_port(), Vec::new())
    }

    /// Starts a server that writes every change to an append-only file before it answers
    /// (`appendfsync always`, in a directory of its own): a restart finds everything it
    /// acknowledged, as a quota store in production keeps it.
    pub fn start_persistent() -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("tower-llm-quota-redis-{port}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory for the append-only file");
        let options = ["--appendonly", "yes", "--appendfsync", "always", "--dir"]
            .into_iter()
            .map(String::from)
            .chain([dir.display().to_string()])
            .collect();
        Self::start_with(port, options)
    }

    /// Starts a server on `port` with more `options` (`--name value` pairs), kept for its
    /// restarts.
    pub fn start_with(port: u16, options: Vec<String>) -> Self {
        let mut server = Self {
            port,
            options,
            child: None,
        };
        server.restart();
        server
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server with SIGKILL: no shutdown, connections cut.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server with SIGSTOP: connections stay open and nothing answers until
    /// [`resume`](Self::resume).
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused server run again with SIGCONT.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            let status = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status()
                .expect("kill(1) runs");
            assert!(status.success(), "kill {signal} failed");
        }
    }

    /// Starts the server again on the same port (empty unless it keeps an append-only file).
    pub fn restart(&mut self) {
        self.kill();
        let mut child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(&self.options)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start `redis-server` ({e}): these tests need it on the PATH; \
                     install it with `apt-get install redis-server` (Debian, Ubuntu) or \
                     `brew install redis` (macOS)"
                )
            });
        // No polling: the server says when it accepts connections. Its log is then drained
        // on a thread of its own, so that it never blocks on a full pipe.
        let log = child.stdout.take().expect("piped");
        let mut lines = BufReader::new(log).lines();
        let ready = lines
            .by_ref()
            .map_while(Result::ok)
            .any(|line| line.contains("Ready to accept connections"));
        assert!(ready, "redis-server stopped before accepting connections");
        std::thread::spawn(move || lines.for_each(drop));
        self.child = Some(child);
        assert_eq!(self.command("PING"), "+PONG");
    }

    /// Sends one inline command and returns the first line of the reply ("" if none).
    pub fn command(&self, command: &str) -> String {
        self.reply(command).lines().next().unwrap_or("").to_owned()
    }

    /// The scripts it ran since its statistics were last reset (`EVALSHA` and `EVAL`): calls,
    /// and the microseconds it spent in them.
    pub fn script_stats(&self) -> (u64, u64) {
        let stats = self.reply("INFO commandstats");
        let field = |line: &str, name: &str| -> u64 {
            line.split(&format!("{name}="))
                .nth(1)
                .and_then(|rest| rest.split(',').next())
                .and_then(|value| value.parse().ok())
                .unwrap_or(0)
        };
        stats
            .lines()
            .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
            .fold((0, 0), |(calls, usec), line| {
                (calls + field(line, "calls"), usec + field(line, "usec"))
            })
    }

    /// Sends one inline command and returns its reply as read at once (up to 4 kB; "" if
    /// none).
    pub fn reply(&self, command: &str) -> String {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return String::new();
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        if stream
            .write_all(format!("{command}\r\n").as_bytes())
            .is_err()
        {
            return String::new();
        }
        let mut reply = [0u8; 4096];
        let n = stream.read(&mut reply).unwrap_or(0);
        String::from_utf8_lossy(&reply[..n]).into_owned()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
