//! Routing: fallback by policy per class, degraded routes, and ramps for migrations.
//!
//! A [`Route`] is a governed client: usually a [`QuotaStack`](crate::stack::QuotaStack)
//! around a client ([`Route::stack`]), with its own budget, provider profile and model (the
//! `model` of the request's JSON body is rewritten for the route). A [`Router`] holds a
//! primary route, ordered fallbacks, each used only under its [`Fallback`] conditions and
//! for its classes, and optionally a ramped route that takes a growing share of the
//! primary's traffic ([`Ramp`]).
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU64;
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use tower::{ServiceExt, service_fn};
//! use tower_llm_quota::routing::{Condition, Fallback, Ramp, Route, Router, ServedBy};
//! use tower_llm_quota::{Dimension, Limit, Priority, Quota, stack::QuotaStack};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), tower_llm_quota::BoxError> {
//! let tpm = |n| Quota::new().with_limit(Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(n).unwrap()));
//! let client = service_fn(|_request: http::Request<Full<Bytes>>| async {
//!     let body = r#"{"usage":{"prompt_tokens":5,"completion_tokens":5,"total_tokens":10}}"#;
//!     Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(body))))
//! });
//! let router = Router::builder(Route::stack("gpt-4o", &QuotaStack::openai(tpm(30_000)), client.clone()))
//!     // Interactive work that would wait for quota, or meets a 5xx, goes to a smaller model.
//!     .fallback(
//!         Route::stack("gpt-4o-mini", &QuotaStack::openai(tpm(200_000)), client.clone()).model("gpt-4o-mini"),
//!         Fallback::when(Condition::would_wait_longer_than(Duration::ZERO))
//!             .or(Condition::provider_5xx())
//!             .classes(&[Priority::Interactive]),
//!     )
//!     // A migration: 5 % of the traffic to the new model, 10 points more a minute.
//!     .ramp(Route::stack("gpt-5", &QuotaStack::openai(tpm(30_000)), client).model("gpt-5"), Ramp::new(5.0, 10.0, 100.0)?)
//!     .build();
//!
//! let request = http::Request::post("https://api.openai.com/v1/chat/completions")
//!     .extension(Priority::Interactive)
//!     .body(Full::new(Bytes::from(r#"{"model":"gpt-4o","max_tokens":50,"messages":[{"role":"user","content":"Hi"}]}"#)))?;
//! let response = router.clone().oneshot(request).await?;
//! let served = response.extensions().get::<ServedBy>().unwrap();
//! assert!(["gpt-4o", "gpt-5"].contains(&served.route()));
//! assert_eq!(router.ramp().unwrap().status().share, 5.0);
//! # Ok(()) }
//! ```
//!
//! # Decisions, in order
//!
//! 1. **The first route.** With a ramp, a request falls within its share by the position of
//!    its [`RouteKey`] (stable: one conversation stays on one model while the share does not
//!    cross it) or, without one, of its arrival (spread evenly); a ramp for one [`Tenant`]
//!    leaves the other tenants on the primary. The rest go to the primary.
//! 2. **Before sending**, for the fallbacks that serve the request's class, in order:
//!    [`Condition::Degrade`] takes the request at once; [`Condition::ContextLengthNeeded`]
//!    when its estimate exceeds the first route's context window and fits the fallback's;
//!    [`Condition::WouldWaitLongerThan`] when the first route's budget cannot admit it in
//!    time. The last asks the budget's own ordering with a class-aware probe: a
//!    [`Budget::try_reserve`](crate::Budget::try_reserve) behind only the waiters that would
//!    be admitted before a request of its class (its class and those above, and lower fronts
//!    aging has lifted to it), which gives back at once what it got: a request sent to a
//!    fallback holds nothing on the route it left, and never queued there.
//! 3. **After an answer**: a final 5xx or 429 (the route's retry layer gave up; a 429 for a
//!    service tier without capacity is [`Condition::TierUnavailable`], or a rate limit to a
//!    fallback that does not name it, and [`Route::service_tier`] sends it at another tier), or an error
//!    from a route that could not take the request (its store unavailable and fail-closed, its
//!    provider unreachable, or a cap of spend of its tenant path that cannot pay its estimate:
//!    [`Condition::SpendCapped`], for a cheaper route), goes to the next fallback for that
//!    condition. Only a failure
//!    that never reached the provider ([`Ambiguity::may_route_elsewhere`]) or that the
//!    provider answered goes elsewhere: a timeout or a reset before the response head stays
//!    on its route. The failed answer is dropped first, which settles its reservation.
//! 4. **The compatibility check** ([`RouterBuilder::compatible`]) runs before every
//!    fallback: when it says no, the request stays — it waits on its route, or gets its
//!    route's answer or normalized local refusal. Never a silent change of semantics.
//!
//! A response is returned to the caller as soon as its head is in: once a streamed body is
//! being passed on, nothing routes it elsewhere (a cut fails the body with
//! [`Interrupted`](crate::retry::Interrupted)). Every response carries [`ServedBy`]: the
//! route, its provider, why a fallback served it.
//!
//! # Ramps
//!
//! A [`Ramp`] starts at a share, grows by points per minute at each evaluation period while
//! the route is healthy, up to a ceiling. A period with too many 429s (final or retried
//! inside the route), too many requests waiting in the route's budget, or a p95 latency to
//! the head above its threshold pauses the growth (or steps the share back,
//! [`Ramp::step_back`]); a healthy period resumes it. [`RampHandle::status`] reads the share
//! and why it is paused.
//!
//! # Metrics and tracing
//!
//! `llm_fallbacks_total{from_provider,to_provider,reason}` counts every fallback decision
//! ([`Reason::as_str`]); `llm_ramp_share{route}` (percent) and `llm_ramp_paused{route}` (1 or
//! 0) follow the ramp. Each decision is a tracing event: `routed` (debug), `routed to a
//! fallback` (info), `fallback refused by the compatibility check`, `ramp paused`, `ramp
//! growing` (debug).
//!
//! # Why a router, not a layer
//!
//! A layer wraps one service; a router holds several governed clients and picks one per
//! request. Each route keeps its whole stack (its budget, queue, retries), so a request sent
//! to a fallback queues and reserves there only.
//!
//! [`Ambiguity::may_route_elsewhere`]: crate::retry::Ambiguity::may_route_elsewhere

mod condition;
mod future;
mod inner;
mod ramp;
mod route;
mod service;

pub use condition::{Condition, Fallback, Reason};
pub use future::ResponseFuture;
pub use inner::RampHandle;
pub use ramp::{InvalidRamp, PauseReason, Ramp, RampStatus};
pub use route::{
    BoxRouteBody, BoxRouteService, RequestView, Route, RouteInfo, RouteKey, ServedBy, Tenant,
};
pub use service::{DEFAULT_MAX_BODY, Router, RouterBuilder};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds() {
        fn send_sync_unpin<T: Send + Sync + Unpin>() {}
        fn send_unpin<T: Send + Unpin>() {}
        send_sync_unpin::<Router<()>>();
        send_sync_unpin::<RouterBuilder<()>>();
        send_sync_unpin::<Route<()>>();
        send_sync_unpin::<RampHandle>();
        send_sync_unpin::<Ramp>();
        send_sync_unpin::<Fallback>();
        send_sync_unpin::<ServedBy>();
        send_unpin::<ResponseFuture<()>>();
    }
}
