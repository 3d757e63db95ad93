//! Wait hints in error bodies: Gemini's `RetryInfo`, and "retry after" prose.

use std::time::Duration;

use serde_json::Value;

use super::duration::go_prefix;
use super::number::{Decimal, SECOND, clamp};

/// The wait an error body asks for, from the first of these that it holds:
///
/// 1. A `google.rpc.RetryInfo` (any JSON object whose `@type` ends in `RetryInfo`, anywhere in
///    the document, typically in `error.details[]`): its `retryDelay`, a protobuf JSON
///    duration (`"36s"`, `"3.957525076s"`).
/// 2. The text `"retryDelay": "…s"`, with any quotes and backslashes around it: the body may be
///    cut short, or hold the Gemini error escaped inside another error's message.
/// 3. Prose, matched case-insensitively: `retry after 37 seconds` (Azure),
///    `retry in 27.372244281s` (Gemini) or `try again in 1.5s` (OpenAI), the last two with a
///    [Go duration](super::go_duration).
///
/// Numbers are `\d+(\.\d+)?`, truncated to the nanosecond; anything else (a negative
/// delay, an exponent, a missing unit) is skipped. The result is at most
/// [`MAX_WAIT`](super::MAX_WAIT), to which larger values are clamped.
///
/// # Example
///
/// ```text
/// use std::time::Duration;
///
/// let gemini = br#"{"error":{"code":429,"details":[
///     {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"3.957525076s"}]}}"#;
/// assert_eq!(body_retry_delay(gemini), Some(Duration::new(3, 957_525_076)));
///
/// let azure = b"... exceeded token rate limit. Please retry after 37 seconds.";
/// assert_eq!(body_retry_delay(azure), Some(Duration::from_secs(37)));
/// assert_eq!(body_retry_delay(b"{}"), None);
/// ```
pub fn body_retry_delay(body: &[u8]) -> Option<Duration> {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|json| retry_info(&json))
        .or_else(|| retry_delay_text(body))
        .or_else(|| prose(body))
}

/// The `retryDelay` of the first `RetryInfo` in `json`, depth first.
fn retry_info(json: &Value) -> Option<Duration> {
    match json {
        Value::Object(map) => {
            let is_retry_info = map
                .get("@type")
                .and_then(Value::as_str)
                .is_some_and(|t| t.ends_with("RetryInfo"));
            let delay = map.get("retryDelay").and_then(Value::as_str);
            match delay.filter(|_| is_retry_info).and_then(proto_duration) {
                Some(delay) => Some(delay),
                None => map.values().find_map(retry_info),
            }
        }
        Value::Array(items) => items.iter().find_map(retry_info),
        _ => None,
    }
}

/// A protobuf JSON `Duration`: decimal seconds and an `s`, no sign.
fn proto_duration(s: &str) -> Option<Duration> {
    let number = Decimal::whole(s.strip_suffix('s')?.as_bytes())?;
    Some(clamp(number.nanos(SECOND)))
}

/// The first `retryDelay` followed by a `:`, quotes or backslashes, and `<decimal>s` closed by
/// a quote or backslash.
fn retry_delay_text(body: &[u8]) -> Option<Duration> {
    after_all(body, b"retryDelay", false).find_map(|start| {
        let rest = &body[start..];
        let gap = rest
            .iter()
            .take_while(|b| matches!(b, b'"' | b'\\' | b':' | b' ' | b'\t' | b'\r' | b'\n'))
            .count();
        if !rest[..gap].contains(&b':') {
            return None;
        }
        let rest = &rest[gap..];
        let number = Decimal::scan(rest)?;
        match rest[number.len..] {
            [b's', b'"' | b'\\', ..] => Some(clamp(number.nanos(SECOND))),
            _ => None,
        }
    })
}

/// The first wait stated in prose.
fn prose(body: &[u8]) -> Option<Duration> {
    let go = |start: usize| {
        let rest = &body[start..];
        let (nanos, len) = go_prefix(rest)?;
        let boundary = rest.get(len).is_none_or(|b| !b.is_ascii_alphanumeric());
        boundary.then(|| clamp(nanos))
    };
    after_all(body, b"retry after ", true)
        .find_map(|start| {
            let rest = &body[start..];
            let number = Decimal::scan(rest)?;
            let rest = &rest[number.len..];
            let spaces = rest.iter().take_while(|&&b| b == b' ').count();
            let unit = rest.get(spaces..spaces + 6)?;
            (spaces > 0 && unit.eq_ignore_ascii_case(b"second"))
                .then(|| clamp(number.nanos(SECOND)))
        })
        .or_else(|| after_all(body, b"retry in ", true).find_map(go))
        .or_else(|| after_all(body, b"try again in ", true).find_map(go))
}

/// The index just past every occurrence of `needle` in `haystack`, in order.
fn after_all<'a>(
    haystack: &'a [u8],
    needle: &'a [u8],
    ignore_case: bool,
) -> impl Iterator<Item = usize> + 'a {
    haystack
        .windows(needle.len())
        .enumerate()
        .filter(move |(_, window)| {
            if ignore_case {
                window.eq_ignore_ascii_case(needle)
            } else {
                *window == needle
            }
        })
        .map(move |(i, _)| i + needle.len())
}

#[cfg(test)]
mod tests {
    use super::super::MAX_WAIT;
    use super::*;

    const GEMINI: &str = r#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED",
 "message":"You exceeded your current quota ... Please retry in 36.123s.",
 "details":[
  {"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[
     {"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests",
      "quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
      "quotaDimensions":{"location":"global","model":"gemini-2.5-flash"}}]},
  {"@type":"type.googleapis.com/google.rpc.Help","links":[{"url":"https://ai.google.dev/gemini-api/docs/rate-limits"}]},
  {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"36s"}]}}"#;

    fn delay(body: &str) -> Option<Duration> {
        body_retry_delay(body.as_bytes())
    }

    #[test]
    fn retry_info_wins_over_the_message() {
        assert_eq!(delay(GEMINI), Some(Duration::from_secs(36)));
        let without = GEMINI.replace(r#","retryDelay":"36s""#, "");
        assert_eq!(delay(&without), Some(Duration::from_millis(36_123)));
    }

    #[test]
    fn retry_info_anywhere() {
        let array = r#"[{"error":{"details":[{"@type":"x.RetryInfo","retryDelay":"1.5s"}]}}]"#;
        assert_eq!(delay(array), Some(Duration::from_millis(1_500)));
        // Not a RetryInfo: ignored by the JSON walk, found by the text search.
        let untyped = r#"{"retryDelay":"2s"}"#;
        assert_eq!(delay(untyped), Some(Duration::from_secs(2)));
        let bad = r#"{"@type":"RetryInfo","retryDelay":"-2s"}"#;
        assert_eq!(delay(bad), None);
        let huge = r#"{"@type":"RetryInfo","retryDelay":"315576000000s"}"#;
        assert_eq!(delay(huge), Some(MAX_WAIT));
    }

    #[test]
    fn nested_and_truncated_bodies() {
        let nested = r#"{"error":{"message":"upstream: {\"error\":{\"code\":429,\"details\":[{\"@type\":\"type.googleapis.com/google.rpc.RetryInfo\",\"retryDelay\":\"56s\"}]}}"}}"#;
        assert_eq!(delay(nested), Some(Duration::from_secs(56)));
        let cut = r#"{"error":{"details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay": "3.957525076s"}"#;
        assert_eq!(delay(cut), Some(Duration::new(3, 957_525_076)));
        for no in [
            r#""retryDelay":"3""#,
            r#""retryDelay":"3sx""#,
            r#"retryDelay 3s""#,
        ] {
            assert_eq!(delay(no), None, "{no}");
        }
    }

    #[test]
    fn prose_forms() {
        assert_eq!(
            delay("Rate limit exceeded. Please retry after 45 seconds."),
            Some(Duration::from_secs(45))
        );
        assert_eq!(
            delay("please RETRY AFTER 1 second"),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            delay("Please retry in 27.372244281s."),
            Some(Duration::new(27, 372_244_281))
        );
        assert_eq!(
            delay("Please retry in 738.5ms"),
            Some(Duration::from_micros(738_500))
        );
        assert_eq!(
            delay("Limit 10000, Used 9000, Requested 1500. Please try again in 3.6s. Visit"),
            Some(Duration::from_millis(3_600))
        );
        assert_eq!(
            delay("Please retry after 86400 seconds"),
            Some(Duration::from_secs(86_400))
        );
        for no in [
            "Please retry after 37",
            "Please retry after 37s",
            "Please retry after -1 seconds",
            "Please retry in 5 minutes",
            "Please retry in 5sec",
            "Please retry in -5s",
            "retry later",
            "",
        ] {
            assert_eq!(delay(no), None, "{no}");
        }
    }

    #[test]
    fn not_utf8() {
        assert_eq!(
            body_retry_delay(b"\xff\xfe retry after 3 seconds \xff"),
            Some(Duration::from_secs(3))
        );
    }
}
