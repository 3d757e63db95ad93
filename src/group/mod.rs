//! Grouping: many items in one call, each answer checked, failures sent again on their own.
//!
//! A batch of classifications sent one item per call pays for the shared instructions once
//! per item. Sent ten per call, the instructions are paid once per ten: the batch articles
//! report 500 items at 1,284,000 tokens and 437 provider 429s one per call, against 389,000
//! tokens and no error grouped by ten. A [`Grouper`] does that over any governed service:
//!
//! 1. it **forms groups** of items of one class, in arrival order, up to
//!    [`max_items`](GroupConfig::max_items) (10 by default) and
//!    [`max_cost`](GroupConfig::max_cost) estimated tokens;
//! 2. it **renders** each group with a [`Template`] (the default asks for a JSON array of
//!    `{"id", "answer"}` and marks items `<item id="...">`) and **estimates** its [`Cost`]
//!    as the shared instructions once plus each item's text, and each item's expected
//!    output plus a little overhead as `max_tokens`;
//! 3. each group is **one governed call**: the cost, class and earliest deadline travel in
//!    the request's extensions, so the stack below reserves, queues and settles it as any
//!    call, with an `idempotency-key` that names the work: a hash of the request (endpoint,
//!    model, parameters, instructions, template, every item's rendered text and id), the
//!    items' own keys and how often each was regrouped. Two batches that differ in anything
//!    the model sees never share a stored answer; the same batch run again replays;
//! 4. it **splits the answer** by id (the first JSON array of objects in the text, after
//!    prose, inside a fence or before trailing text) and checks each element with a
//!    [`Validator`]: an item missing from the answer, named twice, or rejected, and every
//!    item of a malformed answer, is **sent again**, regrouped with the other items to send
//!    again, and alone once such a group failed it too ([`Resend`]); an item's final failure
//!    carries its reason. A bad answer is never fatal to the batch;
//! 5. it **attributes** each call's real usage to its items (the shared part split evenly,
//!    the rest by each item's text and answer), so per-item usage adds up to the provider's.
//!
//! [`Grouper::run`] takes a whole batch; [`Grouper::queue`] gives a [`GroupQueue`] to submit
//! items one by one (durable job handlers) and the [`GroupWorker`] that groups what is
//! submitted around the same time (waiting at most the [linger](GroupConfig::linger)).
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Full};
//! use serde_json::json;
//! use tower::service_fn;
//! use tower_llm_quota::group::{ApiFormat, GroupItem, Grouper, item_markers};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // A model that answers every item it is shown (the simulated provider of the
//! // `tower-llm-quota-sim` crate does the same, with faults on demand).
//! let model = service_fn(|request: http::Request<Full<Bytes>>| async move {
//!     let body = request.into_body().collect().await?.to_bytes();
//!     let body: serde_json::Value = serde_json::from_slice(&body)?;
//!     let prompt = body["messages"][1]["content"].as_str().unwrap_or_default();
//!     let answers: Vec<_> = item_markers(prompt)
//!         .map(|(id, _)| json!({"id": id, "answer": "billing"}))
//!         .collect();
//!     let answer = json!({
//!         "choices": [{"message": {"content": serde_json::to_string(&answers)?}}],
//!         "usage": {"prompt_tokens": 400, "completion_tokens": 60},
//!     });
//!     Ok::<_, tower_llm_quota::BoxError>(http::Response::new(Full::new(Bytes::from(answer.to_string()))))
//! });
//!
//! let items: Vec<GroupItem> = (0..25)
//!     .map(|n| GroupItem::new(format!("t{n}"), "I was charged twice this month."))
//!     .collect();
//! let report = Grouper::new(model, ApiFormat::OpenAiChat, "Label each support ticket.")
//!     .run(items)
//!     .await;
//! assert_eq!(report.stats.calls, 3); // 10 + 10 + 5
//! assert!(report.outcomes.iter().all(|o| o.result == Ok(json!("billing"))));
//! let tokens: u64 = report.outcomes.iter().map(|o| o.usage.total()).sum();
//! assert_eq!(tokens, 3 * 460); // per-item usage adds up to the provider's
//! # }
//! ```
//!
//! # Traps, and sizes to try
//!
//! Grouping pays when the shared part is large next to each item (long instructions,
//! examples, a schema) and items are independent. Larger groups save less and less (the
//! shared part is already split ten ways at ten) while the risks grow: answers get worse, a
//! malformed array fails the whole group, and one long answer may hit `max_tokens`. Ten is
//! a comfortable size; measure before going higher (the simulated provider's
//! `GroupFaults::per_extra_item`, in the `tower-llm-quota-sim` crate, shows why a group of 40 loses more
//! items than ten). Keep [`max_cost`](GroupConfig::max_cost) below the budget's token
//! capacity.
//!
//! # Who pays for a failure
//!
//! Only calls an item was alone in count toward its
//! [`max_attempts`](GroupConfig::max_attempts): a group's failure cannot say which item
//! caused it, so an item never fails for a neighbour, whatever the group size and the
//! attempt limit.
//!
//! - A **permanent** failure of a group (a 4xx, a cost that never fits) is **bisected**: its
//!   halves are sent at once, with new keys, until the item that fails stands alone and
//!   fails with its reason. One poisoned item in a group of ten costs six more calls
//!   (10, 5 + 5, 3 + 2, 2 + 1), and its nine neighbours are answered.
//! - A **transient** failure (a 429 or 5xx the stack's own retries gave up on, a reset) sends
//!   the same group again with the same key, at most `max_attempts` times in a row; then its
//!   items fail with the provider's reason.
//! - An answer no call of the grouper's produced (an [`IdempotencyLayer`] below replayed a
//!   record, or joined a call in flight: [`GroupStats::replayed_calls`]) charges nothing; its
//!   rejected items go again with new keys. A worker restarted over the same records rebuilds
//!   its earlier keys, and reads their answers again at no attempt (sixteen replays an item
//!   at most; past them, replays are charged like calls, so a layer below that replays
//!   whatever the key cannot loop an item).
//!
//! [`IdempotencyLayer`]: crate::IdempotencyLayer
//!
//! [`Cost`]: crate::Cost

mod attribute;
mod call;
mod config;
mod grouper;
mod item;
mod outcome;
mod plan;
mod request;
mod split;
mod template;
mod validate;
mod worker;

pub use config::{DEFAULT_MAX_ITEMS, GroupConfig, InvalidGroupConfig, MAX_ITEMS_LIMIT, Resend};
pub use grouper::Grouper;
pub use item::GroupItem;
pub use outcome::{GroupReport, GroupStats, ItemFailure, ItemOutcome, ItemUsage};
pub use request::ApiFormat;
pub use template::{InvalidTemplate, Prompt, Template, TextTemplate, item_markers};
pub use validate::{AnswerField, ValidateFn, Validator};
pub use worker::{GroupQueue, GroupWorker, QueueClosed};
