//! Google's native Gemini API, as Google's SDKs call it: `POST
//! /v1beta/models/{model}:{method}` (`generateContent`, `streamGenerateContent`, `countTokens`,
//! `embedContent`, `batchEmbedContents`) and `GET /v1beta/models`.
//!
//! The model and the method are in the path, not the body: the path is parsed here into a
//! [`Native`] call, which travels with the request (the upstream path is written from it and
//! the route's model), and the request goes on as any other (`forward`; the routes are in
//! `mod.rs`, the model list in `catalog.rs`). The caller's key comes in `x-goog-api-key` or
//! `?key=`; it is a gateway key, and the query is never forwarded.

use std::sync::Arc;

use axum::extract::Request;
use serde_json::Value;

use super::config::Api;

/// The header Google's SDKs send the key in.
pub(crate) const KEY_HEADER: &str = "x-goog-api-key";

/// A method of a model, as the path names it after the colon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    Generate,
    Stream,
    CountTokens,
    Embed,
    BatchEmbed,
}

impl Method {
    pub(crate) const ALL: [Method; 5] = [
        Method::Generate,
        Method::Stream,
        Method::CountTokens,
        Method::Embed,
        Method::BatchEmbed,
    ];

    /// Its name in a path.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Method::Generate => "generateContent",
            Method::Stream => "streamGenerateContent",
            Method::CountTokens => "countTokens",
            Method::Embed => "embedContent",
            Method::BatchEmbed => "batchEmbedContents",
        }
    }

    /// The gateway API that serves it.
    pub(crate) fn api(self) -> Api {
        match self {
            Method::Generate | Method::Stream => Api::GenerateContent,
            Method::CountTokens => Api::GeminiCountTokens,
            Method::Embed | Method::BatchEmbed => Api::EmbedContent,
        }
    }
}

/// A native request: the model its path names (as the caller named it), its method, and
/// whether a stream comes as server-sent events (`alt=sse`) or as one JSON array.
#[derive(Debug, Clone)]
pub(crate) struct Native {
    pub(crate) model: Arc<str>,
    pub(crate) method: Method,
    pub(crate) sse: bool,
}

impl Native {
    /// The call a path's last segment names (`gemini-2.5-flash:generateContent`), with the
    /// query's `alt`.
    pub(crate) fn parse(target: &str, query: Option<&str>) -> Option<Self> {
        let (model, method) = target.rsplit_once(':')?;
        let method = Method::ALL.into_iter().find(|m| m.as_str() == method)?;
        let model = model.strip_prefix("models/").unwrap_or(model);
        // Written into the upstream path: letters, digits, `.`, `-`, `_` only.
        let fits = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_');
        if model.is_empty() || model.len() > 128 || !model.chars().all(fits) {
            return None;
        }
        Some(Self {
            model: model.into(),
            method,
            sse: query_value(query, "alt") == Some("sse"),
        })
    }

    /// Whether it asks for a stream.
    pub(crate) fn streams(&self) -> bool {
        self.method == Method::Stream
    }

    /// The path (and query) upstream for `model`, the name the route gives the model there.
    pub(crate) fn upstream_path(&self, model: &str) -> String {
        let alt = if self.sse { "?alt=sse" } else { "" };
        format!("/v1beta/models/{model}:{}{alt}", self.method.as_str())
    }
}

/// The value of `name` in a query string.
fn query_value<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

/// `?key=` moved into the key header (when the request has none there), for the gateway's
/// authentication: Google's SDKs send either.
pub(crate) fn key_from_query(request: &mut Request) {
    let key = query_value(request.uri().query(), "key")
        .and_then(|key| http::HeaderValue::from_str(key).ok());
    if let Some(key) = key {
        request.headers_mut().entry(KEY_HEADER).or_insert(key);
    }
}

/// What a Google 429's `QuotaFailure` names, for the refusal's message: `quota
/// GenerateRequestsPerMinutePerProjectPerModel, model gemini-2.5-flash`.
pub(crate) fn violation(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let violation = value["error"]["details"]
        .as_array()?
        .iter()
        .filter_map(|detail| detail["violations"].as_array())
        .flatten()
        .next()?;
    let quota = violation["quotaId"]
        .as_str()
        .or_else(|| violation["quotaMetric"].as_str())?;
    Some(match violation["quotaDimensions"]["model"].as_str() {
        Some(model) => format!("quota {quota}, model {model}"),
        None => format!("quota {quota}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_names_the_model_the_method_and_the_stream_form() {
        let call =
            Native::parse("gemini-2.5-flash:streamGenerateContent", Some("alt=sse")).unwrap();
        assert_eq!(&*call.model, "gemini-2.5-flash");
        assert!(call.streams() && call.sse);
        assert_eq!(
            call.upstream_path("gemini-2.5-pro"),
            "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
        );
        let call = Native::parse("models/e:batchEmbedContents", Some("key=k")).unwrap();
        assert_eq!(
            (&*call.model, call.method.api(), call.sse),
            ("e", Api::EmbedContent, false)
        );
        assert!(Native::parse("m:unknownMethod", None).is_none());
        assert!(Native::parse(":generateContent", None).is_none());
        assert!(Native::parse("no-method", None).is_none());
        assert!(Native::parse("../x:generateContent", None).is_none());
        assert!(Native::parse("a?b:generateContent", None).is_none());
    }
}
