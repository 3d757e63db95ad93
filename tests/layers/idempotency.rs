//! `IdempotencyLayer`: one provider call per operation, in process (paused clock, against the
//! simulator and scripted clients) and across processes sharing Redis (a private
//! `redis-server`) or Postgres (a database of its own), in real time.

use tower_llm_quota_test_support::redis_server;

use std::convert::Infallible;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};
use tower_llm_quota::idempotency::{
    IdempotencyError, IdempotencyLayer, IdempotencyStore, MemoryStore, Operation, Suppressed,
};
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{BoxError, Dimension, Limit, Quota};
use tower_llm_quota_postgres::{PostgresBudget, PostgresIdempotencyStore};
use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_redis::RedisIdempotencyStore;
use tower_llm_quota_sim::{SimConfig, Simulator};
use tower_llm_quota_test_support::postgres_server::TestDatabase;

use redis_server::RedisServer;

const DUPLICATES: usize = 100;

fn simulator() -> Simulator {
    Simulator::new(
        SimConfig::openai(500, 100_000)
            .minute(Duration::from_secs(60))
            .latency(Duration::from_millis(300), Duration::from_millis(4))
            .key("sk-test", "org-1"),
    )
}

const DAY: Duration = Duration::from_secs(86_400);

fn nz(n: u64) -> std::num::NonZeroU64 {
    std::num::NonZeroU64::new(n).unwrap()
}

fn quota() -> Quota {
    Quota::new()
        .with_limit(Limit::per_minute(Dimension::Requests, nz(500)))
        .with_limit(Limit::per_minute(Dimension::TotalTokens, nz(100_000)))
}

fn chat(stream: bool) -> Request<Full<Bytes>> {
    let body = serde_json::json!({
        "model": "gpt-4o-mini",
        "max_tokens": 60,
        "stream": stream,
        "messages": [{"role": "user", "content": "Classify this ticket: my invoice is wrong."}],
    });
    Request::post("/v1/chat/completions")
        .header("authorization", "Bearer sk-test")
        .header("content-type", "application/json")
        .extension(Operation::new("acme", "classify"))
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

/// What one caller received.
#[derive(Debug)]
struct Received {
    status: StatusCode,
    body: Bytes,
    suppressed: Option<Suppressed>,
    first_frame_at: Instant,
    end_at: Instant,
}

async fn receive<S>(service: S, request: Request<Full<Bytes>>) -> Result<Received, BoxError>
where
    S: Service<
            Request<Full<Bytes>>,
            Response = Response<tower_llm_quota::idempotency::IdempotentBody>,
            Error = tower_llm_quota::Error,
        >,
{
    let response = service.oneshot(request).await?;
    let status = response.status();
    let suppressed = response.extensions().get::<Suppressed>().copied();
    let mut body = response.into_body();
    let mut bytes = Vec::new();
    let mut first_frame_at = None;
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        first_frame_at.get_or_insert_with(Instant::now);
        if let Ok(data) = frame.into_data() {
            bytes.extend_from_slice(&data);
        }
    }
    let end_at = Instant::now();
    Ok(Received {
        status,
        body: Bytes::from(bytes),
        suppressed,
        first_frame_at: first_frame_at.unwrap_or(end_at),
        end_at,
    })
}

fn assert_identical(received: &[Received]) {
    let first = &received[0];
    assert_eq!(first.status, StatusCode::OK);
    assert!(!first.body.is_empty());
    for other in received {
        assert_eq!(other.status, first.status);
        assert_eq!(
            other.body, first.body,
            "every caller receives the same bytes"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_hundred_identical_requests_make_one_call_streamed_or_not() {
    for stream in [false, true] {
        let simulator = simulator();
        // A daily request limit refills too slowly to hide a second reservation.
        let daily = Limit::new(Dimension::Requests, nz(1_000), DAY).unwrap();
        let stack = QuotaStack::openai(quota().with_limit(daily));
        let budget = stack.budget().clone();
        let layer = IdempotencyLayer::in_memory();
        let service = layer.layer(stack.layer(simulator.service()));
        let tasks: Vec<_> = (0..DUPLICATES)
            .map(|_| tokio::spawn(receive(service.clone(), chat(stream))))
            .collect();
        let mut received = Vec::new();
        for task in tasks {
            received.push(task.await.unwrap().unwrap());
        }
        let stats = simulator.stats();
        assert_eq!(stats.received, 1, "stream {stream}: one upstream call");
        assert_eq!(stats.admitted, 1);
        assert_identical(&received);
        let suppressed = received.iter().filter(|r| r.suppressed.is_some()).count();
        assert_eq!(suppressed, DUPLICATES - 1);
        // One reservation: the budget was charged for one call only.
        let snapshot = budget.snapshot();
        let daily = snapshot
            .limits()
            .iter()
            .find(|l| l.limit().period() == DAY)
            .unwrap();
        assert_eq!(
            daily.capacity() as i64 - daily.level(),
            1,
            "stream {stream}: one reservation"
        );
        // One key, billed once, and forwarded upstream.
        let keys = simulator.calls_by_idempotency_key();
        assert_eq!(keys.len(), 1);
        assert_eq!(keys.values().copied().collect::<Vec<_>>(), [1]);
        if stream {
            // The waiters received the stream as it came, not after it ended.
            for r in &received {
                assert!(r.first_frame_at < r.end_at, "{r:?}");
            }
        }
        assert_eq!(layer.in_flight(), 0);
    }
}

#[tokio::test(start_paused = true)]
async fn after_completion_the_stored_response_until_the_ttl_ends() {
    let simulator = simulator();
    let stack = QuotaStack::openai(quota());
    let layer = IdempotencyLayer::in_memory().ttl(Duration::from_secs(10));
    let service = layer.layer(stack.layer(simulator.service()));

    let first = receive(service.clone(), chat(false)).await.unwrap();
    assert_eq!(first.suppressed, None);
    tokio::time::advance(Duration::from_secs(9)).await;
    let again = receive(service.clone(), chat(false)).await.unwrap();
    assert_eq!(again.suppressed, Some(Suppressed::Replayed));
    assert_eq!(again.body, first.body);
    assert_eq!(simulator.stats().admitted, 1);

    tokio::time::advance(Duration::from_secs(2)).await;
    let after = receive(service.clone(), chat(false)).await.unwrap();
    assert_eq!(after.suppressed, None, "the record expired: a new call");
    assert_eq!(simulator.stats().admitted, 2);
}

/// A reader that stops once it has the `Content-Length` it was told, as a server writing
/// such an answer does: it never asks for the end after the last bytes. The record is still
/// completed and replayed (before, every such answer from an HTTP upstream was released and
/// called again).
#[tokio::test(start_paused = true)]
async fn a_body_read_to_its_content_length_is_recorded_and_replayed() {
    const ANSWER: &str = r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}"#;
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let client = service_fn(move |_: Request<Full<Bytes>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async move {
            Response::builder()
                .header("content-type", "application/json")
                .header("content-length", ANSWER.len())
                .body(Full::new(Bytes::from_static(ANSWER.as_bytes())))
        }
    });
    let layer = IdempotencyLayer::in_memory();
    let service = layer.layer(client);
    let mut bodies = Vec::new();
    for _ in 0..2 {
        let response = service.clone().oneshot(chat(false)).await.unwrap();
        // A replay may come without the header: then read to the end.
        let length = response
            .headers()
            .get("content-length")
            .map_or(usize::MAX, |v| v.to_str().unwrap().parse().unwrap());
        let mut body = response.into_body();
        let mut bytes = Vec::new();
        while bytes.len() < length {
            let Some(frame) = body.frame().await else {
                break;
            };
            if let Ok(data) = frame.unwrap().into_data() {
                bytes.extend_from_slice(&data);
            }
        }
        drop(body);
        bodies.push(bytes);
    }
    assert_eq!(bodies[0], ANSWER.as_bytes());
    assert_eq!(bodies[1], bodies[0]);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the second was replayed");
    assert_eq!(layer.in_flight(), 0);
}

/// What a scripted client answers to its call number `n`.
type Script = dyn Fn(usize) -> Result<Response<Full<Bytes>>, io::Error> + Send + Sync;

/// A client answering after `latency` with what `script` says for each call, in order.
#[derive(Clone)]
struct Scripted {
    calls: Arc<AtomicUsize>,
    script: Arc<Script>,
    latency: Duration,
}

impl Scripted {
    fn new(
        latency: Duration,
        script: impl Fn(usize) -> Result<Response<Full<Bytes>>, io::Error> + Send + Sync + 'static,
    ) -> Self {
        Self {
            calls: Arc::default(),
            script: Arc::new(script),
            latency,
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn service(
        &self,
    ) -> impl Service<
        Request<Full<Bytes>>,
        Response = Response<Full<Bytes>>,
        Error = io::Error,
        Future = impl Send,
    > + Clone
    + Send
    + 'static {
        let this = self.clone();
        service_fn(move |_request: Request<Full<Bytes>>| {
            let call = this.calls.fetch_add(1, Ordering::SeqCst);
            let (script, latency) = (Arc::clone(&this.script), this.latency);
            async move {
                tokio::time::sleep(latency).await;
                script(call)
            }
        })
    }
}

fn ok(body: &'static str) -> Result<Response<Full<Bytes>>, io::Error> {
    Ok(Response::new(Full::new(Bytes::from(body))))
}

#[tokio::test(start_paused = true)]
async fn a_failed_first_call_lets_the_next_one_through() {
    // Without a response: the duplicates in flight get an error that says so.
    let client = Scripted::new(Duration::from_millis(100), |call| match call {
        0 => Err(io::Error::new(io::ErrorKind::ConnectionReset, "reset")),
        _ => ok("{\"ok\":1}"),
    });
    let service = IdempotencyLayer::in_memory().layer(client.service());
    let tasks: Vec<_> = (0..10)
        .map(|_| tokio::spawn(receive(service.clone(), chat(false))))
        .collect();
    let mut leader_failed = 0;
    for task in tasks {
        let error = task.await.unwrap().unwrap_err();
        let error = error
            .downcast_ref::<tower_llm_quota::Error>()
            .expect("the crate's error");
        if error
            .idempotency_error()
            .is_some_and(IdempotencyError::is_leader_failed)
        {
            leader_failed += 1;
        } else {
            // The leader: the client's own error, as the source.
            let source = std::error::Error::source(error).unwrap();
            assert!(error.is_inner() && source.is::<io::Error>(), "{error}");
        }
    }
    assert_eq!((client.calls(), leader_failed), (1, 9));
    let next = receive(service.clone(), chat(false)).await.unwrap();
    assert_eq!((next.status, client.calls()), (StatusCode::OK, 2));

    // An error status: shared with the duplicates in flight, never stored.
    let client = Scripted::new(Duration::from_millis(100), |call| match call {
        0 => Ok(Response::builder()
            .status(500)
            .body(Full::new(Bytes::from("{\"error\":{}}")))
            .unwrap()),
        _ => ok("{\"ok\":2}"),
    });
    let service = IdempotencyLayer::in_memory().layer(client.service());
    let tasks: Vec<_> = (0..10)
        .map(|_| tokio::spawn(receive(service.clone(), chat(false))))
        .collect();
    for task in tasks {
        assert_eq!(task.await.unwrap().unwrap().status, 500);
    }
    let next = receive(service.clone(), chat(false)).await.unwrap();
    assert_eq!((next.status, client.calls()), (StatusCode::OK, 2));
    assert_eq!(next.body, "{\"ok\":2}");
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_stored_size_reaches_the_waiters_but_is_not_replayed() {
    let simulator = simulator();
    let stack = QuotaStack::openai(quota());
    let layer = IdempotencyLayer::in_memory().max_body(64);
    let service = layer.layer(stack.layer(simulator.service()));
    let tasks: Vec<_> = (0..10)
        .map(|_| tokio::spawn(receive(service.clone(), chat(true))))
        .collect();
    let mut received = Vec::new();
    for task in tasks {
        received.push(task.await.unwrap().unwrap());
    }
    assert_identical(&received);
    assert!(received[0].body.len() > 64);
    // Completed, but too large to keep: an error, not a second billed call.
    let error = receive(service.clone(), chat(true)).await.unwrap_err();
    let error = error
        .downcast_ref::<tower_llm_quota::Error>()
        .and_then(tower_llm_quota::Error::idempotency_error)
        .unwrap();
    assert!(error.is_not_replayable(), "{error}");
    assert_eq!(simulator.stats().admitted, 1);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_first_request_hands_the_operation_to_a_duplicate() {
    let client = Scripted::new(Duration::from_secs(1), |_| ok("{\"done\":true}"));
    let service = IdempotencyLayer::in_memory().layer(client.service());
    let first = tokio::spawn(receive(service.clone(), chat(false)));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let second = tokio::spawn(receive(service.clone(), chat(false)));
    tokio::time::sleep(Duration::from_millis(10)).await;
    first.abort();
    let second = second.await.unwrap().unwrap();
    assert_eq!(second.body, "{\"done\":true}");
    assert_eq!(second.suppressed, None, "it made the call itself");
    assert_eq!(client.calls(), 2);
    // And it was recorded.
    let third = receive(service.clone(), chat(false)).await.unwrap();
    assert_eq!(third.suppressed, Some(Suppressed::Replayed));
    assert_eq!(client.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn keys_from_the_header_are_validated_forwarded_and_scoped_by_tenant() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    let client = service_fn(move |request: Request<Full<Bytes>>| {
        let key = request.headers().get("x-op-key").cloned();
        record.lock().unwrap().push(key);
        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("{}")))) }
    });
    let service = IdempotencyLayer::new(MemoryStore::new())
        .forward_as(Some(http::HeaderName::from_static("x-op-key")))
        .layer(client);
    let with_key = |key: &[u8], tenant: &str| {
        let mut request = chat(false);
        request.headers_mut().insert(
            "idempotency-key",
            http::HeaderValue::from_bytes(key).unwrap(),
        );
        request.extensions_mut().insert(Operation::tenant(tenant));
        request
    };
    let error = receive(service.clone(), with_key(b"bad key", "acme"))
        .await
        .unwrap_err();
    assert!(
        error
            .downcast_ref::<tower_llm_quota::Error>()
            .and_then(tower_llm_quota::Error::idempotency_error)
            .unwrap()
            .is_invalid_key()
    );
    assert!(seen.lock().unwrap().is_empty(), "nothing sent");

    receive(service.clone(), with_key(b"job-1", "acme"))
        .await
        .unwrap();
    let again = receive(service.clone(), with_key(b"job-1", "acme"))
        .await
        .unwrap();
    assert_eq!(again.suppressed, Some(Suppressed::Replayed));
    let other_tenant = receive(service.clone(), with_key(b"job-1", "globex"))
        .await
        .unwrap();
    assert_eq!(other_tenant.suppressed, None);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|key| key.as_ref().unwrap() == "job-1"));
}

/// Two instances, each with its own connections, budget and layer, as two processes would be,
/// against one simulated provider: a hundred duplicates make one call, and a third instance
/// later replays it. `open(round)` opens a store shared by the round's instances,
/// `budget(round)` a budget of the round's account.
async fn a_hundred_duplicates_across_two_instances_make_one_call<S, B>(
    open: impl Fn(usize) -> S,
    budget: impl Fn(usize) -> B,
) where
    S: IdempotencyStore,
    B: std::future::Future<Output = tower_llm_quota::Budget>,
{
    for (round, stream) in [false, true].into_iter().enumerate() {
        let simulator = simulator();
        let mut services = Vec::new();
        let mut budgets = Vec::new();
        for _ in 0..2 {
            let budget = budget(round).await;
            let stack = QuotaStack::openai(quota()).with_budget(budget.clone());
            budgets.push(budget);
            // A lost wake-up would show as a 30 s wait.
            let layer = IdempotencyLayer::new(open(round)).recheck(Duration::from_secs(30));
            services.push(layer.layer(stack.layer(simulator.service())));
        }
        let started = std::time::Instant::now();
        let tasks: Vec<_> = (0..DUPLICATES)
            .map(|i| tokio::spawn(receive(services[i % 2].clone(), chat(stream))))
            .collect();
        let mut received = Vec::new();
        for task in tasks {
            received.push(task.await.unwrap().unwrap());
        }
        let stats = simulator.stats();
        assert_eq!(stats.received, 1, "stream {stream}: one upstream call");
        assert_identical(&received);
        // The second instance's duplicates were woken by the completion, not a timeout.
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        let keys = simulator.calls_by_idempotency_key();
        assert_eq!(keys.values().copied().collect::<Vec<_>>(), [1]);

        // A third instance, later: the stored response.
        let late = IdempotencyLayer::new(open(round))
            .layer(QuotaStack::openai(quota()).layer(simulator.service()));
        let replayed = receive(late, chat(stream)).await.unwrap();
        assert_eq!(replayed.suppressed, Some(Suppressed::Replayed));
        assert_eq!(replayed.body, received[0].body);
        assert_eq!(simulator.stats().received, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_duplicates_across_two_instances_sharing_redis_make_one_call() {
    let redis = RedisServer::start();
    let url = redis.url();
    a_hundred_duplicates_across_two_instances_make_one_call(
        |round| RedisIdempotencyStore::open(&url, &format!("t{round}")).unwrap(),
        |round| {
            let url = url.clone();
            async move {
                RedisBudget::new(url, format!("account-{round}"))
                    .connect(&quota())
                    .await
                    .unwrap()
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_duplicates_across_two_instances_sharing_postgres_make_one_call() {
    let database = migrated_database().await;
    let url = database.url().to_owned();
    a_hundred_duplicates_across_two_instances_make_one_call(
        // One table for every round: each round's operation is told apart by its account.
        |_| PostgresIdempotencyStore::open(&url).unwrap(),
        |round| {
            let url = url.clone();
            async move {
                PostgresBudget::new(url, format!("account-{round}"))
                    .connect(&quota())
                    .await
                    .unwrap()
            }
        },
    )
    .await;
}

/// A database of its own on the machine's Postgres, migrated.
async fn migrated_database() -> TestDatabase {
    let database = TestDatabase::create();
    tower_llm_quota_postgres::migrate(database.url())
        .await
        .unwrap();
    database
}

/// A shared store's records: a claim released wakes a waiter of another instance (not its
/// timeout), a completed record is replayed, and expires with its time to live. `open()` opens
/// the store as another process would.
async fn records_expire_and_failed_claims_are_released<S: IdempotencyStore>(open: impl Fn() -> S) {
    let store = open();
    let lease = Duration::from_secs(30);
    use tower_llm_quota::idempotency::Claim;
    assert_eq!(store.claim("k", "a", lease).await.unwrap(), Claim::Claimed);
    assert_eq!(store.claim("k", "b", lease).await.unwrap(), Claim::InFlight);
    // A waiter in "another process" is woken by the release, not by its timeout.
    let other = open();
    let started = std::time::Instant::now();
    let waiter = tokio::spawn(other.changed("k", Duration::from_secs(20)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.release("k", "a");
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("woken by the release")
        .unwrap()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(store.claim("k", "b", lease).await.unwrap(), Claim::Claimed);

    let record = tower_llm_quota::idempotency::Record::new(
        StatusCode::OK,
        &http::HeaderMap::new(),
        None,
        Some(Bytes::from("stored")),
    );
    store.complete("k", "b", record.clone(), Duration::from_millis(300));
    let mut claim = store.claim("k", "c", lease).await.unwrap();
    for _ in 0..50 {
        if claim != Claim::InFlight {
            break;
        }
        // The completion is written in the background.
        tokio::time::sleep(Duration::from_millis(10)).await;
        claim = store.claim("k", "c", lease).await.unwrap();
    }
    assert_eq!(claim, Claim::Completed(Box::new(record)));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(store.claim("k", "c", lease).await.unwrap(), Claim::Claimed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_records_expire_and_failed_claims_are_released() {
    let redis = RedisServer::start();
    records_expire_and_failed_claims_are_released(|| {
        RedisIdempotencyStore::open(&redis.url(), "ttl").unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_records_expire_and_failed_claims_are_released() {
    let database = migrated_database().await;
    records_expire_and_failed_claims_are_released(|| {
        PostgresIdempotencyStore::open(database.url()).unwrap()
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_simulator_honours_keys_when_asked_billing_each_once() {
    let simulator = Simulator::new(
        SimConfig::openai(500, 100_000)
            .latency(Duration::from_millis(300), Duration::from_millis(4))
            .honour_idempotency_keys(Duration::from_secs(60)),
    );
    let keyed = |key: &'static str| {
        let mut request = chat(false);
        request
            .headers_mut()
            .insert("idempotency-key", http::HeaderValue::from_static(key));
        request
    };
    let service = simulator.service();
    // While the first is generated, a duplicate is told so (409), and not billed.
    let first = tokio::spawn(service.clone().oneshot(keyed("op-1")));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let during = service.clone().oneshot(keyed("op-1")).await.unwrap();
    assert_eq!(during.status(), StatusCode::CONFLICT);
    let first = first.await.unwrap().unwrap();
    let first = first.into_body().collect().await.unwrap().to_bytes();
    // After: the same completion, not billed again.
    let again = service.clone().oneshot(keyed("op-1")).await.unwrap();
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.into_body().collect().await.unwrap().to_bytes(), first);
    // Another key is another call; a call without a key is not counted by key.
    service.clone().oneshot(keyed("op-2")).await.unwrap();
    service.clone().oneshot(chat(false)).await.unwrap();
    let keys = simulator.calls_by_idempotency_key();
    assert_eq!((keys["op-1"], keys["op-2"], keys.len()), (1, 1, 2));
    assert_eq!(simulator.stats().admitted, 3);
    assert_eq!(simulator.idempotent_replays(), 1);
    // The ttl ends: billed again.
    tokio::time::advance(Duration::from_secs(61)).await;
    service.clone().oneshot(keyed("op-1")).await.unwrap();
    assert_eq!(simulator.calls_by_idempotency_key()["op-1"], 2);
}

#[tokio::test(start_paused = true)]
async fn bodies_dropped_mid_stream_release_the_call_and_the_key() {
    let simulator = simulator();
    let stack = QuotaStack::openai(quota());
    let layer = IdempotencyLayer::in_memory();
    let service = layer.layer(stack.layer(simulator.service()));
    let mut bodies = Vec::new();
    for _ in 0..10 {
        let response = service.clone().oneshot(chat(true)).await.unwrap();
        let mut body = response.into_body();
        // Each reads the first chunk, then gives up.
        body.frame().await.unwrap().unwrap();
        bodies.push(body);
    }
    assert_eq!((simulator.stats().admitted, layer.in_flight()), (1, 1));
    assert_eq!(stack.in_flight(), 1, "one call holds one slot");
    drop(bodies);
    // Nothing left: the upstream body dropped (its slot freed), the key released.
    assert_eq!((layer.in_flight(), stack.in_flight()), (0, 0));
    let again = receive(service.clone(), chat(true)).await.unwrap();
    assert_eq!(
        again.suppressed, None,
        "the abandoned operation may be tried again"
    );
    assert_eq!(simulator.stats().admitted, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_store_sends_uncoordinated_and_still_coalesces_locally() {
    // A port nobody listens on.
    let port = tower_llm_quota_test_support::port::free_port();
    let store = RedisIdempotencyStore::open_with_timeout(
        &format!("redis://127.0.0.1:{port}"),
        "down",
        Duration::from_millis(100),
    )
    .unwrap();
    let client = Scripted::new(Duration::from_millis(200), |_| ok("{\"ok\":true}"));
    let service = IdempotencyLayer::new(store).layer(client.service());
    let started = std::time::Instant::now();
    let tasks: Vec<_> = (0..10)
        .map(|_| tokio::spawn(receive(service.clone(), chat(false))))
        .collect();
    for task in tasks {
        assert_eq!(task.await.unwrap().unwrap().body, "{\"ok\":true}");
    }
    assert_eq!(client.calls(), 1, "coalesced in this process");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// Durations past any representable instant (a lease, a TTL, a recheck of `Duration::MAX`)
/// mean "as long as it takes", never an overflow: a second instance waits for the first's
/// call and replays it.
#[tokio::test(start_paused = true)]
async fn the_longest_durations_saturate_instead_of_overflowing() {
    let client = Scripted::new(Duration::from_secs(1), |_| ok("{\"done\":true}"));
    let store = MemoryStore::new();
    let layer = |store: MemoryStore| {
        IdempotencyLayer::new(store)
            .recheck(Duration::MAX)
            .lease(Duration::MAX)
            .ttl(Duration::MAX)
    };
    let first = layer(store.clone()).layer(client.service());
    let second = layer(store).layer(client.service());
    let first = tokio::spawn(receive(first, chat(false)));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let second = receive(second, chat(false)).await.unwrap();
    assert_eq!(second.suppressed, Some(Suppressed::Replayed));
    assert_eq!(first.await.unwrap().unwrap().body, "{\"done\":true}");
    assert_eq!(client.calls(), 1);
}

/// The layer fails with the crate's `Error`: its own decisions read without a downcast, the
/// client's failures as `is_inner` with the client's error as the source.
#[tokio::test(start_paused = true)]
async fn the_layer_fails_with_the_crate_s_error() {
    let client = Scripted::new(Duration::ZERO, |_| ok("{}"));
    let service = IdempotencyLayer::in_memory().layer(client.service());
    let mut request = chat(false);
    request
        .headers_mut()
        .insert("idempotency-key", http::HeaderValue::from_static(""));
    let error: tower_llm_quota::Error = service.oneshot(request).await.unwrap_err();
    assert!(error.is_local());
    assert!(
        error.idempotency_error().unwrap().is_invalid_key(),
        "{error}"
    );
    assert!(std::error::Error::source(&error).is_some());
    assert_eq!(client.calls(), 0);

    let failing = service_fn(|_request: Request<Full<Bytes>>| async {
        Err::<Response<Full<Bytes>>, _>(std::io::Error::other("connection refused"))
    });
    let error = IdempotencyLayer::in_memory()
        .layer(failing)
        .oneshot(chat(false))
        .await
        .unwrap_err();
    assert!(error.is_inner() && error.idempotency_error().is_none());
    assert_eq!(
        std::error::Error::source(&error).unwrap().to_string(),
        "connection refused"
    );
}

/// A claim is renewed while its call is alive: a call lasting ten leases keeps its key, so a
/// duplicate in "another process" (a second layer on the same store) waits for it and gets
/// its record rather than making a second call. Without renewal the claim would lapse after
/// one lease and the duplicate would call again.
#[tokio::test(start_paused = true)]
async fn a_claim_outlasts_its_lease_while_its_call_is_alive() {
    let store = MemoryStore::new();
    let lease = Duration::from_secs(3);
    let client = Scripted::new(Duration::from_secs(30), |_| ok("{\"ok\":1}"));
    let first = IdempotencyLayer::new(store.clone())
        .lease(lease)
        .layer(client.service());
    let second = IdempotencyLayer::new(store.clone())
        .lease(lease)
        .recheck(Duration::from_secs(1))
        .layer(client.service());
    let started = Instant::now();
    let leader = tokio::spawn(receive(first, chat(false)));
    tokio::time::sleep(lease * 4).await;
    let duplicate = receive(second, chat(false)).await.unwrap();
    let leader = leader.await.unwrap().unwrap();
    assert_eq!(client.calls(), 1, "the claim lapsed: a second call");
    assert_eq!(leader.body, "{\"ok\":1}");
    assert_eq!(duplicate.body, leader.body);
    assert_eq!(duplicate.suppressed, Some(Suppressed::Replayed));
    // The duplicate got the record within a recheck of the call's end.
    assert!(
        started.elapsed() <= Duration::from_secs(31),
        "{:?}",
        started.elapsed()
    );
    // Once finished, the renewals stop: the record is there, no claim is held.
    tokio::time::sleep(lease * 10).await;
    use tower_llm_quota::idempotency::Claim;
    let key = store.claim("probe", "x", lease).await.unwrap();
    assert_eq!(key, Claim::Claimed);
}

/// Renewal in a shared store: only the owner extends its claim; a renewed claim outlives its
/// first lease, and one not renewed lapses.
async fn claims_are_renewed_by_their_owner_only(store: impl IdempotencyStore) {
    use tower_llm_quota::idempotency::Claim;
    let lease = Duration::from_millis(400);
    assert_eq!(store.claim("k", "a", lease).await.unwrap(), Claim::Claimed);
    assert!(!store.renew("k", "b", lease).await.unwrap());
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(store.renew("k", "a", lease).await.unwrap());
    }
    // 800 ms after the claim, twice its lease: still held.
    assert_eq!(store.claim("k", "b", lease).await.unwrap(), Claim::InFlight);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(store.claim("k", "b", lease).await.unwrap(), Claim::Claimed);
    assert!(!store.renew("k", "a", lease).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_claims_are_renewed_by_their_owner_only() {
    let redis = RedisServer::start();
    claims_are_renewed_by_their_owner_only(
        RedisIdempotencyStore::open(&redis.url(), "renew").unwrap(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_claims_are_renewed_by_their_owner_only() {
    let database = migrated_database().await;
    claims_are_renewed_by_their_owner_only(PostgresIdempotencyStore::open(database.url()).unwrap())
        .await;
}

/// A duplicate waits for the identical request in flight at most its layer's `max_wait`, or
/// its own `Deadline` when sooner, then fails without a call: here the first call's body is
/// held unread (its claim renewed as long as it lives), and the duplicate comes through
/// another layer on the same store (as from another process).
#[tokio::test(start_paused = true)]
async fn a_duplicate_waits_at_most_its_max_wait_or_its_deadline() {
    let store = MemoryStore::new();
    let client = Scripted::new(Duration::from_millis(10), |_| ok("{}"));
    let first = IdempotencyLayer::new(store.clone()).layer(client.service());
    let other = IdempotencyLayer::new(store.clone())
        .max_wait(Duration::from_secs(60))
        .recheck(Duration::from_secs(1))
        .layer(client.service());
    let held = first.clone().oneshot(chat(false)).await.unwrap();

    let still_in_flight = |error: BoxError| {
        error
            .downcast_ref::<tower_llm_quota::Error>()
            .and_then(tower_llm_quota::Error::idempotency_error)
            .is_some_and(IdempotencyError::is_still_in_flight)
    };
    let start = Instant::now();
    let error = other.clone().oneshot(chat(false)).await.unwrap_err();
    assert!(still_in_flight(error.into()));
    assert_eq!(start.elapsed(), Duration::from_secs(60), "its max_wait");

    let start = Instant::now();
    let mut request = chat(false);
    let deadline = tower_llm_quota::Deadline::after(Duration::from_secs(5));
    request.extensions_mut().insert(deadline);
    let error = other.clone().oneshot(request).await.unwrap_err();
    assert!(still_in_flight(error.into()));
    assert_eq!(start.elapsed(), Duration::from_secs(5), "its deadline");

    // Duration::MAX is a very long time: the wait is armed without overflow.
    let patient = IdempotencyLayer::new(store.clone())
        .max_wait(Duration::MAX)
        .layer(client.service());
    let waiting = tokio::spawn(patient.oneshot(chat(false)));
    tokio::time::sleep(Duration::from_secs(3_600)).await;
    assert!(!waiting.is_finished());
    // The first body read to its end completes the operation: the patient one is answered
    // from the record, and no duplicate made a call.
    held.into_body().collect().await.unwrap();
    let replayed = waiting.await.unwrap().unwrap();
    assert_eq!(
        replayed.extensions().get::<Suppressed>(),
        Some(&Suppressed::Replayed)
    );
    assert_eq!(client.calls(), 1);
}

/// `chat(false)` with the caller's key `key`, and another question when `other`.
fn keyed(key: &str, other: bool) -> Request<Full<Bytes>> {
    let question = if other {
        "Translate it."
    } else {
        "Classify it."
    };
    let body = serde_json::json!({
        "model": "gpt-4o-mini",
        "max_tokens": 60,
        "messages": [{"role": "user", "content": question}],
    });
    Request::post("/v1/chat/completions")
        .header("idempotency-key", key)
        .extension(Operation::tenant("acme"))
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

fn key_reused(error: &BoxError) -> bool {
    error
        .downcast_ref::<tower_llm_quota::Error>()
        .and_then(tower_llm_quota::Error::idempotency_error)
        .is_some_and(IdempotencyError::is_key_reused)
}

/// The caller's key used again for another request is refused, nothing sent, whether the
/// first is still in flight or completed; used again for the same request, it replays.
#[tokio::test(start_paused = true)]
async fn a_key_used_again_for_another_request_is_refused() {
    let client = Scripted::new(Duration::from_secs(1), |n| {
        Ok(Response::new(Full::new(Bytes::from(format!(
            "{{\"n\":{n}}}"
        )))))
    });
    let service = IdempotencyLayer::in_memory().layer(client.service());
    // In flight.
    let first = tokio::spawn(receive(service.clone(), keyed("job-1", false)));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let error = receive(service.clone(), keyed("job-1", true))
        .await
        .unwrap_err();
    assert!(key_reused(&error), "{error}");
    assert!(error.to_string().contains("job-1"), "{error}");
    let first = first.await.unwrap().unwrap();
    // Completed.
    let error = receive(service.clone(), keyed("job-1", true))
        .await
        .unwrap_err();
    assert!(key_reused(&error), "{error}");
    let again = receive(service.clone(), keyed("job-1", false))
        .await
        .unwrap();
    assert_eq!(again.suppressed, Some(Suppressed::Replayed));
    assert_eq!(again.body, first.body);
    assert_eq!(client.calls(), 1, "one call in all");
}
