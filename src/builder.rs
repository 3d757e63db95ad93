//! `ServiceBuilder` methods for this crate's layers.

use tower::ServiceBuilder;
use tower::layer::util::Stack;

use crate::budget::Budget;
use crate::reconcile::{ExtractUsage, ReconcileLayer};
use crate::token_budget::TokenBudgetLayer;

/// Adds this crate's layers to [`tower::ServiceBuilder`].
///
/// # Example
///
/// ```
/// use std::num::NonZeroU64;
/// use tower::ServiceBuilder;
/// use tower_llm_quota::{Budget, Dimension, Limit, Quota, ServiceBuilderExt};
///
/// let budget = Budget::new(Quota::new().with_limit(Limit::per_minute(
///     Dimension::Requests,
///     NonZeroU64::new(500).unwrap(),
/// )));
/// let builder = ServiceBuilder::new().token_budget(budget).reconcile();
/// # let _ = builder;
/// ```
pub trait ServiceBuilderExt<L>: sealed::Sealed + Sized {
    /// Adds a [`TokenBudgetLayer`] spending `budget`.
    fn token_budget(self, budget: Budget) -> ServiceBuilder<Stack<TokenBudgetLayer, L>>;

    /// Adds a [`ReconcileLayer`] settling with the usage in response extensions.
    fn reconcile(self) -> ServiceBuilder<Stack<ReconcileLayer, L>>;

    /// Adds a [`ReconcileLayer`] settling with the usage `extract` reads from bodies.
    fn reconcile_with<X: ExtractUsage>(
        self,
        extract: X,
    ) -> ServiceBuilder<Stack<ReconcileLayer<X>, L>>;
}

impl<L> ServiceBuilderExt<L> for ServiceBuilder<L> {
    fn token_budget(self, budget: Budget) -> ServiceBuilder<Stack<TokenBudgetLayer, L>> {
        self.layer(TokenBudgetLayer::new(budget))
    }

    fn reconcile(self) -> ServiceBuilder<Stack<ReconcileLayer, L>> {
        self.layer(ReconcileLayer::new())
    }

    fn reconcile_with<X: ExtractUsage>(
        self,
        extract: X,
    ) -> ServiceBuilder<Stack<ReconcileLayer<X>, L>> {
        self.layer(ReconcileLayer::with_extractor(extract))
    }
}

mod sealed {
    pub trait Sealed {}
    impl<L> Sealed for tower::ServiceBuilder<L> {}
}
