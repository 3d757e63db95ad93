//! With the `metrics` feature, the per-tenant series: tokens used as guaranteed against
//! borrowed, and refusals by scope, labelled by the tree's label depth.
#![cfg(feature = "metrics")]

use tower_llm_quota_test_support as support;

use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use support::limit;
use tower_llm_quota::tenant::{Tenant, TenantNode, TenantTree};
use tower_llm_quota::{Budget, Cost, Dimension, Quota};

/// Every series of one snapshot (a snapshot drains the counters it reads).
type Series = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

fn counter(series: &Series, name: &str, labels: &[(&str, &str)]) -> u64 {
    series
        .iter()
        .find_map(|(key, _, _, value)| {
            let key = key.key();
            let matches = key.name() == name
                && labels
                    .iter()
                    .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
                && key.labels().count() == labels.len();
            match (matches, value) {
                (true, DebugValue::Counter(n)) => Some(*n),
                _ => None,
            }
        })
        .unwrap_or(0)
}

#[test]
fn tokens_by_share_and_refusals_by_scope_at_the_label_depth() {
    let recorder = DebuggingRecorder::new();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let tree = TenantTree::new().with_label_depth(1).with_node(
                "acme".parse().unwrap(),
                TenantNode::new().with_guarantee(0.5),
            );
            let quota = Quota::new().with_limit(limit(
                Dimension::TotalTokens,
                1_000,
                Duration::from_secs(60),
                1_000,
            ));
            let budget = Budget::with_tenants(quota, tree).unwrap();
            let key: Tenant = "acme/search/key-1".parse().unwrap();
            // Within its guarantee (500 a minute): 100 guaranteed.
            let reservation = budget.reserve(Cost::new(100, 0)).tenant(key.clone()).await;
            reservation.unwrap().charge_estimate();
            // 700 in the last minute is above it: the next 600 are borrowed.
            let reservation = budget.reserve(Cost::new(600, 0)).tenant(key.clone()).await;
            reservation.unwrap().charge_estimate();
            budget
                .tenants()
                .unwrap()
                .pause(&"acme/search".parse().unwrap());
            let refused = budget.reserve(Cost::new(1, 0)).tenant(key).await;
            assert!(refused.unwrap_err().tenant_refused().unwrap().is_paused());
        });
    });
    let series = recorder.snapshotter().snapshot().into_vec();
    let tokens = |share| {
        counter(
            &series,
            "llm_tenant_tokens_total",
            &[("tenant", "acme"), ("share", share)],
        )
    };
    assert_eq!((tokens("guaranteed"), tokens("borrowed")), (100, 600));
    assert_eq!(
        counter(
            &series,
            "llm_tenant_refusals_total",
            &[("scope", "acme"), ("reason", "paused")],
        ),
        1
    );
}
