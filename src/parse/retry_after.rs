//! The Retry-After family of response headers.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

use super::duration::{millis, seconds, timespan};
use super::instant::until;
use super::number::trim;

/// The wait a response's headers ask for, from the first of these that parses:
///
/// 1. `retry-after-ms`: milliseconds, fractions allowed (`"20.5"`; Azure OpenAI).
/// 2. `x-ms-retry-after-ms`: milliseconds (`"100"`) or a .NET timespan
///    (`"00:00:00.033"`; Azure services).
/// 3. `retry-after`: seconds, fractions allowed (`"60"`, `"1.5"`), or an HTTP-date in any of
///    the three forms of RFC 9110 (its weekday must match), giving
///    the wait from `now` until the date: zero if the date has passed.
///
/// A header that is absent, malformed (negative, `NaN`, an exponent, not ASCII…) or repeated
/// with differing values is skipped for the next one. Numbers are `\d+(\.\d+)?`, truncated to
/// the nanosecond; the result is at most a week, to which larger values are clamped.
///
/// # Example
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use http::HeaderMap;
/// use tower_llm_quota::provider::retry_after;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("retry-after", "60".parse().unwrap());
/// assert_eq!(retry_after(&headers, SystemTime::now()), Some(Duration::from_secs(60)));
/// headers.insert("retry-after-ms", "1500".parse().unwrap());
/// assert_eq!(retry_after(&headers, SystemTime::now()), Some(Duration::from_millis(1_500)));
/// headers.insert("retry-after-ms", "-1".parse().unwrap()); // skipped
/// assert_eq!(retry_after(&headers, SystemTime::now()), Some(Duration::from_secs(60)));
/// ```
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    single(headers, "retry-after-ms")
        .and_then(millis)
        .or_else(|| {
            single(headers, "x-ms-retry-after-ms").and_then(|v| millis(v).or_else(|| timespan(v)))
        })
        .or_else(|| {
            single(headers, "retry-after").and_then(|v| {
                seconds(v).or_else(|| {
                    let at = httpdate::parse_http_date(trim(v)).ok()?;
                    Some(until(at, now))
                })
            })
        })
}

/// The value of header `name` as text, unless it is absent, not visible ASCII, or present more
/// than once with differing values.
fn single<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    let mut values = headers.get_all(name).iter();
    let first = values.next()?;
    if values.any(|other| other != first) {
        return None;
    }
    first.to_str().ok()
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use http::HeaderValue;

    use super::super::MAX_WAIT;
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for &(name, value) in pairs {
            map.append(name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    fn wait(pairs: &[(&'static str, &str)]) -> Option<Duration> {
        retry_after(
            &headers(pairs),
            UNIX_EPOCH + Duration::from_secs(1_792_654_000),
        )
    }

    #[test]
    fn each_header_alone() {
        assert_eq!(wait(&[]), None);
        assert_eq!(
            wait(&[("retry-after-ms", "20.5")]),
            Some(Duration::from_micros(20_500))
        );
        assert_eq!(
            wait(&[("x-ms-retry-after-ms", "100")]),
            Some(Duration::from_millis(100))
        );
        assert_eq!(
            wait(&[("x-ms-retry-after-ms", "00:00:00.033")]),
            Some(Duration::from_millis(33))
        );
        assert_eq!(
            wait(&[("retry-after", "60")]),
            Some(Duration::from_secs(60))
        );
        assert_eq!(
            wait(&[("retry-after", "1.5")]),
            Some(Duration::from_millis(1_500))
        );
        // Wed, 21 Oct 2026 07:28:00 GMT is 1_792_567_680: in the past here.
        assert_eq!(
            wait(&[("retry-after", "Wed, 21 Oct 2026 07:28:00 GMT")]),
            Some(Duration::ZERO)
        );
        assert_eq!(wait(&[("retry-after", "99999999999")]), Some(MAX_WAIT));
    }

    #[test]
    fn repeated_headers() {
        let twice = [("retry-after", "60"), ("retry-after", "60")];
        assert_eq!(wait(&twice), Some(Duration::from_secs(60)));
        let differing = [("retry-after", "60"), ("retry-after", "30")];
        assert_eq!(wait(&differing), None);
        let fallback = [
            ("retry-after-ms", "1"),
            ("retry-after-ms", "2"),
            ("retry-after", "3"),
        ];
        assert_eq!(wait(&fallback), Some(Duration::from_secs(3)));
    }

    #[test]
    fn not_ascii_is_skipped() {
        let mut map = headers(&[("retry-after", "7")]);
        map.insert("retry-after-ms", HeaderValue::from_bytes(b"1\xb5").unwrap());
        assert_eq!(retry_after(&map, UNIX_EPOCH), Some(Duration::from_secs(7)));
    }
}
