//! The grouping API: a governed service, the shared instructions, and how groups are formed,
//! rendered and checked.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::future::{join, join_all};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, Uri};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tokio::sync::mpsc;
use tower::{Service, ServiceExt};

use super::call::{CallResult, FormedGroup};
use super::config::GroupConfig;
use super::item::GroupItem;
use super::outcome::{FailureKind, GroupReport, ItemFailure, ItemOutcome};
use super::plan::Planner;
use super::request::{ApiFormat, RequestShape, read_response};
use super::template::{Template, TextTemplate};
use super::validate::{AnswerField, Validator};
use super::worker::{CallFuture, GroupQueue, GroupWorker};
use crate::error::{BoxError, Error};
use crate::estimate::{CharEstimator, Estimator};
use crate::idempotency::Suppressed;

/// Sends many items in few calls: groups of items sharing one set of instructions, each group
/// one call through `S` (the governed stack), each answer split back into items and checked,
/// items with a bad answer sent again.
///
/// See the [module docs](super) for an example.
pub struct Grouper<S, V = AnswerField> {
    service: S,
    validator: Arc<V>,
    config: GroupConfig,
    template: Arc<dyn Template>,
    instructions: Arc<str>,
    estimator: Arc<dyn Estimator>,
    shape: RequestShape,
}

impl<S, V> fmt::Debug for Grouper<S, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grouper")
            .field("config", &self.config)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl<S> Grouper<S, AnswerField> {
    /// Groups sent through `service` in `format` to the format's
    /// [endpoint](ApiFormat::endpoint), with `instructions` shared by every group, the
    /// [default configuration](GroupConfig::default), the [default template](TextTemplate)
    /// and the [`AnswerField`] validator.
    pub fn new(service: S, format: ApiFormat, instructions: impl Into<Arc<str>>) -> Self {
        Self {
            service,
            validator: Arc::new(AnswerField),
            config: GroupConfig::default(),
            template: Arc::new(TextTemplate::default()),
            instructions: instructions.into(),
            estimator: Arc::new(CharEstimator::new()),
            shape: RequestShape {
                format,
                model: String::from("gpt-4o-mini"),
                uri: Uri::from_static(format.endpoint()),
                headers: HeaderMap::new(),
            },
        }
    }
}

impl<S, V> Grouper<S, V> {
    /// How groups are formed. Defaults to [`GroupConfig::default`].
    pub fn config(self, config: GroupConfig) -> Self {
        Self { config, ..self }
    }

    /// How a group is rendered. Defaults to [`TextTemplate::default`].
    pub fn template(self, template: impl Template) -> Self {
        Self {
            template: Arc::new(template),
            ..self
        }
    }

    /// How a group's cost is estimated (the shared part once, each item's text). Defaults to
    /// [`CharEstimator`].
    pub fn estimator(self, estimator: impl Estimator) -> Self {
        Self {
            estimator: Arc::new(estimator),
            ..self
        }
    }

    /// The request's `model`. Defaults to `gpt-4o-mini`.
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.shape.model = model.into();
        self
    }

    /// The request's URI. Defaults to the format's [endpoint](ApiFormat::endpoint).
    pub fn uri(mut self, uri: Uri) -> Self {
        self.shape.uri = uri;
        self
    }

    /// A header on every request (an API key, say).
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.shape.headers.append(name, value);
        self
    }

    /// How each item's answer is checked. Defaults to [`AnswerField`].
    pub fn validator<W: Validator>(self, validator: W) -> Grouper<S, W> {
        Grouper {
            service: self.service,
            validator: Arc::new(validator),
            config: self.config,
            template: self.template,
            instructions: self.instructions,
            estimator: self.estimator,
            shape: self.shape,
        }
    }
}

impl<S, V, B> Grouper<S, V>
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    V: Validator,
{
    /// A queue to submit items to one by one, and the worker that groups them: spawn the
    /// worker (or await it beside the submissions). A group that is not full is sent once its
    /// oldest item has waited the configuration's [linger](GroupConfig::linger).
    pub fn queue(self) -> (GroupQueue<V::Output>, GroupWorker<V::Output>) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let shape = Arc::new(self.shape);
        let planner = Planner::new(
            self.config,
            self.template,
            self.instructions,
            Arc::clone(&shape),
            &*self.estimator,
        );
        let service = self.service;
        let launch = move |group: FormedGroup| -> CallFuture {
            let request = shape.request(&group);
            let service = service.clone();
            let format = shape.format;
            Box::pin(async move {
                let result = match request {
                    Ok(request) => call(service, request, format).await,
                    Err(error) => CallResult::Failed {
                        transient: false,
                        reason: error.to_string(),
                        usage: None,
                    },
                };
                (group, result)
            })
        };
        let worker = GroupWorker {
            planner,
            receiver,
            validator: self.validator,
            estimator: self.estimator,
            launch: Box::new(launch),
            replies: Vec::new(),
        };
        (GroupQueue { sender }, worker)
    }

    /// Runs `items` to the end: every item gets an outcome, in the order given.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the groups in flight; the stack below refunds or charges
    /// each as it does any dropped call. Nothing is sent after the drop.
    pub async fn run(self, items: Vec<GroupItem>) -> GroupReport<V::Output> {
        let (queue, worker) = self.queue();
        let ids: Vec<String> = items.iter().map(|item| item.id().to_owned()).collect();
        let answers: Vec<_> = items.into_iter().map(|item| queue.submit(item)).collect();
        drop(queue);
        let (stats, outcomes) = join(worker.run(), join_all(answers)).await;
        let outcomes = outcomes
            .into_iter()
            .zip(ids)
            .map(|(outcome, id)| {
                outcome.unwrap_or_else(|_| ItemOutcome {
                    id,
                    result: Err(ItemFailure {
                        kind: FailureKind::Call,
                        reason: String::from("the grouping worker ended first"),
                    }),
                    attempts: 0,
                    resent: false,
                    resent_alone: false,
                    usage: Default::default(),
                })
            })
            .collect();
        GroupReport { outcomes, stats }
    }
}

/// One group's call: the response read whole, or the failure classified. A cost the budget
/// can never admit says the budget's capacity (groups are formed under it from then on);
/// other errors may pass.
async fn call<S, B>(service: S, request: Request<Full<Bytes>>, format: ApiFormat) -> CallResult
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let failed = |error: BoxError| {
        let local = error.downcast_ref::<Error>();
        if let Some(too_large) = local.and_then(Error::insufficient_capacity) {
            return CallResult::TooLarge {
                dimension: too_large.dimension(),
                capacity: too_large.capacity(),
                reason: error.to_string(),
            };
        }
        // A deadline refused is not sent again as it was: the group is bisected, so that
        // members with a later deadline (or none) may still go.
        let permanent = local.is_some_and(|e| {
            e.is_missing_cost() || e.is_request_body() || e.is_deadline_exceeded()
        });
        CallResult::Failed {
            transient: !permanent,
            reason: error.to_string(),
            usage: None,
        }
    };
    let response = match service.oneshot(request).await {
        Ok(response) => response,
        Err(error) => return failed(error.into()),
    };
    let (parts, body) = response.into_parts();
    // Answered without a call of its own: a stored record replayed, or a call in flight joined.
    let suppressed = parts.extensions.get::<Suppressed>().is_some();
    match body.collect().await {
        Ok(body) => match read_response(format, parts.status, &body.to_bytes()) {
            CallResult::Answered { text, usage, .. } => CallResult::Answered {
                text,
                usage,
                replayed: suppressed,
            },
            failed => failed,
        },
        Err(error) => failed(error.into()),
    }
}
