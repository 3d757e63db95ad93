//! What a [`RetryAfterLayer`](super::RetryAfterLayer), its services and their attempts share.

use std::sync::Arc;

use tower::retry::budget::TpsBudget;

use super::{Jitter, RetryPolicy};
use crate::budget::Budget;

/// What every attempt of a retried request consults.
pub(crate) struct Settings<C> {
    pub(crate) policy: RetryPolicy,
    pub(crate) classify: C,
    pub(crate) budget: Arc<TpsBudget>,
    pub(crate) pause: Option<Budget>,
    pub(crate) jitter: Arc<dyn Jitter>,
}

impl<C: Clone> Clone for Settings<C> {
    fn clone(&self) -> Self {
        Self {
            policy: self.policy,
            classify: self.classify.clone(),
            budget: self.budget.clone(),
            pause: self.pause.clone(),
            jitter: self.jitter.clone(),
        }
    }
}
