//! What a provider means by its numbers.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

use crate::budget::{Budget, Observation};
use crate::cost::Usage;
use crate::parse;
use crate::pricing::CacheCounting;
use crate::quota::{Dimension, Limit};
use crate::usage::{RawUsage, WireFormat};

const MINUTE: Duration = Duration::from_secs(60);
const DAY: Duration = Duration::from_secs(86_400);

/// A provider's conventions: the shape of its bodies, how its usage maps to the quota's
/// dimensions, which rate-limit headers it sends, and over which windows its limits count.
///
/// The windows come from the profile, never from a header's name: Groq's
/// `x-ratelimit-limit-requests` is per day, OpenAI's per minute.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_llm_quota::provider::{AdoptLimits, Profile};
///
/// let groq = Profile::openai_compatible(Duration::from_secs(86_400), Duration::from_secs(60));
/// let anthropic = Profile::anthropic().adopt_limits(AdoptLimits::Any);
/// # let _ = (groq, anthropic);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    kind: Kind,
    request_window: Duration,
    token_window: Duration,
    cache_reads_count: bool,
    adopt: AdoptLimits,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    OpenAiChat,
    OpenAiResponses,
    Azure,
    Anthropic,
    Gemini,
    Compatible,
}

/// Whether a limit a provider reports replaces the configured one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AdoptLimits {
    /// Never: the configured limits stand (for example when instances share a key and each
    /// is configured with its share).
    Never,
    /// Only when lower: a provider that lowers the quota without notice is followed within
    /// one response. The default.
    #[default]
    Lower,
    /// Whenever it differs.
    Any,
}

/// What a provider's headers say about one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitReport {
    /// The dimension.
    pub dimension: Dimension,
    /// The window the limit counts over.
    pub window: Duration,
    /// The limit, if sent (sentinels such as Azure's `-1` are unknown).
    pub limit: Option<u64>,
    /// What is left, if sent.
    pub remaining: Option<u64>,
    /// The time until the bucket is full again, if sent.
    pub reset: Option<Duration>,
}

const fn profile(kind: Kind, request_window: Duration, cache_reads_count: bool) -> Profile {
    Profile {
        kind,
        request_window,
        token_window: MINUTE,
        cache_reads_count,
        adopt: AdoptLimits::Lower,
    }
}

impl Profile {
    /// OpenAI Chat Completions: `usage.prompt_tokens` includes cached tokens, which count
    /// against TPM; `x-ratelimit-*` headers with Go-style resets, per minute.
    pub const fn openai() -> Self {
        profile(Kind::OpenAiChat, MINUTE, true)
    }

    /// OpenAI Responses: `response.usage`, same headers as [`Profile::openai`].
    pub const fn openai_responses() -> Self {
        profile(Kind::OpenAiResponses, MINUTE, true)
    }

    /// Azure OpenAI: Chat Completions bodies; `x-ratelimit-remaining-*` (and on newer
    /// deployments `limit` and `reset` in plain seconds), `-1` meaning unknown.
    pub const fn azure_openai() -> Self {
        profile(Kind::Azure, MINUTE, true)
    }

    /// Anthropic Messages: `usage.input_tokens` excludes cache reads and writes; cache writes
    /// count against input TPM, cache reads do not (on most models); `anthropic-ratelimit-*`
    /// headers with RFC 3339 resets, per minute.
    pub const fn anthropic() -> Self {
        profile(Kind::Anthropic, MINUTE, false)
    }

    /// Google Gemini: `usageMetadata`; no rate-limit headers.
    pub const fn gemini() -> Self {
        profile(Kind::Gemini, MINUTE, true)
    }

    /// An OpenAI-compatible server (vLLM, Groq, Together, ...): OpenAI bodies and header
    /// names, with the windows its limits really use (Groq: requests per day, tokens per
    /// minute).
    pub const fn openai_compatible(request_window: Duration, token_window: Duration) -> Self {
        Profile {
            token_window: crate::timer::capped(token_window),
            ..profile(Kind::Compatible, crate::timer::capped(request_window), true)
        }
    }

    /// Groq: an OpenAI-compatible server whose `requests` headers count per day and whose
    /// `tokens` headers count per minute.
    pub const fn groq() -> Self {
        Self::openai_compatible(DAY, MINUTE)
    }

    /// Whether a reported limit replaces the configured one. Defaults to
    /// [`AdoptLimits::Lower`].
    pub const fn adopt_limits(self, adopt: AdoptLimits) -> Self {
        Self { adopt, ..self }
    }

    /// Whether cached input tokens count against the input-token limit. Defaults to true,
    /// except for Anthropic.
    pub const fn cache_reads_count(self, count: bool) -> Self {
        Self {
            cache_reads_count: count,
            ..self
        }
    }

    /// Which cache tokens the input count of this profile's [`Usage`](crate::Usage) holds:
    /// the reads when they count against the input-token limit; the writes for Anthropic,
    /// which reports them apart from its input while they count against its limits, so the
    /// profile adds them. What [pricing](crate::pricing) takes apart again.
    pub const fn cache_counting(&self) -> CacheCounting {
        CacheCounting::new(
            self.cache_reads_count,
            matches!(self.wire_format(), WireFormat::Anthropic),
        )
    }

    /// The shape of this provider's bodies.
    pub const fn wire_format(&self) -> WireFormat {
        match self.kind {
            Kind::OpenAiChat | Kind::Azure | Kind::Compatible => WireFormat::OpenAiChat,
            Kind::OpenAiResponses => WireFormat::OpenAiResponses,
            Kind::Anthropic => WireFormat::Anthropic,
            Kind::Gemini => WireFormat::Gemini,
        }
    }

    /// A short name, for logs and labels.
    pub const fn name(&self) -> &'static str {
        match self.kind {
            Kind::OpenAiChat | Kind::OpenAiResponses => "openai",
            Kind::Azure => "azure_openai",
            Kind::Anthropic => "anthropic",
            Kind::Gemini => "gemini",
            Kind::Compatible => "openai_compatible",
        }
    }

    /// The usage to settle with: what counts against each dimension. `None` when the
    /// provider reported neither input nor output.
    ///
    /// Input tokens charged: OpenAI-style prompt counts include cached tokens, which are
    /// removed unless cache reads count; Anthropic's input excludes the cache, so cache writes
    /// are added, and cache reads only if they count. Output includes reasoning tokens.
    pub fn usage(&self, raw: &RawUsage) -> Option<Usage> {
        if !raw.is_resolved() {
            return None;
        }
        let (cache_read, cache_write) = (raw.cache_read.unwrap_or(0), raw.cache_write.unwrap_or(0));
        let reported = raw.input.unwrap_or(0);
        let input = match self.wire_format() {
            WireFormat::Anthropic => {
                let reads = if self.cache_reads_count {
                    cache_read
                } else {
                    0
                };
                reported.saturating_add(cache_write).saturating_add(reads)
            }
            _ if self.cache_reads_count => reported,
            _ => reported.saturating_sub(cache_read),
        };
        Some(
            Usage::new(input, raw.output.unwrap_or(0))
                .with_cache_read_tokens(cache_read)
                .with_cache_write_tokens(cache_write),
        )
    }

    /// What the rate-limit headers of a response say, one report per dimension they name.
    /// Missing, malformed and sentinel values are left out, never a panic.
    pub fn limits(&self, headers: &HeaderMap, now: SystemTime) -> Vec<LimitReport> {
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let report = |dimension, window, limit: &str, remaining: &str, reset: &str| {
            let report = LimitReport {
                dimension,
                window,
                limit: text(limit).and_then(parse::count).filter(|&n| n > 0),
                remaining: text(remaining).and_then(parse::count),
                reset: text(reset).and_then(|v| {
                    parse::reset_duration(v)
                        .or_else(|| parse::rfc3339(v).map(|at| parse::until(at, now)))
                }),
            };
            (report.limit.is_some() || report.remaining.is_some()).then_some(report)
        };
        let reports: Vec<Option<LimitReport>> = match self.kind {
            Kind::Gemini => Vec::new(),
            Kind::Anthropic => [
                (Dimension::Requests, "requests"),
                (Dimension::TotalTokens, "tokens"),
                (Dimension::InputTokens, "input-tokens"),
                (Dimension::OutputTokens, "output-tokens"),
            ]
            .into_iter()
            .map(|(dimension, name)| {
                let window = if dimension == Dimension::Requests {
                    self.request_window
                } else {
                    self.token_window
                };
                report(
                    dimension,
                    window,
                    &format!("anthropic-ratelimit-{name}-limit"),
                    &format!("anthropic-ratelimit-{name}-remaining"),
                    &format!("anthropic-ratelimit-{name}-reset"),
                )
            })
            .collect(),
            _ => vec![
                report(
                    Dimension::Requests,
                    self.request_window,
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                ),
                report(
                    Dimension::TotalTokens,
                    self.token_window,
                    "x-ratelimit-limit-tokens",
                    "x-ratelimit-remaining-tokens",
                    "x-ratelimit-reset-tokens",
                ),
            ],
        };
        reports.into_iter().flatten().collect()
    }

    /// Feeds a response's rate-limit headers back into `budget`: lowers the level of every
    /// limit the provider says has less left than we hold (someone else spends the same
    /// quota), lets an adaptive limit spend what the provider holds beyond its own burst
    /// ([`AdaptiveShare::spend_reported_burst`](crate::budget::AdaptiveShare::spend_reported_burst);
    /// not for Azure OpenAI, which enforces its minute over seconds too), and adopts changed
    /// limits as [`AdoptLimits`] says.
    ///
    /// Each report is applied to the budget's limit it describes ([`LimitReport::describes`]):
    /// of the same dimension, and the one whose nominal amount is the reported limit, else
    /// whose period is the window the provider's own numbers imply, else whose period is the
    /// profile's window. A report matching no limit is ignored.
    pub fn adapt(&self, headers: &HeaderMap, budget: &Budget) {
        let reports = self.limits(headers, SystemTime::now());
        if reports.is_empty() {
            return;
        }
        let configured: Vec<Limit> = budget
            .snapshot()
            .limits()
            .iter()
            .map(|l| *l.limit())
            .collect();
        for report in reports {
            let Some(current) = report.describes(&configured) else {
                tracing::trace!(?report, "rate-limit report matches no limit of the budget");
                continue;
            };
            // Azure enforces its per-minute limits over seconds too: its remaining is not a
            // bucket to spend at once.
            let mut observation = Observation::new(report.dimension, current.period())
                .spendable_at_once(self.kind != Kind::Azure);
            if let Some(remaining) = report.remaining {
                observation = observation.with_remaining(remaining);
            }
            let old = current.amount().get();
            let adopt = match (self.adopt, report.limit) {
                (AdoptLimits::Never, _) | (_, None) => None,
                (AdoptLimits::Lower, Some(new)) => (new < old).then_some(new),
                (AdoptLimits::Any, Some(new)) => (new != old).then_some(new),
            };
            if let Some(limit) = adopt.and_then(std::num::NonZeroU64::new) {
                tracing::debug!(dimension = %report.dimension, limit, "provider limit adopted");
                observation = observation.with_limit(limit);
            }
            tracing::trace!(?observation, "rate-limit headers applied to the budget");
            budget.observe(&observation);
        }
    }

    /// The windows this profile assumes for the provider's request and token limits when the
    /// headers alone cannot tell: for a provider whose minute is not 60 s (a simulator with a
    /// compressed minute) or whose limits count per day. Defaults: a minute for both, except
    /// Groq (requests per day).
    pub const fn windows(self, request_window: Duration, token_window: Duration) -> Self {
        Self {
            request_window: crate::timer::capped(request_window),
            token_window: crate::timer::capped(token_window),
            ..self
        }
    }

    /// The window assumed for request limits.
    pub const fn request_window(&self) -> Duration {
        self.request_window
    }

    /// The window assumed for token limits.
    pub const fn token_window(&self) -> Duration {
        self.token_window
    }
}

impl LimitReport {
    /// The window the provider's own numbers imply, for a token bucket: its reset is the time
    /// until the bucket is full again, so it refills `limit - remaining` in `reset`, and a whole
    /// `limit` in `reset × limit / (limit - remaining)`. `None` when they cannot say (nothing
    /// spent, no reset, no limit).
    pub fn implied_window(&self) -> Option<Duration> {
        let (limit, remaining, reset) = (self.limit?, self.remaining?, self.reset?);
        if remaining >= limit || reset.is_zero() {
            return None;
        }
        let window = reset.as_secs_f64() * limit as f64 / (limit - remaining) as f64;
        Duration::try_from_secs_f64(window).ok()
    }

    /// The limit among `limits` this report describes: of its dimension, the one whose
    /// nominal amount is the reported limit; else the one whose period is within a factor of
    /// two of the [implied window](Self::implied_window) (the closest); else the one whose
    /// period is the profile's window for the dimension. A window set in the profile is
    /// a fallback, so a compressed minute, a day window or any provider's period works as long
    /// as the headers carry a limit and a reset.
    pub fn describes(&self, limits: &[Limit]) -> Option<Limit> {
        let candidates = || limits.iter().filter(|l| l.dimension() == self.dimension);
        if let Some(amount) = self.limit {
            let same: Vec<&Limit> = candidates()
                .filter(|l| l.amount().get() == amount)
                .collect();
            match same.as_slice() {
                [one] => return Some(**one),
                [] => {}
                many => {
                    let by_window = many.iter().find(|l| l.period() == self.window);
                    return Some(**by_window.unwrap_or(&many[0]));
                }
            }
        }
        if let Some(implied) = self.implied_window() {
            let distance = |l: &Limit| {
                (l.period().as_secs_f64() / implied.as_secs_f64())
                    .ln()
                    .abs()
            };
            let closest = candidates()
                .filter(|l| distance(l) <= std::f64::consts::LN_2)
                .min_by(|a, b| distance(a).total_cmp(&distance(b)));
            if let Some(closest) = closest {
                return Some(*closest);
            }
        }
        candidates().find(|l| l.period() == self.window).copied()
    }
}

/// The rate-limit reports of a response from whichever provider sent it (OpenAI-style and
/// Anthropic headers; the windows are the defaults), for code that does not know the profile.
pub(crate) fn reports_of_any_provider(headers: &HeaderMap, now: SystemTime) -> Vec<LimitReport> {
    let mut reports = Profile::openai().limits(headers, now);
    reports.extend(Profile::anthropic().limits(headers, now));
    reports
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::headers;

    #[test]
    fn usage_maps_to_the_dimensions_each_provider_counts() {
        let raw = RawUsage {
            input: Some(1_000),
            cache_read: Some(800),
            cache_write: Some(100),
            output: Some(50),
            ..RawUsage::default()
        };
        let openai = Profile::openai().usage(&raw).unwrap();
        assert_eq!((openai.input_tokens(), openai.output_tokens()), (1_000, 50));
        let openai = Profile::openai()
            .cache_reads_count(false)
            .usage(&raw)
            .unwrap();
        assert_eq!(openai.input_tokens(), 200);
        // Anthropic's input excludes the cache: writes count, reads do not.
        let anthropic = Profile::anthropic().usage(&raw).unwrap();
        assert_eq!(anthropic.input_tokens(), 1_100);
        assert_eq!(anthropic.cache_read_tokens(), 800);
        assert_eq!(Profile::gemini().usage(&RawUsage::default()), None);
    }

    #[test]
    fn headers_become_reports_with_the_profiles_windows() {
        let now = SystemTime::UNIX_EPOCH;
        let openai = headers(&[
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-limit-tokens", "150000"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        let groq = Profile::openai_compatible(DAY, MINUTE).limits(&openai, now);
        assert_eq!(groq[0].window, DAY);
        assert_eq!(groq[0].limit, Some(60));
        assert_eq!(groq[1].reset, Some(Duration::from_secs(360)));

        let azure = headers(&[
            ("x-ratelimit-limit-tokens", "-1"),
            ("x-ratelimit-remaining-tokens", "-1"),
            ("x-ratelimit-remaining-requests", "19"),
            ("x-ratelimit-reset-requests", "37"),
        ]);
        let reports = Profile::azure_openai().limits(&azure, now);
        assert_eq!(reports.len(), 1, "the -1 sentinels are unknown");
        assert_eq!(reports[0].reset, Some(Duration::from_secs(37)));

        let anthropic = headers(&[
            ("anthropic-ratelimit-output-tokens-limit", "16000"),
            ("anthropic-ratelimit-output-tokens-remaining", "12000"),
            (
                "anthropic-ratelimit-output-tokens-reset",
                "1970-01-01T00:00:15Z",
            ),
            ("anthropic-ratelimit-requests-remaining", "garbage"),
        ]);
        let reports = Profile::anthropic().limits(&anthropic, now);
        assert_eq!(reports.len(), 1);
        assert_eq!(reports[0].dimension, Dimension::OutputTokens);
        assert_eq!(reports[0].reset, Some(Duration::from_secs(15)));
        assert!(Profile::gemini().limits(&openai, now).is_empty());
    }

    #[test]
    fn reports_describe_the_limit_of_their_amount_or_implied_window() {
        let nz = |n| std::num::NonZeroU64::new(n).unwrap();
        let two = Duration::from_secs(2);
        let rpm = Limit::new(Dimension::Requests, nz(500), two).unwrap();
        let rpd = Limit::per_day(Dimension::Requests, nz(14_400));
        let limits = [rpm, rpd];
        let report = |limit, remaining, reset: f64| LimitReport {
            dimension: Dimension::Requests,
            window: MINUTE,
            limit: Some(limit),
            remaining: Some(remaining),
            reset: Some(Duration::from_secs_f64(reset)),
        };
        // The amount names the limit, whatever the profile's window.
        assert_eq!(report(500, 500, 0.0).describes(&limits), Some(rpm));
        assert_eq!(report(14_400, 14_399, 6.0).describes(&limits), Some(rpd));
        // A limit halved without notice: 250 per 2 s, 50 spent, full again in 0.4 s.
        let halved = report(250, 200, 0.4);
        assert_eq!(halved.implied_window(), Some(two));
        assert_eq!(halved.describes(&limits), Some(rpm));
        // A day window cannot be mistaken for the compressed minute.
        assert_eq!(report(7_200, 7_199, 12.0).describes(&limits), Some(rpd));
        // Nothing to go by: the profile's window, here matching nothing.
        assert_eq!(report(250, 250, 0.0).describes(&limits), None);
        assert_eq!(Profile::openai().windows(two, two).request_window(), two);
    }
}
