//! Absolute reset instants: RFC 3339 timestamps and Unix epoch seconds.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::MAX_WAIT;
#[cfg(any(test, fuzzing))]
use super::number::{Decimal, SECOND};
use super::number::{duration, trim};

/// Parses an RFC 3339 timestamp, as in Anthropic's `anthropic-ratelimit-*-reset` headers.
///
/// Accepts `Z` or a numeric offset (`±hh:mm`), any number of fractional-second digits
/// (truncated to the nanosecond), a lower-case `t`/`z` or a space for the `T`, and a leap
/// second (read as the last nanosecond before it). Anything else, including a date that does
/// not exist, gives `None`.
///
/// # Example
///
/// ```text
/// use std::time::{Duration, UNIX_EPOCH};
///
/// let at = UNIX_EPOCH + Duration::from_secs(1_740_435_947);
/// assert_eq!(rfc3339("2025-02-24T22:25:47Z"), Some(at));
/// assert_eq!(rfc3339("2025-02-24T23:25:47+01:00"), Some(at));
/// assert_eq!(rfc3339("2025-02-24T22:25:47.5Z"), Some(at + Duration::from_millis(500)));
/// assert_eq!(rfc3339("2025-02-30T00:00:00Z"), None);
/// ```
pub fn rfc3339(s: &str) -> Option<SystemTime> {
    let nanos = OffsetDateTime::parse(trim(s), &Rfc3339)
        .ok()?
        .unix_timestamp_nanos();
    let magnitude = duration(nanos.unsigned_abs())?;
    if nanos >= 0 {
        UNIX_EPOCH.checked_add(magnitude)
    } else {
        UNIX_EPOCH.checked_sub(magnitude)
    }
}

/// Parses a Unix timestamp in seconds, as in `anthropic-ratelimit-unified-reset: 1767225600`.
///
/// Accepts `\d+(\.\d+)?`; a sign, an exponent, or an instant the platform cannot represent gives
/// `None`.
///
/// # Example
///
/// ```text
/// use std::time::{Duration, UNIX_EPOCH};
///
/// assert_eq!(epoch_seconds("1767225600"), Some(UNIX_EPOCH + Duration::from_secs(1_767_225_600)));
/// assert_eq!(epoch_seconds("-1"), None);
/// ```
#[cfg(any(test, fuzzing))]
pub fn epoch_seconds(s: &str) -> Option<SystemTime> {
    let nanos = Decimal::whole(trim(s).as_bytes())?.nanos(SECOND);
    UNIX_EPOCH.checked_add(duration(nanos)?)
}

/// The wait until `at`, seen at `now`: zero if `at` has passed, at most
/// [`MAX_WAIT`](super::MAX_WAIT).
///
/// # Example
///
/// ```text
/// use std::time::{Duration, UNIX_EPOCH};
///
/// let now = UNIX_EPOCH + Duration::from_secs(1_767_225_590);
/// let at = epoch_seconds("1767225600").unwrap();
/// assert_eq!(until(at, now), Duration::from_secs(10));
/// assert_eq!(until(now, at), Duration::ZERO);
/// ```
pub fn until(at: SystemTime, now: SystemTime) -> Duration {
    at.duration_since(now)
        .map_or(Duration::ZERO, |d| d.min(MAX_WAIT))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn epoch(secs: u64, nanos: u32) -> Option<SystemTime> {
        Some(UNIX_EPOCH + Duration::new(secs, nanos))
    }

    #[test]
    fn rfc3339_forms() {
        assert_eq!(rfc3339("2025-08-21T12:40:59Z"), epoch(1_755_780_059, 0));
        assert_eq!(rfc3339("2025-08-21t12:40:59z"), epoch(1_755_780_059, 0));
        assert_eq!(rfc3339("2025-08-21 12:40:59Z"), epoch(1_755_780_059, 0)); // RFC 3339 § 5.6 NOTE
        assert_eq!(
            rfc3339("2025-08-21T14:40:59+02:00"),
            epoch(1_755_780_059, 0)
        );
        assert_eq!(
            rfc3339("2025-08-21T07:10:59-05:30"),
            epoch(1_755_780_059, 0)
        );
        assert_eq!(
            rfc3339("2025-08-21T12:40:59-00:00"),
            epoch(1_755_780_059, 0)
        );
        assert_eq!(
            rfc3339("2025-08-21T12:40:59.123456789Z"),
            epoch(1_755_780_059, 123_456_789)
        );
        assert_eq!(rfc3339("1970-01-01T00:00:00Z"), Some(UNIX_EPOCH));
        assert_eq!(
            rfc3339("1969-12-31T23:59:59Z"),
            UNIX_EPOCH.checked_sub(Duration::from_secs(1))
        );
    }

    #[test]
    fn rfc3339_rejects() {
        for s in [
            "",
            "2025-08-21",
            "2025-08-21T12:40:59",
            "2025-13-01T00:00:00Z",
            "2025-08-21T25:00:00Z",
            "2025-08-21T12:40:59+24:00",
            "2025-08-21T12:40:59.Z",
            "1755780059",
            "Wed, 21 Oct 2026 07:28:00 GMT",
        ] {
            assert_eq!(rfc3339(s), None, "{s:?}");
        }
    }

    #[test]
    fn epoch_seconds_forms() {
        assert_eq!(epoch_seconds("0"), Some(UNIX_EPOCH));
        assert_eq!(epoch_seconds("1767225600"), epoch(1_767_225_600, 0));
        assert_eq!(
            epoch_seconds("1767225600.25"),
            epoch(1_767_225_600, 250_000_000)
        );
        for s in ["", "-1", "1e9", "NaN", "0x10", &"9".repeat(400)] {
            assert_eq!(epoch_seconds(s), None, "{s:?}");
        }
    }

    #[test]
    fn until_clamps() {
        let now = UNIX_EPOCH + Duration::from_secs(1_000);
        assert_eq!(until(now, now), Duration::ZERO);
        assert_eq!(
            until(now + Duration::from_secs(5), now),
            Duration::from_secs(5)
        );
        assert_eq!(until(now + MAX_WAIT * 2, now), MAX_WAIT);
        assert_eq!(until(UNIX_EPOCH, now), Duration::ZERO);
    }
}
