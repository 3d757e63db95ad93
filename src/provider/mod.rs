//! Provider profiles: usage from bodies and streams, adaptation from rate-limit headers, and
//! one normalized rate-limit error.
//!
//! A [`Profile`] says how a provider (OpenAI Chat and Responses, Azure OpenAI, Anthropic,
//! Gemini, OpenAI-compatible servers) reports usage and limits. [`ProviderUsage`] plugs it into
//! [`ReconcileLayer`](crate::ReconcileLayer): it settles each reservation with the usage found
//! in the body (JSON, or the event stream's final usage), and on every response lowers the
//! budget when the provider reports less left than we hold. [`RateLimitError`] tells a local
//! refusal from a provider's 429, with the dimension, scope and wait.

pub(crate) mod classify;
mod extract;
pub(crate) mod hints;
mod profile;
mod rate_limit;
mod strip;

pub use crate::estimate::InjectedStreamUsage;
pub use crate::parse::retry_after;
pub use crate::scope::Scope;
pub use extract::{ProviderScan, ProviderUsage};
pub(crate) use profile::reports_of_any_provider;
pub use profile::{AdoptLimits, LimitReport, Profile};
#[cfg(feature = "metrics")]
pub(crate) use rate_limit::limit_type;
pub use rate_limit::{Decision, LimitedBy, RateLimitError};
pub use strip::{StripUsage, StripUsageBody, StripUsageFuture, StripUsageLayer};
