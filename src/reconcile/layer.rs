use tower::Layer;

use super::{ExtensionUsage, ExtractUsage, Reconcile};

/// Applies [`Reconcile`] to a service; see the [module documentation](crate::reconcile).
#[derive(Debug, Clone, Default)]
pub struct ReconcileLayer<X = ExtensionUsage> {
    extract: X,
}

impl ReconcileLayer {
    /// Settles with the [`Usage`](crate::Usage) found in the response's extensions.
    pub fn new() -> Self {
        Self {
            extract: ExtensionUsage,
        }
    }
}

impl<X: ExtractUsage> ReconcileLayer<X> {
    /// Settles with the usage `extract` reads from each response body, falling back to the
    /// response's extensions.
    pub fn with_extractor(extract: X) -> Self {
        Self { extract }
    }
}

impl<S, X: Clone> Layer<S> for ReconcileLayer<X> {
    type Service = Reconcile<S, X>;

    fn layer(&self, inner: S) -> Self::Service {
        Reconcile::new(inner, self.extract.clone())
    }
}
