//! Google Gemini's native shapes (`generativelanguage.googleapis.com/v1beta`): the model and
//! method in the path (`/v1beta/models/{model}:{method}`), `contents` of `parts`,
//! `usageMetadata`, streams as server-sent events (`alt=sse`) or one JSON array, and errors in
//! Google's shape (`{"error": {"code", "message", "status", "details"}}`, a 429's
//! `RetryInfo.retryDelay` and `QuotaFailure`). Google sends no rate-limit headers.

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

use super::wire::{self, ChatRequest, Completion, Fnv, Frame, Invalid, Refusal};
use tower_llm_quota::Dimension;

/// A method of a model, as the path names it after the colon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    Generate,
    Stream,
    CountTokens,
    Embed,
    BatchEmbed,
}

/// The model and method of a path `.../models/{model}:{method}`, if it is one.
pub(crate) fn route(path: &str) -> Option<(&str, Method)> {
    let (_, target) = path.rsplit_once("/models/")?;
    let (model, method) = target.rsplit_once(':')?;
    let method = match method {
        "generateContent" => Method::Generate,
        "streamGenerateContent" => Method::Stream,
        "countTokens" => Method::CountTokens,
        "embedContent" => Method::Embed,
        "batchEmbedContents" => Method::BatchEmbed,
        _ => return None,
    };
    (!model.is_empty()).then_some((model, method))
}

/// Whether a path lists the models (`GET /v1beta/models`).
pub(crate) fn is_listing(path: &str) -> bool {
    path.trim_end_matches('/').ends_with("/models")
}

/// The API key of `x-goog-api-key: <key>` (a `?key=` is moved there by the service).
pub(crate) fn api_key(headers: &HeaderMap) -> Option<&str> {
    let key = headers.get("x-goog-api-key")?.to_str().ok()?.trim();
    (!key.is_empty()).then_some(key)
}

/// The value of `name` in a query string.
pub(crate) fn query_value<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

/// Parses a request of `method` for `model`: `contents` (and `systemInstruction`) counted as
/// the prompt, `generationConfig.maxOutputTokens` (else `default_max_tokens`); for
/// embeddings, the `content` (or each request's) counted, nothing generated.
pub(crate) fn parse(
    model: &str,
    method: Method,
    body: &[u8],
    default_max_tokens: u64,
) -> Result<ChatRequest, Invalid> {
    let body = wire::object(body)?;
    let (mut prompt_tokens, mut hash) = (0, Fnv::new());
    let mut request = ChatRequest {
        model: model.to_owned(),
        prompt_tokens: 0,
        max_tokens: 0,
        stream: method == Method::Stream,
        include_usage: true,
        prompt_hash: 0,
        group: Vec::new(),
        service_tier: None,
        embeddings: None,
    };
    match method {
        Method::Embed => {
            count_parts(body.get("content"), &mut prompt_tokens, &mut hash)
                .ok_or("content: field required (a Content of parts)")?;
            request.embeddings = Some(1);
        }
        Method::BatchEmbed => {
            let requests = match body.get("requests").and_then(Value::as_array) {
                Some(requests) if !requests.is_empty() => requests,
                _ => return Err("requests: field required (a non-empty array)".to_owned()),
            };
            for (i, item) in requests.iter().enumerate() {
                count_parts(item.get("content"), &mut prompt_tokens, &mut hash)
                    .ok_or_else(|| format!("requests[{i}].content: field required"))?;
            }
            request.embeddings = Some(requests.len());
        }
        Method::Generate | Method::Stream | Method::CountTokens => {
            let contents = match body.get("contents").and_then(Value::as_array) {
                Some(contents) if !contents.is_empty() => contents,
                _ => return Err("contents is not specified".to_owned()),
            };
            let mut texts = Vec::new();
            for (i, content) in contents.iter().enumerate() {
                prompt_tokens += wire::MESSAGE_OVERHEAD;
                count_parts(Some(content), &mut prompt_tokens, &mut hash)
                    .ok_or_else(|| format!("contents[{i}].parts: field required"))?;
                texts.extend(texts_of(content));
            }
            let system = body
                .get("systemInstruction")
                .or_else(|| body.get("system_instruction"));
            if system.is_some_and(|s| !s.is_null()) {
                prompt_tokens += wire::MESSAGE_OVERHEAD;
                count_parts(system, &mut prompt_tokens, &mut hash)
                    .ok_or("systemInstruction.parts: field required")?;
            }
            let config = body
                .get("generationConfig")
                .or_else(|| body.get("generation_config"))
                .filter(|c| !c.is_null());
            let asked = match config {
                Some(config) => wire::positive(config, "maxOutputTokens")?,
                None => None,
            };
            request.max_tokens = asked.unwrap_or(default_max_tokens);
            request.group = texts
                .iter()
                .flat_map(|text| tower_llm_quota::group::item_markers(text))
                .map(|(id, _)| id.to_owned())
                .collect();
        }
    }
    request.prompt_tokens = prompt_tokens;
    request.prompt_hash = hash.finish();
    Ok(request)
}

/// Adds the tokens of a `Content`'s text parts; `None` when it has no `parts` array.
fn count_parts(content: Option<&Value>, tokens: &mut u64, hash: &mut Fnv) -> Option<()> {
    let parts = content?.get("parts")?.as_array()?;
    for text in parts
        .iter()
        .filter_map(|p| p.get("text").and_then(Value::as_str))
    {
        *tokens = tokens.saturating_add(wire::text_tokens(text));
        hash.write(text.as_bytes());
    }
    Some(())
}

fn texts_of(content: &Value) -> impl Iterator<Item = &str> {
    content
        .get("parts")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|p| p.get("text").and_then(Value::as_str))
}

/// The `countTokens` answer for a parsed request.
pub(crate) fn token_count(request: &ChatRequest) -> Bytes {
    Bytes::from(json!({"totalTokens": request.prompt_tokens}).to_string())
}

/// The `GET /v1beta/models` answer: the one model the simulator knows by name, for each
/// method it serves.
pub(crate) fn models(max_output_tokens: u64) -> Bytes {
    let model = |name: &str, methods: &[&str]| {
        json!({
            "name": format!("models/{name}"),
            "displayName": name,
            "inputTokenLimit": 1_048_576,
            "outputTokenLimit": max_output_tokens,
            "supportedGenerationMethods": methods,
        })
    };
    let body = json!({"models": [
        model("gemini-2.5-flash", &["generateContent", "countTokens"]),
        model("text-embedding-004", &["embedContent"]),
    ]});
    Bytes::from(body.to_string())
}

fn finish_reason(c: &Completion) -> &'static str {
    if c.truncated() { "MAX_TOKENS" } else { "STOP" }
}

fn usage(c: &Completion, output: u64) -> Value {
    let mut usage = json!({
        "promptTokenCount": c.prompt_tokens,
        "totalTokenCount": c.prompt_tokens.saturating_add(output),
    });
    if output > 0 {
        usage["candidatesTokenCount"] = json!(output);
    }
    usage
}

fn chunk(c: &Completion, text: &str, last: bool, output: u64) -> Value {
    let mut candidate =
        json!({"content": {"parts": [{"text": text}], "role": "model"}, "index": 0});
    if last {
        candidate["finishReason"] = json!(finish_reason(c));
    }
    json!({
        "candidates": [candidate],
        "usageMetadata": usage(c, output),
        "modelVersion": c.model,
        "responseId": c.id,
    })
}

/// The `GenerateContentResponse` body.
pub(crate) fn completion(c: &Completion) -> Bytes {
    let text = wire::completion_text(c);
    Bytes::from(chunk(c, &text, true, c.completion_tokens).to_string())
}

/// The embeddings of an `embedContent` (one) or `batchEmbedContents` answer: 8 numbers each.
pub(crate) fn embeddings(c: &Completion, batch: bool) -> Bytes {
    let seed = wire::mix(c.prompt_tokens ^ c.created);
    let vector = |index: u64| {
        let values: Vec<f64> = (0..8u64)
            .map(|i| (wire::mix(seed ^ index << 8 ^ i) % 2_000) as f64 / 1_000.0 - 1.0)
            .collect();
        json!({"values": values})
    };
    let body = if batch {
        let all: Vec<Value> = (0..c.embeddings.unwrap_or(1) as u64).map(vector).collect();
        json!({"embeddings": all})
    } else {
        json!({"embedding": vector(0)})
    };
    Bytes::from(body.to_string())
}

/// The stream: a `GenerateContentResponse` per piece of text, each with the usage so far (the
/// prompt), the last with the finish reason and the whole usage; as server-sent events
/// (`alt=sse`) or as the elements of one JSON array.
pub(crate) fn frames(c: &Completion, sse: bool) -> Vec<Frame> {
    let pieces = wire::content_pieces(c);
    let count = pieces.len();
    let mut frames: Vec<Frame> = pieces
        .into_iter()
        .enumerate()
        .map(|(i, (tokens, text))| {
            let last = i + 1 == count;
            let output = if last { c.completion_tokens } else { 0 };
            let data = chunk(c, &text, last, output);
            let data = match (sse, i) {
                (true, _) => format!("data: {data}\r\n\r\n"),
                (false, 0) => format!("[{data}"),
                (false, _) => format!(",\r\n{data}"),
            };
            Frame {
                tokens,
                data: Bytes::from(data),
                settles: last,
            }
        })
        .collect();
    if frames.is_empty() {
        let data = chunk(c, "", true, c.completion_tokens);
        let data = if sse {
            format!("data: {data}\r\n\r\n")
        } else {
            format!("[{data}")
        };
        frames.push(Frame {
            tokens: 0,
            data: Bytes::from(data),
            settles: true,
        });
    }
    if !sse {
        frames.push(Frame {
            tokens: 0,
            data: Bytes::from_static(b"]"),
            settles: false,
        });
    }
    frames
}

/// The status and body of a refusal, in Google's error shape.
pub(crate) fn refusal(refusal: &Refusal) -> (StatusCode, Bytes) {
    let error = |status: StatusCode, kind: &str, message: &str, details: Value| {
        let body = json!({"error": {
            "code": status.as_u16(),
            "message": message,
            "status": kind,
            "details": details,
        }});
        (status, Bytes::from(body.to_string()))
    };
    match refusal {
        Refusal::Unauthorized => error(
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            "API key not valid. Please pass a valid API key.",
            json!([{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "API_KEY_INVALID", "domain": "googleapis.com"}]),
        ),
        Refusal::Invalid(message) | Refusal::TooLarge(message) => error(
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            message,
            json!([]),
        ),
        Refusal::NotFound(path) => error(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            &format!("{path} is not found for API version v1beta, or is not supported"),
            json!([]),
        ),
        Refusal::MethodNotAllowed => error(
            StatusCode::METHOD_NOT_ALLOWED,
            "INVALID_ARGUMENT",
            "method not allowed",
            json!([]),
        ),
        Refusal::RateLimited(limited) => {
            let (metric, id) = match limited.dimension {
                Dimension::Requests => ("generate_content_requests", "GenerateRequests"),
                _ => (
                    "generate_content_input_token_count",
                    "GenerateContentInputTokens",
                ),
            };
            let per = if limited.per.contains("day") {
                "PerDay"
            } else {
                "PerMinute"
            };
            let seconds = limited.wait.as_secs_f64();
            let message = format!(
                "You exceeded your current quota, please check your plan and billing details. \
                 Quota exceeded for metric: generativelanguage.googleapis.com/{metric}, limit: \
                 {}, model: {}\nPlease retry in {seconds:.6}s.",
                limited.limit, limited.model
            );
            let details = json!([
                {"@type": "type.googleapis.com/google.rpc.QuotaFailure",
                 "violations": [{
                    "quotaMetric": format!("generativelanguage.googleapis.com/{metric}"),
                    "quotaId": format!("{id}{per}PerProjectPerModel"),
                    "quotaDimensions": {"location": "global", "model": limited.model},
                    "quotaValue": limited.limit.to_string(),
                 }]},
                {"@type": "type.googleapis.com/google.rpc.Help",
                 "links": [{"description": "Learn more about Gemini API quotas",
                            "url": "https://ai.google.dev/gemini-api/docs/rate-limits"}]},
                {"@type": "type.googleapis.com/google.rpc.RetryInfo",
                 "retryDelay": format!("{}s", limited.wait.as_secs().max(1))},
            ]);
            error(
                StatusCode::TOO_MANY_REQUESTS,
                "RESOURCE_EXHAUSTED",
                &message,
                details,
            )
        }
        Refusal::ServerError => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "INTERNAL",
            "An internal error has occurred.",
            json!([]),
        ),
        Refusal::Overloaded | Refusal::TierUnavailable => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "UNAVAILABLE",
            "The model is overloaded. Please try again later.",
            json!([]),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_names_its_model_and_method() {
        assert_eq!(
            route("/v1beta/models/gemini-2.5-flash:streamGenerateContent"),
            Some(("gemini-2.5-flash", Method::Stream))
        );
        assert_eq!(
            route("/v1beta/models/m:countTokens").unwrap().1,
            Method::CountTokens
        );
        assert_eq!(route("/v1beta/models/m:unknown"), None);
        assert_eq!(route("/v1beta/models/:generateContent"), None);
        assert!(is_listing("/v1beta/models"));
        assert_eq!(query_value(Some("alt=sse&key=k"), "key"), Some("k"));
    }

    #[test]
    fn a_request_counts_contents_and_system_and_asks_its_bound() {
        let body = br#"{"contents":[{"role":"user","parts":[{"text":"12345678"}]}],
            "systemInstruction":{"parts":[{"text":"1234"}]},
            "generationConfig":{"maxOutputTokens":7}}"#;
        let request = parse("m", Method::Generate, body, 100).unwrap();
        assert_eq!(request.prompt_tokens, 2 + 1 + 2 * wire::MESSAGE_OVERHEAD);
        assert_eq!(request.max_tokens, 7);
        let without = br#"{"contents":[{"parts":[{"text":"hi"}]}]}"#;
        assert_eq!(
            parse("m", Method::Stream, without, 100).unwrap().max_tokens,
            100
        );
        assert!(parse("m", Method::Generate, b"{}", 1).is_err());
        let batch = br#"{"requests":[{"content":{"parts":[{"text":"abcd"}]}},
            {"content":{"parts":[{"text":"abcdefgh"}]}}]}"#;
        let request = parse("e", Method::BatchEmbed, batch, 1).unwrap();
        assert_eq!((request.prompt_tokens, request.embeddings), (3, Some(2)));
    }

    #[test]
    fn a_stream_is_events_or_one_json_array() {
        let c = Completion {
            id: "r".into(),
            model: "m".into(),
            prompt_tokens: 5,
            completion_tokens: 3,
            max_tokens: 10,
            ..Completion::default()
        };
        let array: Vec<u8> = frames(&c, false)
            .iter()
            .flat_map(|f| f.data.to_vec())
            .collect();
        let chunks: Vec<Value> = serde_json::from_slice(&array).unwrap();
        let last = chunks.last().unwrap();
        assert_eq!(last["usageMetadata"]["candidatesTokenCount"], 3);
        assert_eq!(last["candidates"][0]["finishReason"], "STOP");
        let events = frames(&c, true);
        assert!(events.iter().all(|f| f.data.starts_with(b"data: ")));
        assert!(events.last().unwrap().settles);
    }
}
