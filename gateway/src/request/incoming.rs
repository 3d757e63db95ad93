//! Step 1: what a caller asks. The body is read (within the size limit and the body timeout)
//! and parsed once: its model, whether it streams, and its estimated cost as the accounts'
//! estimation layers read it, which the stack then takes as read.

use std::future::Future;
use std::pin::Pin;

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::Value;
use tower_llm_quota::estimate::{
    CharEstimator, Defaults, RequestEstimate, read_embeddings_json, read_request_json,
};
use tower_llm_quota::{BoxError, Cost, Priority};

use crate::Gateway;
use crate::auth::Caller;
use crate::config::Api;
use crate::fit::Shaped;
use crate::gemini::{Method, Native};
use crate::refusal::Refusal;

/// A request as the gateway took it in: its API and class, its body, and what was read of it.
#[derive(Debug)]
pub(super) struct Incoming {
    pub(super) api: Api,
    /// The class it waits in: the key's, or its `x-priority` where the key allows one.
    pub(super) class: Priority,
    /// The body as sent upstream (rewritten when its output is bounded or lowered).
    pub(super) body: Bytes,
    pub(super) checked: Checked,
    /// How its output bound was written, when a hard cap made the gateway write one.
    pub(super) shaped: Option<Shaped>,
}

/// Reads and checks the body of `caller`'s request of `api`, refused when the gateway stops,
/// when no account serves `api`, or when the body is too large, too slow or unreadable.
///
/// # Cancel safety
///
/// Dropped while the body is read, nothing was reserved: the body is dropped with it.
pub(super) async fn read(
    gateway: &Gateway,
    (api, caller): (Api, &Caller),
    parts: &Parts,
    body: Body,
) -> Result<Incoming, Refusal> {
    if gateway.shutdown.is_cancelled() {
        return Err(Refusal::stopping());
    }
    if gateway.account(api).is_none() {
        return Err(Refusal::not_served(api.path()));
    }
    let body = read_body(body, gateway.max_body_bytes).await?;
    let checked = check_body(api, parts.extensions.get::<Native>(), &body)?;
    Ok(Incoming {
        api,
        class: caller.class(&parts.headers),
        body,
        checked,
        shaped: None,
    })
}

/// A body's bytes, at most `max` of them, as a boxed `Send` future.
pub(super) fn collect<B>(
    body: B,
    max: usize,
) -> Pin<Box<dyn Future<Output = Result<Bytes, BoxError>> + Send>>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    Box::pin(async move { Ok(Limited::new(body, max).collect().await?.to_bytes()) })
}

async fn read_body(body: Body, max: usize) -> Result<Bytes, Refusal> {
    match collect(body, max).await {
        Ok(bytes) => Ok(bytes),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            Err(Refusal::too_large(max))
        }
        Err(error) if crate::serve::BodyTimeout::is_in(&*error) => {
            Err(Refusal::body_timeout(error.to_string()))
        }
        Err(error) => Err(Refusal::bad_request(format!(
            "the body could not be read: {error}"
        ))),
    }
}

/// A request body as the gateway checked it.
#[derive(Debug)]
pub(super) struct Checked {
    /// What the estimation layer reads of it; none for a count of tokens.
    pub(super) read: Option<RequestEstimate>,
    /// Its estimated cost.
    pub(super) cost: Cost,
    /// Whether it asks for a stream.
    pub(super) streaming: bool,
    /// The model it names.
    pub(super) model: String,
}

/// The request's estimated cost, whether it streams and its model, or why its body is
/// refused. A native Gemini request's model and stream are its path's (`native`).
fn check_body(api: Api, native: Option<&Native>, body: &[u8]) -> Result<Checked, Refusal> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| Refusal::bad_request(format!("the body is not JSON: {e}")))?;
    let object = value
        .as_object()
        .ok_or_else(|| Refusal::bad_request("the body is not a JSON object"))?;
    let fields = needed_fields(api, native);
    let field = fields[0];
    if !fields.iter().any(|field| object.contains_key(*field)) {
        return Err(Refusal::bad_request(format!("the body has no `{field}`")));
    }
    let (model, streaming) = match native {
        Some(native) => (native.model.to_string(), native.streams()),
        None => {
            let model = match object.get("model").and_then(Value::as_str) {
                Some(model) if !model.trim().is_empty() => model.to_owned(),
                _ => return Err(Refusal::bad_request("the body names no `model`")),
            };
            let streaming = object
                .get("stream")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            (model, streaming)
        }
    };
    // Read as the accounts' estimation layers read it (their default estimator and defaults),
    // from the value parsed above: the body is parsed once.
    let chars = CharEstimator::new();
    let defaults = Defaults::new();
    let read = match api {
        // Anthropic and Google count tokens without billing any: one request.
        Api::CountTokens | Api::GeminiCountTokens => None,
        Api::Embeddings | Api::EmbedContent => Some(read_embeddings_json(&value, &chars)),
        _ => Some(read_request_json(&value, &chars, &defaults)),
    };
    let cost = match &read {
        None => Cost::new(0, 0),
        Some(Some(read)) => read.cost(&defaults),
        Some(None) => {
            return Err(Refusal::bad_request(format!(
                "the `{field}` cannot be read"
            )));
        }
    };
    Ok(Checked {
        read: read.flatten(),
        cost,
        streaming,
        model,
    })
}

/// The fields a body of `api` must have one of (the first is named when none is there).
fn needed_fields(api: Api, native: Option<&Native>) -> &'static [&'static str] {
    match (api, native.map(|n| n.method)) {
        (Api::Responses | Api::Embeddings, _) => &["input"],
        (Api::Completions, _) => &["prompt"],
        (Api::Chat | Api::Messages | Api::CountTokens, _) => &["messages"],
        (Api::GenerateContent | Api::GeminiCountTokens, _) => &["contents"],
        (Api::EmbedContent, Some(Method::BatchEmbed)) => &["requests"],
        (Api::EmbedContent, _) => &["content"],
    }
}
