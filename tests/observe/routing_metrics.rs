//! With the `metrics` feature, a router counts its fallback decisions by providers and reason,
//! and follows its ramp's share and paused state.
#![cfg(feature = "metrics")]

use std::collections::HashMap;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use metrics_util::MetricKind;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tower::util::BoxCloneSyncService;
use tower::{Service, service_fn};
use tower_llm_quota::BoxError;
use tower_llm_quota::routing::{Condition, Fallback, Ramp, Route, Router, ServedBy};

type Svc = BoxCloneSyncService<Request<Full<Bytes>>, Response<Full<Bytes>>, BoxError>;

fn client(status: StatusCode) -> Svc {
    BoxCloneSyncService::new(service_fn(
        move |_request: Request<Full<Bytes>>| async move {
            let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
            *response.status_mut() = status;
            Ok::<_, BoxError>(response)
        },
    ))
}

#[tokio::test(start_paused = true)]
async fn fallbacks_are_counted_by_providers_and_reason_and_the_ramp_is_followed() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // This thread's recorder (the runtime runs every task on it): the binary's other tests
    // keep theirs.
    let _recording = metrics::set_default_local_recorder(&recorder);

    let router = Router::builder(Route::new("a", client(StatusCode::BAD_GATEWAY)).provider("p1"))
        .ramp(
            Route::new("c", client(StatusCode::OK)).provider("p3"),
            Ramp::new(50.0, 0.0, 50.0).unwrap(),
        )
        .fallback(
            Route::new("b", client(StatusCode::OK)).provider("p2"),
            Fallback::when(Condition::provider_5xx()),
        )
        .build();
    let mut served = HashMap::<String, u64>::new();
    for _ in 0..10 {
        let mut router = router.clone();
        let response = router.call(Request::new(Full::default())).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let route = response
            .extensions()
            .get::<ServedBy>()
            .unwrap()
            .route()
            .to_owned();
        *served.entry(route).or_default() += 1;
    }
    assert_eq!(router.ramp().unwrap().status().share, 50.0);

    let series: HashMap<String, DebugValue> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let (kind, key) = key.into_parts();
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            let kind = if kind == MetricKind::Counter {
                "counter"
            } else {
                "gauge"
            };
            (
                format!("{kind} {}{{{}}}", key.name(), labels.join(",")),
                value,
            )
        })
        .collect();
    // Every request the ramp left on the primary met its 502 and went to the fallback.
    assert_eq!(served.get("a"), None);
    let fallbacks = served["b"];
    assert_eq!(fallbacks + served["c"], 10);
    assert!(fallbacks > 0 && served["c"] > 0, "{served:?}");
    assert_eq!(
        series.get(
            "counter llm_fallbacks_total{from_provider=p1,reason=provider_5xx,to_provider=p2}"
        ),
        Some(&DebugValue::Counter(fallbacks)),
        "{series:?}"
    );
    assert_eq!(
        series.get("gauge llm_ramp_share{route=c}"),
        Some(&DebugValue::Gauge(50.0.into()))
    );
    assert_eq!(
        series.get("gauge llm_ramp_paused{route=c}"),
        Some(&DebugValue::Gauge(0.0.into()))
    );
}
