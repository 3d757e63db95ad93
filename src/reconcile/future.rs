use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;

use super::body::{Pending, Told};
use super::{ExtractUsage, ReconcileBody};
use crate::budget::Reservation;
use crate::cost::Usage;
use crate::observe::{self, Labels};

pin_project! {
    /// The response future of [`Reconcile`](super::Reconcile).
    ///
    /// # Cancel safety
    ///
    /// Dropped before the response arrives (or when the inner service fails), its reservation
    /// is charged its estimate: the request was sent and may have been counted.
    pub struct ResponseFuture<F, X> {
        #[pin]
        inner: F,
        reservation: Option<Reservation>,
        extract: Option<X>,
        told: Told,
        labels: Labels,
        span: tracing::Span,
    }
}

impl<F, X> ResponseFuture<F, X> {
    pub(crate) fn new(
        inner: F,
        reservation: Option<Reservation>,
        extract: Option<X>,
        told: Told,
        (labels, span): (Labels, tracing::Span),
    ) -> Self {
        Self {
            inner,
            reservation,
            extract,
            told,
            labels,
            span,
        }
    }
}

impl<F, X, B, E> Future for ResponseFuture<F, X>
where
    F: Future<Output = Result<Response<B>, E>>,
    X: ExtractUsage,
{
    type Output = Result<Response<ReconcileBody<B, X::Scanner>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = match ready!(this.inner.poll(cx)) {
            Ok(response) => response,
            Err(error) => {
                observe::request(this.labels, None);
                return Poll::Ready(Err(error));
            }
        };
        observe::request(this.labels, Some(response.status()));
        let (head, body) = response.into_parts();
        let pending = match (this.reservation.take(), this.extract.take()) {
            (Some(reservation), Some(extract)) => {
                let scanner = extract.start(&head, reservation.budget());
                let from_extensions = head.extensions.get::<Usage>().copied();
                let failed = head.status.is_client_error() || head.status.is_server_error();
                Some(Pending::new(
                    reservation,
                    scanner,
                    from_extensions,
                    failed,
                    std::mem::take(this.told),
                    (std::mem::take(this.labels), this.span.clone()),
                ))
            }
            _ => None,
        };
        Poll::Ready(Ok(Response::from_parts(
            head,
            ReconcileBody::new(body, pending),
        )))
    }
}

impl<F, X> fmt::Debug for ResponseFuture<F, X> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("reservation", &self.reservation)
            .finish_non_exhaustive()
    }
}
