//! What an [`IdempotencyLayer`](super::IdempotencyLayer), its services and their futures
//! share: the store, the calls in flight in this process, the settings.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;

use super::flight::Flights;
use super::store::IdempotencyStore;
use crate::usage::WireFormat;

/// The state every clone of a layer shares.
#[derive(Debug, Clone)]
pub(crate) struct Inner {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) flights: Arc<Flights>,
    pub(crate) config: Arc<Config>,
}

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) recheck: Duration,
    pub(crate) max_wait: Duration,
    pub(crate) max_body: usize,
    pub(crate) max_request_body: usize,
    pub(crate) key_header: HeaderName,
    pub(crate) forward: Option<HeaderName>,
    pub(crate) derive: bool,
    pub(crate) format: WireFormat,
}
