use std::sync::Arc;

use tower::Layer;

use super::PriorityQueue;
use super::config::QueueConfig;
use super::inner::{Inner, QueueHandle};

/// Applies [`PriorityQueue`] to services; see the [module documentation](crate::queue).
///
/// Every service this layer builds, and their clones, share one queue.
#[derive(Debug, Clone)]
pub struct PriorityQueueLayer {
    queue: Arc<Inner>,
}

impl PriorityQueueLayer {
    /// A queue configured by `config`.
    pub fn new(config: QueueConfig) -> Self {
        Self {
            queue: Arc::new(Inner::new(config)),
        }
    }

    /// Names the queue: the `queue` label of its `llm_queue_depth` gauge, so that queues of
    /// one process do not overwrite each other's depth. Defaults to `default`.
    pub fn named(self, name: impl Into<Arc<str>>) -> Self {
        self.queue.lock().order.set_label(name.into());
        self
    }

    /// A handle for introspection: depth and oldest wait by class.
    pub fn handle(&self) -> QueueHandle {
        QueueHandle::new(self.queue.clone())
    }
}

impl Default for PriorityQueueLayer {
    fn default() -> Self {
        Self::new(QueueConfig::default())
    }
}

impl<S> Layer<S> for PriorityQueueLayer {
    type Service = PriorityQueue<S>;

    fn layer(&self, inner: S) -> Self::Service {
        PriorityQueue::new(inner, self.queue.clone())
    }
}
