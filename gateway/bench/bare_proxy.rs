//! A bare reverse proxy on the gateway's own hyper, hyper-util and tokio: each request
//! forwarded to the upstream as it came (its head, its body streamed), the answer streamed
//! back, and nothing else. The floor of the gateway's cost per request: the same two HTTP
//! exchanges, no logic (`gateway/bench/proxy_cpu.py` measures both side by side).
//!
//! ```sh
//! cargo run --release -p tower-llm-quota-gateway --example bare_proxy -- \
//!     --listen 127.0.0.1:0 --upstream http://127.0.0.1:9000
//! ```
//!
//! It prints `bare proxy listening on http://ADDR` once it accepts connections.

use std::convert::Infallible;
use std::net::SocketAddr;

use http::{Request, Response, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

type Body = BoxBody<Bytes, hyper::Error>;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (listen, upstream) = arguments()?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("bare proxy listening on http://{}", listener.local_addr()?);
    let client: Client<HttpConnector, Incoming> =
        Client::builder(TokioExecutor::new()).build_http();
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let (client, upstream) = (client.clone(), upstream.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                forward(client.clone(), upstream.clone(), request)
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// `request` sent to `upstream` (its scheme and authority, the request's path and query);
/// the answer as it comes, or a 502.
async fn forward(
    client: Client<HttpConnector, Incoming>,
    upstream: Uri,
    mut request: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let mut parts = upstream.into_parts();
    parts.path_and_query = path.parse().ok();
    match Uri::from_parts(parts) {
        Ok(uri) => *request.uri_mut() = uri,
        Err(_) => return Ok(bad_gateway()),
    }
    request.headers_mut().remove(http::header::HOST);
    Ok(match client.request(request).await {
        Ok(response) => response.map(BodyExt::boxed),
        Err(_) => bad_gateway(),
    })
}

fn bad_gateway() -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::from_static(b"bad gateway"))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = http::StatusCode::BAD_GATEWAY;
    response
}

/// `--listen ADDR` and `--upstream URL`.
fn arguments() -> Result<(SocketAddr, Uri), String> {
    let mut listen = None;
    let mut upstream = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--listen" => listen = Some(value.parse().map_err(|e| format!("--listen: {e}"))?),
            "--upstream" => {
                upstream = Some(value.parse().map_err(|e| format!("--upstream: {e}"))?);
            }
            _ => {
                return Err(format!(
                    "unknown flag {flag} (--listen ADDR --upstream URL)"
                ));
            }
        }
    }
    Ok((
        listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0))),
        upstream.ok_or("--upstream URL is required")?,
    ))
}
