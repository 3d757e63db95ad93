//! What a request will consume ([`Cost`]) and what it really consumed ([`Usage`]).

use crate::quota::Dimension;
use crate::usage::ServiceTier;

/// What one request will consume, placed in the request's extensions before it reaches a
/// [`TokenBudget`](crate::token_budget::TokenBudget).
///
/// A cost counts requests (one by default), input tokens (the prompt) and output tokens
/// *reserved*: the upper bound the provider may generate (`max_tokens`). Totals are derived, so a
/// cost can never be inconsistent. Estimates should err high: the unused part is refunded when
/// the reservation is settled with the real [`Usage`].
///
/// # Example
///
/// ```
/// use tower_llm_quota::{Cost, Dimension};
///
/// let cost = Cost::new(1_200, 200);
/// assert_eq!(cost.amount(Dimension::Requests), 1);
/// assert_eq!(cost.amount(Dimension::TotalTokens), 1_400);
///
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(cost);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Cost {
    requests: u64,
    input_tokens: u64,
    output_tokens: u64,
    spend: u64,
}

impl Cost {
    /// One request with `input_tokens` of prompt and `output_tokens` reserved for the answer.
    pub const fn new(input_tokens: u64, output_tokens: u64) -> Self {
        Self {
            requests: 1,
            input_tokens,
            output_tokens,
            spend: 0,
        }
    }

    /// A cost of `requests` requests and no tokens (for example a call whose tokens are not
    /// limited).
    pub const fn requests_only(requests: u64) -> Self {
        Self {
            requests,
            input_tokens: 0,
            output_tokens: 0,
            spend: 0,
        }
    }

    /// The same cost counting `requests` requests instead of one (a batch endpoint, `n > 1`).
    pub const fn with_requests(self, requests: u64) -> Self {
        Self { requests, ..self }
    }

    /// The same cost with `spend` nano-dollars (10⁻⁹ USD): what its tokens cost at its
    /// model's prices, for limits of [`Dimension::Spend`]. Defaults to 0 (not priced); the
    /// [`EstimateLayer`](crate::EstimateLayer) sets it when given a
    /// [`PriceTable`](crate::pricing::PriceTable).
    pub const fn with_spend(self, spend: u64) -> Self {
        Self { spend, ..self }
    }

    /// Spend in nano-dollars (0 unless priced).
    pub const fn spend(&self) -> u64 {
        self.spend
    }

    /// Requests this cost counts.
    pub const fn requests(&self) -> u64 {
        self.requests
    }

    /// Input (prompt) tokens.
    pub const fn input_tokens(&self) -> u64 {
        self.input_tokens
    }

    /// Output tokens reserved (the `max_tokens` bound, or a measured output).
    pub const fn output_tokens(&self) -> u64 {
        self.output_tokens
    }

    /// Input plus output tokens.
    pub const fn total_tokens(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    /// The amount this cost takes from a bucket of `dimension`.
    pub const fn amount(&self, dimension: Dimension) -> u64 {
        match dimension {
            Dimension::Requests => self.requests,
            Dimension::InputTokens => self.input_tokens,
            Dimension::OutputTokens => self.output_tokens,
            Dimension::TotalTokens => self.total_tokens(),
            Dimension::Spend => self.spend,
        }
    }

    /// Component-wise saturating sum, used to total queued demand.
    pub(crate) const fn saturating_add(self, other: Self) -> Self {
        Self {
            requests: self.requests.saturating_add(other.requests),
            input_tokens: self.input_tokens.saturating_add(other.input_tokens),
            output_tokens: self.output_tokens.saturating_add(other.output_tokens),
            spend: self.spend.saturating_add(other.spend),
        }
    }

    /// Component-wise saturating difference, the inverse of [`Cost::saturating_add`].
    pub(crate) const fn saturating_sub(self, other: Self) -> Self {
        Self {
            requests: self.requests.saturating_sub(other.requests),
            input_tokens: self.input_tokens.saturating_sub(other.input_tokens),
            output_tokens: self.output_tokens.saturating_sub(other.output_tokens),
            spend: self.spend.saturating_sub(other.spend),
        }
    }
}

/// What one request really consumed, placed in the response's extensions by whatever knows it
/// (a provider adapter, a body parser, or the client itself).
///
/// [`ReconcileLayer`](crate::ReconcileLayer) settles the request's reservation with it.
/// `input_tokens` is the amount that counts against the provider's input-token limit; cached
/// input tokens are reported apart, as information: providers differ in whether cache reads
/// are included in their prompt count and whether they count against the limit, so the code
/// that builds a `Usage` for a provider decides what `input_tokens` holds.
///
/// # Example
///
/// ```
/// use tower_llm_quota::Usage;
///
/// let usage = Usage::new(1_150, 87).with_cache_read_tokens(1_024);
/// let mut response = http::Response::new(());
/// response.extensions_mut().insert(usage);
/// assert_eq!(usage.total_tokens(), 1_237);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Usage {
    input_tokens: u64,
    output_tokens: u64,
    cache_read_tokens: u64,
    cache_write_tokens: u64,
    service_tier: Option<ServiceTier>,
    spend: Option<u64>,
}

impl Usage {
    /// Usage of `input_tokens` prompt tokens and `output_tokens` generated tokens.
    pub const fn new(input_tokens: u64, output_tokens: u64) -> Self {
        Self {
            input_tokens,
            output_tokens,
            cache_read_tokens: 0,
            cache_write_tokens: 0,
            service_tier: None,
            spend: None,
        }
    }

    /// Records what the call cost, in nano-dollars, where the provider or the client knows it
    /// (some gateways report a cost in their usage). Defaults to none: a reservation priced by
    /// the [`EstimateLayer`](crate::EstimateLayer) prices the tokens itself.
    pub const fn with_spend(self, spend: u64) -> Self {
        Self {
            spend: Some(spend),
            ..self
        }
    }

    /// What the call cost in nano-dollars, if recorded with [`with_spend`](Self::with_spend).
    pub const fn spend(&self) -> Option<u64> {
        self.spend
    }

    /// Records the service tier that served the request, as the provider said. Defaults to
    /// none (not said).
    pub const fn with_service_tier(self, service_tier: Option<ServiceTier>) -> Self {
        Self {
            service_tier,
            ..self
        }
    }

    /// The service tier that served the request, if the provider said (a record, not a
    /// dimension: the budget settles the tokens alone).
    pub const fn service_tier(&self) -> Option<ServiceTier> {
        self.service_tier
    }

    /// Records input tokens served from the provider's prompt cache. Defaults to 0.
    pub const fn with_cache_read_tokens(self, cache_read_tokens: u64) -> Self {
        Self {
            cache_read_tokens,
            ..self
        }
    }

    /// Records input tokens written to the provider's prompt cache. Defaults to 0.
    pub const fn with_cache_write_tokens(self, cache_write_tokens: u64) -> Self {
        Self {
            cache_write_tokens,
            ..self
        }
    }

    /// Input tokens that count against the input-token limit.
    pub const fn input_tokens(&self) -> u64 {
        self.input_tokens
    }

    /// Output tokens generated.
    pub const fn output_tokens(&self) -> u64 {
        self.output_tokens
    }

    /// Input plus output tokens.
    pub const fn total_tokens(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    /// Input tokens read from the prompt cache.
    pub const fn cache_read_tokens(&self) -> u64 {
        self.cache_read_tokens
    }

    /// Input tokens written to the prompt cache.
    pub const fn cache_write_tokens(&self) -> u64 {
        self.cache_write_tokens
    }

    /// The cost this usage really had, for a request that counted `requests` requests (its
    /// spend, if [recorded](Self::with_spend), else none).
    pub const fn as_cost(&self, requests: u64) -> Cost {
        let spend = match self.spend {
            Some(spend) => spend,
            None => 0,
        };
        Cost::new(self.input_tokens, self.output_tokens)
            .with_requests(requests)
            .with_spend(spend)
    }
}
