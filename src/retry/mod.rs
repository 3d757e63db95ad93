//! The safety net: retry what is transient, obey the provider, spread the herd, share the
//! cooldown.
//!
//! [`RetryAfterLayer`] sits outermost. It classifies each failed attempt ([`Classify`];
//! [`ProviderErrors`] by default): 429, 408, 409, 5xx, "overloaded", connection resets and
//! timeouts are transient; validation, authentication, context-length, policy and
//! quota-exhausted failures are not, and neither are this crate's local decisions. It waits at
//! least what the provider asks (`retry-after-ms`, `x-ms-retry-after-ms`, `retry-after` as
//! seconds or a date, Gemini's `RetryInfo`), with jitter so that a herd does not come back in the
//! same millisecond, or full-jitter backoff without a hint ([`RetryPolicy`]).
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU64;
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//! use tower_llm_quota::{
//!     Budget, Cost, Dimension, Limit, PriorityQueueLayer, Quota, RetryAfterLayer, RetryPolicy,
//!     TokenBudgetLayer,
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_llm_quota::BoxError> {
//! let budget = Budget::new(Quota::new().with_limit(Limit::per_minute(
//!     Dimension::TotalTokens,
//!     NonZeroU64::new(30_000).unwrap(),
//! )));
//! let client = service_fn(|_req: http::Request<String>| async {
//!     let body = http_body_util::Full::new(bytes::Bytes::from("ok"));
//!     Ok::<_, std::convert::Infallible>(http::Response::new(body))
//! });
//! let mut llm = ServiceBuilder::new()
//!     .layer(RetryAfterLayer::new(RetryPolicy::new()).pause_on_rate_limit(budget.clone()))
//!     .layer(PriorityQueueLayer::default())
//!     .layer(TokenBudgetLayer::new(budget))
//!     .service(client);
//!
//! let mut request = http::Request::new(String::from("{...}"));
//! request.extensions_mut().insert(Cost::new(800, 200));
//! let response = llm.ready().await?.call(request).await?;
//! assert!(response.status().is_success());
//! # Ok(()) }
//! ```
//!
//! # Rules
//!
//! - **The provider's wait is a minimum.** It is re-read on every attempt; a wait above
//!   [`RetryPolicy::max_honored_delay`] (a daily quota) is not honoured: the failure is
//!   permanent. With a hint, the retry comes between the hint and the hint plus twice the larger
//!   of the hint and the backoff window (at most the backoff cap).
//! - **Per class** ([`Priority`](crate::Priority) in the request): attempts and total time are
//!   bounded (3 / 8 s interactive, 5 / 60 s async, 8 / 300 s batch by default), and a wait
//!   that would cross them, or the request's [`Deadline`](crate::Deadline), is not started.
//!   The total time counts from the first attempt's sending, not from its wait in the queue:
//!   an item that waited ten minutes for its turn still has its whole retry time.
//! - **A retry budget** bounds retries to a share of recent requests (tower's `TpsBudget`: a
//!   deposit per original request when its first attempt ends, a withdrawal per retry; 10 %
//!   plus 1 per second by default), so a failing provider sees about 1.1 attempts per request
//!   instead of 4.
//! - **A transient refusal loses no batch item.** A rate-limited (429) async or batch request
//!   is retried whatever its attempt count and the retry budget: its retry re-enters admission,
//!   which the 429 paused and which spaces it, so it waits for budget, bounded only by its
//!   deadline and its class's total time. Interactive requests keep every limit.
//! - **Every attempt re-enters admission**: the layer sits outside the queue and the budget,
//!   so a retry queues again (keeping its first attempt's [`EnqueuedAt`](crate::queue::EnqueuedAt)
//!   for aging) and reserves again. **A retry keeps its place while it waits**: when a
//!   [`TokenBudgetLayer`](crate::TokenBudgetLayer) answered the last attempt, the retry is
//!   handed to it at once with [`NotBefore`](crate::queue::NotBefore) (the provider's wait,
//!   without jitter: the budget spaces the retries), and waits in the budget's ordering at its
//!   first attempt's place, out of the way of the others until a millisecond before its time:
//!   requests that arrived meanwhile go after it. Without a budget inside, it sleeps here. Requests are re-sent from a clone: the body must be `Clone`
//!   (`Full<Bytes>`, `String`, `Bytes`; buffer a streaming request body first).
//! - **A 429 pauses the shared budget** ([`RetryAfterLayer::pause_on_rate_limit`]): the
//!   dimensions it names (from the rate-limit headers or the message; all when unknown) admit
//!   nothing until the provider's wait (`retry-after` and family), or without one until the
//!   request's cost fits by the provider's reported remaining and refill rate; never until the
//!   provider's bucket is full again (its reset headers), and never longer than
//!   [`RetryPolicy::max_honored_delay`]. The pause keeps the levels (which the response's
//!   rate-limit headers lower to what the provider has left), and
//!   [`Budget::lift_pause`](crate::Budget::lift_pause) ends it early. Overloaded answers (529,
//!   503) pause nothing.
//! - **A service tier without capacity is not a rate limit**: OpenAI flex's 429 "Resource
//!   Unavailable" (not billed) and Groq flex's 498 are [`Transient::TierUnavailable`]; they
//!   pause nobody. Interactive work gets the answer at once (a router's
//!   [`Condition::TierUnavailable`](crate::routing::Condition::TierUnavailable) fallback may
//!   send it at another tier); async and batch work try the tier again later, bounded by their
//!   total time only ([`RetryPolicy::on_tier_unavailable`] chooses per class).
//! - **Streams are not retried once handed over**: only error statuses are retried; a success
//!   goes to the caller at once, with its body untouched. A body that fails after the head
//!   fails with [`Interrupted`]: the provider processed the call.
//! - **Ambiguous failures are retried only with a key** ([`Ambiguity`]): a connect failure
//!   never reached the provider and is retried; a timeout or reset before the response head
//!   may have been processed, and is retried (on the same provider: this layer never routes
//!   elsewhere) only when the request carries an idempotency key, set by
//!   [`IdempotencyLayer`](crate::IdempotencyLayer) or by the caller's own `idempotency-key`
//!   header; without one it fails as [`Permanent::Ambiguous`].
//! - **One span per request**: the layer opens a `llm_request` span (debug level) with the
//!   request's priority and estimated cost; the layers inside record into it the queue wait, the
//!   budget wait, the call time, the attempt, the usage and the decision (`ok`, `local`,
//!   `provider`, `failed`). Without this layer, open a span with those field names around the
//!   call to collect them.
//! - **The outcome is reported**: a final 429 carries a normalized
//!   [`RateLimitError`](crate::provider::RateLimitError) (decision, limit, scope, wait), and
//!   every final failed response, and every success that needed retries, a [`RetryReport`] (attempts,
//!   time waited, last status and class, why it gave up: [`GaveUp`] says permanent, attempts,
//!   time, deadline, retry budget or a wait too long; the wait asked); a failure without a
//!   response is an [`Error`](crate::Error) with the same report. Error bodies (up to 64 KiB)
//!   are read to classify them and returned buffered; a larger one is classified by its
//!   status and headers with an empty body.

mod ambiguity;
mod body;
mod future;
mod layer;
mod policy;
mod service;
mod settings;

pub use crate::error::failure::{FailureClass, Permanent, Transient};
pub use crate::error::report::{GaveUp, RetryReport};
pub use crate::provider::classify::{Classify, ClassifyError, ClassifyFn, Failure, ProviderErrors};
pub use ambiguity::{Ambiguity, Interrupted};
pub use body::RetryBody;
pub use future::ResponseFuture;
pub use layer::RetryAfterLayer;
pub use policy::{
    InvalidRetryPolicy, Jitter, MaxAttempts, RetryPolicy, SeededJitter, ThreadJitter,
    TierUnavailable,
};
pub use service::RetryAfter;
