//! The usage scanner against fixtures written from each provider's documented formats, JSON
//! and event streams: the usage found, the characters of generated text counted, the same
//! result for any split of the body into frames, no panic on any input, and bytes passing
//! through `ReconcileLayer` unchanged.

use std::convert::Infallible;
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::response::Parts;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use proptest::prelude::*;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::usage::{RawUsage, UsageScanner, WireFormat};
use tower_llm_quota::{
    Budget, Cost, Dimension, Limit, Quota, ReconcileLayer, TokenBudgetLayer, Usage,
    reconcile::{BodyEnd, ExtractUsage, ScanUsage},
};

use WireFormat::{Anthropic, Gemini, OpenAiChat, OpenAiResponses};

// ---------------------------------------------------------------------------------------------
// Fixtures and the results they must give.

const CHAT_JSON: &[u8] = include_bytes!("fixtures/usage/openai_chat.json");
const CHAT_NULL_JSON: &[u8] = include_bytes!("fixtures/usage/openai_chat_null_usage.json");
const CHAT_SSE: &[u8] = include_bytes!("fixtures/usage/openai_chat.sse");
const CHAT_NO_USAGE_SSE: &[u8] = include_bytes!("fixtures/usage/openai_chat_no_usage.sse");
const RESPONSES_JSON: &[u8] = include_bytes!("fixtures/usage/openai_responses.json");
const RESPONSES_SSE: &[u8] = include_bytes!("fixtures/usage/openai_responses.sse");
const ANTHROPIC_JSON: &[u8] = include_bytes!("fixtures/usage/anthropic.json");
const ANTHROPIC_SSE: &[u8] = include_bytes!("fixtures/usage/anthropic.sse");
const GEMINI_JSON: &[u8] = include_bytes!("fixtures/usage/gemini.json");
const GEMINI_SSE: &[u8] = include_bytes!("fixtures/usage/gemini.sse");
const GEMINI_ARRAY_JSON: &[u8] = include_bytes!("fixtures/usage/gemini_array.json");

/// A body, how to read it, and what it must give.
struct Case {
    name: &'static str,
    format: WireFormat,
    streaming: bool,
    body: &'static [u8],
    usage: Option<RawUsage>,
    chars: u64,
}

fn raw(input: u64, cache_read: u64, cache_write: Option<u64>, output: u64) -> RawUsage {
    RawUsage {
        input: Some(input),
        cache_read: Some(cache_read),
        cache_write,
        output: Some(output),
        reasoning: None,
        total: None,
    }
}

/// Every fixture. The character counts were computed apart, by decoding the JSON in Python.
fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "openai chat json: cached and reasoning details; decoys in text and arguments",
            format: OpenAiChat,
            streaming: false,
            body: CHAT_JSON,
            usage: Some(RawUsage {
                reasoning: Some(256),
                total: Some(2306),
                ..raw(2006, 1920, None, 300)
            }),
            chars: 101,
        },
        Case {
            name: "openai chat json: usage null",
            format: OpenAiChat,
            streaming: false,
            body: CHAT_NULL_JSON,
            usage: None,
            chars: 9,
        },
        Case {
            name: "openai chat stream with the usage chunk",
            format: OpenAiChat,
            streaming: true,
            body: CHAT_SSE,
            usage: Some(RawUsage {
                reasoning: Some(12),
                total: Some(1163),
                ..raw(1117, 1024, None, 46)
            }),
            chars: 50,
        },
        Case {
            name: "openai chat stream without include_usage",
            format: OpenAiChat,
            streaming: true,
            body: CHAT_NO_USAGE_SSE,
            usage: None,
            chars: 50,
        },
        Case {
            name: "responses json",
            format: OpenAiResponses,
            streaming: false,
            body: RESPONSES_JSON,
            usage: Some(RawUsage {
                reasoning: Some(896),
                total: Some(2523),
                ..raw(1536, 1280, None, 987)
            }),
            chars: 100,
        },
        Case {
            name: "responses stream: response.completed",
            format: OpenAiResponses,
            streaming: true,
            body: RESPONSES_SSE,
            usage: Some(RawUsage {
                reasoning: Some(0),
                total: Some(48),
                ..raw(37, 0, None, 11)
            }),
            chars: 11,
        },
        Case {
            name: "anthropic json: cache breakdown, decoy usage in tool input",
            format: Anthropic,
            streaming: false,
            body: ANTHROPIC_JSON,
            usage: Some(raw(2095, 1800, Some(150), 503)),
            chars: 41,
        },
        Case {
            name: "anthropic stream: cumulative message_delta",
            format: Anthropic,
            streaming: true,
            body: ANTHROPIC_SSE,
            // Output 102, the last value (not 2 + 89 + 102); the cache write of message_start
            // kept, as no delta repeats it.
            usage: Some(raw(472, 2048, Some(96), 102)),
            chars: 87,
        },
        Case {
            name: "gemini json: thoughts in the output, decoy in function args",
            format: Gemini,
            streaming: false,
            body: GEMINI_JSON,
            usage: Some(RawUsage {
                input: Some(1024),
                cache_read: Some(768),
                cache_write: None,
                output: Some(9 + 28),
                reasoning: Some(28),
                total: Some(1061),
            }),
            chars: 32,
        },
        Case {
            name: "gemini stream: the last usageMetadata",
            format: Gemini,
            streaming: true,
            body: GEMINI_SSE,
            usage: Some(gemini_last()),
            chars: 46,
        },
        Case {
            name: "gemini json array (streamGenerateContent without alt=sse)",
            format: Gemini,
            streaming: false,
            body: GEMINI_ARRAY_JSON,
            usage: Some(gemini_last()),
            chars: 46,
        },
    ]
}

/// The last `usageMetadata` of the Gemini stream.
fn gemini_last() -> RawUsage {
    RawUsage {
        input: Some(10),
        cache_read: None,
        cache_write: None,
        output: Some(12 + 26),
        reasoning: Some(26),
        total: Some(48),
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// What a scanner found after `frames`.
fn scan<'a>(
    format: WireFormat,
    streaming: bool,
    frames: impl IntoIterator<Item = &'a [u8]>,
) -> (Option<RawUsage>, u64) {
    let mut scanner = UsageScanner::new(format, streaming);
    for frame in frames {
        scanner.data(frame);
    }
    (scanner.usage(), scanner.streamed_chars())
}

/// `body` cut into frames at `cuts` (positions, in any order, out of range ones clamped).
fn split_at<'a>(body: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = cuts.iter().map(|&c| c.min(body.len())).collect();
    cuts.sort_unstable();
    let mut frames = Vec::new();
    let mut start = 0;
    for cut in cuts.into_iter().chain([body.len()]) {
        frames.push(&body[start..cut]);
        start = cut;
    }
    frames
}

/// `body` cut into frames of random sizes, from 1 byte to the whole body.
fn random_frames<'a>(body: &'a [u8], rng: &mut fastrand::Rng) -> Vec<&'a [u8]> {
    let max = rng.usize(1..=body.len().max(1));
    let mut frames = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (frame, tail) = rest.split_at(rng.usize(1..=max).min(rest.len()));
        frames.push(frame);
        rest = tail;
    }
    frames
}

fn crlf(body: &[u8]) -> Vec<u8> {
    String::from_utf8(body.to_vec())
        .unwrap()
        .replace('\n', "\r\n")
        .into_bytes()
}

// ---------------------------------------------------------------------------------------------
// Fixtures, whole and split.

#[test]
fn every_fixture_gives_its_usage_and_characters() {
    for case in cases() {
        let found = scan(case.format, case.streaming, [case.body]);
        assert_eq!(found, (case.usage, case.chars), "{}", case.name);
    }
}

/// One OpenAI client calls Chat Completions, the Responses API and embeddings through one
/// profile: the Chat Completions format reads the other two's usage as their own format does.
#[test]
fn the_chat_format_reads_the_responses_and_embeddings_usage() {
    for (body, streaming) in [(RESPONSES_JSON, false), (RESPONSES_SSE, true)] {
        let own = scan(OpenAiResponses, streaming, [body]).0;
        assert!(own.is_some());
        assert_eq!(scan(OpenAiChat, streaming, [body]).0, own);
    }
    let embeddings = br#"{"object":"list","data":[],"usage":{"prompt_tokens":7,"total_tokens":7}}"#;
    let usage = scan(OpenAiChat, false, [&embeddings[..]]).0.unwrap();
    assert_eq!(
        (usage.input, usage.output, usage.total),
        (Some(7), None, Some(7))
    );
}

/// A reader that stops at `[DONE]` (async-openai does) drops an OpenAI stream after its usage:
/// the usage is final, settled as reported; an Anthropic stream dropped early is not.
#[test]
fn an_openai_stream_dropped_after_its_usage_settles_as_reported() {
    use tower_llm_quota::provider::{Profile, ProviderScan};
    // Text that reads as more tokens than the provider counted: the report wins.
    let stream = format!(
        "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n\
         data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":12,\"completion_tokens\":10,\
         \"total_tokens\":22}}}}\n\n",
        "word ".repeat(140)
    );
    let mut scan = ProviderScan::new(Profile::openai(), true);
    scan.data(stream.as_bytes());
    let reported = scan
        .finish(BodyEnd::Dropped, Cost::new(1_000, 1_000))
        .unwrap();
    assert_eq!(
        (reported.input_tokens(), reported.output_tokens()),
        (12, 10)
    );

    let mut cut = ProviderScan::new(Profile::anthropic(), true);
    cut.data(&ANTHROPIC_SSE[..ANTHROPIC_SSE.len() / 2]);
    let estimated = cut
        .finish(BodyEnd::Dropped, Cost::new(1_000, 1_000))
        .unwrap();
    let whole = self::scan(Anthropic, true, [ANTHROPIC_SSE]).0.unwrap();
    assert_ne!(Some(estimated.output_tokens()), whole.output);
}

#[test]
fn every_fixture_gives_the_same_in_any_frames() {
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    for case in cases() {
        let expected = (case.usage, case.chars);
        let bytes = case.body.chunks(1);
        assert_eq!(
            scan(case.format, case.streaming, bytes),
            expected,
            "{}",
            case.name
        );
        for _ in 0..300 {
            let frames = random_frames(case.body, &mut rng);
            let found = scan(case.format, case.streaming, frames.iter().copied());
            assert_eq!(found, expected, "{}: {:?}", case.name, frames.len());
        }
    }
}

#[test]
fn event_streams_read_the_same_with_crlf_line_ends() {
    let mut rng = fastrand::Rng::with_seed(7);
    for case in cases().into_iter().filter(|c| c.streaming) {
        let body = crlf(case.body);
        let expected = (case.usage, case.chars);
        assert_eq!(
            scan(case.format, true, [&body[..]]),
            expected,
            "{}",
            case.name
        );
        for _ in 0..100 {
            let frames = random_frames(&body, &mut rng);
            assert_eq!(scan(case.format, true, frames), expected, "{}", case.name);
        }
    }
}

#[test]
fn the_body_corrects_a_wrong_content_type() {
    for case in cases() {
        let found = scan(case.format, !case.streaming, [case.body]);
        assert_eq!(found, (case.usage, case.chars), "{}", case.name);
    }
}

#[test]
fn the_usage_is_known_as_soon_as_it_arrives() {
    // Before the usage chunk: nothing; after it, before `[DONE]`: the usage.
    let at = find(CHAT_SSE, b"\"choices\":[]");
    let mut scanner = UsageScanner::new(OpenAiChat, true);
    scanner.data(&CHAT_SSE[..at]);
    assert_eq!(scanner.usage(), None);
    assert_eq!(scanner.streamed_chars(), 50);
    let done = find(CHAT_SSE, b"data: [DONE]");
    scanner.data(&CHAT_SSE[at..done]);
    assert_eq!(scanner.usage().and_then(|u| u.input), Some(1117));
    // A JSON body: as soon as the usage object closes, before the rest of the document.
    let end = find(CHAT_JSON, b"\"service_tier\"");
    let (usage, _) = scan(OpenAiChat, false, [&CHAT_JSON[..end]]);
    assert_eq!(usage.and_then(|u| u.output), Some(300));
}

fn find(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Cut streams and partial reports.

#[test]
fn a_stream_cut_in_the_middle_has_no_usage_but_counted_text() {
    // Cut in the middle of the event carrying the usage.
    for (format, body, usage_at) in [
        (OpenAiChat, CHAT_SSE, &b"\"choices\":[]"[..]),
        (
            OpenAiResponses,
            RESPONSES_SSE,
            b"\"type\":\"response.completed\"",
        ),
    ] {
        let (usage, chars) = scan(format, true, [&body[..find(body, usage_at) + 20]]);
        assert_eq!(usage, None, "{format:?}");
        assert_eq!(chars, if format == OpenAiChat { 50 } else { 11 });
    }
    // Gemini: the usage of the chunks before the cut, the text up to it.
    let cut = find(GEMINI_SSE, b" quick") + 6;
    let (usage, chars) = scan(Gemini, true, [&GEMINI_SSE[..cut]]);
    let first = RawUsage {
        input: Some(10),
        total: Some(10),
        ..RawUsage::default()
    };
    assert_eq!(usage, Some(first));
    assert_eq!(chars, "The quick".len() as u64);
    // Anthropic: cut after message_start, the input is known and the output is preliminary.
    let cut = find(ANTHROPIC_SSE, b" \\u2014");
    let (usage, chars) = scan(Anthropic, true, [&ANTHROPIC_SSE[..cut]]);
    assert_eq!(usage, Some(raw(472, 2048, Some(96), 2)));
    assert_eq!(
        chars,
        "I need the weather in Paris.Let me check".len() as u64
    );
}

#[test]
fn anthropic_deltas_update_field_by_field_and_never_add() {
    let stream = concat!(
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":10,",
        "\"cache_read_input_tokens\":5,\"output_tokens\":1}}}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":30}}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":35,\"input_tokens\":12,",
        "\"cache_read_input_tokens\":null}}\n\n",
    );
    let (usage, _) = scan(Anthropic, true, [stream.as_bytes()]);
    assert_eq!(
        usage,
        Some(RawUsage {
            input: Some(12),
            cache_read: Some(5),
            output: Some(35),
            ..RawUsage::default()
        })
    );
}

#[test]
fn responses_partial_usage_of_an_incomplete_response() {
    let stream = concat!(
        "event: response.output_text.delta\n",
        // `delta` before `type`: counted once the type is known.
        "data: {\"delta\":\"abc\",\"type\":\"response.output_text.delta\"}\n\n",
        "data: {\"delta\":\"QUJD\",\"type\":\"response.audio.delta\"}\n\n",
        "data: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"{\\\"a\\\":1}\"}\n\n",
        "event: response.incomplete\n",
        "data: {\"type\":\"response.incomplete\",\"response\":{\"status\":\"incomplete\",",
        "\"incomplete_details\":{\"reason\":\"max_output_tokens\"},",
        "\"usage\":{\"input_tokens\":20,\"output_tokens\":64}}}\n\n",
    );
    let (usage, chars) = scan(OpenAiResponses, true, [stream.as_bytes()]);
    assert_eq!(
        usage,
        Some(RawUsage {
            input: Some(20),
            output: Some(64),
            ..RawUsage::default()
        })
    );
    assert_eq!(chars, 3 + 7);
}

#[test]
fn gemini_takes_the_last_usage_metadata_not_the_sum() {
    let (usage, _) = scan(Gemini, true, [GEMINI_SSE]);
    assert_eq!(usage.and_then(|u| u.total), Some(48));
    assert_eq!(usage.and_then(|u| u.input), Some(10));
}

// ---------------------------------------------------------------------------------------------
// Edge cases of the framing and the JSON.

#[test]
fn multi_line_data_and_comments() {
    let stream = concat!(
        ": keep-alive\n\n",
        "id: 1\nevent: chunk\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\"ab\"}}],\n",
        "data:\"usage\":{\"prompt_tokens\":3,\n",
        "data: \"completion_tokens\":4}}\n",
        "retry: 100\n\n",
    );
    let (usage, chars) = scan(OpenAiChat, true, [stream.as_bytes()]);
    assert_eq!(usage.map(|u| (u.input, u.output)), Some((Some(3), Some(4))));
    assert_eq!(chars, 2);
}

#[test]
fn usage_elsewhere_than_the_top_level_is_not_the_usage() {
    for (format, body) in [
        (
            OpenAiChat,
            r#"{"choices":[{"message":{"usage":{"prompt_tokens":1}}}]}"#,
        ),
        (OpenAiChat, r#"{"data":{"usage":{"prompt_tokens":1}}}"#),
        (
            OpenAiChat,
            r#"{"text":"{\"usage\":{\"prompt_tokens\":1}}"}"#,
        ),
        (OpenAiResponses, r#"{"item":{"usage":{"input_tokens":1}}}"#),
        (
            Anthropic,
            r#"{"content_block":{"usage":{"input_tokens":1}}}"#,
        ),
        (
            Gemini,
            r#"{"candidates":[{"usageMetadata":{"promptTokenCount":1}}]}"#,
        ),
    ] {
        assert_eq!(scan(format, false, [body.as_bytes()]).0, None, "{body}");
    }
}

#[test]
fn malformed_or_odd_usage_values() {
    let body = |usage: &str| format!(r#"{{"id":"x","usage":{usage}}}"#);
    let usage = |u: &str| scan(OpenAiChat, false, [body(u).as_bytes()]).0;
    assert_eq!(usage("null"), None);
    assert_eq!(usage("7"), None);
    assert_eq!(usage(r#""many""#), None);
    assert_eq!(usage("{}"), Some(RawUsage::default()));
    assert!(!usage(r#"{"total_tokens":9}"#).unwrap().is_resolved());
    let odd = usage(r#"{"prompt_tokens":-1,"completion_tokens":2.5,"total_tokens":"3"}"#);
    assert_eq!(odd, Some(RawUsage::default()));
    let padding = "x".repeat(20_000);
    assert_eq!(
        usage(&format!(r#"{{"prompt_tokens":1,"pad":"{padding}"}}"#)),
        None,
        "a usage object over 16 KiB is dropped"
    );
    // Broken JSON after the usage: what was found stays found.
    let broken = r#"{"usage":{"prompt_tokens":5,"completion_tokens":1}, ]]] garbage"#;
    let (usage, _) = scan(OpenAiChat, false, [broken.as_bytes()]);
    assert_eq!(usage.and_then(|u| u.input), Some(5));
}

#[test]
fn a_huge_event_is_scanned_in_bounded_memory() {
    // A 4 MiB event of text, then the usage: nothing of it is buffered, all of it counted.
    let text = "é".repeat(2 << 20);
    let stream = format!(
        "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n\
         data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":2}}}}\n\n"
    );
    let frames = stream.as_bytes().chunks(16 * 1024);
    let (usage, chars) = scan(OpenAiChat, true, frames);
    assert_eq!(chars, 2 << 20);
    assert_eq!(usage.and_then(|u| u.output), Some(2));
}

// ---------------------------------------------------------------------------------------------
// Properties.

fn any_format() -> impl Strategy<Value = WireFormat> {
    prop_oneof![
        Just(OpenAiChat),
        Just(OpenAiResponses),
        Just(Anthropic),
        Just(Gemini)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_split_of_any_fixture_gives_the_same(
        index in 0..11usize,
        cuts in prop::collection::vec(any::<usize>(), 0..40),
    ) {
        let case = &cases()[index];
        let cuts: Vec<usize> = cuts.iter().map(|c| c % (case.body.len() + 1)).collect();
        let frames = split_at(case.body, &cuts);
        let found = scan(case.format, case.streaming, frames);
        prop_assert_eq!(found, (case.usage, case.chars), "{}", case.name);
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        format in any_format(),
        streaming in any::<bool>(),
        bytes in prop::collection::vec(any::<u8>(), 0..2048),
        cuts in prop::collection::vec(any::<usize>(), 0..8),
    ) {
        let (whole, whole_chars) = scan(format, streaming, [&bytes[..]]);
        let (split, split_chars) = scan(format, streaming, split_at(&bytes, &cuts));
        prop_assert_eq!(whole, split);
        prop_assert_eq!(whole_chars, split_chars);
    }

    #[test]
    fn mutated_fixtures_never_panic_and_splits_agree(
        index in 0..11usize,
        edits in prop::collection::vec((any::<usize>(), prop_oneof![
            Just(b'"'), Just(b'\\'), Just(b'{'), Just(b'}'), Just(b'['), Just(b']'),
            Just(b':'), Just(b','), Just(b'\n'), Just(b'\r'), any::<u8>(),
        ]), 1..6),
        cuts in prop::collection::vec(any::<usize>(), 0..16),
    ) {
        let case = &cases()[index];
        let mut body = case.body.to_vec();
        for (at, byte) in edits {
            let at = at % body.len();
            body[at] = byte;
        }
        let whole = scan(case.format, case.streaming, [&body[..]]);
        let split = scan(case.format, case.streaming, split_at(&body, &cuts));
        prop_assert_eq!(whole, split);
    }
}

// ---------------------------------------------------------------------------------------------
// End to end: the scanner inside ReconcileLayer.

/// How each body ended, and the usage it settled with.
type Settled = Arc<Mutex<Vec<(BodyEnd, Option<Usage>)>>>;

/// An `ExtractUsage` over [`UsageScanner`], settling with input and output as reported.
#[derive(Clone)]
struct Scanned {
    format: WireFormat,
    settled: Settled,
}

struct ScannedBody {
    scanner: UsageScanner,
    settled: Settled,
}

impl ExtractUsage for Scanned {
    type Scanner = ScannedBody;

    fn start(&self, head: &Parts, _budget: &Budget) -> ScannedBody {
        let streaming = head
            .headers
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        ScannedBody {
            scanner: UsageScanner::new(self.format, streaming),
            settled: self.settled.clone(),
        }
    }
}

impl ScanUsage for ScannedBody {
    fn data(&mut self, chunk: &[u8]) {
        self.scanner.data(chunk);
    }

    fn finish(self, end: BodyEnd, _reserved: Cost) -> Option<Usage> {
        let usage = self
            .scanner
            .usage()
            .filter(RawUsage::is_resolved)
            .map(|u| Usage::new(u.input.unwrap_or(0), u.output.unwrap_or(0)));
        self.settled.lock().unwrap().push((end, usage));
        usage
    }
}

/// One million total tokens per minute, all of it available at once.
fn large_budget() -> Budget {
    let million = NonZeroU64::new(1_000_000).unwrap();
    let limit = Limit::new(Dimension::TotalTokens, million, Duration::from_secs(60))
        .unwrap()
        .with_headroom(1.0)
        .unwrap()
        .with_burst(million);
    Budget::new(Quota::new().with_limit(limit))
}

#[tokio::test(start_paused = true)]
async fn bytes_pass_through_reconcile_unchanged_and_settle_with_the_usage() {
    let mut rng = fastrand::Rng::with_seed(42);
    for case in cases() {
        for round in 0..20 {
            let frames: Vec<Bytes> = if round == 0 {
                case.body.chunks(1).map(Bytes::copy_from_slice).collect()
            } else {
                random_frames(case.body, &mut rng)
                    .into_iter()
                    .map(Bytes::copy_from_slice)
                    .collect()
            };
            let content_type = if case.streaming {
                "text/event-stream"
            } else {
                "application/json"
            };
            let client = service_fn(move |_request: Request<&'static str>| {
                let frames = frames.clone();
                async move {
                    let chunks = frames
                        .into_iter()
                        .map(|f| Ok::<_, Infallible>(Frame::data(f)));
                    let body = StreamBody::new(futures::stream::iter(chunks));
                    let response = Response::builder()
                        .header(http::header::CONTENT_TYPE, content_type)
                        .body(body)
                        .unwrap();
                    Ok::<_, Infallible>(response)
                }
            });
            let budget = large_budget();
            let extract = Scanned {
                format: case.format,
                settled: Arc::default(),
            };
            let mut service = ServiceBuilder::new()
                .layer(TokenBudgetLayer::new(budget.clone()))
                .layer(ReconcileLayer::with_extractor(extract.clone()))
                .service(client);
            let mut request = Request::new("prompt");
            request.extensions_mut().insert(Cost::new(5_000, 1_000));
            let response = service.ready().await.unwrap().call(request).await.unwrap();
            let body = response.into_body().collect().await.unwrap().to_bytes();

            assert_eq!(&body[..], case.body, "{}", case.name);
            let expected = case
                .usage
                .map(|u| Usage::new(u.input.unwrap_or(0), u.output.unwrap_or(0)));
            let settled = extract.settled.lock().unwrap().clone();
            assert_eq!(settled, [(BodyEnd::Complete, expected)], "{}", case.name);
            let charged = expected.map_or(6_000, |u| u.input_tokens() + u.output_tokens());
            let level = budget.snapshot().limits()[0].level();
            assert_eq!(level, 1_000_000 - charged as i64, "{}", case.name);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The service tier that served the request.

/// The tier each provider names in its answer is read, whatever the framing and the split:
/// OpenAI's `service_tier` (a body, any chunk of a stream, a Responses event's `response`),
/// Anthropic's `usage.service_tier`; Gemini names none in its body.
#[test]
fn the_served_tier_is_read_where_each_provider_names_it() {
    use tower_llm_quota::usage::ServiceTier::{Flex, Priority, Standard};
    let flex_stream = concat!(
        "data: {\"id\":\"c\",\"service_tier\":\"flex\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"service_tier\":\"flex\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1,\"total_tokens\":6}}\n\n",
        "data: [DONE]\n\n",
    );
    let responses_event = concat!(
        "event: response.completed\n",
        "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"service_tier\":\"priority\",",
        "\"usage\":{\"input_tokens\":5,\"output_tokens\":1,\"total_tokens\":6}}}\n\n",
    );
    // A `service_tier` inside generated text or a tool's arguments is not the answer's.
    let quoted = r#"{"choices":[{"index":0,"message":{"content":"{\"service_tier\":\"flex\"}"}}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
    let cases: [(&str, WireFormat, bool, &[u8], _); 7] = [
        ("openai json", OpenAiChat, false, CHAT_JSON, Some(Standard)),
        (
            "openai flex stream",
            OpenAiChat,
            true,
            flex_stream.as_bytes(),
            Some(Flex),
        ),
        (
            "responses event",
            OpenAiResponses,
            true,
            responses_event.as_bytes(),
            Some(Priority),
        ),
        (
            "anthropic json",
            Anthropic,
            false,
            ANTHROPIC_JSON,
            Some(Standard),
        ),
        (
            "anthropic stream",
            Anthropic,
            true,
            ANTHROPIC_SSE,
            Some(Standard),
        ),
        ("gemini", Gemini, false, GEMINI_JSON, None),
        ("quoted", OpenAiChat, false, quoted.as_bytes(), None),
    ];
    for (name, format, streaming, body, tier) in cases {
        for cut in 0..=body.len() {
            let mut scanner = UsageScanner::new(format, streaming);
            scanner.data(&body[..cut]);
            scanner.data(&body[cut..]);
            assert_eq!(scanner.service_tier(), tier, "{name}, cut at {cut}");
        }
    }
}

/// The usage a provider scan settles with carries the tier: the body's, else Gemini's
/// `x-gemini-service-tier` header; a stream cut before its usage keeps it too.
#[test]
fn the_settled_usage_carries_the_served_tier() {
    use tower_llm_quota::provider::{Profile, ProviderScan};
    use tower_llm_quota::usage::ServiceTier;
    let mut scan = ProviderScan::new(Profile::openai(), false);
    scan.data(CHAT_JSON);
    let usage = scan.finish(BodyEnd::Complete, Cost::new(10, 10)).unwrap();
    assert_eq!(usage.service_tier(), Some(ServiceTier::Standard));

    let mut headers = http::HeaderMap::new();
    headers.insert("x-gemini-service-tier", "flex".parse().unwrap());
    let mut scan = ProviderScan::new(Profile::gemini(), false).tier_from(&headers);
    scan.data(GEMINI_JSON);
    let usage = scan.finish(BodyEnd::Complete, Cost::new(10, 10)).unwrap();
    assert_eq!(usage.service_tier(), Some(ServiceTier::Flex));

    let cut = b"data: {\"service_tier\":\"flex\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"}}]}\n\n";
    let mut scan = ProviderScan::new(Profile::openai(), true);
    scan.data(cut);
    let usage = scan.finish(BodyEnd::Dropped, Cost::new(10, 10)).unwrap();
    assert_eq!(usage.service_tier(), Some(ServiceTier::Flex));
}
