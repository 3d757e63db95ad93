//! The body of a forwarded answer: passed through unchanged, and counted for its tenant when
//! it ends (or is dropped) with the usage the budget settled it with, which the stack's
//! reconciling body below reads (the body is scanned once). An answer without a call of its
//! own (replayed or joined by the idempotency layer) settled nothing: its body is scanned here.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower_llm_quota::provider::ProviderScan;
use tower_llm_quota::reconcile::{BodyEnd, ScanUsage, UsageReport};
use tower_llm_quota::{BoxError, Cost};

use super::Gateway;
use super::audit::{Audit, Audited, Tokens, millis, rfc3339};

/// What is counted when the answer ends.
#[derive(Debug)]
pub(crate) struct Meter {
    /// Where the request is counted: its tenant's usage, the report, the audit log.
    pub(crate) gateway: Arc<Gateway>,
    pub(crate) tenant: String,
    /// The request's path (its key's node) and the account that answered: its tokens in
    /// the last minute per account.
    pub(crate) path: tower_llm_quota::tenant::Tenant,
    pub(crate) account: String,
    /// The usage the stack settled the answer with, told when its body ends.
    pub(crate) report: UsageReport,
    /// Reads the usage of an answer the stack did not settle (no call of its own); taken when
    /// the answer ends.
    pub(crate) scan: Option<ProviderScan>,
    pub(crate) estimate: Cost,
    /// The request's audit line, written when the answer ends.
    pub(crate) audited: Option<Audited>,
    /// The bytes of the answer passed on so far.
    pub(crate) bytes: u64,
}

impl Meter {
    /// Counts once, as the budget settles: the usage the provider reported; for a stream cut
    /// before its final usage, the input reported (or estimated) and the output streamed; the
    /// estimate when nothing can be read.
    fn finish(&mut self, end: BodyEnd) {
        let Some(audited) = self.audited.take() else {
            return;
        };
        let usage = match (self.report.settled(), self.scan.take()) {
            (Some(settled), _) => settled,
            (None, Some(scan)) => scan.finish(end, self.estimate),
            (None, None) => None,
        };
        let (tokens, tier) = match &usage {
            Some(usage) => (
                (
                    usage.input_tokens(),
                    usage.output_tokens(),
                    usage.cache_read_tokens(),
                ),
                usage.service_tier(),
            ),
            None => (
                (
                    self.estimate.input_tokens(),
                    self.estimate.output_tokens(),
                    0,
                ),
                None,
            ),
        };
        self.gateway.ledger.tokens(&self.tenant, tokens, tier);
        let spend = (usage.as_ref().zip(audited.prices.as_ref()))
            .map_or(0, |(usage, prices)| prices.spend(usage));
        let counted = (tokens.0 + tokens.1, spend);
        (self.gateway.ledger).recent(&self.account, &self.path, counted);
        audited.finish(&self.gateway, usage.as_ref(), self.bytes);
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        self.finish(BodyEnd::Dropped);
    }
}

pin_project! {
    /// A provider body, metered.
    pub(crate) struct Metered<B> {
        #[pin]
        inner: B,
        meter: Meter,
    }
}

impl<B> Metered<B> {
    pub(crate) fn new(inner: B, meter: Meter) -> Self {
        Self { inner, meter }
    }
}

impl<B> Body for Metered<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.meter.bytes += data.len() as u64;
                    if let Some(scan) = this.meter.scan.as_mut() {
                        scan.data(data);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => {
                this.meter.finish(BodyEnd::Error);
                Poll::Ready(Some(Err(error.into())))
            }
            Poll::Ready(None) => {
                this.meter.finish(BodyEnd::Complete);
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The request's end, where the gateway's state is at hand (the audit module knows none of it).
impl Audited {
    /// Counts the request in the gateway's report and writes its audit line, with the usage
    /// the answer reported (if any) and the bytes it sent.
    pub(crate) fn finish(
        mut self,
        gateway: &Gateway,
        used: Option<&tower_llm_quota::Usage>,
        bytes: u64,
    ) {
        let duration = self.started.elapsed();
        metrics::histogram!(
            "gateway_request_duration_seconds",
            "api" => self.entry.api,
            "decision" => self.entry.decision,
        )
        .record(duration.as_secs_f64());
        if let Some(usage) = used {
            self.entry.used = Some(Tokens {
                input: usage.input_tokens(),
                output: usage.output_tokens(),
                cached: Some(usage.cache_read_tokens()),
            });
            self.entry.service_tier = usage.service_tier().map(|t| t.as_str());
            if let Some(prices) = &self.prices {
                self.entry.spend_nano_usd = Some(prices.spend(usage));
                self.entry.priced = Some(prices.tokens(usage));
                // The tier it was priced at: the provider's word, else the one asked.
                let tier = usage.service_tier().or(prices.tier());
                self.entry.service_tier = tier.map(|t| t.as_str());
            }
        }
        let now = SystemTime::now();
        gateway.report.record(&self.entry, now);
        let spend = self
            .entry
            .spend_nano_usd
            .filter(|_| gateway.alerts.watches_any());
        if let Some(spend) = spend {
            let path = match (&self.entry.tenant, &self.entry.key) {
                (Some(tenant), Some(key)) => Some(format!("{tenant}/{key}")),
                (Some(tenant), None) => Some(tenant.clone()),
                (None, _) => None,
            };
            let account = self.entry.account.as_deref();
            let at = (path.as_deref(), account);
            gateway.alerts.add(at, spend, now, &gateway.audit);
        }
        #[cfg(feature = "otel")]
        if let Some(otel) = &gateway.otel {
            let started = now.checked_sub(duration).unwrap_or(now);
            otel.span(&self.entry, self.parent.as_ref(), (started, now));
        }
        let audit = &gateway.audit;
        if let Audit::Off = audit {
            return;
        }
        self.entry.time = rfc3339(now);
        self.entry.duration_ms = millis(duration);
        self.entry.bytes = bytes;
        audit.write(&self.entry);
    }
}
