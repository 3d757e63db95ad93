//! Real transport errors (features `hyper` and `reqwest`) are classified: a refused connection
//! on loopback is transient, so it is retried.

use std::net::TcpListener;

use tower_llm_quota::retry::{Classify, Failure, FailureClass, ProviderErrors, Transient};

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    port
}

fn classify(error: &(dyn std::error::Error + 'static)) -> FailureClass {
    ProviderErrors.classify(&Failure::Error(error))
}

#[tokio::test]
async fn a_refused_reqwest_connection_is_transient() {
    let url = format!("http://127.0.0.1:{}/v1/chat/completions", closed_port());
    let error = reqwest::Client::new().get(url).send().await.unwrap_err();
    assert!(error.is_connect());
    assert_eq!(
        classify(&error),
        FailureClass::Transient(Transient::Connection)
    );
}

#[tokio::test]
async fn a_refused_hyper_connection_is_transient() {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let client: Client<_, http_body_util::Empty<bytes::Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let uri: http::Uri = format!("http://127.0.0.1:{}/", closed_port())
        .parse()
        .unwrap();
    let error = client.get(uri).await.unwrap_err();
    assert!(error.is_connect());
    assert_eq!(
        classify(&error),
        FailureClass::Transient(Transient::Connection)
    );
}
