use tower::Layer;

use super::{MissingCost, TokenBudget};
use crate::budget::Budget;
use crate::priority::Priority;

/// Applies [`TokenBudget`] to a service; see the [module documentation](crate::token_budget).
///
/// Every service this layer builds shares the one [`Budget`].
#[derive(Debug, Clone)]
pub struct TokenBudgetLayer {
    budget: Budget,
    missing_cost: MissingCost,
    class_floor: [f64; 3],
}

impl TokenBudgetLayer {
    /// A layer spending `budget`.
    pub fn new(budget: Budget) -> Self {
        Self {
            budget,
            missing_cost: MissingCost::default(),
            class_floor: [0.0; 3],
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

impl TokenBudgetLayer {
    /// Makes requests of `priority` leave `fraction` of every bucket untouched, so that higher
    /// classes find that share at once even while lower ones saturate the quota. `fraction` is
    /// clamped to `[0, 1]`. Defaults to 0 for every class; see
    /// [`TokenBudget::class_floor`].
    pub fn class_floor(mut self, priority: Priority, fraction: f64) -> Self {
        self.class_floor[priority.index()] = fraction;
        self
    }

    /// The budget this layer's services spend.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }
}

impl<S> Layer<S> for TokenBudgetLayer {
    type Service = TokenBudget<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let mut service =
            TokenBudget::new(inner, self.budget.clone()).missing_cost(self.missing_cost);
        service.class_floor = self.class_floor;
        service
    }
}
