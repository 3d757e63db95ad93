//! A quota-aware, multi-tenant LLM gateway on axum, governed by `tower-llm-quota`'s stack:
//! OpenAI-, Anthropic- and Gemini-compatible routes, per-tenant limits, one budget per provider
//! account, refusals in each provider's own shape, an admin API, Prometheus metrics and a live
//! status page. The `llm-quota-gateway` binary is a thin command line over this library.
//!
//! The surface is small: a [`Config`] parsed from TOML, a [`Gateway`] built from it with its
//! state kept as [`Persistence`] says, [`serve()`] until a stop signal, and
//! [`Gateway::reload`] / [`Gateway::reload_file`] to apply a changed configuration.
//!
//! ```no_run
//! use tower_llm_quota_gateway::{Config, Gateway, Persistence, serve};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let config = Config::from_toml(&std::fs::read_to_string("gateway.toml")?)?;
//! let gateway = Gateway::new(&config, &Persistence::Memory).await?;
//! let listener = tokio::net::TcpListener::bind(config.listen()).await?;
//! serve(gateway, listener, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! # Ok(())
//! # }
//! ```
//!
//! The configuration reference and the operator's guide are in the crate's README; the path a
//! request takes through these modules is drawn in its "Architecture" section.

// No function longer than the workspace's `too-many-lines-threshold` (clippy.toml).
#![warn(clippy::too_many_lines)]

pub(crate) mod account;
pub(crate) mod admin;
pub(crate) mod alerts;
pub(crate) mod audit;
pub(crate) mod auth;
pub(crate) mod catalog;
pub(crate) mod clients;
pub(crate) mod config;
pub(crate) mod fit;
mod gateway;
pub(crate) mod gemini;
pub(crate) mod metered;
pub(crate) mod models;
pub(crate) mod nearest;
#[cfg(feature = "otel")]
pub(crate) mod otel;
pub(crate) mod overrides;
pub(crate) mod refusal;
pub(crate) mod reload;
pub(crate) mod report;
pub(crate) mod request;
pub(crate) mod routes;
pub(crate) mod serve;
pub(crate) mod simulated;
pub(crate) mod state;
pub(crate) mod status;
pub(crate) mod store;
pub(crate) mod tenancy;
pub(crate) mod usage;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use config::Api;
pub use config::{Config, ConfigError};
pub use gateway::{Gateway, Reloaded};
use refusal::{Dialect, Refusal};
pub use serve::serve;
pub use store::Persistence;

/// The routes.
impl Gateway {
    /// Every route of the gateway.
    pub(crate) fn router(self: &Arc<Self>) -> Router {
        let api = |api: Api| {
            move |State(gateway): State<Arc<Gateway>>, request: Request| {
                request::handle(gateway, api, request)
            }
        };
        Router::new()
            .route(Api::Chat.path(), post(api(Api::Chat)))
            .route(Api::Responses.path(), post(api(Api::Responses)))
            .route(Api::Messages.path(), post(api(Api::Messages)))
            .route(Api::Embeddings.path(), post(api(Api::Embeddings)))
            .route(Api::Completions.path(), post(api(Api::Completions)))
            .route(Api::CountTokens.path(), post(api(Api::CountTokens)))
            .route("/v1beta/models", get(catalog::gemini_list))
            .route(
                "/v1beta/models/{target}",
                post(gemini_call).get(catalog::gemini_get),
            )
            .route("/v1/models", get(catalog::list))
            .route("/v1/models/{id}", get(catalog::retrieve))
            .route("/", get(status::page))
            .route(
                "/status.json",
                get(status::json).route_layer(from_fn_with_state(self.clone(), require_status)),
            )
            .route("/healthz", get(status::healthz))
            .route(
                "/metrics",
                get(metrics).route_layer(from_fn_with_state(self.clone(), require_status)),
            )
            .nest("/admin", admin::routes(self.clone()))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .with_state(self.clone())
    }
}

/// `POST /v1beta/models/{model}:{method}`: Google's native API, the call its path names.
async fn gemini_call(
    State(gateway): State<Arc<Gateway>>,
    Path(target): Path<String>,
    mut request: Request,
) -> Response {
    let Some(native) = gemini::Native::parse(&target, request.uri().query()) else {
        let path = request.uri().path().to_owned();
        return gateway.refuse_in(Dialect::Gemini, None, Refusal::not_found(&path));
    };
    gemini::key_from_query(&mut request);
    let api = native.method.api();
    request.extensions_mut().insert(native);
    request::handle(gateway, api, request).await
}

/// `/status.json` and `/metrics` behind the status token, when one is configured (the status
/// page itself holds no figures: it sends the token it finds after `#token=` in its URL).
async fn require_status(
    State(gateway): State<Arc<Gateway>>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(token) = &gateway.status_token else {
        return next.run(request).await;
    };
    let presented = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if auth::secret_matches(presented, token) {
        next.run(request).await
    } else {
        let body = serde_json::json!({"error": {"type": "authentication",
            "message": "this route needs the status token (Authorization: Bearer)"}});
        (http::StatusCode::UNAUTHORIZED, axum::Json(body)).into_response()
    }
}

/// 404 with a JSON body: no such route.
async fn not_found(uri: http::Uri) -> Response {
    Refusal::not_found(uri.path()).into_response()
}

/// 405 with a JSON body: the route exists, not for this method.
async fn method_not_allowed(method: http::Method, uri: http::Uri) -> Response {
    Refusal::method_not_allowed(&method, uri.path()).into_response()
}

async fn metrics(State(gateway): State<Arc<Gateway>>, uri: http::Uri) -> Response {
    let Some(handle) = &gateway.metrics else {
        return Refusal::not_found(uri.path())
            .message("metrics are off ([server] metrics = false)")
            .into_response();
    };
    status::record_gauges(&gateway);
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
        .into_response()
}
