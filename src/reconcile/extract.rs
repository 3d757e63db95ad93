//! The extension point through which usage is read from response bodies.

use http::HeaderMap;
use http::response::Parts;

use crate::budget::Budget;
use crate::cost::{Cost, Usage};

/// Makes a [`ScanUsage`] for each response: the seam for provider-specific usage extraction
/// (OpenAI and Anthropic JSON bodies and event streams).
///
/// It sees the response head first, with the budget the request was reserved from, so it can
/// also feed the provider's rate-limit headers back with
/// [`Budget::observe`](crate::Budget::observe).
///
/// # Example
///
/// A scanner for a toy format whose body ends with `usage=<input>,<output>`:
///
/// ```
/// use http::response::Parts;
/// use tower_llm_quota::{Budget, Cost, Usage, reconcile::{BodyEnd, ExtractUsage, ScanUsage}};
///
/// #[derive(Clone)]
/// struct Trailer;
///
/// #[derive(Default)]
/// struct TrailerScan(Vec<u8>);
///
/// impl ExtractUsage for Trailer {
///     type Scanner = TrailerScan;
///     fn start(&self, _head: &Parts, _budget: &Budget) -> TrailerScan {
///         TrailerScan::default()
///     }
/// }
///
/// impl ScanUsage for TrailerScan {
///     fn data(&mut self, chunk: &[u8]) {
///         self.0.extend_from_slice(chunk);
///     }
///     fn finish(self, end: BodyEnd, _reserved: Cost) -> Option<Usage> {
///         if end != BodyEnd::Complete {
///             return None;
///         }
///         let text = std::str::from_utf8(&self.0).ok()?;
///         let (input, output) = text.rsplit_once("usage=")?.1.split_once(',')?;
///         Some(Usage::new(input.trim().parse().ok()?, output.trim().parse().ok()?))
///     }
/// }
/// ```
pub trait ExtractUsage: Clone {
    /// The per-response scanner.
    type Scanner: ScanUsage;

    /// Starts scanning a response whose head is `head`, reserved from `budget`.
    fn start(&self, head: &Parts, budget: &Budget) -> Self::Scanner;
}

/// Reads one response body as it streams past, and reports its usage at the end.
pub trait ScanUsage: Send + 'static {
    /// A chunk of body data, in order, before the caller sees it.
    fn data(&mut self, chunk: &[u8]);

    /// The body's trailers, if any.
    fn trailers(&mut self, trailers: &HeaderMap) {
        let _ = trailers;
    }

    /// The body ended as `end` says; the usage found, if any. `reserved` is the request's
    /// estimate, from which a scanner may derive a charge when the body was cut before its
    /// usage arrived. `None` falls back to a `Usage` in the response's extensions, then to
    /// charging the estimate.
    fn finish(self, end: BodyEnd, reserved: Cost) -> Option<Usage>;
}

/// How a response body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyEnd {
    /// It reached its end.
    Complete,
    /// It failed with an error.
    Error,
    /// It was dropped before its end (the caller stopped reading, or cancelled).
    Dropped,
}

impl BodyEnd {
    /// How a body ended, if it did, given the frame it just yielded and whether it now says it
    /// has ended (some servers stop polling once it does).
    pub(crate) fn after<D, E>(
        frame: &Option<Result<http_body::Frame<D>, E>>,
        ended: bool,
    ) -> Option<Self> {
        match frame {
            Some(Ok(_)) => ended.then_some(BodyEnd::Complete),
            Some(Err(_)) => Some(BodyEnd::Error),
            None => Some(BodyEnd::Complete),
        }
    }
}

/// The default [`ExtractUsage`]: reads no body, and relies on a [`Usage`] the inner client put
/// in the response's extensions.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExtensionUsage;

/// The scanner of [`ExtensionUsage`]: finds nothing in bodies.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoScan;

impl ExtractUsage for ExtensionUsage {
    type Scanner = NoScan;

    fn start(&self, _head: &Parts, _budget: &Budget) -> NoScan {
        NoScan
    }
}

impl ScanUsage for NoScan {
    fn data(&mut self, _chunk: &[u8]) {}

    fn finish(self, _end: BodyEnd, _reserved: Cost) -> Option<Usage> {
        None
    }
}
