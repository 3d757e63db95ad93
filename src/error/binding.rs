//! What binds when a budget refuses a request on arrival.

/// What a request refused on arrival would have waited for: the limit whose refill, and the
/// budget's quota ([`Error::predicted_by`](crate::Error::predicted_by)).
#[derive(Debug, Clone, PartialEq)]
pub struct Binding {
    pub(crate) limit: crate::Limit,
    pub(crate) quota: Option<std::sync::Arc<str>>,
}

impl Binding {
    /// The limit whose refill the request would wait for.
    pub fn limit(&self) -> crate::Limit {
        self.limit
    }

    /// The name of the budget's quota ([`Quota::with_name`](crate::Quota::with_name)), when
    /// it has one: which of several budgets on a request's way binds (a model's scope, or
    /// the account).
    pub fn quota(&self) -> Option<&str> {
        self.quota.as_deref()
    }
}
