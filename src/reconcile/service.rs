use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use super::{ExtensionUsage, ExtractUsage, ReconcileBody, ResponseFuture, UsageReport};
use crate::budget::ReservationSlot;
use crate::estimate::OutputRoute;
use crate::observe::Labels;

/// Settles each request's reservation when its response body ends; see the
/// [module documentation](crate::reconcile).
///
/// Requests that carry no [`ReservationSlot`] pass through untouched. `X` defaults to
/// [`ExtensionUsage`] (the usage the client put in the response's extensions), as
/// [`ReconcileLayer::new`](super::ReconcileLayer::new) builds it.
#[derive(Debug, Clone)]
pub struct Reconcile<S, X = ExtensionUsage> {
    inner: S,
    extract: X,
}

impl<S, X> Reconcile<S, X> {
    /// Wraps `inner`, reading usage with `extract`.
    pub fn new(inner: S, extract: X) -> Self {
        Self { inner, extract }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, X, B, ResBody> Service<Request<B>> for Reconcile<S, X>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    X: ExtractUsage,
{
    type Response = Response<ReconcileBody<ResBody, X::Scanner>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, X>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let reservation = request
            .extensions()
            .get::<ReservationSlot>()
            .and_then(ReservationSlot::take)
            .map(|mut reservation| {
                reservation.mark_sent();
                reservation
            });
        let extract = reservation.is_some().then(|| self.extract.clone());
        // Real output tokens feed a learned output estimate, when the request asked for one.
        let learn = request.extensions().get::<OutputRoute>().cloned();
        let report = request.extensions().get::<UsageReport>().cloned();
        let labels = Labels::of(request.extensions());
        // The request's span, if an outer layer opened one: the usage is recorded into it when
        // the body ends, outside any poll of the layers.
        let span = tracing::Span::current();
        ResponseFuture::new(
            self.inner.call(request),
            reservation,
            extract,
            (learn, report),
            (labels, span),
        )
    }
}
