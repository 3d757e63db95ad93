//! One attempt's answer: the future [`RestOfChain`](super::RestOfChain) returns, and why an
//! attempt could not be sent.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::error::BoxError;

/// A request's result as the rest of the chain gave it.
pub(super) type AttemptResult = Result<http::Response<reqwest::Body>, BoxError>;

/// The response future of [`RestOfChain`](super::RestOfChain): the answer of the rest of the chain.
pub struct AttemptFuture {
    state: AttemptState,
}

enum AttemptState {
    Waiting(oneshot::Receiver<AttemptResult>),
    Failed(Option<AttemptError>),
}

impl AttemptFuture {
    pub(super) fn waiting(answer: oneshot::Receiver<AttemptResult>) -> Self {
        Self {
            state: AttemptState::Waiting(answer),
        }
    }

    pub(super) fn failed(error: AttemptError) -> Self {
        Self {
            state: AttemptState::Failed(Some(error)),
        }
    }
}

impl Future for AttemptFuture {
    type Output = AttemptResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            AttemptState::Waiting(answer) => Pin::new(answer)
                .poll(cx)
                .map(|answer| answer.unwrap_or_else(|_| Err(AttemptError::Cancelled.into()))),
            AttemptState::Failed(error) => {
                Poll::Ready(Err(error.take().unwrap_or(AttemptError::Cancelled).into()))
            }
        }
    }
}

impl fmt::Debug for AttemptFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttemptFuture").finish_non_exhaustive()
    }
}

/// Why [`RestOfChain`](super::RestOfChain) could not send an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttemptError {
    /// A retry of a request whose body was a stream, already sent by an earlier attempt.
    BodyNotReplayable,
    /// The request did not come through a [`QuotaMiddleware`](super::QuotaMiddleware).
    OutsideMiddleware,
    /// The request was abandoned before the rest of the chain answered.
    Cancelled,
}

impl fmt::Display for AttemptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::BodyNotReplayable => "the request's streaming body was already sent",
            Self::OutsideMiddleware => "the request did not come through the quota middleware",
            Self::Cancelled => "the request was abandoned before the client answered",
        })
    }
}

impl std::error::Error for AttemptError {}
