//! The largest output each model may generate: what a request without an output bound may
//! use, and so what a cap that must never be passed reserves for it.

use crate::pricing::by_model;

/// The most output tokens one answer (one choice) of a model may hold, by model name:
/// exact names, and prefixes ending in `*` (the longest match wins), as
/// [`PriceTable`](crate::pricing::PriceTable) matches them.
///
/// A request that sets no `max_tokens` may be answered up to its model's limit: a budget
/// reserves [`Defaults::output_tokens`](super::Defaults::output_tokens) for it (4,096), which
/// the answer may pass. Where that must not happen (a hard spend cap), reserve the model's
/// largest output instead ([`RequestEstimate::with_output_bound`](super::RequestEstimate::with_output_bound)).
///
/// [`known`](Self::known) holds the providers' published limits (late 2026), each rounded up
/// where a model's versions differ (an early `gpt-4o` answered at most 4,096 tokens, later
/// ones 16,384): a figure too high reserves more than needed for a while (refunded when the
/// answer settles); one too low would let an answer pass a cap. Add or correct entries with
/// [`with_model`](Self::with_model).
///
/// # Example
///
/// ```
/// use tower_llm_quota::estimate::LargestOutput;
///
/// let table = LargestOutput::known().with_model("my-finetune*", 8_192);
/// assert_eq!(table.largest("gpt-4o-mini-2024-07-18"), Some(16_384));
/// assert_eq!(table.largest("my-finetune-v2"), Some(8_192));
/// assert_eq!(table.largest("unheard-of"), None);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LargestOutput {
    models: Vec<(String, u64)>,
}

/// The providers' published limits on one answer's output tokens.
const KNOWN: &[(&str, u64)] = &[
    // OpenAI.
    ("gpt-3.5-turbo*", 4_096),
    ("gpt-4*", 8_192),
    ("gpt-4-32k*", 32_768),
    ("gpt-4-turbo*", 4_096),
    ("gpt-4o*", 16_384),
    ("chatgpt-4o*", 16_384),
    ("gpt-4.1*", 32_768),
    ("gpt-4.5*", 16_384),
    ("gpt-5*", 128_000),
    ("o1*", 100_000),
    ("o1-mini*", 65_536),
    ("o3*", 100_000),
    ("o4-mini*", 100_000),
    // Anthropic (Claude 3.7 Sonnet up to 128,000 with its beta header).
    ("claude-3-haiku*", 4_096),
    ("claude-3-opus*", 4_096),
    ("claude-3-sonnet*", 4_096),
    ("claude-3-5*", 8_192),
    ("claude-3-7-sonnet*", 128_000),
    ("claude-sonnet-4*", 64_000),
    ("claude-haiku-4*", 64_000),
    ("claude-opus-4*", 32_000),
    ("claude-opus-4-5*", 64_000),
    // Google.
    ("gemini-1.5*", 8_192),
    ("gemini-2.0*", 8_192),
    ("gemini-2.5*", 65_536),
    ("gemini-3*", 65_536),
];

impl LargestOutput {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The providers' published limits for their current models (see the type's docs).
    pub fn known() -> Self {
        KNOWN.iter().fold(Self::new(), |table, &(pattern, tokens)| {
            table.with_model(pattern, tokens)
        })
    }

    /// `pattern` (a model's name, or a prefix ending in `*`) answers at most `tokens` output
    /// tokens. A later entry of the same pattern replaces an earlier one.
    #[must_use]
    pub fn with_model(mut self, pattern: impl Into<String>, tokens: u64) -> Self {
        let pattern = pattern.into();
        self.models.retain(|(p, _)| *p != pattern);
        self.models.push((pattern, tokens));
        self
    }

    /// The largest output of `model`: its exact name's entry, else its longest matching
    /// prefix's; `None` for a model the table does not know.
    pub fn largest(&self, model: &str) -> Option<u64> {
        by_model(&self.models, model).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_prefix_wins_and_an_exact_name_over_it() {
        let table = LargestOutput::known();
        assert_eq!(table.largest("gpt-4"), Some(8_192));
        assert_eq!(table.largest("gpt-4-turbo-2024-04-09"), Some(4_096));
        assert_eq!(table.largest("gpt-4o"), Some(16_384));
        assert_eq!(table.largest("gpt-4.1-mini"), Some(32_768));
        assert_eq!(table.largest("o1-mini"), Some(65_536));
        assert_eq!(table.largest("claude-opus-4-1-20250805"), Some(32_000));
        assert_eq!(table.largest("claude-opus-4-5"), Some(64_000));
        assert_eq!(table.largest("claude-3-5-haiku-latest"), Some(8_192));
        assert_eq!(table.largest("llama-3.3-70b"), None);
        let table = table
            .with_model("gpt-4o", 4_096)
            .with_model("gpt-4o", 2_048);
        assert_eq!(
            table.largest("gpt-4o"),
            Some(2_048),
            "the exact name, replaced"
        );
        assert_eq!(table.largest("gpt-4o-mini"), Some(16_384));
    }
}
