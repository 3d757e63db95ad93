//! Every wait-hint parser on arbitrary bytes: none may panic, every wait is at most `MAX_WAIT`.
#![no_main]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tower_llm_quota::parse;

fuzz_target!(|data: &[u8]| {
    let mut waits = vec![parse::body_retry_delay(data)];
    if let Ok(s) = std::str::from_utf8(data) {
        waits.extend([
            parse::go_duration(s),
            parse::reset_duration(s),
            parse::timespan(s),
        ]);
        let _ = (parse::count(s), parse::epoch_seconds(s));
        if let Some(at) = parse::rfc3339(s) {
            waits.push(Some(parse::until(at, UNIX_EPOCH)));
        }
    }
    if let Ok(value) = HeaderValue::from_bytes(data) {
        // Each header alone, then all three at once.
        let names = ["retry-after-ms", "x-ms-retry-after-ms", "retry-after"];
        let mut all = HeaderMap::new();
        for name in names {
            let mut one = HeaderMap::new();
            one.insert(name, value.clone());
            all.insert(name, value.clone());
            waits.push(parse::retry_after(&one, UNIX_EPOCH));
        }
        let now = UNIX_EPOCH + Duration::from_secs(1_792_567_680);
        waits.push(parse::retry_after(&all, now));
        waits.push(parse::retry_after(&all, SystemTime::now()));
    }
    for wait in waits.into_iter().flatten() {
        assert!(wait <= parse::MAX_WAIT, "{wait:?}");
    }
});
