//! A route: a governed client, with what the router needs to know about it.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use serde_json::value::RawValue;
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
    pub(crate) earlier_attempts: u32,
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

    /// The provider calls the routes tried before this one made (and that failed): with the
    /// attempts of this route's own [`RetryReport`](crate::retry::RetryReport), every call
    /// the request made.
    pub fn earlier_attempts(&self) -> u32 {
        self.earlier_attempts
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

/// `body` with each of `fields` (a top-level key and its string value) set, when it is a JSON
/// object that does not hold them already; anything else unchanged.
///
/// Only the values set change: the body is read once for the spans of its top-level values
/// (without building its tree), each value named is written over its span, and a key the body
/// lacks is added first in the object. Every other byte, and the order of the fields, stays
/// as it came.
pub(crate) fn rewrite(body: &Bytes, fields: &[(&str, &str)]) -> Bytes {
    let Ok(object) = serde_json::from_slice::<HashMap<String, &RawValue>>(body) else {
        return body.clone();
    };
    let holds = |key: &str, value: &str| {
        object
            .get(key)
            .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
            .is_some_and(|current| current == value)
    };
    if fields.iter().all(|(key, value)| holds(key, value)) {
        return body.clone();
    }
    let json = |text: &str| serde_json::Value::from(text).to_string();
    // The values written over their spans, in the body's order; the fields added after `{`.
    let mut edits: Vec<(Range<usize>, String)> = Vec::with_capacity(fields.len());
    let mut added = String::new();
    for (key, value) in fields {
        match object.get(*key) {
            // A borrowed raw value is a slice of the body: its place is its offset.
            Some(raw) => match span_in(body, raw.get()) {
                Some(span) => edits.push((span, json(value))),
                None => return body.clone(),
            },
            None => {
                added.push_str(&json(key));
                added.push(':');
                added.push_str(&json(value));
                added.push(',');
            }
        }
    }
    edits.sort_by_key(|(span, _)| span.start);
    if object.is_empty() {
        // `{}`: no field follows the added ones.
        added.pop();
    }
    // Only whitespace comes before the object's `{`.
    let open = body.iter().position(|&b| b == b'{').map_or(0, |at| at + 1);
    let mut out = Vec::with_capacity(body.len() + added.len() + 64);
    out.extend_from_slice(&body[..open]);
    out.extend_from_slice(added.as_bytes());
    let mut at = open;
    for (span, value) in edits {
        out.extend_from_slice(&body[at..span.start]);
        out.extend_from_slice(value.as_bytes());
        at = span.end;
    }
    out.extend_from_slice(&body[at..]);
    Bytes::from(out)
}

/// Where `part`, a slice of `body`, lies in it.
fn span_in(body: &[u8], part: &str) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (end <= body.len()).then_some(start..end)
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
    fn only_the_values_set_change() {
        let body = Bytes::from_static(
            b"{ \"stream\": true,\n  \"model\" : \"a\\u0041\", \"messages\": [{\"model\": \"inner\"}] }",
        );
        let rewritten = rewrite(&body, &[("model", "b\"c")]);
        assert_eq!(
            &rewritten[..],
            b"{ \"stream\": true,\n  \"model\" : \"b\\\"c\", \"messages\": [{\"model\": \"inner\"}] }"
        );
        // An escaped value equal to the one asked is left as it is.
        assert_eq!(rewrite(&body, &[("model", "aA")]), body);
        // A key the body lacks comes first; an empty object gets it alone.
        let added = rewrite(&body, &[("service_tier", "flex")]);
        assert!(added.starts_with(b"{\"service_tier\":\"flex\", \"stream\""));
        let empty = rewrite(&Bytes::from_static(b" {} "), &[("model", "m")]);
        assert_eq!(&empty[..], b" {\"model\":\"m\"} ");
        // Not an object: unchanged.
        let array = Bytes::from_static(b"[{\"model\":\"a\"}]");
        assert_eq!(rewrite(&array, &[("model", "b")]), array);
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i32>().prop_map(serde_json::Value::from),
            "[a-z\"\\\\ é\n]{0,6}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(2, 12, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::btree_map("(model|x|service_tier)", inner, 0..3)
                    .prop_map(|map| serde_json::Value::Object(map.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// Against the reference (the object parsed, the fields inserted): the same object,
        /// whatever the body's spacing, escapes, nesting and fields.
        #[test]
        fn rewriting_agrees_with_inserting_the_fields(
            object in proptest::collection::btree_map(
                "(model|service_tier|messages|stream|[a-z]{1,3})", json_value(), 0..5),
            pretty in proptest::bool::ANY,
            model in "[a-z\"\\\\ é-]{0,8}",
            tier in proptest::option::of("(flex|default|priority)"),
            tier_first in proptest::bool::ANY,
        ) {
            let object: serde_json::Map<String, serde_json::Value> = object.into_iter().collect();
            let body = Bytes::from(match pretty {
                true => serde_json::to_vec_pretty(&object).unwrap(),
                false => serde_json::to_vec(&object).unwrap(),
            });
            let mut fields = vec![("model", model.as_str())];
            fields.extend(tier.as_deref().map(|tier| ("service_tier", tier)));
            if tier_first {
                fields.reverse();
            }
            let mut expected = object.clone();
            for (key, value) in &fields {
                expected.insert((*key).into(), (*value).into());
            }
            let rewritten = rewrite(&body, &fields);
            let read: serde_json::Map<String, serde_json::Value> =
                serde_json::from_slice(&rewritten).unwrap();
            proptest::prop_assert_eq!(read, expected.clone());
            if expected == object {
                proptest::prop_assert_eq!(rewritten, body);
            }
        }
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
