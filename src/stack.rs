//! The recommended stack, assembled in one call for a provider profile.
//!
//! [`QuotaStack`] is a tower [`Layer`] that wraps a client in every layer of this crate, in the
//! documented order (outermost first):
//!
//! 1. [`EstimateLayer`]: fills each request's [`Cost`](crate::Cost) from its JSON body, once;
//!    for the OpenAI Chat Completions format it also asks for the usage of a stream whose
//!    caller did not ([`EstimateLayer::include_stream_usage`]), so that the stream settles
//!    exactly;
//! 2. [`RetryAfterLayer`], pausing the budget on a provider 429: every attempt re-enters
//!    admission;
//! 3. [`PriorityQueueLayer`]: stamps each request's class, place and deadline;
//! 4. [`TokenBudgetLayer`]: reserves the cost and an in-flight slot together, from the head
//!    of the budget's ordering, or waits there;
//! 5. [`StripUsageLayer`]: hides from the caller the usage chunk of a stream whose usage only
//!    the stack asked for ([`EstimateLayer::include_stream_usage`]); every other response
//!    passes untouched;
//! 6. [`ReconcileLayer`] with [`ProviderUsage`] for the profile: settles with the usage in the
//!    provider's body and lowers the budget when its rate-limit headers report less left.
//!
//! The result is a [`QuotaService`]; its responses carry a [`QuotaBody`]. To make one call per
//! logical operation, wrap it in an [`IdempotencyLayer`](crate::IdempotencyLayer): outside the
//! stack, a duplicate neither queues nor reserves.
//!
//! # Example
//!
//! ```
//! use std::num::{NonZeroU64, NonZeroUsize};
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Full};
//! use tower::{Layer, Service, ServiceExt, service_fn};
//! use tower_llm_quota::{Dimension, Limit, Priority, Quota, stack::QuotaStack};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), tower_llm_quota::BoxError> {
//! let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap());
//! let stack = QuotaStack::openai(Quota::new().with_limit(tpm)).concurrency(NonZeroUsize::new(16).unwrap());
//! let budget = stack.budget().clone();
//!
//! // Any client: hyper, a `reqwest_middleware` client (the `middleware` module), a mock.
//! let client = service_fn(|_request: http::Request<Full<Bytes>>| async {
//!     let body = r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;
//!     Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(body))))
//! });
//! let mut llm = stack.layer(client);
//!
//! let request = http::Request::post("https://api.openai.com/v1/chat/completions")
//!     .header("content-type", "application/json")
//!     .extension(Priority::Interactive)
//!     .body(Full::new(Bytes::from(
//!         r#"{"model":"gpt-4o-mini","max_tokens":100,"messages":[{"role":"user","content":"Hi"}]}"#,
//!     )))?;
//! let response = llm.ready().await?.call(request).await?;
//! response.into_body().collect().await?; // the end of the body settles the reservation
//! assert_eq!(budget.snapshot().limits()[0].level(), 5_000 - 42);
//! # Ok(()) }
//! ```
//!
//! # What the client must accept
//!
//! - **Request body**: `B: http_body::Body + From<Bytes> + Clone`, with `B::Error:
//!   Into<BoxError>`. The estimation layer reads the body and rebuilds it from bytes, the retry
//!   layer re-sends clones: `http_body_util::Full<Bytes>` fits. `String` and `reqwest::Body` do
//!   not (the `middleware` module, behind the `reqwest` feature, adapts reqwest).
//! - **Response body**: `ResBody: http_body::Body<Data = Bytes>`, with `ResBody::Error:
//!   Into<BoxError>`.
//! - **The client**: `Service<http::Request<B>, Response = http::Response<ResBody>> + Clone`,
//!   with `S::Error: Into<BoxError>`.
//!
//! The stack's error is the crate's [`Error`](crate::Error): a local decision
//! (`is_too_large()`, `is_queue_full()`, `is_deadline_exceeded()`, `is_store_unavailable()`,
//! ...), retries exhausted (`retry_report()`), or the client's failure (`is_inner()`), whose
//! own error is the [`source`](std::error::Error::source).
//!
//! # Spawning
//!
//! The stack's futures and bodies are `Send + 'static` when the client's are, whatever the
//! client's error types, a `BoxError` body error included (tower-http's decompression): a
//! task may own the whole call, `tokio::spawn(async move { llm.oneshot(request).await?
//! .into_body().collect().await })`, with no `boxed_unsync()` in between.
//!
//! # Requests without an estimate
//!
//! A request whose body the estimator cannot read (not JSON, a size unknown in advance, an
//! unknown shape) and that carries no `Cost` of its own is refused by default
//! ([`MissingCost::Reject`]); see [`QuotaStack::missing_cost`].

use tower::Layer;

use crate::budget::Budget;
use crate::estimate::{Estimate, EstimateLayer, Estimator};
use std::num::NonZeroUsize;
use std::sync::Arc;

use crate::pricing::PriceTable;
use crate::priority::Priority;
use crate::provider::{
    Profile, ProviderScan, ProviderUsage, StripUsage, StripUsageBody, StripUsageLayer,
};
use crate::queue::{PriorityQueue, PriorityQueueLayer, QueueConfig, QueueHandle};
use crate::quota::Quota;
use crate::reconcile::{ExtensionUsage, Reconcile, ReconcileBody, ReconcileLayer};
use crate::retry::{ProviderErrors, RetryAfter, RetryAfterLayer, RetryBody, RetryPolicy};
use crate::token_budget::{MissingCost, TokenBudget, TokenBudgetLayer};

/// The service a [`QuotaStack`] builds around a client `S`, outermost layer first.
pub type QuotaService<S> = Estimate<
    RetryAfter<PriorityQueue<TokenBudget<StripUsage<Reconcile<S, ProviderUsage>>>>, ProviderErrors>,
>;

/// The service of the two core layers assembled by hand, [`TokenBudgetLayer`] over
/// [`ReconcileLayer`] reading usage with `X` (by default the usage the client puts in the
/// response's extensions): `ServiceBuilder::new().token_budget(budget).reconcile()`.
pub type Governed<S, X = ExtensionUsage> = TokenBudget<Reconcile<S, X>>;

/// The body of a [`QuotaService`]'s responses around a client's response body `B`: it settles
/// the call's reservation (giving back its in-flight slot) when it ends, fails or is dropped.
pub type QuotaBody<B> = RetryBody<StripUsageBody<ReconcileBody<B, ProviderScan>>>;

/// The recommended stack for one provider quota; see the [module documentation](self).
///
/// Cloning it, or applying it to several clients, shares the budget, the queue, the in-flight
/// limit and the retry budget.
#[derive(Debug, Clone)]
pub struct QuotaStack {
    profile: Profile,
    budget: Budget,
    estimate: EstimateLayer,
    /// The prices requests are priced at, if any.
    prices: Option<Arc<PriceTable>>,
    retry: RetryAfterLayer,
    queue: PriorityQueueLayer,
    missing_cost: MissingCost,
    /// The share of every bucket each class leaves to higher ones, by `Priority::index`.
    class_floor: [f64; 3],
    /// The cap on calls in flight set with [`QuotaStack::concurrency`], if any.
    concurrency: Option<NonZeroUsize>,
}

impl QuotaStack {
    /// Calls in flight by default, until [`QuotaStack::concurrency`] says otherwise.
    pub const DEFAULT_CONCURRENCY: usize = 64;

    /// The stack for OpenAI Chat Completions ([`Profile::openai`]) over a new budget for
    /// `quota`.
    pub fn openai(quota: Quota) -> Self {
        Self::for_profile(Profile::openai(), quota)
    }

    /// The stack for Anthropic Messages ([`Profile::anthropic`]) over a new budget for
    /// `quota`.
    pub fn anthropic(quota: Quota) -> Self {
        Self::for_profile(Profile::anthropic(), quota)
    }

    /// The stack for the provider `profile` describes, over a new budget for `quota`, with
    /// the defaults of every layer and at most [`QuotaStack::DEFAULT_CONCURRENCY`] calls in
    /// flight unless the quota caps them ([`Quota::with_max_in_flight`]).
    ///
    /// The provider's rate-limit headers are matched to the quota's limits by the amount they
    /// report and the window their numbers imply; the profile's windows
    /// ([`Profile::windows`]) are the fallback. Against a provider whose minute is not 60 s (a
    /// simulator with a compressed minute) or whose limits count per day (Groq), give the
    /// profile those windows: `Profile::openai().windows(minute, minute)`.
    pub fn for_profile(profile: Profile, quota: Quota) -> Self {
        let quota = match quota.max_in_flight() {
            Some(_) => quota,
            None => quota.with_max_in_flight(Self::default_concurrency()),
        };
        // The depth gauges are labelled by the quota's name, else the profile's.
        let quota = match quota.name() {
            Some(_) => quota,
            None => quota.with_name(profile.name()),
        };
        let name: std::sync::Arc<str> = quota.name().unwrap_or_default().into();
        Self {
            profile,
            budget: Budget::new(quota),
            estimate: EstimateLayer::new().include_stream_usage(asks_stream_usage(&profile)),
            prices: None,
            retry: RetryAfterLayer::default(),
            queue: PriorityQueueLayer::default().named(name),
            missing_cost: MissingCost::default(),
            class_floor: [0.0; 3],
            concurrency: None,
        }
    }

    fn default_concurrency() -> NonZeroUsize {
        NonZeroUsize::new(Self::DEFAULT_CONCURRENCY).expect("a positive default")
    }

    /// Spends `budget` instead of the stack's own, for example one that other clients or
    /// processes already share. The quota given to the constructor is then unused. The cap on
    /// calls in flight given to [`QuotaStack::concurrency`] (before or after this call) is set
    /// on `budget`; without one, a budget that caps nothing gets
    /// [`QuotaStack::DEFAULT_CONCURRENCY`], and one with a cap of its own keeps it.
    pub fn with_budget(mut self, budget: Budget) -> Self {
        match self.concurrency {
            Some(max) => budget.set_max_in_flight(Some(max)),
            None if budget.snapshot().max_in_flight().is_none() => {
                budget.set_max_in_flight(Some(Self::default_concurrency()));
            }
            None => {}
        }
        // The queue's depth gauge follows the budget's name.
        self.queue = self.queue.named(budget.queue_label());
        self.budget = budget;
        self
    }

    /// At most `max` calls in flight, each holding its slot until its response body ends:
    /// sets the cap of the stack's budget ([`Budget::set_max_in_flight`]), which every holder
    /// of that budget shares, whether the budget is given before or after this call. Defaults
    /// to the quota's cap, else [`QuotaStack::DEFAULT_CONCURRENCY`].
    ///
    /// A cap of zero (every call would wait until its deadline) cannot be written:
    ///
    /// ```compile_fail
    /// # use tower_llm_quota::{Quota, stack::QuotaStack};
    /// let stack = QuotaStack::openai(Quota::new()).concurrency(0);
    /// ```
    pub fn concurrency(mut self, max: NonZeroUsize) -> Self {
        self.concurrency = Some(max);
        self.budget.set_max_in_flight(Some(max));
        self
    }

    /// Retries by `policy`, with the default classifier and jitter. Defaults to
    /// [`RetryPolicy::new`].
    pub fn retry(self, policy: RetryPolicy) -> Self {
        self.retry_layer(RetryAfterLayer::new(policy))
    }

    /// Retries with `layer` (its policy, jitter and retry budget). The stack makes it pause
    /// the stack's budget on a provider 429, replacing any budget it was given.
    pub fn retry_layer(mut self, layer: RetryAfterLayer) -> Self {
        self.retry = layer;
        self
    }

    /// Queues by `config`, in a new queue: take [`QuotaStack::queue_handle`] after this call.
    /// Defaults to [`QueueConfig::new`].
    pub fn queue(mut self, config: QueueConfig) -> Self {
        let name = self.budget.queue_label();
        self.queue = PriorityQueueLayer::new(config).named(name);
        self
    }

    /// Estimates with `estimator` and the default [`Defaults`](crate::estimate::Defaults).
    /// Defaults to a [`CharEstimator`](crate::estimate::CharEstimator).
    pub fn estimator(self, estimator: impl Estimator) -> Self {
        let include = asks_stream_usage(&self.profile);
        self.estimate(EstimateLayer::with_estimator(estimator).include_stream_usage(include))
    }

    /// Estimates with `layer`, for its other settings (defaults, body size, learned output).
    /// The layer's own [`include_stream_usage`](EstimateLayer::include_stream_usage) applies
    /// (the stack's default turns it on for the OpenAI Chat Completions format).
    pub fn estimate(mut self, layer: EstimateLayer) -> Self {
        self.estimate = layer;
        self
    }

    /// Prices requests at `prices`, their usage read as the stack's profile builds it, so
    /// that limits of [`Dimension::Spend`](crate::Dimension::Spend) hold; see
    /// [`EstimateLayer::prices`]. Defaults to none.
    pub fn prices(mut self, prices: Arc<PriceTable>) -> Self {
        self.prices = Some(prices);
        self
    }

    /// What the budget does with a request that has no `Cost` after estimation. Defaults to
    /// [`MissingCost::Reject`].
    pub fn missing_cost(mut self, missing_cost: MissingCost) -> Self {
        self.missing_cost = missing_cost;
        self
    }

    /// Makes requests of `priority` leave `fraction` of every bucket to higher classes; see
    /// [`TokenBudgetLayer::class_floor`]. Defaults to 0 for every class.
    pub fn class_floor(mut self, priority: Priority, fraction: f64) -> Self {
        self.class_floor[priority.index()] = fraction;
        self
    }

    /// The provider profile.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// The budget the stack spends: snapshot it, or hand clones to other stacks.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// The depth and oldest wait by class of the requests waiting in the stack (in the
    /// queue's ordering and in the budget's).
    pub fn queue_handle(&self) -> QueueHandle {
        self.queue.handle().including(&self.budget)
    }

    /// Calls in flight now, across every holder of this stack's budget.
    pub fn in_flight(&self) -> usize {
        self.budget.snapshot().in_flight()
    }
}

/// Whether the stack asks for the usage of streams whose callers did not: for the OpenAI Chat
/// Completions format (OpenAI, Azure, compatible servers), whose streams carry no usage
/// unless asked; the others report it in every stream.
fn asks_stream_usage(profile: &Profile) -> bool {
    profile.wire_format() == crate::usage::WireFormat::OpenAiChat
}

impl<S> Layer<S> for QuotaStack {
    type Service = QuotaService<S>;

    fn layer(&self, client: S) -> Self::Service {
        let reconcile = ReconcileLayer::with_extractor(ProviderUsage::new(self.profile));
        let token_budget = Priority::ALL.into_iter().fold(
            TokenBudgetLayer::new(self.budget.clone()).missing_cost(self.missing_cost),
            |layer, priority| layer.class_floor(priority, self.class_floor[priority.index()]),
        );
        let retry = self.retry.clone().pause_on_rate_limit(self.budget.clone());
        let service = StripUsageLayer.layer(reconcile.layer(client));
        let service = token_budget.layer(service);
        let service = self.queue.layer(service);
        let service = retry.layer(service);
        match &self.prices {
            Some(prices) => (self.estimate.clone())
                .prices(Arc::clone(prices), self.profile.cache_counting())
                .layer(service),
            None => self.estimate.layer(service),
        }
    }
}
