//! The scanner every parser shares: unsigned decimals as exact, saturating nanoseconds.

use std::time::Duration;

/// Nanoseconds per second.
pub(super) const SECOND: u64 = 1_000_000_000;
/// Nanoseconds per millisecond.
pub(super) const MILLI: u64 = 1_000_000;

/// Fraction digits kept: with every unit at most an hour (3.6 × 10¹² ns), the dropped tail is
/// worth less than a nanosecond, and `fraction × unit` stays far below `u128::MAX`.
const FRACTION_DIGITS: u32 = 18;

/// A scanned `\d+(\.\d+)?`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Decimal {
    /// The integer part, saturated at `u128::MAX`.
    integer: u128,
    /// How many digits the integer part has.
    pub(super) integer_digits: usize,
    /// The first [`FRACTION_DIGITS`] digits of the fraction, as an integer.
    fraction: u128,
    /// How many digits `fraction` holds.
    fraction_digits: u32,
    /// Bytes consumed.
    pub(super) len: usize,
}

impl Decimal {
    /// Scans the longest `\d+(\.\d+)?` at the start of `bytes`; a `.` not followed by a digit
    /// is left unconsumed.
    pub(super) fn scan(bytes: &[u8]) -> Option<Self> {
        let integer_digits = bytes.iter().take_while(|b| b.is_ascii_digit()).count();
        if integer_digits == 0 {
            return None;
        }
        let integer = bytes[..integer_digits].iter().fold(0u128, |n, &b| {
            n.saturating_mul(10).saturating_add(u128::from(b - b'0'))
        });
        let mut decimal = Self {
            integer,
            integer_digits,
            fraction: 0,
            fraction_digits: 0,
            len: integer_digits,
        };
        let rest = &bytes[integer_digits..];
        if let [b'.', tail @ ..] = rest {
            let digits = tail.iter().take_while(|b| b.is_ascii_digit()).count();
            if digits > 0 {
                for &b in tail[..digits].iter().take(FRACTION_DIGITS as usize) {
                    decimal.fraction = decimal.fraction * 10 + u128::from(b - b'0');
                    decimal.fraction_digits += 1;
                }
                decimal.len += 1 + digits;
            }
        }
        Some(decimal)
    }

    /// Scans `\d+(\.\d+)?` spanning all of `bytes`.
    pub(super) fn whole(bytes: &[u8]) -> Option<Self> {
        Self::scan(bytes).filter(|d| d.len == bytes.len())
    }

    /// The value, counted in units of `unit` nanoseconds, in nanoseconds: truncated to the
    /// nanosecond, saturated at `u128::MAX`.
    pub(super) fn nanos(self, unit: u64) -> u128 {
        let unit = u128::from(unit);
        let fraction = self.fraction * unit / 10u128.pow(self.fraction_digits);
        self.integer.saturating_mul(unit).saturating_add(fraction)
    }
}

/// `nanos` as a wait: at most [`MAX_WAIT`].
pub(super) fn clamp(nanos: u128) -> Duration {
    let max = MAX_WAIT.as_nanos();
    u64::try_from(nanos.min(max)).map_or(MAX_WAIT, Duration::from_nanos)
}

/// `nanos` as a `Duration`, if it fits one.
pub(super) fn duration(nanos: u128) -> Option<Duration> {
    let secs = u64::try_from(nanos / u128::from(SECOND)).ok()?;
    // The remainder is below 10⁹, so it fits a `u32`.
    let subsec = u32::try_from(nanos % u128::from(SECOND)).ok()?;
    Some(Duration::new(secs, subsec))
}

/// `s` without the spaces and tabs HTTP allows around a field value.
pub(super) fn trim(s: &str) -> &str {
    s.trim_matches([' ', '\t'])
}

/// A whole `\d+(\.\d+)?` in units of `unit` nanoseconds, clamped to [`MAX_WAIT`].
pub(super) fn decimal_wait(s: &str, unit: u64) -> Option<Duration> {
    Decimal::whole(trim(s).as_bytes()).map(|d| clamp(d.nanos(unit)))
}

/// The longest wait any parser returns: 7 days. Longer well-formed values are clamped to it.
///
/// Far above any delay worth honouring (the SDKs stop at 60 or 120 seconds), and far below
/// what would overflow an `Instant` or a timer.
pub const MAX_WAIT: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// Parses a count, as in `x-ratelimit-remaining-tokens: 149984`: ASCII digits only.
///
/// A sign (Azure's `-1` sentinel means unknown), a fraction, an exponent or a value above
/// `u64::MAX` gives `None`; surrounding spaces and tabs are ignored.
///
/// # Example
///
/// ```text
///
/// assert_eq!(count("149984"), Some(149_984));
/// assert_eq!(count("-1"), None);
/// ```
pub fn count(s: &str) -> Option<u64> {
    let s = trim(s);
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nanos(s: &str, unit: u64) -> Option<u128> {
        Decimal::whole(s.as_bytes()).map(|d| d.nanos(unit))
    }

    #[test]
    fn scans_integers_and_fractions_exactly() {
        assert_eq!(nanos("0", SECOND), Some(0));
        assert_eq!(nanos("37", SECOND), Some(37_000_000_000));
        assert_eq!(nanos("1.28", SECOND), Some(1_280_000_000));
        assert_eq!(nanos("20.5", MILLI), Some(20_500_000));
        assert_eq!(nanos("3.957525076", SECOND), Some(3_957_525_076));
        assert_eq!(nanos("0.0000000019", SECOND), Some(1)); // truncated to the nanosecond
        assert_eq!(nanos("1.5", 1), Some(1));
        assert_eq!(nanos("007", SECOND), Some(7_000_000_000));
    }

    #[test]
    fn rejects_what_is_not_an_unsigned_decimal() {
        for s in [
            "", ".", ".5", "5.", "-1", "+1", "1e3", "1.2.3", "NaN", "inf", " 1", "1 ", "١",
        ] {
            assert_eq!(nanos(s, SECOND), None, "{s:?}");
        }
    }

    #[test]
    fn a_dot_without_digits_is_left_unconsumed() {
        let d = Decimal::scan(b"12.s").unwrap();
        assert_eq!((d.len, d.nanos(1)), (2, 12));
    }

    #[test]
    fn huge_values_saturate_and_clamp() {
        let digits = "9".repeat(400);
        assert_eq!(nanos(&digits, SECOND), Some(u128::MAX));
        assert_eq!(decimal_wait(&digits, SECOND), Some(MAX_WAIT));
        let long_fraction = format!("1.{}", "9".repeat(400));
        assert_eq!(nanos(&long_fraction, SECOND), Some(1_999_999_999));
        assert_eq!(duration(u128::MAX), None);
        assert_eq!(duration(1_500_000_000), Some(Duration::from_millis(1_500)));
    }

    #[test]
    fn counts() {
        assert_eq!(count("0"), Some(0));
        assert_eq!(count(" 60 "), Some(60));
        assert_eq!(count("18446744073709551615"), Some(u64::MAX));
        for s in [
            "",
            "-1",
            "+1",
            "1.0",
            "1e3",
            "18446744073709551616",
            "1 000",
            "٣",
        ] {
            assert_eq!(count(s), None, "{s:?}");
        }
    }
}
