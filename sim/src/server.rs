//! The simulated provider over HTTP/1.1 on a local socket.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

use super::engine::Engine;
use super::service::respond;

/// A running HTTP server of a [`Simulator`](super::Simulator), from
/// [`Simulator::serve`](super::Simulator::serve).
///
/// It answers HTTP/1.1 on [`local_addr`](Self::local_addr) until dropped or
/// [shut down](Self::shutdown); both close every open connection at once. An injected
/// connection reset closes the connection without a response.
#[derive(Debug)]
pub struct SimServer {
    local_addr: SocketAddr,
    task: Option<JoinHandle<()>>,
}

impl SimServer {
    pub(crate) async fn bind(engine: Arc<Engine>, addr: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        let task = tokio::spawn(accept(engine, listener));
        Ok(Self {
            local_addr,
            task: Some(task),
        })
    }

    /// The address the server listens on (with the port chosen when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The base URL, `http://<local_addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.local_addr)
    }

    /// Stops accepting, closes every connection, and waits until that is done.
    ///
    /// # Cancel safety
    ///
    /// The server is stopped when the future is first polled; dropping it afterwards only
    /// stops waiting for the connections to close.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            // The only error is the cancellation just asked for.
            let _ = task.await;
        }
    }
}

impl Drop for SimServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Accepts connections until aborted; aborting drops the set, which aborts every connection.
async fn accept(engine: Arc<Engine>, listener: TcpListener) {
    let mut connections = JoinSet::new();
    loop {
        // Reap finished connections so the set stays small.
        while connections.try_join_next().is_some() {}
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::debug!(%error, "simulated provider: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let engine = Arc::clone(&engine);
        connections.spawn(async move {
            let service = service_fn(move |request| respond(Arc::clone(&engine), request));
            if let Err(error) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%error, "simulated provider: connection closed");
            }
        });
    }
}
