//! Routing between governed clients, against two simulated providers under a paused clock:
//! every fallback condition sends exactly the requests it names, a refused compatibility check
//! keeps the request waiting on its route, nothing is reserved twice, a started stream stays
//! where it is, and a ramp grows, pauses and steps back on the new route's health.

use crate::routing_support;

use std::io;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use routing_support::*;
use tokio::time::{self, Instant};
use tower::{ServiceExt, service_fn};
use tower_llm_quota::retry::{Ambiguity, Interrupted};
use tower_llm_quota::routing::{
    Condition, Fallback, PauseReason, Ramp, Reason, RouteKey, Router, ServedBy, Tenant,
};
use tower_llm_quota::{BoxError, Cost, Dimension, Priority, RetryPolicy};
use tower_llm_quota_sim::{Faults, SimConfig};

#[tokio::test(start_paused = true)]
async fn provider_5xx_sends_only_the_classes_the_fallback_serves() {
    let models = Models::default();
    let primary = simulator(
        SimConfig::openai(1_000, 1_000_000).faults(Faults::none().server_errors(1.0)),
        Duration::from_millis(50),
    );
    let fallback = simulator(
        SimConfig::openai(1_000, 1_000_000),
        Duration::from_millis(50),
    );
    let router = Router::builder(route("a", &stack(100_000), sim_client(&primary), &models))
        .fallback(
            route("b", &stack(100_000), sim_client(&fallback), &models).model("fallback-model"),
            Fallback::when(Condition::provider_5xx()).classes(&[Priority::Interactive]),
        )
        .build();
    for _ in 0..3 {
        let before = primary.stats().received;
        let (status, served, _) = send(&router, request(Priority::Interactive, 20, "")).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(served.route(), "b");
        assert_eq!(served.fallback_reason(), Some(Reason::Provider5xx));
        // Every call the primary got for it, told with the fallback's answer.
        let calls = primary.stats().received - before;
        assert!(calls >= 1);
        assert_eq!(u64::from(served.earlier_attempts()), calls);
    }
    for _ in 0..2 {
        let (status, served, _) = send(&router, request(Priority::Batch, 20, "")).await;
        assert!(status.is_server_error(), "{status}");
        assert_eq!(served.route(), "a");
        assert_eq!(served.fallback_reason(), None);
    }
    assert_eq!(fallback.stats().received, 3);
    assert_eq!(fallback.stats().admitted, 3);
    assert_eq!(primary.stats().admitted, 0);
    let models = models.lock().unwrap();
    assert_eq!(
        models.iter().filter(|m| *m == "fallback-model").count(),
        3,
        "the model is rewritten on the fallback only: {models:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn rate_limited_after_the_retry_policy_gave_up() {
    let models = Models::default();
    // The provider takes 2 requests a minute; the local budget does not know it.
    let primary = simulator(SimConfig::openai(2, 1_000_000), Duration::from_millis(50));
    let fallback = simulator(
        SimConfig::openai(1_000, 1_000_000),
        Duration::from_millis(50),
    );
    let one_attempt = RetryPolicy::new()
        .max_attempts(Priority::Interactive, std::num::NonZeroU32::new(1).unwrap());
    let primary_stack = stack(100_000).retry(one_attempt);
    let router = Router::builder(route("a", &primary_stack, sim_client(&primary), &models))
        .fallback(
            route("b", &stack(100_000), sim_client(&fallback), &models),
            Fallback::when(Condition::rate_limited()),
        )
        .build();
    let answers = futures::future::join_all(
        (0..6).map(|_| send(&router, request(Priority::Interactive, 20, ""))),
    )
    .await;
    let on_fallback = answers.iter().filter(|(_, s, _)| s.route() == "b").count() as u64;
    assert!(
        answers
            .iter()
            .all(|(status, _, _)| *status == StatusCode::OK)
    );
    assert_eq!(primary.stats().admitted, 2);
    assert_eq!(primary.stats().rate_limited, 4);
    assert_eq!(on_fallback, 4, "exactly the requests the provider refused");
    assert_eq!(fallback.stats().received, 4);
    assert!(
        answers
            .iter()
            .filter(|(_, s, _)| s.route() == "b")
            .all(|(_, s, _)| s.fallback_reason() == Some(Reason::RateLimited))
    );
}

#[tokio::test(start_paused = true)]
async fn unreachable_primary_goes_elsewhere_but_a_reset_does_not() {
    let models = Models::default();
    let fallback = simulator(
        SimConfig::openai(1_000, 1_000_000),
        Duration::from_millis(50),
    );
    let refused = service_fn(|_request: Request<Full<Bytes>>| async {
        Err::<Response<Body>, BoxError>(Box::new(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            "connection refused",
        )))
    });
    let when = Fallback::when(Condition::primary_unavailable()).or(Condition::provider_5xx());
    let router = Router::builder(route("a", &stack(100_000), refused, &models))
        .fallback(
            route("b", &stack(100_000), sim_client(&fallback), &models),
            when.clone(),
        )
        .build();
    let (status, served, _) = send(&router, request(Priority::Interactive, 20, "")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(served.route(), "b");
    assert_eq!(served.fallback_reason(), Some(Reason::PrimaryUnavailable));
    assert_eq!(fallback.stats().received, 1);

    // A reset before the head may have been processed: it stays on its route.
    let resetting = simulator(
        SimConfig::openai(1_000, 1_000_000).faults(Faults::none().connection_resets(1.0)),
        Duration::from_millis(50),
    );
    let router = Router::builder(route("a", &stack(100_000), sim_client(&resetting), &models))
        .fallback(
            route("b", &stack(100_000), sim_client(&fallback), &models),
            when,
        )
        .build();
    let error = router
        .clone()
        .oneshot(request(Priority::Interactive, 20, ""))
        .await
        .expect_err("the reset is reported");
    assert_eq!(Ambiguity::of_error(&error), Ambiguity::Uncertain, "{error}");
    assert_eq!(resetting.stats().connection_resets, 1);
    assert_eq!(fallback.stats().received, 1, "not one more");
}

#[tokio::test(start_paused = true)]
async fn interactive_work_skips_a_saturated_primary_without_queueing_and_nothing_is_reserved_twice()
{
    let models = Models::default();
    let primary = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    let fallback = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    let (primary_stack, fallback_stack) = (stack(1_000), stack(10_000));
    let router = Router::builder(route("a", &primary_stack, sim_client(&primary), &models))
        .fallback(
            route("b", &fallback_stack, sim_client(&fallback), &models),
            Fallback::when(Condition::would_wait_longer_than(Duration::ZERO))
                .classes(&[Priority::Interactive]),
        )
        .build();
    // Saturate the primary: its whole bucket is held by one reservation.
    let held = primary_stack
        .budget()
        .try_reserve(Cost::new(1_000, 0))
        .unwrap();
    let start = Instant::now();
    let answers = futures::future::join_all(
        (0..3).map(|_| send(&router, request(Priority::Interactive, 20, ""))),
    )
    .await;
    for (status, served, elapsed) in &answers {
        assert_eq!(*status, StatusCode::OK);
        assert_eq!(served.route(), "b");
        assert_eq!(served.fallback_reason(), Some(Reason::WouldWait));
        assert_eq!(
            served.earlier_attempts(),
            0,
            "nothing was sent to the primary"
        );
        assert_eq!(*elapsed, Duration::ZERO, "no queueing on the primary");
    }
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(primary.stats().received, 0);
    assert_eq!(primary_stack.budget().waiters(), 0);
    // Both levels exact: the primary holds only the test's reservation, the fallback what its
    // provider charged.
    assert_eq!(level(&primary_stack), 0);
    let charged = fallback.stats().prompt_tokens + fallback.stats().completion_tokens;
    assert!(charged > 0);
    assert_eq!(level(&fallback_stack), 10_000 - charged as i64);
    drop(held);
    assert_eq!(level(&primary_stack), 1_000);
}

#[tokio::test(start_paused = true)]
async fn a_refused_compatibility_check_waits_on_the_primary() {
    let models = Models::default();
    let primary = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    let fallback = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    let primary_stack = stack(1_000);
    let router = Router::builder(route("a", &primary_stack, sim_client(&primary), &models))
        .fallback(
            route("b", &stack(10_000), sim_client(&fallback), &models).attribute("tools", "no"),
            Fallback::when(Condition::would_wait_longer_than(Duration::ZERO)),
        )
        .compatible(|request, route| {
            !(request.has_field("tools") && route.attribute("tools") == Some("no"))
        })
        .build();
    let held = primary_stack
        .budget()
        .try_reserve(Cost::new(1_000, 0))
        .unwrap();
    let with_tools = request(
        Priority::Interactive,
        20,
        r#","tools":[{"type":"function"}]"#,
    );
    let waiting = tokio::spawn({
        let router = router.clone();
        async move { send(&router, with_tools).await }
    });
    time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        primary_stack.budget().waiters(),
        1,
        "it waits on the primary"
    );
    assert_eq!(fallback.stats().received, 0);
    drop(held);
    let (status, served, elapsed) = waiting.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(served.route(), "a");
    assert_eq!(served.fallback_reason(), None);
    assert_eq!(elapsed, Duration::from_secs(1));
    // The same request without tools goes to the fallback at once.
    let held = primary_stack
        .budget()
        .try_reserve(Cost::new(900, 0))
        .unwrap();
    let (_, served, elapsed) = send(&router, request(Priority::Interactive, 80, "")).await;
    assert_eq!((served.route(), elapsed), ("b", Duration::ZERO));
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn context_length_and_degraded_classes_are_decided_before_sending() {
    let models = Models::default();
    let primary = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    let long = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    let cheap = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    let router = Router::builder(
        route("a", &stack(100_000), sim_client(&primary), &models).context_window(100),
    )
    .fallback(
        route("long", &stack(100_000), sim_client(&long), &models).context_window(100_000),
        Fallback::when(Condition::context_length_needed()),
    )
    .fallback(
        route("cheap", &stack(100_000), sim_client(&cheap), &models),
        Fallback::when(Condition::degrade()).classes(&[Priority::Batch]),
    )
    .build();
    let (_, served, _) = send(&router, request(Priority::Interactive, 20, "")).await;
    assert_eq!(served.route(), "a");
    let (_, served, _) = send(&router, request(Priority::Interactive, 500, "")).await;
    assert_eq!(
        (served.route(), served.fallback_reason()),
        ("long", Some(Reason::ContextLength))
    );
    for _ in 0..2 {
        let (_, served, _) = send(&router, request(Priority::Batch, 20, "")).await;
        assert_eq!(
            (served.route(), served.fallback_reason()),
            ("cheap", Some(Reason::Degraded))
        );
    }
    assert_eq!(primary.stats().received, 1);
    assert_eq!(long.stats().received, 1);
    assert_eq!(cheap.stats().received, 2);
}

#[tokio::test(start_paused = true)]
async fn a_stream_cut_after_its_first_byte_is_not_sent_elsewhere() {
    let models = Models::default();
    let fallback = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    let cut = service_fn(|_request: Request<Full<Bytes>>| async {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
            Ok(Frame::data(Bytes::from_static(
                b"data: {\"choices\":[]}\n\n",
            ))),
            Err(Box::new(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "reset",
            ))),
        ];
        let body = StreamBody::new(futures::stream::iter(frames)).boxed_unsync();
        Ok::<_, BoxError>(
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(body)
                .unwrap(),
        )
    });
    let router = Router::builder(route("a", &stack(100_000), cut, &models))
        .fallback(
            route("b", &stack(100_000), sim_client(&fallback), &models),
            Fallback::when(Condition::provider_5xx())
                .or(Condition::primary_unavailable())
                .or(Condition::rate_limited()),
        )
        .build();
    let response = router
        .clone()
        .oneshot(request(Priority::Interactive, 20, r#","stream":true"#))
        .await
        .unwrap();
    assert_eq!(
        response.extensions().get::<ServedBy>().unwrap().route(),
        "a"
    );
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    let error = body.frame().await.unwrap().unwrap_err();
    assert!(error.is::<Interrupted>(), "{error}");
    assert_eq!(fallback.stats().received, 0);
}

#[tokio::test(start_paused = true)]
async fn requests_with_one_key_stay_on_one_route() {
    let models = Models::default();
    let old = simulator(SimConfig::openai(10_000, 10_000_000), Duration::ZERO);
    let new = simulator(SimConfig::openai(10_000, 10_000_000), Duration::ZERO);
    let router = Router::builder(route("old", &stack(1_000_000), sim_client(&old), &models))
        .ramp(
            route("new", &stack(1_000_000), sim_client(&new), &models),
            Ramp::new(50.0, 0.0, 50.0).unwrap(),
        )
        .build();
    for conversation in 0..20 {
        let mut routes = Vec::new();
        for _ in 0..3 {
            let mut request = request(Priority::Async, 20, "");
            request
                .extensions_mut()
                .insert(RouteKey(format!("conversation-{conversation}")));
            routes.push(send(&router, request).await.1.route().to_owned());
        }
        assert!(routes.iter().all(|r| *r == routes[0]), "{routes:?}");
    }
    assert!(old.stats().received > 0 && new.stats().received > 0);
}

/// One async request a second for `seconds` through `router`, recording the ramp's share at
/// every second.
async fn traffic(
    router: &Router<Svc>,
    seconds: u64,
    class: Priority,
) -> Vec<(f64, Option<PauseReason>)> {
    let mut shares = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..seconds {
        let status = router.ramp().unwrap().status();
        shares.push((status.share, status.paused));
        let router = router.clone();
        tasks.push(tokio::spawn(async move {
            send(&router, request(class, 20, "")).await
        }));
        time::sleep(Duration::from_secs(1)).await;
    }
    for task in tasks {
        assert_eq!(task.await.unwrap().0, StatusCode::OK);
    }
    shares
}

#[tokio::test(start_paused = true)]
async fn a_healthy_ramp_reaches_its_ceiling_on_schedule() {
    let models = Models::default();
    let old = simulator(
        SimConfig::openai(10_000, 10_000_000),
        Duration::from_millis(100),
    );
    let new = simulator(
        SimConfig::openai(10_000, 10_000_000),
        Duration::from_millis(100),
    );
    let router = Router::builder(route("old", &stack(1_000_000), sim_client(&old), &models))
        .ramp(
            route("new", &stack(1_000_000), sim_client(&new), &models).model("new-model"),
            Ramp::new(5.0, 10.0, 100.0).unwrap(),
        )
        .build();
    let shares = traffic(&router, 660, Priority::Async).await;
    // 95 points at 10 a minute: 9.5 minutes, in periods of 30 s.
    assert_eq!(shares[0].0, 5.0);
    assert_eq!(shares[569].0, 95.0);
    assert_eq!(shares[570].0, 100.0);
    assert!(shares.iter().all(|(_, paused)| paused.is_none()));
    let (old, new) = (old.stats(), new.stats());
    assert_eq!(old.received + new.received, 660);
    assert_eq!(old.rate_limited + new.rate_limited, 0);
    // From 570 s, everything goes to the new route.
    assert!(new.received > 90 + 200, "{}", new.received);
    assert!(old.received > 200, "{}", old.received);
}

/// The new route starts answering 429s at 300 s: the ramp pauses at the end of that period
/// and steps back, the old route absorbs the rest without one 429.
#[tokio::test(start_paused = true)]
async fn a_ramp_stops_within_one_period_when_the_new_route_answers_429s() {
    let models = Models::default();
    let old = simulator(
        SimConfig::openai(10_000, 10_000_000),
        Duration::from_millis(100),
    );
    let new = simulator(
        SimConfig::openai(10_000, 10_000_000).lower_limit_at(
            Duration::from_secs(300),
            Dimension::Requests,
            1,
        ),
        Duration::from_millis(100),
    );
    let old_stack = stack(1_000_000);
    let router = Router::builder(route("old", &old_stack, sim_client(&old), &models))
        .ramp(
            route("new", &stack(1_000_000), sim_client(&new), &models),
            Ramp::new(5.0, 10.0, 100.0).unwrap().step_back(10.0),
        )
        .fallback(
            route("old", &old_stack, sim_client(&old), &models),
            Fallback::when(Condition::rate_limited())
                .or(Condition::would_wait_longer_than(Duration::ZERO)),
        )
        .build();
    let shares = traffic(&router, 420, Priority::Interactive).await;
    assert_eq!(shares[299], (50.0, None));
    assert_eq!(shares[300], (55.0, None));
    // The period [300 s, 330 s) saw the 429s: paused at its end, one step back.
    assert_eq!(shares[330], (45.0, Some(PauseReason::RateLimited)));
    assert!(shares[330..].iter().all(|(share, _)| *share <= 45.0));
    assert_eq!(
        old.stats().rate_limited,
        0,
        "the old route absorbs the rest"
    );
    assert!(new.stats().rate_limited > 0);
}

/// The new route's latency jumps from 100 ms to 5 s at 300 s: the ramp pauses at the end of
/// that period and holds its share while the latency stays high.
#[tokio::test(start_paused = true)]
async fn a_ramp_stops_within_one_period_when_the_new_route_slows_down() {
    let models = Models::default();
    let start = Instant::now();
    let old = simulator(
        SimConfig::openai(10_000, 10_000_000),
        Duration::from_millis(100),
    );
    let new = simulator(
        SimConfig::openai(10_000, 10_000_000),
        Duration::from_millis(100),
    );
    let inner = sim_client(&new);
    let slow = service_fn(move |request: Request<Full<Bytes>>| {
        let inner = inner.clone();
        async move {
            if start.elapsed() >= Duration::from_secs(300) {
                time::sleep(Duration::from_secs(5)).await;
            }
            inner.oneshot(request).await
        }
    });
    let router = Router::builder(route("old", &stack(1_000_000), sim_client(&old), &models))
        .ramp(
            route("new", &stack(1_000_000), slow, &models),
            Ramp::new(5.0, 10.0, 100.0)
                .unwrap()
                .max_p95(Duration::from_secs(2)),
        )
        .build();
    let shares = traffic(&router, 420, Priority::Async).await;
    assert_eq!(shares[300], (55.0, None));
    assert_eq!(shares[330], (55.0, Some(PauseReason::Latency)));
    assert!(
        shares[330..]
            .iter()
            .all(|s| *s == (55.0, Some(PauseReason::Latency)))
    );
    assert_eq!(old.stats().rate_limited + new.stats().rate_limited, 0);
}

/// A ramp of the admitted rate: 6 requests a minute to the new route, the rest to the old one.
#[tokio::test(start_paused = true)]
async fn a_rate_ramp_caps_the_requests_sent_to_its_route() {
    let models = Models::default();
    let old = simulator(
        SimConfig::openai(10_000, 10_000_000),
        Duration::from_millis(100),
    );
    let new = simulator(
        SimConfig::openai(10_000, 10_000_000),
        Duration::from_millis(100),
    );
    let router = Router::builder(route("old", &stack(1_000_000), sim_client(&old), &models))
        .ramp(
            route("new", &stack(1_000_000), sim_client(&new), &models),
            Ramp::admitted_rate(6.0, 6.0, 12.0).unwrap(),
        )
        .build();
    let shares = traffic(&router, 180, Priority::Async).await;
    assert_eq!((shares[0].0, shares[30].0, shares[60].0), (6.0, 9.0, 12.0));
    // At 0, 10, 20 s (6 a minute); 30, 37, 44, 51, 58 s (9 a minute: 6.67 s apart); then 5 s
    // apart from 65 s to 175 s (12 a minute).
    let new = new.stats().received;
    assert_eq!(new, 3 + 5 + 23);
    assert_eq!(old.stats().received + new, 180);
}

/// `would_wait_longer_than(d)` with a wait shorter than `d` waits on the primary; with a longer
/// one, it goes to the fallback at once.
#[tokio::test(start_paused = true)]
async fn would_wait_compares_the_primary_wait_with_its_bound() {
    let models = Models::default();
    let primary = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    let fallback = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    // 600 tokens a minute: 10 a second.
    let primary_stack = stack(600);
    let router = |bound| {
        Router::builder(route("a", &primary_stack, sim_client(&primary), &models))
            .fallback(
                route("b", &stack(10_000), sim_client(&fallback), &models),
                Fallback::when(Condition::would_wait_longer_than(bound)),
            )
            .build()
    };
    let cost = Cost::new(20, 20);
    let held = primary_stack
        .budget()
        .try_reserve(Cost::new(600, 0))
        .unwrap();
    // 40 tokens missing: a wait of 4 s on the primary.
    let request_with_cost = || {
        let mut request = request(Priority::Interactive, 20, "");
        request.extensions_mut().insert(cost);
        request
    };
    let (_, served, elapsed) = send(&router(Duration::from_secs(3)), request_with_cost()).await;
    assert_eq!((served.route(), elapsed), ("b", Duration::ZERO));
    // The same wait, now spent for good: the bucket refills from zero.
    held.charge_estimate();
    let (_, served, elapsed) = send(&router(Duration::from_secs(5)), request_with_cost()).await;
    assert_eq!((served.route(), elapsed), ("a", Duration::from_secs(4)));
    assert_eq!(primary.stats().received, 1);
    assert_eq!(fallback.stats().received, 1);
}

/// A ramp for one tenant moves that tenant's requests only.
#[tokio::test(start_paused = true)]
async fn a_tenant_ramp_moves_that_tenant_only() {
    let models = Models::default();
    let old = simulator(SimConfig::openai(10_000, 10_000_000), Duration::ZERO);
    let new = simulator(SimConfig::openai(10_000, 10_000_000), Duration::ZERO);
    let router = Router::builder(route("old", &stack(1_000_000), sim_client(&old), &models))
        .ramp(
            route("new", &stack(1_000_000), sim_client(&new), &models),
            Ramp::new(100.0, 0.0, 100.0)
                .unwrap()
                .for_tenant("acme".parse().unwrap()),
        )
        .build();
    for tenant in ["acme", "globex", "acme", "initech"] {
        let mut request = request(Priority::Async, 20, "");
        request
            .extensions_mut()
            .insert(tenant.parse::<Tenant>().unwrap());
        let (_, served, _) = send(&router, request).await;
        let expected = if tenant == "acme" { "new" } else { "old" };
        assert_eq!(served.route(), expected, "{tenant}");
        assert_eq!(served.ramped(), tenant == "acme");
    }
    let (_, served, _) = send(&router, request(Priority::Async, 20, "")).await;
    assert_eq!(served.route(), "old", "no tenant, no ramp");
    assert_eq!((old.stats().received, new.stats().received), (3, 2));
}

/// A request the ramped route cannot serve stays on the primary, whatever the share.
#[tokio::test(start_paused = true)]
async fn a_ramp_respects_the_compatibility_check() {
    let models = Models::default();
    let old = simulator(SimConfig::openai(10_000, 10_000_000), Duration::ZERO);
    let new = simulator(SimConfig::openai(10_000, 10_000_000), Duration::ZERO);
    let router = Router::builder(route("old", &stack(1_000_000), sim_client(&old), &models))
        .ramp(
            route("new", &stack(1_000_000), sim_client(&new), &models).attribute("tools", "no"),
            Ramp::new(100.0, 0.0, 100.0).unwrap(),
        )
        .compatible(|request, route| {
            !(request.has_field("tools") && route.attribute("tools") == Some("no"))
        })
        .build();
    let tools = r#","tools":[{"type":"function"}]"#;
    let (_, served, _) = send(&router, request(Priority::Async, 20, tools)).await;
    assert_eq!(served.route(), "old");
    let (_, served, _) = send(&router, request(Priority::Async, 20, "")).await;
    assert_eq!(served.route(), "new");
}

/// The would-wait probe counts only what would be admitted before the request: a batch
/// backlog of 100 items of 1,000 tokens does not make an interactive request wait 100 s, so
/// it stays on the primary (and is admitted as the probe said); a batch request behind the
/// backlog goes to the fallback.
#[tokio::test(start_paused = true)]
async fn would_wait_counts_only_the_requests_ahead_of_the_class() {
    let models = Models::default();
    let primary = simulator(SimConfig::openai(100_000, 10_000_000), Duration::ZERO);
    let fallback = simulator(SimConfig::openai(100_000, 10_000_000), Duration::ZERO);
    // 60,000 tokens a minute: 1,000 a second, all at once.
    let primary_stack = stack(60_000);
    let budget = primary_stack.budget().clone();
    // Drain the bucket, then 100 batch items of 1,000 tokens wait.
    budget
        .try_reserve(Cost::new(60_000, 0))
        .unwrap()
        .charge_estimate();
    let backlog: Vec<_> = (0..100)
        .map(|_| {
            let budget = budget.clone();
            tokio::spawn(async move {
                let reservation = budget
                    .reserve(Cost::new(1_000, 0))
                    .priority(Priority::Batch)
                    .await
                    .unwrap();
                reservation.charge_estimate();
            })
        })
        .collect();
    // Every task takes its place (no time passes: yielding only).
    for _ in 0..1_000 {
        if budget.snapshot().waiters() == 100 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(budget.snapshot().waiters(), 100);
    let router = Router::builder(route("a", &primary_stack, sim_client(&primary), &models))
        .fallback(
            route("b", &stack(10_000_000), sim_client(&fallback), &models),
            Fallback::when(Condition::would_wait_longer_than(Duration::from_secs(3))),
        )
        .build();
    let with_cost = |class| {
        let mut request = request(class, 500, "");
        request.extensions_mut().insert(Cost::new(500, 500));
        request
    };
    // 1,000 tokens at 1,000 a second: one second, ahead of every batch item.
    let (_, served, elapsed) = send(&router, with_cost(Priority::Interactive)).await;
    assert_eq!((served.route(), elapsed), ("a", Duration::from_secs(1)));
    // A batch request waits behind the 99 left: the fallback.
    let (_, served, elapsed) = send(&router, with_cost(Priority::Batch)).await;
    assert_eq!((served.route(), elapsed), ("b", Duration::ZERO));
    for task in backlog {
        task.abort();
    }
}

/// Routes of different client types in one router, once boxed: a failing closure and a
/// governed simulator; the 5xx goes to the fallback.
#[tokio::test(start_paused = true)]
async fn routes_of_different_client_types_share_a_router_once_boxed() {
    let backup = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    let failing = service_fn(|_request: Request<Full<Bytes>>| async {
        let response = Response::builder()
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .body(Full::new(Bytes::from(r#"{"error":{"message":"down"}}"#)))
            .unwrap();
        Ok::<_, std::io::Error>(response)
    });
    use tower_llm_quota::routing::Route;
    let router = Router::builder(Route::new("closure", failing).boxed())
        .fallback(
            Route::stack("governed", &stack(100_000), backup.service()).boxed(),
            Fallback::when(Condition::provider_5xx()),
        )
        .build();
    let response = router
        .oneshot(request(Priority::Interactive, 20, ""))
        .await
        .unwrap();
    let served = response.extensions().get::<ServedBy>().unwrap();
    assert_eq!(served.route(), "governed");
    assert_eq!(served.fallback_reason(), Some(Reason::Provider5xx));
    assert_eq!(backup.stats().admitted, 1);
}

/// OpenAI's flex tier without capacity (the simulator refuses every flex request with a 429
/// "Resource Unavailable"): interactive work falls back at once to the same provider at the
/// standard tier (the route rewrites `service_tier`); batch work, which the fallback does not
/// serve, keeps retrying the cheap tier for its five minutes and is never sent at the dearer
/// one.
#[tokio::test(start_paused = true)]
async fn a_tier_without_capacity_falls_back_to_another_tier_for_the_classes_it_names() {
    let models = Models::default();
    let sim = simulator(
        SimConfig::openai(1_000, 1_000_000).faults(Faults::none().flex_unavailable(1.0)),
        Duration::from_millis(50),
    );
    let shared = stack(100_000);
    let router = Router::builder(route("flex", &shared, sim_client(&sim), &models))
        .fallback(
            route("standard", &shared, sim_client(&sim), &models).service_tier("default"),
            Fallback::when(Condition::tier_unavailable()).classes(&[Priority::Interactive]),
        )
        .build();
    let flex = r#","service_tier":"flex""#;
    let (status, served, took) = send(&router, request(Priority::Interactive, 20, flex)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(served.route(), "standard");
    assert_eq!(served.fallback_reason(), Some(Reason::TierUnavailable));
    assert!(took < Duration::from_secs(1), "interactive waited {took:?}");
    assert_eq!((sim.stats().tier_unavailable, sim.stats().admitted), (1, 1));

    let (status, served, took) = send(&router, request(Priority::Batch, 20, flex)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(served.route(), "flex");
    assert!(
        took > Duration::from_secs(200),
        "batch gave up after {took:?}"
    );
    let stats = sim.stats();
    assert!(
        stats.tier_unavailable > 9,
        "{} flex attempts",
        stats.tier_unavailable
    );
    assert_eq!(
        stats.admitted, 1,
        "batch work was sent at the standard tier"
    );
    // Nothing stays in flight.
    assert_eq!(shared.budget().snapshot().in_flight(), 0);
}
