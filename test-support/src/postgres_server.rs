//! Postgres for the tests: a database of its own on the machine's server (created for the test
//! and dropped after it), or a private cluster on a free loopback port, which a test may kill
//! and restart.
//!
//! The machine's server is `TEST_POSTGRES_URL` (a server URL whose user may create databases),
//! by default `postgres://postgres@127.0.0.1:5432/postgres` (trust authentication). A private
//! cluster is made with `initdb` and run with `pg_ctl` (Debian's `postgresql` package: on the
//! `PATH`, or in `/usr/lib/postgresql/<version>/bin`), as the `postgres` user when the test
//! runs as root (Postgres refuses to run as root). It runs with `fsync=off`: a test kills the
//! server's processes, never the machine, and what a commit wrote is in the kernel's cache, so
//! a restart after `pg_ctl stop -m immediate` (a crash) still finds every commit.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::port::free_port;

/// The machine's server, for tests that neither kill nor restart it.
fn server_url() -> String {
    std::env::var("TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// Runs `sql` through `psql` against `url`: its output (tuples only, unaligned).
///
/// # Panics
///
/// When `psql` is missing or the statement fails.
pub fn psql(url: &str, sql: &str) -> String {
    let output = try_psql(url, sql).unwrap_or_else(|e| {
        panic!(
            "cannot run `psql` ({e}): these tests need the PostgreSQL client on the PATH \
             (`apt-get install postgresql-client`)"
        )
    });
    assert!(
        output.status.success(),
        "psql {sql:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

fn try_psql(url: &str, sql: &str) -> std::io::Result<Output> {
    Command::new("psql")
        .args([
            "-X",
            "-q",
            "-t",
            "-A",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            url,
            "-c",
            sql,
        ])
        .output()
}

static DATABASES: AtomicU32 = AtomicU32::new(0);

/// A database of its own on the machine's server, dropped when this is dropped.
#[derive(Debug)]
pub struct TestDatabase {
    server: String,
    name: String,
    url: String,
}

impl TestDatabase {
    /// Creates a database with a name of its own (the process id and a count).
    ///
    /// # Panics
    ///
    /// When the server cannot be reached: the message says which and how to set it.
    pub fn create() -> Self {
        let server = server_url();
        let name = format!(
            "llmq_test_{}_{}",
            std::process::id(),
            DATABASES.fetch_add(1, Ordering::Relaxed)
        );
        let created = try_psql(&server, &format!("CREATE DATABASE {name}"));
        match created {
            Ok(output) if output.status.success() => {}
            Ok(output) => panic!(
                "cannot create a test database on {server} ({}): these tests need a \
                 PostgreSQL server; set TEST_POSTGRES_URL to one whose user may create \
                 databases",
                String::from_utf8_lossy(&output.stderr).trim()
            ),
            Err(e) => panic!("cannot run `psql` ({e}): install the PostgreSQL client"),
        }
        let url = with_database(&server, &name);
        Self { server, name, url }
    }

    /// Its URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Runs `sql` in it through `psql`.
    pub fn psql(&self, sql: &str) -> String {
        psql(&self.url, sql)
    }

    /// The transactions it has committed and rolled back, as its statistics say once every
    /// backend has reported (they report at most every second: this waits 1.5 s first).
    pub fn transactions(&self) -> u64 {
        std::thread::sleep(std::time::Duration::from_millis(1_500));
        self.psql(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database \
             WHERE datname = current_database()",
        )
        .parse()
        .unwrap()
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let _ = try_psql(
            &self.server,
            &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        );
    }
}

/// `url` naming the database `name` instead of its own.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let authority_end = base
        .find("://")
        .map(|scheme| scheme + 3)
        .and_then(|start| base[start..].find('/').map(|slash| start + slash));
    let base = match authority_end {
        Some(end) => &base[..end],
        None => base,
    };
    match query {
        Some(query) => format!("{base}/{name}?{query}"),
        None => format!("{base}/{name}"),
    }
}

/// A private Postgres cluster on a free loopback port; stopped (immediately) and deleted when
/// dropped.
#[derive(Debug)]
pub struct PostgresServer {
    port: u16,
    dir: PathBuf,
    bin: PathBuf,
}

impl PostgresServer {
    /// Makes a cluster in a temporary folder and starts it.
    ///
    /// # Panics
    ///
    /// When `initdb` or `pg_ctl` cannot be found or fail: the message says how to install them.
    pub fn start() -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("tower-llm-quota-pg-{port}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a folder for the cluster");
        let server = Self {
            port,
            dir,
            bin: bin_dir(),
        };
        if as_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&server.dir)
                .status()
                .expect("chown runs");
            assert!(status.success(), "chown of the cluster's folder");
        }
        let data = server.data();
        server.run(
            "initdb",
            &[
                "-D",
                &data,
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        server.run_pg_ctl("start");
        server
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`
    pub fn url(&self) -> String {
        self.url_via(self.port)
    }

    /// The URL of this cluster's database reached through `port` (a proxy in front of it).
    pub fn url_via(&self, port: u16) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/postgres")
    }

    /// Runs `sql` through `psql`.
    pub fn psql(&self, sql: &str) -> String {
        psql(&self.url(), sql)
    }

    /// Stops the server as a crash does (`pg_ctl stop -m immediate`: every process quits at
    /// once, connections cut; the next start recovers from the write-ahead log).
    pub fn kill(&self) {
        self.run_pg_ctl_with(&["stop", "-m", "immediate"], false);
    }

    /// Starts it again after [`kill`](Self::kill).
    pub fn start_again(&self) {
        self.run_pg_ctl("start");
    }

    /// Restarts it as after a crash (`pg_ctl restart -m immediate`), waiting until it accepts
    /// connections.
    pub fn restart_immediate(&self) {
        self.run_pg_ctl_with(&["restart", "-m", "immediate"], true);
    }

    /// Makes every new transaction read-only (`default_transaction_read_only`), or lifts it:
    /// writes are refused, as on a full disk or a standby.
    pub fn refuse_writes(&self, refused: bool) {
        let value = if refused { "on" } else { "off" };
        self.psql(&format!(
            "ALTER SYSTEM SET default_transaction_read_only = {value}"
        ));
        self.psql("SELECT pg_reload_conf()");
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    fn run_pg_ctl(&self, action: &str) {
        self.run_pg_ctl_with(&[action], true);
    }

    fn run_pg_ctl_with(&self, action: &[&str], must: bool) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300 \
             -c full_page_writes=off",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("log").display().to_string();
        let data = self.data();
        let mut args = vec!["-D", &data, "-w", "-t", "60", "-l", &log, "-o", &options];
        args.extend_from_slice(action);
        let output = self.command("pg_ctl", &args).output().expect("pg_ctl runs");
        if must {
            assert!(
                output.status.success(),
                "pg_ctl {action:?} failed: {}{}",
                String::from_utf8_lossy(&output.stderr),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
    }

    fn run(&self, program: &str, args: &[&str]) {
        let output = self
            .command(program, args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run `{program}` ({e}): install `postgresql`"));
        assert!(
            output.status.success(),
            "{program} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// `program` from the cluster's binaries, as the `postgres` user when running as root.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let path = self.bin.join(program);
        let mut command = if as_root() {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(&path);
            command
        } else {
            Command::new(&path)
        };
        command.args(args);
        command
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.run_pg_ctl_with(&["stop", "-m", "immediate"], false);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Where `initdb` and `pg_ctl` are: on the `PATH`, or Debian's `/usr/lib/postgresql/*/bin`.
fn bin_dir() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).find(|dir| dir.join("initdb").is_file()));
    if let Some(dir) = on_path {
        return dir;
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("bin"))
        .filter(|bin| bin.join("initdb").is_file())
        .collect();
    versions.sort();
    versions.pop().unwrap_or_else(|| {
        panic!(
            "`initdb` was not found (on the PATH or in /usr/lib/postgresql/*/bin): these tests \
             start private clusters; install `postgresql` (`apt-get install postgresql`)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn a_url_names_another_database() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/postgres", "t1"),
            "postgres://postgres@127.0.0.1:5432/t1"
        );
        assert_eq!(
            with_database("postgres://u:p@h/db?sslmode=disable", "t2"),
            "postgres://u:p@h/t2?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h:5", "t3"), "postgres://h:5/t3");
    }
}
