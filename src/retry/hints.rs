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
/// provider's wait). Read from the rate-limit headers of any known provider (a report with
/// nothing remaining), else from the message; unknown dimensions: all of them.
pub(crate) fn spent(
    headers: &HeaderMap,
    body: &[u8],
    wait: Option<Duration>,
    now: SystemTime,
) -> (Vec<Dimension>, Option<Duration>) {
    let mut dimensions = Vec::new();
    let mut until = wait;
    for report in crate::provider::reports_of_any_provider(headers, now) {
        if report.remaining != Some(0) {
            continue;
        }
        for dimension in covered(report.dimension) {
            if !dimensions.contains(dimension) {
                dimensions.push(*dimension);
            }
        }
        until = until.max(report.reset);
    }
    if dimensions.is_empty() {
        let body = String::from_utf8_lossy(body).to_ascii_lowercase();
        if body.contains("requests per min") || body.contains("(rpm)") {
            dimensions.push(Dimension::Requests);
        } else if body.contains("tokens per min") || body.contains("(tpm)") {
            dimensions.extend(covered(Dimension::TotalTokens));
        } else {
            dimensions.extend(Dimension::ALL);
        }
    }
    (dimensions, until)
}

/// The dimensions to pause when a provider says one is spent: a total-token limit constrains
/// every token dimension we may have configured for it; input or output also constrain the
/// total.
fn covered(dimension: Dimension) -> &'static [Dimension] {
    match dimension {
        Dimension::Requests => &[Dimension::Requests],
        Dimension::InputTokens => &[Dimension::InputTokens, Dimension::TotalTokens],
        Dimension::OutputTokens => &[Dimension::OutputTokens, Dimension::TotalTokens],
        _ => &[
            Dimension::InputTokens,
            Dimension::OutputTokens,
            Dimension::TotalTokens,
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::headers;

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
