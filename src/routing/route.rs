//! A route: a governed client, with what the router needs to know about it.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

use super::condition::Reason;
use crate::budget::Budget;
use crate::error::BoxError;
use crate::priority::Priority;
use crate::stack::{QuotaService, QuotaStack};
use tower::Layer;

/// What a router knows about a route: its name, provider, model, context window and the
/// attributes a compatibility check reads (tools, structured output, residency, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteInfo {
    name: Arc<str>,
    provider: Arc<str>,
    model: Option<Arc<str>>,
    service_tier: Option<Arc<str>>,
    context_window: Option<u64>,
    attributes: Vec<(String, String)>,
}

impl RouteInfo {
    /// The route's name (the `route` in [`ServedBy`] and in the ramp gauges).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The provider (the `from_provider` and `to_provider` labels of `llm_fallbacks_total`).
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// The model the request's body names on this route, if the route rewrites it.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The service tier the request's body asks for on this route, if the route rewrites it.
    pub fn service_tier(&self) -> Option<&str> {
        self.service_tier.as_deref()
    }

    /// The model's context window in tokens, if known.
    pub fn context_window(&self) -> Option<u64> {
        self.context_window
    }

    /// The value of the attribute `key`, if set.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// A governed client and what the router knows about it.
///
/// Build it from a [`QuotaStack`] with [`Route::stack`] (the route then knows its budget,
/// which [`Condition::WouldWaitLongerThan`](super::Condition::WouldWaitLongerThan) and the
/// ramp's queue-depth threshold read), or from any service with [`Route::new`].
#[derive(Clone)]
pub struct Route<S> {
    pub(crate) info: Arc<RouteInfo>,
    pub(crate) budget: Option<Budget>,
    pub(crate) service: S,
}

impl<S> Route<S> {
    /// A route named `name` over `service`, with provider `"unknown"`, no budget, no model
    /// rewrite and no context window.
    pub fn new(name: impl Into<String>, service: S) -> Self {
        Self {
            info: Arc::new(RouteInfo {
                name: name.into().into(),
                provider: "unknown".into(),
                model: None,
                service_tier: None,
                context_window: None,
                attributes: Vec::new(),
            }),
            budget: None,
            service,
        }
    }

    fn with_info(mut self, change: impl FnOnce(&mut RouteInfo)) -> Self {
        change(Arc::make_mut(&mut self.info));
        self
    }

    /// The provider's name, for metric labels. Defaults to the stack's profile name with
    /// [`Route::stack`], else `"unknown"`.
    pub fn provider(self, provider: impl Into<String>) -> Self {
        self.with_info(|info| info.provider = provider.into().into())
    }

    /// Rewrites the `model` of the request's JSON body to `model` on this route. Defaults to
    /// no rewrite.
    pub fn model(self, model: impl Into<String>) -> Self {
        self.with_info(|info| info.model = Some(model.into().into()))
    }

    /// Rewrites the `service_tier` of the request's JSON body to `tier` on this route
    /// (OpenAI's `default`, `flex`, `priority`, `auto`; Anthropic's `auto`, `standard_only`):
    /// a fallback at another tier, after [`Condition::TierUnavailable`](super::Condition::TierUnavailable).
    /// Defaults to no rewrite.
    pub fn service_tier(self, tier: impl Into<String>) -> Self {
        self.with_info(|info| info.service_tier = Some(tier.into().into()))
    }

    /// The model's context window in tokens, for
    /// [`Condition::ContextLengthNeeded`](super::Condition::ContextLengthNeeded). Defaults
    /// to unknown (no limit known).
    pub fn context_window(self, tokens: u64) -> Self {
        self.with_info(|info| info.context_window = Some(tokens))
    }

    /// Sets an attribute for compatibility checks (`"residency"`, `"tools"`, ...).
    pub fn attribute(self, key: impl Into<String>, value: impl Into<String>) -> Self {
        let (key, value) = (key.into(), value.into());
        self.with_info(|info| {
            info.attributes.retain(|(k, _)| *k != key);
            info.attributes.push((key, value));
        })
    }

    /// The budget the route spends, for decisions before waiting. Set by [`Route::stack`].
    pub fn budget(self, budget: Budget) -> Self {
        Self {
            budget: Some(budget),
            ..self
        }
    }

    /// What the router knows about the route.
    pub fn info(&self) -> &RouteInfo {
        &self.info
    }
}

/// A route's response body once its client is [boxed](Route::boxed).
pub type BoxRouteBody = UnsyncBoxBody<Bytes, BoxError>;

/// A route's client once [boxed](Route::boxed): any service over `Request<B>`, its response
/// body boxed, its error a [`BoxError`]. Routes of different client types box to this one
/// type, so one [`Router`](super::Router) holds them all.
pub type BoxRouteService<B> = BoxCloneSyncService<Request<B>, Response<BoxRouteBody>, BoxError>;

impl<S> Route<S> {
    /// The same route with its client boxed ([`BoxRouteService`]): routes of different client
    /// types (two `service_fn` closures, a hyper and a reqwest client, stacks over different
    /// clients) then share one type. A box and a virtual call per request: nothing next to a
    /// network call.
    ///
    /// # Example
    ///
    /// ```
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http_body_util::Full;
    /// use tower::{ServiceExt, service_fn};
    /// use tower_llm_quota::routing::{Condition, Fallback, Route, Router, ServedBy};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_llm_quota::BoxError> {
    /// let answer = |text: &'static str| {
    ///     move |_request: http::Request<Full<Bytes>>| async move {
    ///         Ok::<_, std::io::Error>(http::Response::new(Full::new(Bytes::from(text))))
    ///     }
    /// };
    /// // Two closures: two client types, one router.
    /// let router = Router::builder(Route::new("primary", service_fn(answer("a"))).boxed())
    ///     .fallback(
    ///         Route::new("backup", service_fn(answer("b"))).boxed(),
    ///         Fallback::when(Condition::provider_5xx()),
    ///     )
    ///     .build();
    /// let request = http::Request::post("/v1/chat/completions").body(Full::new(Bytes::from("{}")))?;
    /// let response = router.oneshot(request).await?;
    /// assert_eq!(response.extensions().get::<ServedBy>().unwrap().route(), "primary");
    /// # Ok(()) }
    /// ```
    pub fn boxed<B, ResBody>(self) -> Route<BoxRouteService<B>>
    where
        S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + Sync + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError> + 'static,
        B: 'static,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let service = ServiceExt::<Request<B>>::map_response(self.service, |response| {
            response.map(|body| body.map_err(Into::into).boxed_unsync())
        })
        .map_err(Into::into);
        Route {
            info: self.info,
            budget: self.budget,
            service: BoxCloneSyncService::new(service),
        }
    }
}

impl<C> Route<QuotaService<C>> {
    /// A route named `name`: `stack` around `client`, knowing the stack's budget and provider.
    pub fn stack(name: impl Into<String>, stack: &QuotaStack, client: C) -> Self {
        Route::new(name, stack.layer(client))
            .provider(stack.profile().name())
            .budget(stack.budget().clone())
    }
}

impl<S> fmt::Debug for Route<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Route")
            .field("info", &self.info)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

/// The route that served a response, in its extensions (a gateway turns it into a header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedBy {
    pub(crate) route: Arc<str>,
    pub(crate) provider: Arc<str>,
    pub(crate) reason: Option<Reason>,
    pub(crate) ramped: bool,
}

impl ServedBy {
    /// The route's name.
    pub fn route(&self) -> &str {
        &self.route
    }

    /// The route's provider.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Why a fallback served the request; `None` when the first route chosen did.
    pub fn fallback_reason(&self) -> Option<Reason> {
        self.reason
    }

    /// Whether a ramp sent the request to the ramped route.
    pub fn ramped(&self) -> bool {
        self.ramped
    }
}

/// The tenant of a request, in its extensions: the one tenant path of the crate, which a ramp
/// limited to a scope ([`Ramp::for_tenant`](super::Ramp::for_tenant)) matches by prefix.
pub use crate::tenant::Tenant;

/// A request's stable key for ramps (a conversation id, say), in its extensions: every request
/// with the same key falls on the same side of the ramp's share, so one conversation stays on
/// one model while the share does not cross it. Requests without one are spread evenly.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RouteKey(pub String);

/// A request as a compatibility check sees it: its head and its body, before any rewrite.
#[derive(Debug)]
pub struct RequestView<'a> {
    pub(crate) parts: &'a Parts,
    pub(crate) body: &'a Bytes,
}

impl RequestView<'_> {
    /// The request's head.
    pub fn parts(&self) -> &Parts {
        self.parts
    }

    /// The request's body.
    pub fn body(&self) -> &[u8] {
        self.body
    }

    /// The request's class (async when it has none).
    pub fn priority(&self) -> Priority {
        priority_of(self.parts)
    }

    /// Whether the body is a JSON object with the top-level field `name` (not `null`): for
    /// example `"tools"` or `"response_format"`.
    pub fn has_field(&self, name: &str) -> bool {
        serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(self.body)
            .ok()
            .and_then(|object| object.get(name).map(|v| !v.is_null()))
            .unwrap_or(false)
    }
}

pub(crate) fn priority_of(parts: &Parts) -> Priority {
    parts
        .extensions
        .get::<Priority>()
        .copied()
        .unwrap_or(Priority::Async)
}

/// `body` with its top-level `model` set to `model`; unchanged when it is not a JSON object
/// or already names `model`. The object is written again by serde_json, so the order of its
/// fields may change; their values do not.
/// `body` with each of `fields` (a top-level key and its string value) set, when it is a JSON
/// object that does not hold them already; anything else unchanged.
pub(crate) fn rewrite(body: &Bytes, fields: &[(&str, &str)]) -> Bytes {
    let Ok(mut object) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body)
    else {
        return body.clone();
    };
    if fields
        .iter()
        .all(|(key, value)| object.get(*key).and_then(|v| v.as_str()) == Some(*value))
    {
        return body.clone();
    }
    for (key, value) in fields {
        object.insert((*key).into(), serde_json::Value::from(*value));
    }
    match serde_json::to_vec(&object) {
        Ok(bytes) => Bytes::from(bytes),
        Err(_) => body.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_is_rewritten_in_json_bodies_only() {
        let rewrite_model = |body: &Bytes, model: &str| rewrite(body, &[("model", model)]);
        let body = Bytes::from_static(br#"{"model":"a","max_tokens":5,"messages":[]}"#);
        let rewritten = rewrite_model(&body, "b");
        let value: serde_json::Value = serde_json::from_slice(&rewritten).unwrap();
        assert_eq!(value["model"], "b");
        assert_eq!(value["max_tokens"], 5);
        assert_eq!(rewrite_model(&body, "a"), body);
        let text = Bytes::from_static(b"not json");
        assert_eq!(rewrite_model(&text, "b"), text);
    }

    #[test]
    fn the_service_tier_is_set_beside_the_model() {
        let body = Bytes::from_static(br#"{"model":"a","service_tier":"flex","messages":[]}"#);
        let both = rewrite(&body, &[("model", "b"), ("service_tier", "default")]);
        let value: serde_json::Value = serde_json::from_slice(&both).unwrap();
        assert_eq!(
            (&value["model"], &value["service_tier"]),
            (&"b".into(), &"default".into())
        );
        // A body without a tier gets one; a body already at both is returned as is.
        let bare = Bytes::from_static(br#"{"model":"a"}"#);
        let tiered: serde_json::Value =
            serde_json::from_slice(&rewrite(&bare, &[("service_tier", "default")])).unwrap();
        assert_eq!(tiered["service_tier"], "default");
        assert_eq!(
            rewrite(&both, &[("model", "b"), ("service_tier", "default")]),
            both
        );
    }

    #[test]
    fn views_read_fields() {
        let (parts, ()) = http::Request::new(()).into_parts();
        let body = Bytes::from_static(br#"{"tools":[{}],"response_format":null}"#);
        let view = RequestView {
            parts: &parts,
            body: &body,
        };
        assert!(view.has_field("tools"));
        assert!(!view.has_field("response_format"));
        assert!(!view.has_field("model"));
        assert_eq!(view.priority(), Priority::Async);
    }

    #[test]
    fn attributes_replace() {
        let route = Route::new("r", ())
            .attribute("residency", "us")
            .attribute("residency", "eu")
            .context_window(8_000);
        assert_eq!(route.info().attribute("residency"), Some("eu"));
        assert_eq!(route.info().context_window(), Some(8_000));
        assert_eq!(route.info().provider(), "unknown");
    }
}
