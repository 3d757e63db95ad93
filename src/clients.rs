//! Using tower-llm-quota with your client: where the stack plugs into each HTTP client and
//! LLM client crate, in a few lines each.
//!
//! | your client | the seam | feature |
//! |---|---|---|
//! | hyper / hyper-util, or any `tower::Service<http::Request<B>>` | the stack is a tower [`Layer`](tower::Layer): wrap the client | `hyper` (error classification) |
//! | `reqwest_middleware::ClientWithMiddleware` | [`QuotaMiddleware`](crate::middleware::QuotaMiddleware) | `reqwest` |
//! | plain `reqwest::Client` | wrap it in a `reqwest_middleware` client (one line), then as above | `reqwest` |
//! | async-openai 0.43 | [`QuotaTransport`](crate::async_openai::QuotaTransport) in `Client::with_http_service` | `async-openai` |
//! | rig 0.44 (`rig-core`, `rig-reqwest` with `reqwest-middleware`) | `ReqwestMiddlewareClient` over a client holding `QuotaMiddleware` | `reqwest` |
//! | genai, graniet's `llm`, the Anthropic crates, any SDK in another language | their base URL, pointed at the gateway (`tower-llm-quota-gateway`) | — |
//!
//! Every snippet below builds in CI (they are doc tests); `cargo run --example
//! hyper_client`, `reqwest_client`, `async_openai` and `rig` run each against the simulated
//! provider.
//!
//! # Supported versions
//!
//! | crate | versions | how it is checked |
//! |---|---|---|
//! | `hyper` / `hyper-util` | 1.x / 0.1 | tests, example, minimal versions |
//! | `reqwest` / `reqwest-middleware` | 0.13 / 0.5 | tests, example, minimal versions |
//! | `async-openai` | 0.43 (its `middleware` feature; `with_http_service` takes this shape since then) | tests against the simulator, example, minimal versions |
//! | `rig-core` / `rig-reqwest` | 0.44 (0.45 and later need Rust 1.97, above this crate's MSRV) | test against the simulator, example |
//!
//! A new minor version of async-openai or rig (0.x) may change the seam: the crate moves to
//! it in a minor release of its own, named in the changelog.
//!
//! # hyper, or any tower service
//!
//! ```no_run
//! use std::num::NonZeroU64;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use tower::Layer;
//! use tower_llm_quota::{Dimension, Limit, Quota, QuotaStack};
//!
//! let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap());
//! let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let llm = QuotaStack::openai(Quota::new().with_limit(tpm)).layer(client);
//! // `llm` is a `Service<http::Request<Full<Bytes>>>`: call it as the client.
//! # let _ = llm;
//! ```
//!
//! # reqwest and reqwest-middleware
//!
//! ```no_run
//! use std::num::NonZeroU64;
//! use reqwest_middleware::ClientBuilder;
//! use tower_llm_quota::middleware::QuotaMiddleware;
//! use tower_llm_quota::{Dimension, Limit, Priority, Quota, QuotaStack};
//!
//! # async fn run() -> Result<(), reqwest_middleware::Error> {
//! let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap());
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with(QuotaMiddleware::new(QuotaStack::openai(Quota::new().with_limit(tpm))))
//!     .build();
//! let response = client
//!     .post("https://api.openai.com/v1/chat/completions")
//!     .body(r#"{"model":"gpt-4o-mini","max_tokens":50,"messages":[{"role":"user","content":"Hi"}]}"#)
//!     .with_extension(Priority::Batch)
//!     .send()
//!     .await?;
//! response.text().await?; // the end of the body settles the reservation
//! # Ok(()) }
//! ```
//!
//! # async-openai
//!
//! ```no_run
//! use std::num::NonZeroU64;
//! use async_openai::Client;
//! use async_openai::config::OpenAIConfig;
//! use tower_llm_quota::async_openai::QuotaTransport;
//! use tower_llm_quota::{Dimension, Limit, Priority, Quota, QuotaStack};
//!
//! let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap());
//! let transport = QuotaTransport::new(QuotaStack::openai(Quota::new().with_limit(tpm)));
//! let client = Client::with_config(OpenAIConfig::new()).with_http_service(transport.clone());
//! let nightly = Client::with_config(OpenAIConfig::new())
//!     .with_http_service(transport.with_priority(Priority::Batch));
//! # let _ = (client, nightly);
//! ```
//!
//! Do not add async-openai's `OpenAIRetryLayer` around the transport: the stack retries
//! (see [`async_openai`](crate::async_openai)).
//!
//! # rig
//!
//! ```no_run
//! use std::num::NonZeroU64;
//! use reqwest_middleware::{ClientBuilder, Extension};
//! use rig_core::completion::CompletionRequest;
//! use rig_core::providers::openai::OpenAIConfig;
//! use rig_reqwest::ReqwestMiddlewareClient;
//! use tower_llm_quota::middleware::QuotaMiddleware;
//! use tower_llm_quota::{Dimension, Limit, Priority, Quota, QuotaStack};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let tpm = Limit::per_minute(Dimension::TotalTokens, NonZeroU64::new(30_000).unwrap());
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with_init(Extension(Priority::Async))
//!     .with(QuotaMiddleware::new(QuotaStack::openai(Quota::new().with_limit(tpm))))
//!     .build();
//! let openai = OpenAIConfig::new("sk-...").connect(ReqwestMiddlewareClient::from(client));
//! let model = openai.chat("gpt-4o-mini");
//! let answer = model.call(CompletionRequest::new("Hi").max_tokens(50)).await?;
//! # let _ = answer;
//! # Ok(()) }
//! ```
//!
//! Streams (`model.stream(..)`) settle at their end. rig 0.44's models send each call once
//! and mark a failure `retryable` for the caller to decide: the stack has retried it already
//! (429s with the provider's `Retry-After`, 5xx, connection failures), so a loop retrying
//! rig's retryable errors multiplies the provider's calls; leave retries to the stack.
//!
//! # Clients with no seam: the gateway
//!
//! genai, graniet's `llm`, the Anthropic crates and the official SDKs of other languages
//! take an API key and a base URL. Point the base URL at the gateway
//! (`tower-llm-quota-gateway`, OpenAI- and Anthropic-compatible), give them a key the
//! gateway issued, and every process of every language shares one governed quota:
//!
//! ```no_run
//! # async fn run() -> Result<(), reqwest::Error> {
//! // What such a client sends, with the gateway as its base URL.
//! let base_url = "http://127.0.0.1:8080/v1"; // OPENAI_BASE_URL for most SDKs
//! let answer = reqwest::Client::new()
//!     .post(format!("{base_url}/chat/completions"))
//!     .bearer_auth("key-issued-by-the-gateway")
//!     .header("x-priority", "batch")
//!     .body(r#"{"model":"gpt-4o-mini","max_tokens":50,"messages":[{"role":"user","content":"Hi"}]}"#)
//!     .send()
//!     .await?;
//! # let _ = answer;
//! # Ok(()) }
//! ```
