//! Usage from provider bodies, plugged into [`ReconcileLayer`](crate::ReconcileLayer).

use http::response::Parts;

use super::Profile;
use crate::budget::Budget;
use crate::cost::{Cost, Usage};
use crate::reconcile::{BodyEnd, ExtractUsage, ScanUsage};
use crate::usage::{ServiceTier, UsageScanner, WireFormat};

/// Reads the usage a provider reports in its bodies, JSON or event streams, and adapts the
/// budget from its rate-limit headers on every response. Use it with
/// [`ReconcileLayer::with_extractor`](crate::ReconcileLayer::with_extractor).
///
/// Every byte passes through to the caller unchanged; the scanner holds no event, only the
/// usage object itself (at most 16 KiB).
///
/// A stream cut before its usage arrived (dropped, failed, or ended without it) is charged the
/// input estimate plus the output it streamed, counted at 3.5 characters per token, but never
/// less than the provider's partial report: never refunded blindly.
///
/// Extraction needs the decoded body: put tower-http's `DecompressionLayer` *inside*
/// `ReconcileLayer` (between it and the client), so that it sees plain JSON or SSE.
///
/// # Example
///
/// ```
/// use tower::ServiceBuilder;
/// use tower_llm_quota::provider::{Profile, ProviderUsage};
/// use tower_llm_quota::ReconcileLayer;
///
/// let reconcile = ReconcileLayer::with_extractor(ProviderUsage::new(Profile::anthropic()));
/// let _builder = ServiceBuilder::new().layer(reconcile);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ProviderUsage {
    profile: Profile,
}

impl ProviderUsage {
    /// Reads bodies and headers as `profile` says.
    pub const fn new(profile: Profile) -> Self {
        Self { profile }
    }
}

/// The scanner of [`ProviderUsage`] for one response.
#[derive(Debug)]
pub struct ProviderScan {
    profile: Profile,
    scanner: UsageScanner,
    streaming: bool,
    /// The tier a response header named (Gemini's `x-gemini-service-tier`).
    header_tier: Option<ServiceTier>,
}

impl ProviderScan {
    /// A scanner of one response body of `profile`'s format, an event stream if `streaming`,
    /// settling as [`ProviderUsage`] does (a cut stream is charged what it streamed) without
    /// adapting any budget: for a second reader of the same body, such as a gateway's usage
    /// ledger.
    ///
    /// ```
    /// use tower_llm_quota::Cost;
    /// use tower_llm_quota::provider::{Profile, ProviderScan};
    /// use tower_llm_quota::reconcile::{BodyEnd, ScanUsage};
    ///
    /// let mut scan = ProviderScan::new(Profile::openai(), true);
    /// scan.data(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hello, world!\"}}]}\n\n");
    /// // Cut before the final usage chunk: the estimate's input, the output streamed.
    /// let usage = scan.finish(BodyEnd::Dropped, Cost::new(100, 500)).unwrap();
    /// assert_eq!((usage.input_tokens(), usage.output_tokens()), (100, 4));
    /// ```
    pub fn new(profile: Profile, streaming: bool) -> Self {
        Self {
            profile,
            scanner: UsageScanner::new(profile.wire_format(), streaming),
            streaming,
            header_tier: None,
        }
    }

    /// A scanner of the response whose head is `head`: an event stream if its content type
    /// says so, the tier its headers name read. What [`ProviderUsage`] scans with, without
    /// adapting a budget to the head's rate-limit headers.
    pub fn of_response(profile: Profile, head: &Parts) -> Self {
        let streaming = head
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
        Self::new(profile, streaming).tier_from(&head.headers)
    }

    /// Reads the service tier a response header names (Gemini's `x-gemini-service-tier`);
    /// the body's (OpenAI's `service_tier`, Anthropic's `usage.service_tier`) is read as it
    /// passes. The usage it settles with carries the tier ([`Usage::service_tier`]).
    pub fn tier_from(mut self, headers: &http::HeaderMap) -> Self {
        self.header_tier = ServiceTier::from_headers(headers);
        self
    }
}

impl ExtractUsage for ProviderUsage {
    type Scanner = ProviderScan;

    fn start(&self, head: &Parts, budget: &Budget) -> ProviderScan {
        self.profile.adapt(&head.headers, budget);
        ProviderScan::of_response(self.profile, head)
    }
}

impl ScanUsage for ProviderScan {
    fn data(&mut self, chunk: &[u8]) {
        self.scanner.data(chunk);
    }

    fn finish(self, end: BodyEnd, reserved: Cost) -> Option<Usage> {
        let tier = self.scanner.service_tier().or(self.header_tier);
        let reported = self
            .scanner
            .usage()
            .and_then(|raw| self.profile.usage(&raw))
            .map(|usage| usage.with_service_tier(tier));
        // OpenAI streams report usage once, in their last events: seen, it is final even if
        // the reader stops before the body's end (at `[DONE]`, say). Anthropic's and Gemini's
        // grow with the stream: final only at its end.
        let final_when_seen = matches!(
            self.scanner.format(),
            WireFormat::OpenAiChat | WireFormat::OpenAiResponses
        );
        let complete = reported.is_some() && (end == BodyEnd::Complete || final_when_seen);
        if !self.streaming || complete {
            return reported;
        }
        // Cut before the final usage: the input as reported or estimated, the output streamed.
        let streamed = self.scanner.streamed_chars().saturating_mul(2).div_ceil(7);
        let input = reported.map_or(reserved.input_tokens(), |u| u.input_tokens());
        let output = reported.map_or(streamed, |u| u.output_tokens().max(streamed));
        tracing::debug!(
            ?end,
            input,
            output,
            "usage missing from a cut stream, estimated"
        );
        Some(Usage::new(input, output).with_service_tier(tier))
    }
}
