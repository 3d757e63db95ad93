//! The grouping worker: it takes submitted items, forms groups, sends them through the
//! service, and answers each item's submitter.

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::Poll;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::call::{CallResult, FormedGroup};
use super::item::GroupItem;
use super::outcome::{GroupStats, ItemOutcome};
use super::plan::Planner;
use super::validate::Validator;
use crate::estimate::Estimator;

pub(crate) type CallFuture = Pin<Box<dyn Future<Output = (FormedGroup, CallResult)> + Send>>;
pub(crate) type Launch = Box<dyn Fn(FormedGroup) -> CallFuture + Send>;

type Submission<T> = (GroupItem, oneshot::Sender<ItemOutcome<T>>);

/// The grouping worker ended before answering: the item has no outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueClosed;

impl fmt::Display for QueueClosed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the grouping worker is gone")
    }
}

impl std::error::Error for QueueClosed {}

/// Submits items one by one to a [`GroupWorker`] (a durable job handler, say): the worker puts
/// them in groups with the items submitted around the same time. Cheap to clone; the worker
/// ends once every clone is dropped and every item is answered.
pub struct GroupQueue<T> {
    pub(crate) sender: mpsc::UnboundedSender<Submission<T>>,
}

impl<T> Clone for GroupQueue<T> {
    fn clone(&self) -> Self {
        Self {
            sender: self.sender.clone(),
        }
    }
}

impl<T> fmt::Debug for GroupQueue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupQueue").finish_non_exhaustive()
    }
}

impl<T: Send + 'static> GroupQueue<T> {
    /// Submits `item` and waits for its outcome (a result, or its failure after its
    /// attempts).
    ///
    /// # Errors
    ///
    /// [`QueueClosed`] when the worker was dropped or ended first.
    ///
    /// # Cancel safety
    ///
    /// The item is handed to the worker when this is called, not when it is first polled:
    /// dropping the future leaves the item in its group (it is still sent and its usage still
    /// counted), only its outcome is dropped.
    pub fn submit(
        &self,
        item: GroupItem,
    ) -> impl Future<Output = Result<ItemOutcome<T>, QueueClosed>> + Send + 'static {
        let (reply, answer) = oneshot::channel();
        let sent = self.sender.send((item, reply)).is_ok();
        async move {
            if !sent {
                return Err(QueueClosed);
            }
            answer.await.map_err(|_| QueueClosed)
        }
    }
}

/// The future that forms and sends groups for a [`GroupQueue`]: spawn it, or await it beside
/// the submissions. It ends with the run's figures once every queue handle is dropped and
/// every item submitted has its outcome.
pub struct GroupWorker<T> {
    pub(crate) planner: Planner<T>,
    pub(crate) receiver: mpsc::UnboundedReceiver<Submission<T>>,
    pub(crate) validator: Arc<dyn Validator<Output = T>>,
    pub(crate) estimator: Arc<dyn Estimator>,
    pub(crate) launch: Launch,
    pub(crate) replies: Vec<Option<oneshot::Sender<ItemOutcome<T>>>>,
}

impl<T> fmt::Debug for GroupWorker<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupWorker")
            .field("planner", &self.planner)
            .finish_non_exhaustive()
    }
}

enum Event<T> {
    Submitted(Option<Submission<T>>),
    Called(FormedGroup, CallResult),
    Lingered,
}

impl<T: Send + 'static> GroupWorker<T> {
    /// Runs until every handle is dropped and every item has its outcome; returns the run's
    /// figures.
    ///
    /// # Cancel safety
    ///
    /// Dropping it drops the groups in flight (the stack below refunds or charges them as for
    /// any dropped call) and answers every waiting submitter with [`QueueClosed`].
    pub async fn run(mut self) -> GroupStats {
        let mut calls = FuturesUnordered::new();
        let mut linger = pin!(tokio::time::sleep_until(Instant::now()));
        let mut open = true;
        loop {
            while open {
                match self.receiver.try_recv() {
                    Ok(submission) => self.accept(submission),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                }
            }
            let now = Instant::now();
            while calls.len() < self.planner.max_in_flight() {
                let Some(group) = self.planner.form(now, !open) else {
                    break;
                };
                calls.push((self.launch)(group));
            }
            self.deliver();
            if !open && calls.is_empty() && self.planner.pending() == 0 {
                return self.planner.stats;
            }
            // Lingering matters only while a group could be sent.
            let wake_at = self
                .planner
                .linger_until()
                .filter(|_| calls.len() < self.planner.max_in_flight());
            if let Some(at) = wake_at {
                linger.as_mut().reset(at);
            }
            let event = poll_fn(|cx| {
                if open {
                    if let Poll::Ready(submission) = self.receiver.poll_recv(cx) {
                        return Poll::Ready(Event::Submitted(submission));
                    }
                }
                if let Poll::Ready(Some((group, result))) = calls.poll_next_unpin(cx) {
                    return Poll::Ready(Event::Called(group, result));
                }
                if wake_at.is_some() && linger.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Event::Lingered);
                }
                Poll::Pending
            })
            .await;
            match event {
                Event::Submitted(Some(submission)) => self.accept(submission),
                Event::Submitted(None) => open = false,
                Event::Called(group, result) => {
                    let now = Instant::now();
                    self.planner.settle(group, result, &*self.validator, now)
                }
                Event::Lingered => {}
            }
        }
    }

    fn accept(&mut self, (item, reply): Submission<T>) {
        let slot = self.planner.push(item, &*self.estimator, Instant::now());
        if self.replies.len() <= slot {
            self.replies.resize_with(slot + 1, || None);
        }
        self.replies[slot] = Some(reply);
    }

    fn deliver(&mut self) {
        for (slot, outcome) in self.planner.take_finished() {
            if let Some(reply) = self.replies.get_mut(slot).and_then(Option::take) {
                // A submitter that stopped waiting drops its outcome.
                let _ = reply.send(outcome);
            }
        }
    }
}
