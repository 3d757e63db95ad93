//! `ServiceBuilder` methods for this crate's layers.

use tower::ServiceBuilder;
use tower::layer::util::Stack;

use crate::budget::Budget;
use crate::estimate::{EstimateLayer, Estimator};
use crate::idempotency::{IdempotencyLayer, IdempotencyStore};
use crate::provider::StripUsageLayer;
use crate::queue::{PriorityQueueLayer, QueueConfig};
use crate::reconcile::{ExtractUsage, ReconcileLayer};
use crate::retry::{RetryAfterLayer, RetryPolicy};
use crate::stack::QuotaStack;
use crate::token_budget::TokenBudgetLayer;

/// Adds this crate's layers to [`tower::ServiceBuilder`], one method per layer.
///
/// Each method adds the layer with the settings it names and the defaults of the others; for
/// other settings, build the layer and add it with [`ServiceBuilder::layer`]. The order below is
/// the order of [`QuotaStack`] (outermost first), which is what `.quota_stack(..)` adds in one
/// call.
///
/// # Example
///
/// ```
/// use std::num::NonZeroU64;
/// use tower::ServiceBuilder;
/// use tower_llm_quota::provider::{Profile, ProviderUsage};
/// use tower_llm_quota::{
///     Budget, Dimension, Limit, QueueConfig, Quota, RetryPolicy, ServiceBuilderExt,
/// };
///
/// let budget = Budget::new(Quota::new().with_limit(Limit::per_minute(
///     Dimension::Requests,
///     NonZeroU64::new(500).unwrap(),
/// )));
/// let builder = ServiceBuilder::new()
///     .estimate()
///     .retry_after(RetryPolicy::new())
///     .priority_queue(QueueConfig::new())
///     .token_budget(budget)
///     .strip_usage()
///     .reconcile_with(ProviderUsage::new(Profile::openai()));
/// # let _ = builder;
/// ```
pub trait ServiceBuilderExt<L>: sealed::Sealed + Sized {
    /// Adds a whole [`QuotaStack`]: every layer below, in this order, over one budget.
    fn quota_stack(self, stack: QuotaStack) -> ServiceBuilder<Stack<QuotaStack, L>>;

    /// Adds an [`EstimateLayer`] with a [`CharEstimator`](crate::estimate::CharEstimator).
    fn estimate(self) -> ServiceBuilder<Stack<EstimateLayer, L>>;

    /// Adds an [`EstimateLayer`] counting with `estimator`.
    fn estimate_with(self, estimator: impl Estimator) -> ServiceBuilder<Stack<EstimateLayer, L>>;

    /// Adds a [`RetryAfterLayer`] retrying by `policy`.
    fn retry_after(self, policy: RetryPolicy) -> ServiceBuilder<Stack<RetryAfterLayer, L>>;

    /// Adds a [`PriorityQueueLayer`] queueing by `config`.
    fn priority_queue(self, config: QueueConfig) -> ServiceBuilder<Stack<PriorityQueueLayer, L>>;

    /// Adds a [`TokenBudgetLayer`] spending `budget`.
    fn token_budget(self, budget: Budget) -> ServiceBuilder<Stack<TokenBudgetLayer, L>>;

    /// Adds a [`StripUsageLayer`]: outside the reconcile layer, it hides the usage chunk the
    /// estimation layer asked a stream for.
    fn strip_usage(self) -> ServiceBuilder<Stack<StripUsageLayer, L>>;

    /// Adds a [`ReconcileLayer`] settling with the usage in response extensions.
    fn reconcile(self) -> ServiceBuilder<Stack<ReconcileLayer, L>>;

    /// Adds a [`ReconcileLayer`] settling with the usage `extract` reads from bodies.
    fn reconcile_with<X: ExtractUsage>(
        self,
        extract: X,
    ) -> ServiceBuilder<Stack<ReconcileLayer<X>, L>>;

    /// Adds an [`IdempotencyLayer`] keeping its records in `store`.
    fn idempotency(
        self,
        store: impl IdempotencyStore,
    ) -> ServiceBuilder<Stack<IdempotencyLayer, L>>;
}

impl<L> ServiceBuilderExt<L> for ServiceBuilder<L> {
    fn quota_stack(self, stack: QuotaStack) -> ServiceBuilder<Stack<QuotaStack, L>> {
        self.layer(stack)
    }

    fn estimate(self) -> ServiceBuilder<Stack<EstimateLayer, L>> {
        self.layer(EstimateLayer::new())
    }

    fn estimate_with(self, estimator: impl Estimator) -> ServiceBuilder<Stack<EstimateLayer, L>> {
        self.layer(EstimateLayer::with_estimator(estimator))
    }

    fn retry_after(self, policy: RetryPolicy) -> ServiceBuilder<Stack<RetryAfterLayer, L>> {
        self.layer(RetryAfterLayer::new(policy))
    }

    fn priority_queue(self, config: QueueConfig) -> ServiceBuilder<Stack<PriorityQueueLayer, L>> {
        self.layer(PriorityQueueLayer::new(config))
    }

    fn token_budget(self, budget: Budget) -> ServiceBuilder<Stack<TokenBudgetLayer, L>> {
        self.layer(TokenBudgetLayer::new(budget))
    }

    fn strip_usage(self) -> ServiceBuilder<Stack<StripUsageLayer, L>> {
        self.layer(StripUsageLayer)
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

    fn idempotency(
        self,
        store: impl IdempotencyStore,
    ) -> ServiceBuilder<Stack<IdempotencyLayer, L>> {
        self.layer(IdempotencyLayer::new(store))
    }
}

mod sealed {
    pub trait Sealed {}
    impl<L> Sealed for tower::ServiceBuilder<L> {}
}
