//! Cost of reading usage from a streamed body: [`UsageScanner`] against passing the same bytes
//! through.
//!
//! Run with `cargo bench --bench extract` (criterion; extra options after `--`, e.g.
//! `cargo bench --bench extract -- --warm-up-time 1 --measurement-time 3`).
//!
//! Each group streams one synthetic 8 MiB event stream, in 16 KiB frames, with throughput in
//! bytes:
//!
//! - `openai_chat_sse`: chunks as OpenAI sends them (about 290 bytes each, a token or two of
//!   text, `"usage":null`), and the usage chunk and `[DONE]` at the end.
//! - `anthropic_sse`: `event:` + `data:` pairs of `content_block_delta` text deltas between
//!   `message_start` and `message_delta`/`message_stop`, with a `ping` now and then.
//!
//! In each group, peers side by side:
//!
//! - `pass_through`: copies each frame into a reusable buffer, as the least a proxy does with
//!   the bytes it forwards.
//! - `scan`: feeds each frame to a new `UsageScanner` and reads the usage at the end.
//! - `pass_through_and_scan`: both, as `ReconcileLayer` with a scanner does.

use std::hint::black_box;

use criterion::{Criterion, Throughput};
use tower_llm_quota::usage::{UsageScanner, WireFormat};

/// The size of each synthetic stream.
const STREAM_BYTES: usize = 8 << 20;
/// The size of each frame.
const FRAME_BYTES: usize = 16 << 10;

/// Pieces of generated text: words, punctuation, a non-ASCII letter, escapes.
const TOKENS: [&str; 12] = [
    " the",
    " quota",
    " bucket",
    ",",
    " refill",
    "s",
    " é",
    "té",
    ".\\n\\n",
    " \\\"tokens\\\"",
    " 42",
    " 🦀",
];

fn openai_chat_stream() -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(1);
    let mut stream = Vec::with_capacity(STREAM_BYTES + 4096);
    while stream.len() < STREAM_BYTES {
        let token = TOKENS[rng.usize(..TOKENS.len())];
        stream.extend_from_slice(
            format!(
                "data: {{\"id\":\"chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG\",\"object\":\
                 \"chat.completion.chunk\",\"created\":1741570283,\"model\":\"gpt-4o-2024-08-06\",\
                 \"system_fingerprint\":\"fp_4d6e3d9d4b\",\"choices\":[{{\"index\":0,\"delta\":\
                 {{\"content\":\"{token}\"}},\"logprobs\":null,\"finish_reason\":null}}],\
                 \"usage\":null}}\n\n"
            )
            .as_bytes(),
        );
    }
    stream.extend_from_slice(
        b"data: {\"id\":\"chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG\",\"object\":\
          \"chat.completion.chunk\",\"created\":1741570283,\"model\":\"gpt-4o-2024-08-06\",\
          \"system_fingerprint\":\"fp_4d6e3d9d4b\",\"choices\":[],\"usage\":{\"prompt_tokens\":\
          1117,\"completion_tokens\":28000,\"total_tokens\":29117,\"prompt_tokens_details\":\
          {\"cached_tokens\":1024,\"audio_tokens\":0},\"completion_tokens_details\":\
          {\"reasoning_tokens\":0,\"audio_tokens\":0,\"accepted_prediction_tokens\":0,\
          \"rejected_prediction_tokens\":0}}}\n\ndata: [DONE]\n\n",
    );
    stream
}

fn anthropic_stream() -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(2);
    let mut stream = Vec::with_capacity(STREAM_BYTES + 4096);
    stream.extend_from_slice(
        b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\
          \"msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY\",\"type\":\"message\",\"role\":\"assistant\",\
          \"content\":[],\"model\":\"claude-sonnet-4-5-20250929\",\"stop_reason\":null,\
          \"stop_sequence\":null,\"usage\":{\"input_tokens\":472,\"cache_creation_input_tokens\":0,\
          \"cache_read_input_tokens\":2048,\"output_tokens\":2}}}\n\n\
          event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\
          \"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
    );
    let mut events = 0u32;
    while stream.len() < STREAM_BYTES {
        let token = TOKENS[rng.usize(..TOKENS.len())];
        stream.extend_from_slice(
            format!(
                "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\
                 \"delta\":{{\"type\":\"text_delta\",\"text\":\"{token}\"}}}}\n\n"
            )
            .as_bytes(),
        );
        events += 1;
        if events % 500 == 0 {
            stream.extend_from_slice(b"event: ping\ndata: {\"type\": \"ping\"}\n\n");
        }
    }
    stream.extend_from_slice(
        b"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
          event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\
          \"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":61000}}\n\n\
          event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    );
    stream
}

#[inline]
fn pass_through(frames: &[&[u8]], buffer: &mut [u8]) -> usize {
    let mut forwarded = 0;
    for frame in frames {
        let out = &mut buffer[..frame.len()];
        out.copy_from_slice(black_box(frame));
        forwarded += black_box(out).len();
    }
    forwarded
}

#[inline]
fn scan(format: WireFormat, frames: &[&[u8]]) -> u64 {
    let mut scanner = UsageScanner::new(format, true);
    for frame in frames {
        scanner.data(black_box(frame));
    }
    scanner.usage().and_then(|u| u.output).unwrap_or(0) + scanner.streamed_chars()
}

fn group(c: &mut Criterion, name: &str, format: WireFormat, stream: &[u8]) {
    let frames: Vec<&[u8]> = stream.chunks(FRAME_BYTES).collect();
    let mut check = UsageScanner::new(format, true);
    frames.iter().for_each(|f| check.data(f));
    assert!(check.usage().is_some_and(|u| u.is_resolved()), "{name}");

    let mut buffer = vec![0u8; FRAME_BYTES];
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Bytes(stream.len() as u64));
    group.bench_function("pass_through", |b| {
        b.iter(|| pass_through(&frames, &mut buffer))
    });
    group.bench_function("scan", |b| b.iter(|| scan(format, &frames)));
    group.bench_function("pass_through_and_scan", |b| {
        b.iter(|| {
            let mut scanner = UsageScanner::new(format, true);
            let mut forwarded = 0;
            for frame in &frames {
                scanner.data(black_box(frame));
                let out = &mut buffer[..frame.len()];
                out.copy_from_slice(frame);
                forwarded += black_box(out).len();
            }
            (forwarded, scanner.usage())
        })
    });
    group.finish();
}

// What `criterion_group!`/`criterion_main!` expand to, without their undocumented `pub fn`.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    group(
        &mut c,
        "openai_chat_sse",
        WireFormat::OpenAiChat,
        &openai_chat_stream(),
    );
    group(
        &mut c,
        "anthropic_sse",
        WireFormat::Anthropic,
        &anthropic_stream(),
    );
    c.final_summary();
}
