//! Parsers for the wait hints providers send: reset headers, the Retry-After family, error
//! bodies.
//!
//! Every function is pure and total: malformed input gives `None`, never a panic, and the
//! current time is passed in where one is needed. Numbers are unsigned decimals
//! (`\d+(\.\d+)?`), so sentinels such as `-1` (Azure's "unknown"), `NaN`, `inf` or `1e309` give
//! `None`; fractions finer than a nanosecond are truncated. Every wait returned is at most
//! [`MAX_WAIT`]: a well-formed value above it is **clamped** to it, not rejected, so a caller
//! comparing with its own ceiling still sees "too long".
//!
//! | Source | Example | Parser |
//! |---|---|---|
//! | `x-ratelimit-reset-*` (OpenAI) | `6m0s`, `12ms` | [`go_duration`], [`reset_duration`] |
//! | `x-ratelimit-reset-*` (Azure, Cerebras) | `37` | [`reset_duration`] |
//! | `x-ratelimit-{limit,remaining}-*` | `149984`, `-1` | [`count`] |
//! | `anthropic-ratelimit-*-reset` | `2025-02-24T22:25:47Z` | [`rfc3339`], then [`until`] |
//! | `anthropic-ratelimit-unified-reset` | `1767225600` | [`epoch_seconds`], then [`until`] |
//! | `retry-after-ms`, `x-ms-retry-after-ms`, `retry-after` | `20.5`, `00:00:00.033`, `60` | [`retry_after`] |
//! | A 429 body (Gemini, Azure, OpenAI) | `"retryDelay":"36s"` | [`body_retry_delay`] |
//!
//! # Example
//!
//! ```
//! use std::time::{Duration, SystemTime};
//! use http::HeaderMap;
//! use tower_llm_quota::parse;
//!
//! let mut headers = HeaderMap::new();
//! headers.insert("x-ratelimit-reset-tokens", "6m0s".parse().unwrap());
//! headers.insert("retry-after", "1.5".parse().unwrap());
//! let reset = headers
//!     .get("x-ratelimit-reset-tokens")
//!     .and_then(|v| v.to_str().ok())
//!     .and_then(parse::reset_duration);
//! assert_eq!(reset, Some(Duration::from_secs(360)));
//! let wait = parse::retry_after(&headers, SystemTime::now())
//!     .or_else(|| parse::body_retry_delay(br#"{"error":{"message":"..."}}"#));
//! assert_eq!(wait, Some(Duration::from_millis(1_500)));
//! ```

mod body;
mod duration;
mod instant;
mod number;
mod retry_after;

pub use body::body_retry_delay;
pub use duration::{go_duration, reset_duration, timespan};
pub use instant::{epoch_seconds, rfc3339, until};
pub use number::{MAX_WAIT, count};
pub use retry_after::retry_after;
