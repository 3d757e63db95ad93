//! The HTTP(S) clients under the accounts' stacks and the alert webhook: hyper's pooled
//! client over rustls (the Mozilla roots, or a CA file), or an in-process simulator.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;
use tower_llm_quota::BoxError;
use tower_llm_quota_sim::Simulator;

/// A provider's response body, boxed.
pub(crate) type UpBody = BoxBody<Bytes, BoxError>;

/// The client under a governed stack.
pub(crate) type Client = BoxCloneSyncService<Request<Full<Bytes>>, Response<UpBody>, BoxError>;

/// Set when a request leaves for the provider: until then it is only queued.
#[derive(Debug, Clone, Default)]
pub(crate) struct Dispatched(Arc<AtomicBool>);

impl Dispatched {
    pub(crate) fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// The TLS configuration of an `https://` upstream: the Mozilla roots compiled in, or the
/// CAs of `ca_file` instead; the `ring` provider, TLS 1.2 and 1.3.
pub(crate) fn tls_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, String> {
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?;
    let Some(path) = ca_file else {
        use hyper_rustls::ConfigBuilderExt;
        return Ok(builder.with_webpki_roots().with_no_client_auth());
    };
    let shown = path.display();
    let pem = std::fs::read(path).map_err(|e| format!("ca_file {shown}: {e}"))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| format!("ca_file {shown}: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("ca_file {shown}: {e}"))?;
    }
    if roots.is_empty() {
        return Err(format!("ca_file {shown}: no certificate in the file"));
    }
    Ok(builder.with_root_certificates(roots).with_no_client_auth())
}

/// A TLS handshake the upstream failed (a certificate of an unknown CA, another name): the
/// same every time, so no retry is spent on it (a connect error alone reads as transient).
#[derive(Debug)]
struct TlsRefused(String);

impl std::fmt::Display for TlsRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the TLS handshake with the upstream failed: {}", self.0)
    }
}

impl std::error::Error for TlsRefused {}

/// The client's error, a [`TlsRefused`] when a TLS error caused it.
pub(crate) fn client_error(error: hyper_util::client::legacy::Error) -> BoxError {
    // An `io::Error` hides what it wraps from `source`: descend through `get_ref`.
    let mut link: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(e) = link {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Box::new(TlsRefused(tls.to_string()));
        }
        link = match e.downcast_ref::<std::io::Error>() {
            Some(io) => io
                .get_ref()
                .map(|inner| inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    error.into()
}

/// A client for the alert webhook: HTTP or HTTPS (the Mozilla roots).
pub(crate) fn webhook_client() -> Client {
    let tls = tls_config(None).expect("the built-in roots load");
    client(None, tls)
}

/// The client an account's stacks call: marks the request dispatched, then sends it, over
/// `tls` for an `https://` upstream.
pub(crate) fn client(simulator: Option<&Simulator>, tls: rustls::ClientConfig) -> Client {
    let mark = |request: Request<Full<Bytes>>| {
        if let Some(dispatched) = request.extensions().get::<Dispatched>() {
            dispatched.0.store(true, Ordering::Release);
        }
        request
    };
    match simulator {
        Some(simulator) => BoxCloneSyncService::new(
            simulator
                .service()
                .map_request(mark)
                .map_response(|r| r.map(|b| b.map_err(BoxError::from).boxed()))
                .map_err(BoxError::from),
        ),
        None => {
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            connector.enforce_http(false);
            let connector = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls)
                .https_or_http()
                .enable_http1()
                .enable_http2()
                .wrap_connector(connector);
            let http =
                HyperClient::builder(TokioExecutor::new()).build::<_, Full<Bytes>>(connector);
            BoxCloneSyncService::new(
                http.map_request(mark)
                    .map_response(|r| r.map(|b| b.map_err(BoxError::from).boxed()))
                    .map_err(client_error),
            )
        }
    }
}
