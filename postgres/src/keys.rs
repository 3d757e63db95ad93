//! The names of one quota's rows: every row of an account carries its tag (the account, or the
//! tenant plane its accounts share), which names the advisory lock its calls take in turn.

use tower_llm_quota::Limit;
use tower_llm_quota::tenant::Tenant;

/// The names of one quota's rows.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    /// `<prefix>:<quota key>`, or `<prefix>:<plane>:<quota key>`: the account's own rows.
    root: String,
    /// Where the tenant nodes' rows live, and the lock every call takes: the root, or
    /// `<prefix>:<plane>`.
    nodes: String,
}

impl Keys {
    /// The rows of the quota `quota_key`, its tenant nodes its own.
    pub(crate) fn new(prefix: &str, quota_key: &str) -> Self {
        let root = format!("{prefix}:{quota_key}");
        Self {
            nodes: root.clone(),
            root,
        }
    }

    /// The rows of the quota `quota_key` in the tenant plane `plane`: every account of the
    /// plane shares its lock and its tenant nodes' buckets.
    pub(crate) fn in_plane(prefix: &str, plane: &str, quota_key: &str) -> Self {
        let nodes = format!("{prefix}:{plane}");
        Self {
            root: format!("{nodes}:{quota_key}"),
            nodes,
        }
    }

    /// The lock every call on this quota takes, and the tag of its rows.
    pub(crate) fn tag(&self) -> &str {
        &self.nodes
    }

    /// The account's own rows: its line of processes, its leases.
    pub(crate) fn root(&self) -> &str {
        &self.root
    }

    /// The tenant nodes' rows: the paused nodes, the processes' leases on their slots.
    pub(crate) fn nodes(&self) -> &str {
        &self.nodes
    }

    /// The bucket of `limit`: one per dimension and period.
    pub(crate) fn bucket(&self, limit: &Limit) -> String {
        format!(
            "{}:{}:{}",
            self.root,
            limit.dimension().as_str(),
            limit.period().as_millis()
        )
    }

    /// The bucket of `limit` of the tenant node `node`.
    pub(crate) fn node_bucket(&self, node: &Tenant, limit: &Limit) -> String {
        format!(
            "{}/t/{}:{}:{}",
            self.nodes,
            node.as_str(),
            limit.dimension().as_str(),
            limit.period().as_millis()
        )
    }

    /// The caps over a period of the tenant node `node`, for every process.
    pub(crate) fn node_days(&self, node: &Tenant) -> String {
        format!("{}/t/{}:days", self.nodes, node.as_str())
    }

    /// The slots of the tenant node `node`'s calls in flight, for every process.
    pub(crate) fn node_slots(&self, node: &Tenant) -> String {
        format!("{}/t/{}:slots", self.nodes, node.as_str())
    }

    /// The record of reservation `id`.
    pub(crate) fn record(&self, id: &str) -> String {
        format!("{}/r/{id}", self.root)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU64;
    use tower_llm_quota::Dimension;

    #[test]
    fn accounts_of_one_plane_share_its_lock_and_their_nodes_buckets() {
        let rpm = Limit::per_minute(Dimension::Requests, NonZeroU64::new(500).unwrap());
        let alone = Keys::new("llmq", "openai");
        assert_eq!(alone.bucket(&rpm), "llmq:openai:requests:60000");
        assert_eq!(alone.tag(), "llmq:openai");
        let (openai, anthropic) = (
            Keys::in_plane("llmq", "gw", "openai"),
            Keys::in_plane("llmq", "gw", "anthropic"),
        );
        assert_eq!(openai.tag(), anthropic.tag());
        assert_eq!(anthropic.record("1"), "llmq:gw:anthropic/r/1");
        let node: Tenant = "acme/search".parse().unwrap();
        assert_eq!(
            openai.node_bucket(&node, &rpm),
            "llmq:gw/t/acme/search:requests:60000"
        );
        assert_eq!(
            openai.node_bucket(&node, &rpm),
            anthropic.node_bucket(&node, &rpm)
        );
    }
}
