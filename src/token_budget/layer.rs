use tower::Layer;

use super::{MissingCost, TokenBudget};
use crate::budget::Budget;

/// Applies [`TokenBudget`] to a service; see the [module documentation](crate::token_budget).
///
/// Every service this layer builds shares the one [`Budget`].
#[derive(Debug, Clone)]
pub struct TokenBudgetLayer {
    budget: Budget,
    missing_cost: MissingCost,
}

impl TokenBudgetLayer {
    /// A layer spending `budget`.
    pub fn new(budget: Budget) -> Self {
        Self {
            budget,
            missing_cost: MissingCost::default(),
        }
    }

    /// What to do with a request that carries no [`Cost`](crate::Cost). Defaults to
    /// [`MissingCost::Reject`].
    pub fn missing_cost(self, missing_cost: MissingCost) -> Self {
        Self {
            missing_cost,
            ..self
        }
    }
}

impl<S> Layer<S> for TokenBudgetLayer {
    type Service = TokenBudget<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TokenBudget::new(inner, self.budget.clone()).missing_cost(self.missing_cost)
    }
}
