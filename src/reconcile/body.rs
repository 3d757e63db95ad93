use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::{BodyEnd, ScanUsage, UsageReport};
use crate::budget::Reservation;
use crate::cost::Usage;
use crate::estimate::OutputRoute;
use crate::observe::{self, Labels};

pin_project! {
    /// A response body that settles its request's reservation when it ends, fails or is
    /// dropped. Every frame passes through unchanged.
    ///
    /// # Cancel safety
    ///
    /// Dropping the body before its end settles with the usage seen so far, if the scanner
    /// can tell it, else charges the estimate.
    pub struct ReconcileBody<B, X>
    where
        X: ScanUsage,
    {
        #[pin]
        inner: B,
        pending: Option<Pending<X>>,
    }

    impl<B, X> PinnedDrop for ReconcileBody<B, X>
    where
        X: ScanUsage,
    {
        fn drop(this: Pin<&mut Self>) {
            if let Some(pending) = this.project().pending.take() {
                pending.settle(BodyEnd::Dropped);
            }
        }
    }
}

/// Who is told the usage: a learned output estimate, and the caller's report.
pub(crate) type Told = (Option<OutputRoute>, Option<UsageReport>);

/// A reservation waiting for its usage.
pub(crate) struct Pending<X> {
    reservation: Reservation,
    scanner: X,
    /// A usage the inner client put in the response's extensions.
    from_extensions: Option<Usage>,
    /// Whether the response is an error (4xx, 5xx): providers bill no tokens for those.
    failed: bool,
    /// A learned output estimate to feed with the real output, and where the caller reads
    /// the usage.
    told: Told,
    labels: Labels,
    span: tracing::Span,
}

impl<X> Pending<X> {
    pub(crate) fn new(
        reservation: Reservation,
        scanner: X,
        from_extensions: Option<Usage>,
        failed: bool,
        told: Told,
        (labels, span): (Labels, tracing::Span),
    ) -> Self {
        Self {
            reservation,
            scanner,
            from_extensions,
            failed,
            told,
            labels,
            span,
        }
    }
}

impl<X: ScanUsage> Pending<X> {
    fn settle(self, end: BodyEnd) {
        let reserved = self.reservation.cost();
        #[cfg(feature = "metrics")]
        let budget = self.reservation.budget().clone();
        let usage = self.scanner.finish(end, reserved).or(self.from_extensions);
        match usage {
            Some(usage) => {
                self.span.record("usage_input", usage.input_tokens());
                self.span.record("usage_output", usage.output_tokens());
                if let Some(route) = &self.told.0 {
                    route.record(usage.output_tokens());
                }
                let settled = self.reservation.settle(&usage);
                tracing::trace!(?end, ?settled, "reservation settled");
            }
            None if self.failed => {
                let settled = self.reservation.settle(&Usage::new(0, 0));
                tracing::trace!(?end, ?settled, "error response: tokens refunded");
            }
            None => {
                let charged = self.reservation.charge_estimate();
                tracing::debug!(?end, ?charged, "usage missing, estimate charged");
            }
        }
        if let Some(report) = &self.told.1 {
            report.set(usage);
        }
        if !self.failed {
            observe::settled(&self.labels, &reserved, usage.as_ref());
        }
        #[cfg(feature = "metrics")]
        if budget.gauges_due() {
            observe::budget(budget.queue_label(), budget.snapshot().limits());
        }
    }
}

impl<B, X: ScanUsage> ReconcileBody<B, X> {
    pub(crate) fn new(inner: B, pending: Option<Pending<X>>) -> Self {
        Self { inner, pending }
    }

    /// Whether the reservation is still waiting for the body to end.
    pub fn is_pending(&self) -> bool {
        self.pending.is_some()
    }
}

impl<B, X> Body for ReconcileBody<B, X>
where
    B: Body,
    B::Data: AsRef<[u8]>,
    X: ScanUsage,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        if let Some(Ok(frame)) = &frame {
            if let Some(pending) = this.pending.as_mut() {
                if let Some(data) = frame.data_ref() {
                    pending.scanner.data(data.as_ref());
                } else if let Some(trailers) = frame.trailers_ref() {
                    pending.scanner.trailers(trailers);
                }
            }
        }
        let end = BodyEnd::after(&frame, this.inner.is_end_stream());
        if let Some(end) = end {
            if let Some(pending) = this.pending.take() {
                pending.settle(end);
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B, X: ScanUsage> fmt::Debug for ReconcileBody<B, X> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReconcileBody")
            .field("pending", &self.pending.is_some())
            .finish_non_exhaustive()
    }
}
