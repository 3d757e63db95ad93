//! The simulated provider: quota enforcement, headers, bodies, streams,
//! faults and statistics, in virtual time; and its HTTP server over loopback, in real time.

use std::io;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use tokio::time::{self, Instant};
use tower::ServiceExt;
use tower_llm_quota::provider::{Decision, LimitedBy, Profile, RateLimitError};
use tower_llm_quota::usage::{RawUsage, UsageScanner, WireFormat};
use tower_llm_quota::{Dimension, ReconcileLayer};
use tower_llm_quota_sim::{Faults, SimConfig, SimService, Simulator, Style};

const MINUTE: Duration = Duration::from_secs(60);

/// A message whose prompt is `4 + chars / 4` tokens.
fn text(chars: usize) -> String {
    "abcd".repeat(chars / 4)
}

fn openai_body(chars: usize, max_tokens: u64) -> Value {
    json!({"model": "gpt-sim", "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": text(chars)}]})
}

fn anthropic_body(chars: usize, max_tokens: u64) -> Value {
    json!({"model": "claude-sim", "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": text(chars)}]})
}

fn request(style: Style, key: Option<&str>, body: impl Into<Bytes>) -> Request<Full<Bytes>> {
    let builder = match style {
        Style::OpenAi => Request::post("/v1/chat/completions"),
        Style::Anthropic => Request::post("/v1/messages"),
        other => panic!("no request shape for {other:?}"),
    };
    let builder = match (style, key) {
        (Style::OpenAi, Some(key)) => builder.header("authorization", format!("Bearer {key}")),
        (Style::Anthropic, Some(key)) => builder.header("x-api-key", key),
        (_, None) => builder,
        (other, Some(_)) => panic!("no key header for {other:?}"),
    };
    builder.body(Full::new(body.into())).unwrap()
}

fn openai(key: &str, body: &Value) -> Request<Full<Bytes>> {
    request(Style::OpenAi, Some(key), body.to_string())
}

fn anthropic(key: &str, body: &Value) -> Request<Full<Bytes>> {
    request(Style::Anthropic, Some(key), body.to_string())
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

async fn call(service: &SimService, request: Request<Full<Bytes>>) -> Answer {
    let response = service.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// An instantaneous provider (no latency).
fn instant(config: SimConfig) -> Simulator {
    Simulator::new(config.latency(Duration::ZERO, Duration::ZERO))
}

fn scan(format: WireFormat, body: &[u8]) -> Option<RawUsage> {
    let mut scanner = UsageScanner::new(format, true);
    for piece in body.chunks(5) {
        scanner.data(piece);
    }
    scanner.usage()
}

#[tokio::test(start_paused = true)]
async fn openai_admits_its_rpm_then_answers_429_with_headers_body_and_wait() {
    let simulator = instant(SimConfig::openai(5, 100_000).key("sk-a", "org-1"));
    let service = simulator.service();
    let body = openai_body(40, 10);
    let mut statuses = Vec::new();
    for _ in 0..7 {
        statuses.push(call(&service, openai("sk-a", &body)).await.status);
    }
    assert_eq!(statuses.iter().filter(|s| **s == StatusCode::OK).count(), 5);
    assert_eq!(&statuses[5..], [StatusCode::TOO_MANY_REQUESTS; 2]);

    let refused = call(&service, openai("sk-a", &body)).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    // One request every 12 s.
    assert_eq!(header(&refused.headers, "retry-after"), "12");
    assert_eq!(header(&refused.headers, "retry-after-ms"), "12000");
    assert_eq!(header(&refused.headers, "x-ratelimit-limit-requests"), "5");
    assert_eq!(
        header(&refused.headers, "x-ratelimit-remaining-requests"),
        "0"
    );
    assert_eq!(
        header(&refused.headers, "x-ratelimit-reset-requests"),
        "1m0s"
    );
    let error = &refused.json()["error"];
    assert_eq!(error["type"], "requests");
    assert_eq!(error["code"], "rate_limit_exceeded");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("requests per min (RPM): Limit 5"),
        "{error}"
    );

    // The crate reads it as the provider's refusal on requests, with the wait.
    let mut response = http::Response::new(());
    *response.status_mut() = refused.status;
    *response.headers_mut() = refused.headers.clone();
    let limit = RateLimitError::from_response(&response, &refused.body).unwrap();
    assert_eq!(limit.decision(), Decision::Provider);
    assert_eq!(limit.limited_by(), LimitedBy::Requests);
    assert_eq!(limit.retry_after(), Some(Duration::from_secs(12)));
    assert!(limit.is_transient());

    let reports = Profile::openai().limits(&refused.headers, SystemTime::now());
    let requests = reports
        .iter()
        .find(|r| r.dimension == Dimension::Requests)
        .unwrap();
    assert_eq!(
        (requests.limit, requests.remaining, requests.reset),
        (Some(5), Some(0), Some(MINUTE))
    );
    let tokens = reports
        .iter()
        .find(|r| r.dimension == Dimension::TotalTokens)
        .unwrap();
    // Five admissions of 14 + 10 tokens, completions between 1 and 10 refunded partly.
    assert_eq!(tokens.limit, Some(100_000));
    assert!(tokens.remaining.unwrap() < 100_000 - 5 * 14);

    let stats = simulator.stats();
    assert_eq!((stats.received, stats.admitted), (8, 5));
    assert_eq!(stats.rate_limited, 3);
    assert_eq!(stats.rate_limited_by(Dimension::Requests), 3);
    assert_eq!(stats.rate_limited_by(Dimension::TotalTokens), 0);
    assert_eq!(stats.rate_limited_at, vec![Duration::ZERO; 3]);

    // Refill: one request 12 s later, not a nanosecond earlier.
    time::advance(Duration::from_secs(12) - Duration::from_nanos(1)).await;
    assert_eq!(
        call(&service, openai("sk-a", &body)).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    time::advance(Duration::from_nanos(1)).await;
    let admitted = call(&service, openai("sk-a", &body)).await;
    assert_eq!(admitted.status, StatusCode::OK);
    assert_eq!(
        header(&admitted.headers, "x-ratelimit-remaining-requests"),
        "0"
    );
    assert_eq!(
        call(&service, openai("sk-a", &body)).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(start_paused = true)]
async fn openai_charges_max_tokens_at_admission_and_refunds_the_unused_part_at_completion() {
    let simulator = Simulator::new(
        SimConfig::openai(100, 1_000)
            .latency(Duration::ZERO, Duration::from_millis(10))
            .completion_share(0.5, 0.5)
            .key("sk-a", "org-1"),
    );
    let service = simulator.service();
    // 36 characters: 9 + 4 = 13 prompt tokens; 87 reserved for the answer: 100 in all.
    let mut body = openai_body(36, 87);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let response = service
        .clone()
        .oneshot(openai("sk-a", &body))
        .await
        .unwrap();
    assert_eq!(
        header(response.headers(), "content-type"),
        "text/event-stream; charset=utf-8"
    );
    assert_eq!(
        header(response.headers(), "x-ratelimit-remaining-tokens"),
        "900"
    );
    assert_eq!(
        simulator
            .stats()
            .limit(Dimension::TotalTokens)
            .unwrap()
            .remaining,
        900,
        "prompt + max_tokens held while generating"
    );

    let start = Instant::now();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    // ceil(87 / 2) = 44 tokens at 10 ms each.
    assert_eq!(start.elapsed(), Duration::from_millis(440));
    let usage = scan(WireFormat::OpenAiChat, &bytes).unwrap();
    assert_eq!(
        (usage.input, usage.output, usage.total),
        (Some(13), Some(44), Some(57))
    );
    let settled = Profile::openai().usage(&usage).unwrap();
    assert_eq!((settled.input_tokens(), settled.output_tokens()), (13, 44));

    // 43 unused tokens refunded, plus 440 ms of refill at 1000 per minute (7.33).
    let stats = simulator.stats();
    let tpm = stats.limit(Dimension::TotalTokens).unwrap();
    assert_eq!(tpm.remaining, 950);
    assert_eq!(tpm.max_in_window, 57, "counted with the final usage");
    assert_eq!((stats.prompt_tokens, stats.completion_tokens), (13, 44));
    assert_eq!(stats.completed, 1);
}

#[tokio::test(start_paused = true)]
async fn openai_bodies_and_streams_are_real_shaped() {
    let simulator = instant(SimConfig::openai(100, 100_000).completion_share(1.0, 1.0));
    let service = simulator.service();
    // Any key is accepted when none is configured.
    let answer = call(&service, openai("sk-anything", &openai_body(8, 30))).await;
    assert_eq!(answer.status, StatusCode::OK);
    let json = answer.json();
    assert_eq!(json["object"], "chat.completion");
    assert_eq!(json["model"], "gpt-sim");
    assert_eq!(json["choices"][0]["finish_reason"], "length");
    assert_eq!(
        json["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .chars()
            .count(),
        120,
        "four characters per token"
    );
    assert_eq!(
        json["usage"],
        json!({"prompt_tokens": 6, "completion_tokens": 30, "total_tokens": 36})
    );
    assert!(header(&answer.headers, "x-request-id").starts_with("req_"));
    let scanned = scan(WireFormat::OpenAiChat, &answer.body).unwrap();
    assert_eq!((scanned.input, scanned.output), (Some(6), Some(30)));

    // A stream without include_usage reports none; its text is still counted.
    let mut body = openai_body(8, 30);
    body["stream"] = json!(true);
    let stream = call(&service, openai("sk-anything", &body)).await;
    let text = std::str::from_utf8(&stream.body).unwrap();
    assert!(text.starts_with("data: {"));
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert!(text.contains("\"object\":\"chat.completion.chunk\""));
    assert!(!text.contains("\"usage\""));
    let mut scanner = UsageScanner::new(WireFormat::OpenAiChat, true);
    scanner.data(&stream.body);
    assert_eq!(scanner.usage(), None);
    assert_eq!(scanner.streamed_chars(), 120);

    // With it: every chunk says "usage": null, the last before [DONE] has the usage.
    body["stream_options"] = json!({"include_usage": true});
    let stream = call(&service, openai("sk-anything", &body)).await;
    let events: Vec<&str> = std::str::from_utf8(&stream.body)
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .collect();
    let last: Value = serde_json::from_str(&events[events.len() - 2][6..]).unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["total_tokens"], 36);
    assert!(
        events[..events.len() - 2]
            .iter()
            .all(|e| e.contains("\"usage\":null"))
    );
}

#[tokio::test(start_paused = true)]
async fn anthropic_charges_input_and_output_buckets_and_names_the_refusing_one() {
    let simulator = Simulator::new(
        SimConfig::anthropic(100, 1_000, 500)
            .latency(Duration::ZERO, Duration::from_millis(1))
            .completion_share(0.1, 0.1)
            .key("sk-ant", "org-1"),
    );
    let service = simulator.service();
    let mut streams = Vec::new();
    // Each: 100 + 4 input tokens, 200 output tokens reserved; held while streaming.
    let mut body = anthropic_body(400, 200);
    body["stream"] = json!(true);
    for _ in 0..2 {
        let response = service
            .clone()
            .oneshot(anthropic("sk-ant", &body))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        streams.push(response);
    }
    let refused = call(&service, anthropic("sk-ant", &body)).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.json()["error"]["type"],
        "rate_limit_error",
        "{:?}",
        refused.json()
    );
    assert_eq!(refused.json()["type"], "error");
    assert_eq!(
        header(
            &refused.headers,
            "anthropic-ratelimit-output-tokens-remaining"
        ),
        "100"
    );
    assert_eq!(
        header(
            &refused.headers,
            "anthropic-ratelimit-input-tokens-remaining"
        ),
        "792"
    );
    // 100 more output tokens refill in 12 s.
    assert_eq!(header(&refused.headers, "retry-after"), "12");
    assert_eq!(
        header(&refused.headers, "retry-after-ms"),
        "",
        "Anthropic sends whole seconds only"
    );
    let reports = Profile::anthropic().limits(&refused.headers, SystemTime::now());
    let dims: Vec<Dimension> = reports.iter().map(|r| r.dimension).collect();
    assert_eq!(
        dims,
        [
            Dimension::Requests,
            Dimension::InputTokens,
            Dimension::OutputTokens
        ]
    );
    let output = reports[2];
    assert_eq!((output.limit, output.remaining), (Some(500), Some(100)));
    // Full again in 48 s (400 missing at 500 per minute), read back from an RFC 3339 instant.
    let reset = output.reset.unwrap();
    assert!(
        reset > Duration::from_secs(47) && reset <= Duration::from_millis(48_001),
        "{reset:?}"
    );
    assert_eq!(reports[0].remaining, Some(98));
    let mut response = http::Response::new(());
    *response.status_mut() = refused.status;
    *response.headers_mut() = refused.headers.clone();
    let limit = RateLimitError::from_response(&response, &refused.body).unwrap();
    assert_eq!(limit.retry_after(), Some(Duration::from_secs(12)));

    // The streams end: 20 tokens each, 180 refunded each.
    for stream in streams {
        let bytes = stream.into_body().collect().await.unwrap().to_bytes();
        let usage = scan(WireFormat::Anthropic, &bytes).unwrap();
        assert_eq!((usage.input, usage.output), (Some(104), Some(20)));
        let text = std::str::from_utf8(&bytes).unwrap();
        let events: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .collect();
        assert_eq!(events.first(), Some(&"message_start"));
        assert_eq!(
            &events[events.len() - 2..],
            ["message_delta", "message_stop"]
        );
        assert!(events.contains(&"content_block_delta"));
    }
    let stats = simulator.stats();
    let otpm = stats.limit(Dimension::OutputTokens).unwrap();
    // 500 − 2 × 20, plus 40 ms of refill (0.33 tokens).
    assert_eq!(otpm.remaining, 460);
    assert_eq!(otpm.max_in_window, 40);
    assert_eq!(
        stats.limit(Dimension::InputTokens).unwrap().max_in_window,
        208
    );
    assert_eq!(stats.rate_limited_by(Dimension::OutputTokens), 1);

    // Input: 600 + 4 tokens twice is over 1000 per minute.
    let big = anthropic_body(2_400, 10);
    assert_eq!(
        call(&service, anthropic("sk-ant", &big)).await.status,
        StatusCode::OK
    );
    let refused = call(&service, anthropic("sk-ant", &big)).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        refused.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("input tokens per min (ITPM)")
    );
    assert_eq!(simulator.stats().rate_limited_by(Dimension::InputTokens), 1);
}

#[tokio::test(start_paused = true)]
async fn anthropic_non_streamed_message_has_its_usage() {
    let simulator = instant(SimConfig::anthropic(10, 10_000, 10_000).completion_share(1.0, 1.0));
    let service = simulator.service();
    let mut body = anthropic_body(20, 12);
    body["system"] = json!("abcdabcd");
    let answer = call(&service, anthropic("k", &body)).await;
    assert_eq!(answer.status, StatusCode::OK);
    let json = answer.json();
    assert_eq!(json["type"], "message");
    assert_eq!(json["stop_reason"], "max_tokens");
    // System 4 + 2, message 4 + 5.
    assert_eq!(json["usage"]["input_tokens"], 15);
    assert_eq!(json["usage"]["output_tokens"], 12);
    assert!(header(&answer.headers, "request-id").starts_with("req_"));
    let usage = scan(WireFormat::Anthropic, &answer.body).unwrap();
    assert_eq!((usage.input, usage.output), (Some(15), Some(12)));
    let reports = Profile::anthropic().limits(&answer.headers, SystemTime::now());
    assert_eq!(reports.len(), 3);
    assert_eq!(
        (reports[1].limit, reports[1].remaining),
        (Some(10_000), Some(10_000 - 15))
    );
}

#[tokio::test(start_paused = true)]
async fn a_cost_above_the_limit_is_a_400_not_a_429() {
    let simulator = instant(SimConfig::openai(100, 1_000).key("sk-a", "org-1"));
    let service = simulator.service();
    // 4 + 100 prompt tokens and 897 reserved: 1001 > 1000.
    let answer = call(&service, openai("sk-a", &openai_body(400, 897))).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    let error = &answer.json()["error"];
    assert_eq!(error["code"], "request_too_large");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("Requested 1001")
    );
    assert_eq!(
        header(&answer.headers, "x-ratelimit-remaining-tokens"),
        "1000"
    );
    assert_eq!(
        call(&service, openai("sk-a", &openai_body(400, 896)))
            .await
            .status,
        StatusCode::OK
    );
    let stats = simulator.stats();
    assert_eq!(
        (stats.bad_requests, stats.rate_limited, stats.admitted),
        (1, 0, 1)
    );

    let anthropic_sim = instant(SimConfig::anthropic(100, 1_000, 100));
    let answer = call(
        &anthropic_sim.service(),
        anthropic("k", &anthropic_body(4, 101)),
    )
    .await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.json()["error"]["type"], "invalid_request_error");
}

#[tokio::test(start_paused = true)]
async fn unknown_keys_get_401_and_malformed_requests_400() {
    let simulator = instant(
        SimConfig::openai(100, 100_000)
            .key("sk-a", "org-1")
            .key("sk-b", "org-1"),
    );
    let service = simulator.service();
    let good = openai_body(8, 10).to_string();
    for request in [
        request(Style::OpenAi, None, good.clone()),
        request(Style::OpenAi, Some("sk-wrong"), good.clone()),
    ] {
        let answer = call(&service, request).await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
        assert_eq!(answer.json()["error"]["code"], "invalid_api_key");
        assert!(answer.headers.get("x-ratelimit-limit-requests").is_none());
    }
    for body in [
        "not json".to_owned(),
        "[1, 2]".to_owned(),
        json!({"model": "m"}).to_string(),
        json!({"messages": []}).to_string(),
        json!({"messages": ["hi"]}).to_string(),
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).to_string(),
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}).to_string(),
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}).to_string(),
        json!({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}).to_string(),
    ] {
        let answer = call(&service, request(Style::OpenAi, Some("sk-b"), body.clone())).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(answer.json()["error"]["type"], "invalid_request_error");
        assert_eq!(header(&answer.headers, "x-ratelimit-limit-requests"), "100");
    }
    let wrong_route = Request::post("/v1/messages")
        .header("authorization", "Bearer sk-a")
        .body(Full::new(Bytes::from(good)))
        .unwrap();
    assert_eq!(
        call(&service, wrong_route).await.status,
        StatusCode::NOT_FOUND
    );
    let stats = simulator.stats();
    assert_eq!(
        (stats.unauthorized, stats.bad_requests, stats.admitted),
        (2, 10, 0)
    );

    let anthropic_sim = instant(SimConfig::anthropic(10, 1_000, 1_000).key("sk-ant", "org"));
    let service = anthropic_sim.service();
    let no_max = json!({"messages": [{"role": "user", "content": "hi"}]});
    let answer = call(&service, anthropic("sk-ant", &no_max)).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.json()["type"], "error");
    assert_eq!(answer.json()["error"]["type"], "invalid_request_error");
    assert!(
        answer.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens")
    );
    let answer = call(
        &service,
        request(Style::Anthropic, None, anthropic_body(8, 10).to_string()),
    )
    .await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    assert_eq!(answer.json()["error"]["type"], "authentication_error");
    // An OpenAI route on an Anthropic simulator is not found.
    let answer = call(
        &service,
        request(
            Style::OpenAi,
            Some("sk-ant"),
            anthropic_body(8, 10).to_string(),
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
}

#[tokio::test(start_paused = true)]
async fn keys_of_one_organisation_share_its_quota_and_other_organisations_do_not() {
    let simulator = instant(
        SimConfig::openai(2, 100_000)
            .key("sk-a", "org-1")
            .key("sk-b", "org-1")
            .key("sk-c", "org-2"),
    );
    let service = simulator.service();
    let body = openai_body(8, 10);
    let mut statuses = Vec::new();
    for key in ["sk-a", "sk-b", "sk-a", "sk-c", "sk-c", "sk-c"] {
        statuses.push(call(&service, openai(key, &body)).await.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 200, 200, 429]);
    let stats = simulator.stats();
    let orgs: Vec<(&str, u64)> = stats
        .limits
        .iter()
        .filter(|l| l.dimension == Dimension::Requests)
        .map(|l| (l.organization.as_str(), l.max_in_window))
        .collect();
    assert_eq!(orgs, [("org-1", 2), ("org-2", 2)]);
}

#[tokio::test(start_paused = true)]
async fn a_sub_window_refuses_a_burst_the_minute_would_allow() {
    let simulator = instant(SimConfig::openai(60, 100_000).sub_window(Dimension::Requests, 60));
    let service = simulator.service();
    let body = openai_body(8, 10);
    assert_eq!(
        call(&service, openai("k", &body)).await.status,
        StatusCode::OK
    );
    let refused = call(&service, openai("k", &body)).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&refused.headers, "retry-after"), "1");
    assert_eq!(header(&refused.headers, "retry-after-ms"), "1000");
    // The minute's limit still has 59 left: the headers report the minute.
    assert_eq!(
        header(&refused.headers, "x-ratelimit-remaining-requests"),
        "59"
    );
    time::advance(Duration::from_secs(1)).await;
    assert_eq!(
        call(&service, openai("k", &body)).await.status,
        StatusCode::OK
    );

    let stats = simulator.stats();
    let sub = stats
        .limits
        .iter()
        .find(|l| l.sub_window == Some(60))
        .unwrap();
    assert_eq!(
        (sub.window, sub.amount, sub.rate_limited, sub.max_in_window),
        (Duration::from_secs(1), 1, 1, 1)
    );
    assert_eq!(stats.limit(Dimension::Requests).unwrap().rate_limited, 0);
    assert_eq!(stats.limit(Dimension::Requests).unwrap().max_in_window, 2);
}

#[tokio::test(start_paused = true)]
async fn a_daily_limit_counts_over_its_own_period() {
    let day = Duration::from_secs(86_400);
    let simulator = instant(SimConfig::openai(600, 1_000_000).limit(Dimension::Requests, 3, day));
    let service = simulator.service();
    let body = openai_body(8, 10);
    for _ in 0..3 {
        assert_eq!(
            call(&service, openai("k", &body)).await.status,
            StatusCode::OK
        );
        time::advance(Duration::from_secs(60)).await;
    }
    let refused = call(&service, openai("k", &body)).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        refused.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("requests per day (RPD)")
    );
    // A third of a day after the first one, minus the 3 minutes passed.
    assert_eq!(header(&refused.headers, "retry-after"), "28620");
    let mut response = http::Response::new(());
    *response.status_mut() = refused.status;
    let limit = RateLimitError::from_response(&response, &refused.body).unwrap();
    assert_eq!(limit.limited_by(), LimitedBy::Daily);
    let stats = simulator.stats();
    let daily = stats.limits.iter().find(|l| l.window == day).unwrap();
    assert_eq!((daily.rate_limited, daily.max_in_window), (1, 3));
}

#[tokio::test(start_paused = true)]
async fn faults_come_at_their_seeded_shares_and_repeat_with_the_seed() {
    async fn run(seed: u64) -> (Vec<u16>, tower_llm_quota_sim::SimStats) {
        let simulator = Simulator::new(
            SimConfig::anthropic(1_000_000, 100_000_000, 100_000_000)
                .latency(Duration::from_millis(100), Duration::ZERO)
                .seed(seed)
                .faults(
                    Faults::none()
                        .server_errors(0.2)
                        .connection_resets(0.1)
                        .latency_spikes(0.1, Duration::from_secs(5)),
                ),
        );
        let service = simulator.service();
        let mut outcomes = Vec::new();
        for _ in 0..1_000 {
            let start = Instant::now();
            let result = service
                .clone()
                .oneshot(anthropic("k", &anthropic_body(8, 10)))
                .await;
            match result {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let body = response.into_body().collect().await.unwrap().to_bytes();
                    let json: Value = serde_json::from_slice(&body).unwrap();
                    match status {
                        200 => {
                            let spiked = start.elapsed() == Duration::from_millis(5_100);
                            assert!(spiked || start.elapsed() == Duration::from_millis(100));
                            outcomes.push(if spiked { 1 } else { 200 });
                        }
                        529 => assert_eq!(json["error"]["type"], "overloaded_error"),
                        500 => assert_eq!(json["error"]["type"], "api_error"),
                        other => panic!("unexpected {other}"),
                    }
                    if status != 200 {
                        outcomes.push(status);
                    }
                }
                Err(error) => {
                    assert_eq!(error.kind(), io::ErrorKind::ConnectionReset);
                    outcomes.push(0);
                }
            }
        }
        (outcomes, simulator.stats())
    }
    let (outcomes, stats) = run(7).await;
    let count = |code| outcomes.iter().filter(|&&o| o == code).count() as u64;
    assert_eq!(stats.connection_resets, count(0));
    assert_eq!(stats.server_errors, count(500) + count(529));
    assert_eq!(stats.latency_spikes, count(1));
    assert_eq!(stats.admitted, count(200) + count(1));
    // Resets: 10 % of 1000; server errors: 20 % of the other 900; spikes: 10 % of the rest.
    assert!((70..=130).contains(&stats.connection_resets), "{stats:?}");
    assert!((140..=220).contains(&stats.server_errors), "{stats:?}");
    assert!(count(500) > 50 && count(529) > 50);
    assert!((40..=100).contains(&stats.latency_spikes), "{stats:?}");

    let (again, _) = run(7).await;
    assert_eq!(outcomes, again, "the same seed, the same faults");
    let (other, _) = run(8).await;
    assert_ne!(outcomes, other);
}

#[tokio::test(start_paused = true)]
async fn a_quota_lowered_without_notice_applies_from_its_instant() {
    let simulator = instant(SimConfig::openai(600, 1_000_000).lower_limit_at(
        Duration::from_secs(10),
        Dimension::Requests,
        60,
    ));
    let service = simulator.service();
    let body = openai_body(8, 10);
    let before = call(&service, openai("k", &body)).await;
    assert_eq!(header(&before.headers, "x-ratelimit-limit-requests"), "600");
    assert_eq!(
        header(&before.headers, "x-ratelimit-remaining-requests"),
        "599"
    );
    time::advance(Duration::from_secs(10)).await;
    let after = call(&service, openai("k", &body)).await;
    assert_eq!(after.status, StatusCode::OK);
    assert_eq!(header(&after.headers, "x-ratelimit-limit-requests"), "60");
    assert_eq!(
        header(&after.headers, "x-ratelimit-remaining-requests"),
        "59"
    );
    let reports = Profile::openai().limits(&after.headers, SystemTime::now());
    assert_eq!(reports[0].limit, Some(60));
    let mut admitted = 1;
    while call(&service, openai("k", &body)).await.status == StatusCode::OK {
        admitted += 1;
    }
    assert_eq!(admitted, 60);
    assert_eq!(
        simulator.stats().limit(Dimension::Requests).unwrap().amount,
        60
    );
}

#[tokio::test(start_paused = true)]
async fn the_sliding_window_maximum_and_the_time_series_are_exact() {
    // 60 per minute: a full bucket at once, then one per second: 119 within one minute.
    let simulator =
        instant(SimConfig::openai(60, 1_000_000).series_interval(Duration::from_secs(10)));
    let service = simulator.service();
    let body = openai_body(8, 10);
    let start = Instant::now();
    let mut admitted = 0;
    while start.elapsed() < Duration::from_secs(120) {
        if call(&service, openai("k", &body)).await.status == StatusCode::OK {
            admitted += 1;
        } else {
            time::advance(Duration::from_millis(250)).await;
        }
    }
    let stats = simulator.stats();
    // The bucket at once, then one each second from 1 s to 119 s.
    assert_eq!(admitted, 60 + 119);
    let rpm = stats.limit(Dimension::Requests).unwrap();
    assert_eq!(
        rpm.max_in_window, 119,
        "capacity plus a minute of refill, less one"
    );
    assert_eq!(stats.series_interval, Duration::from_secs(10));
    assert_eq!(stats.series.len(), 12);
    assert_eq!(stats.series[0].requests, 60 + 9);
    assert!(stats.series[1..].iter().all(|p| p.requests == 10));
    assert_eq!(stats.series[0].input_tokens, 69 * 6);
    // Three refusals per second between refills.
    assert_eq!(stats.series[1].rate_limited, 40);
    assert_eq!(stats.rate_limited_at.len() as u64, stats.rate_limited);
    assert!(stats.rate_limited_at.windows(2).all(|w| w[0] <= w[1]));

    simulator.reset_stats();
    let stats = simulator.stats();
    assert_eq!((stats.received, stats.admitted), (0, 0));
    assert!(stats.series.is_empty());
    assert_eq!(stats.limit(Dimension::Requests).unwrap().max_in_window, 0);
}

#[tokio::test(start_paused = true)]
async fn a_governed_client_never_gets_a_429_and_stays_within_the_quota_at_full_speed() {
    use std::num::NonZeroU64;
    use tower::ServiceBuilder;
    use tower_llm_quota::provider::ProviderUsage;
    use tower_llm_quota::{Budget, Cost, Limit, Quota, TokenBudgetLayer};

    let simulator = Simulator::new(
        SimConfig::openai(120, 12_000)
            .minute(Duration::from_secs(6))
            .latency(Duration::from_millis(200), Duration::from_millis(2)),
    );
    let period = Duration::from_secs(6);
    let limit = |dimension, amount| {
        Limit::new(dimension, NonZeroU64::new(amount).unwrap(), period)
            .unwrap()
            .with_headroom(0.9)
            .unwrap()
    };
    let budget = Budget::new(
        Quota::new()
            .with_limit(limit(Dimension::Requests, 120))
            .with_limit(limit(Dimension::TotalTokens, 12_000)),
    );
    let client = ServiceBuilder::new()
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::with_extractor(ProviderUsage::new(
            Profile::openai(),
        )))
        .service(simulator.service());
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..300usize {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let chars = 40 + (i % 7) * 40;
            let mut request = openai("k", &openai_body(chars, 100));
            // The simulator's own count: 4 + chars / 4 prompt tokens.
            request
                .extensions_mut()
                .insert(Cost::new(4 + chars as u64 / 4, 100));
            let response = client.oneshot(request).await.unwrap();
            let status = response.status();
            response.into_body().collect().await.unwrap();
            status
        }));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap(), StatusCode::OK);
    }
    let stats = simulator.stats();
    assert_eq!((stats.admitted, stats.rate_limited), (300, 0));
    let tokens = stats.prompt_tokens + stats.completion_tokens;
    let minimum = Duration::from_secs_f64(tokens as f64 / 2_000.0);
    // Close to the fastest possible run (the tokens at the nominal rate): 90 % headroom.
    assert!(
        start.elapsed() < minimum.mul_f64(1.25),
        "{:?}",
        start.elapsed()
    );
    // And within the nominal quota in every sliding minute.
    let tpm = stats.limit(Dimension::TotalTokens).unwrap();
    assert!(tpm.max_in_window <= 12_000, "{}", tpm.max_in_window);
}

#[tokio::test]
async fn over_http_a_completion_and_a_429() {
    let simulator = instant(SimConfig::openai(1, 10_000).key("sk-a", "org-1"));
    let server = simulator
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let url = format!("{}/v1/chat/completions", server.url());
    let client = reqwest::Client::new();
    let send = || {
        client
            .post(&url)
            .bearer_auth("sk-a")
            .body(openai_body(8, 10).to_string())
            .send()
    };
    let ok = send().await.unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(ok.headers()["x-ratelimit-remaining-requests"], "0");
    let json: Value = serde_json::from_slice(&ok.bytes().await.unwrap()).unwrap();
    assert_eq!(json["usage"]["prompt_tokens"], 6);

    let refused = send().await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "60");
    let json: Value = serde_json::from_slice(&refused.bytes().await.unwrap()).unwrap();
    assert_eq!(json["error"]["code"], "rate_limit_exceeded");

    let unauthorized = client.post(&url).body("{}").send().await.unwrap();
    assert_eq!(unauthorized.status(), 401);
    assert_eq!(simulator.stats().received, 3);

    let addr = server.local_addr();
    server.shutdown().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn over_http_a_stream_arrives_in_events_and_a_reset_closes_the_connection() {
    let simulator = Simulator::new(
        SimConfig::anthropic(100, 100_000, 100_000)
            .latency(Duration::ZERO, Duration::from_millis(1))
            .completion_share(1.0, 1.0),
    );
    let server = simulator
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let url = format!("{}/v1/messages", server.url());
    let client = reqwest::Client::new();
    let mut body = anthropic_body(8, 32);
    body["stream"] = json!(true);
    let mut response = client
        .post(&url)
        .header("x-api-key", "k")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["anthropic-ratelimit-output-tokens-limit"],
        "100000"
    );
    let mut scanner = UsageScanner::new(WireFormat::Anthropic, true);
    let mut chunks = 0;
    while let Some(chunk) = response.chunk().await.unwrap() {
        scanner.data(&chunk);
        chunks += 1;
    }
    assert!(chunks > 1, "sent over time, not at once");
    let usage = scanner.usage().unwrap();
    assert_eq!((usage.input, usage.output), (Some(6), Some(32)));
    drop(server);

    let resetting = Simulator::new(
        SimConfig::openai(100, 100_000).faults(Faults::none().connection_resets(1.0)),
    );
    let server = resetting
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let error = client
        .post(format!("{}/v1/chat/completions", server.url()))
        .bearer_auth("k")
        .body(openai_body(8, 10).to_string())
        .send()
        .await
        .unwrap_err();
    assert!(!error.is_status());
    assert_eq!(resetting.stats().connection_resets, 1);
}

/// Reads a response the way the reconcile layer does, with `ProviderUsage`.
async fn provider_usage(
    profile: Profile,
    response: http::Response<tower_llm_quota_sim::SimBody>,
) -> tower_llm_quota::Usage {
    use tower_llm_quota::provider::ProviderUsage;
    use tower_llm_quota::{
        Budget, Cost, Quota,
        reconcile::{BodyEnd, ExtractUsage, ScanUsage},
    };

    let (parts, mut body) = response.into_parts();
    let mut scan = ProviderUsage::new(profile).start(&parts, &Budget::new(Quota::new()));
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            scan.data(&data);
        }
    }
    scan.finish(BodyEnd::Complete, Cost::new(0, 0)).unwrap()
}

#[tokio::test(start_paused = true)]
async fn provider_usage_reads_both_streams_and_bodies() {
    let openai_sim = instant(SimConfig::openai(100, 100_000).completion_share(0.5, 0.5));
    let mut body = openai_body(80, 40);
    for stream in [false, true] {
        body["stream"] = json!(stream);
        body["stream_options"] = json!({"include_usage": true});
        let response = openai_sim
            .service()
            .oneshot(openai("k", &body))
            .await
            .unwrap();
        let usage = provider_usage(Profile::openai(), response).await;
        assert_eq!((usage.input_tokens(), usage.output_tokens()), (24, 20));
    }
    let anthropic_sim =
        instant(SimConfig::anthropic(100, 100_000, 100_000).completion_share(0.5, 0.5));
    let mut body = anthropic_body(80, 40);
    for stream in [false, true] {
        body["stream"] = json!(stream);
        let response = anthropic_sim
            .service()
            .oneshot(anthropic("k", &body))
            .await
            .unwrap();
        let usage = provider_usage(Profile::anthropic(), response).await;
        assert_eq!((usage.input_tokens(), usage.output_tokens()), (24, 20));
    }
    assert_eq!(openai_sim.stats().completion_tokens, 40);
    assert_eq!(anthropic_sim.stats().completion_tokens, 40);
}

#[tokio::test(start_paused = true)]
async fn stream_events_are_spread_over_the_generation_time() {
    let simulator = Simulator::new(
        SimConfig::openai(100, 100_000)
            .latency(Duration::from_millis(500), Duration::from_millis(20))
            .completion_share(1.0, 1.0),
    );
    let mut body = openai_body(8, 32);
    body["stream"] = json!(true);
    let start = Instant::now();
    let response = simulator
        .service()
        .oneshot(openai("k", &body))
        .await
        .unwrap();
    // The head after the base latency.
    assert_eq!(start.elapsed(), Duration::from_millis(500));
    let mut body = response.into_body();
    let mut arrivals = Vec::new();
    while let Some(frame) = body.frame().await {
        let data = frame.unwrap().into_data().unwrap();
        if std::str::from_utf8(&data)
            .unwrap()
            .contains("\"content\":\" ")
        {
            arrivals.push(start.elapsed());
        }
    }
    // 32 tokens in 16 events of 2 tokens, 40 ms apart.
    let expected: Vec<Duration> = (1..=16)
        .map(|i| Duration::from_millis(500 + 40 * i))
        .collect();
    assert_eq!(arrivals, expected);

    // Not streamed: the whole latency, then the whole body.
    body_timing(&simulator).await;
}

async fn body_timing(simulator: &Simulator) {
    let start = Instant::now();
    let response = simulator
        .service()
        .oneshot(openai("k", &openai_body(8, 32)))
        .await
        .unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(500 + 32 * 20));
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_stream_dropped_midway_is_settled_with_its_whole_completion() {
    let simulator = Simulator::new(
        SimConfig::anthropic(100, 100_000, 1_000)
            .minute(Duration::from_secs(3_600))
            .latency(Duration::ZERO, Duration::from_millis(10))
            .completion_share(0.5, 0.5),
    );
    let mut body = anthropic_body(8, 400);
    body["stream"] = json!(true);
    let response = simulator
        .service()
        .oneshot(anthropic("k", &body))
        .await
        .unwrap();
    let mut body = response.into_body();
    for _ in 0..4 {
        body.frame().await.unwrap().unwrap();
    }
    assert_eq!(simulator.stats().completed, 0);
    assert_eq!(
        simulator
            .stats()
            .limit(Dimension::OutputTokens)
            .unwrap()
            .remaining,
        600,
        "max_tokens held while streaming"
    );
    drop(body);
    let stats = simulator.stats();
    assert_eq!((stats.completed, stats.completion_tokens), (1, 200));
    let otpm = stats.limit(Dimension::OutputTokens).unwrap();
    // 200 charged; 130 ms of refill at 1000 per hour is under one token.
    assert_eq!((otpm.remaining, otpm.max_in_window), (800, 200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_on_threads_are_all_counted_once() {
    let simulator = instant(SimConfig::openai(100, 1_000_000).minute(Duration::from_secs(3_600)));
    let mut tasks = Vec::new();
    for _ in 0..300 {
        let service = simulator.service();
        tasks.push(tokio::spawn(async move {
            service
                .oneshot(openai("k", &openai_body(8, 10)))
                .await
                .unwrap()
                .status()
        }));
    }
    let mut ok = 0;
    for task in tasks {
        if task.await.unwrap() == StatusCode::OK {
            ok += 1;
        }
    }
    let stats = simulator.stats();
    assert_eq!((ok, stats.admitted, stats.rate_limited), (100, 100, 200));
    assert_eq!(stats.limit(Dimension::Requests).unwrap().max_in_window, 100);
}

#[tokio::test(start_paused = true)]
async fn injected_faults_are_not_charged_to_the_quota() {
    // 3 requests a minute; half of the requests fail with a 5xx before reaching the quota.
    let simulator = Simulator::new(
        SimConfig::openai(3, 1_000_000)
            .faults(Faults::none().server_errors(0.5))
            .seed(3),
    );
    let service = simulator.service();
    let mut statuses = Vec::new();
    for _ in 0..12 {
        let answer = call(&service, openai("sk-a", &openai_body(100, 10))).await;
        statuses.push(answer.status.as_u16());
    }
    let stats = simulator.stats();
    let faults = statuses.iter().filter(|&&s| s >= 500).count() as u64;
    assert!(faults >= 3, "enough faults to matter: {statuses:?}");
    assert!(
        statuses.iter().position(|&s| s >= 500) < statuses.iter().position(|&s| s == 200),
        "a fault comes before the first admission: {statuses:?}"
    );
    // The three requests the quota holds were admitted all the same; the rest were refused.
    assert_eq!(stats.admitted, 3, "{statuses:?}");
    assert_eq!(stats.rate_limited, 12 - 3 - faults);
    assert_eq!(stats.limit(Dimension::Requests).unwrap().remaining, 0);
}

#[tokio::test(start_paused = true)]
async fn a_max_tokens_above_the_models_is_refused() {
    let simulator = Simulator::new(SimConfig::openai(100, 0).max_output_tokens(4_096));
    let service = simulator.service();
    let answer = call(&service, openai("sk-a", &openai_body(100, 20_000_000))).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert!(
        answer.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens")
    );
    let answer = call(&service, openai("sk-a", &openai_body(100, 4_096))).await;
    assert_eq!(answer.status, StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_neighbour_spends_its_share_of_the_quota_unseen() {
    // Half of 12,000 TPM in requests of 100 tokens: one a second.
    let simulator = Simulator::new(
        SimConfig::openai(600, 12_000)
            .latency(Duration::ZERO, Duration::ZERO)
            .completion_share(1.0, 1.0)
            .key("sk-a", "org-1")
            .neighbour("org-1", 0.5, 100),
    );
    time::sleep(Duration::from_millis(59_900)).await;
    let stats = simulator.stats();
    assert_eq!(stats.neighbour_admitted, 60, "at 0 s, 1 s, ..., 59 s");
    assert_eq!(stats.neighbour_tokens, 6_000);
    assert_eq!(stats.neighbour_rate_limited, 0);
    assert_eq!((stats.admitted, stats.received), (0, 0), "counted apart");
    // A client empties the token bucket (1,004 prompt tokens and 10,996 of output).
    let answer = call(
        &simulator.service(),
        openai("sk-a", &openai_body(4_000, 10_996)),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    // At 60 s, 20 tokens have refilled: the neighbour's request is refused, not retried.
    time::sleep(Duration::from_millis(500)).await;
    let stats = simulator.stats();
    assert_eq!(
        (stats.neighbour_admitted, stats.neighbour_rate_limited),
        (60, 1)
    );
    // At 61 s, 220 have: admitted again.
    time::sleep(Duration::from_secs(1)).await;
    assert_eq!(simulator.stats().neighbour_admitted, 61);
}

#[tokio::test(start_paused = true)]
async fn server_errors_can_stream_large_bodies_with_no_length() {
    let simulator = Simulator::new(
        SimConfig::openai(60, 100_000).faults(
            Faults::none()
                .server_errors(1.0)
                .streamed_error_bodies(100 * 1_024),
        ),
    );
    let response = simulator
        .service()
        .oneshot(openai("sk-a", &openai_body(100, 10)))
        .await
        .unwrap();
    assert!(response.status().is_server_error());
    assert_eq!(http_body::Body::size_hint(response.body()).upper(), None);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), 100 * 1_024);
    // The error document, then padding: still one JSON value.
    let json: Value = serde_json::from_slice(&body).unwrap();
    assert!(json["error"].is_object(), "{json}");
}
