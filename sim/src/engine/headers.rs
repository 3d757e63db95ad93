//! The request id and the rate-limit headers of every answer.

use std::time::Duration;

use http::{HeaderMap, HeaderValue};

use super::*;
use crate::config::Style;
use crate::wire::Level;
use crate::{anthropic, openai};

impl Engine {
    /// The request id and, for a known organisation, the rate-limit headers.
    pub(super) fn common_headers(
        &self,
        state: &mut State,
        organization: Option<usize>,
        now: u64,
        id: String,
        headers: &mut HeaderMap,
    ) {
        let id_header = match self.config.style {
            Style::OpenAi => "x-request-id",
            Style::Anthropic => "request-id",
            Style::Gemini => "x-goog-request-id",
        };
        if let Ok(id) = HeaderValue::try_from(id) {
            headers.insert(id_header, id);
        }
        let Some(organization) = organization else {
            return;
        };
        let levels: Vec<Level> = self
            .limits
            .iter()
            .enumerate()
            .filter(|(_, limit)| limit.reported())
            .map(|(i, limit)| {
                let bucket = &mut state.buckets[organization][i];
                Level {
                    dimension: limit.dimension,
                    limit: state.amounts[i],
                    remaining: bucket.remaining(now),
                    until_full: Duration::from_nanos(bucket.until_full(now)),
                }
            })
            .collect();
        match self.config.style {
            Style::OpenAi => openai::rate_limit_headers(&levels, headers),
            Style::Anthropic => anthropic::rate_limit_headers(&levels, headers),
            // Google sends no rate-limit headers.
            Style::Gemini => {}
        }
    }

    /// The headers of an admitted response, as the quota stands when its head is sent.
    pub(crate) fn response_headers(
        &self,
        organization: usize,
        stream: bool,
        completion_id: &str,
    ) -> HeaderMap {
        let (mut state, now) = self.lock();
        let mut headers = HeaderMap::new();
        let content_type = if stream {
            "text/event-stream; charset=utf-8"
        } else {
            "application/json"
        };
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static(content_type),
        );
        let id = completion_id
            .replace("chatcmpl-sim", "req_sim")
            .replace("msg_sim", "req_sim");
        self.common_headers(&mut state, Some(organization), now, id, &mut headers);
        headers
    }
}
