//! The Prometheus example's setup, scraped over HTTP on loopback: the series are there, with
//! the values the workload implies.

#[path = "../../examples/prometheus.rs"]
#[allow(dead_code)]
mod example;

use std::num::NonZeroU64;

use metrics_exporter_prometheus::PrometheusBuilder;
use tower_llm_quota::{Budget, Dimension, Limit, Priority, Quota};
use tower_llm_quota_test_support::port::free_port;

/// The value of the series `name{labels}` in a Prometheus text exposition.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|line| line.starts_with(series) && line[series.len()..].starts_with(' '))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_are_served_and_count_the_workload() {
    let address: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    PrometheusBuilder::new()
        .with_http_listener(address)
        .install()
        .unwrap();

    let budget = Budget::new(Quota::new().with_limit(Limit::per_minute(
        Dimension::TotalTokens,
        NonZeroU64::new(600_000).unwrap(),
    )));
    let llm = example::governed(&budget);
    // 40 calls: the mock answers the 20th and the 40th with a 429, each retried once.
    for _ in 0..40 {
        example::call(llm.clone(), Priority::Batch).await.unwrap();
    }

    let body = reqwest::get(format!("http://{address}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let by = r#"provider="openai",model="gpt-4o-mini""#;
    assert_eq!(
        value(
            &body,
            &format!(r#"llm_requests_total{{{by},status="200"}}"#)
        ),
        Some(40.0),
        "{body}"
    );
    assert_eq!(
        value(
            &body,
            &format!(r#"llm_requests_total{{{by},status="429"}}"#)
        ),
        Some(2.0)
    );
    assert_eq!(
        value(
            &body,
            &format!(r#"llm_retries_total{{{by},error_type="rate_limited"}}"#)
        ),
        Some(2.0)
    );
    assert_eq!(
        value(
            &body,
            &format!(
                r#"llm_tokens_used_total{{{by},dimension="output_tokens",service_tier="unknown"}}"#
            )
        ),
        Some(1_600.0)
    );
    assert_eq!(
        value(
            &body,
            r#"llm_rate_limit_hits_total{limit_type="unknown",decision="provider"}"#
        ),
        Some(2.0)
    );
    assert_eq!(
        value(&body, r#"llm_queue_wait_seconds_count{priority="batch"}"#),
        Some(42.0)
    );
    assert!(body.contains("# HELP llm_queue_wait_seconds"));
    // Each budget's levels under its quota's name (`queue`, as its ordering's depth).
    assert!(
        body.lines()
            .any(|l| l.starts_with(r#"llm_budget_level{queue=""#)
                && l.contains(r#"dimension="total_tokens",window_seconds="60"}"#)),
        "{body}"
    );
}
