//! The OpenAI Chat Completions shapes: requests, bodies, event streams, headers, errors.

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

use super::wire::{self, ChatRequest, Completion, Fnv, Frame, Invalid, Level, Refusal};
use tower_llm_quota::Dimension;

/// The API key of `Authorization: Bearer <key>`.
pub(crate) fn api_key(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let key = value.strip_prefix("Bearer ")?.trim();
    (!key.is_empty()).then_some(key)
}

/// Parses a Chat Completions request. `max_completion_tokens` wins over `max_tokens`; without
/// either, `default_max_tokens` applies.
pub(crate) fn parse(body: &[u8], default_max_tokens: u64) -> Result<ChatRequest, Invalid> {
    let body = wire::object(body)?;
    let messages = wire::messages(&body)?;
    let (mut prompt_tokens, mut hash) = (0, Fnv::new());
    wire::count_messages(messages, &mut prompt_tokens, &mut hash)?;
    let max_tokens = match wire::positive(&body, "max_completion_tokens")? {
        Some(n) => n,
        None => wire::positive(&body, "max_tokens")?.unwrap_or(default_max_tokens),
    };
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(options @ Value::Object(_)) => wire::flag(options, "include_usage")?,
        Some(_) => return Err("stream_options must be an object".to_owned()),
    };
    let service_tier = match body.get("service_tier") {
        None | Some(Value::Null) => None,
        Some(Value::String(tier)) => Some(tier.clone()),
        Some(_) => return Err("service_tier must be a string".to_owned()),
    };
    Ok(ChatRequest {
        model: wire::model(&body),
        prompt_tokens,
        max_tokens,
        stream: wire::flag(&body, "stream")?,
        include_usage,
        prompt_hash: hash.finish(),
        group: wire::group_ids(messages),
        service_tier,
        embeddings: None,
    })
}

/// An embeddings request (`POST /v1/embeddings`): `input`, a string or a non-empty array of
/// strings (or of token ids), counted as the prompt; nothing is generated.
pub(crate) fn parse_embeddings(body: &[u8]) -> Result<ChatRequest, Invalid> {
    let body = wire::object(body)?;
    let (mut prompt_tokens, mut hash) = (0, Fnv::new());
    let inputs = match body.get("input") {
        Some(text @ Value::String(_)) => {
            wire::count_content(Some(text), &mut prompt_tokens, &mut hash);
            1
        }
        Some(Value::Array(items)) if !items.is_empty() => {
            for item in items {
                match item {
                    Value::String(_) => {
                        wire::count_content(Some(item), &mut prompt_tokens, &mut hash);
                    }
                    Value::Array(ids) => prompt_tokens += ids.len() as u64,
                    Value::Number(_) => prompt_tokens += 1,
                    _ => return Err("input items must be strings or token arrays".to_owned()),
                }
            }
            if items.iter().all(Value::is_number) {
                1
            } else {
                items.len()
            }
        }
        _ => return Err("input must be a string or a non-empty array".to_owned()),
    };
    Ok(ChatRequest {
        model: wire::model(&body),
        prompt_tokens,
        max_tokens: 0,
        stream: false,
        include_usage: false,
        prompt_hash: hash.finish(),
        group: Vec::new(),
        service_tier: None,
        embeddings: Some(inputs),
    })
}

/// The answer to an embeddings request: a vector of 8 numbers per input, drawn from the
/// completion's id, and its usage (the prompt's tokens).
pub(crate) fn embeddings(c: &Completion) -> Bytes {
    let seed = wire::mix(c.prompt_tokens ^ c.created);
    let data: Vec<Value> = (0..c.embeddings.unwrap_or(1))
        .map(|index| {
            let vector: Vec<f64> = (0..8u64)
                .map(|i| {
                    let x = wire::mix(seed ^ (index as u64) << 8 ^ i) % 2_000;
                    (x as f64 - 1_000.0) / 1_000.0
                })
                .collect();
            json!({"object": "embedding", "index": index, "embedding": vector})
        })
        .collect();
    let body = json!({
        "object": "list",
        "data": data,
        "model": c.model,
        "usage": {"prompt_tokens": c.prompt_tokens, "total_tokens": c.prompt_tokens},
    });
    Bytes::from(body.to_string())
}

/// The tier that serves a request asking for `asked`: flex and priority as asked, the
/// standard tier (`default`) otherwise.
pub(crate) fn served_tier(asked: &str) -> &'static str {
    match asked {
        "flex" => "flex",
        "priority" => "priority",
        _ => "default",
    }
}

fn usage(c: &Completion) -> Value {
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens.saturating_add(c.completion_tokens),
    })
}

fn finish_reason(c: &Completion) -> &'static str {
    if c.truncated() { "length" } else { "stop" }
}

/// The `chat.completion` body.
pub(crate) fn completion(c: &Completion) -> Bytes {
    let text = wire::completion_text(c);
    let body = json!({
        "id": c.id,
        "object": "chat.completion",
        "created": c.created,
        "model": c.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": null},
            "logprobs": null,
            "finish_reason": finish_reason(c),
        }],
        "usage": usage(c),
        "system_fingerprint": "fp_sim",
    });
    let mut body = body;
    if let Some(tier) = c.service_tier {
        body["service_tier"] = json!(tier);
    }
    Bytes::from(body.to_string())
}

/// The `chat.completion.chunk` stream: the role, the content pieces, the finish reason, the
/// usage chunk when `stream_options.include_usage` was set, then `[DONE]`.
pub(crate) fn frames(c: &Completion) -> Vec<Frame> {
    let chunk = |delta: Value, finish: Value| {
        let mut chunk = json!({
            "id": c.id,
            "object": "chat.completion.chunk",
            "created": c.created,
            "model": c.model,
            "system_fingerprint": "fp_sim",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if c.include_usage {
            chunk["usage"] = Value::Null;
        }
        if let Some(tier) = c.service_tier {
            chunk["service_tier"] = json!(tier);
        }
        chunk
    };
    let event = |tokens, value: Value, settles| Frame {
        tokens,
        data: Bytes::from(format!("data: {value}\n\n")),
        settles,
    };
    let mut frames = vec![event(
        0,
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        false,
    )];
    for (tokens, text) in wire::content_pieces(c) {
        frames.push(event(
            tokens,
            chunk(json!({"content": text}), Value::Null),
            false,
        ));
    }
    frames.push(event(0, chunk(json!({}), json!(finish_reason(c))), true));
    if c.include_usage {
        let last = json!({
            "id": c.id,
            "object": "chat.completion.chunk",
            "created": c.created,
            "model": c.model,
            "system_fingerprint": "fp_sim",
            "choices": [],
            "usage": usage(c),
        });
        frames.push(event(0, last, false));
    }
    frames.push(Frame {
        tokens: 0,
        data: Bytes::from_static(b"data: [DONE]\n\n"),
        settles: false,
    });
    frames
}

/// The status and body of a refusal.
pub(crate) fn refusal(refusal: &Refusal) -> (StatusCode, Bytes) {
    let error = |status, message: &str, kind: &str, code: Value| {
        let body =
            json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
        (status, Bytes::from(body.to_string()))
    };
    match refusal {
        Refusal::Unauthorized => error(
            StatusCode::UNAUTHORIZED,
            "Incorrect API key provided. You can find your API key at https://platform.openai.com/account/api-keys.",
            "invalid_request_error",
            json!("invalid_api_key"),
        ),
        Refusal::Invalid(message) => error(
            StatusCode::BAD_REQUEST,
            message,
            "invalid_request_error",
            Value::Null,
        ),
        Refusal::TooLarge(message) => error(
            StatusCode::BAD_REQUEST,
            message,
            "invalid_request_error",
            json!("request_too_large"),
        ),
        Refusal::NotFound(path) => error(
            StatusCode::NOT_FOUND,
            &format!("Invalid URL (POST {path})"),
            "invalid_request_error",
            Value::Null,
        ),
        Refusal::MethodNotAllowed => error(
            StatusCode::METHOD_NOT_ALLOWED,
            "Only POST is allowed here.",
            "invalid_request_error",
            Value::Null,
        ),
        Refusal::RateLimited(limited) => {
            let kind = if limited.dimension == Dimension::Requests {
                "requests"
            } else {
                "tokens"
            };
            let message = format!(
                "Rate limit reached for {} in organization {} on {} {}: Limit {}, Used {}, \
                 Requested {}. Please try again in {}.",
                limited.model,
                limited.organization,
                kind,
                limited.per,
                limited.limit,
                limited.limit.saturating_sub(limited.remaining),
                limited.requested,
                wire::go_duration(limited.wait),
            );
            error(
                StatusCode::TOO_MANY_REQUESTS,
                &message,
                kind,
                json!("rate_limit_exceeded"),
            )
        }
        Refusal::ServerError => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The server had an error while processing your request. Sorry about that!",
            "server_error",
            Value::Null,
        ),
        Refusal::TierUnavailable => error(
            StatusCode::TOO_MANY_REQUESTS,
            "Resource Unavailable: the flex tier has no capacity for this request now, and you \
             were not charged. Retry later, or send it with service_tier \"default\".",
            "resource_unavailable",
            json!("resource_unavailable"),
        ),
        Refusal::Overloaded => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "The engine is currently overloaded, please try again later.",
            "server_error",
            Value::Null,
        ),
    }
}

/// The `x-ratelimit-*` headers for the per-minute requests and tokens limits.
pub(crate) fn rate_limit_headers(levels: &[Level], headers: &mut HeaderMap) {
    for level in levels {
        let name = match level.dimension {
            Dimension::Requests => "requests",
            Dimension::TotalTokens => "tokens",
            _ => continue,
        };
        let mut put = |field: &str, value: String| {
            wire::insert_header(headers, format!("x-ratelimit-{field}-{name}"), value);
        };
        put("limit", level.limit.to_string());
        put("remaining", level.remaining.to_string());
        put("reset", wire::go_duration(level.until_full));
    }
}
