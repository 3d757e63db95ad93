//! Starting the gateway on a loopback port, and calling it.

use std::sync::Arc;

use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::server::config::Config;
use crate::server::{Gateway, serve};

/// The demo configuration, with a simulator that answers at once.
pub(crate) fn demo() -> String {
    include_str!("../../demo.toml").replace(
        "sim = { base_ms = 40, per_token_ms = 2 }",
        "sim = { base_ms = 0, per_token_ms = 0 }",
    )
}

pub(crate) const ADMIN: &str = "demo-admin-token";
pub(crate) const SEARCH: &str = "demo-key-acme-search";
pub(crate) const REPORTS: &str = "demo-key-acme-reports";
pub(crate) const GLOBEX: &str = "demo-key-globex";

/// A gateway serving on loopback until stopped.
pub(crate) struct Running {
    pub(crate) url: String,
    pub(crate) gateway: Arc<Gateway>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Running {
    /// Starts serving `config` on a free loopback port.
    pub(crate) async fn start(config: &str) -> Self {
        Self::serve(config, None).await
    }

    /// Starts serving `config`, its accounts' budgets shared through the Redis at `redis`.
    pub(crate) async fn start_shared(config: &str, redis: &str) -> Self {
        Self::serve(config, Some(redis)).await
    }

    async fn serve(config: &str, redis: Option<&str>) -> Self {
        let config = Config::from_toml(config).expect("a valid configuration");
        let gateway = Gateway::new(&config, redis)
            .await
            .expect("the gateway starts");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(gateway.clone(), listener, async {
            let _ = stopped.await;
        }));
        Self {
            url,
            gateway,
            stop: Some(stop),
            task,
        }
    }

    /// Signals the stop (as SIGTERM does) and returns at once.
    pub(crate) fn signal_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Stops and waits until every connection drained.
    pub(crate) async fn stop(mut self) {
        self.signal_stop();
        (&mut self.task).await.unwrap().unwrap();
    }

    /// `POST` of `body` to `path` with the caller key `key`.
    pub(crate) async fn post(
        &self,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> reqwest::Response {
        let mut request = reqwest::Client::new()
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        request.send().await.unwrap()
    }

    /// An admin call: `method` on `/admin{path}` with a JSON body.
    pub(crate) async fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Value,
    ) -> reqwest::Response {
        reqwest::Client::new()
            .request(method, format!("{}/admin{path}", self.url))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap()
    }

    /// `GET` of `path`, as text.
    pub(crate) async fn get(&self, path: &str) -> (u16, String) {
        let response = reqwest::get(format!("{}{path}", self.url)).await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    }
}

/// A chat completion body of `max_tokens`.
pub(crate) fn chat(max_tokens: u32) -> String {
    format!(
        r#"{{"model":"gpt-4o-mini","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"Hello there"}}]}}"#
    )
}

/// A Messages body of `max_tokens`.
pub(crate) fn messages(max_tokens: u32) -> String {
    format!(
        r#"{{"model":"claude-sonnet","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"Hello there"}}]}}"#
    )
}

/// A response's status and its body as JSON.
pub(crate) async fn json(response: reqwest::Response) -> (u16, Option<String>, Value) {
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.bytes().await.unwrap();
    (
        status,
        retry_after,
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    )
}
