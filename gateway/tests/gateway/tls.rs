//! HTTPS upstreams: a loopback TLS server with a certificate made here, trusted through the
//! account's `ca_file`, and refused without it.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::api::{EVENTS, fixed_app, fixed_config};
use crate::support::{Running, json};
use tower_llm_quota_gateway::Config;
use tower_llm_quota_gateway::{Gateway, Persistence};

/// A CA, and a certificate for `localhost` it signed.
struct Certs {
    ca_pem: String,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

fn certs() -> Certs {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::from_params(&params, &ca_key);
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    Certs {
        ca_pem: ca.pem(),
        chain: vec![leaf.der().clone()],
        key: PrivatePkcs8KeyDer::from(key.serialize_der()).into(),
    }
}

/// The fixed upstream over TLS on loopback: its `https://localhost:port` URL.
async fn tls_upstream(certs: &Certs) -> String {
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs.chain.clone(), certs.key.clone_key())
    .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let (app, _) = fixed_app(Duration::ZERO);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "https://localhost:{}",
        listener.local_addr().unwrap().port()
    );
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                // A handshake the client gives up on is no failure of the server's.
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), TowerToHyperService::new(app))
                    .await;
            });
        }
    });
    url
}

/// A file of `text` in the system's temporary directory, removed on drop.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(name: &str, text: &str) -> Self {
        let path = std::env::temp_dir().join(format!("gateway-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        Self(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn with_ca(config: String, ca: &TempFile) -> String {
    let line = format!("ca_file = {:?}\n", ca.0.display().to_string());
    config.replacen(
        "        key = \"sk-upstream-secret\"\n",
        &format!("        key = \"sk-upstream-secret\"\n        {line}"),
        1,
    )
}

const BODY: &str = r#"{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Hi"}]}"#;

#[tokio::test]
async fn an_https_upstream_trusted_through_ca_file_passes_byte_for_byte() {
    let certs = certs();
    let upstream = tls_upstream(&certs).await;
    let ca = TempFile::new("ca.pem", &certs.ca_pem);
    let gateway = Running::start(&with_ca(fixed_config(&upstream), &ca)).await;
    let response = gateway
        .post("/v1/chat/completions", Some("caller-secret"), BODY)
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.bytes().await.unwrap(), EVENTS.concat().as_bytes());
    gateway.stop().await;
}

#[tokio::test]
async fn an_https_upstream_of_an_unknown_ca_is_refused_as_a_failed_provider() {
    let certs = certs();
    let upstream = tls_upstream(&certs).await;
    // The Mozilla roots do not know the test's CA.
    let gateway = Running::start(&fixed_config(&upstream)).await;
    let (status, _, body) = json(
        gateway
            .post("/v1/chat/completions", Some("caller-secret"), BODY)
            .await,
    )
    .await;
    assert_eq!(status, 502, "{body}");
    let error = &body["error"];
    assert_eq!(
        (
            &error["gateway_type"],
            &error["gateway_decision"],
            &error["limit"]
        ),
        (
            &"unavailable".into(),
            &"provider".into(),
            &"upstream".into()
        )
    );
    assert_eq!(error["scope"], "account:fixed");
    gateway.stop().await;
}

#[tokio::test]
async fn a_ca_file_unreadable_or_without_a_certificate_is_a_config_error() {
    let empty = TempFile::new("empty.pem", "not a certificate\n");
    let missing = TempFile::new("missing.pem", "");
    std::fs::remove_file(&missing.0).unwrap();
    for (ca, expected) in [(&empty, "no certificate"), (&missing, "ca_file")] {
        let config = Config::from_toml(&with_ca(fixed_config("https://localhost:1"), ca)).unwrap();
        let error = Gateway::new(&config, &Persistence::Memory)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("account `fixed`") && error.contains(expected),
            "{error}"
        );
    }
}
