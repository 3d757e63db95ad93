//! Where each wire format keeps its usage and its generated text, and how its usage object
//! reads as a [`RawUsage`].

use serde_json::{Map, Value};

use super::json::{INDEX, OTHER, StringUse, Visit};
use super::{RawUsage, ServiceTier, WireFormat};

// Key ids in paths. One namespace for every format; each format gives out only its own.
/// The usage object: `usage`, or Gemini's `usageMetadata`.
const USAGE: u8 = 1;
/// A string of generated text, counted.
const TEXT: u8 = 2;
const CHOICES: u8 = 3;
/// OpenAI Chat `delta` (streams) or `message`; Anthropic and Responses event `delta`.
const DELTA: u8 = 4;
const TOOL_CALLS: u8 = 5;
const FUNCTION: u8 = 6;
/// Responses events: `response`; Anthropic `message_start`: `message`.
const ENVELOPE: u8 = 7;
const TYPE: u8 = 8;
const OUTPUT: u8 = 9;
const CONTENT: u8 = 10;
const CANDIDATES: u8 = 11;
const PARTS: u8 = 12;
/// OpenAI's `service_tier`: the tier that served the request.
const SERVICE_TIER: u8 = 13;

/// The Responses stream events whose `delta` is generated text.
const RESPONSES_TEXT_EVENTS: [&[u8]; 4] = [
    b"response.output_text.delta",
    b"response.reasoning_text.delta",
    b"response.refusal.delta",
    b"response.function_call_arguments.delta",
];

/// Whether a Responses event's `delta` is text, known once its `type` is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Unknown,
    Text,
    Other,
}

/// The [`Visit`] for one wire format: it finds the usage object and the generated text, and
/// keeps what they said.
#[derive(Debug, Clone)]
pub(super) struct Fields {
    format: WireFormat,
    pub(super) usage: Option<RawUsage>,
    /// The tier the answer says served it.
    pub(super) tier: Option<ServiceTier>,
    pub(super) chars: u64,
    /// The current Responses event's kind, and its `delta` characters seen before its `type`.
    kind: Kind,
    pending: u64,
}

impl Fields {
    pub(super) fn new(format: WireFormat) -> Self {
        Self {
            format,
            usage: None,
            tier: None,
            chars: 0,
            kind: Kind::Unknown,
            pending: 0,
        }
    }
}

impl Visit for Fields {
    #[inline]
    fn key(&self, parent: &[u8], key: &[u8]) -> u8 {
        use WireFormat::*;
        match (self.format, parent, key) {
            // The Responses API's usage too, in a body or a `response.completed` event: one
            // client (or one profile) calls both APIs.
            (OpenAiChat, [] | [ENVELOPE], b"usage") => USAGE,
            (OpenAiChat | OpenAiResponses, [] | [ENVELOPE], b"service_tier") => SERVICE_TIER,
            (OpenAiChat, [], b"response") => ENVELOPE,
            (OpenAiChat, [], b"choices") => CHOICES,
            (OpenAiChat, [CHOICES, INDEX], b"delta" | b"message") => DELTA,
            (
                OpenAiChat,
                [CHOICES, INDEX, DELTA],
                b"content" | b"reasoning_content" | b"refusal",
            ) => TEXT,
            (OpenAiChat, [CHOICES, INDEX, DELTA], b"tool_calls") => TOOL_CALLS,
            (OpenAiChat, [CHOICES, INDEX, DELTA, TOOL_CALLS, INDEX], b"function") => FUNCTION,
            (OpenAiChat, [CHOICES, INDEX, DELTA, TOOL_CALLS, INDEX, FUNCTION], b"arguments") => {
                TEXT
            }

            (OpenAiResponses, [] | [ENVELOPE], b"usage") => USAGE,
            (OpenAiResponses, [], b"response") => ENVELOPE,
            (OpenAiResponses, [], b"type") => TYPE,
            (OpenAiResponses, [], b"delta") => DELTA,
            (OpenAiResponses, [], b"output") => OUTPUT,
            (OpenAiResponses, [OUTPUT, INDEX], b"content") => CONTENT,
            (OpenAiResponses, [OUTPUT, INDEX], b"arguments") => TEXT,
            (OpenAiResponses, [OUTPUT, INDEX, CONTENT, INDEX], b"text" | b"refusal") => TEXT,

            (Anthropic, [] | [ENVELOPE], b"usage") => USAGE,
            (Anthropic, [], b"message") => ENVELOPE,
            (Anthropic, [], b"delta") => DELTA,
            (Anthropic, [DELTA], b"text" | b"thinking" | b"partial_json") => TEXT,
            (Anthropic, [], b"content") => CONTENT,
            (Anthropic, [CONTENT, INDEX], b"text" | b"thinking") => TEXT,

            (Gemini, [], b"usageMetadata") => USAGE,
            (Gemini, [], b"candidates") => CANDIDATES,
            (Gemini, [CANDIDATES, INDEX], b"content") => CONTENT,
            (Gemini, [CANDIDATES, INDEX, CONTENT], b"parts") => PARTS,
            (Gemini, [CANDIDATES, INDEX, CONTENT, PARTS, INDEX], b"text") => TEXT,
            _ => OTHER,
        }
    }

    #[inline]
    fn string(&self, path: &[u8]) -> StringUse {
        match (self.format, path) {
            (_, [.., TEXT]) => StringUse::Count,
            (_, [SERVICE_TIER] | [ENVELOPE, SERVICE_TIER]) => StringUse::Read,
            (WireFormat::OpenAiResponses, [DELTA]) if self.kind != Kind::Other => StringUse::Count,
            (WireFormat::OpenAiResponses, [TYPE]) => StringUse::Read,
            _ => StringUse::Skip,
        }
    }

    #[inline]
    fn capture(&self, path: &[u8]) -> bool {
        matches!(path, [USAGE] | [ENVELOPE, USAGE])
    }

    #[inline]
    fn chars(&mut self, path: &[u8], chars: u64) {
        if path == [DELTA] && self.kind == Kind::Unknown {
            self.pending = self.pending.saturating_add(chars);
        } else {
            self.chars = self.chars.saturating_add(chars);
        }
    }

    fn read(&mut self, path: &[u8], value: &[u8]) {
        if path.last() == Some(&SERVICE_TIER) {
            if let Ok(name) = std::str::from_utf8(value) {
                self.tier = Some(ServiceTier::parse(name));
            }
            return;
        }
        self.kind = if RESPONSES_TEXT_EVENTS.contains(&value) {
            self.chars = self.chars.saturating_add(self.pending);
            Kind::Text
        } else {
            Kind::Other
        };
        self.pending = 0;
    }

    fn captured(&mut self, _path: &[u8], object: &[u8]) {
        let Ok(Value::Object(object)) = serde_json::from_slice(object) else {
            return;
        };
        // Anthropic names the tier in its usage object.
        if let Some(tier) = object.get("service_tier").and_then(Value::as_str) {
            self.tier = Some(ServiceTier::parse(tier));
        }
        let reported = match self.format {
            WireFormat::OpenAiChat => openai_chat(&object),
            WireFormat::OpenAiResponses => openai_responses(&object),
            WireFormat::Anthropic => anthropic(&object),
            WireFormat::Gemini => gemini(&object),
        };
        self.usage = Some(match (self.format, self.usage) {
            // Cumulative: a field a `message_delta` leaves out keeps its earlier value.
            (WireFormat::Anthropic, Some(earlier)) => reported.or(earlier),
            _ => reported,
        });
    }

    fn record_start(&mut self) {
        self.kind = Kind::Unknown;
        self.pending = 0;
    }

    fn record_end(&mut self) {}
}

fn count(object: &Map<String, Value>, key: &str) -> Option<u64> {
    object.get(key)?.as_u64()
}

fn nested(object: &Map<String, Value>, key: &str, inner: &str) -> Option<u64> {
    object.get(key)?.as_object().and_then(|o| count(o, inner))
}

/// Chat Completions' (and embeddings') usage, or the Responses API's where its names are
/// the ones present.
fn openai_chat(usage: &Map<String, Value>) -> RawUsage {
    if !usage.contains_key("prompt_tokens") && usage.contains_key("input_tokens") {
        return openai_responses(usage);
    }
    RawUsage {
        input: count(usage, "prompt_tokens"),
        cache_read: nested(usage, "prompt_tokens_details", "cached_tokens"),
        cache_write: nested(usage, "prompt_tokens_details", "cache_write_tokens"),
        output: count(usage, "completion_tokens"),
        reasoning: nested(usage, "completion_tokens_details", "reasoning_tokens"),
        total: count(usage, "total_tokens"),
    }
}

fn openai_responses(usage: &Map<String, Value>) -> RawUsage {
    RawUsage {
        input: count(usage, "input_tokens"),
        cache_read: nested(usage, "input_tokens_details", "cached_tokens"),
        cache_write: nested(usage, "input_tokens_details", "cache_write_tokens"),
        output: count(usage, "output_tokens"),
        reasoning: nested(usage, "output_tokens_details", "reasoning_tokens"),
        total: count(usage, "total_tokens"),
    }
}

fn anthropic(usage: &Map<String, Value>) -> RawUsage {
    // The breakdown by cache lifetime, when the total is missing.
    let by_ttl = || {
        let five = nested(usage, "cache_creation", "ephemeral_5m_input_tokens");
        let hour = nested(usage, "cache_creation", "ephemeral_1h_input_tokens");
        sum(five, hour)
    };
    RawUsage {
        input: count(usage, "input_tokens"),
        cache_read: count(usage, "cache_read_input_tokens"),
        cache_write: count(usage, "cache_creation_input_tokens").or_else(by_ttl),
        output: count(usage, "output_tokens"),
        reasoning: None,
        total: None,
    }
}

fn gemini(usage: &Map<String, Value>) -> RawUsage {
    let thoughts = count(usage, "thoughtsTokenCount");
    RawUsage {
        input: count(usage, "promptTokenCount"),
        cache_read: count(usage, "cachedContentTokenCount"),
        cache_write: None,
        output: sum(count(usage, "candidatesTokenCount"), thoughts),
        reasoning: thoughts,
        total: count(usage, "totalTokenCount"),
    }
}

/// The sum of the counts present, if any is.
fn sum(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.saturating_add(b)),
        _ => a.or(b),
    }
}
