//! Step 3: through the crate's stack. The request goes to its model's routes (behind the
//! idempotency layer), carrying what the stack reads: its class, its tenant path, its body as
//! read, the usage report its answer settles, and the gateway's [`Trip`]. A hard cap that
//! refuses it has it sent again with its output lowered to what the cap has left.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, header};
use http_body_util::Full;
use tower::ServiceExt;
use tower_llm_quota::Error;
use tower_llm_quota::estimate::{Defaults, RequestEstimate};
use tower_llm_quota::idempotency::{IdempotentBody, Operation};
use tower_llm_quota::provider::Scope;
use tower_llm_quota::reconcile::UsageReport;
use tower_llm_quota::retry::MaxAttempts;
use tower_llm_quota::routing::ServedBy;

use super::incoming::Incoming;
use super::pushback::stack_error;
use crate::Gateway;
use crate::account::Account;
use crate::audit::{Audited, Tokens};
use crate::auth::Caller;
use crate::config::Retries;
use crate::fit::{self, Shaped};
use crate::gemini::Native;
use crate::refusal::Refusal;
use crate::routes::{Routed, Target, Trip};
use crate::tenancy;

/// How many times a request is lowered to fit the hard caps before it is refused: each
/// lowering fits what the refusing cap had left, which other requests may take first, and
/// another cap of its path may then refuse it.
const MAX_LOWERINGS: usize = 4;

/// The headers of a caller's request passed to the provider (its credentials never are: the
/// route writes the account's key).
const PASSED: [&str; 6] = [
    "anthropic-version",
    "anthropic-beta",
    "openai-organization",
    "openai-project",
    "accept",
    "idempotency-key",
];

/// A request on its way: who sent it, with which headers, and the primary account of its
/// model (whose hard caps bound it).
pub(super) struct Call<'a> {
    pub(super) gateway: &'a Arc<Gateway>,
    pub(super) caller: &'a Caller,
    pub(super) headers: &'a HeaderMap,
    pub(super) native: Option<&'a Native>,
    pub(super) primary: &'a Account,
}

/// The provider's answer (or an idempotency record's), with what the stack will settle it
/// with and the trip that says which scope answered.
pub(super) struct Answered {
    pub(super) response: http::Response<IdempotentBody>,
    pub(super) report: UsageReport,
    pub(super) trip: Trip,
}

impl Answered {
    /// The route that served it (a fallback's, a ramp's), when the router said.
    pub(super) fn route(&self) -> Option<&str> {
        (self.response.extensions().get::<ServedBy>()).map(ServedBy::route)
    }
}

impl Call<'_> {
    /// Sends `incoming` to `routed`, lowered and sent again while a hard cap refuses it and
    /// lowering helps; the answer, or the refusal the stack's error maps to.
    ///
    /// # Cancel safety
    ///
    /// Dropped while queued, the request leaves the queue; dropped while the provider
    /// answers, the reservation is settled with what was read (the crate's stack's rule).
    pub(super) async fn send(
        &self,
        routed: &Routed,
        mut incoming: Incoming,
        audit: &mut Audited,
    ) -> Result<(Answered, Incoming), Refusal> {
        let client_retries = self.caller.retries == Retries::Client;
        let hard = incoming.checked.read.is_some()
            && (self.primary).hard_capped(&self.caller.path, self.gateway.fitting.tree_hard());
        if hard {
            self.bound(&mut incoming);
        }
        let mut lowered = 0;
        loop {
            let cost = incoming.checked.cost;
            audit.entry.estimated = Some(Tokens {
                input: cost.input_tokens(),
                output: cost.output_tokens(),
                cached: None,
            });
            // Kept only where a hard cap may lower it (else the stack takes it, uncopied).
            let read = &mut incoming.checked.read;
            let sent = if hard { read.clone() } else { read.take() };
            let (request, trip, report) = self.request(&incoming, sent);
            let result = self.answer_of(routed, request, &trip).await?;
            if let (Err(error), Some(asked)) = (&result, &incoming.checked.read)
                && lowered < MAX_LOWERINGS
                && let Some(fit) = lower(self.gateway, (&incoming, asked), error)
            {
                let (body, read, how) = fit.map_err(|why| {
                    stack_error(self.primary, error)
                        .client_retries(client_retries)
                        .message(why)
                })?;
                lowered += 1;
                incoming.checked.cost = read.cost(&Defaults::new());
                (incoming.body, incoming.checked.read) = (body, Some(read));
                incoming.shaped = Some(how);
                continue;
            }
            audit.entry.output_bound = incoming.shaped.as_ref().map(Shaped::header);
            return match result {
                Ok(response) => Ok((
                    Answered {
                        response,
                        report,
                        trip,
                    },
                    incoming,
                )),
                Err(error) => {
                    audit.entry.attempts = error.retry_report().map(|r| r.attempts());
                    Err(stack_error(self.primary, &error).client_retries(client_retries))
                }
            };
        }
    }

    /// Under a hard cap, the request's output is bounded (written into its body when it set
    /// none).
    fn bound(&self, incoming: &mut Incoming) {
        let Some(asked) = incoming.checked.read.take() else {
            return;
        };
        let model = &incoming.checked.model;
        let fitting = &self.gateway.fitting;
        let (bounded, written) = fitting.bound(incoming.api, model, (&incoming.body, asked));
        incoming.checked.cost = bounded.cost(&Defaults::new());
        incoming.checked.read = Some(bounded);
        if let Some((body, how)) = written {
            incoming.body = body;
            incoming.shaped = Some(how);
        }
    }

    /// The request as the stack takes it, not yet pointed at an account (its route does
    /// that): the caller's body and the provider's headers, and what the stack reads.
    fn request(
        &self,
        incoming: &Incoming,
        read: Option<RequestEstimate>,
    ) -> (Request<Full<Bytes>>, Trip, UsageReport) {
        let api = incoming.api;
        let mut request = Request::post(api.path())
            .body(Full::new(incoming.body.clone()))
            .expect("a valid request");
        let headers = request.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        for name in PASSED {
            if let Some(value) = self.headers.get(name) {
                headers.insert(name, value.clone());
            }
        }
        let (trip, report) = (Trip::new(api), UsageReport::new());
        let extensions = request.extensions_mut();
        if let Some(native) = self.native {
            extensions.insert(native.clone());
        }
        extensions.insert(incoming.class);
        if self.caller.retries == Retries::Client {
            // One attempt: the caller's SDK retries, paced by the budget the answer paused.
            extensions.insert(MaxAttempts(std::num::NonZeroU32::MIN));
        }
        match read {
            // The body as read here: the estimation layer prices it without parsing it again.
            Some(read) => {
                extensions.insert(read);
            }
            // Its cost as checked: the estimation layer would reserve a reply it never has.
            None => {
                extensions.insert(incoming.checked.cost);
            }
        }
        extensions.insert(trip.clone());
        extensions.insert(trip.dispatched_mark());
        // The usage the stack settles the answer with, read when its body ends.
        extensions.insert(report.clone());
        extensions.insert(self.caller.path.clone());
        // Idempotency keys are the tenant's own: another tenant's same key is another
        // operation.
        extensions.insert(Operation::new(self.caller.tenant.clone(), api.as_str()));
        extensions.insert(Scope {
            provider: Some(self.primary.name.clone()),
            model: Some(incoming.checked.model.clone()),
            key: Some(self.caller.name.clone()),
        });
        (request, trip, report)
    }

    /// The answer of `routed` to `request`, or the refusal of a stop that came while it was
    /// still queued (one already sent is waited for).
    async fn answer_of(
        &self,
        routed: &Routed,
        request: Request<Full<Bytes>>,
        trip: &Trip,
    ) -> Result<Result<http::Response<IdempotentBody>, Error>, Refusal> {
        let mut call = send(routed.target.clone(), request);
        tokio::select! {
            biased;
            result = &mut call => Ok(result),
            () = self.gateway.shutdown.cancelled() => {
                if trip.dispatched() {
                    Ok(call.await)
                } else {
                    // Still queued: leave the queue (the future's drop gives its place back).
                    drop(call);
                    Err(Refusal::stopping())
                }
            }
        }
    }
}

/// The target's answer, as a boxed `Send` future (its type names the whole stack).
fn send(
    target: Target,
    request: Request<Full<Bytes>>,
) -> Pin<Box<dyn Future<Output = Result<http::Response<IdempotentBody>, Error>> + Send>> {
    Box::pin(target.oneshot(request))
}

/// For a request a hard cap refused (`error`), the request lowered to what the cap has left
/// (its new body, estimate, and what was done), or why it is not (too little left to be of
/// use); `None` when no hard cap refused it or lowering cannot help (its prompt alone does
/// not fit, it asked no more than what is left).
fn lower(
    gateway: &Gateway,
    (incoming, read): (&Incoming, &RequestEstimate),
    error: &Error,
) -> Option<Result<(Bytes, RequestEstimate, Shaped), String>> {
    let refused = error.tenant_refused()?;
    let left = refused.cap_left()?;
    let room = gateway.fitting.room(read, &incoming.checked.model, left)?;
    if room >= read.max_output_tokens()? {
        return None;
    }
    let min = gateway.fitting.min_tokens();
    if room < min {
        return Some(Err(format!(
            "{refused}: what it has left pays for {room} output tokens, below the useful \
             minimum of {min} ([output] min_tokens)"
        )));
    }
    let body = fit::write_bound(incoming.api, &incoming.body, room)?;
    let cap = tenancy::refused(refused);
    let how = Shaped::Lowered {
        to: room,
        limit: cap.limit.to_string(),
        scope: cap.scope.to_string(),
    };
    Some(Ok((body, read.clone().with_output_bound(room), how)))
}
