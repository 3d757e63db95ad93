//! A group's HTTP request, and reading its response.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Uri};
use http_body_util::Full;
use serde_json::{Value, json};

use super::call::{CallResult, FormedGroup};
use super::template::Prompt;
use crate::error::BoxError;

/// The API a group's request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApiFormat {
    /// OpenAI Chat Completions (and Azure OpenAI, OpenAI-compatible servers): the instructions
    /// as the system message; the answer is `choices[0].message.content`.
    OpenAiChat,
    /// Anthropic Messages: the instructions as `system`; the answer is the text of `content`.
    Anthropic,
}

impl ApiFormat {
    /// The path of the API's endpoint under a base URL ending in `/v1`.
    pub fn endpoint(self) -> &'static str {
        match self {
            ApiFormat::OpenAiChat => "/v1/chat/completions",
            ApiFormat::Anthropic => "/v1/messages",
        }
    }
}

/// Where and how groups are sent.
#[derive(Debug, Clone)]
pub(crate) struct RequestShape {
    pub(crate) format: ApiFormat,
    pub(crate) model: String,
    pub(crate) uri: Uri,
    pub(crate) headers: HeaderMap,
}

impl RequestShape {
    /// The body of a group's request: the prompt and `max_tokens`, in the format's shape.
    pub(crate) fn body(&self, prompt: &Prompt, max_tokens: u64) -> Bytes {
        let system = &prompt.system;
        let user = json!({"role": "user", "content": prompt.user});
        let body = match self.format {
            ApiFormat::OpenAiChat => {
                let mut messages = Vec::with_capacity(2);
                if !system.is_empty() {
                    messages.push(json!({"role": "system", "content": system}));
                }
                messages.push(user);
                json!({"model": self.model, "max_tokens": max_tokens, "messages": messages})
            }
            ApiFormat::Anthropic => {
                let mut body = json!({
                    "model": self.model,
                    "max_tokens": max_tokens,
                    "messages": [user],
                });
                if !system.is_empty() {
                    body["system"] = Value::String(system.clone());
                }
                body
            }
        };
        Bytes::from(body.to_string())
    }

    /// The request of `group`: its body, the shape's headers, its idempotency key, and its
    /// cost, class and deadline in the extensions (so the stack reserves what the group was
    /// estimated at).
    pub(crate) fn request(&self, group: &FormedGroup) -> Result<Request<Full<Bytes>>, BoxError> {
        let mut request = Request::post(self.uri.clone()).body(Full::new(group.body.clone()))?;
        let headers = request.headers_mut();
        headers.extend(self.headers.clone());
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert("idempotency-key", HeaderValue::from_str(&group.key)?);
        let extensions = request.extensions_mut();
        extensions.insert(group.cost);
        extensions.insert(group.priority);
        if let Some(deadline) = group.deadline {
            extensions.insert(deadline);
        }
        Ok(request)
    }
}

/// What a response says: the answer's text and usage, or why the call failed.
pub(crate) fn read_response(
    format: ApiFormat,
    status: http::StatusCode,
    body: &[u8],
) -> CallResult {
    let value: Option<Value> = serde_json::from_slice(body).ok();
    let usage = value.as_ref().and_then(|v| usage(format, v));
    if !status.is_success() {
        let transient = matches!(status.as_u16(), 408 | 409 | 429 | 500..=599);
        let message = value
            .as_ref()
            .and_then(|v| v["error"]["message"].as_str())
            .unwrap_or_default();
        let reason = match message {
            "" => format!("HTTP {status}"),
            message => format!("HTTP {status}: {message}"),
        };
        return CallResult::Failed {
            transient,
            reason,
            usage,
        };
    }
    let text = match (format, &value) {
        (ApiFormat::OpenAiChat, Some(v)) => v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        (ApiFormat::Anthropic, Some(v)) => v["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|block| block["text"].as_str())
            .collect(),
        (_, None) => String::new(),
    };
    CallResult::Answered {
        text,
        usage,
        replayed: false,
    }
}

/// Input and output tokens of a body's `usage`; Anthropic's input counts its cache reads and
/// writes (they are the group's prompt too).
fn usage(format: ApiFormat, body: &Value) -> Option<(u64, u64)> {
    let usage = body.get("usage")?;
    let field = |name: &str| usage.get(name).and_then(Value::as_u64);
    match format {
        ApiFormat::OpenAiChat => Some((field("prompt_tokens")?, field("completion_tokens")?)),
        ApiFormat::Anthropic => {
            let input = field("input_tokens")?
                + field("cache_read_input_tokens").unwrap_or(0)
                + field("cache_creation_input_tokens").unwrap_or(0);
            Some((input, field("output_tokens")?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    #[test]
    fn answers_and_usage_are_read_in_both_formats() {
        let openai = br#"{"choices":[{"message":{"content":"[1]"}}],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}"#;
        assert_eq!(
            read_response(ApiFormat::OpenAiChat, StatusCode::OK, openai),
            CallResult::Answered {
                text: "[1]".into(),
                usage: Some((9, 2)),
                replayed: false,
            }
        );
        let anthropic = br#"{"content":[{"type":"text","text":"[1"},{"type":"text","text":"]"}],"usage":{"input_tokens":5,"cache_read_input_tokens":4,"output_tokens":2}}"#;
        assert_eq!(
            read_response(ApiFormat::Anthropic, StatusCode::OK, anthropic),
            CallResult::Answered {
                text: "[1]".into(),
                usage: Some((9, 2)),
                replayed: false,
            }
        );
    }

    #[test]
    fn failures_say_whether_sending_again_can_help() {
        let body = br#"{"error":{"message":"slow down","type":"tokens"}}"#;
        let CallResult::Failed {
            transient, reason, ..
        } = read_response(ApiFormat::OpenAiChat, StatusCode::TOO_MANY_REQUESTS, body)
        else {
            panic!("a 429 is a failure");
        };
        assert!(transient);
        assert_eq!(reason, "HTTP 429 Too Many Requests: slow down");
        let CallResult::Failed { transient, .. } =
            read_response(ApiFormat::Anthropic, StatusCode::BAD_REQUEST, b"not json")
        else {
            panic!("a 400 is a failure");
        };
        assert!(!transient);
        assert_eq!(
            read_response(ApiFormat::OpenAiChat, StatusCode::OK, b"garbage"),
            CallResult::Answered {
                text: String::new(),
                usage: None,
                replayed: false,
            }
        );
    }
}
