//! Request bodies every attempt can send: bytes in memory, or a stream sent once.

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::attempt::AttemptError;
use crate::error::BoxError;

/// A request body that every attempt can send: bytes in memory, or a stream sent once; see
/// the [module documentation](super#bodies-and-retries).
///
/// Clones of a body in memory share its bytes; clones of a stream share the one stream, and
/// only the first attempt to send it gets it.
#[derive(Clone)]
pub struct ReplayBody {
    inner: Inner,
}

#[derive(Clone)]
enum Inner {
    /// No body at all (a GET, say): sent as none.
    Empty,
    Bytes(Bytes),
    Stream(Arc<Mutex<Option<reqwest::Body>>>),
}

impl ReplayBody {
    /// No body.
    pub fn empty() -> Self {
        Self {
            inner: Inner::Empty,
        }
    }

    /// A streaming body, sent by one attempt only.
    pub fn stream(body: reqwest::Body) -> Self {
        Self {
            inner: Inner::Stream(Arc::new(Mutex::new(Some(body)))),
        }
    }

    /// Whether every attempt can send this body.
    pub fn is_replayable(&self) -> bool {
        !matches!(self.inner, Inner::Stream(_))
    }

    /// The body for reqwest: `None` for no body.
    pub(super) fn into_reqwest(self) -> Result<Option<reqwest::Body>, AttemptError> {
        match self.inner {
            Inner::Empty => Ok(None),
            Inner::Bytes(bytes) => Ok(Some(reqwest::Body::from(bytes))),
            Inner::Stream(slot) => slot
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
                .map(Some)
                .ok_or(AttemptError::BodyNotReplayable),
        }
    }
}

impl From<Bytes> for ReplayBody {
    fn from(bytes: Bytes) -> Self {
        Self {
            inner: Inner::Bytes(bytes),
        }
    }
}

impl Default for ReplayBody {
    fn default() -> Self {
        Self::empty()
    }
}

impl Body for ReplayBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.inner {
            Inner::Empty => Poll::Ready(None),
            Inner::Bytes(bytes) if bytes.is_empty() => Poll::Ready(None),
            Inner::Bytes(bytes) => Poll::Ready(Some(Ok(Frame::data(std::mem::take(bytes))))),
            Inner::Stream(slot) => {
                let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
                match slot.as_mut() {
                    Some(body) => Pin::new(body)
                        .poll_frame(cx)
                        .map(|frame| frame.map(|frame| frame.map_err(Into::into))),
                    None => Poll::Ready(Some(Err(AttemptError::BodyNotReplayable.into()))),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Empty => true,
            Inner::Bytes(bytes) => bytes.is_empty(),
            Inner::Stream(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Empty => SizeHint::with_exact(0),
            Inner::Bytes(bytes) => SizeHint::with_exact(bytes.len() as u64),
            Inner::Stream(_) => SizeHint::default(),
        }
    }
}

impl fmt::Debug for ReplayBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("ReplayBody");
        match &self.inner {
            Inner::Empty => debug.field("len", &0),
            Inner::Bytes(bytes) => debug.field("len", &bytes.len()),
            Inner::Stream(_) => debug.field("stream", &true),
        };
        debug.finish()
    }
}
