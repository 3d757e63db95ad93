//! Relative waits: Go durations, plain seconds, .NET timespans.

use std::time::Duration;

use super::number::{Decimal, MILLI, SECOND, clamp, decimal_wait, trim};

const MINUTE: u64 = 60 * SECOND;
const HOUR: u64 = 60 * MINUTE;
const DAY: u64 = 24 * HOUR;

/// Parses a Go duration, as in OpenAI's `x-ratelimit-reset-*` headers.
///
/// The grammar is `(\d+(\.\d+)?(h|m|s|ms|us|µs|ns))+` (the `µ` may also be the Greek `μ`,
/// as Go accepts), the components are summed (`1m1m` is two minutes) and surrounding spaces
/// and tabs are ignored. A sign, an exponent, a bare number (even `0`), an unknown or
/// upper-case unit gives `None`. Sub-nanosecond fractions are truncated; a value above
/// [`MAX_WAIT`](super::MAX_WAIT) is clamped to it.
///
/// # Example
///
/// ```text
/// use std::time::Duration;
///
/// assert_eq!(go_duration("6m0s"), Some(Duration::from_secs(360)));
/// assert_eq!(go_duration("12ms"), Some(Duration::from_millis(12)));
/// assert_eq!(go_duration("1h2m3.5s"), Some(Duration::from_millis(3_723_500)));
/// assert_eq!(go_duration("37"), None); // no unit: see `reset_duration`
/// ```
pub fn go_duration(s: &str) -> Option<Duration> {
    let bytes = trim(s).as_bytes();
    go_prefix(bytes)
        .filter(|&(_, len)| len == bytes.len())
        .map(|(nanos, _)| clamp(nanos))
}

/// Parses what a `…-reset-…` header may hold: a Go duration (`"6m0s"`, OpenAI) or else a plain
/// number of seconds (`"37"`, Azure and Cerebras; fractions allowed).
///
/// Returns `None` for anything else, such as `-1`; clamped to [`MAX_WAIT`](super::MAX_WAIT).
/// Anthropic's resets are instants instead: see [`rfc3339`](super::rfc3339) and
/// `epoch_seconds`.
///
/// # Example
///
/// ```text
/// use std::time::Duration;
///
/// assert_eq!(reset_duration("1.28s"), Some(Duration::from_millis(1_280)));
/// assert_eq!(reset_duration("37"), Some(Duration::from_secs(37)));
/// assert_eq!(reset_duration("0"), Some(Duration::ZERO));
/// assert_eq!(reset_duration("-1"), None);
/// ```
pub fn reset_duration(s: &str) -> Option<Duration> {
    go_duration(s).or_else(|| seconds(s))
}

/// Parses a .NET timespan `[d.]hh:mm:ss[.fffffff]`, as Azure may send in
/// `x-ms-retry-after-ms` (`"00:00:00.033"`).
///
/// Hours take one or two digits and must be below 24, minutes and seconds exactly two digits
/// below 60; the fraction may have any number of digits (truncated to the nanosecond). Negative
/// timespans give `None`; a value above [`MAX_WAIT`](super::MAX_WAIT) is clamped to it.
///
/// # Example
///
/// ```text
/// use std::time::Duration;
///
/// assert_eq!(timespan("00:00:00.033"), Some(Duration::from_millis(33)));
/// assert_eq!(timespan("01:02:03"), Some(Duration::from_secs(3_723)));
/// assert_eq!(timespan("1.00:00:00"), Some(Duration::from_secs(86_400)));
/// assert_eq!(timespan("00:60:00"), None);
/// ```
pub fn timespan(s: &str) -> Option<Duration> {
    let bytes = trim(s).as_bytes();
    let first = digits(bytes);
    let (days, hours, rest) = match bytes.get(first) {
        Some(b'.') => {
            let days = Decimal::whole(&bytes[..first])?.nanos(DAY);
            let rest = &bytes[first + 1..];
            let hours = digits(rest);
            (days, &rest[..hours], &rest[hours..])
        }
        _ => (0, &bytes[..first], &bytes[first..]),
    };
    if !(1..=2).contains(&hours.len()) {
        return None;
    }
    let hours = two_digits(hours).filter(|&h| h < 24)?;
    let [b':', m1, m2, b':', rest @ ..] = rest else {
        return None;
    };
    let minutes = two_digits(&[*m1, *m2]).filter(|&m| m < 60)?;
    let seconds = Decimal::whole(rest).filter(|d| d.integer_digits == 2)?;
    if seconds.nanos(SECOND) >= u128::from(MINUTE) {
        return None;
    }
    let nanos = days
        .saturating_add(u128::from(hours) * u128::from(HOUR))
        .saturating_add(u128::from(minutes) * u128::from(MINUTE))
        .saturating_add(seconds.nanos(SECOND));
    Some(clamp(nanos))
}

/// A whole `\d+(\.\d+)?` number of seconds, clamped.
pub(super) fn seconds(s: &str) -> Option<Duration> {
    decimal_wait(s, SECOND)
}

/// A whole `\d+(\.\d+)?` number of milliseconds, clamped.
pub(super) fn millis(s: &str) -> Option<Duration> {
    decimal_wait(s, MILLI)
}

/// The longest run of Go duration components at the start of `bytes`: their sum in nanoseconds
/// (saturating) and the bytes they span, or `None` if there is not even one.
pub(super) fn go_prefix(bytes: &[u8]) -> Option<(u128, usize)> {
    let mut total = 0u128;
    let mut len = 0;
    while let Some(number) = Decimal::scan(&bytes[len..]) {
        let Some((unit, unit_len)) = unit(&bytes[len + number.len..]) else {
            break;
        };
        total = total.saturating_add(number.nanos(unit));
        len += number.len + unit_len;
    }
    (len > 0).then_some((total, len))
}

/// The Go unit at the start of `bytes`, in nanoseconds, and its length. `ms` before `m`.
fn unit(bytes: &[u8]) -> Option<(u64, usize)> {
    const UNITS: [(&str, u64); 8] = [
        ("ns", 1),
        ("us", 1_000),
        ("µs", 1_000), // U+00B5 MICRO SIGN
        ("μs", 1_000), // U+03BC GREEK SMALL LETTER MU
        ("ms", MILLI),
        ("s", SECOND),
        ("m", MINUTE),
        ("h", HOUR),
    ];
    UNITS
        .iter()
        .find(|(name, _)| bytes.starts_with(name.as_bytes()))
        .map(|&(name, nanos)| (nanos, name.len()))
}

/// How many ASCII digits `bytes` starts with.
fn digits(bytes: &[u8]) -> usize {
    bytes.iter().take_while(|b| b.is_ascii_digit()).count()
}

/// The value of one or two ASCII digits.
fn two_digits(bytes: &[u8]) -> Option<u32> {
    match bytes {
        [d] if d.is_ascii_digit() => Some(u32::from(d - b'0')),
        [d1, d2] if d1.is_ascii_digit() && d2.is_ascii_digit() => {
            Some(u32::from(d1 - b'0') * 10 + u32::from(d2 - b'0'))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::MAX_WAIT;
    use super::*;

    fn ns(n: u64) -> Option<Duration> {
        Some(Duration::from_nanos(n))
    }

    #[test]
    fn go_durations_of_every_unit() {
        assert_eq!(go_duration("0s"), ns(0));
        assert_eq!(go_duration("1s"), ns(SECOND));
        assert_eq!(go_duration("9ms"), ns(9 * MILLI));
        assert_eq!(go_duration("1.5h"), ns(5_400 * SECOND));
        assert_eq!(go_duration("2m"), ns(120 * SECOND));
        assert_eq!(go_duration("3us"), ns(3_000));
        assert_eq!(go_duration("3µs"), ns(3_000));
        assert_eq!(go_duration("3μs"), ns(3_000));
        assert_eq!(go_duration("7ns"), ns(7));
        assert_eq!(go_duration("1m1m"), ns(120 * SECOND));
        assert_eq!(go_duration("1ms1m"), ns(MILLI + MINUTE));
        assert_eq!(go_duration(" 6m0s\t"), ns(360 * SECOND));
        assert_eq!(go_duration("1.0000000005s"), ns(SECOND)); // truncated
    }

    #[test]
    fn go_durations_outside_the_grammar() {
        for s in [
            "",
            " ",
            "0",
            "37",
            "s",
            "1",
            "1x",
            "1S",
            "1M",
            "-1s",
            "+1s",
            ".5s",
            "1.s",
            "1e3s",
            "1s ms",
            "1s-1s",
            "1 s",
            "1sec",
            "1h2m3",
            "inf",
            "NaN",
            "1m0s,1m0s",
            "1d",
            "１s",
        ] {
            assert_eq!(go_duration(s), None, "{s:?}");
        }
    }

    #[test]
    fn go_durations_clamp_to_the_maximum() {
        assert_eq!(go_duration("169h"), Some(MAX_WAIT));
        assert_eq!(go_duration("168h"), Some(MAX_WAIT));
        assert_eq!(go_duration("167h"), Some(Duration::from_secs(167 * 3_600)));
        let huge = format!("{}h", "9".repeat(100));
        assert_eq!(go_duration(&huge), Some(MAX_WAIT));
        assert_eq!(go_duration(&"9999999999h".repeat(50)), Some(MAX_WAIT));
    }

    #[test]
    fn go_prefix_stops_at_the_last_whole_component() {
        assert_eq!(go_prefix(b"27.372244281s."), Some((27_372_244_281, 13)));
        assert_eq!(
            go_prefix(b"1h2m3"),
            Some((HOUR as u128 + 2 * MINUTE as u128, 4))
        );
        assert_eq!(go_prefix(b"x1s"), None);
        assert_eq!(go_prefix(b""), None);
    }

    #[test]
    fn resets_are_go_durations_or_seconds() {
        assert_eq!(reset_duration("6m0s"), ns(360 * SECOND));
        assert_eq!(reset_duration("37"), ns(37 * SECOND));
        assert_eq!(reset_duration("0.5"), ns(SECOND / 2));
        assert_eq!(reset_duration(" 37 "), ns(37 * SECOND));
        for s in ["-1", "", "37s37", "1e3", "NaN", "inf", "37 s"] {
            assert_eq!(reset_duration(s), None, "{s:?}");
        }
    }

    #[test]
    fn timespans() {
        assert_eq!(timespan("00:00:00.033"), ns(33 * MILLI));
        assert_eq!(timespan("0:00:01"), ns(SECOND));
        assert_eq!(timespan("23:59:59.9999999"), ns(86_399_999_999_900));
        assert_eq!(timespan("2.03:00:00"), ns(2 * DAY + 3 * HOUR));
        assert_eq!(timespan("99999999999999.00:00:00"), Some(MAX_WAIT));
        for s in [
            "",
            "00:00",
            "00:00:00:00",
            "000:00:00",
            "24:00:00",
            "00:60:00",
            "00:00:60",
            "00:0:00",
            "00:00:0",
            "00:00:000",
            "-00:00:01",
            "00:00:00.",
            ".00:00:00",
            "1..00:00:00",
            "00:00:00.033ms",
            "100",
            "1.5",
        ] {
            assert_eq!(timespan(s), None, "{s:?}");
        }
    }

    #[test]
    fn plain_seconds_and_millis() {
        assert_eq!(seconds("60"), ns(60 * SECOND));
        assert_eq!(seconds("1.5"), ns(1_500 * MILLI));
        assert_eq!(millis("20.5"), ns(20_500_000));
        assert_eq!(millis("1500"), ns(1_500 * MILLI));
        assert_eq!(millis("-1"), None);
    }
}
