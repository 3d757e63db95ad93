//! The estimate module: the character estimator's rules, the body reader on each API shape,
//! learned outputs, the layer (bodies pass byte for byte), and, with the `tiktoken` feature,
//! the estimators' quality against tiktoken's true counts on a few hundred generated prompts.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use serde_json::Value;
use tower::{Layer, Service, ServiceExt, service_fn};
use tower_llm_quota::estimate::{self, Defaults, read_request};
use tower_llm_quota::{
    BoxError, Cost, EstimateLayer,
    estimate::{CharEstimator, Estimator, LearnedOutput, OutputRoute},
};

fn c(text: &str) -> u64 {
    CharEstimator::new().count(text)
}

/// The JSON text of `json`, as the reader serializes a nested object.
fn j(json: &str) -> u64 {
    c(&serde_json::from_str::<Value>(json).unwrap().to_string())
}

/// Whether serde_json keeps an object's keys in their order (feature `preserve_order`).
fn serde_json_preserves_order() -> bool {
    let value: Value = serde_json::from_str(r#"{"b":1,"a":2}"#).unwrap();
    value.to_string().starts_with(r#"{"b""#)
}

fn cost_of(body: &str) -> Cost {
    estimate::estimate(body.as_bytes(), &CharEstimator::new(), &Defaults::new())
        .expect("a known request shape")
}

const M: u64 = Defaults::DEFAULT_MESSAGE_TOKENS;
const REPLY: u64 = Defaults::DEFAULT_REPLY_TOKENS;
const IMAGE: u64 = Defaults::DEFAULT_IMAGE_TOKENS;

// ---------------------------------------------------------------------------------------------
// CharEstimator rules

#[test]
fn char_estimator_weighs_each_kind_of_character() {
    // 14 lowercase letters and spaces at 2/7, plus the slack of 2.
    assert_eq!(c("abcdefg abcdef"), 4 + 2);
    assert_eq!(c(""), 0);
    assert_eq!(c("a"), 1 + 2);
    // Digits: one token per group of up to three.
    assert_eq!(c("1234567"), 3 + 2);
    assert_eq!(c("1,000"), 1 + 1 + 1 + 2);
    // Capitals: 1/2 each.
    assert_eq!(c("NASA"), 2 + 2);
    // A word mixing letters and digits: its letters count 1 each, its digits by groups.
    assert_eq!(c("a1b2"), 2 + 2 + 2);
    // Punctuation 1, repeated punctuation 1/4.
    assert_eq!(c("!?"), 2 + 2);
    assert_eq!(c("--------"), 1 + 2 + 2);
    // Indentation after a newline is nearly free; a newline costs 1.
    assert_eq!(c("\n                "), 1 + 1 + 2);
    // Accented letters 2, Cyrillic 3/4, Greek 1.1, CJK 1.3, emoji 3; characters, not bytes.
    assert_eq!(c("ção"), 5 + 2);
    assert_eq!(c("дом"), 3 + 2);
    assert_eq!(c("αβγ"), 4 + 2);
    assert_eq!(c("你好"), 3 + 2);
    assert_eq!(c("🎉"), 3 + 2);
}

#[test]
fn char_estimator_rate_is_configurable() {
    let english = CharEstimator::new().with_chars_per_token(7.0);
    assert_eq!(english.count("abcdefg abcdef"), 2 + 2);
    assert!((english.chars_per_token() - 7.0).abs() < 1e-9);
    let floor = CharEstimator::new().with_chars_per_token(f64::NAN);
    assert_eq!(floor.count("abcd"), 4 + 2);
    assert!((CharEstimator::new().chars_per_token() - 3.5).abs() < 1e-9);
}

// ---------------------------------------------------------------------------------------------
// The body reader

#[test]
fn chat_completions_counts_messages_parts_tools_and_choices() {
    let body = r#"{
        "model": "gpt-4o",
        "max_completion_tokens": 500,
        "n": 2,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "name": "ana", "content": [
                {"type": "text", "text": "Describe this"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo", "detail": "high"}}
            ]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"id\":7}"}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}
        ],
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
        "tool_choice": "auto"
    }"#;
    let tool_calls = r#"[{"id":"call_1","type":"function","function":{"name":"lookup","arguments":"{\"id\":7}"}}]"#;
    let tools =
        r#"[{"type":"function","function":{"name":"lookup","parameters":{"type":"object"}}}]"#;
    let input = (M + c("system") + c("Be brief."))
        + (M + c("user") + c("ana") + c("Describe this") + IMAGE)
        + (M + c("assistant") + j(tool_calls))
        + (M + c("tool") + c("call_1") + c("42"))
        + REPLY
        + j(tools)
        + c("auto");
    let cost = cost_of(body);
    assert_eq!(cost, Cost::new(input, 1_000), "max_completion_tokens × n");
    assert_eq!(cost.requests(), 1);
    // Nested JSON is counted as serde_json writes it back: its keys sorted, or in their order
    // when a dependency turns on serde_json's `preserve_order` (rig does, for the tests).
    let pinned = if serde_json_preserves_order() {
        1_767
    } else {
        1_769
    };
    assert_eq!(input, pinned, "pinned: the rules above and the defaults");
}

#[test]
fn chat_completions_with_max_tokens_and_string_content() {
    let body = r#"{"model":"gpt-4","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}"#;
    // 4 of framing, "user" 4, "hi" 3, 3 priming the reply.
    assert_eq!(cost_of(body), Cost::new(14, 100));
    // The legacy "functions" list counts as JSON text too.
    let body = r#"{"model":"gpt-4","max_tokens":100,"messages":[{"role":"user","content":"hi"}],
                   "functions":[{"name":"f","parameters":{}}]}"#;
    assert_eq!(
        cost_of(body),
        Cost::new(14 + j(r#"[{"name":"f","parameters":{}}]"#), 100)
    );
}

#[test]
fn responses_counts_instructions_input_items_and_text_format() {
    let body = r#"{
        "model": "gpt-4.1",
        "instructions": "Answer in Portuguese.",
        "input": [
            {"role": "user", "content": [
                {"type": "input_text", "text": "Olá, tudo bem?"},
                {"type": "input_image", "image_url": "https://example.com/cat.png"}
            ]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Thinking."}], "encrypted_content": "gAAAAABo"},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{\"q\":1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "found"}
        ],
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}},
        "max_output_tokens": 300
    }"#;
    let text = r#"{"format":{"type":"json_schema","name":"answer","schema":{"type":"object"}}}"#;
    let input = (M + c("Answer in Portuguese."))
        + (M + c("user") + c("Olá, tudo bem?") + IMAGE)
        + (M + c("rs_1") + c("Thinking."))
        + (M + c("c1") + c("lookup") + c("{\"q\":1}"))
        + (M + c("c1") + c("found"))
        + REPLY
        + j(text);
    assert_eq!(cost_of(body), Cost::new(input, 300));
}

#[test]
fn responses_with_a_string_input_gets_the_default_output() {
    let body = r#"{"model":"o3","input":"Hi"}"#;
    assert_eq!(
        cost_of(body),
        Cost::new(M + c("Hi") + REPLY, Defaults::DEFAULT_OUTPUT_TOKENS)
    );
    assert_eq!(Defaults::DEFAULT_OUTPUT_TOKENS, 4_096);
}

#[test]
fn anthropic_messages_counts_system_blocks_documents_tool_use_and_results() {
    let body = r#"{
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "system": [{"type": "text", "text": "You are a lawyer.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Summarize."},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo"}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Contract text."}, "title": "Contract"},
                {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0"}}
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Search first.", "signature": "EqQBCkgIARABGAIiQL"},
                {"type": "tool_use", "id": "tu_1", "name": "search", "input": {"q": "clause 4"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "tu_1", "content": [{"type": "text", "text": "Clause 4: payment in 30 days."}]}
            ]}
        ],
        "tools": [{"name": "search", "description": "Search the contract", "input_schema": {"type": "object"}}]
    }"#;
    let tools = r#"[{"name":"search","description":"Search the contract","input_schema":{"type":"object"}}]"#;
    let input = (M + c("You are a lawyer."))
        + (M + c("user") + c("Summarize.") + IMAGE + c("Contract text.") + c("Contract") + IMAGE)
        + (M + c("assistant")
            + c("Search first.")
            + c("tu_1")
            + c("search")
            + j(r#"{"q":"clause 4"}"#))
        + (M + c("user") + c("tu_1") + c("Clause 4: payment in 30 days."))
        + REPLY
        + j(tools);
    assert_eq!(cost_of(body), Cost::new(input, 1_024));
    // A plain string system prompt is one more message.
    let body = r#"{"model":"claude-haiku-4-5","max_tokens":64,"system":"Be kind.",
                   "messages":[{"role":"user","content":"Hello"}]}"#;
    assert_eq!(
        cost_of(body),
        Cost::new(
            (M + c("Be kind.")) + (M + c("user") + c("Hello")) + REPLY,
            64
        )
    );
}

#[test]
fn gemini_counts_contents_system_instruction_tools_and_its_generation_config() {
    let body = r#"{
        "systemInstruction": {"parts": [{"text": "Answer briefly."}]},
        "contents": [
            {"role": "user", "parts": [
                {"text": "What is in this picture?"},
                {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgoAAAANSUhEUgAA"}}
            ]},
            {"role": "model", "parts": [{"text": "A cat."}]}
        ],
        "tools": [{"functionDeclarations": [{"name": "look"}]}],
        "generationConfig": {"maxOutputTokens": 200, "candidateCount": 2}
    }"#;
    let tools = r#"[{"functionDeclarations":[{"name":"look"}]}]"#;
    let input = (M + c("Answer briefly."))
        + (M + c("user") + c("What is in this picture?") + IMAGE)
        + (M + c("model") + c("A cat."))
        + REPLY
        + j(tools);
    assert_eq!(cost_of(body), Cost::new(input, 400));
    // Without a bound, the default output; the snake_case spelling of Google's SDKs too.
    let body = r#"{"contents":[{"parts":[{"text":"Hi"}]}],
                   "system_instruction":{"parts":[{"text":"Be kind."}]}}"#;
    assert_eq!(
        cost_of(body),
        Cost::new(
            (M + c("Hi")) + (M + c("Be kind.")) + REPLY,
            Defaults::DEFAULT_OUTPUT_TOKENS
        )
    );
}

#[test]
fn gemini_embeddings_count_each_content() {
    let chars = CharEstimator::new();
    let one = br#"{"content":{"parts":[{"text":"a cat"},{"text":"sat"}]}}"#;
    let read = estimate::read_embeddings(one, &chars).unwrap();
    assert_eq!(read.input_tokens(), c("a cat") + c("sat"));
    let batch = br#"{"requests":[{"model":"models/e","content":{"parts":[{"text":"a"}]}},
                                  {"content":{"parts":[{"text":"bb"}]}}]}"#;
    let read = estimate::read_embeddings(batch, &chars).unwrap();
    assert_eq!(read.input_tokens(), c("a") + c("bb"));
    assert_eq!(read.cost(&Defaults::new()).output_tokens(), 0);
    assert!(estimate::read_embeddings(br#"{"requests":[{"x":1}]}"#, &chars).is_none());
}

#[test]
fn legacy_completions_prompt_is_counted() {
    let body =
        r#"{"model":"gpt-3.5-turbo-instruct","prompt":["Once upon", "a time"],"max_tokens":16}"#;
    assert_eq!(cost_of(body), Cost::new(c("Once upon") + c("a time"), 16));
}

#[test]
fn unusable_max_tokens_and_n_fall_back_to_defaults() {
    for body in [
        r#"{"messages":[{"role":"user","content":"x"}]}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":null}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":0}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-5}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":"100"}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"n":0}"#,
    ] {
        assert_eq!(cost_of(body).output_tokens(), 4_096, "{body}");
    }
    let defaults = Defaults::new()
        .with_output_tokens(256)
        .with_message_tokens(3)
        .with_reply_tokens(0)
        .with_image_tokens(85);
    let body = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}],"n":3}"#;
    let cost = estimate::estimate(body, &CharEstimator::new(), &defaults).unwrap();
    assert_eq!(cost, Cost::new(3 + c("user") + 85, 3 * 256));
}

#[test]
fn bodies_that_are_not_llm_requests_have_no_estimate() {
    for body in [
        &b""[..],
        b"not json",
        b"[1, 2, 3]",
        b"{\"model\":\"gpt-4o\"}",
        b"{\"input\": 42}",
        b"{\"messages\": \"oops\"}",
    ] {
        assert_eq!(
            estimate::estimate(body, &CharEstimator::new(), &Defaults::new()),
            None
        );
    }
}

#[test]
fn read_request_reports_model_bound_and_choices() {
    let body = br#"{"model":"gpt-4o-mini","max_tokens":50,"n":4,"messages":[{"role":"user","content":"x"}]}"#;
    let request = read_request(body, &CharEstimator::new(), &Defaults::new()).unwrap();
    assert_eq!(request.model(), Some("gpt-4o-mini"));
    assert_eq!(request.max_output_tokens(), Some(50));
    assert_eq!(request.choices(), 4);
    assert_eq!(request.cost(&Defaults::new()).output_tokens(), 200);
}

/// An estimator that records the model it is asked about.
struct ModelEcho(std::sync::Mutex<Vec<String>>);

impl Estimator for ModelEcho {
    fn count(&self, _text: &str) -> u64 {
        self.0.lock().unwrap().push(String::new());
        1
    }

    fn count_for(&self, model: &str, _text: &str) -> u64 {
        self.0.lock().unwrap().push(model.to_owned());
        1
    }
}

#[test]
fn the_estimator_is_told_the_model() {
    let echo = ModelEcho(Default::default());
    let body = br#"{"model":"gpt-5","messages":[{"role":"user","content":"x"}]}"#;
    read_request(body, &echo, &Defaults::new()).unwrap();
    assert_eq!(*echo.0.lock().unwrap(), ["gpt-5", "gpt-5"]);
    let echo = ModelEcho(Default::default());
    read_request(br#"{"input":"x"}"#, &echo, &Defaults::new()).unwrap();
    assert_eq!(*echo.0.lock().unwrap(), [""]);
}

// ---------------------------------------------------------------------------------------------
// LearnedOutput

#[test]
fn learned_output_estimates_the_nearest_rank_p95() {
    let learned = LearnedOutput::new();
    for tokens in (1..=100).rev() {
        learned.record("r", tokens);
    }
    assert_eq!(learned.estimate("r"), Some(95));
    assert_eq!(learned.samples("r"), 100);
    // The same records, the same answer.
    assert_eq!(learned.estimate("r"), Some(95));
    let median = LearnedOutput::new()
        .with_quantile(0.5)
        .unwrap()
        .with_min_samples(nz(1));
    for tokens in [10, 30, 20] {
        median.record("r", tokens);
    }
    assert_eq!(median.estimate("r"), Some(20));
}

#[test]
fn learned_output_needs_min_samples() {
    let learned = LearnedOutput::new();
    for _ in 0..LearnedOutput::DEFAULT_MIN_SAMPLES - 1 {
        learned.record("r", 10);
    }
    assert_eq!(learned.estimate("r"), None);
    learned.record("r", 10);
    assert_eq!(learned.estimate("r"), Some(10));
}

#[test]
fn learned_output_window_slides() {
    let learned = LearnedOutput::new()
        .with_window(nz(10))
        .with_min_samples(nz(10));
    for _ in 0..10 {
        learned.record("r", 1_000);
    }
    assert_eq!(learned.estimate("r"), Some(1_000));
    for _ in 0..10 {
        learned.record("r", 50);
    }
    assert_eq!(learned.samples("r"), 10);
    assert_eq!(
        learned.estimate("r"),
        Some(50),
        "old samples left the window"
    );
    // Default window: 256.
    let learned = LearnedOutput::new();
    for tokens in 0..1_000 {
        learned.record("r", tokens);
    }
    assert_eq!(learned.samples("r"), 256);
    // The last 256 are 744..=999; their p95 is the 244th: 987.
    assert_eq!(learned.estimate("r"), Some(987));
}

#[test]
fn learned_output_evicts_the_least_recently_used_route() {
    let learned = LearnedOutput::new()
        .with_max_routes(nz(2))
        .with_min_samples(nz(1));
    learned.record("a", 1);
    learned.record("b", 2);
    // Reading "a" makes "b" the least recently used.
    assert_eq!(learned.estimate("a"), Some(1));
    learned.record("c", 3);
    assert_eq!(learned.routes(), 2);
    assert_eq!(learned.estimate("b"), None, "evicted");
    assert_eq!(learned.estimate("a"), Some(1));
    assert_eq!(learned.estimate("c"), Some(3));
    // Recording an existing route evicts nothing.
    learned.record("a", 5);
    assert_eq!(learned.routes(), 2);
}

#[test]
fn output_route_learns_per_choice() {
    let learned = LearnedOutput::new().with_min_samples(nz(1));
    let route = OutputRoute::new(learned.clone(), "r", std::num::NonZeroU64::new(3).unwrap());
    route.record(301);
    assert_eq!(learned.estimate("r"), Some(101), "rounded up");
    assert_eq!(route.route(), "r");
    assert_eq!(route.choices(), 3);
}

#[test]
fn learned_cost_is_bounded_by_max_tokens() {
    let learned = LearnedOutput::new().with_min_samples(nz(1));
    learned.record("r", 700);
    let defaults = Defaults::new();
    let bounded = br#"{"max_tokens":500,"n":2,"messages":[{"role":"user","content":"x"}]}"#;
    let request = read_request(bounded, &CharEstimator::new(), &defaults).unwrap();
    assert_eq!(
        request
            .cost_learned(&defaults, &learned, "r")
            .output_tokens(),
        1_000
    );
    let open = br#"{"messages":[{"role":"user","content":"x"}]}"#;
    let request = read_request(open, &CharEstimator::new(), &defaults).unwrap();
    assert_eq!(
        request
            .cost_learned(&defaults, &learned, "r")
            .output_tokens(),
        700
    );
    assert_eq!(
        request
            .cost_learned(&defaults, &learned, "unknown")
            .output_tokens(),
        4_096
    );
}

// ---------------------------------------------------------------------------------------------
// The layer

/// What the inner service saw: the body's bytes, its cost and its output route.
type Seen = (Bytes, Option<Cost>, Option<OutputRoute>);

async fn echo<B>(request: Request<B>) -> Result<Response<Seen>, BoxError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let cost = request.extensions().get::<Cost>().copied();
    let route = request.extensions().get::<OutputRoute>().cloned();
    let bytes = request.into_body().collect().await.map_err(Into::into)?;
    Ok(Response::new((bytes.to_bytes(), cost, route)))
}

async fn through<B>(layer: &EstimateLayer, request: Request<B>) -> Seen
where
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let mut service = layer.layer(service_fn(echo::<B>));
    service
        .ready()
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap()
        .into_body()
}

const CHAT: &str =
    r#"{"model":"gpt-4o","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}"#;

fn post(body: &'static str) -> Request<Full<Bytes>> {
    Request::post("https://api.openai.com/v1/chat/completions")
        .header("content-type", "application/json")
        .header("content-length", body.len())
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

#[tokio::test]
async fn the_layer_inserts_the_cost_and_passes_the_body_byte_for_byte() {
    let (bytes, cost, route) = through(&EstimateLayer::new(), post(CHAT)).await;
    assert_eq!(bytes, CHAT.as_bytes());
    assert_eq!(cost, Some(Cost::new(14, 100)));
    assert!(route.is_none(), "no learning configured");
    // Non-ASCII and odd spacing survive untouched too.
    let body = "{ \"input\" : \"Olá 你好 🎉\\n\",\n\t\"max_output_tokens\": 7 }";
    let (bytes, cost, _) = through(&EstimateLayer::new(), post(body)).await;
    assert_eq!(bytes, body.as_bytes());
    assert_eq!(cost.map(|c| c.output_tokens()), Some(7));
}

#[tokio::test]
async fn a_cost_set_by_the_caller_is_left_untouched() {
    let mut request = post(CHAT);
    request.extensions_mut().insert(Cost::new(1, 2));
    let (bytes, cost, _) = through(&EstimateLayer::new(), request).await;
    assert_eq!(bytes, CHAT.as_bytes());
    assert_eq!(cost, Some(Cost::new(1, 2)));
}

/// A body the layer must not read: polling it fails.
struct Unreadable;

impl Body for Unreadable {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(Some(Err("the layer read a body it was handed".into())))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(CHAT.len() as u64)
    }
}

impl From<Bytes> for Unreadable {
    fn from(_: Bytes) -> Self {
        Unreadable
    }
}

/// `json` read as a layer above would: parsed once, with the layer's estimator.
fn read_above(json: &str) -> estimate::RequestEstimate {
    let value: Value = serde_json::from_str(json).unwrap();
    estimate::read_request_json(&value, &CharEstimator::new(), &Defaults::new()).unwrap()
}

#[tokio::test]
async fn a_body_read_above_is_estimated_without_reading_it_again() {
    let mut request = Request::post("https://api.openai.com/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Unreadable)
        .unwrap();
    request.extensions_mut().insert(read_above(CHAT));
    let mut service =
        EstimateLayer::new().layer(service_fn(|request: Request<Unreadable>| async move {
            let cost = request.extensions().get::<Cost>().copied();
            let handed = request
                .extensions()
                .get::<estimate::RequestEstimate>()
                .is_some();
            Ok::<_, Infallible>(Response::new((cost, handed)))
        }));
    let (cost, handed) = service
        .ready()
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap()
        .into_body();
    assert_eq!(
        cost,
        Some(cost_of(CHAT)),
        "the same estimate as reading the body"
    );
    assert!(!handed, "the read is consumed");
}

#[tokio::test]
async fn a_body_read_above_is_priced_and_refused_unpriced_without_a_call() {
    use tower_llm_quota::pricing::{CacheCounting, ModelPrices, PriceTable, TokenPrices, Unpriced};
    let prices = TokenPrices::per_million_usd("2.50", "1.25", "2.50", "10").unwrap();
    let table = PriceTable::new(Unpriced::Refuse).with_model("gpt-4o", ModelPrices::new(prices));
    let layer = EstimateLayer::new().prices(Arc::new(table), CacheCounting::new(true, false));
    let mut request = post(CHAT);
    request.extensions_mut().insert(read_above(CHAT));
    let (_, cost, _) = through(&layer, request).await;
    assert!(cost.is_some_and(|c| c.spend() > 0), "priced: {cost:?}");

    let other = r#"{"model":"unpriced","messages":[{"role":"user","content":"hi"}]}"#;
    let mut request = post(other);
    request.extensions_mut().insert(read_above(other));
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let mut service = layer.layer(service_fn(move |_: Request<Full<Bytes>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(())) }
    }));
    let error = service
        .ready()
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap_err();
    assert!(error.is_unpriced(), "{error}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_stream_read_above_is_asked_for_its_usage() {
    let layer = EstimateLayer::new().include_stream_usage(true);
    // No `stream_options`: the member is spliced in, the rest byte for byte.
    let body = r#" {"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut request = post(body);
    request.extensions_mut().insert(read_above(body));
    let (bytes, cost, _) = through(&layer, request).await;
    let expected = format!(
        r#" {{"stream_options":{{"include_usage":true}},{}"#,
        &body[2..]
    );
    assert_eq!(std::str::from_utf8(&bytes).unwrap(), expected);
    assert_eq!(cost, Some(cost_of(body)));
    // `stream_options` without the usage: parsed and written again.
    let body = r#"{"model":"gpt-4o","stream":true,"stream_options":{},"messages":[{"role":"user","content":"hi"}]}"#;
    let mut request = post(body);
    request.extensions_mut().insert(read_above(body));
    let (bytes, _, _) = through(&layer, request).await;
    let json: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(json["stream_options"]["include_usage"], Value::Bool(true));
    // Read by the layer itself, the same.
    let (bytes, _, _) = through(&layer, post(r#"{"stream":true,"input":"hi"}"#)).await;
    let json: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(json["stream_options"]["include_usage"], Value::Bool(true));
    assert_eq!(json["input"], "hi");
}

#[tokio::test]
async fn requests_that_are_not_json_pass_without_a_cost() {
    let mut request = post(CHAT);
    request.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    let (bytes, cost, _) = through(&EstimateLayer::new(), request).await;
    assert_eq!(bytes, CHAT.as_bytes());
    assert_eq!(cost, None);
    // JSON by its content type, but not a request the reader knows.
    let (bytes, cost, _) = through(&EstimateLayer::new(), post("{\"hello\": true}")).await;
    assert_eq!(bytes, "{\"hello\": true}".as_bytes());
    assert_eq!(cost, None);
    // Not JSON at all, without a content type.
    let request = Request::new(Full::new(Bytes::from_static(b"\x00\xffbinary")));
    let (bytes, cost, _) = through(&EstimateLayer::new(), request).await;
    assert_eq!(bytes, &b"\x00\xffbinary"[..]);
    assert_eq!(cost, None);
}

#[tokio::test]
async fn vendor_json_content_types_are_read() {
    let mut request = post(CHAT);
    request.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/vnd.api+JSON; charset=utf-8"),
    );
    let (_, cost, _) = through(&EstimateLayer::new(), request).await;
    assert_eq!(cost, Some(Cost::new(14, 100)));
}

#[tokio::test]
async fn bodies_over_the_limit_pass_without_a_cost() {
    let layer = EstimateLayer::new().max_body_bytes(CHAT.len() - 1);
    let (bytes, cost, _) = through(&layer, post(CHAT)).await;
    assert_eq!(bytes, CHAT.as_bytes());
    assert_eq!(cost, None);
    let layer = EstimateLayer::new().max_body_bytes(CHAT.len());
    let (_, cost, _) = through(&layer, post(CHAT)).await;
    assert!(cost.is_some(), "a body of exactly the limit is read");
    assert_eq!(EstimateLayer::DEFAULT_MAX_BODY_BYTES, 4 * 1024 * 1024);
}

/// A body of several frames whose size may or may not be announced, rebuilt from bytes.
#[derive(Debug, Default)]
struct Frames {
    frames: VecDeque<Result<Bytes, &'static str>>,
    announced: bool,
    pending_forever: bool,
}

impl Frames {
    fn new(frames: &[&'static str], announced: bool) -> Self {
        Self {
            frames: frames
                .iter()
                .map(|f| Ok(Bytes::from_static(f.as_bytes())))
                .collect(),
            announced,
            pending_forever: false,
        }
    }
}

impl From<Bytes> for Frames {
    fn from(bytes: Bytes) -> Self {
        Self {
            frames: VecDeque::from([Ok(bytes)]),
            announced: true,
            pending_forever: false,
        }
    }
}

impl Body for Frames {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.pending_forever {
            return Poll::Pending;
        }
        Poll::Ready(
            self.frames
                .pop_front()
                .map(|f| f.map(Frame::data).map_err(Into::into)),
        )
    }

    fn size_hint(&self) -> SizeHint {
        if !self.announced {
            return SizeHint::default();
        }
        let len: usize = self.frames.iter().flatten().map(Bytes::len).sum();
        SizeHint::with_exact(len as u64)
    }
}

#[tokio::test]
async fn frames_are_joined_and_unknown_sizes_pass_unread() {
    let parts = [&CHAT[..20], &CHAT[20..41], &CHAT[41..]];
    let (bytes, cost, _) = through(
        &EstimateLayer::new(),
        Request::new(Frames::new(&parts, true)),
    )
    .await;
    assert_eq!(bytes, CHAT.as_bytes());
    assert_eq!(cost, Some(Cost::new(14, 100)));
    // A stream whose size is not known is not read: it passes as it came, without a cost.
    let (bytes, cost, _) = through(
        &EstimateLayer::new(),
        Request::new(Frames::new(&parts, false)),
    )
    .await;
    assert_eq!(bytes, CHAT.as_bytes());
    assert_eq!(cost, None);
}

#[tokio::test]
async fn a_failing_body_fails_the_call_before_the_inner_service() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let inner = service_fn(move |_request: Request<Frames>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(())) }
    });
    let mut service = EstimateLayer::new().layer(inner);
    let mut body = Frames::new(&["{\"input\":"], true);
    body.frames.push_back(Err("connection reset"));
    let error = service
        .ready()
        .await
        .unwrap()
        .call(Request::new(body))
        .await
        .unwrap_err();
    assert!(error.is_request_body() && error.is_local(), "{error:?}");
    let source = std::error::Error::source(&error).expect("the body's error");
    assert_eq!(source.to_string(), "connection reset");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn dropped_while_reading_nothing_is_sent() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let inner = service_fn(move |_request: Request<Frames>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(())) }
    });
    let mut service = EstimateLayer::new().layer(inner);
    let mut body = Frames::new(&[CHAT], true);
    body.pending_forever = true;
    let future = service.ready().await.unwrap().call(Request::new(body));
    let mut future = tokio_test::task::spawn(future);
    assert!(future.poll().is_pending());
    drop(future);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    // The service still works afterwards.
    let response = service
        .ready()
        .await
        .unwrap()
        .call(Request::new(Frames::new(&[CHAT], true)))
        .await;
    assert!(response.is_ok());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_layer_learns_outputs_per_route() {
    let learned = LearnedOutput::new().with_min_samples(nz(2));
    let layer = EstimateLayer::new().learn_output(learned.clone());
    // Not enough samples yet: max_tokens is reserved, and the route travels with the request.
    let (_, cost, route) = through(&layer, post(CHAT)).await;
    assert_eq!(cost.map(|c| c.output_tokens()), Some(100));
    let route = route.expect("an output route");
    assert_eq!(route.route(), "/v1/chat/completions gpt-4o");
    route.record(12);
    route.record(30);
    let (_, cost, _) = through(&layer, post(CHAT)).await;
    assert_eq!(
        cost.map(|c| c.output_tokens()),
        Some(30),
        "the p95 of 12 and 30"
    );
    // A custom key; None learns nothing.
    let layer = EstimateLayer::new()
        .learn_output(learned.clone())
        .route_key(|parts, request| {
            let model = request.model()?;
            (parts.method == http::Method::POST).then(|| format!("tenant-a {model}"))
        });
    let (_, _, route) = through(&layer, post(CHAT)).await;
    assert_eq!(
        route.map(|r| r.route().to_owned()).as_deref(),
        Some("tenant-a gpt-4o")
    );
}

#[tokio::test(start_paused = true)]
async fn the_layer_composes_with_the_budget() {
    use std::num::NonZeroU64;
    use tower_llm_quota::{Budget, Dimension, Limit, MissingCost, Quota, TokenBudgetLayer};

    let budget = Budget::new(Quota::new().with_limit(Limit::per_minute(
        Dimension::TotalTokens,
        NonZeroU64::new(100_000).unwrap(),
    )));
    let level = || budget.snapshot().limits()[0].level();
    let before = level();
    let mut service = tower::ServiceBuilder::new()
        .layer(EstimateLayer::new())
        .layer(TokenBudgetLayer::new(budget.clone()).missing_cost(MissingCost::Reject))
        .service(service_fn(|_r: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(()))
        }));
    service
        .ready()
        .await
        .unwrap()
        .call(post(CHAT))
        .await
        .unwrap();
    assert_eq!(
        before - level(),
        114,
        "14 input + 100 output reserved and charged"
    );
    // Not JSON: no cost, and the budget's policy rejects it.
    let mut request = post(CHAT);
    request
        .headers_mut()
        .insert("content-type", http::HeaderValue::from_static("text/plain"));
    let error = service
        .ready()
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap_err();
    assert!(error.is_missing_cost());
}

// ---------------------------------------------------------------------------------------------
// Estimation quality against tiktoken's true counts

/// The estimators against tiktoken's `o200k_base` and `cl100k_base` on a few hundred prompts
/// generated from embedded snippets with a fixed seed. `CharEstimator` must never count less
/// than 0.9 times the truth of either encoding; the ratios are printed (run with
/// `--nocapture`).
#[cfg(feature = "tiktoken")]
mod quality {
    use tower_llm_quota::estimate::CharEstimator;
    use tower_llm_quota::estimate::Estimator;
    use tower_llm_quota::estimate::{TiktokenEncoding, TiktokenEstimator};

    const PROMPTS: usize = 300;
    const SEED: u64 = 0x5EED_CAFE;

    struct Ratios {
        name: &'static str,
        values: Vec<(f64, usize)>,
    }

    impl Ratios {
        fn new(name: &'static str) -> Self {
            Self {
                name,
                values: Vec::new(),
            }
        }

        fn push(&mut self, estimate: u64, truth: u64, prompt: usize) {
            self.values
                .push((estimate as f64 / truth.max(1) as f64, prompt));
        }

        fn sorted(&self) -> Vec<(f64, usize)> {
            let mut values = self.values.clone();
            values.sort_by(|a, b| a.0.total_cmp(&b.0));
            values
        }

        fn report(&self, prompts: &[(String, String)]) {
            let sorted = self.sorted();
            let (min, at) = sorted[0];
            let median = sorted[sorted.len() / 2].0;
            let p5 = sorted[sorted.len() / 20].0;
            let (max, max_at) = sorted[sorted.len() - 1];
            let excerpt = |i: usize| prompts[i].1.chars().take(40).collect::<String>();
            eprintln!(
                "{:<42} min {min:.3} p5 {p5:.3} median {median:.3} max {max:.3}\n    min on {} {:?}\n    max on {} {:?}",
                self.name,
                prompts[at].0,
                excerpt(at),
                prompts[max_at].0,
                excerpt(max_at),
            );
        }
    }

    #[test]
    fn estimators_against_tiktoken() {
        let prompts = prompts(SNIPPETS, PROMPTS, SEED);
        assert!(prompts.len() >= 200);
        let chars = CharEstimator::new();
        let tiktoken = TiktokenEstimator::new();
        let mut char_o200k = Ratios::new("CharEstimator / o200k_base");
        let mut char_cl100k = Ratios::new("CharEstimator / cl100k_base");
        let mut tik_o200k = Ratios::new("TiktokenEstimator(gpt-4o) / o200k_base");
        let mut tik_cl100k = Ratios::new("TiktokenEstimator(gpt-4) / cl100k_base");
        let mut fallback = Ratios::new("TiktokenEstimator(no model) / o200k_base");
        let (mut total_chars, mut total_o200k, mut total_cl100k) = (0u64, 0u64, 0u64);
        for (i, (_, text)) in prompts.iter().enumerate() {
            let o200k = TiktokenEncoding::O200kBase.count(text);
            let cl100k = TiktokenEncoding::Cl100kBase.count(text);
            let estimate = chars.count(text);
            total_chars += estimate;
            total_o200k += o200k;
            total_cl100k += cl100k;
            char_o200k.push(estimate, o200k, i);
            char_cl100k.push(estimate, cl100k, i);
            tik_o200k.push(tiktoken.count_for("gpt-4o", text), o200k, i);
            tik_cl100k.push(tiktoken.count_for("gpt-4", text), cl100k, i);
            fallback.push(tiktoken.count(text), o200k, i);
        }
        eprintln!(
            "{} prompts, {} to {} characters; totals: CharEstimator {total_chars}, o200k_base {total_o200k}, cl100k_base {total_cl100k}",
            prompts.len(),
            prompts.iter().map(|p| p.1.chars().count()).min().unwrap(),
            prompts.iter().map(|p| p.1.chars().count()).max().unwrap(),
        );
        for ratios in [
            &char_o200k,
            &char_cl100k,
            &tik_o200k,
            &tik_cl100k,
            &fallback,
        ] {
            ratios.report(&prompts);
        }
        for ratios in [&char_o200k, &char_cl100k] {
            for &(ratio, i) in &ratios.values {
                assert!(
                    ratio >= 0.9,
                    "{}: {ratio:.3} on prompt {i} ({}): {:?}",
                    ratios.name,
                    prompts[i].0,
                    prompts[i].1
                );
            }
        }
        for ratios in [&tik_o200k, &tik_cl100k] {
            assert!(
                ratios.values.iter().all(|&(ratio, _)| ratio == 1.0),
                "{}",
                ratios.name
            );
        }
    }

    #[test]
    fn encodings_are_chosen_by_model() {
        for model in [
            "gpt-4o",
            "gpt-4o-mini-2024-07-18",
            "chatgpt-4o-latest",
            "gpt-4.1-nano",
            "gpt-5",
            "gpt-5.1-codex",
            "o1",
            "o1-mini",
            "o3-pro",
            "o4-mini",
            "openai/gpt-4o",
            "ft:gpt-4o-mini:acme::abc123",
            "GPT-4o",
        ] {
            assert_eq!(
                TiktokenEncoding::for_model(model),
                Some(TiktokenEncoding::O200kBase),
                "{model}"
            );
        }
        for model in [
            "gpt-4",
            "gpt-4-turbo",
            "gpt-4-0613",
            "gpt-3.5-turbo",
            "gpt-35-turbo-16k",
            "text-embedding-3-small",
        ] {
            assert_eq!(
                TiktokenEncoding::for_model(model),
                Some(TiktokenEncoding::Cl100kBase),
                "{model}"
            );
        }
        for model in ["claude-sonnet-4", "o10", "gpt-40", "llama-3.1-70b", ""] {
            assert_eq!(TiktokenEncoding::for_model(model), None, "{model}");
        }
        let estimator = TiktokenEstimator::new();
        assert_eq!(
            estimator.encoding_for(Some("claude-sonnet-4")),
            TiktokenEncoding::Cl100kBase
        );
        assert_eq!(estimator.encoding_for(None), TiktokenEncoding::Cl100kBase);
        let o200k = estimator.with_fallback(TiktokenEncoding::O200kBase);
        assert_eq!(o200k.encoding_for(None), TiktokenEncoding::O200kBase);
        // A text both encodings split differently.
        let text = "Olá! Você já ouviu falar da programação funcional?";
        assert_eq!(
            estimator.count_for("gpt-4o", text),
            TiktokenEncoding::O200kBase.count(text)
        );
        assert_eq!(
            estimator.count_for("gpt-4", text),
            TiktokenEncoding::Cl100kBase.count(text)
        );
        assert_ne!(
            TiktokenEncoding::O200kBase.count(text),
            TiktokenEncoding::Cl100kBase.count(text)
        );
    }

    #[test]
    fn the_body_reader_counts_with_the_model_encoding() {
        use tower_llm_quota::estimate::{Defaults, read_request};
        let text = "Olá! Você já ouviu falar da programação funcional?";
        let body = |model: &str| {
            format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"{text}"}}]}}"#)
        };
        let estimator = TiktokenEstimator::new();
        for (model, encoding) in [
            ("gpt-4o", TiktokenEncoding::O200kBase),
            ("gpt-4", TiktokenEncoding::Cl100kBase),
        ] {
            let request =
                read_request(body(model).as_bytes(), &estimator, &Defaults::new()).unwrap();
            assert_eq!(
                request.input_tokens(),
                4 + encoding.count("user") + encoding.count(text) + 3
            );
        }
    }

    /// Snippets by kind. Every one is written for this test; none is copied from elsewhere.
    const SNIPPETS: &[(&str, &str)] = &[
        (
            "en",
            "You are a helpful assistant that classifies customer support tickets. For each ticket, answer with exactly one label from the list: billing, shipping, account, technical, other. Do not explain your answer unless the user asks for an explanation.",
        ),
        (
            "en",
            "The quarterly report shows that revenue grew by eleven percent compared to the same period last year, driven mostly by the new subscription plans. Operating costs rose as well, mainly because of cloud infrastructure and the hiring of two support teams in Lisbon and Manila. The board asked for a forecast that accounts for the seasonal dip we usually see in August.",
        ),
        (
            "en",
            "Summarize the following meeting notes in three bullet points. Keep the names of the people who own each action item, and mention any deadline that was agreed. If nothing was decided about a topic, say so explicitly instead of guessing.",
        ),
        (
            "en",
            "I'm trying to understand why my sourdough starter smells like nail polish remover after two days in the fridge. I feed it once a day with equal parts flour and water by weight, and the kitchen is fairly warm. Is it dying, or is it just hungry? What should I change?",
        ),
        (
            "en",
            "Write a short, friendly email to a landlord asking whether the heating system can be checked before winter. Mention that the radiator in the bedroom makes a knocking noise at night and that the thermostat seems to ignore the schedule.",
        ),
        (
            "en",
            "Photosynthesis converts light energy into chemical energy. In the light-dependent reactions, water is split, oxygen is released, and ATP and NADPH are produced; the Calvin cycle then uses them to fix carbon dioxide into sugars. Explain this to a twelve-year-old without using the words ATP or NADPH.",
        ),
        (
            "en",
            "Translate the user's message into formal business English, correct any grammar mistakes, and keep the original meaning. If the message contains a date, rewrite it in ISO 8601 format. Return only the translated text.",
        ),
        (
            "en",
            "Context: the user is a nurse working night shifts who wants meal ideas that are easy to prepare in advance, high in protein, and do not require a microwave. Suggest a plan for five nights with a shopping list grouped by supermarket aisle.",
        ),
        (
            "pt",
            "Você é um assistente que ajuda estudantes a revisar redações do ENEM. Aponte os erros de concordância, de regência e de pontuação, explique cada correção em uma frase curta e, no final, dê uma nota de zero a mil com a justificativa por competência.",
        ),
        (
            "pt",
            "A reunião de condomínio foi marcada para quinta-feira, às dezenove horas, no salão de festas. Na pauta estão a troca do portão da garagem, a contratação de uma nova empresa de limpeza e a aprovação das contas do último semestre. A presença de todos os moradores é muito importante.",
        ),
        (
            "pt",
            "Preciso de uma receita de bolo de fubá com goiabada que não leve leite, porque meu filho tem intolerância à lactose. Pode sugerir substituições para a manteiga também? O forno daqui de casa esquenta bastante, então diga a temperatura e o tempo com cuidado.",
        ),
        (
            "pt",
            "Explique, de forma simples, a diferença entre juros simples e juros compostos, usando como exemplo um empréstimo de cinco mil reais por um ano. Depois, mostre por que o cartão de crédito rotativo costuma ser a opção mais cara para quem está endividado.",
        ),
        (
            "pt",
            "Resuma a notícia a seguir em até três frases, sem opinião: a prefeitura anunciou nesta terça-feira a ampliação da ciclovia da avenida principal, que passará a ligar a estação de metrô ao parque municipal. As obras começam em março e devem durar seis meses, segundo a secretaria de mobilidade.",
        ),
        (
            "pt",
            "Olá! Gostaria de saber se vocês entregam em Florianópolis e qual é o prazo médio para pedidos feitos na sexta-feira à noite. Também queria confirmar se é possível trocar o tamanho da camiseta caso não sirva, e quem paga o frete da devolução.",
        ),
        (
            "pt",
            "A análise de sentimentos deve classificar cada avaliação como positiva, negativa ou neutra. Considere ironias comuns no português brasileiro, como \"que ótimo, mais uma vez atrasou\", e trate gírias regionais com atenção antes de decidir a classificação.",
        ),
        (
            "es",
            "Necesito que redactes una carta de recomendación para una alumna que terminó la carrera de ingeniería química con excelentes notas. Destaca su trabajo en el laboratorio, su capacidad de liderazgo y su participación en proyectos de voluntariado en comunidades rurales.",
        ),
        (
            "es",
            "¿Cuál es la mejor manera de conservar el cilantro fresco durante más de una semana? Siempre se me pone negro en la nevera a los tres días, aunque lo guarde en una bolsa de plástico bien cerrada.",
        ),
        (
            "fr",
            "Rédige un message poli pour informer les clients que la boutique sera fermée pendant les vacances d'été, du quatorze juillet au quinze août. Précise que les commandes en ligne resteront possibles, mais qu'elles seront expédiées à la réouverture.",
        ),
        (
            "fr",
            "Quelle est la différence entre l'imparfait et le passé composé ? Donne-moi des exemples simples, puis corrige les phrases que je t'envoie ensuite en expliquant chaque erreur.",
        ),
        (
            "de",
            "Bitte fasse den folgenden Vertragsentwurf zusammen und markiere alle Klauseln, die für einen Mieter in Deutschland ungewöhnlich oder möglicherweise unwirksam sind. Begründe deine Einschätzung kurz und verweise, wenn möglich, auf die entsprechenden Paragraphen.",
        ),
        (
            "de",
            "Die Straßenbahnlinie wird wegen Bauarbeiten zwischen dem Hauptbahnhof und der Universität für drei Wochen unterbrochen. Fahrgäste werden gebeten, die Ersatzbusse zu nutzen, die alle zehn Minuten fahren.",
        ),
        (
            "it",
            "Scrivi una breve descrizione per il menù di una trattoria romana: carbonara, cacio e pepe, saltimbocca e carciofi alla giudia. Usa un tono caldo ma non esagerato, e indica quali piatti sono vegetariani.",
        ),
        (
            "ru",
            "Объясни простыми словами, как работает ипотека с плавающей ставкой, и приведи пример расчёта ежемесячного платежа. Укажи, какие риски несёт заёмщик, если ставка центрального банка резко вырастет.",
        ),
        (
            "ru",
            "Вчера вечером в городе прошёл сильный дождь, и несколько улиц в центре оказались затоплены. Городские службы работали всю ночь, а утром движение транспорта было полностью восстановлено.",
        ),
        (
            "el",
            "Γράψε ένα σύντομο κείμενο για την ιστορία της Ακρόπολης, κατάλληλο για μαθητές δημοτικού. Εξήγησε γιατί χτίστηκε ο Παρθενώνας και τι σημαίνει η λέξη ακρόπολη.",
        ),
        (
            "zh",
            "请把下面这段产品说明翻译成简体中文，保持专业的语气，并把所有的计量单位换算成公制。如果原文中有不清楚的地方，请在译文后面用括号注明。",
        ),
        (
            "zh",
            "今天的会议主要讨论了新版本的发布计划。测试团队报告说还有三个严重的问题没有解决，所以我们决定把发布日期推迟一周，并每天下午四点同步一次进度。",
        ),
        (
            "ja",
            "次の文章を丁寧な日本語に書き直してください。敬語の使い方に注意し、取引先に送るメールとして自然な表現にしてください。締め切りは来週の金曜日です。",
        ),
        (
            "ja",
            "東京の桜は例年より一週間ほど早く咲き始めました。週末には多くの人が公園に集まり、お花見を楽しみました。",
        ),
        (
            "ko",
            "다음 문장을 자연스러운 한국어로 번역해 주세요. 존댓말을 사용하고, 고객에게 보내는 안내문이라는 점을 고려해 주세요. 배송은 영업일 기준으로 삼 일에서 오 일 정도 걸립니다.",
        ),
        (
            "ar",
            "اكتب رسالة قصيرة ومهذبة إلى العملاء لإبلاغهم بأن خدمة العملاء ستكون متاحة على مدار الساعة ابتداءً من الشهر القادم، واشكرهم على صبرهم خلال فترة التحديث.",
        ),
        (
            "hi",
            "कृपया नीचे दिए गए लेख का सारांश तीन वाक्यों में लिखिए। भाषा सरल रखें ताकि स्कूल के विद्यार्थी भी इसे आसानी से समझ सकें।",
        ),
        (
            "tr",
            "Lütfen aşağıdaki metni resmi bir dille yeniden yazın ve yazım hatalarını düzeltin. Toplantı önümüzdeki salı günü saat on dörtte yapılacaktır.",
        ),
        (
            "pl",
            "Napisz krótką wiadomość do sąsiadów z informacją, że w sobotę od dziewiątej do piętnastej w budynku nie będzie wody z powodu wymiany rur.",
        ),
        (
            "vi",
            "Hãy viết một đoạn văn ngắn giới thiệu về phở Hà Nội, nhấn mạnh nước dùng trong, thơm mùi quế và hồi, ăn kèm với hành lá và rau thơm.",
        ),
        (
            "emoji",
            "Great job team! 🎉🚀 The release went out on time 🙌 and the dashboards look green ✅✅. Next sprint: fix the flaky tests 🐛 and update the docs 📚. Coffee is on me ☕😄",
        ),
        (
            "pt",
            "Oi, tudo bem? Queria saber se ainda dá tempo de mudar o endereço de entrega do meu pedido, porque vou passar o fim de semana na casa da minha mãe.",
        ),
        (
            "pt",
            "Quem paga o frete da devolução se o produto chegou com defeito?",
        ),
        (
            "pt",
            "Escreva um poema curto sobre a saudade de casa, com rimas simples, para ser lido numa festa de despedida de um colega que vai morar no Japão.",
        ),
        (
            "pt",
            "O senhor poderia enviar-me a fatura do mês passado? Não a recebi por correio electrónico e preciso dela para a contabilidade até sexta-feira.",
        ),
        (
            "pt",
            "Liste cinco ideias de passeio barato para fazer com crianças no Rio de Janeiro num domingo de sol, com o horário de funcionamento e o preço aproximado de cada lugar.",
        ),
        (
            "pt",
            "Me ajuda a montar uma planilha de gastos mensais? Tenho aluguel, luz, água, internet, mercado, transporte e academia, e quero ver quanto sobra do salário.",
        ),
        (
            "pt",
            "Corrija o texto: \"A gente se ve amanha as oito, ai a gente decide oque fazer com os documento que faltam.\"",
        ),
        ("en", "Hi! Can you help me?"),
        (
            "en",
            "What's the capital of Australia, and why isn't it Sydney?",
        ),
        (
            "en",
            "Rewrite this SQL so it uses a CTE instead of the nested subquery, and explain whether the planner will treat them differently in PostgreSQL 16.",
        ),
        (
            "en",
            "Give me a regex that matches ISO dates like 2024-03-09 but not 2024-13-40, and show three test cases that should fail.",
        ),
        (
            "es",
            "Hola, ¿me puedes explicar qué es una API REST con un ejemplo sencillo?",
        ),
        (
            "fr",
            "Merci beaucoup ! Peux-tu aussi vérifier l'orthographe du dernier paragraphe ?",
        ),
        (
            "de",
            "Kannst du mir bitte erklären, wie die Mülltrennung in München funktioniert?",
        ),
        (
            "kotlin",
            r#"data class User(val id: Long, val name: String, val email: String?)

fun List<User>.withEmail(): Map<Long, String> =
    mapNotNull { user -> user.email?.let { user.id to it } }.toMap()

suspend fun loadUsers(client: HttpClient): List<User> =
    client.get("https://api.example.com/users").body()"#,
        ),
        (
            "csharp",
            r#"public async Task<IActionResult> GetOrder(int id, CancellationToken ct)
{
    var order = await _db.Orders
        .Include(o => o.Lines)
        .FirstOrDefaultAsync(o => o.Id == id, ct);
    if (order is null)
    {
        return NotFound(new { message = $"Order {id} not found" });
    }
    return Ok(order);
}"#,
        ),
        (
            "php",
            r#"<?php
function slugify(string $text): string {
    $text = iconv('UTF-8', 'ASCII//TRANSLIT', $text);
    $text = preg_replace('/[^a-z0-9]+/i', '-', strtolower($text));
    return trim($text, '-');
}
echo slugify("Promoção de Verão 2024!"); // promocao-de-verao-2024"#,
        ),
        (
            "ruby",
            r#"class Invoice < ApplicationRecord
  has_many :lines, dependent: :destroy
  validates :number, presence: true, uniqueness: true

  def total
    lines.sum { |line| line.quantity * line.unit_price }.round(2)
  end
end"#,
        ),
        (
            "latex",
            r#"The posterior is $p(\theta \mid x) \propto p(x \mid \theta)\, p(\theta)$, and for a Gaussian prior $\theta \sim \mathcal{N}(\mu_0, \sigma_0^2)$ with $n$ observations we get
\[
\mu_n = \frac{\sigma^2 \mu_0 + n \sigma_0^2 \bar{x}}{\sigma^2 + n \sigma_0^2}, \qquad \sigma_n^2 = \left(\frac{1}{\sigma_0^2} + \frac{n}{\sigma^2}\right)^{-1}.
\]"#,
        ),
        (
            "urls",
            "See https://docs.example.com/v2/reference/chat#streaming and https://status.example.com/incidents/8f2k1x9 for details; mirror at http://10.12.0.5:8443/api/v1/health?verbose=true&region=sa-east-1. Contact ops-team+alerts@example.com.",
        ),
        (
            "ids",
            "commit 4e1c9a7d2b0f38e5a6c1d9f0b7e2a3c4d5e6f7a8\nAuthor: Maria Oliveira <maria.oliveira@example.com>\nDate:   Tue Mar 12 09:41:27 2024 -0300\n\n    Fix race in cache eviction (#4821)",
        ),
        (
            "ids",
            "token=eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
        ),
        (
            "numbers",
            "Temperaturas (°C) de segunda a domingo: 18,4; 19,1; 21,7; 23,0; 22,5; 20,9; 17,8. Média: 20,49. Desvio-padrão: 1,96. Umidade relativa entre 61% e 88%.",
        ),
        (
            "json",
            r#"{"model":"claude-sonnet-4","max_tokens":1024,"system":"Você é um assistente jurídico.","messages":[{"role":"user","content":[{"type":"text","text":"Resuma o contrato em anexo."}]}],"metadata":{"user_id":"u_84f2c1"}}"#,
        ),
        (
            "markdown",
            r#"### TODO
* [ ] Migrar o banco para o Postgres 16
* [ ] Atualizar `tokio` para 1.38
* [x] Remover o endpoint `/legacy/export`

**Prazo:** 15/07 · **Responsável:** @joao.silva"#,
        ),
        ("zh", "你好！请问明天北京的天气怎么样？需要带伞吗？"),
        (
            "ja",
            "この関数のバグを見つけてください。配列が空のときにエラーになります。",
        ),
        (
            "ru",
            "Привет! Можешь помочь написать резюме для позиции backend-разработчика на Go?",
        ),
        (
            "uk",
            "Будь ласка, перекладіть цей лист українською мовою і збережіть офіційний стиль.",
        ),
        ("he", "תוכל לעזור לי לכתוב מכתב תודה קצר למורה של הבן שלי?"),
        ("th", "ช่วยแปลประโยคนี้เป็นภาษาอังกฤษให้หน่อยได้ไหมครับ"),
        (
            "rust",
            r#"use std::collections::HashMap;

/// Counts how often each word appears in `text`, ignoring case.
pub fn word_counts(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for word in text.split_whitespace() {
        let word = word.trim_matches(|c: char| !c.is_alphanumeric()).to_lowercase();
        if word.is_empty() {
            continue;
        }
        *counts.entry(word).or_insert(0) += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_repeated_words() {
        let counts = word_counts("The cat and the hat.");
        assert_eq!(counts["the"], 2);
        assert_eq!(counts.get("dog"), None);
    }
}"#,
        ),
        (
            "rust",
            r#"impl<S, B> Service<Request<B>> for Timeout<S>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let sleep = tokio::time::sleep(self.timeout);
        ResponseFuture::new(self.inner.call(request), sleep)
    }
}"#,
        ),
        (
            "python",
            r#"import csv
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Order:
    order_id: str
    customer: str
    total_cents: int


def load_orders(path: Path) -> list[Order]:
    """Read orders from a CSV file, skipping rows with a missing total."""
    orders = []
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if not row.get("total"):
                continue
            cents = round(float(row["total"]) * 100)
            orders.append(Order(row["id"], row["customer"].strip(), cents))
    return orders


if __name__ == "__main__":
    for order in load_orders(Path("orders.csv"))[:10]:
        print(f"{order.order_id:>8} {order.customer:<20} {order.total_cents / 100:10.2f}")"#,
        ),
        (
            "python",
            r#"def retry(times=3, delay=0.5, exceptions=(TimeoutError, ConnectionError)):
    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for attempt in range(1, times + 1):
                try:
                    return fn(*args, **kwargs)
                except exceptions as exc:
                    if attempt == times:
                        raise
                    logger.warning("attempt %d/%d failed: %s", attempt, times, exc)
                    time.sleep(delay * 2 ** (attempt - 1))
        return wrapper
    return decorator"#,
        ),
        (
            "javascript",
            r#"export async function fetchJson(url, { timeoutMs = 5000, ...options } = {}) {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), timeoutMs);
  try {
    const response = await fetch(url, { ...options, signal: controller.signal });
    if (!response.ok) {
      throw new Error(`HTTP ${response.status} for ${url}`);
    }
    return await response.json();
  } finally {
    clearTimeout(timer);
  }
}

const users = await fetchJson("/api/users?page=2&limit=50");
console.log(users.map((u) => `${u.firstName} ${u.lastName}`).join(", "));"#,
        ),
        (
            "typescript",
            r#"interface Invoice {
  id: string;
  issuedAt: Date;
  lines: Array<{ sku: string; quantity: number; unitPrice: number }>;
  discount?: number;
}

export function invoiceTotal(invoice: Invoice): number {
  const subtotal = invoice.lines.reduce((sum, l) => sum + l.quantity * l.unitPrice, 0);
  const discount = Math.min(invoice.discount ?? 0, subtotal);
  return Math.round((subtotal - discount) * 100) / 100;
}"#,
        ),
        (
            "go",
            r#"package main

import (
	"encoding/json"
	"log"
	"net/http"
	"time"
)

type Health struct {
	Status  string        `json:"status"`
	Uptime  time.Duration `json:"uptime_ns"`
	Version string        `json:"version"`
}

func main() {
	started := time.Now()
	http.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(Health{"ok", time.Since(started), "1.4.2"})
	})
	log.Fatal(http.ListenAndServe(":8080", nil))
}"#,
        ),
        (
            "java",
            r#"public final class RateLimiter {
    private final long capacity;
    private final double refillPerNanos;
    private double tokens;
    private long lastRefill;

    public RateLimiter(long capacity, Duration period) {
        this.capacity = capacity;
        this.refillPerNanos = (double) capacity / period.toNanos();
        this.tokens = capacity;
        this.lastRefill = System.nanoTime();
    }

    public synchronized boolean tryAcquire(long amount) {
        long now = System.nanoTime();
        tokens = Math.min(capacity, tokens + (now - lastRefill) * refillPerNanos);
        lastRefill = now;
        if (tokens < amount) {
            return false;
        }
        tokens -= amount;
        return true;
    }
}"#,
        ),
        (
            "c",
            r#"#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int compare_ints(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s N...\n", argv[0]);
        return EXIT_FAILURE;
    }
    int *values = calloc((size_t)argc - 1, sizeof *values);
    for (int i = 1; i < argc; i++) values[i - 1] = atoi(argv[i]);
    qsort(values, (size_t)argc - 1, sizeof *values, compare_ints);
    for (int i = 0; i < argc - 1; i++) printf("%d%c", values[i], i + 2 < argc ? ' ' : '\n');
    free(values);
    return EXIT_SUCCESS;
}"#,
        ),
        (
            "sql",
            r#"SELECT c.customer_id,
       c.email,
       COUNT(o.order_id)            AS orders,
       SUM(o.total_cents) / 100.0   AS revenue,
       MAX(o.created_at)            AS last_order
FROM customers AS c
LEFT JOIN orders AS o
       ON o.customer_id = c.customer_id
      AND o.created_at >= DATE '2024-01-01'
WHERE c.country IN ('BR', 'PT', 'AO')
GROUP BY c.customer_id, c.email
HAVING COUNT(o.order_id) > 2
ORDER BY revenue DESC
LIMIT 100;"#,
        ),
        (
            "shell",
            r#"#!/usr/bin/env bash
set -euo pipefail

backup_dir="/var/backups/$(date +%Y-%m-%d)"
mkdir -p "$backup_dir"
for db in $(psql -At -c "select datname from pg_database where not datistemplate"); do
  pg_dump --format=custom --file="$backup_dir/$db.dump" "$db"
  echo "dumped $db ($(du -h "$backup_dir/$db.dump" | cut -f1))"
done
find /var/backups -maxdepth 1 -type d -mtime +14 -exec rm -rf {} +"#,
        ),
        (
            "html",
            r#"<!doctype html>
<html lang="pt-BR">
  <head>
    <meta charset="utf-8">
    <title>Pedido confirmado</title>
    <link rel="stylesheet" href="/static/app.css">
  </head>
  <body>
    <main class="container">
      <h1>Obrigado pela sua compra!</h1>
      <p>Seu pedido <strong>#48213</strong> será enviado em até <em>2 dias úteis</em>.</p>
      <a class="btn btn-primary" href="/pedidos/48213">Acompanhar pedido</a>
    </main>
  </body>
</html>"#,
        ),
        (
            "css",
            r#".card {
  display: grid;
  grid-template-columns: 64px 1fr auto;
  gap: 0.75rem 1rem;
  padding: 16px 20px;
  border: 1px solid #e2e8f0;
  border-radius: 12px;
  box-shadow: 0 1px 2px rgba(15, 23, 42, 0.06);
}

.card:hover { border-color: #94a3b8; }
@media (max-width: 640px) { .card { grid-template-columns: 1fr; } }"#,
        ),
        (
            "yaml",
            r#"services:
  api:
    image: registry.example.com/shop/api:2.13.0
    ports:
      - "8080:8080"
    environment:
      DATABASE_URL: postgres://shop:secret@db:5432/shop
      RUST_LOG: info,tower_http=debug
    depends_on: [db, redis]
    deploy:
      resources:
        limits: { cpus: "1.5", memory: 512M }
  db:
    image: postgres:16
    volumes: ["pgdata:/var/lib/postgresql/data"]"#,
        ),
        (
            "json",
            r#"{"id":"chatcmpl-9x2","object":"chat.completion","created":1718000000,"model":"gpt-4o-2024-08-06","choices":[{"index":0,"message":{"role":"assistant","content":"Sure, here is the summary."},"finish_reason":"stop"}],"usage":{"prompt_tokens":1234,"completion_tokens":56,"total_tokens":1290}}"#,
        ),
        (
            "json",
            r#"{
  "order": {
    "id": "A-10293",
    "placed_at": "2024-11-03T14:22:08Z",
    "customer": { "name": "Ana Souza", "email": "ana.souza@example.com", "vip": true },
    "items": [
      { "sku": "TSHIRT-BLK-M", "qty": 2, "price": 59.9 },
      { "sku": "MUG-001", "qty": 1, "price": 34.5 },
      { "sku": "CAP-RED", "qty": 3, "price": 19.99 }
    ],
    "shipping": { "method": "express", "cost": 24.0, "zip": "88015-100" },
    "notes": null
  }
}"#,
        ),
        (
            "json",
            r#"[{"type":"function","function":{"name":"get_weather","description":"Get the current weather for a city","parameters":{"type":"object","properties":{"city":{"type":"string","description":"City name, e.g. São Paulo"},"unit":{"type":"string","enum":["celsius","fahrenheit"]}},"required":["city"],"additionalProperties":false}}}]"#,
        ),
        (
            "markdown",
            r#"# Release notes — v2.4.0

## Highlights
- **Faster search**: queries over 1M documents now return in under 120 ms (p95).
- New `--dry-run` flag for the `migrate` command.
- Dark mode for the admin dashboard.

## Breaking changes
1. The `/v1/export` endpoint was removed; use `/v2/exports` instead.
2. `MAX_UPLOAD_MB` now defaults to `25` (was `100`).

| Metric        | v2.3 | v2.4 |
|---------------|-----:|-----:|
| Cold start    | 2.1s | 1.4s |
| Memory (idle) | 310M | 240M |

> Upgrade with `helm upgrade shop ./chart --version 2.4.0`."#,
        ),
        (
            "markdown",
            r#"## Passo a passo

1. Abra o aplicativo e toque em **Configurações**.
2. Escolha *Conta* → *Segurança*.
3. Ative a verificação em duas etapas e guarde os códigos de recuperação.

> **Atenção:** sem os códigos você pode perder o acesso à conta.

- [x] Senha forte
- [ ] Verificação em duas etapas
- [ ] E-mail de recuperação"#,
        ),
        (
            "log",
            r#"2024-06-11T08:14:02.391Z INFO  api::http  request_id=7f3c2a9e method=POST path=/v1/chat/completions status=200 latency_ms=1843 tokens_in=2211 tokens_out=187
2024-06-11T08:14:02.877Z WARN  api::quota tenant=acme-corp dimension=tpm remaining=1200 limit=90000 reset_in=14.2s
2024-06-11T08:14:03.005Z ERROR api::http  request_id=91b0d4e1 method=POST path=/v1/chat/completions status=429 retry_after=2 error="Rate limit reached for gpt-4o in organization org-8H2k on tokens per min (TPM): Limit 90000, Used 89410, Requested 1980.""#,
        ),
        (
            "numbers",
            r#"date,store,units,revenue,margin
2024-01-01,001,137,4521.30,0.231
2024-01-01,002,98,3210.75,0.198
2024-01-02,001,142,4688.10,0.226
2024-01-02,002,87,2950.40,0.204
2024-01-03,001,151,5012.95,0.219
2024-01-03,002,110,3675.00,0.211"#,
        ),
        (
            "numbers",
            "Invoice 2024-00871: 3 x 19.99 = 59.97; shipping 12.50; tax 8.25% = 5.98; total 78.45. Paid by card ending 4417 on 03/11/2024 at 14:22. Tracking: 1Z999AA10123456784. Call +55 48 99123-4567 or +1 (415) 555-0132.",
        ),
        (
            "ids",
            "Request 3f2b9c1e-7d4a-4e8b-9a61-0c5d2e7f8a90 failed on node ip-10-0-3-17 (sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08). Retry with idempotency key 01HZX3K9Q8M2V7T4B6N1C5D0EF.",
        ),
    ];

    /// A small deterministic generator (SplitMix64), so the corpus never depends on a crate's
    /// choice of algorithm.
    struct Rng(u64);

    impl Rng {
        fn new(seed: u64) -> Self {
            Self(seed)
        }
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next_u64() % n as u64) as usize
        }
        fn range(&mut self, lo: usize, hi: usize) -> usize {
            lo + self.below(hi - lo + 1)
        }
        fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
            &items[self.below(items.len())]
        }
        fn chance(&mut self, percent: usize) -> bool {
            self.below(100) < percent
        }
    }

    const WORDS: &[&str] = &[
        "status",
        "nome",
        "cidade",
        "preço",
        "quantidade",
        "customer",
        "region",
        "createdAt",
        "tags",
        "descrição",
        "enabled",
        "score",
        "endereço",
        "latency_ms",
        "itens",
        "user_id",
        "São Paulo",
        "Lisboa",
        "ação",
        "coração",
        "approved",
        "pending",
        "über",
        "naïve",
        "total",
    ];

    fn number(rng: &mut Rng) -> String {
        match rng.below(5) {
            0 => rng.below(10).to_string(),
            1 => rng.range(10, 99_999).to_string(),
            2 => format!("{}.{:02}", rng.range(0, 9_999), rng.below(100)),
            3 => format!("-{}.{}", rng.range(0, 99), rng.range(0, 999_999)),
            _ => rng.next_u64().to_string(),
        }
    }

    fn json_value(rng: &mut Rng, depth: usize) -> String {
        match if depth > 2 {
            rng.below(4)
        } else {
            rng.below(6)
        } {
            0 => number(rng),
            1 => format!("\"{}\"", rng.pick(WORDS)),
            2 => rng.pick(&["true", "false", "null"]).to_string(),
            3 => format!("\"{}-{:04}\"", rng.pick(WORDS), rng.below(10_000)),
            4 => {
                let n = rng.range(1, 5);
                let items: Vec<String> = (0..n).map(|_| json_value(rng, depth + 1)).collect();
                format!("[{}]", items.join(","))
            }
            _ => json_object(rng, depth + 1, false),
        }
    }

    fn json_object(rng: &mut Rng, depth: usize, pretty: bool) -> String {
        let n = rng.range(1, 6);
        let fields: Vec<String> = (0..n)
            .map(|_| {
                format!(
                    "\"{}\":{}{}",
                    rng.pick(WORDS),
                    if pretty { " " } else { "" },
                    json_value(rng, depth)
                )
            })
            .collect();
        if pretty {
            let indent = "  ".repeat(depth + 1);
            format!(
                "{{\n{indent}{}\n{}}}",
                fields.join(&format!(",\n{indent}")),
                "  ".repeat(depth)
            )
        } else {
            format!("{{{}}}", fields.join(","))
        }
    }

    fn table(rng: &mut Rng) -> String {
        let cols = rng.range(2, 6);
        let rows = rng.range(2, 20);
        let markdown = rng.chance(50);
        let mut out = String::new();
        let header: Vec<&str> = (0..cols).map(|_| *rng.pick(WORDS)).collect();
        if markdown {
            out.push_str(&format!(
                "| {} |\n|{}\n",
                header.join(" | "),
                "---|".repeat(cols)
            ));
        } else {
            out.push_str(&format!("{}\n", header.join(",")));
        }
        for _ in 0..rows {
            let cells: Vec<String> = (0..cols).map(|_| number(rng)).collect();
            if markdown {
                out.push_str(&format!("| {} |\n", cells.join(" | ")));
            } else {
                out.push_str(&format!("{}\n", cells.join(",")));
            }
        }
        out
    }

    /// Cuts `text` to a window of about `len` characters, starting and ending at word boundaries
    /// (real prompts do not start in the middle of a word).
    fn window(rng: &mut Rng, text: &str, len: usize) -> String {
        let chars: Vec<char> = text.chars().collect();
        let len = len.min(chars.len());
        let mut start = rng.below(chars.len() - len + 1);
        while start > 0 && !chars[start - 1].is_whitespace() {
            start -= 1;
        }
        let mut end = (start + len).min(chars.len());
        while end < chars.len() && !chars[end].is_whitespace() {
            end += 1;
        }
        chars[start..end]
            .iter()
            .collect::<String>()
            .trim()
            .to_string()
    }

    fn fenced(kind: &str, text: &str) -> String {
        match kind {
            "rust" | "python" | "javascript" | "typescript" | "go" | "java" | "c" | "sql"
            | "shell" | "html" | "css" | "yaml" | "json" => format!("```{kind}\n{text}\n```"),
            _ => text.to_string(),
        }
    }

    /// At least `count` prompts: every snippet whole, then windows, mixes, tables, JSON and long
    /// concatenations drawn with a fixed seed.
    fn prompts(snippets: &[(&str, &str)], count: usize, seed: u64) -> Vec<(String, String)> {
        let mut rng = Rng::new(seed);
        let mut out: Vec<(String, String)> = snippets
            .iter()
            .map(|(k, t)| (k.to_string(), t.to_string()))
            .collect();
        while out.len() < count {
            let prompt = match out.len() % 6 {
                0 => {
                    let (kind, text) = rng.pick(snippets);
                    let len = rng.range(1, 80);
                    (format!("{kind}/short"), window(&mut rng, text, len))
                }
                1 => {
                    let n = rng.range(2, 5);
                    let parts: Vec<&(&str, &str)> = (0..n).map(|_| rng.pick(snippets)).collect();
                    let kinds: Vec<&str> = parts.iter().map(|p| p.0).collect();
                    let text: Vec<String> = parts.iter().map(|(k, t)| fenced(k, t)).collect();
                    (format!("mix/{}", kinds.join("+")), text.join("\n\n"))
                }
                2 => ("numbers/table".to_string(), table(&mut rng)),
                3 => {
                    let pretty = rng.chance(50);
                    let n = rng.range(1, 4);
                    let objects: Vec<String> =
                        (0..n).map(|_| json_object(&mut rng, 0, pretty)).collect();
                    (
                        "json/generated".to_string(),
                        objects.join(if pretty { ",\n" } else { "," }),
                    )
                }
                4 => {
                    let (kind, text) = rng.pick(snippets);
                    let len = rng.range(80, 400);
                    (format!("{kind}/window"), window(&mut rng, text, len))
                }
                _ => {
                    let n = rng.range(6, 14);
                    let mut kinds = Vec::new();
                    let mut text = String::from("Use the context below to answer.\n\n");
                    for _ in 0..n {
                        let (kind, t) = rng.pick(snippets);
                        kinds.push(*kind);
                        text.push_str(&fenced(kind, t));
                        text.push_str("\n\n");
                    }
                    ("long".to_string(), text)
                }
            };
            if !prompt.1.trim().is_empty() {
                out.push(prompt);
            }
        }
        out
    }
}

fn nz(n: usize) -> std::num::NonZeroUsize {
    std::num::NonZeroUsize::new(n).unwrap()
}
