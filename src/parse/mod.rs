//! Parsers for the wait hints providers send: reset headers, the Retry-After family, error
//! bodies. Private to the crate (the provider profiles and the retry layer read through them;
//! [`provider::retry_after`](crate::provider::retry_after) is public); public only to the fuzz
//! targets (`--cfg fuzzing`).
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
//! | `x-ratelimit-reset-*` (OpenAI) | `6m0s`, `12ms` | [`reset_duration`] (Go durations, read by `go_duration`) |
//! | `x-ratelimit-reset-*` (Azure, Cerebras) | `37` | [`reset_duration`] |
//! | `x-ratelimit-{limit,remaining}-*` | `149984`, `-1` | [`count`] |
//! | `anthropic-ratelimit-*-reset` | `2025-02-24T22:25:47Z` | [`rfc3339`], then [`until`] |
//! | `anthropic-ratelimit-unified-reset` | `1767225600` | `epoch_seconds` (tests and fuzzing only: no profile reads it yet), then [`until`] |
//! | `retry-after-ms`, `x-ms-retry-after-ms`, `retry-after` | `20.5`, `00:00:00.033`, `60` | [`retry_after`] |
//! | A 429 body (Gemini, Azure, OpenAI) | `"retryDelay":"36s"` | [`body_retry_delay`] |

// Its items are `pub` for the fuzz targets (`--cfg fuzzing`); elsewhere the crate alone reads
// them.
#![cfg_attr(not(fuzzing), allow(unreachable_pub))]

mod body;
mod duration;
mod instant;
mod number;
mod retry_after;

pub use body::body_retry_delay;
pub use duration::reset_duration;
#[cfg(any(test, fuzzing))]
pub use duration::{go_duration, timespan};
#[cfg(any(test, fuzzing))]
pub use instant::epoch_seconds;
pub use instant::{rfc3339, until};
pub use number::{MAX_WAIT, count};
pub use retry_after::retry_after;

#[cfg(test)]
mod tests;
