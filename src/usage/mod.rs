//! Reading the usage a provider reports in its response body, as the body streams past.
//!
//! A [`UsageScanner`] is fed the body's chunks in order (split anywhere) and says at any moment
//! which usage the provider has reported so far, as a [`RawUsage`]: the provider's own figures,
//! not yet mapped to quota dimensions. It reads the four wire formats in use, each as one JSON
//! document or as a server-sent event stream:
//!
//! | [`WireFormat`] | JSON body | Event stream |
//! |---|---|---|
//! | [`OpenAiChat`](WireFormat::OpenAiChat) (also Azure OpenAI and OpenAI-compatible servers) | `usage` | the last chunk's `usage` (earlier chunks say `"usage": null`) |
//! | [`OpenAiResponses`](WireFormat::OpenAiResponses) | `usage` | `response.usage` of `response.completed`, `.incomplete` or `.failed` |
//! | [`Anthropic`](WireFormat::Anthropic) | `usage` | `message_start`'s `message.usage`, updated field by field by each `message_delta`'s cumulative `usage` |
//! | [`Gemini`](WireFormat::Gemini) (also Vertex AI) | `usageMetadata` (in each element of a JSON array too) | the last chunk's `usageMetadata` |
//!
//! The usage object is taken at the top level of the response (or event) only: a `usage` key
//! inside a tool call's arguments or a model's text is not it. It also counts the characters
//! of generated text ([`UsageScanner::streamed_chars`]), to estimate the output of a stream cut
//! before its usage arrived.
//!
//! # Example
//!
//! ```
//! use tower_llm_quota::usage::{RawUsage, UsageScanner, WireFormat};
//!
//! let mut scanner = UsageScanner::new(WireFormat::OpenAiChat, true);
//! let stream = concat!(
//!     "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\n\n",
//!     "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo!\"}}],\"usage\":null}\n\n",
//!     "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,",
//!     "\"total_tokens\":11}}\n\n",
//!     "data: [DONE]\n\n",
//! );
//! for chunk in stream.as_bytes().chunks(7) {
//!     scanner.data(chunk);
//! }
//! assert_eq!(scanner.streamed_chars(), 6);
//! let usage = scanner.usage().unwrap();
//! assert_eq!((usage.input, usage.output, usage.total), (Some(9), Some(2), Some(11)));
//! assert!(usage.is_resolved());
//! ```
//!
//! # Why a scanner, and not `serde_json` on the body
//!
//! The body passes through to the caller as it arrives; holding a copy of it to parse at the
//! end would cost as much memory as the longest answer, per request in flight, and nothing at
//! all would be known about a stream cut in the middle. The scanner instead keeps a few hundred
//! bytes of state, whatever the body's size:
//!
//! - The event stream framing is a state machine over lines: an event's `data` goes straight
//!   from the chunk to the JSON scanner, never into a buffer, so no event is too large.
//! - The JSON scanner tracks only where it is: the path of open containers down to 8 levels
//!   (deeper ones are skipped whole), and whether it is in a string. Strings are skipped, or
//!   counted, without being copied.
//! - The one thing it copies is the usage object, at most 16 KiB of it (a real one is a few
//!   hundred bytes); a larger one is dropped. That object alone goes to `serde_json`.
//!
//! Malformed input never panics or fails: a document whose structure breaks is ignored from
//! that byte on, and the usage found before stays found.

mod fields;
mod json;
mod scanner;
mod sse;
mod tier;

pub use scanner::UsageScanner;
pub use tier::ServiceTier;

/// How a provider frames its responses and where it reports usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WireFormat {
    /// OpenAI Chat Completions (`/v1/chat/completions`), also spoken by Azure OpenAI and by
    /// OpenAI-compatible servers. Reads the usage of embeddings (`/v1/embeddings`: input
    /// only) and of the Responses API (a body's `usage`, `response.usage` in its events)
    /// too, so that one client's calls to all three settle; the text of a Responses stream
    /// cut before its usage is counted by [`WireFormat::OpenAiResponses`] alone.
    OpenAiChat,
    /// OpenAI Responses (`/v1/responses`).
    OpenAiResponses,
    /// Anthropic Messages (`/v1/messages`).
    Anthropic,
    /// Google Gemini and Vertex AI (`generateContent`, `streamGenerateContent`).
    Gemini,
}

/// Usage exactly as the provider reported it, with no mapping to quota dimensions (providers
/// differ in what their counts include; see each field). A field is `None` when the provider
/// did not report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RawUsage {
    /// Input tokens. OpenAI `prompt_tokens` and Responses `input_tokens` **include** cached
    /// tokens; Anthropic `input_tokens` **excludes** cache reads and writes; Gemini
    /// `promptTokenCount` includes cached content.
    pub input: Option<u64>,
    /// Input tokens read from the prompt cache: OpenAI `prompt_tokens_details.cached_tokens`
    /// (Responses `input_tokens_details.cached_tokens`), Anthropic `cache_read_input_tokens`,
    /// Gemini `cachedContentTokenCount`.
    pub cache_read: Option<u64>,
    /// Input tokens written to the prompt cache: OpenAI `…_details.cache_write_tokens`,
    /// Anthropic `cache_creation_input_tokens` (or the sum of its `cache_creation` breakdown).
    pub cache_write: Option<u64>,
    /// Output tokens, reasoning included: OpenAI `completion_tokens` (Responses
    /// `output_tokens`), Anthropic `output_tokens`, Gemini `candidatesTokenCount +
    /// thoughtsTokenCount`.
    pub output: Option<u64>,
    /// The reasoning tokens among the output: OpenAI
    /// `completion_tokens_details.reasoning_tokens` (Responses
    /// `output_tokens_details.reasoning_tokens`), Gemini `thoughtsTokenCount`. Anthropic does
    /// not report it.
    pub reasoning: Option<u64>,
    /// The provider's total: OpenAI `total_tokens`, Gemini `totalTokenCount`. Anthropic does
    /// not report one.
    pub total: Option<u64>,
}

impl RawUsage {
    /// Whether the usage can settle a reservation: at least one of input and output is known.
    /// A bare total cannot be split into the two (LiteLLM's `_usage_is_present` rule).
    ///
    /// # Example
    ///
    /// ```
    /// use tower_llm_quota::usage::RawUsage;
    ///
    /// let total_only = RawUsage { total: Some(120), ..RawUsage::default() };
    /// assert!(!total_only.is_resolved());
    /// assert!(RawUsage { output: Some(20), ..total_only }.is_resolved());
    /// ```
    pub fn is_resolved(&self) -> bool {
        self.input.is_some() || self.output.is_some()
    }

    /// Each field of `self`, or of `earlier` where `self` has none.
    fn or(self, earlier: Self) -> Self {
        Self {
            input: self.input.or(earlier.input),
            cache_read: self.cache_read.or(earlier.cache_read),
            cache_write: self.cache_write.or(earlier.cache_write),
            output: self.output.or(earlier.output),
            reasoning: self.reasoning.or(earlier.reasoning),
            total: self.total.or(earlier.total),
        }
    }
}
