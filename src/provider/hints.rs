//! What a rate-limited answer says: how long to wait, and which quota it is spent.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

use crate::cost::Cost;
use crate::parse;
use crate::quota::Dimension;

/// The provider's minimum wait: the Retry-After family, then the body (Gemini's `RetryInfo`,
/// "Please retry after N seconds").
pub(crate) fn provider_wait(headers: &HeaderMap, body: &[u8], now: SystemTime) -> Option<Duration> {
    parse::retry_after(headers, now).or_else(|| parse::body_retry_delay(body))
}

/// Which dimensions a 429 says are spent, and for how long to pause them.
///
/// A dimension is spent when a rate-limit header of any known provider reports less remaining
/// than the request's `cost` needs in it (nothing remaining, when the cost is unknown); else
/// the message names it; unknown: all of them.
///
/// The pause is the provider's `wait` when it sent one. Without one, it is the time until
/// the cost fits by the provider's own numbers: its reset header is the time until its bucket
/// is *full* again, so its refill rate is `(limit - remaining) / reset`, and the cost fits
/// after `(cost - remaining) / rate`. Never the time to a full bucket: the provider accepts
/// the next request long before. `None` when nothing says how long.
pub(crate) fn spent(
    headers: &HeaderMap,
    body: &[u8],
    wait: Option<Duration>,
    cost: Option<&Cost>,
    now: SystemTime,
) -> (Vec<Dimension>, Option<Duration>) {
    let mut dimensions = Vec::new();
    let mut fits_after: Option<Duration> = None;
    for report in crate::provider::reports_of_any_provider(headers, now) {
        let Some(remaining) = report.remaining else {
            continue;
        };
        let needed = cost.map_or(1, |cost| cost.amount(report.dimension).max(1));
        if remaining >= needed {
            continue;
        }
        for dimension in covered(report.dimension) {
            if !dimensions.contains(dimension) {
                dimensions.push(*dimension);
            }
        }
        if let (Some(limit), Some(reset)) = (report.limit, report.reset) {
            if limit > remaining {
                let share = (needed - remaining) as f64 / (limit - remaining) as f64;
                let fits = reset.mul_f64(share.min(1.0));
                fits_after = fits_after.max(Some(fits));
            }
        }
    }
    if dimensions.is_empty() {
        let body = String::from_utf8_lossy(body).to_ascii_lowercase();
        // Gemini's `QuotaFailure` names its quota: `GenerateRequestsPerMinutePerProject...`,
        // `GenerateContentInputTokensPerModelPerMinute...`.
        let quota = quota_id(&body).unwrap_or_default();
        if quota.contains("request") {
            dimensions.push(Dimension::Requests);
        } else if quota.contains("inputtoken") {
            dimensions.extend(covered(Dimension::InputTokens));
        } else if quota.contains("outputtoken") {
            dimensions.extend(covered(Dimension::OutputTokens));
        } else if quota.contains("token") {
            dimensions.extend(covered(Dimension::TotalTokens));
        } else if body.contains("requests per min") || body.contains("(rpm)") {
            dimensions.push(Dimension::Requests);
        } else if body.contains("tokens per min") || body.contains("(tpm)") {
            dimensions.extend(covered(Dimension::TotalTokens));
        } else {
            dimensions.extend(Dimension::ALL);
        }
    }
    (dimensions, wait.or(fits_after))
}

/// The first `quotaId` of a (lowercased) Gemini error body's `QuotaFailure` violations.
fn quota_id(body: &str) -> Option<&str> {
    let after = &body[body.find("\"quotaid\"")? + "\"quotaid\"".len()..];
    let value = after
        .trim_start()
        .strip_prefix(':')?
        .trim_start()
        .strip_prefix('"')?;
    value.split('"').next()
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
    fn the_pause_is_the_providers_wait_never_the_time_to_a_full_bucket() {
        let now = SystemTime::UNIX_EPOCH;
        let map = headers(&[
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "12"),
            ("x-ratelimit-limit-tokens", "10000"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        let (dimensions, until) = spent(&map, b"", Some(Duration::from_secs(2)), None, now);
        assert_eq!(
            dimensions,
            [
                Dimension::InputTokens,
                Dimension::OutputTokens,
                Dimension::TotalTokens
            ]
        );
        assert_eq!(until, Some(Duration::from_secs(2)));
        // Without a wait: until 500 tokens fit at the provider's rate (10,000 per 360 s).
        let cost = Cost::new(300, 200);
        let (_, until) = spent(&map, b"", None, Some(&cost), now);
        assert_eq!(until, Some(Duration::from_secs(18)));
    }

    #[test]
    fn a_dimension_is_spent_when_the_cost_does_not_fit() {
        let now = SystemTime::UNIX_EPOCH;
        let map = headers(&[
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "60s"),
            ("x-ratelimit-limit-tokens", "10000"),
            ("x-ratelimit-remaining-tokens", "400"),
            ("x-ratelimit-reset-tokens", "57.6s"),
        ]);
        let (dimensions, until) = spent(&map, b"", None, Some(&Cost::new(100, 100)), now);
        assert_eq!(dimensions, [Dimension::Requests]);
        // One request of 60 per minute: a second, not the 60 s to a full bucket.
        assert_eq!(until, Some(Duration::from_secs(1)));
        let (dimensions, _) = spent(&map, b"", None, Some(&Cost::new(400, 100)), now);
        assert_eq!(dimensions.len(), 4);
    }

    #[test]
    fn geminis_quota_failure_names_its_dimension() {
        let now = SystemTime::UNIX_EPOCH;
        let body = |id: &str| {
            format!(
                r#"{{"error":{{"code":429,"details":[{{"@type":"type.googleapis.com/google.rpc.QuotaFailure",
                "violations":[{{"quotaMetric":"m","quotaId": "{id}"}}]}}]}}}}"#
            )
        };
        let spent_by = |id: &str| spent(&HeaderMap::new(), body(id).as_bytes(), None, None, now).0;
        assert_eq!(
            spent_by("GenerateRequestsPerMinutePerProjectPerModel-FreeTier"),
            [Dimension::Requests]
        );
        assert_eq!(
            spent_by("GenerateContentInputTokensPerModelPerMinute-FreeTier"),
            [Dimension::InputTokens, Dimension::TotalTokens]
        );
        assert_eq!(spent_by("SomethingElse").len(), Dimension::ALL.len());
    }

    #[test]
    fn unknown_means_every_dimension() {
        let now = SystemTime::UNIX_EPOCH;
        let (dimensions, until) = spent(&HeaderMap::new(), b"{}", None, None, now);
        assert_eq!(dimensions, Dimension::ALL);
        assert_eq!(until, None);
        let body = b"Rate limit reached for gpt-4o on requests per min (RPM): Limit 500";
        assert_eq!(
            spent(&HeaderMap::new(), body, None, None, now).0,
            [Dimension::Requests]
        );
    }
}
