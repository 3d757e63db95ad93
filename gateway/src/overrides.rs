//! Overrides: the configuration file is the base, and what the admin API changed (a node's
//! limit or weight, a configured key's secret) is an override of it, kept in the admin state
//! ([`super::state`]). This module lists them against the file: the admin API's
//! `/admin/overrides`, a reload's report and the status page read it.

use serde::Serialize;
use tower_llm_quota::tenant::TenantTree;

use super::config::Config;
use super::refusal::limit_name;
use super::state::{self, Parsed};

/// One setting the admin state holds over the file's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Override {
    /// Its name in the admin state: `DELETE /admin/overrides?id=...` gives the setting back.
    pub(crate) id: String,
    /// The node it changes (a tenant's path, or a key's node), or the key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tenant: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) key: Option<String>,
    /// `requests_per_minute`, `weight`, `secret`.
    pub(crate) setting: String,
    /// What holds: an amount, or `removed` (a limit), `rotated`, `revoked` (a key's secret).
    pub(crate) value: serde_json::Value,
    /// The file's value it shadows: an amount, a key's `key_env`, or `null` when the file
    /// sets none.
    pub(crate) file: serde_json::Value,
    /// Who made it and when; `null` for one written before changes were stamped.
    pub(crate) by: Option<String>,
    pub(crate) at: Option<String>,
}

/// A configured key's secret rotated or revoked through the API: the file's `key_env` (or
/// `key`) no longer serves.
fn key_overrides(config: &Config, parsed: &Parsed) -> Vec<Override> {
    (parsed.keys.iter())
        .filter_map(|(name, record)| {
            let configured = config.keys.iter().find(|k| k.name == *name)?;
            let id = state::key_field(name);
            let stamp = parsed.stamps.get(&id).cloned();
            let file = match &configured.key_env {
                Some(var) => format!("key_env {var}"),
                None => "key (inline)".to_owned(),
            };
            Some(Override {
                setting: "secret".into(),
                tenant: None,
                key: Some(name.clone()),
                value: if record.revoked { "revoked" } else { "rotated" }.into(),
                file: file.into(),
                by: stamp.as_ref().map(|s| s.admin.clone()),
                at: stamp.map(|s| s.at),
                id,
            })
        })
        .collect()
}

/// Every override of `parsed` over `config`, in the order of their ids.
pub(crate) fn list(config: &Config, parsed: &Parsed) -> Vec<Override> {
    let tree: Option<TenantTree> = config.tenant_tree().ok().map(|(tree, _)| tree);
    let stamp = |id: &str| parsed.stamps.get(id).cloned();
    let mut all = Vec::new();
    for (path, node) in &parsed.nodes {
        let file = tree.as_ref().and_then(|tree| tree.node(path));
        for (&(dimension, period), amount) in &node.limits {
            let id = state::limit_field(path, dimension, period);
            let held = file.and_then(|node| {
                (node.limits().iter())
                    .find(|l| l.dimension() == dimension && l.period().as_secs() == period)
            });
            let stamp = stamp(&id);
            all.push(Override {
                setting: limit_name(dimension.as_str(), std::time::Duration::from_secs(period)),
                tenant: Some(path.to_string()),
                key: None,
                value: amount.map_or_else(|| "removed".into(), |a| a.amount.get().into()),
                file: held.map_or(serde_json::Value::Null, |l| l.amount().get().into()),
                by: stamp.as_ref().map(|s| s.admin.clone()),
                at: stamp.map(|s| s.at),
                id,
            });
        }
        if let Some(weight) = node.weight {
            let id = state::weight_field(path);
            let stamp = stamp(&id);
            all.push(Override {
                setting: "weight".into(),
                tenant: Some(path.to_string()),
                key: None,
                value: weight.get().into(),
                file: file.map_or(serde_json::Value::Null, |n| n.weight().get().into()),
                by: stamp.as_ref().map(|s| s.admin.clone()),
                at: stamp.map(|s| s.at),
                id,
            });
        }
    }
    all.extend(key_overrides(config, parsed));
    all.sort_by(|a, b| a.id.cmp(&b.id));
    all
}
