//! Key names.

use tower_llm_quota::Limit;
use tower_llm_quota::tenant::Tenant;

/// The names of one quota's keys: every key shares one hash tag, the quota key's, or the
/// tenant plane's when accounts share their tenants' buckets.
#[derive(Debug, Clone)]
pub(super) struct Keys {
    /// `<prefix>:{<quota key>}`, or `<prefix>:{<plane>}:<quota key>`.
    root: String,
    /// Where the tenant nodes' buckets live: the root, or `<prefix>:{<plane>}`.
    nodes: String,
}

impl Keys {
    /// The keys of the quota `quota_key`, its tenant nodes' buckets its own.
    pub(super) fn new(prefix: &str, quota_key: &str) -> Self {
        let root = format!("{prefix}:{{{}}}", tag(quota_key));
        Self {
            nodes: root.clone(),
            root,
        }
    }

    /// The keys of the quota `quota_key` in the tenant plane `plane`: every account of the
    /// plane shares its hash tag (one slot) and its tenant nodes' buckets.
    pub(super) fn in_plane(prefix: &str, plane: &str, quota_key: &str) -> Self {
        let nodes = format!("{prefix}:{{{}}}", tag(plane));
        Self {
            root: format!("{nodes}:{}", tag(quota_key)),
            nodes,
        }
    }

    /// The bucket of `limit`: one per dimension and period.
    pub(super) fn bucket(&self, limit: &Limit) -> String {
        format!(
            "{}:{}:{}",
            self.root,
            limit.dimension().as_str(),
            limit.period().as_millis()
        )
    }

    /// The hold of `limit`'s bucket: the server instant (ms) before which it admits nothing,
    /// a provider's pause. It expires at that instant.
    pub(super) fn hold(&self, limit: &Limit) -> String {
        format!("{}:held", self.bucket(limit))
    }

    /// The fleet's adaptive plan for `limit` (see `bucket.lua`'s `plan`): the share of its
    /// amount the leasing processes plan for, lowered by the provider's 429s.
    pub(super) fn plan(&self, limit: &Limit) -> String {
        format!("{}:plan", self.bucket(limit))
    }

    /// The bucket of `limit` of the tenant node `node`, under the quota's hash tag: every
    /// bucket of a path lives in the account's slot, so one script reaches them all.
    pub(super) fn node_bucket(&self, node: &Tenant, limit: &Limit) -> String {
        format!(
            "{}:t:{}:{}:{}",
            self.nodes,
            node.as_str(),
            limit.dimension().as_str(),
            limit.period().as_millis()
        )
    }

    /// The daily counts of the tenant node `node`, for every process (a hash; see
    /// `controls.lua`).
    pub(super) fn node_days(&self, node: &Tenant) -> String {
        format!("{}:t:{}:days", self.nodes, node.as_str())
    }

    /// The slots of the tenant node `node`'s calls in flight, for every process (a hash of
    /// reservation ids; see `controls.lua`).
    pub(super) fn node_slots(&self, node: &Tenant) -> String {
        format!("{}:t:{}:slots", self.nodes, node.as_str())
    }

    /// The processes' leases on their slots (a hash: process, server instant its lease
    /// ends), beside the nodes' slots.
    pub(super) fn alive(&self) -> String {
        format!("{}:alive", self.nodes)
    }

    /// The line of processes refused for want of the account's capacity (a sorted set), in
    /// the order their heads get their turn.
    pub(super) fn line(&self) -> String {
        format!("{}:line", self.root)
    }

    /// When each process in line came, must come back, and loses its turn (a hash).
    pub(super) fn line_details(&self) -> String {
        format!("{}:line:at", self.root)
    }

    /// Where each process's last admission in turns started on the virtual clock (a sorted set).
    pub(super) fn clocks(&self) -> String {
        format!("{}:line:clocks", self.root)
    }

    /// The shares of the account leased to processes (a hash).
    pub(super) fn shares(&self) -> String {
        format!("{}:shares", self.root)
    }

    /// The tenant nodes paused for every process (a set of paths), beside the nodes'
    /// buckets.
    pub(super) fn paused(&self) -> String {
        format!("{}:paused", self.nodes)
    }

    /// The record of reservation `id`.
    pub(super) fn record(&self, id: &str) -> String {
        format!("{}:r:{id}", self.root)
    }
}

/// `name` as a hash tag: braces inside it would change the tag, and an empty tag (`{}`) is no
/// tag at all, so they are kept out.
fn tag(name: &str) -> String {
    let mut tag: String = name
        .chars()
        .map(|c| if c == '{' || c == '}' { '_' } else { c })
        .collect();
    if tag.is_empty() {
        tag.push('_');
    }
    tag
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU64;
    use tower_llm_quota::Dimension;

    fn nz(n: u64) -> NonZeroU64 {
        NonZeroU64::new(n).unwrap()
    }

    #[test]
    fn keys_share_one_hash_tag() {
        let keys = Keys::new("llmq", "org-{1}");
        let rpm = Limit::per_minute(Dimension::Requests, nz(500));
        assert_eq!(keys.bucket(&rpm), "llmq:{org-_1_}:requests:60000");
        assert_eq!(keys.hold(&rpm), "llmq:{org-_1_}:requests:60000:held");
        assert_eq!(keys.record("ab-7"), "llmq:{org-_1_}:r:ab-7");
        assert_eq!(Keys::new("llmq", "").record("1"), "llmq:{_}:r:1");
        let node: Tenant = "acme/search".parse().unwrap();
        assert_eq!(
            keys.node_bucket(&node, &rpm),
            "llmq:{org-_1_}:t:acme/search:requests:60000"
        );
    }

    #[test]
    fn accounts_of_one_plane_share_its_tag_and_their_nodes_buckets() {
        let (openai, anthropic) = (
            Keys::in_plane("llmq", "gw", "openai"),
            Keys::in_plane("llmq", "gw", "anthropic"),
        );
        let rpm = Limit::per_minute(Dimension::Requests, nz(500));
        assert_eq!(openai.bucket(&rpm), "llmq:{gw}:openai:requests:60000");
        assert_eq!(anthropic.record("1"), "llmq:{gw}:anthropic:r:1");
        let node: Tenant = "acme".parse().unwrap();
        assert_eq!(
            openai.node_bucket(&node, &rpm),
            "llmq:{gw}:t:acme:requests:60000"
        );
        assert_eq!(
            openai.node_bucket(&node, &rpm),
            anthropic.node_bucket(&node, &rpm)
        );
    }
}
