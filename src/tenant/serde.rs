//! A tenant tree from a configuration file (feature `serde`); the format is in the
//! [module docs](super#configuration-file).

use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::time::Duration;

use serde::Deserialize;
use serde::de::Error as _;

use super::config::{TenantNode, TenantTree};
use super::path::Tenant;
use crate::quota::{CapWindow, PeriodCap};
use crate::quota::{Dimension, Limit};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Tree {
    #[serde(default)]
    default_tenant: Option<Tenant>,
    #[serde(default)]
    label_depth: Option<usize>,
    #[serde(default)]
    nodes: HashMap<Tenant, Node>,
    #[serde(default)]
    templates: HashMap<String, Node>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Node {
    #[serde(default)]
    limits: Vec<LimitConfig>,
    #[serde(default)]
    weight: Option<NonZeroU32>,
    #[serde(default)]
    guarantee: Option<f64>,
    #[serde(default)]
    max_share: Option<f64>,
    #[serde(default)]
    max_in_flight: Option<NonZeroUsize>,
    #[serde(default)]
    max_wait_seconds: Option<f64>,
    #[serde(default)]
    account: Option<String>,
    #[serde(default, alias = "daily")]
    caps: Vec<PeriodCap>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitConfig {
    dimension: String,
    #[serde(default)]
    amount: Option<NonZeroU64>,
    #[serde(default)]
    amount_usd: Option<String>,
    period_seconds: f64,
    #[serde(default)]
    burst: Option<NonZeroU64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CapConfig {
    dimension: String,
    #[serde(default)]
    amount: Option<NonZeroU64>,
    #[serde(default)]
    amount_usd: Option<String>,
    window: Window,
    #[serde(default)]
    enforce: Enforce,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "snake_case")]
enum Enforce {
    #[default]
    Hard,
    Soft,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Window {
    #[serde(alias = "calendar_utc")]
    CalendarDayUtc,
    CalendarMonthUtc,
    Rolling,
}

/// A cap as `{ dimension = "spend", amount_usd = "500.00", window = "calendar_month_utc" }`
/// (windows `calendar_day_utc`, `calendar_month_utc`, `rolling`), with `enforce = "soft"`
/// for a [soft](PeriodCap::soft) one (`"hard"`, the default, otherwise): a tenant node's
/// `caps`, or an account's. A spend amount is `amount_usd` (dollars, a decimal) or `amount`
/// (nano-dollars); any other dimension's is `amount`.
impl<'de> Deserialize<'de> for PeriodCap {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let cap = CapConfig::deserialize(deserializer)?;
        let window = match cap.window {
            Window::CalendarDayUtc => CapWindow::CalendarDayUtc,
            Window::CalendarMonthUtc => CapWindow::CalendarMonthUtc,
            Window::Rolling => CapWindow::Rolling,
        };
        let dimension = dimension(&cap.dimension)?;
        let amount = amount(dimension, cap.amount, cap.amount_usd.as_deref())?;
        let built = PeriodCap::new(dimension, amount, window);
        Ok(match cap.enforce {
            Enforce::Hard => built,
            Enforce::Soft => built.soft(),
        })
    }
}

/// A limit's or cap's amount: `amount`, or for spend `amount_usd` in dollars; exactly one.
fn amount<E: serde::de::Error>(
    dimension: Dimension,
    amount: Option<NonZeroU64>,
    usd: Option<&str>,
) -> Result<NonZeroU64, E> {
    match (amount, usd) {
        (Some(amount), None) => Ok(amount),
        (None, Some(usd)) if dimension == Dimension::Spend => {
            let nanos = crate::pricing::Usd::parse(usd).map_err(E::custom)?.nanos();
            NonZeroU64::new(nanos).ok_or_else(|| E::custom("amount_usd must be above zero"))
        }
        (None, Some(_)) => Err(E::custom(format!(
            "amount_usd is for spend; a {} amount is `amount`",
            dimension.as_str()
        ))),
        (Some(_), Some(_)) => Err(E::custom("give `amount` or `amount_usd`, not both")),
        (None, None) => Err(E::custom(
            "missing field `amount` (or `amount_usd` for spend)",
        )),
    }
}

fn dimension<E: serde::de::Error>(name: &str) -> Result<Dimension, E> {
    Dimension::ALL
        .into_iter()
        .find(|d| d.as_str() == name)
        .ok_or_else(|| E::custom(format!("unknown dimension `{name}`")))
}

fn node<E: serde::de::Error>(config: Node) -> Result<TenantNode, E> {
    let mut node = TenantNode::new();
    for limit in config.limits {
        if !(limit.period_seconds.is_finite() && limit.period_seconds > 0.0) {
            return Err(E::custom("a limit's period_seconds must be positive"));
        }
        let period = Duration::from_secs_f64(limit.period_seconds);
        let dimension = dimension(&limit.dimension)?;
        let amount = amount(dimension, limit.amount, limit.amount_usd.as_deref())?;
        let mut built = Limit::new(dimension, amount, period).map_err(E::custom)?;
        if let Some(burst) = limit.burst {
            built = built.with_burst(burst);
        }
        node = node.with_limit(built);
    }
    for cap in config.caps {
        node = node.with_cap(cap);
    }
    if let Some(weight) = config.weight {
        node = node.with_weight(weight);
    }
    if let Some(share) = config.guarantee {
        node = node.with_guarantee(share);
    }
    if let Some(share) = config.max_share {
        node = node.with_max_share(share);
    }
    if let Some(max) = config.max_in_flight {
        node = node.with_max_in_flight(max);
    }
    if let Some(seconds) = config.max_wait_seconds {
        let max_wait = Duration::try_from_secs_f64(seconds)
            .map_err(|_| E::custom("a node's max_wait_seconds must be 0 or more"))?;
        node = node.with_max_wait(max_wait);
    }
    if let Some(account) = config.account {
        node = node.for_account(account);
    }
    Ok(node)
}

impl<'de> Deserialize<'de> for TenantTree {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let config = Tree::deserialize(deserializer)?;
        let mut tree = TenantTree::new();
        if let Some(tenant) = config.default_tenant {
            tree = tree.with_default_tenant(tenant);
        }
        if let Some(depth) = config.label_depth {
            tree = tree.with_label_depth(depth);
        }
        for (path, config) in config.nodes {
            tree = tree.with_node(path, node(config)?);
        }
        for (depth, config) in config.templates {
            let depth: usize = depth
                .parse()
                .map_err(|_| D::Error::custom("a template is keyed by its depth (1, 2, ...)"))?;
            tree = tree.with_template(depth, node(config)?);
        }
        tree.validate().map_err(D::Error::custom)?;
        Ok(tree)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_reads_from_json() {
        let tree: TenantTree = serde_json::from_str(
            r#"{ "default_tenant": "anonymous", "label_depth": 2,
                 "nodes": { "acme": { "weight": 3, "guarantee": 0.75, "max_share": 0.9 },
                            "acme/search": { "limits": [ { "dimension": "total_tokens",
                                "amount": 20000, "period_seconds": 60, "burst": 5000 } ],
                              "max_in_flight": 8, "account": "openai",
                              "daily": [ { "dimension": "total_tokens", "amount": 1000000,
                                           "window": "rolling" } ] } },
                 "templates": { "3": { "limits": [ { "dimension": "requests", "amount": 60,
                                                      "period_seconds": 60 } ] } } }"#,
        )
        .unwrap();
        let acme = tree.node(&"acme".parse().unwrap()).unwrap();
        assert_eq!((acme.weight().get(), acme.guarantee()), (3, 0.75));
        assert_eq!(acme.max_share(), Some(0.9));
        let search = tree.node(&"acme/search".parse().unwrap()).unwrap();
        assert_eq!(search.limits()[0].capacity(), 5_000);
        assert_eq!(search.caps()[0].window(), CapWindow::Rolling);
        assert_eq!((search.account(), acme.account()), (Some("openai"), None));
        let key = tree.node(&"acme/search/k1".parse().unwrap()).unwrap();
        assert_eq!(key.limits()[0].dimension(), Dimension::Requests);
        assert_eq!(tree.default_tenant().as_str(), "anonymous");
        assert_eq!(tree.label_depth(), 2);
    }

    #[test]
    fn a_bad_tree_is_refused() {
        let over = r#"{ "nodes": { "a": { "guarantee": 0.6 }, "b": { "guarantee": 0.6 } } }"#;
        assert!(serde_json::from_str::<TenantTree>(over).is_err());
        let dimension = r#"{ "nodes": { "a": { "limits": [ { "dimension": "bytes",
            "amount": 1, "period_seconds": 1 } ] } } }"#;
        assert!(serde_json::from_str::<TenantTree>(dimension).is_err());
        assert!(serde_json::from_str::<TenantTree>(r#"{ "nodes": { "a//b": {} } }"#).is_err());
    }

    #[test]
    fn spend_reads_in_dollars() {
        let cap: PeriodCap = serde_json::from_str(
            r#"{ "dimension": "spend", "amount_usd": "500.00", "window": "calendar_day_utc" }"#,
        )
        .unwrap();
        assert_eq!(cap.amount().get(), 500_000_000_000);
        let tree: TenantTree = serde_json::from_str(
            r#"{ "nodes": { "a": { "limits": [ { "dimension": "spend", "amount_usd": "0.50",
                 "period_seconds": 3600 } ] } } }"#,
        )
        .unwrap();
        let a = tree.node(&"a".parse().unwrap()).unwrap();
        assert_eq!(a.limits()[0].amount().get(), 500_000_000);
        for bad in [
            r#"{ "dimension": "spend", "amount_usd": "1.5", "amount": 5, "window": "rolling" }"#,
            r#"{ "dimension": "requests", "amount_usd": "1", "window": "rolling" }"#,
            r#"{ "dimension": "spend", "amount_usd": "0.0000000001", "window": "rolling" }"#,
            r#"{ "dimension": "spend", "amount_usd": "0", "window": "rolling" }"#,
            r#"{ "dimension": "spend", "window": "rolling" }"#,
        ] {
            assert!(serde_json::from_str::<PeriodCap>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_cap_reads_alone() {
        let cap: PeriodCap = serde_json::from_str(
            r#"{ "dimension": "spend", "amount": 500000000000, "window": "calendar_month_utc" }"#,
        )
        .unwrap();
        assert_eq!(
            (cap.dimension(), cap.amount().get(), cap.window()),
            (
                Dimension::Spend,
                500_000_000_000,
                CapWindow::CalendarMonthUtc
            )
        );
        assert!(!cap.is_soft(), "hard unless told");
        let soft: PeriodCap = serde_json::from_str(
            r#"{ "dimension": "output_tokens", "amount": 9, "window": "rolling", "enforce": "soft" }"#,
        )
        .unwrap();
        assert!(soft.is_soft());
        let week = r#"{ "dimension": "spend", "amount": 1, "window": "week" }"#;
        assert!(serde_json::from_str::<PeriodCap>(week).is_err());
        let lax = r#"{ "dimension": "spend", "amount": 1, "window": "rolling", "enforce": "lax" }"#;
        assert!(serde_json::from_str::<PeriodCap>(lax).is_err());
    }
}
