//! The connection to Redis: one server through a [`ConnectionManager`], or a Redis Cluster
//! through redis-rs's cluster client, behind one [`ConnectionLike`].
//!
//! Both reconnect by themselves. The manager reconnects to its one server. The cluster client
//! keeps a connection per primary and a map of slots: a `MOVED` or `ASK` reply, or a lost
//! connection, makes it read the slots again from the nodes it still reaches, so after a
//! failover (a replica promoted) the next call of a script finds the new primary, where a
//! missing script is loaded again on `NOSCRIPT` like after a restart. Neither retries more than
//! once: the caller's timeout, breaker and [`FailurePolicy`](crate::FailurePolicy) decide what
//! happens while a node is out of reach.

use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClient, ClusterConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, Value};

/// Where the Redis servers are: one server, or seed nodes of a cluster (any of them is enough
/// to find the others).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Servers {
    /// One server (or a proxy in front of several): `redis://host:port/db`.
    Node(String),
    /// Nodes of a Redis Cluster: `redis://host:port` each.
    Cluster(Vec<String>),
}

/// How long to wait for a connection and for each reply, and the longest pause between two
/// attempts to connect.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    pub(crate) connect: Duration,
    pub(crate) response: Duration,
    pub(crate) max_delay: Duration,
}

/// A connection to one server or to a cluster; clones share it.
#[derive(Clone)]
pub(crate) enum Connection {
    Node(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Servers {
    /// A connection made in the background: an unreachable server is an error of each
    /// command, not of this call. Fails on an invalid address, or on no address at all.
    /// Must be called within a tokio runtime.
    pub(crate) fn connect_lazy(&self, timeouts: Timeouts) -> RedisResult<Connection> {
        match self {
            Self::Node(url) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeouts.connect))
                    .set_response_timeout(Some(timeouts.response))
                    .set_number_of_retries(1)
                    .set_min_delay(Duration::from_millis(10))
                    .set_max_delay(timeouts.max_delay);
                let client = ::redis::Client::open(url.as_str())?;
                Ok(Connection::Node(ConnectionManager::new_lazy_with_config(
                    client, config,
                )?))
            }
            Self::Cluster(nodes) => {
                if nodes.is_empty() {
                    return Err(RedisError::from((
                        ErrorKind::InvalidClientConfig,
                        "a Redis Cluster needs the address of at least one node",
                    )));
                }
                let client = ClusterClient::builder(nodes.iter().map(String::as_str))
                    .retries(1)
                    .min_retry_wait(10)
                    .max_retry_wait(
                        u64::try_from(timeouts.max_delay.as_millis())
                            .unwrap_or(u64::MAX)
                            .max(11),
                    )
                    .build()?;
                let config = ClusterConfig::new()
                    .set_connection_timeout(timeouts.connect)
                    .set_response_timeout(timeouts.response);
                Ok(Connection::Cluster(
                    client.get_pending_async_connection_with_config(config),
                ))
            }
        }
    }

    /// A client of each server, for subscriptions: a message published on any node of a
    /// cluster reaches the subscribers of every node, so a subscriber may use any of them.
    pub(crate) fn subscription_clients(&self) -> RedisResult<Vec<::redis::Client>> {
        let urls = match self {
            Self::Node(url) => std::slice::from_ref(url),
            Self::Cluster(nodes) => nodes.as_slice(),
        };
        urls.iter()
            .map(|url| ::redis::Client::open(url.as_str()))
            .collect()
    }

    /// Whether keys of one script must share a hash slot.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Node(connection) => connection.req_packed_command(cmd),
            Self::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Node(connection) => connection.req_packed_commands(pipeline, offset, count),
            Self::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Node(connection) => connection.get_db(),
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Node(_) => "Connection::Node",
            Self::Cluster(_) => "Connection::Cluster",
        })
    }
}

/// The part of `key` that Redis Cluster hashes to choose its slot: what lies between the
/// first `{` and the first `}` after it when that is not empty, else the whole key.
pub(crate) fn hash_tag(key: &[u8]) -> &[u8] {
    let Some(open) = key.iter().position(|&b| b == b'{') else {
        return key;
    };
    let inner = &key[open + 1..];
    match inner.iter().position(|&b| b == b'}') {
        Some(len) if len > 0 => &inner[..len],
        _ => key,
    }
}

/// Checks that `keys`, the keys of one script, all hash to one slot of a cluster: a script
/// whose keys cross slots is refused by every node. The error is
/// [`ErrorKind::InvalidClientConfig`], naming two keys that differ.
pub(crate) fn same_slot<'a>(keys: impl IntoIterator<Item = &'a str>) -> RedisResult<()> {
    let mut keys = keys.into_iter();
    let Some(first) = keys.next() else {
        return Ok(());
    };
    let tag = hash_tag(first.as_bytes());
    match keys.find(|key| hash_tag(key.as_bytes()) != tag) {
        None => Ok(()),
        Some(other) => Err(RedisError::from((
            ErrorKind::InvalidClientConfig,
            "keys of one script would lie in different Redis Cluster slots (braces in the \
             key prefix change the hash tag)",
            format!("`{first}` and `{other}`"),
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_tag_follows_the_cluster_rule() {
        assert_eq!(hash_tag(b"llmq:{acct}:requests:60000"), b"acct");
        assert_eq!(hash_tag(b"{user1000}.following"), b"user1000");
        // The first `{` and the first `}` after it.
        assert_eq!(hash_tag(b"foo{{bar}}zap"), b"{bar");
        assert_eq!(hash_tag(b"foo{bar}{zap}"), b"bar");
        // An empty or unclosed tag: the whole key.
        assert_eq!(hash_tag(b"foo{}{bar}"), b"foo{}{bar}");
        assert_eq!(hash_tag(b"foo{bar"), b"foo{bar");
        assert_eq!(hash_tag(b"plain"), b"plain");
    }

    #[test]
    fn keys_crossing_slots_are_a_configuration_error() {
        assert!(same_slot(["p:{a}:x", "p:{a}:y:held", "p:{a}:r:1"]).is_ok());
        assert!(same_slot([]).is_ok());
        let error = same_slot(["p{}:{a}:x", "p{}:{a}:y"]).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidClientConfig);
        assert!(
            error.to_string().contains("`p{}:{a}:x` and `p{}:{a}:y`"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_cluster_needs_a_node() {
        let timeouts = Timeouts {
            connect: Duration::from_millis(100),
            response: Duration::from_millis(50),
            max_delay: Duration::from_millis(100),
        };
        let error = Servers::Cluster(Vec::new())
            .connect_lazy(timeouts)
            .unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidClientConfig);
        assert!(
            Servers::Cluster(vec!["not a url".to_owned()])
                .connect_lazy(timeouts)
                .is_err()
        );
        // Lazy: nobody listens there, and that is an error of each command only.
        assert!(
            Servers::Cluster(vec!["redis://127.0.0.1:1".to_owned()])
                .connect_lazy(timeouts)
                .is_ok()
        );
        assert!(
            Servers::Node("redis://127.0.0.1:1".to_owned())
                .connect_lazy(timeouts)
                .is_ok()
        );
    }
}
