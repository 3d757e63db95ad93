//! A request pointed at an account: its URL for the API, its key (and only its key), the
//! provider's headers passed through.

use bytes::Bytes;
use http::{HeaderValue, Request};
use http_body_util::Full;
use tower_llm_quota::provider::Profile;

use crate::config::Api;
use crate::gemini::Native;

use super::Account;

impl Account {
    /// Points `request` at this account: its URL for `api` (for a native Gemini call, its
    /// method of `model`, the route's name for it, else the caller's), its key (and only its
    /// key).
    pub(crate) fn retarget(
        &self,
        api: Api,
        model: Option<&str>,
        request: &mut Request<Full<Bytes>>,
    ) {
        // Borrowed for the OpenAI and Anthropic APIs: no allocation of their own per request.
        let path: std::borrow::Cow<'_, str> =
            match (request.extensions().get::<Native>(), self.root) {
                (Some(native), _) => native.upstream_path(model.unwrap_or(&native.model)).into(),
                (None, Some(root)) => format!(
                    "{root}{}",
                    api.path().strip_prefix("/v1").unwrap_or(api.path())
                )
                .into(),
                (None, None) => api.path().into(),
            };
        let uri = format!(
            "{}://{}{}{path}",
            self.base.scheme_str().unwrap_or("http"),
            self.base.authority().map_or("localhost", |a| a.as_str()),
            self.base.path().trim_end_matches('/'),
        );
        *request.uri_mut() = uri.parse().expect("a valid upstream URL");
        let out = request.headers_mut();
        for name in [
            "authorization",
            "x-api-key",
            "api-key",
            crate::gemini::KEY_HEADER,
        ] {
            out.remove(name);
        }
        if self.profile == Profile::anthropic() && !out.contains_key("anthropic-version") {
            out.insert("anthropic-version", HeaderValue::from_static("2023-06-01"));
        }
        if let Some((name, value)) = &self.key {
            out.insert(name.clone(), value.clone());
        }
    }
}
