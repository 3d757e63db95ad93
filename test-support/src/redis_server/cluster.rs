//! A private Redis Cluster: primaries on free loopback ports with their cluster state in a
//! temporary directory, made a cluster by `redis-cli --cluster create`. A test may kill a
//! node and restart it; it rejoins with its slots (its data is gone, nothing is saved).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::RedisServer;
use crate::port::free_port;

/// How long a node may be unreachable before the others count it failed: short, so that a
/// test of a killed node takes seconds.
const NODE_TIMEOUT_MS: u32 = 500;

/// The servers of a cluster (its primaries, then any replicas added) and their directory; all
/// removed when dropped.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    dir: PathBuf,
}

/// The options of a cluster node on `port` keeping its state in `dir`.
fn node_options(port: u16, dir: &Path) -> Vec<String> {
    let bus = free_port();
    let options = [
        "--cluster-enabled",
        "yes",
        "--dir",
        dir.to_str().expect("a UTF-8 temporary directory"),
        "--cluster-config-file",
        &format!("nodes-{port}.conf"),
        "--cluster-port",
        &bus.to_string(),
        "--cluster-node-timeout",
        &NODE_TIMEOUT_MS.to_string(),
        "--cluster-require-full-coverage",
        "no",
        // A replica's first copy at once, not after the default 5 s.
        "--repl-diskless-sync-delay",
        "0",
    ];
    options.map(str::to_owned).to_vec()
}

/// Runs `redis-cli --cluster <args>`.
///
/// # Panics
///
/// When it fails.
fn redis_cli_cluster(args: &[String]) {
    let done = Command::new("redis-cli")
        .arg("--cluster")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("`redis-cli` on the PATH (it comes with redis-server)");
    assert!(
        done.status.success(),
        "redis-cli --cluster {args:?} failed: {}",
        String::from_utf8_lossy(&done.stdout)
    );
}

impl RedisCluster {
    /// Starts `primaries` servers with `--cluster-enabled yes`, gives them the 16,384 slots in
    /// equal ranges (in the order of [`RedisCluster::urls`]) and waits until every node says
    /// `cluster_state:ok`.
    ///
    /// Slots of a failed node do not stop the others (`cluster-require-full-coverage no`).
    pub fn start(primaries: usize) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tower-llm-quota-cluster-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let nodes = (0..primaries)
            .map(|_| {
                let port = free_port();
                RedisServer::start_with(port, node_options(port, &dir))
            })
            .collect::<Vec<_>>();
        let cluster = Self { nodes, dir };
        let mut create = vec!["create".to_owned()];
        create.extend(cluster.addresses());
        create.extend(["--cluster-replicas", "0", "--cluster-yes"].map(str::to_owned));
        redis_cli_cluster(&create);
        cluster.wait_until_ok(Duration::from_secs(10));
        cluster
    }

    /// `redis://127.0.0.1:<port>` of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// `127.0.0.1:<port>` of every node.
    fn addresses(&self) -> Vec<String> {
        let address = |n: &RedisServer| format!("127.0.0.1:{}", n.port());
        self.nodes.iter().map(address).collect()
    }

    /// Starts a node replicating node `primary` and returns its index, once it has copied
    /// the primary's data and every node knows it.
    pub fn add_replica(&mut self, primary: usize) -> usize {
        let port = free_port();
        let replica = RedisServer::start_with(port, node_options(port, &self.dir));
        // `CLUSTER MYID` is a bulk string: its length, then the id.
        let id = self.nodes[primary].reply("CLUSTER MYID");
        let id = id.lines().nth(1).expect("a node id").to_owned();
        let address = |n: &RedisServer| format!("127.0.0.1:{}", n.port());
        redis_cli_cluster(&[
            "add-node".to_owned(),
            address(&replica),
            address(&self.nodes[primary]),
            "--cluster-slave".to_owned(),
            "--cluster-master-id".to_owned(),
            id,
        ]);
        let start = Instant::now();
        while !replica
            .reply("INFO replication")
            .contains("master_link_status:up")
        {
            assert!(start.elapsed() < Duration::from_secs(10), "no replication");
            // Real time: the servers are other processes, which announce this state nowhere
            // but in their replies; the paused clock has no hold on them.
            std::thread::sleep(Duration::from_millis(20));
        }
        self.nodes.push(replica);
        self.wait_until_ok(Duration::from_secs(10));
        self.nodes.len() - 1
    }

    /// Node `i`.
    pub fn node(&self, i: usize) -> &RedisServer {
        &self.nodes[i]
    }

    /// Node `i`, to kill or restart it.
    pub fn node_mut(&mut self, i: usize) -> &mut RedisServer {
        &mut self.nodes[i]
    }

    /// The node serving `key`'s slot: the one that does not redirect a command on it.
    pub fn owner(&self, key: &str) -> usize {
        let key = key.replace(' ', "_");
        (0..self.nodes.len())
            .find(|&i| {
                self.nodes[i]
                    .command(&format!("EXISTS {key}"))
                    .starts_with(':')
            })
            .unwrap_or_else(|| panic!("no node serves `{key}`"))
    }

    /// Waits until every running node (every one answering) says `cluster_state:ok`: it
    /// knows every other node and sees every slot served. Polls every 20 ms: the servers tell
    /// no event.
    ///
    /// # Panics
    ///
    /// When that does not happen within `within`.
    pub fn wait_until_ok(&self, within: Duration) {
        let start = Instant::now();
        loop {
            let states: Vec<String> = self
                .nodes
                .iter()
                .map(|n| n.reply("CLUSTER INFO"))
                .filter(|reply| !reply.is_empty())
                .collect();
            if states.iter().all(|s| s.contains("cluster_state:ok")) {
                return;
            }
            assert!(
                start.elapsed() < within,
                "the cluster is not ok after {within:?}: {states:?}"
            );
            // Real time, as above: the cluster's state is read from other processes.
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
