//! Idempotency keys at the simulated provider: calls billed per key (how a test proves that no
//! operation was billed twice) and, when configured, keys honoured as providers that support
//! them do.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, StatusCode};

use super::config::Style;
use super::wire::Completion;
use super::{anthropic, gemini, openai};

/// The header a client sends its operation's key under.
const HEADER: &str = "idempotency-key";

/// The answer to a duplicate: the stored completion, or a conflict while it is generated.
#[derive(Debug)]
pub(crate) struct Replay {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

/// Per key: calls billed, and what an honoured key answers again.
#[derive(Debug, Default)]
pub(crate) struct KeyCounts {
    state: Mutex<Keys>,
}

#[derive(Debug, Default)]
struct Keys {
    billed: HashMap<String, u64>,
    kept: HashMap<String, Kept>,
    replayed: u64,
}

/// The completion billed under a key, replayed to a later request with the same key.
#[derive(Debug)]
struct Kept {
    completion: Completion,
    stream: bool,
    /// Simulated nanoseconds when the generation ends; before, a duplicate gets 409.
    done_at: u64,
    /// Simulated nanoseconds when the key is forgotten.
    until: u64,
}

/// The key of a request, if it has one that is text.
pub(crate) fn key_of(headers: &HeaderMap) -> Option<&str> {
    headers.get(HEADER).and_then(|v| v.to_str().ok())
}

impl KeyCounts {
    /// A call billed under `key`; kept until `until` when keys are honoured.
    pub(crate) fn billed(&self, key: &str, kept: Option<(&Completion, bool, u64, u64)>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        *state.billed.entry(key.to_owned()).or_default() += 1;
        if let Some((completion, stream, done_at, until)) = kept {
            state.kept.insert(
                key.to_owned(),
                Kept {
                    completion: completion.clone(),
                    stream,
                    done_at,
                    until,
                },
            );
        }
    }

    /// The answer to a request with an honoured `key` billed before, at `now`: the same
    /// completion once generated, a 409 while it is generated; `None` for a new key.
    pub(crate) fn replay(&self, key: &str, now: u64, style: Style) -> Option<Replay> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.kept.len() > 1024 {
            state.kept.retain(|_, kept| kept.until > now);
        }
        let Some(kept) = state.kept.get(key).filter(|kept| kept.until > now) else {
            // Held until the request's outcome is known.
            state.kept.insert(
                key.to_owned(),
                Kept {
                    completion: Completion::default(),
                    stream: false,
                    done_at: u64::MAX,
                    until: u64::MAX,
                },
            );
            return None;
        };
        let mut headers = HeaderMap::new();
        if now < kept.done_at {
            let body = Bytes::from(format!(
                r#"{{"error":{{"message":"A request with the idempotency key {key:?} is still in progress.","type":"idempotency_error","code":"conflict"}}}}"#
            ));
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            return Some(Replay {
                status: StatusCode::CONFLICT,
                headers,
                body,
            });
        }
        let body = if kept.stream {
            let frames = match style {
                Style::OpenAi => openai::frames(&kept.completion),
                Style::Anthropic => anthropic::frames(&kept.completion),
                Style::Gemini => gemini::frames(&kept.completion, true),
            };
            let mut body = BytesMut::new();
            for frame in frames {
                body.extend_from_slice(&frame.data);
            }
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            body.freeze()
        } else {
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            match style {
                Style::OpenAi => openai::completion(&kept.completion),
                Style::Anthropic => anthropic::completion(&kept.completion),
                Style::Gemini => gemini::completion(&kept.completion),
            }
        };
        headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
        state.replayed += 1;
        Some(Replay {
            status: StatusCode::OK,
            headers,
            body,
        })
    }

    /// Frees a key held for a request that was not admitted.
    pub(crate) fn forget(&self, key: &str) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.kept.remove(key);
    }

    pub(crate) fn snapshot(&self) -> HashMap<String, u64> {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .billed
            .clone()
    }

    pub(crate) fn replayed(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replayed
    }

    pub(crate) fn clear(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.billed.clear();
        state.replayed = 0;
    }
}
