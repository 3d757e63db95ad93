//! Where a request goes: for each public model (or, with none configured, for each API) one
//! of the crate's [`Router`]s over the accounts (the primary, fallbacks by condition and
//! class, a ramp), behind the crate's [`IdempotencyLayer`], so that requests carrying the same
//! `Idempotency-Key` (for one tenant) share one upstream call, in flight or within the
//! record's time to live.
//!
//! A route is an account's governed stack for the request's API, the request pointed at that
//! account (its URL, its key) and its `model` renamed for it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt};
use tower_llm_quota::idempotency::{Idempotency, IdempotencyLayer};
use tower_llm_quota::provider::Scope;
use tower_llm_quota::routing::{
    BoxRouteBody, Condition, Fallback, Ramp, RampHandle, RequestView, Route, RouteInfo, Router,
};
use tower_llm_quota::{BoxError, Priority};

use super::account::{Account, Governed, ScopeError, Scoped};
use super::clients::{Dispatched, UpBody};
use super::config::{
    Api, ConfigError, FallbackConfig, FallbackOn, Feature, Format, ModelConfig, RampConfig,
};
use super::store::idempotency::SqliteRecords;
use super::store::{Database, Persistence};
use tower_llm_quota::stack::QuotaBody;

/// One route's service: an account's stack for the request's API.
pub(crate) type RouteService =
    BoxCloneSyncService<Request<Full<Bytes>>, Response<BoxRouteBody>, BoxError>;

/// What a request is sent to: a router, behind the idempotency layer.
pub(crate) type Target = Idempotency<Router<RouteService>>;

/// The gateway's own part of a request on its way through the crate's stack: its API (which
/// stack of the route's account serves it), whether it has left for the provider, and the
/// scope that served it (the last route's that sent it: a fallback's after the primary's).
#[derive(Debug, Clone)]
pub(crate) struct Trip(Arc<TripState>);

#[derive(Debug)]
struct TripState {
    api: Api,
    dispatched: Dispatched,
    served_by: std::sync::Mutex<Option<Scoped>>,
}

impl Trip {
    pub(crate) fn new(api: Api) -> Self {
        Self(Arc::new(TripState {
            api,
            dispatched: Dispatched::default(),
            served_by: std::sync::Mutex::new(None),
        }))
    }

    /// The mark the client sets when the request leaves for the provider.
    pub(crate) fn dispatched_mark(&self) -> Dispatched {
        self.0.dispatched.clone()
    }

    /// Whether the request has left for the provider (until then it is only queued).
    pub(crate) fn dispatched(&self) -> bool {
        self.0.dispatched.is_set()
    }

    /// The scope that sent the request last, if a route did (an answer replayed from an
    /// idempotency record had none).
    pub(crate) fn served_by(&self) -> Option<Scoped> {
        let slot = self.0.served_by.lock();
        slot.unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn sent_by(&self, scoped: &Scoped) {
        let slot = self.0.served_by.lock();
        *slot.unwrap_or_else(|e| e.into_inner()) = Some(scoped.clone());
    }
}

/// A router's routes, by name, and the account each spends.
#[derive(Debug, Clone)]
pub(crate) struct Routed {
    pub(crate) target: Target,
    /// `(route name, account index)`, the primary first.
    pub(crate) routes: Vec<(String, usize)>,
    /// The ramp's handle, when the model has one.
    pub(crate) ramp: Option<RampHandle>,
}

impl Routed {
    /// The account the route `name` spends (the primary's when unknown).
    pub(crate) fn account_of(&self, name: Option<&str>) -> usize {
        name.and_then(|name| self.routes.iter().find(|(n, _)| n == name))
            .unwrap_or(&self.routes[0])
            .1
    }
}

/// The idempotency layer every target shares: its records in the gateway's state (Redis,
/// Postgres, the SQLite `database`), or in memory.
pub(crate) fn idempotency(
    persistence: &Persistence,
    database: Option<&Database>,
) -> Result<IdempotencyLayer, ConfigError> {
    // Only requests that carry a key are deduplicated: two callers sending the same body
    // both want an answer.
    let layer = match (persistence, database) {
        (Persistence::Redis(url), _) => {
            let store = tower_llm_quota_redis::RedisIdempotencyStore::open(url, "gateway")
                .map_err(|e| ConfigError(format!("redis (idempotency): {e}")))?;
            IdempotencyLayer::new(store)
        }
        (Persistence::Postgres(url), _) => {
            let store = tower_llm_quota_postgres::PostgresIdempotencyStore::open(url)
                .map_err(|e| ConfigError(format!("state (idempotency): {e}")))?;
            IdempotencyLayer::new(store)
        }
        (_, Some(Database::Sqlite(sqlite))) => {
            IdempotencyLayer::new(SqliteRecords::new(Arc::clone(sqlite)))
        }
        _ => IdempotencyLayer::in_memory(),
    };
    Ok(layer.derive_keys(false).ttl(Duration::from_secs(24 * 3600)))
}

/// The route of `account` for `model` (its name upstream, when not the public one) at
/// `tier` (the body's `service_tier` rewritten, when given); `scope` is the model's name
/// upstream when known before the request (a configured model's), for the budget the route
/// spends. Named `account`, `account:model`, with `@tier` after a tier.
fn route(
    accounts: &[Account],
    account: &str,
    (model, scope, tier): (Option<&str>, Option<&str>, Option<&str>),
) -> (Route<RouteService>, usize) {
    let index = accounts
        .iter()
        .position(|a| a.name == account)
        .expect("models name configured accounts (checked with the configuration)");
    let account = Arc::new(accounts[index].clone());
    let mut name = match model {
        Some(model) => format!("{}:{model}", account.name),
        None => account.name.clone(),
    };
    if let Some(tier) = tier {
        name = format!("{name}@{tier}");
    }
    let budget = account.configured_scope(scope).budget().clone();
    let mut route = Route::new(name, service(account.clone(), scope.map(str::to_owned)))
        .provider(account.profile.name())
        .budget(budget);
    // A native Gemini request names its model in its path (written from the scope's name
    // upstream), never in its body.
    if let Some(model) = model.filter(|_| account.format() != Format::Gemini) {
        route = route.model(model);
    }
    if let Some(tier) = tier {
        route = route.service_tier(tier);
    }
    (route, index)
}

/// An account's stack for the API the request names (its `Api` extension) and the scope of
/// its model (`model`, else the one its [`Scope`] names), the request pointed at the account.
fn service(account: Arc<Account>, model: Option<String>) -> RouteService {
    BoxCloneSyncService::new(tower::service_fn(move |request: Request<Full<Bytes>>| {
        let (account, model) = (account.clone(), model.clone());
        async move {
            let (stack, request) = prepare(&account, model, request).await?;
            // The stack's future, boxed: its type names the whole stack, which the compiler
            // cannot prove `Send` through an `async` block.
            let call: StackCall = Box::pin(stack.oneshot(request));
            match call.await {
                Ok(response) => Ok(response.map(|body| body.boxed_unsync())),
                Err(error) => Err(BoxError::from(error)),
            }
        }
    }))
}

/// A governed stack's answer, boxed.
type StackCall = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Result<Response<QuotaBody<UpBody>>, tower_llm_quota::Error>,
            > + Send,
    >,
>;

/// The account's stack for the request's API and model, and the request pointed at the
/// account: its URL, its key, its model's name there. Its trip records the scope.
async fn prepare(
    account: &Account,
    model: Option<String>,
    mut request: Request<Full<Bytes>>,
) -> Result<(Governed, Request<Full<Bytes>>), BoxError> {
    let Some(trip) = request.extensions().get::<Trip>().cloned() else {
        return Err("a gateway request carries its trip".into());
    };
    let api = trip.0.api;
    let model = model.or_else(|| request.extensions().get::<Scope>()?.model.clone());
    let scoped = account
        .scope(model.as_deref())
        .await
        .map_err(|error| BoxError::from(ScopeRefused(error)))?;
    let Some(stack) = scoped.stack(api) else {
        let message = format!("the account {} does not serve {}", account.name, api.path());
        return Err(message.into());
    };
    account.retarget(api, model.as_deref(), &mut request);
    if let Some(scope) = request.extensions_mut().get_mut::<Scope>() {
        scope.provider = Some(account.name.clone());
    }
    trip.sent_by(&scoped);
    Ok((stack, request))
}

/// A model the account cannot give a scope (a name unfit for one, too many models, the store
/// unreachable): nothing was sent.
#[derive(Debug)]
pub(crate) struct ScopeRefused(pub(crate) ScopeError);

impl std::fmt::Display for ScopeRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ScopeRefused {}

/// The router of one public model.
pub(crate) fn model_target<'a>(
    model: &'a ModelConfig,
    accounts: &[Account],
    idempotency: &IdempotencyLayer,
) -> Routed {
    let upstream = |name| upstream_name(model, name);
    let scope = |name: Option<&'a String>| Some(name.unwrap_or(&model.name).as_str());
    let primary_model = upstream(model.model.as_ref());
    let (mut primary, index) = route(
        accounts,
        &model.account,
        (primary_model, scope(model.model.as_ref()), None),
    );
    if let Some(tokens) = model.context_window {
        primary = primary.context_window(tokens);
    }
    let mut routes = vec![(primary.info().name().to_owned(), index)];
    let mut builder = Router::builder(primary).compatible(supports_request);
    for fallback in &model.fallbacks {
        let name = fallback.model.as_ref().or(model.model.as_ref());
        let tier = fallback.service_tier.as_deref();
        let (mut route, index) = route(
            accounts,
            &fallback.account,
            (upstream(name), scope(name), tier),
        );
        if let Some(tokens) = fallback.context_window {
            route = route.context_window(tokens);
        }
        route = with_features(route, fallback.features.as_deref());
        routes.push((route.info().name().to_owned(), index));
        builder = builder.fallback(route, fallback_of(fallback));
    }
    if let Some(ramp) = &model.ramp {
        let name = ramp.model.as_ref().or(model.model.as_ref());
        let (route, index) = route(accounts, &ramp.account, (upstream(name), scope(name), None));
        let route = with_features(route, ramp.features.as_deref());
        routes.push((route.info().name().to_owned(), index));
        builder = builder.ramp(route, ramp_of(ramp));
    }
    let router = builder.build();
    Routed {
        ramp: router.ramp().cloned(),
        target: idempotency.layer(router),
        routes,
    }
}

/// The route, with the features it supports as its `features` attribute (a comma-separated
/// list) when they are limited.
fn with_features(route: Route<RouteService>, features: Option<&[Feature]>) -> Route<RouteService> {
    match features {
        None => route,
        Some(features) => {
            let list: Vec<&str> = features.iter().map(|f| f.as_str()).collect();
            route.attribute("features", list.join(","))
        }
    }
}

/// The compatibility check before a fallback or the ramp: the route supports every feature
/// the request needs (a route without a `features` attribute supports all).
fn supports_request(request: &RequestView<'_>, route: &RouteInfo) -> bool {
    let Some(supported) = route.attribute("features") else {
        return true;
    };
    let needed = needs(request.body());
    Feature::ALL
        .into_iter()
        .filter(|feature| needed.contains(feature))
        .all(|feature| supported.split(',').any(|s| s == feature.as_str()))
}

/// The features a request body needs.
fn needs(body: &[u8]) -> Vec<Feature> {
    let Ok(object) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body)
    else {
        return Vec::new();
    };
    let has = |name: &str| object.get(name).is_some_and(|v| !v.is_null());
    let mut needed = Vec::new();
    if has("tools") || has("functions") {
        needed.push(Feature::Tools);
    }
    if has("response_format") {
        needed.push(Feature::ResponseFormat);
    }
    let image_part = |part: &serde_json::Value| {
        matches!(
            part.get("type").and_then(|t| t.as_str()),
            Some("image_url" | "image")
        )
    };
    let images = object
        .get("messages")
        .and_then(|m| m.as_array())
        .into_iter()
        .flatten()
        .filter_map(|message| message.get("content").and_then(|c| c.as_array()))
        .flatten()
        .any(image_part);
    if images {
        needed.push(Feature::Images);
    }
    needed
}

/// A route's model upstream (`name`, else the public name), when not the public name.
fn upstream_name<'a>(model: &'a ModelConfig, name: Option<&'a String>) -> Option<&'a str> {
    let name = name.unwrap_or(&model.name);
    (*name != model.name).then_some(name.as_str())
}

/// The router of an API when no model is configured: its one account.
pub(crate) fn api_target(
    index: usize,
    accounts: &[Account],
    idempotency: &IdempotencyLayer,
) -> Routed {
    let (primary, index) = route(accounts, &accounts[index].name, (None, None, None));
    Routed {
        routes: vec![(primary.info().name().to_owned(), index)],
        target: idempotency.layer(Router::builder(primary).build()),
        ramp: None,
    }
}

fn fallback_of(config: &FallbackConfig) -> Fallback {
    let condition = |on: FallbackOn| match on {
        FallbackOn::ServerError => Condition::provider_5xx(),
        FallbackOn::RateLimited => Condition::rate_limited(),
        FallbackOn::Unavailable => Condition::primary_unavailable(),
        FallbackOn::WouldWait => {
            Condition::would_wait_longer_than(Duration::from_secs_f64(config.would_wait_seconds))
        }
        FallbackOn::ContextLength => Condition::context_length_needed(),
        FallbackOn::Degrade => Condition::degrade(),
        FallbackOn::TierUnavailable => Condition::tier_unavailable(),
        FallbackOn::SpendCapped => Condition::spend_capped(),
    };
    let mut conditions = config.on.iter().copied().map(condition);
    let first = conditions
        .next()
        .expect("a fallback has a condition (checked)");
    let mut fallback = conditions.fold(Fallback::when(first), Fallback::or);
    if let Some(classes) = &config.classes {
        let classes: Vec<Priority> = classes.iter().copied().map(Priority::from).collect();
        fallback = fallback.classes(&classes);
    }
    fallback
}

fn ramp_of(config: &RampConfig) -> Ramp {
    Ramp::new(
        config.start_percent,
        config.percent_per_minute,
        config.max_percent,
    )
    .expect("a valid ramp (checked with the configuration)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_needs_what_its_body_asks_for() {
        let needs = |body: &str| needs(body.as_bytes());
        assert_eq!(needs(r#"{"model":"m","messages":[]}"#), []);
        assert_eq!(
            needs(r#"{"tools":[{"type":"function"}]}"#),
            [Feature::Tools]
        );
        assert_eq!(
            needs(r#"{"tools":null,"functions":[{}]}"#),
            [Feature::Tools]
        );
        assert_eq!(
            needs(r#"{"response_format":{"type":"json_schema"}}"#),
            [Feature::ResponseFormat]
        );
        let image = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"?"},
            {"type":"image_url","image_url":{"url":"data:"}}]}]}"#;
        assert_eq!(needs(image), [Feature::Images]);
        // Not JSON: nothing known is needed.
        assert_eq!(needs("not json"), []);
    }
}
