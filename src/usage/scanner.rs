use std::fmt;

use super::fields::Fields;
use super::json::JsonScan;
use super::sse::{EventStream, Sink};
use super::{RawUsage, WireFormat};

/// Reads the usage a provider reports in a response body, as the body streams past, in
/// bounded memory; see the [module documentation](crate::usage).
///
/// Feed it every chunk of the body, in order, split anywhere; ask it at any time what it has
/// found. It never fails and never panics: bytes it cannot make sense of are skipped.
#[derive(Clone)]
pub struct UsageScanner {
    format: WireFormat,
    framing: Framing,
    json: JsonScan,
    fields: Fields,
}

/// How the body is framed.
#[derive(Debug, Clone)]
enum Framing {
    /// Not known until the first byte that is not whitespace: the caller's guess.
    Undecided { streaming: bool },
    /// One JSON document.
    Json,
    /// An event stream, each event's data a JSON document.
    Events(EventStream),
}

impl UsageScanner {
    /// A scanner for a response body in `format`; `streaming` says whether the response is an
    /// event stream (`content-type: text/event-stream`) or one JSON document.
    ///
    /// The body itself has the last word: if its first byte that is not whitespace is `{` or
    /// `[`, it is read as JSON, and anything else as an event stream (whose lines start with
    /// `data:`, `event:`, `id:`, `retry:` or `:`), so a mislabelled response is still read.
    pub fn new(format: WireFormat, streaming: bool) -> Self {
        Self {
            format,
            framing: Framing::Undecided { streaming },
            json: JsonScan::new(),
            fields: Fields::new(format),
        }
    }

    /// The next chunk of the body.
    pub fn data(&mut self, chunk: &[u8]) {
        if let Framing::Undecided { streaming } = self.framing {
            let Some(&first) = chunk.iter().find(|b| !b.is_ascii_whitespace()) else {
                // Whitespace: the same in both framings, except that blank lines dispatch
                // events, and there are none before the first.
                return;
            };
            // A JSON body starts with `{` or `[`; no event stream line does.
            let json = matches!(first, b'{' | b'[');
            if json == streaming {
                tracing::debug!(streaming, "the body contradicts its content type");
            }
            self.framing = if json {
                Framing::Json
            } else {
                Framing::Events(EventStream::new())
            };
        }
        match &mut self.framing {
            Framing::Json => self.json.feed(chunk, &mut self.fields),
            Framing::Events(events) => events.feed(
                chunk,
                &mut Event {
                    json: &mut self.json,
                    fields: &mut self.fields,
                },
            ),
            Framing::Undecided { .. } => {}
        }
    }

    /// The usage reported so far: `None` until a usage object arrives (`"usage": null` is
    /// none).
    ///
    /// In a stream this is the latest report, complete only at the end: an OpenAI Chat stream
    /// reports once, in its last chunk (only when the request set
    /// `stream_options.include_usage`); Responses in `response.completed` (or
    /// `response.incomplete` / `response.failed`); Anthropic's `message_start` reports the
    /// input and an initial output count that each `message_delta` updates; Gemini reports in
    /// any chunk, the last one final. After a cut stream, compare the output with
    /// [`streamed_chars`](Self::streamed_chars).
    pub fn usage(&self) -> Option<RawUsage> {
        self.fields.usage
    }

    /// The service tier the answer says served the request, once read: OpenAI's (Chat
    /// Completions and Responses) `service_tier`, in a body or any event; Anthropic's
    /// `usage.service_tier`. Gemini names it in a header instead
    /// ([`ServiceTier::from_headers`](super::ServiceTier::from_headers)).
    pub fn service_tier(&self) -> Option<super::ServiceTier> {
        self.fields.tier
    }

    /// Characters of generated text seen so far: visible text, reasoning and tool-call
    /// arguments, decoded from their JSON strings (escapes count as the character they
    /// stand for). A rough measure of the output of a stream cut before its usage arrived.
    ///
    /// | Format | Counted strings |
    /// |---|---|
    /// | OpenAI Chat | `choices[].delta` (in streams) or `choices[].message`: `content`, `reasoning_content`, `refusal`, `tool_calls[].function.arguments` |
    /// | Responses | the `delta` of `response.output_text.delta`, `response.reasoning_text.delta`, `response.refusal.delta`, `response.function_call_arguments.delta`; in a JSON body `output[].content[].text`, `.refusal` and `output[].arguments` |
    /// | Anthropic | `content_block_delta`'s `delta.text`, `.thinking`, `.partial_json`; in a JSON body `content[].text` and `.thinking` |
    /// | Gemini | `candidates[].content.parts[].text` |
    pub fn streamed_chars(&self) -> u64 {
        self.fields.chars
    }

    /// The wire format this scanner reads.
    pub fn format(&self) -> WireFormat {
        self.format
    }
}

impl fmt::Debug for UsageScanner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UsageScanner")
            .field("format", &self.format)
            .field("usage", &self.fields.usage)
            .field("streamed_chars", &self.fields.chars)
            .finish_non_exhaustive()
    }
}

/// The scanner's view of an event stream: each event's data is a JSON document.
struct Event<'a> {
    json: &'a mut JsonScan,
    fields: &'a mut Fields,
}

impl Sink for Event<'_> {
    fn data(&mut self, bytes: &[u8]) {
        self.json.feed(bytes, self.fields);
    }

    fn dispatch(&mut self) {
        self.json.reset();
    }
}
