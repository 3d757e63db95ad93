//! The usage scanner and the provider header parsing on arbitrary bytes: no panic, and the
//! scanner's memory stays bounded whatever the input (libFuzzer's `-rss_limit_mb` catches an
//! unbounded allocation).
#![no_main]

use std::time::UNIX_EPOCH;

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tower_llm_quota::provider::Profile;
use tower_llm_quota::usage::{UsageScanner, WireFormat};

fuzz_target!(|data: &[u8]| {
    let formats = [
        WireFormat::OpenAiChat,
        WireFormat::OpenAiResponses,
        WireFormat::Anthropic,
        WireFormat::Gemini,
    ];
    // The first byte chooses how the rest is split into frames.
    let (split, body) = data.split_first().map_or((1, data), |(s, b)| (*s as usize + 1, b));
    for format in formats {
        for streaming in [false, true] {
            let mut scanner = UsageScanner::new(format, streaming);
            for chunk in body.chunks(split) {
                scanner.data(chunk);
            }
            if let Some(raw) = scanner.usage() {
                let _ = Profile::openai().usage(&raw);
                let _ = Profile::anthropic().usage(&raw);
            }
            let _ = scanner.streamed_chars();
        }
    }
    if let Ok(value) = HeaderValue::from_bytes(body) {
        let mut headers = HeaderMap::new();
        for name in [
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
            "anthropic-ratelimit-tokens-remaining",
            "anthropic-ratelimit-tokens-reset",
        ] {
            headers.insert(name, value.clone());
        }
        for profile in [Profile::openai(), Profile::azure_openai(), Profile::anthropic()] {
            for report in profile.limits(&headers, UNIX_EPOCH) {
                assert!(report.reset.is_none_or(|r| r <= tower_llm_quota::parse::MAX_WAIT));
            }
        }
    }
});
