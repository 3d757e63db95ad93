//! One span per logical request: the layers record the queue wait, the budget wait, the call
//! time, the attempts, the usage and the decision into the span `RetryAfterLayer` opens.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::provider::{Profile, ProviderUsage};
use tower_llm_quota::retry::Jitter;
use tower_llm_quota::{
    Budget, Cost, Dimension, Limit, Priority, PriorityQueueLayer, Quota, ReconcileLayer,
    RetryAfterLayer, RetryPolicy, TokenBudgetLayer,
};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::{LookupSpan, Registry};

type Fields = HashMap<String, String>;

/// Keeps the fields of every `llm_request` span, as they are when it closes.
#[derive(Clone, Default)]
struct Spans {
    open: Arc<Mutex<HashMap<u64, Fields>>>,
    closed: Arc<Mutex<Vec<Fields>>>,
}

struct Collect<'a>(&'a mut Fields);

impl Visit for Collect<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        if attrs.metadata().name() == "llm_request" {
            let mut fields = Fields::new();
            attrs.record(&mut Collect(&mut fields));
            self.open.lock().unwrap().insert(id.into_u64(), fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some(fields) = self.open.lock().unwrap().get_mut(&id.into_u64()) {
            values.record(&mut Collect(fields));
        }
    }

    fn on_close(&self, id: Id, _: Context<'_, S>) {
        if let Some(fields) = self.open.lock().unwrap().remove(&id.into_u64()) {
            self.closed.lock().unwrap().push(fields);
        }
    }
}

struct NoJitter;

impl Jitter for NoJitter {
    fn fraction(&self) -> f64 {
        0.0
    }
}

#[tokio::test(start_paused = true)]
async fn one_span_carries_the_whole_story_of_a_request() {
    let spans = Spans::default();
    let _guard = tracing::subscriber::set_default(Registry::default().with(spans.clone()));

    let budget = Budget::new(
        Quota::new().with_limit(
            Limit::per_minute(
                Dimension::TotalTokens,
                std::num::NonZeroU64::new(6_000).unwrap(),
            )
            .with_headroom(1.0)
            .unwrap()
            .with_burst(std::num::NonZeroU64::new(1_000).unwrap()),
        ),
    );
    // Spent: the request waits 1 s (100 tokens a second) for its 100 + 50.
    budget
        .try_reserve(Cost::new(1_000, 0))
        .unwrap()
        .charge_estimate();
    let calls = Arc::new(Mutex::new(0));
    let counted = calls.clone();
    let client = service_fn(move |_request: Request<String>| {
        let call = {
            let mut calls = counted.lock().unwrap();
            *calls += 1;
            *calls
        };
        async move {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let mut response = if call == 1 {
                let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
                *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                response
            } else {
                let body = r#"{"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":20,"total_tokens":120}}"#;
                Response::new(Full::new(Bytes::from_static(body.as_bytes())))
            };
            response
                .headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            Ok::<_, Infallible>(response)
        }
    });
    let llm = ServiceBuilder::new()
        .layer(RetryAfterLayer::new(RetryPolicy::new()).jitter(NoJitter))
        .layer(PriorityQueueLayer::default())
        .layer(TokenBudgetLayer::new(budget))
        .layer(ReconcileLayer::with_extractor(ProviderUsage::new(
            Profile::openai(),
        )))
        .service(client);

    let mut request = Request::new(String::new());
    request.extensions_mut().insert(Cost::new(100, 50));
    request.extensions_mut().insert(Priority::Interactive);
    let response = llm.oneshot(request).await.unwrap();
    response.into_body().collect().await.unwrap();

    let closed = spans.closed.lock().unwrap().clone();
    assert_eq!(closed.len(), 1, "one span for the request and its retry");
    let span = &closed[0];
    let field = |name: &str| span.get(name).map(String::as_str);
    assert_eq!(field("priority"), Some("interactive"));
    assert_eq!(
        (field("input_tokens"), field("output_tokens")),
        (Some("100"), Some("50"))
    );
    assert_eq!(field("attempt"), Some("2"));
    assert_eq!(field("queue_wait_ms"), Some("0"));
    // The retry was admitted at once: the failed call's tokens were refunded.
    assert_eq!(field("budget_wait_ms"), Some("0"));
    assert_eq!(field("call_ms"), Some("250"));
    assert_eq!(
        (field("usage_input"), field("usage_output")),
        (Some("100"), Some("20"))
    );
    assert_eq!(field("decision"), Some("ok"));
}
