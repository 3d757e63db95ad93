//! The metrics of a governed workload, served in Prometheus' text format on loopback.
//!
//! A mock provider answers with usage and, now and then, a 429; the governed client (retry,
//! queue, budget, reconcile) keeps calling it. Scrape the metrics while it runs:
//!
//! ```sh
//! cargo run --release --features metrics --example prometheus -- 127.0.0.1:9898 30
//! curl -s 127.0.0.1:9898/metrics | grep ^llm_
//! ```
//!
//! Arguments: the address to listen on (default `127.0.0.1:9898`) and how many seconds to run
//! (default 30).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use metrics_exporter_prometheus::PrometheusBuilder;
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::provider::{Profile, ProviderScan, ProviderUsage, Scope};
use tower_llm_quota::retry::RetryBody;
use tower_llm_quota::{
    Budget, Cost, Dimension, Limit, Priority, PriorityQueueLayer, Quota, ReconcileLayer,
    RetryAfterLayer, RetryPolicy, TokenBudgetLayer, reconcile::ReconcileBody,
};

type Body = RetryBody<ReconcileBody<Full<Bytes>, ProviderScan>>;
type Llm = BoxCloneService<Request<String>, Response<Body>, tower_llm_quota::Error>;

/// The governed client over a mock provider that rejects one call in twenty with a 429.
pub(crate) fn governed(budget: &Budget) -> Llm {
    let calls = Arc::new(AtomicU64::new(0));
    let provider = service_fn(move |_request: Request<String>| {
        let call = calls.fetch_add(1, Ordering::Relaxed);
        async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let mut response = if call % 20 == 19 {
                let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
                *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                response
                    .headers_mut()
                    .insert("retry-after-ms", "100".parse().unwrap());
                response
            } else {
                let body = r#"{"choices":[],"usage":{"prompt_tokens":180,"completion_tokens":40,"total_tokens":220}}"#;
                Response::new(Full::new(Bytes::from_static(body.as_bytes())))
            };
            response
                .headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            Ok::<_, Infallible>(response)
        }
    });
    BoxCloneService::new(
        ServiceBuilder::new()
            .layer(RetryAfterLayer::new(RetryPolicy::new()))
            .layer(PriorityQueueLayer::default())
            .layer(TokenBudgetLayer::new(budget.clone()))
            .layer(ReconcileLayer::with_extractor(ProviderUsage::new(
                Profile::openai(),
            )))
            .service(provider),
    )
}

/// One call of the workload.
pub(crate) async fn call(llm: Llm, priority: Priority) -> Result<(), tower_llm_quota::BoxError> {
    let mut request = Request::new(String::from("{}"));
    request.extensions_mut().insert(Cost::new(200, 100));
    request.extensions_mut().insert(priority);
    request.extensions_mut().insert(Scope {
        provider: Some("openai".into()),
        model: Some("gpt-4o-mini".into()),
        key: None,
    });
    let response = llm.oneshot(request).await?;
    response.into_body().collect().await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), tower_llm_quota::BoxError> {
    let mut args = std::env::args().skip(1);
    let address: SocketAddr = args
        .next()
        .unwrap_or_else(|| "127.0.0.1:9898".into())
        .parse()?;
    let seconds: u64 = args.next().map_or(Ok(30), |s| s.parse())?;
    PrometheusBuilder::new()
        .with_http_listener(address)
        .install()?;
    println!("metrics on http://{address}/metrics for {seconds} s");

    let budget = Budget::new(Quota::new().with_limit(Limit::per_minute(
        Dimension::TotalTokens,
        NonZeroU64::new(60_000).unwrap(),
    )));
    let llm = governed(&budget);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(seconds);
    let mut round = 0u64;
    while tokio::time::Instant::now() < deadline {
        let priority =
            [Priority::Interactive, Priority::Batch, Priority::Batch][round as usize % 3];
        let calls: Vec<_> = (0..8).map(|_| call(llm.clone(), priority)).collect();
        for result in futures::future::join_all(calls).await {
            if let Err(error) = result {
                eprintln!("call failed: {error}");
            }
        }
        round += 1;
    }
    println!("done after {round} rounds of 8 calls");
    Ok(())
}
