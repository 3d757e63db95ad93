//! An async-openai client over [`QuotaTransport`], against the simulated provider over HTTP
//! (and a loopback fake for the embeddings and Responses shapes): every call estimated,
//! admitted in its class, settled with the usage in its answer or stream, refunded when
//! dropped, its errors readable.

use tower_llm_quota_test_support as support;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::traits::RequestOptionsBuilder;
use async_openai::types::chat::{
    ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequest,
    CreateChatCompletionRequestArgs,
};
use async_openai::types::embeddings::CreateEmbeddingRequestArgs;
use async_openai::types::responses::CreateResponseArgs;
use bytes::Bytes;
use futures::StreamExt;
use http::Extensions;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use reqwest_middleware::{ClientBuilder, Middleware, Next};
use support::limit;
use tower_llm_quota::async_openai::{QuotaTransport, quota_error};
use tower_llm_quota::middleware::QuotaMiddleware;
use tower_llm_quota::{Budget, Dimension, Limit, Priority, Quota, QuotaStack, RetryPolicy};
use tower_llm_quota_sim::{SimConfig, SimServer, Simulator};

/// A "minute" of the simulator and the stack's quota: one second.
const MINUTE: Duration = Duration::from_secs(1);
const RPM: u64 = 1_000;
const TPM: u64 = 8_000;
/// Total tokens that never refill during a test (a meter): 10 million over 100,000 days.
const METER: u64 = 10_000_000;

fn meter() -> Limit {
    limit(
        Dimension::TotalTokens,
        METER,
        Duration::from_secs(100_000 * 86_400),
        METER,
    )
}

/// The simulator's quota as the stack knows it (the defaults' headroom and burst), and the
/// meter.
fn quota() -> Quota {
    let per_minute = |dimension, amount| {
        Limit::new(
            dimension,
            std::num::NonZeroU64::new(amount).unwrap(),
            MINUTE,
        )
        .unwrap()
    };
    Quota::new()
        .with_limit(per_minute(Dimension::Requests, RPM))
        .with_limit(per_minute(Dimension::TotalTokens, TPM))
        .with_limit(meter())
}

/// What the meter counted: the tokens settled since the budget began.
fn metered(budget: &Budget) -> u64 {
    let snapshot = budget.snapshot();
    let meter = snapshot
        .limit(Dimension::TotalTokens, meter().period())
        .unwrap();
    METER - u64::try_from(meter.level()).unwrap()
}

async fn simulator(config: SimConfig) -> (Simulator, SimServer, OpenAIConfig) {
    let simulator = Simulator::new(config);
    let server = simulator
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let config = OpenAIConfig::new()
        .with_api_base(format!("{}/v1", server.url()))
        .with_api_key("sk-test");
    (simulator, server, config)
}

fn sim_config() -> SimConfig {
    SimConfig::openai(RPM, TPM)
        .minute(MINUTE)
        .latency(Duration::from_millis(20), Duration::from_micros(200))
        .seed(7)
}

/// The stack for `quota`, retrying after a millisecond at the least.
fn stack(quota: Quota) -> QuotaStack {
    let fast = Duration::from_millis(1);
    QuotaStack::openai(quota).retry(RetryPolicy::new().backoff(fast, fast * 10).unwrap())
}

/// Waits until `condition` holds, failing after `within`.
async fn eventually(within: Duration, mut condition: impl FnMut() -> bool) {
    let end = tokio::time::Instant::now() + within;
    while !condition() {
        assert!(tokio::time::Instant::now() < end, "timed out");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn chat(text: &str, max_tokens: u32) -> CreateChatCompletionRequest {
    CreateChatCompletionRequestArgs::default()
        .model("gpt-4o-mini")
        .max_tokens(max_tokens)
        .messages([ChatCompletionRequestUserMessageArgs::default()
            .content(text)
            .build()
            .unwrap()
            .into()])
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_concurrent_calls_of_one_client_meet_no_429_and_settle_exactly() {
    let (simulator, _server, config) = simulator(sim_config()).await;
    let stack = stack(quota());
    let budget = stack.budget().clone();
    let client = Client::with_config(config).with_http_service(QuotaTransport::new(stack));

    let calls = (0..500).map(|i| {
        let client = client.clone();
        async move {
            let text = format!(
                "Ticket {i}: the printer on floor {} is jammed again.",
                i % 7
            );
            client.chat().create(chat(&text, 24)).await
        }
    });
    let answers = futures::future::join_all(calls).await;
    let failed: Vec<_> = answers.iter().filter_map(|a| a.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        failed[0]
    );

    let stats = simulator.stats();
    let served = stats.prompt_tokens + stats.completion_tokens;
    println!(
        "500 calls: {} reached the provider, {} provider 429s, {served} tokens served, {} \
         settled, {:?}",
        stats.received,
        stats.rate_limited,
        metered(&budget),
        stats.elapsed
    );
    assert_eq!(stats.rate_limited, 0, "no provider 429");
    assert_eq!(stats.received, 500, "one upstream call per create");
    assert_eq!(
        metered(&budget),
        served,
        "settled with the usage of each answer"
    );
}

#[tokio::test]
async fn a_streamed_call_is_settled_at_its_end() {
    let (simulator, _server, config) = simulator(sim_config()).await;
    let stack = stack(quota());
    let budget = stack.budget().clone();
    let client = Client::with_config(config).with_http_service(QuotaTransport::new(stack));

    let mut stream = client
        .chat()
        .create_stream(chat("Tell me about token buckets.", 40))
        .await
        .unwrap();
    let mut chunks = 0;
    let mut usage_seen = false;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        usage_seen |= chunk.usage.is_some();
        chunks += 1;
    }
    assert!(chunks > 1);
    assert!(
        !usage_seen,
        "the usage chunk asked for the budget's sake is not the caller's"
    );
    // The stream's end reaches the budget on async-openai's reading task.
    eventually(Duration::from_secs(5), || {
        let stats = simulator.stats();
        metered(&budget) == stats.prompt_tokens + stats.completion_tokens
    })
    .await;
    assert_eq!(budget.snapshot().in_flight(), 0);
}

#[tokio::test]
async fn a_dropped_call_is_refunded_and_a_waiting_one_sends_nothing() {
    let (simulator, _server, config) =
        simulator(sim_config().latency(Duration::from_secs(30), Duration::from_micros(100))).await;
    let tight = Quota::new()
        .with_limit(limit(
            Dimension::TotalTokens,
            120,
            Duration::from_secs(3_600),
            120,
        ))
        .with_limit(meter());
    let stack = stack(tight);
    let budget = stack.budget().clone();
    let client = Client::with_config(config).with_http_service(QuotaTransport::new(stack));

    // Two calls leave and are held by the slow provider; the third waits for the budget.
    // All three are dropped then: the third can no longer be sent.
    let call = || {
        let client = client.clone();
        async move { client.chat().create(chat("Hi", 40)).await }
    };
    let mut calls = Box::pin(async { tokio::join!(call(), call(), call()) });
    let charged_in_flight = tokio::select! {
        _ = &mut calls => panic!("the calls ended before they were dropped"),
        () = eventually(Duration::from_secs(10), || {
            let snapshot = budget.snapshot();
            snapshot.in_flight() == 2
                && snapshot.waiters() == 1
                && simulator.stats().received == 2
        }) => metered(&budget),
    };
    drop(calls);
    let snapshot = budget.snapshot();
    assert_eq!(snapshot.waiters(), 0, "the waiting call left its place");
    assert_eq!(snapshot.in_flight(), 0);
    // The two that left may be counted by the provider: each is charged at most its
    // estimate. The one that waited is charged nothing and sent nothing.
    let charged = metered(&budget);
    assert!(
        charged <= charged_in_flight,
        "{charged} charged after the drop, {charged_in_flight} reserved before"
    );
    assert_eq!(simulator.stats().received, 2);
}

/// An attempt's class, and whether the class header reached the wire.
type Seen = (Option<Priority>, bool);

/// Records what each attempt carries.
#[derive(Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Middleware for Recorder {
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        request: reqwest::Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> Pin<
        Box<
            dyn Future<Output = reqwest_middleware::Result<reqwest::Response>>
                + Send
                + 'async_trait,
        >,
    >
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        self.seen.lock().unwrap().push((
            extensions.get::<Priority>().copied(),
            request.headers().contains_key("x-priority"),
        ));
        Box::pin(next.run(request, extensions))
    }
}

#[tokio::test]
async fn each_call_carries_its_class_and_the_header_stays_home() {
    let (_simulator, _server, config) = simulator(sim_config()).await;
    let recorder = Recorder::default();
    let middleware = ClientBuilder::new(reqwest::Client::new())
        .with(QuotaMiddleware::new(stack(quota())))
        .with(recorder.clone())
        .build();
    let transport = QuotaTransport::from_middleware_client(middleware);
    let interactive = Client::with_config(config.clone()).with_http_service(transport.clone());
    let batch =
        Client::with_config(config).with_http_service(transport.with_priority(Priority::Batch));

    interactive.chat().create(chat("a", 5)).await.unwrap();
    batch.chat().create(chat("b", 5)).await.unwrap();
    batch
        .chat()
        .header("x-priority", "async")
        .unwrap()
        .create(chat("c", 5))
        .await
        .unwrap();
    let seen = recorder.seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        [
            // No class set: the queue's default, not written into the request.
            (None, false),
            (Some(Priority::Batch), false),
            (Some(Priority::Async), false),
        ]
    );
}

#[tokio::test]
async fn an_unknown_class_or_a_call_too_large_fails_at_once_sending_nothing() {
    let (simulator, _server, config) = simulator(sim_config()).await;
    let client = Client::with_config(config).with_http_service(QuotaTransport::new(stack(quota())));

    let unknown = client
        .chat()
        .header("x-priority", "urgent")
        .unwrap()
        .create(chat("a", 5))
        .await
        .unwrap_err();
    assert!(
        matches!(&unknown, OpenAIError::InvalidArgument(m) if m.contains("urgent")),
        "{unknown}"
    );
    // More output than the quota's burst of tokens could ever hold.
    let too_large = client.chat().create(chat("a", 100_000)).await.unwrap_err();
    let decision = quota_error(&too_large).expect("the stack's decision");
    assert!(decision.is_too_large() && decision.is_local(), "{decision}");
    assert_eq!(simulator.stats().received, 0);
}

/// A loopback fake answering the embeddings and Responses shapes with fixed usage, and every
/// chat completion with a 429 (`retry-after-ms: 1`), recording each body it receives.
struct Fake {
    addr: SocketAddr,
    bodies: Arc<Mutex<Vec<String>>>,
}

const EMBEDDINGS: &str = r#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]},{"object":"embedding","index":1,"embedding":[0.3,0.4]}],"model":"text-embedding-3-small","usage":{"prompt_tokens":7,"total_tokens":7}}"#;
const RESPONSE: &str = r#"{"id":"resp_1","object":"response","created_at":1,"model":"gpt-4o-mini","status":"completed","output":[{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Hi","annotations":[]}]}],"usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":0},"output_tokens":3,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":15}}"#;

const RATE_LIMITED: &str = r#"{"error":{"message":"Rate limit reached for gpt-4o-mini on tokens per min (TPM)","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;

impl Fake {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let fake = Self {
            addr: listener.local_addr().unwrap(),
            bodies: Arc::default(),
        };
        let bodies = fake.bodies.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let bodies = bodies.clone();
                let service = hyper::service::service_fn(
                    move |request: http::Request<hyper::body::Incoming>| {
                        let bodies = bodies.clone();
                        async move {
                            use http_body_util::BodyExt;
                            let path = request.uri().path().to_owned();
                            let body = request.into_body().collect().await.unwrap().to_bytes();
                            bodies
                                .lock()
                                .unwrap()
                                .push(String::from_utf8_lossy(&body).into_owned());
                            let (status, answer) = match path.as_str() {
                                "/v1/embeddings" => (200, EMBEDDINGS),
                                "/v1/responses" => (200, RESPONSE),
                                _ => (429, RATE_LIMITED),
                            };
                            Ok::<_, Infallible>(
                                http::Response::builder()
                                    .status(status)
                                    .header("content-type", "application/json")
                                    .header("retry-after-ms", "1")
                                    .body(Full::new(Bytes::from(answer)))
                                    .unwrap(),
                            )
                        }
                    },
                );
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        fake
    }

    fn config(&self) -> OpenAIConfig {
        OpenAIConfig::new()
            .with_api_base(format!("http://{}/v1", self.addr))
            .with_api_key("sk-test")
    }
}

#[tokio::test]
async fn embeddings_and_responses_are_estimated_from_their_bodies_and_settled() {
    let fake = Fake::start().await;
    // 200 tokens in all: an embeddings call reserved with the chat default of 4,096 output
    // tokens would be refused as too large.
    let small = Quota::new()
        .with_limit(limit(
            Dimension::TotalTokens,
            200,
            Duration::from_secs(3_600),
            200,
        ))
        .with_limit(meter());
    let stack = stack(small);
    let budget = stack.budget().clone();
    let client = Client::with_config(fake.config()).with_http_service(QuotaTransport::new(stack));

    let embeddings = client
        .embeddings()
        .create(
            CreateEmbeddingRequestArgs::default()
                .model("text-embedding-3-small")
                .input(["a cat sat", "on the mat"])
                .build()
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(embeddings.data.len(), 2);
    assert_eq!(metered(&budget), 7, "settled with the embeddings usage");

    let response = client
        .responses()
        .create(
            CreateResponseArgs::default()
                .model("gpt-4o-mini")
                .input("Say hi")
                .max_output_tokens(50u32)
                .build()
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.id, "resp_1");
    assert_eq!(metered(&budget), 7 + 15, "settled with the Responses usage");
    assert_eq!(fake.bodies.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn the_providers_final_429_is_async_openais_api_error_after_the_stacks_retries_alone() {
    let fake = Fake::start().await;
    // The interactive class's default: three attempts.
    let transport = QuotaTransport::new(stack(quota())).with_priority(Priority::Interactive);
    let client = Client::with_config(fake.config()).with_http_service(transport);
    let error = client.chat().create(chat("a", 5)).await.unwrap_err();
    match &error {
        OpenAIError::ApiError(api) => {
            assert_eq!(api.status_code, 429);
            assert_eq!(
                api.api_error.code.as_deref(),
                Some("rate_limit_exceeded"),
                "{api:?}"
            );
        }
        other => panic!("not an API error: {other}"),
    }
    assert_eq!(
        fake.bodies.lock().unwrap().len(),
        3,
        "the stack's attempts, none from async-openai"
    );
}
