//! The audit log: one JSON line per request and per admin change, written by a thread of its
//! own every tenth of a second (stdout, or a file the platform rotates), so that a slow disk
//! or a full pipe never holds a request: past 8 MiB waiting, lines are dropped and counted
//! (`gateway_audit_dropped_total`).
//!
//! A request's line, once its answer's body ends (or at once for a refusal):
//!
//! ```json
//! {"time":"2026-12-03T17:41:00.123Z","request_id":"9f1c...","tenant":"acme/search",
//!  "key":"acme-search-web","api":"chat","model":"gpt-4o-mini","class":"interactive",
//!  "account":"openai-sim","provider":"openai","route":"openai-sim","fallback":null,
//!  "decision":"admitted","status":200,"service_tier":"standard",
//!  "estimated":{"input":9,"output":20},"used":{"input":9,"output":14,"cached":0},
//!  "attempts":1,"queue_ms":0.0,"call_ms":41.2,"duration_ms":43.0,"bytes":512}
//! ```
//!
//! A refusal says who decided (`"decision": "local"` or `"provider"`), its `limit`, `scope` and
//! `reason`; a provider's also its raw `provider_status`, `provider_error` (the body's error
//! type or code) and its rate-limit headers (`rate_limit_headers`). The key's name is logged,
//! never the key.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::Value;

/// Bytes waiting for the writer at most (about 30,000 lines); past them, lines are dropped and
/// counted.
const BACKLOG: usize = 8 << 20;

/// How often the writer takes what waits: the longest a line waits before its write.
const FLUSH_EVERY: Duration = Duration::from_millis(100);

/// Where the audit lines go.
#[derive(Debug, Clone, Default)]
pub(crate) enum Audit {
    /// Nowhere.
    #[default]
    Off,
    /// Into the buffer the writer thread takes every [`FLUSH_EVERY`].
    Lines(Arc<Lines>),
}

/// The lines waiting, and where they go.
pub(crate) struct Lines {
    waiting: Mutex<Vec<u8>>,
    out: Mutex<Box<dyn Write + Send>>,
}

impl std::fmt::Debug for Lines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lines").finish_non_exhaustive()
    }
}

impl Lines {
    /// Writes what waits, at once.
    fn flush(&self, batch: &mut Vec<u8>) {
        std::mem::swap(
            &mut *self.waiting.lock().unwrap_or_else(|e| e.into_inner()),
            batch,
        );
        if !batch.is_empty() {
            let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
            let _ = out.write_all(batch).and_then(|()| out.flush());
            batch.clear();
        }
    }
}

impl Audit {
    /// The audit log of `target`: `off`, `stdout`, or a file path (appended to; created when
    /// missing).
    pub(crate) fn open(target: &str) -> std::io::Result<Self> {
        let out: Box<dyn Write + Send> = match target {
            "off" => return Ok(Self::Off),
            "stdout" => Box::new(std::io::stdout()),
            path => Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?,
            ),
        };
        let lines = Arc::new(Lines {
            waiting: Mutex::new(Vec::new()),
            out: Mutex::new(out),
        });
        let writer = Arc::downgrade(&lines);
        // No wake-up a line: the writer takes the lines that wait every tenth of a second and
        // writes them at once, so that a busy gateway makes one write of a few hundred lines.
        // It ends with the gateway; `flush` writes what waits at the end.
        std::thread::Builder::new()
            .name("audit-log".into())
            .spawn(move || {
                let mut batch = Vec::new();
                loop {
                    std::thread::sleep(FLUSH_EVERY);
                    let Some(lines) = writer.upgrade() else {
                        return;
                    };
                    lines.flush(&mut batch);
                }
            })?;
        Ok(Self::Lines(lines))
    }

    /// Writes what waits now (when the gateway stops).
    #[allow(
        dead_code,
        reason = "called by main.rs and the tests; the load generator never stops a gateway"
    )]
    pub(crate) fn flush(&self) {
        if let Self::Lines(lines) = self {
            lines.flush(&mut Vec::new());
        }
    }

    /// Writes `record` as one line, unless the log is off or its backlog is full.
    pub(crate) fn write(&self, record: &impl Serialize) {
        let Self::Lines(lines) = self else {
            return;
        };
        let Ok(mut line) = serde_json::to_vec(record) else {
            return;
        };
        line.push(b'\n');
        let mut waiting = lines.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if waiting.len() + line.len() > BACKLOG {
            drop(waiting);
            metrics::counter!("gateway_audit_dropped_total").increment(1);
            return;
        }
        waiting.extend_from_slice(&line);
    }
}

/// One request, as the audit log records it.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Entry {
    pub(crate) time: String,
    pub(crate) request_id: String,
    pub(crate) tenant: Option<String>,
    pub(crate) key: Option<String>,
    pub(crate) api: &'static str,
    pub(crate) model: Option<String>,
    pub(crate) class: Option<&'static str>,
    pub(crate) account: Option<String>,
    pub(crate) provider: Option<&'static str>,
    pub(crate) route: Option<String>,
    pub(crate) fallback: Option<&'static str>,
    /// `admitted`, `local` or `provider`.
    pub(crate) decision: &'static str,
    pub(crate) status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) limit: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) scope: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) provider_status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) provider_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) rate_limit_headers: Option<serde_json::Map<String, Value>>,
    pub(crate) service_tier: Option<&'static str>,
    pub(crate) estimated: Option<Tokens>,
    /// What a hard cap did to the request's output bound (as `x-llm-quota-output-bound`
    /// says it): `4096; written`, `120; lowered; limit=...; scope=...`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) output_bound: Option<String>,
    pub(crate) used: Option<Tokens>,
    /// What the answer cost in nano-dollars (10⁻⁹ USD), as its reservation settled it: its
    /// usage at its model's and tier's prices (with `[prices]` configured).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) spend_nano_usd: Option<u64>,
    /// The usage's tokens by the kind each is priced as, for the spend export.
    #[serde(skip)]
    pub(crate) priced: Option<tower_llm_quota::pricing::PricedTokens>,
    pub(crate) attempts: Option<u32>,
    pub(crate) queue_ms: Option<f64>,
    pub(crate) call_ms: Option<f64>,
    pub(crate) duration_ms: f64,
    pub(crate) bytes: u64,
}

/// Tokens of a request: estimated before, or used as the provider reported.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct Tokens {
    pub(crate) input: u64,
    pub(crate) output: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) cached: Option<u64>,
}

/// An admin change, as the audit log records it.
#[derive(Debug, Serialize)]
pub(crate) struct AdminEntry<'a> {
    pub(crate) time: String,
    /// The admin token's name: `admin` for `server.admin_token`, else its `[[admins]]` name.
    pub(crate) admin: &'a str,
    pub(crate) action: &'static str,
    pub(crate) target: &'a str,
    pub(crate) before: Value,
    pub(crate) after: Value,
}

/// A request's audit line under way: its entry, and when it started.
#[derive(Debug)]
pub(crate) struct Audited {
    pub(crate) entry: Entry,
    /// When the gateway had the request's head.
    pub(crate) started: std::time::Instant,
    /// The prices the answer's request was reserved at (from its response), to price its
    /// usage as the budget settles it.
    pub(crate) prices: Option<tower_llm_quota::pricing::Priced>,
    /// The caller's trace context, for the request's span (set by the handler that has it).
    #[cfg(feature = "otel")]
    pub(crate) parent: Option<opentelemetry::Context>,
}

impl Audited {
    /// The line of a request of `api` with `headers`, starting now.
    pub(crate) fn new(api: super::config::Api, headers: &http::HeaderMap) -> Self {
        Self {
            entry: Entry {
                request_id: request_id(headers),
                api: api.as_str(),
                decision: "admitted",
                ..Entry::default()
            },
            started: std::time::Instant::now(),
            prices: None,
            #[cfg(feature = "otel")]
            parent: None,
        }
    }

    /// Records what a provider's refusing answer said: its status, error type and rate-limit
    /// headers.
    pub(crate) fn provider_said(&mut self, head: &http::Response<()>, body: &[u8]) {
        self.entry.provider_status = Some(head.status().as_u16());
        self.entry.provider_error = provider_error(body);
        let headers = rate_limit_headers(head.headers());
        self.entry.rate_limit_headers = (!headers.is_empty()).then_some(headers);
    }
}

/// Milliseconds, to the microsecond.
pub(crate) fn millis(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 1e6).round() / 1e3
}

/// `now` as RFC 3339 in UTC, to the millisecond: `2026-12-03T17:41:00.123Z`.
pub(crate) fn rfc3339(now: SystemTime) -> String {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil from days (Howard Hinnant's algorithm), for the proleptic Gregorian calendar.
    let z = i64::try_from(days).unwrap_or(i64::MAX) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60,
        since.subsec_millis()
    )
}

/// A request id: the caller's `x-request-id` when it is a short printable token, else a new
/// random one.
pub(crate) fn request_id(headers: &http::HeaderMap) -> String {
    let given = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            (1..=128).contains(&v.len()) && v.bytes().all(|b| b.is_ascii_graphic() && b != b'"')
        });
    match given {
        Some(id) => id.to_owned(),
        None => format!("{:016x}{:016x}", rand_u64(), rand_u64()),
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // A fresh random state per call: the standard library seeds it from the system.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64,
    );
    hasher.finish()
}

/// A provider error's type or code, from its body (`error.type`, else `error.code`).
pub(crate) fn provider_error(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let error = value.get("error")?;
    let field = |name: &str| error.get(name).and_then(Value::as_str).map(str::to_owned);
    field("type").or_else(|| field("code"))
}

/// The rate-limit headers of a provider's answer (`x-ratelimit-*`, `anthropic-ratelimit-*`,
/// `retry-after*`), as a JSON object.
pub(crate) fn rate_limit_headers(headers: &http::HeaderMap) -> serde_json::Map<String, Value> {
    headers
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            name.starts_with("x-ratelimit-")
                || name.starts_with("anthropic-ratelimit-")
                || name.starts_with("retry-after")
        })
        .filter_map(|(name, value)| {
            Some((name.as_str().to_owned(), Value::from(value.to_str().ok()?)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_in_utc() {
        let at = |secs: u64, millis: u64| {
            rfc3339(UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_millis(millis))
        };
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(951_782_400, 5), "2000-02-29T00:00:00.005Z");
        assert_eq!(at(1_796_319_660, 123), "2026-12-03T17:41:00.123Z");
        assert_eq!(at(4_107_542_399, 999), "2100-02-28T23:59:59.999Z");
    }

    #[test]
    fn a_callers_request_id_is_kept_when_it_is_a_short_token() {
        let mut headers = http::HeaderMap::new();
        let generated = request_id(&headers);
        assert_eq!(generated.len(), 32);
        assert_ne!(generated, request_id(&headers));
        headers.insert("x-request-id", "req-42".parse().unwrap());
        assert_eq!(request_id(&headers), "req-42");
        headers.insert("x-request-id", "a b".parse().unwrap());
        assert_eq!(request_id(&headers).len(), 32);
    }
}
