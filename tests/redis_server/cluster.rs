//! A private Redis Cluster: primaries on free loopback ports with their cluster state in a
//! temporary directory, made a cluster by `redis-cli --cluster create`. A test may kill a
//! node and restart it; it rejoins with its slots (its data is gone, nothing is saved).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{RedisServer, free_port};

/// How long a node may be unreachable before the others count it failed: short, so that a
/// test of a killed node takes seconds.
const NODE_TIMEOUT_MS: u32 = 500;

/// The servers of a cluster without replicas, and their directory; all removed when dropped.
pub(crate) struct RedisCluster {
    nodes: Vec<RedisServer>,
    dir: PathBuf,
}

impl RedisCluster {
    /// Starts `primaries` servers with `--cluster-enabled yes`, gives them the 16,384 slots in
    /// equal ranges (in the order of [`RedisCluster::urls`]) and waits until every node says
    /// `cluster_state:ok`.
    ///
    /// Slots of a failed node do not stop the others (`cluster-require-full-coverage no`).
    pub(crate) fn start(primaries: usize) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tower-llm-quota-cluster-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let nodes = (0..primaries)
            .map(|_| {
                let (port, bus) = (free_port(), free_port());
                let options = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &format!("nodes-{port}.conf"),
                    "--cluster-port",
                    &bus.to_string(),
                    "--cluster-node-timeout",
                    &NODE_TIMEOUT_MS.to_string(),
                    "--cluster-require-full-coverage",
                    "no",
                    "--dir",
                    dir.to_str().expect("a UTF-8 temporary directory"),
                ];
                RedisServer::start_with(port, options.map(str::to_owned).to_vec())
            })
            .collect::<Vec<_>>();
        let cluster = Self { nodes, dir };
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(
                cluster
                    .nodes
                    .iter()
                    .map(|n| format!("127.0.0.1:{}", n.port())),
            )
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("`redis-cli` on the PATH (it comes with redis-server)");
        assert!(
            created.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&created.stdout)
        );
        cluster.wait_until_ok(Duration::from_secs(10));
        cluster
    }

    /// `redis://127.0.0.1:<port>` of every node.
    pub(crate) fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Node `i`.
    pub(crate) fn node(&self, i: usize) -> &RedisServer {
        &self.nodes[i]
    }

    /// Node `i`, to kill or restart it.
    pub(crate) fn node_mut(&mut self, i: usize) -> &mut RedisServer {
        &mut self.nodes[i]
    }

    /// The node serving `key`'s slot: the one that does not redirect a command on it.
    pub(crate) fn owner(&self, key: &str) -> usize {
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
    pub(crate) fn wait_until_ok(&self, within: Duration) {
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
