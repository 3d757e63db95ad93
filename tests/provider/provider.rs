//! Provider profiles end to end: the budget follows what the provider's headers say, and a
//! stream cut before its usage is charged from what it streamed.

use tower_llm_quota_test_support as support;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use support::{budget, levels, limit};
use tokio::time::Instant;
use tower::{Layer, ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::provider::{Profile, ProviderUsage};
use tower_llm_quota::{Cost, Dimension, ReconcileLayer, TokenBudgetLayer};

const SEC: Duration = Duration::from_secs(1);

/// A provider that enforces a token bucket of its own (`limit` per minute, as much at once),
/// shared with another client we cannot see, and reports its state in OpenAI's headers.
#[derive(Debug)]
struct Provider {
    limit: u64,
    level: f64,
    at: Instant,
    rejected: u64,
}

impl Provider {
    fn refill(&mut self) {
        let now = Instant::now();
        let rate = self.limit as f64 / 60.0;
        self.level = (self.level + (now - self.at).as_secs_f64() * rate).min(self.limit as f64);
        self.at = now;
    }

    fn answer(&mut self, tokens: u64) -> Response<Full<Bytes>> {
        self.refill();
        let mut response = if self.level + 1e-6 >= tokens as f64 {
            self.level -= tokens as f64;
            let body = format!(
                r#"{{"id":"x","choices":[{{"message":{{"content":"ok"}}}}],"usage":{{"prompt_tokens":{tokens},"completion_tokens":0,"total_tokens":{tokens}}}}}"#
            );
            Response::new(Full::new(Bytes::from(body)))
        } else {
            self.rejected += 1;
            let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
            *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            response
        };
        let headers = response.headers_mut();
        headers.insert("x-ratelimit-limit-tokens", self.limit.into());
        headers.insert(
            "x-ratelimit-remaining-tokens",
            (self.level.floor() as u64).into(),
        );
        headers.insert("content-type", "application/json".parse().unwrap());
        response
    }
}

#[tokio::test(start_paused = true)]
async fn the_budget_follows_the_providers_remaining_and_its_lowered_limit() {
    // Our view: 12,000 tokens a minute, all of it at once if free.
    let budget = budget([limit(Dimension::TotalTokens, 12_000, 60 * SEC, 12_000)]);
    // The provider's: the same, but another client already spent 10,000.
    let provider = Arc::new(Mutex::new(Provider {
        limit: 12_000,
        level: 2_000.0,
        at: Instant::now(),
        rejected: 0,
    }));
    let state = provider.clone();
    let client = service_fn(move |request: Request<String>| {
        let tokens: u64 = request.body().parse().unwrap();
        let response = state.lock().unwrap().answer(tokens);
        async move { Ok::<_, Infallible>(response) }
    });
    let llm = ServiceBuilder::new()
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::with_extractor(ProviderUsage::new(
            Profile::openai(),
        )))
        .service(client);

    let send = |tokens: u64| {
        let llm = llm.clone();
        async move {
            let mut request = Request::new(tokens.to_string());
            request.extensions_mut().insert(Cost::new(tokens, 0));
            let response = llm.oneshot(request).await.unwrap();
            let status = response.status();
            response.into_body().collect().await.unwrap();
            status
        }
    };

    // The first response says 1,500 are left: our level drops from 11,500 to it.
    assert_eq!(send(500).await, StatusCode::OK);
    assert_eq!(levels(&budget), [1_500]);
    // So the next requests wait for refill instead of meeting a 429.
    for _ in 0..10 {
        assert_eq!(send(1_000).await, StatusCode::OK);
    }

    // A quiet minute, then the provider halves its limit without notice: the next response
    // says so, and the budget follows it from there.
    tokio::time::sleep(60 * SEC).await;
    provider.lock().unwrap().limit = 6_000;
    for _ in 0..10 {
        assert_eq!(send(1_000).await, StatusCode::OK);
    }
    let snapshot = budget.snapshot();
    assert_eq!(snapshot.limits()[0].limit().amount().get(), 6_000);
    assert_eq!(
        provider.lock().unwrap().rejected,
        0,
        "the provider never said 429"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_cut_before_its_usage_is_charged_what_it_streamed() {
    let budget = budget([limit(Dimension::TotalTokens, 10_000, 60 * SEC, 10_000)]);
    let (tx, rx) =
        futures::channel::mpsc::unbounded::<Result<http_body::Frame<Bytes>, Infallible>>();
    let rx = Arc::new(Mutex::new(Some(rx)));
    let client = service_fn(move |_request: Request<String>| {
        let rx = rx.lock().unwrap().take().unwrap();
        async move {
            let mut response = Response::new(StreamBody::new(rx));
            response
                .headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            Ok::<_, Infallible>(response)
        }
    });
    let llm = ServiceBuilder::new()
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::with_extractor(ProviderUsage::new(
            Profile::openai(),
        )))
        .service(client);
    let mut request = Request::new(String::new());
    request.extensions_mut().insert(Cost::new(300, 1_000));
    let response = llm.oneshot(request).await.unwrap();
    assert_eq!(levels(&budget), [8_700]);

    // 70 characters of answer, then the connection drops: no usage chunk ever came.
    let delta = r#"data: {"choices":[{"index":0,"delta":{"content":"0123456789"}}],"usage":null}"#;
    let mut body = response.into_body();
    for _ in 0..7 {
        tx.unbounded_send(Ok(http_body::Frame::data(Bytes::from(format!(
            "{delta}\n\n"
        )))))
        .unwrap();
        body.frame().await.unwrap().unwrap();
    }
    drop(body);
    // Charged 300 (the input estimate) + 20 (70 characters at 3.5 a token): 980 refunded.
    assert_eq!(levels(&budget), [10_000 - 320]);
}

#[tokio::test(start_paused = true)]
async fn real_output_teaches_the_estimate_of_the_next_requests() {
    use tower_llm_quota::estimate::{EstimateLayer, LearnedOutput};

    let budget = budget([limit(
        Dimension::OutputTokens,
        1_000_000,
        60 * SEC,
        1_000_000,
    )]);
    let learned = LearnedOutput::new();
    let client = service_fn(|_request: Request<Full<Bytes>>| async {
        // Every answer uses 120 output tokens, far below max_tokens.
        let body = r#"{"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":120,"total_tokens":140}}"#;
        let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
        response
            .headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        Ok::<_, Infallible>(response)
    });
    let llm = ServiceBuilder::new()
        .layer(EstimateLayer::new().learn_output(learned.clone()))
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(ReconcileLayer::with_extractor(ProviderUsage::new(
            Profile::openai(),
        )))
        .service(client);
    let body = r#"{"model":"gpt-4o","max_tokens":2000,"messages":[{"role":"user","content":"Classify this ticket."}]}"#;
    let send = || {
        let llm = llm.clone();
        async move {
            let mut request = Request::new(Full::new(Bytes::from_static(body.as_bytes())));
            *request.uri_mut() = "/v1/chat/completions".parse().unwrap();
            request
                .headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            let response = llm.oneshot(request).await.unwrap();
            response.into_body().collect().await.unwrap();
        }
    };
    for _ in 0..25 {
        send().await;
    }
    assert_eq!(learned.routes(), 1);
    // Once learned, the next request reserves the p95 of real output (120), not max_tokens.
    let before = levels(&budget)[0];
    let mut request = Request::new(Full::new(Bytes::from_static(body.as_bytes())));
    *request.uri_mut() = "/v1/chat/completions".parse().unwrap();
    request
        .headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    let inner = service_fn(|request: Request<Full<Bytes>>| async move {
        Ok::<_, Infallible>(*request.extensions().get::<Cost>().unwrap())
    });
    let estimated = EstimateLayer::new()
        .learn_output(learned.clone())
        .layer(inner)
        .oneshot(request)
        .await
        .unwrap();
    assert_eq!(estimated.output_tokens(), 120);
    assert_eq!(levels(&budget)[0], before);
}

#[tokio::test(start_paused = true)]
async fn usage_asked_for_the_caller_is_settled_then_hidden_from_it() {
    use tower_llm_quota::estimate::EstimateLayer;
    use tower_llm_quota::provider::StripUsageLayer;

    let budget = budget([limit(Dimension::TotalTokens, 100_000, 60 * SEC, 100_000)]);
    let stream = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Billing\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"total_tokens\":42}}\n\n",
        "data: [DONE]\n\n",
    );
    let seen = Arc::new(Mutex::new(String::new()));
    let sent = seen.clone();
    let client = service_fn(move |request: Request<Full<Bytes>>| {
        let sent = sent.clone();
        async move {
            let body = request.into_body().collect().await.unwrap().to_bytes();
            *sent.lock().unwrap() = String::from_utf8(body.to_vec()).unwrap();
            let mut response = Response::new(Full::new(Bytes::from_static(stream.as_bytes())));
            response
                .headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            Ok::<_, Infallible>(response)
        }
    });
    let llm = ServiceBuilder::new()
        .layer(EstimateLayer::new().include_stream_usage(true))
        .layer(TokenBudgetLayer::new(budget.clone()))
        .layer(StripUsageLayer)
        .layer(ReconcileLayer::with_extractor(ProviderUsage::new(
            Profile::openai(),
        )))
        .service(client);
    let body = r#"{"model":"gpt-4o","stream":true,"max_tokens":500,"messages":[{"role":"user","content":"Classify."}]}"#;
    let mut request = Request::new(Full::new(Bytes::from_static(body.as_bytes())));
    request
        .headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    let response = llm.oneshot(request).await.unwrap();
    let received = response.into_body().collect().await.unwrap().to_bytes();

    assert!(
        seen.lock()
            .unwrap()
            .contains(r#""stream_options":{"include_usage":true}"#)
    );
    assert_eq!(
        received,
        concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Billing\"}}],\"usage\":null}\n\n",
            "data: [DONE]\n\n",
        )
    );
    // Settled with the usage the caller never saw.
    assert_eq!(levels(&budget), [100_000 - 42]);
}

#[tokio::test(start_paused = true)]
async fn headers_apply_to_the_limit_they_describe_whatever_the_window() {
    let nz = |n| std::num::NonZeroU64::new(n).unwrap();
    let headers = |pairs: &[(&'static str, &'static str)]| {
        let mut map = http::HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().unwrap());
        }
        map
    };
    // Groq: the requests headers count per day, the tokens headers per minute.
    let day = tower_llm_quota::Limit::per_day(Dimension::Requests, nz(14_400))
        .with_headroom(1.0)
        .unwrap()
        .with_burst(nz(14_400));
    let tpm = tower_llm_quota::Limit::per_minute(Dimension::TotalTokens, nz(6_000))
        .with_headroom(1.0)
        .unwrap()
        .with_burst(nz(6_000));
    let groq = tower_llm_quota::Budget::new(
        tower_llm_quota::Quota::new()
            .with_limit(day)
            .with_limit(tpm),
    );
    Profile::groq().adapt(
        &headers(&[
            ("x-ratelimit-limit-requests", "14400"),
            ("x-ratelimit-remaining-requests", "14000"),
            ("x-ratelimit-reset-requests", "2m40s"),
            ("x-ratelimit-limit-tokens", "6000"),
            ("x-ratelimit-remaining-tokens", "1000"),
            ("x-ratelimit-reset-tokens", "50s"),
        ]),
        &groq,
    );
    assert_eq!(levels(&groq), [14_000, 1_000]);

    // A minute compressed to 2 s, read with the OpenAI profile's 60 s windows: the amounts
    // name the limits, and a lowered limit is found by the window its numbers imply.
    let minute = 2 * SEC;
    let budget = budget([
        limit(Dimension::Requests, 500, minute, 500),
        limit(Dimension::TotalTokens, 30_000, minute, 30_000),
    ]);
    Profile::openai().adapt(
        &headers(&[
            ("x-ratelimit-limit-requests", "500"),
            ("x-ratelimit-remaining-requests", "450"),
            ("x-ratelimit-reset-requests", "200ms"),
            ("x-ratelimit-limit-tokens", "15000"),
            ("x-ratelimit-remaining-tokens", "12000"),
            ("x-ratelimit-reset-tokens", "400ms"),
        ]),
        &budget,
    );
    assert_eq!(levels(&budget), [450, 12_000]);
    let snapshot = budget.snapshot();
    assert_eq!(
        snapshot.limits()[1].limit().amount().get(),
        15_000,
        "adopted"
    );
}
