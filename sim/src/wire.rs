//! What both wire styles share: the parsed request, token counting, the generated text, and
//! the formats of durations and timestamps in headers.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// Tokens added per message (and per system prompt) on top of its text.
pub(crate) const MESSAGE_OVERHEAD: u64 = 4;

/// A valid completion request, as the simulator needs it.
/// What a reported limit says now, for the rate-limit headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Level {
    pub(crate) dimension: tower_llm_quota::Dimension,
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    pub(crate) until_full: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChatRequest {
    pub(crate) model: String,
    pub(crate) prompt_tokens: u64,
    pub(crate) max_tokens: u64,
    pub(crate) stream: bool,
    /// OpenAI `stream_options.include_usage`.
    pub(crate) include_usage: bool,
    /// A hash of the prompt text, which decides the completion length.
    pub(crate) prompt_hash: u64,
    /// The ids of the items marked in the prompt (`<item id="...">`): a grouped prompt,
    /// answered with a JSON array.
    pub(crate) group: Vec<String>,
    /// OpenAI's `service_tier`, as asked.
    pub(crate) service_tier: Option<String>,
    /// An embeddings request (`/embeddings`) of this many inputs: answered with a vector
    /// each, nothing generated.
    pub(crate) embeddings: Option<usize>,
}

/// Why a request is malformed: the message of a 400.
pub(crate) type Invalid = String;

/// A completion the simulator generates, as both styles render it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Completion {
    pub(crate) id: String,
    pub(crate) model: String,
    /// Seconds since the Unix epoch.
    pub(crate) created: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) max_tokens: u64,
    pub(crate) include_usage: bool,
    /// The answer to a grouped prompt, instead of generated words (its tokens are
    /// `completion_tokens`, four characters each).
    pub(crate) text: Option<String>,
    /// The tier that served it, named in the answer when the request asked for one.
    pub(crate) service_tier: Option<&'static str>,
    /// The inputs of an embeddings request, each answered with a vector.
    pub(crate) embeddings: Option<usize>,
}

impl Completion {
    /// Whether the completion stopped at `max_tokens`.
    pub(crate) fn truncated(&self) -> bool {
        self.completion_tokens >= self.max_tokens
    }
}

/// One server-sent event of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Frame {
    /// Tokens generated before this frame is sent (its delay is their latency).
    pub(crate) tokens: u64,
    pub(crate) data: bytes::Bytes,
    /// The generation ends with this frame: the usage is settled when it is sent.
    pub(crate) settles: bool,
}

/// How many content frames a stream has at most: longer completions send several tokens per
/// frame.
pub(crate) const MAX_CONTENT_FRAMES: u64 = 16;

/// The whole text of a completion, as a non-streamed body carries it.
pub(crate) fn completion_text(c: &Completion) -> String {
    match &c.text {
        Some(text) => text.clone(),
        None => content_pieces(c)
            .into_iter()
            .map(|(_, text)| text)
            .collect(),
    }
}

/// The content frames' token counts and texts: generated words, or slices of the
/// completion's own text (four characters a token).
pub(crate) fn content_pieces(c: &Completion) -> Vec<(u64, String)> {
    let chars: Option<Vec<char>> = c.text.as_ref().map(|text| text.chars().collect());
    let mut offset = 0;
    pieces(c.completion_tokens, MAX_CONTENT_FRAMES)
        .into_iter()
        .map(|n| {
            let text = match &chars {
                Some(chars) => {
                    let start = (offset as usize * 4).min(chars.len());
                    let end = ((offset + n) as usize * 4).min(chars.len());
                    chars[start..end].iter().collect()
                }
                None => generated_text(n, offset),
            };
            offset += n;
            (n, text)
        })
        .collect()
}

/// Why a request is refused, in terms both styles render.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Refusal {
    /// No or unknown API key: 401.
    Unauthorized,
    /// Malformed request: 400.
    Invalid(String),
    /// A cost above a limit's capacity: 400.
    TooLarge(String),
    /// Unknown route: 404.
    NotFound(String),
    /// Not `POST`: 405.
    MethodNotAllowed,
    /// Over quota: 429.
    RateLimited(RateLimited),
    /// Injected: 500.
    ServerError,
    /// Injected: 503 (OpenAI) or 529 `overloaded_error` (Anthropic).
    Overloaded,
    /// Injected for a flex request: 429 "Resource Unavailable", not charged.
    TierUnavailable,
}

/// The facts of a 429.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RateLimited {
    pub(crate) organization: String,
    pub(crate) model: String,
    pub(crate) dimension: tower_llm_quota::Dimension,
    /// `per min (TPM)`, `per day (RPD)`, ...: the limit's period in words.
    pub(crate) per: String,
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    pub(crate) requested: u64,
    pub(crate) wait: Duration,
}

/// The period of a limit in words, with the usual acronym: `per min (RPM)`, `per day (TPD)`.
/// A day is 86 400 s or 1 440 simulated minutes.
pub(crate) fn per(
    dimension: tower_llm_quota::Dimension,
    period: Duration,
    minute: Duration,
) -> String {
    use tower_llm_quota::Dimension;
    let unit = match dimension {
        Dimension::Requests => "RP",
        Dimension::InputTokens => "ITP",
        Dimension::OutputTokens => "OTP",
        Dimension::TotalTokens => "TP",
        // Spend, and any dimension a later core adds.
        _ => "spend ",
    };
    if period == minute {
        format!("per min ({unit}M)")
    } else if period == Duration::from_secs(86_400) || Some(period) == minute.checked_mul(1_440) {
        format!("per day ({unit}D)")
    } else {
        format!("per {}", go_duration(period))
    }
}

/// Token count of one text: a quarter of its characters (Unicode scalar values), rounded up.
pub(crate) fn text_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4)
}

/// Counts the prompt of a message list and hashes its text. Each message costs
/// [`MESSAGE_OVERHEAD`] plus the tokens of its text: a string `content`, or the `text` of each
/// block in an array `content` (other blocks count only the overhead).
pub(crate) fn count_messages(
    messages: &[Value],
    tokens: &mut u64,
    hash: &mut Fnv,
) -> Result<(), Invalid> {
    for (i, message) in messages.iter().enumerate() {
        let Some(message) = message.as_object() else {
            return Err(format!("messages[{i}] must be an object"));
        };
        if !message.get("role").is_some_and(Value::is_string) {
            return Err(format!("messages[{i}].role must be a string"));
        }
        *tokens = tokens.saturating_add(MESSAGE_OVERHEAD);
        count_content(message.get("content"), tokens, hash);
    }
    Ok(())
}

/// Adds the tokens of a `content` (or Anthropic `system`) value: a string or text blocks.
pub(crate) fn count_content(content: Option<&Value>, tokens: &mut u64, hash: &mut Fnv) {
    let mut add = |text: &str| {
        *tokens = tokens.saturating_add(text_tokens(text));
        hash.write(text.as_bytes());
    };
    match content {
        Some(Value::String(text)) => add(text),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .for_each(add),
        _ => {}
    }
}

/// The ids of the items marked in the messages' texts (see
/// [`item_markers`](tower_llm_quota::group::item_markers)).
pub(crate) fn group_ids(messages: &[Value]) -> Vec<String> {
    let mut ids = Vec::new();
    let mut scan = |text: &str| {
        ids.extend(tower_llm_quota::group::item_markers(text).map(|(id, _)| id.to_owned()));
    };
    for message in messages {
        match message.get("content") {
            Some(Value::String(text)) => scan(text),
            Some(Value::Array(blocks)) => blocks
                .iter()
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .for_each(&mut scan),
            _ => {}
        }
    }
    ids
}

/// A positive integer field, `None` when absent.
pub(crate) fn positive(body: &Value, field: &str) -> Result<Option<u64>, Invalid> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => match value.as_u64() {
            Some(n) if n > 0 => Ok(Some(n)),
            _ => Err(format!("{field} must be a positive integer")),
        },
    }
}

/// A boolean field, false when absent.
pub(crate) fn flag(body: &Value, field: &str) -> Result<bool, Invalid> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(format!("{field} must be a boolean")),
    }
}

/// The body as a JSON object.
pub(crate) fn object(body: &[u8]) -> Result<Value, Invalid> {
    match serde_json::from_slice::<Value>(body) {
        Ok(value @ Value::Object(_)) => Ok(value),
        Ok(_) => Err("the request body must be a JSON object".to_owned()),
        Err(e) => Err(format!("the request body is not valid JSON: {e}")),
    }
}

/// The `messages` array, non-empty.
pub(crate) fn messages(body: &Value) -> Result<&[Value], Invalid> {
    match body.get("messages").and_then(Value::as_array) {
        Some(messages) if !messages.is_empty() => Ok(messages),
        Some(_) => Err("messages must not be empty".to_owned()),
        None => Err("messages: field required (an array of messages)".to_owned()),
    }
}

/// The model name, `sim-model` when absent.
pub(crate) fn model(body: &Value) -> String {
    body.get("model")
        .and_then(Value::as_str)
        .unwrap_or("sim-model")
        .to_owned()
}

/// FNV-1a, 64 bits: a small, stable hash.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fnv(u64);

impl Fnv {
    pub(crate) fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Separates consecutive texts.
        self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3) ^ 0xff;
    }

    pub(crate) fn finish(self) -> u64 {
        self.0
    }
}

/// The completion length: between `min` and `max` shares of `max_tokens`, picked by the prompt
/// hash mixed with the seed; at least 1, at most `max_tokens`.
pub(crate) fn completion_tokens(max_tokens: u64, share: (f64, f64), hash: u64, seed: u64) -> u64 {
    let bound = |s: f64| ((max_tokens as f64 * s).ceil() as u64).clamp(1, max_tokens.max(1));
    let (low, high) = (bound(share.0), bound(share.1));
    let span = high - low + 1;
    low + mix(hash ^ seed.rotate_left(29)) % span
}

/// A 64-bit finalizer (splitmix64's), so neighbouring hashes spread.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

const WORDS: [&str; 8] = [
    " sim", " tok", " abc", " run", " hey", " one", " two", " end",
];

/// Generated text of `tokens` tokens: four characters each.
pub(crate) fn generated_text(tokens: u64, offset: u64) -> String {
    (offset..offset + tokens)
        .map(|i| WORDS[(i % WORDS.len() as u64) as usize])
        .collect()
}

/// Splits `tokens` into at most `max_pieces` pieces of near-equal size (none when zero).
pub(crate) fn pieces(tokens: u64, max_pieces: u64) -> Vec<u64> {
    let n = tokens.min(max_pieces.max(1));
    if n == 0 {
        return Vec::new();
    }
    (0..n)
        .map(|i| tokens / n + u64::from(i < tokens % n))
        .collect()
}

/// Inserts a header built at run time; a name or value that is not valid HTTP is skipped.
pub(crate) fn insert_header(headers: &mut http::HeaderMap, name: String, value: String) {
    if let (Ok(name), Ok(value)) = (
        http::HeaderName::try_from(name),
        http::HeaderValue::try_from(value),
    ) {
        headers.insert(name, value);
    }
}

/// A duration as Go prints it (`0s`, `120ms`, `1.5s`, `6m0s`, `1h2m3.5s`), rounded up to the
/// millisecond, as OpenAI's `x-ratelimit-reset-*` headers.
pub(crate) fn go_duration(duration: Duration) -> String {
    let millis = duration.as_nanos().div_ceil(1_000_000);
    if millis == 0 {
        return "0s".to_owned();
    }
    if millis < 1_000 {
        return format!("{millis}ms");
    }
    let (hours, rest) = (millis / 3_600_000, millis % 3_600_000);
    let (minutes, rest) = (rest / 60_000, rest % 60_000);
    let (seconds, fraction) = (rest / 1_000, rest % 1_000);
    let mut out = String::new();
    if hours > 0 {
        out.push_str(&format!("{hours}h"));
    }
    if hours > 0 || minutes > 0 {
        out.push_str(&format!("{minutes}m"));
    }
    out.push_str(&seconds.to_string());
    if fraction > 0 {
        let digits = format!("{fraction:03}");
        out.push('.');
        out.push_str(digits.trim_end_matches('0'));
    }
    out.push('s');
    out
}

/// An instant as RFC 3339 in UTC with milliseconds (`2025-02-24T22:25:47.120Z`), rounded up
/// to the millisecond; instants before 1970 print as the epoch.
pub(crate) fn rfc3339(at: SystemTime) -> String {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let millis = since.as_nanos().div_ceil(1_000_000);
    let (secs, ms) = (millis / 1_000, millis % 1_000);
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_date(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01.
fn civil_date(days: u128) -> (u128, u128, u128) {
    // Shift to a 400-year era starting on 0000-03-01.
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + u128::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_are_written_as_go_writes_them() {
        for (millis, text) in [
            (0, "0s"),
            (12, "12ms"),
            (1_000, "1s"),
            (1_280, "1.28s"),
            (360_000, "6m0s"),
            (3_723_500, "1h2m3.5s"),
            (3_600_000, "1h0m0s"),
        ] {
            let duration = Duration::from_millis(millis);
            assert_eq!(go_duration(duration), text);
        }
        assert_eq!(go_duration(Duration::from_nanos(1)), "1ms", "rounded up");
    }

    #[test]
    fn timestamps_are_written_as_rfc_3339() {
        for (secs, text) in [
            (0, "1970-01-01T00:00:00.120Z"),
            (1_740_435_947, "2025-02-24T22:25:47.120Z"),
            (951_782_400, "2000-02-29T00:00:00.120Z"),
            (4_107_542_400, "2100-03-01T00:00:00.120Z"),
        ] {
            let at = UNIX_EPOCH + Duration::from_millis(secs * 1_000 + 120);
            assert_eq!(rfc3339(at), text);
        }
        let at = UNIX_EPOCH + Duration::from_secs(1_740_435_947);
        assert_eq!(rfc3339(at), "2025-02-24T22:25:47.000Z");
        // 2000-02-29, a leap day.
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00.000Z"
        );
    }

    #[test]
    fn prompt_tokens_follow_the_documented_rule() {
        assert_eq!(text_tokens(""), 0);
        assert_eq!(text_tokens("abcd"), 1);
        assert_eq!(text_tokens("abcde"), 2);
        assert_eq!(text_tokens("éééé"), 1, "characters, not bytes");
    }

    #[test]
    fn completions_stay_within_their_shares() {
        for hash in 0..1_000 {
            let n = completion_tokens(100, (0.1, 1.0), hash, 3);
            assert!((10..=100).contains(&n));
        }
        assert_eq!(completion_tokens(100, (1.0, 1.0), 42, 0), 100);
        assert_eq!(completion_tokens(1, (0.0, 0.0), 42, 0), 1);
    }

    #[test]
    fn periods_read_as_the_providers_write_them() {
        use tower_llm_quota::Dimension;
        let minute = Duration::from_secs(2);
        assert_eq!(per(Dimension::Requests, minute, minute), "per min (RPM)");
        assert_eq!(per(Dimension::TotalTokens, minute, minute), "per min (TPM)");
        assert_eq!(
            per(Dimension::InputTokens, minute, minute),
            "per min (ITPM)"
        );
        let day = Duration::from_secs(2 * 1_440);
        assert_eq!(per(Dimension::OutputTokens, day, minute), "per day (OTPD)");
        assert_eq!(per(Dimension::Requests, minute / 60, minute), "per 34ms");
    }

    #[test]
    fn text_and_pieces_add_up() {
        assert_eq!(generated_text(5, 0).chars().count(), 20);
        assert_eq!(pieces(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(pieces(2, 16), vec![1, 1]);
        assert!(pieces(0, 16).is_empty());
    }
}
