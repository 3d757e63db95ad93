//! The `otel` feature: a span per request, with the GenAI conventions' attributes and the
//! quota decision, received over OTLP/HTTP by a receiver on loopback started here.

use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

use crate::support::{Running, SEARCH, chat, demo, serve_upstream};

/// A receiver of OTLP/HTTP traces: its URL and the spans it got.
async fn receiver() -> (String, Arc<Mutex<Vec<Span>>>) {
    let spans = Arc::new(Mutex::new(Vec::new()));
    let seen = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let seen = seen.clone();
            async move {
                let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                for resource in request.resource_spans {
                    for scope in resource.scope_spans {
                        seen.lock().unwrap().extend(scope.spans);
                    }
                }
                ""
            }
        }),
    );
    (serve_upstream(app).await, spans)
}

fn attribute(span: &Span, key: &str) -> Option<Any> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone()?.value)
}

fn text(span: &Span, key: &str) -> String {
    match attribute(span, key) {
        Some(Any::StringValue(text)) => text,
        other => panic!("{key}: {other:?}"),
    }
}

fn int(span: &Span, key: &str) -> i64 {
    match attribute(span, key) {
        Some(Any::IntValue(n)) => n,
        other => panic!("{key}: {other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_is_a_span_with_the_genai_attributes_and_the_decision() {
    let (url, spans) = receiver().await;
    let config = demo().replace(
        "admin_token = \"demo-admin-token\"",
        &format!("admin_token = \"demo-admin-token\"\notlp_endpoint = \"{url}/v1/traces\""),
    );
    let gateway = Running::start(&config).await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .bearer_auth(SEARCH)
        .header("traceparent", format!("00-{trace}-{parent}-01"))
        .body(chat(20))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    // A refusal of the gateway: a model the key may not use.
    let response = gateway
        .post(
            "/v1/chat/completions",
            Some(SEARCH),
            r#"{"model":"gpt-9","messages":[{"role":"user","content":"Hi"}]}"#,
        )
        .await;
    assert_eq!(response.status(), 404);
    response.bytes().await.unwrap();
    // A stop exports what waits.
    gateway.stop().await;
    let spans = spans.lock().unwrap().clone();
    assert_eq!(spans.len(), 2, "{spans:?}");
    let served = spans.iter().find(|s| s.name == "chat gpt-4o-mini").unwrap();
    assert_eq!(hex(&served.trace_id), trace, "the caller's trace");
    assert_eq!(hex(&served.parent_span_id), parent);
    assert_eq!(served.kind, 3, "CLIENT");
    assert_eq!(text(served, "gen_ai.operation.name"), "chat");
    assert_eq!(text(served, "gen_ai.provider.name"), "openai");
    assert_eq!(text(served, "gen_ai.request.model"), "gpt-4o-mini");
    assert!(int(served, "gen_ai.usage.input_tokens") > 0);
    assert!(int(served, "gen_ai.usage.output_tokens") > 0);
    assert_eq!(int(served, "llm_quota.estimated.output_tokens"), 20);
    assert_eq!(text(served, "llm_quota.decision"), "admitted");
    assert_eq!(text(served, "llm_quota.tenant"), "acme/search");
    assert_eq!(text(served, "llm_quota.key"), "acme-search-web");
    assert_eq!(text(served, "llm_quota.class"), "interactive");
    assert_eq!(text(served, "llm_quota.account"), "openai-sim");
    assert_eq!(int(served, "http.response.status_code"), 200);
    assert!(served.end_time_unix_nano > served.start_time_unix_nano);
    let refused = spans.iter().find(|s| s.name == "chat gpt-9").unwrap();
    assert_eq!(text(refused, "llm_quota.decision"), "local");
    assert_eq!(int(refused, "http.response.status_code"), 404);
    assert!(attribute(refused, "error.type").is_some());
    assert_eq!(refused.status.as_ref().map(|s| s.code), Some(2), "ERROR");
    assert_eq!(
        refused.parent_span_id,
        Vec::<u8>::new(),
        "no caller trace: a root"
    );
}
