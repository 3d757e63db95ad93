//! The Anthropic Messages shapes: requests, bodies, event streams, headers, errors.

use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

use super::wire::{self, ChatRequest, Completion, Fnv, Frame, Invalid, Level, Refusal};
use tower_llm_quota::Dimension;

/// The API key of `x-api-key: <key>`.
pub(crate) fn api_key(headers: &HeaderMap) -> Option<&str> {
    let key = headers.get("x-api-key")?.to_str().ok()?.trim();
    (!key.is_empty()).then_some(key)
}

/// Parses a Messages request: `max_tokens` is required; the `system` prompt counts like a
/// message.
pub(crate) fn parse(body: &[u8]) -> Result<ChatRequest, Invalid> {
    let body = wire::object(body)?;
    let messages = wire::messages(&body)?;
    let Some(max_tokens) = wire::positive(&body, "max_tokens")? else {
        return Err("max_tokens: Field required".to_owned());
    };
    let (mut prompt_tokens, mut hash) = (0, Fnv::new());
    if let Some(system) = body.get("system").filter(|s| !s.is_null()) {
        if !(system.is_string() || system.is_array()) {
            return Err("system: must be a string or an array of text blocks".to_owned());
        }
        prompt_tokens += wire::MESSAGE_OVERHEAD;
        wire::count_content(Some(system), &mut prompt_tokens, &mut hash);
    }
    wire::count_messages(messages, &mut prompt_tokens, &mut hash)?;
    Ok(ChatRequest {
        model: wire::model(&body),
        prompt_tokens,
        max_tokens,
        stream: wire::flag(&body, "stream")?,
        include_usage: true,
        prompt_hash: hash.finish(),
        group: wire::group_ids(messages),
        service_tier: None,
        embeddings: None,
    })
}

fn stop_reason(c: &Completion) -> &'static str {
    if c.truncated() {
        "max_tokens"
    } else {
        "end_turn"
    }
}

/// The `message` body.
pub(crate) fn completion(c: &Completion) -> Bytes {
    let text = wire::completion_text(c);
    let body = json!({
        "id": c.id,
        "type": "message",
        "role": "assistant",
        "model": c.model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason(c),
        "stop_sequence": null,
        "usage": {
            "input_tokens": c.prompt_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": c.completion_tokens,
        },
    });
    Bytes::from(body.to_string())
}

/// The event stream: `message_start` (input usage, one output token), `content_block_start`,
/// `ping`, the `content_block_delta`s, `content_block_stop`, `message_delta` (the final,
/// cumulative output usage), `message_stop`.
pub(crate) fn frames(c: &Completion) -> Vec<Frame> {
    let event = |tokens, name: &str, data: Value, settles| Frame {
        tokens,
        data: Bytes::from(format!("event: {name}\ndata: {data}\n\n")),
        settles,
    };
    let mut frames = vec![
        event(
            0,
            "message_start",
            json!({"type": "message_start", "message": {
                "id": c.id,
                "type": "message",
                "role": "assistant",
                "model": c.model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": {
                    "input_tokens": c.prompt_tokens,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                    "output_tokens": 1,
                },
            }}),
            false,
        ),
        event(
            0,
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}),
            false,
        ),
        event(0, "ping", json!({"type": "ping"}), false),
    ];
    for (tokens, text) in wire::content_pieces(c) {
        frames.push(event(
            tokens,
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": text}}),
            false,
        ));
    }
    frames.push(event(
        0,
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
        false,
    ));
    frames.push(event(
        0,
        "message_delta",
        json!({"type": "message_delta",
               "delta": {"stop_reason": stop_reason(c), "stop_sequence": null},
               "usage": {"output_tokens": c.completion_tokens}}),
        true,
    ));
    frames.push(event(
        0,
        "message_stop",
        json!({"type": "message_stop"}),
        false,
    ));
    frames
}

/// The status and body of a refusal.
pub(crate) fn refusal(refusal: &Refusal) -> (StatusCode, Bytes) {
    let error = |status, kind: &str, message: &str| {
        let body = json!({"type": "error", "error": {"type": kind, "message": message}});
        (status, Bytes::from(body.to_string()))
    };
    match refusal {
        Refusal::Unauthorized => error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid x-api-key",
        ),
        Refusal::Invalid(message) | Refusal::TooLarge(message) => {
            error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
        Refusal::NotFound(path) => error(
            StatusCode::NOT_FOUND,
            "not_found_error",
            &format!("Not found: {path}"),
        ),
        Refusal::MethodNotAllowed => error(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "Method not allowed: only POST",
        ),
        Refusal::RateLimited(limited) => {
            let what = match limited.dimension {
                Dimension::Requests => "requests",
                Dimension::InputTokens => "input tokens",
                Dimension::OutputTokens => "output tokens",
                Dimension::TotalTokens => "tokens",
                // Spend, and any dimension a later core adds.
                _ => "nano-dollars",
            };
            let message = format!(
                "This request would exceed the rate limit for your organization ({}) of {} {} {}. \
                 Requested {}, remaining {}.",
                limited.organization,
                limited.limit,
                what,
                limited.per,
                limited.requested,
                limited.remaining,
            );
            error(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", &message)
        }
        Refusal::ServerError => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "Internal server error",
        ),
        Refusal::Overloaded | Refusal::TierUnavailable => error(
            StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error",
            "Overloaded",
        ),
    }
}

/// The `anthropic-ratelimit-*` headers for the per-minute requests, input and output limits.
/// Resets are wall-clock instants: now plus the simulated time until the bucket is full.
pub(crate) fn rate_limit_headers(levels: &[Level], headers: &mut HeaderMap) {
    let now = SystemTime::now();
    for level in levels {
        let name = match level.dimension {
            Dimension::Requests => "requests",
            Dimension::InputTokens => "input-tokens",
            Dimension::OutputTokens => "output-tokens",
            Dimension::TotalTokens => "tokens",
            // Spend, and any dimension a later core adds.
            _ => "spend",
        };
        let mut put = |field: &str, value: String| {
            wire::insert_header(
                headers,
                format!("anthropic-ratelimit-{name}-{field}"),
                value,
            );
        };
        put("limit", level.limit.to_string());
        put("remaining", level.remaining.to_string());
        let reset = now.checked_add(level.until_full).unwrap_or(now);
        put("reset", wire::rfc3339(reset));
    }
}
