//! What a route that renames the model adds to a request through a [`Router`], beside a route
//! that keeps it, for a chat body of 2 KB and of 64 KB.
//!
//! Run with `cargo bench --bench routing`. The route's service answers at once, so what is
//! measured is the router's own work: reading the body, picking the route, and (renaming)
//! writing the new model into the body.
//!
//! - `routing/keep/<size>`: the route names the model the request asks for.
//! - `routing/rename/<size>`: the route names another model; the body sent differs.

use std::convert::Infallible;
use std::hint::black_box;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput};
use http::{Request, Response};
use http_body_util::Full;
use tower::{Service, ServiceExt, service_fn};
use tower_llm_quota::routing::{Route, Router};

/// A chat request of about `bytes` bytes: a system prompt and turns of plain text.
fn body(bytes: usize) -> Bytes {
    let turn = r#"{"role":"user","content":"Summarise the quarterly report in three bullet points, with figures."}"#;
    let turns = vec![turn; bytes / turn.len()].join(",");
    Bytes::from(format!(
        r#"{{"model":"gpt-4o-mini","stream":false,"temperature":0.2,"messages":[{turns}],"max_tokens":256}}"#
    ))
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("routing");
    for size in [2_048, 65_536] {
        let body = body(size);
        group.throughput(Throughput::Bytes(body.len() as u64));
        for (name, model) in [("keep", "gpt-4o-mini"), ("rename", "gpt-4.1-mini")] {
            let answer = service_fn(|request: Request<Full<Bytes>>| async move {
                black_box(request);
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            });
            let router = Router::builder(Route::new("a", answer).model(model)).build();
            group.bench_with_input(BenchmarkId::new(name, size), &body, |b, body| {
                b.iter(|| {
                    let mut router = router.clone();
                    let request = Request::post("/v1/chat/completions")
                        .body(Full::new(body.clone()))
                        .unwrap();
                    runtime.block_on(async {
                        let response = router.ready().await.unwrap().call(request).await;
                        black_box(response.unwrap());
                    });
                });
            });
        }
    }
    group.finish();
}

// What `criterion_group!`/`criterion_main!` expand to, without their undocumented `pub fn`.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
