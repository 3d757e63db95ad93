//! What the governed stack costs per request, beside the bare client, and what the `metrics`
//! feature adds to it.
//!
//! Run with `cargo bench --bench stack --features metrics` (without the feature only the first
//! two are measured). The client answers at once with its usage, so what is measured is the
//! stack's own work: retry, queue, budget (reserve and settle, with an in-flight slot),
//! reconcile.
//!
//! - `stack/bare`: the client alone.
//! - `stack/tower_bare`: the peer, what a request-count-only client uses: tower's `RateLimit`
//!   + `Retry` (a plain policy) + `ConcurrencyLimit` around the same client.
//! - `stack/governed`: the full stack (with `--features metrics`: compiled in, no recorder).
//! - `stack/governed_recorded`: the same after installing a Prometheus recorder, in the same
//!   run.
//!
//! What metrics cost is `(governed_recorded - governed without the feature) / (governed - bare)`,
//! the first `governed` from a run without the feature (a cargo feature cannot change inside one
//! run); with it, most of the cost is already in `governed` (the per-thread handle cache).

use std::convert::Infallible;
use std::hint::black_box;
use std::num::NonZeroU64;

use bytes::Bytes;
use criterion::{Criterion, Throughput};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tower::util::BoxCloneService;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::{
    Budget, Cost, Dimension, Limit, PriorityQueueLayer, Quota, ReconcileLayer, RetryAfterLayer,
    RetryPolicy, TokenBudgetLayer, Usage,
};

type Client = BoxCloneService<Request<String>, Response<Full<Bytes>>, Infallible>;

fn client() -> Client {
    BoxCloneService::new(service_fn(|_request: Request<String>| async {
        let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
        response.extensions_mut().insert(Usage::new(1_000, 100));
        Ok::<_, Infallible>(response)
    }))
}

/// A budget that never runs out during the bench.
fn budget() -> Budget {
    let huge = |dimension| {
        Limit::per_second(dimension, NonZeroU64::new(1_000_000_000_000).unwrap())
            .with_burst(NonZeroU64::new(1_000_000_000_000_000).unwrap())
    };
    Budget::new(
        Quota::new()
            .with_limit(huge(Dimension::Requests))
            .with_limit(huge(Dimension::TotalTokens))
            .with_max_in_flight(std::num::NonZeroUsize::new(1_024).unwrap()),
    )
}

fn request() -> Request<String> {
    let mut request = Request::new(String::from("{}"));
    request.extensions_mut().insert(Cost::new(1_000, 200));
    request
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("stack");
    group.throughput(Throughput::Elements(1));

    let bare = client();
    group.bench_function("bare", |b| {
        b.iter(|| {
            runtime.block_on(async {
                let response = bare.clone().oneshot(request()).await.unwrap();
                black_box(response.into_body().collect().await.unwrap());
            })
        })
    });

    // The peer: requests per second (never reached here), a plain retry, calls in flight.
    // `RateLimit` arms its timer when built: inside the runtime.
    let mut tower_bare = runtime.block_on(async {
        ServiceBuilder::new()
            .rate_limit(1_000_000_000, std::time::Duration::from_secs(1))
            .retry(PlainRetry(3))
            .concurrency_limit(1_024)
            .service(client())
    });
    group.bench_function("tower_bare", |b| {
        b.iter(|| {
            runtime.block_on(async {
                let service = tower_bare.ready().await.unwrap();
                let response = service.call(request()).await.unwrap();
                black_box(response.into_body().collect().await.unwrap());
            })
        })
    });

    let budget = budget();
    let governed = ServiceBuilder::new()
        .layer(RetryAfterLayer::new(RetryPolicy::new()))
        .layer(PriorityQueueLayer::default())
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::new())
        .service(client());
    let run = |name: &str, group: &mut criterion::BenchmarkGroup<'_, _>| {
        group.bench_function(name, |b| {
            b.iter(|| {
                runtime.block_on(async {
                    let mut llm = governed.clone();
                    let response = llm.ready().await.unwrap().call(request()).await.unwrap();
                    black_box(response.into_body().collect().await.unwrap());
                })
            })
        });
    };
    run("governed", &mut group);

    #[cfg(feature = "metrics")]
    {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .unwrap();
        run("governed_recorded", &mut group);
    }
    group.finish();
}

/// Retries any failure up to `.0` times, at once: the usual request-count-only client.
#[derive(Clone)]
struct PlainRetry(u32);

impl<B> tower::retry::Policy<Request<String>, Response<B>, Infallible> for PlainRetry {
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        _request: &mut Request<String>,
        result: &mut Result<Response<B>, Infallible>,
    ) -> Option<Self::Future> {
        match result {
            Ok(_) => None,
            Err(_) if self.0 == 0 => None,
            Err(_) => {
                self.0 -= 1;
                Some(std::future::ready(()))
            }
        }
    }

    fn clone_request(&mut self, request: &Request<String>) -> Option<Request<String>> {
        let mut clone = Request::new(request.body().clone());
        *clone.headers_mut() = request.headers().clone();
        Some(clone)
    }
}

// What `criterion_group!`/`criterion_main!` expand to, without their undocumented `pub fn`.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
