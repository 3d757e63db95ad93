//! The wait-hint parsers against the test vectors of the provider notes, the precedence of the
//! Retry-After family, malformed values, and properties: no input panics, every wait is at most
//! `MAX_WAIT`, and formatted durations parse back exactly.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::parse::{
    self, MAX_WAIT, body_retry_delay, count, epoch_seconds, go_duration, reset_duration,
    retry_after, rfc3339, timespan, until,
};
use http::{HeaderMap, HeaderValue};
use proptest::prelude::*;

fn secs(s: u64) -> Option<Duration> {
    Some(Duration::from_secs(s))
}

fn nanos(n: u64) -> Option<Duration> {
    Some(Duration::from_nanos(n))
}

fn at(unix: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(unix)
}

/// `Wed, 21 Oct 2026 07:28:00 GMT`.
const OCT_21_2026: u64 = 1_792_567_680;

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for &(name, value) in pairs {
        map.append(name, HeaderValue::from_str(value).unwrap());
    }
    map
}

fn wait(pairs: &[(&'static str, &str)]) -> Option<Duration> {
    retry_after(&headers(pairs), at(OCT_21_2026 - 90))
}

// ---------------------------------------------------------------------------------------------
// The test vectors of the provider notes.

#[test]
fn vectors_reset_durations() {
    assert_eq!(reset_duration("6m0s"), secs(360));
    assert_eq!(reset_duration("12ms"), nanos(12_000_000));
    assert_eq!(reset_duration("1.28s"), nanos(1_280_000_000));
    assert_eq!(reset_duration("1h2m3.5s"), nanos(3_723_500_000_000));
    assert_eq!(reset_duration("37"), secs(37)); // Azure
    assert_eq!(reset_duration("0"), secs(0)); // Azure Responses API
    assert_eq!(go_duration("6m0s"), secs(360));
    assert_eq!(go_duration("250ms"), nanos(250_000_000));
    assert_eq!(go_duration("0s"), secs(0));
    assert_eq!(go_duration("9ms"), nanos(9_000_000));
}

#[test]
fn vectors_counts() {
    assert_eq!(count("150000"), Some(150_000));
    assert_eq!(count("-1"), None); // Azure: unknown
}

#[test]
fn vectors_anthropic_resets() {
    let reset = rfc3339("2025-02-24T22:25:47Z");
    assert_eq!(reset, Some(at(1_740_435_947)));
    assert_eq!(rfc3339("2025-08-21T12:40:59Z"), Some(at(1_755_780_059)));
    let unified = epoch_seconds("1767225600");
    assert_eq!(unified, Some(at(1_767_225_600)));
    let now = at(1_740_435_900);
    assert_eq!(reset.map(|r| until(r, now)), secs(47));
}

#[test]
fn vectors_retry_after() {
    assert_eq!(wait(&[("retry-after", "60")]), secs(60));
    assert_eq!(wait(&[("retry-after", "1.5")]), nanos(1_500_000_000));
    assert_eq!(
        wait(&[("retry-after", "Wed, 21 Oct 2026 07:28:00 GMT")]),
        secs(90)
    );
    assert_eq!(
        wait(&[("retry-after-ms", "20.5")]),
        nanos(20_500_000) // 0.0205 s
    );
    assert_eq!(
        wait(&[("retry-after-ms", "1500")]),
        secs(1).map(|s| s * 3 / 2)
    );
    assert_eq!(
        wait(&[("x-ms-retry-after-ms", "00:00:00.033")]),
        nanos(33_000_000)
    );
    assert_eq!(wait(&[("x-ms-retry-after-ms", "100")]), nanos(100_000_000));
}

#[test]
fn vectors_http_date_relative_to_now() {
    let date = headers(&[("retry-after", "Wed, 21 Oct 2026 07:28:00 GMT")]);
    assert_eq!(retry_after(&date, at(OCT_21_2026)), secs(0));
    assert_eq!(retry_after(&date, at(OCT_21_2026 + 3_600)), secs(0));
    assert_eq!(retry_after(&date, at(OCT_21_2026 - 1)), secs(1));
    let just_before = at(OCT_21_2026) - Duration::from_millis(250);
    assert_eq!(retry_after(&date, just_before), nanos(250_000_000));
    assert_eq!(retry_after(&date, UNIX_EPOCH), Some(MAX_WAIT));
    // The obsolete forms RFC 9110 still asks recipients to accept.
    for obsolete in [
        "Wednesday, 21-Oct-26 07:28:00 GMT",
        "Wed Oct 21 07:28:00 2026",
    ] {
        let map = headers(&[("retry-after", obsolete)]);
        assert_eq!(
            retry_after(&map, at(OCT_21_2026 - 5)),
            secs(5),
            "{obsolete}"
        );
    }
}

#[test]
fn vectors_gemini_retry_delay() {
    let detail =
        br#"{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"3.957525076s"}"#;
    assert_eq!(body_retry_delay(detail), nanos(3_957_525_076));
    let body = br#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED",
 "message":"You exceeded your current quota ... Please retry in 36.123s.",
 "details":[
  {"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[
     {"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests",
      "quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
      "quotaDimensions":{"location":"global","model":"gemini-2.5-flash"}}]},
  {"@type":"type.googleapis.com/google.rpc.Help","links":[{"url":"https://ai.google.dev/gemini-api/docs/rate-limits"}]},
  {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"36s"}]}}"#;
    assert_eq!(body_retry_delay(body), secs(36));
    assert_eq!(
        body_retry_delay(br#"{"@type":"x.RetryInfo","retryDelay":"56s"}"#),
        secs(56)
    );
}

#[test]
fn vectors_body_prose() {
    assert_eq!(
        body_retry_delay(b"Please retry after 37 seconds."),
        secs(37)
    );
    assert_eq!(
        body_retry_delay(b"Please retry in 27.372244281s"),
        nanos(27_372_244_281)
    );
    let daily = br#"{"error":{"code":"429","message":"Requests to the ChatCompletions_Create Operation have exceeded call rate limit. Please retry after 86400 seconds."}}"#;
    assert_eq!(body_retry_delay(daily), secs(86_400));
}

// ---------------------------------------------------------------------------------------------
// Precedence of the Retry-After family.

#[test]
fn retry_after_ms_comes_first() {
    let all = [
        ("retry-after", "60"),
        ("x-ms-retry-after-ms", "2000"),
        ("retry-after-ms", "1500"),
    ];
    assert_eq!(wait(&all), nanos(1_500_000_000));
}

#[test]
fn x_ms_retry_after_ms_comes_second() {
    let both = [("retry-after", "60"), ("x-ms-retry-after-ms", "00:00:02")];
    assert_eq!(wait(&both), secs(2));
    let date = [
        ("retry-after", "Wed, 21 Oct 2026 07:28:00 GMT"),
        ("x-ms-retry-after-ms", "0"),
    ];
    assert_eq!(wait(&date), secs(0));
}

#[test]
fn malformed_headers_fall_through() {
    let bad_ms = [
        ("retry-after-ms", "-1"),
        ("x-ms-retry-after-ms", "NaN"),
        ("retry-after", "60"),
    ];
    assert_eq!(wait(&bad_ms), secs(60));
    let bad_first = [("retry-after-ms", "inf"), ("x-ms-retry-after-ms", "250")];
    assert_eq!(wait(&bad_first), nanos(250_000_000));
    let all_bad = [
        ("retry-after-ms", "1e309"),
        ("x-ms-retry-after-ms", "-00:00:01"),
        ("retry-after", "soon"),
    ];
    assert_eq!(wait(&all_bad), None);
    let conflicting = [
        ("retry-after-ms", "100"),
        ("retry-after-ms", "200"),
        ("retry-after", "3"),
    ];
    assert_eq!(wait(&conflicting), secs(3));
}

#[test]
fn zero_is_a_valid_first_answer() {
    let zero = [("retry-after-ms", "0"), ("retry-after", "60")];
    assert_eq!(wait(&zero), secs(0));
}

#[test]
fn header_names_are_case_insensitive() {
    let mut map = HeaderMap::new();
    map.insert("Retry-After-Ms", HeaderValue::from_static("5"));
    assert_eq!(retry_after(&map, UNIX_EPOCH), nanos(5_000_000));
}

// ---------------------------------------------------------------------------------------------
// Malformed values and sentinels.

const MALFORMED: [&str; 24] = [
    "", " ", "-1", "-0.5", "+1", "NaN", "nan", "inf", "-inf", "Infinity", "1e309", "1E3", "0x10",
    ".5", "5.", "1,5", "60, 60", "60 60", "1 000", "٣", "６０", "1.2.3", "null", "\u{0}",
];

#[test]
fn malformed_values_give_none() {
    for s in MALFORMED {
        assert_eq!(go_duration(s), None, "go_duration({s:?})");
        assert_eq!(reset_duration(s), None, "reset_duration({s:?})");
        assert_eq!(timespan(s), None, "timespan({s:?})");
        assert_eq!(rfc3339(s), None, "rfc3339({s:?})");
        assert_eq!(epoch_seconds(s), None, "epoch_seconds({s:?})");
        assert_eq!(count(s), None, "count({s:?})");
        assert_eq!(body_retry_delay(s.as_bytes()), None, "body({s:?})");
        if let Ok(value) = HeaderValue::from_str(s) {
            let mut map = HeaderMap::new();
            for name in ["retry-after-ms", "x-ms-retry-after-ms", "retry-after"] {
                map.insert(name, value.clone());
            }
            assert_eq!(retry_after(&map, UNIX_EPOCH), None, "retry_after({s:?})");
        }
    }
}

#[test]
fn huge_values_clamp() {
    let huge = "9".repeat(500);
    assert_eq!(reset_duration(&huge), Some(MAX_WAIT));
    assert_eq!(go_duration(&format!("{huge}h")), Some(MAX_WAIT));
    assert_eq!(wait(&[("retry-after", &huge)]), Some(MAX_WAIT));
    assert_eq!(wait(&[("retry-after-ms", &huge)]), Some(MAX_WAIT));
    assert_eq!(wait(&[("retry-after", "604801")]), Some(MAX_WAIT));
    assert_eq!(wait(&[("retry-after", "604799")]), secs(604_799));
    let body = format!(r#"{{"@type":"RetryInfo","retryDelay":"{huge}s"}}"#);
    assert_eq!(body_retry_delay(body.as_bytes()), Some(MAX_WAIT));
    assert_eq!(epoch_seconds(&huge), None); // an instant, not a wait: unrepresentable
    assert_eq!(count(&huge), None);
}

#[test]
fn not_ascii_header_values_are_skipped() {
    let mut map = HeaderMap::new();
    map.insert(
        "retry-after-ms",
        HeaderValue::from_bytes(b"\xc2\xb5").unwrap(),
    );
    map.insert(
        "retry-after",
        HeaderValue::from_bytes("１".as_bytes()).unwrap(),
    );
    assert_eq!(retry_after(&map, UNIX_EPOCH), None);
}

// ---------------------------------------------------------------------------------------------
// Properties.

/// Formats `d` as Go's `Duration.String` does.
fn go_string(d: Duration) -> String {
    fn fixed(value: u128, unit: u128, width: usize) -> String {
        let (int, rem) = (value / unit, value % unit);
        if rem == 0 {
            int.to_string()
        } else {
            let fraction = format!("{rem:0width$}");
            format!("{int}.{}", fraction.trim_end_matches('0'))
        }
    }
    let ns = d.as_nanos();
    match ns {
        0 => "0s".into(),
        1..=999 => format!("{ns}ns"),
        1_000..=999_999 => format!("{}µs", fixed(ns, 1_000, 3)),
        1_000_000..=999_999_999 => format!("{}ms", fixed(ns, 1_000_000, 6)),
        _ => {
            let (h, m) = (d.as_secs() / 3_600, d.as_secs() / 60 % 60);
            let s = format!("{}s", fixed(ns % 60_000_000_000, 1_000_000_000, 9));
            match (h, m) {
                (0, 0) => s,
                (0, m) => format!("{m}m{s}"),
                (h, m) => format!("{h}h{m}m{s}"),
            }
        }
    }
}

#[test]
fn go_string_matches_go() {
    // Outputs of Go's `time.Duration.String`.
    for (d, go) in [
        (Duration::ZERO, "0s"),
        (Duration::from_nanos(7), "7ns"),
        (Duration::from_nanos(1_500), "1.5µs"),
        (Duration::from_millis(12), "12ms"),
        (Duration::from_millis(1_280), "1.28s"),
        (Duration::from_secs(360), "6m0s"),
        (Duration::from_millis(3_723_500), "1h2m3.5s"),
    ] {
        assert_eq!(go_string(d), go);
        assert_eq!(go_duration(go), Some(d));
    }
}

/// Any wait up to [`MAX_WAIT`], to the nanosecond.
fn wait_strategy() -> impl Strategy<Value = Duration> {
    let max = u64::try_from(MAX_WAIT.as_nanos()).unwrap();
    prop_oneof![
        (0..=max).prop_map(Duration::from_nanos),
        (0..1_000_000_000u64).prop_map(Duration::from_nanos),
        (0..=MAX_WAIT.as_secs()).prop_map(Duration::from_secs),
    ]
}

/// Strings near the grammars: digits, separators, units, signs.
fn near_grammar() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[0-9.:+ eE-]{0,6}(h|m|s|ms|us|µs|μs|ns|x|)[0-9.:hmsun]{0,12}")
        .unwrap()
}

fn every_header(value: &HeaderValue) -> HeaderMap {
    let mut map = HeaderMap::new();
    for name in ["retry-after-ms", "x-ms-retry-after-ms", "retry-after"] {
        map.insert(name, value.clone());
    }
    map
}

/// Every parser on `s`: nothing panics, every wait is at most [`MAX_WAIT`].
fn check_str(s: &str) -> Result<(), TestCaseError> {
    for d in [
        go_duration(s),
        reset_duration(s),
        timespan(s),
        body_retry_delay(s.as_bytes()),
    ]
    .into_iter()
    .flatten()
    {
        prop_assert!(d <= MAX_WAIT, "{s:?} -> {d:?}");
    }
    let _ = (rfc3339(s), epoch_seconds(s), count(s));
    if let Ok(value) = HeaderValue::from_str(s) {
        let map = every_header(&value);
        for now in [UNIX_EPOCH, at(OCT_21_2026)] {
            if let Some(d) = retry_after(&map, now) {
                prop_assert!(d <= MAX_WAIT, "{s:?} -> {d:?}");
            }
        }
    }
    Ok(())
}

/// Howard Hinnant's `days_from_civil`: days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn no_string_panics(s in any::<String>()) {
        check_str(&s)?;
    }

    #[test]
    fn no_near_grammar_string_panics(s in near_grammar()) {
        check_str(&s)?;
    }

    #[test]
    fn no_bytes_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Some(d) = body_retry_delay(&bytes) {
            prop_assert!(d <= MAX_WAIT);
        }
        if let Ok(value) = HeaderValue::from_bytes(&bytes) {
            if let Some(d) = retry_after(&every_header(&value), at(OCT_21_2026)) {
                prop_assert!(d <= MAX_WAIT);
            }
        }
        if let Ok(s) = std::str::from_utf8(&bytes) {
            check_str(s)?;
        }
    }

    #[test]
    fn go_durations_round_trip(d in wait_strategy()) {
        prop_assert_eq!(go_duration(&go_string(d)), Some(d));
        prop_assert_eq!(reset_duration(&go_string(d)), Some(d));
        let spelled = format!("{}h{}m{}.{:09}s", d.as_secs() / 3_600, d.as_secs() / 60 % 60,
            d.as_secs() % 60, d.subsec_nanos());
        prop_assert_eq!(go_duration(&spelled), Some(d));
    }

    #[test]
    fn decimal_forms_round_trip(d in wait_strategy()) {
        let ns = d.as_nanos();
        let millis = format!("{}.{:06}", ns / 1_000_000, ns % 1_000_000);
        prop_assert_eq!(wait(&[("retry-after-ms", &millis)]), Some(d));
        prop_assert_eq!(wait(&[("x-ms-retry-after-ms", &millis)]), Some(d));
        let seconds = format!("{}.{:09}", d.as_secs(), d.subsec_nanos());
        prop_assert_eq!(wait(&[("retry-after", &seconds)]), Some(d));
        prop_assert_eq!(reset_duration(&seconds), Some(d));
        let proto = format!(r#"{{"@type":"RetryInfo","retryDelay":"{seconds}s"}}"#);
        prop_assert_eq!(body_retry_delay(proto.as_bytes()), Some(d));
        let s = d.as_secs();
        let span = format!("{}.{:02}:{:02}:{:02}.{:09}", s / 86_400, s / 3_600 % 24, s / 60 % 60,
            s % 60, d.subsec_nanos());
        prop_assert_eq!(timespan(&span), Some(d));
        let ms = format!("{}", ns / 1_000_000);
        prop_assert_eq!(wait(&[("retry-after-ms", &ms)]), Some(Duration::from_millis(d.as_millis() as u64)));
    }

    #[test]
    fn longer_waits_clamp(extra in 1..u64::MAX / 2) {
        let d = MAX_WAIT.saturating_add(Duration::from_nanos(extra));
        prop_assert_eq!(go_duration(&go_string(d)), Some(MAX_WAIT));
        let seconds = format!("{}.{:09}", d.as_secs(), d.subsec_nanos());
        prop_assert_eq!(wait(&[("retry-after", &seconds)]), Some(MAX_WAIT));
    }

    #[test]
    fn http_dates_round_trip(date in 0..253_402_300_799u64, now in 0..253_402_300_799u64) {
        let value = httpdate::fmt_http_date(at(date));
        let expected = Duration::from_secs(date.saturating_sub(now)).min(MAX_WAIT);
        prop_assert_eq!(wait_at(&value, at(now)), Some(expected));
        prop_assert_eq!(until(at(date), at(now)), expected);
    }

    #[test]
    fn rfc3339_matches_the_civil_calendar(
        year in 1970..=9999i64, month in 1..=12i64, day in 1..=28i64,
        hour in 0..24i64, minute in 0..60i64, second in 0..60i64,
        nanos in 0..1_000_000_000u32, digits in 1..=9usize,
        offset in -1_439..=1_439i64, zulu in any::<bool>(),
    ) {
        let offset = if zulu { 0 } else { offset };
        let zone = if zulu {
            "Z".to_string()
        } else {
            let sign = if offset < 0 { '-' } else { '+' };
            format!("{sign}{:02}:{:02}", offset.abs() / 60, offset.abs() % 60)
        };
        let fraction = format!("{nanos:09}")[..digits].to_string();
        let text = format!(
            "{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{fraction}{zone}"
        );
        let unix = days_from_civil(year, month, day) * 86_400 + hour * 3_600 + minute * 60
            + second - offset * 60;
        let kept = fraction.parse::<u32>().unwrap() * 10u32.pow(9 - digits as u32);
        let expected = if unix >= 0 {
            UNIX_EPOCH + Duration::new(unix as u64, kept)
        } else {
            UNIX_EPOCH - Duration::from_secs(unix.unsigned_abs()) + Duration::from_nanos(u64::from(kept))
        };
        prop_assert_eq!(rfc3339(&text), Some(expected), "{}", text);
        if unix >= 0 {
            let epoch = format!("{unix}.{fraction}");
            prop_assert_eq!(epoch_seconds(&epoch), Some(expected));
        }
    }
}

fn wait_at(retry_after_value: &str, now: SystemTime) -> Option<Duration> {
    let map = headers(&[("retry-after", retry_after_value)]);
    parse::retry_after(&map, now)
}
