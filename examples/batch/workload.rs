//! Work items: support tickets to classify, generated from a seed, and their request bodies.
//!
//! Shared by the `batch` example and the `goodput` benchmark.

use std::time::Duration;

use bytes::Bytes;
use tower_llm_quota::Priority;

/// One call to make: a prompt, its output ceiling, its class and when it arrives.
#[derive(Debug, Clone)]
pub(crate) struct Item {
    pub(crate) id: String,
    pub(crate) priority: Priority,
    /// Offset from the start of the run at which the item is submitted.
    pub(crate) arrive: Duration,
    /// The OpenAI Chat Completions JSON body.
    pub(crate) body: Bytes,
}

impl Item {
    /// An item whose body asks the model to answer `prompt` in at most `max_tokens`.
    pub(crate) fn new(
        id: impl Into<String>,
        prompt: &str,
        max_tokens: u64,
        priority: Priority,
        arrive: Duration,
    ) -> Self {
        Self {
            id: id.into(),
            priority,
            arrive,
            body: chat_body(prompt, max_tokens),
        }
    }
}

/// What a generated ticket looks like.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TicketShape {
    pub(crate) min_chars: usize,
    pub(crate) max_chars: usize,
    pub(crate) max_tokens: u64,
}

impl TicketShape {
    /// The story's tickets: 1,000 to 4,000 characters, answered in at most 200 tokens.
    pub(crate) const SUPPORT: Self = Self {
        min_chars: 1_000,
        max_chars: 4_000,
        max_tokens: 200,
    };
}

/// `count` ticket-classification items of `shape` and `priority`, all arriving at once,
/// deterministic from `seed`. Ids are `<prefix>-<n>`.
pub(crate) fn tickets(
    prefix: &str,
    count: usize,
    shape: TicketShape,
    priority: Priority,
    seed: u64,
) -> Vec<Item> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..count)
        .map(|n| {
            let chars = rng.usize(shape.min_chars..=shape.max_chars.max(shape.min_chars));
            let prompt = ticket_prompt(&mut rng, n, chars);
            let id = format!("{prefix}-{n}");
            Item::new(id, &prompt, shape.max_tokens, priority, Duration::ZERO)
        })
        .collect()
}

/// `count` ticket texts of `shape` (without the instruction each prompt of [`tickets`]
/// opens with), deterministic from `seed`: `(id, text)`, ids `<prefix>-<n>`.
pub(crate) fn ticket_texts(
    prefix: &str,
    count: usize,
    shape: TicketShape,
    seed: u64,
) -> Vec<(String, String)> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..count)
        .map(|n| {
            let chars = rng.usize(shape.min_chars..=shape.max_chars.max(shape.min_chars));
            let prompt = ticket_prompt(&mut rng, n, chars + INSTRUCTION.len());
            let text = prompt[INSTRUCTION.len()..].to_owned();
            (format!("{prefix}-{n}"), text)
        })
        .collect()
}

const INSTRUCTION: &str = "Classify this support ticket as one of: billing, bug, account, \
                           feature request, other. Answer with the label and one sentence.\n\n";

const OPENINGS: [&str; 6] = [
    "Hello support team,",
    "Hi there,",
    "Good morning,",
    "To whom it may concern,",
    "Hey,",
    "Dear customer care,",
];

const SENTENCES: [&str; 16] = [
    "I was charged twice for my subscription this month and I would like a refund.",
    "The export button does nothing when I click it in the reports page.",
    "Since the last update the mobile app crashes as soon as I open a project.",
    "I cannot log in anymore, the password reset email never arrives.",
    "It would be great if we could schedule reports to be sent every Monday.",
    "Our invoice shows the wrong company address and VAT number.",
    "The dashboard takes more than a minute to load for our team of forty people.",
    "I would like to transfer ownership of the workspace to a colleague.",
    "When I upload a file larger than ten megabytes the progress bar stops at ninety percent.",
    "Please add a dark mode, my eyes hurt after a long day of work.",
    "We upgraded to the business plan but the new seats are still not available.",
    "The search returns results from archived projects even when the filter is off.",
    "My account was locked after three failed attempts and nobody answers the phone.",
    "Could you explain how the usage based pricing is computed for API calls?",
    "The integration with our calendar duplicates every event it imports.",
    "I keep receiving notifications for a project I left weeks ago.",
];

/// A ticket of exactly `chars` characters (ASCII), opening with the classification
/// instruction.
fn ticket_prompt(rng: &mut fastrand::Rng, n: usize, chars: usize) -> String {
    let mut text = String::with_capacity(chars + 128);
    text.push_str(INSTRUCTION);
    text.push_str(&format!("Ticket #{}: ", 10_000 + n));
    text.push_str(OPENINGS[rng.usize(..OPENINGS.len())]);
    while text.len() < chars {
        text.push(' ');
        text.push_str(SENTENCES[rng.usize(..SENTENCES.len())]);
    }
    text.truncate(chars);
    text
}

/// The model the workload asks for.
pub(crate) const MODEL: &str = "gpt-4o-mini";

/// The OpenAI Chat Completions body asking for a classification of `prompt`.
pub(crate) fn chat_body(prompt: &str, max_tokens: u64) -> Bytes {
    let body = serde_json::json!({
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
    });
    Bytes::from(body.to_string())
}

/// The same request in Google's native Gemini shape: the prompt as the user's content, the
/// output bound as `generationConfig.maxOutputTokens` (the model is in the URL).
pub(crate) fn gemini_body(chat: &[u8]) -> Bytes {
    let chat: serde_json::Value = serde_json::from_slice(chat).unwrap_or_default();
    let body = serde_json::json!({
        "contents": [{"role": "user", "parts": [{"text": chat["messages"][0]["content"]}]}],
        "generationConfig": {"maxOutputTokens": chat["max_tokens"]},
    });
    Bytes::from(body.to_string())
}
