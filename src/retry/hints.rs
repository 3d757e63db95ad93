//! What a rate-limited answer says: how long to wait, and which quota it is spent.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

use crate::parse;
use crate::quota::Dimension;

/// The provider's minimum wait: the Retry-After family, then the body (Gemini's `RetryInfo`,
/// "Please retry after N seconds").
pub(crate) fn provider_wait(headers: &HeaderMap, body: &[u8], now: SystemTime) -> Option<Duration> {
    parse::retry_after(headers, now).or_else(|| parse::body_retry_delay(body))
}

/// Which dimensions a 429 says are spent, and until when (the longest of their resets and the
/// provider's wait). Unknown dimensions: all of them.
pub(crate) fn spent(
    headers: &HeaderMap,
    body: &[u8],
    wait: Option<Duration>,
    now: SystemTime,
) -> (Vec<Dimension>, Option<Duration>) {
    const TOKENS: [Dimension; 3] = [
        Dimension::InputTokens,
        Dimension::OutputTokens,
        Dimension::TotalTokens,
    ];
    // (remaining header, reset header, dimensions it covers)
    let reports: [(&str, &str, &[Dimension]); 5] = [
        (
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
            &[Dimension::Requests],
        ),
        (
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
            &TOKENS,
        ),
        (
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
            &[Dimension::Requests],
        ),
        (
            "anthropic-ratelimit-input-tokens-remaining",
            "anthropic-ratelimit-input-tokens-reset",
            &[Dimension::InputTokens, Dimension::TotalTokens],
        ),
        (
            "anthropic-ratelimit-output-tokens-remaining",
            "anthropic-ratelimit-output-tokens-reset",
            &[Dimension::OutputTokens, Dimension::TotalTokens],
        ),
    ];
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    let mut dimensions = Vec::new();
    let mut until = wait;
    for (remaining, reset, covered) in reports {
        if text(remaining).and_then(|v| v.parse::<u64>().ok()) != Some(0) {
            continue;
        }
        for dimension in covered {
            if !dimensions.contains(dimension) {
                dimensions.push(*dimension);
            }
        }
        let reset = text(reset).and_then(|v| {
            parse::reset_duration(v).or_else(|| parse::rfc3339(v).map(|at| parse::until(at, now)))
        });
        until = until.max(reset);
    }
    if dimensions.is_empty() {
        let body = String::from_utf8_lossy(body).to_ascii_lowercase();
        if body.contains("requests per min") || body.contains("(rpm)") {
            dimensions.push(Dimension::Requests);
        } else if body.contains("tokens per min") || body.contains("(tpm)") {
            dimensions.extend(TOKENS);
        } else {
            dimensions.extend(Dimension::ALL);
        }
    }
    (dimensions, until)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (k.parse().unwrap(), v.parse().unwrap()))
            .collect()
    }

    #[test]
    fn the_spent_dimension_and_its_reset() {
        let now = SystemTime::UNIX_EPOCH;
        let map = headers(&[
            ("x-ratelimit-remaining-requests", "12"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        let (dimensions, until) = spent(&map, b"", Some(Duration::from_secs(2)), now);
        assert_eq!(
            dimensions,
            [
                Dimension::InputTokens,
                Dimension::OutputTokens,
                Dimension::TotalTokens
            ]
        );
        assert_eq!(until, Some(Duration::from_secs(360)));
    }

    #[test]
    fn unknown_means_every_dimension() {
        let now = SystemTime::UNIX_EPOCH;
        let (dimensions, until) = spent(&HeaderMap::new(), b"{}", None, now);
        assert_eq!(dimensions, Dimension::ALL);
        assert_eq!(until, None);
        let body = b"Rate limit reached for gpt-4o on requests per min (RPM): Limit 500";
        assert_eq!(
            spent(&HeaderMap::new(), body, None, now).0,
            [Dimension::Requests]
        );
    }
}
