//! Tenants: hierarchical quotas under one provider account, a weighted fair share with
//! borrowing and reclaim, pauses and caps over a day or a month.
//!
//! A [`Budget`](crate::Budget) built with [`Budget::with_tenants`](crate::Budget::with_tenants)
//! admits a request only when the account **and every node on its [`Tenant`] path** can pay
//! (all or nothing, under the budget's one lock), and serves waiting requests of a class by
//! weighted fair queuing over token cost, tenants owed their guarantee first.
//!
//! # Example
//!
//! ```
//! use std::num::{NonZeroU32, NonZeroU64};
//! use tower_llm_quota::tenant::{PeriodCap, CapWindow, Tenant, TenantNode, TenantTree};
//! use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let nz = |n| NonZeroU64::new(n).unwrap();
//! let tree = TenantTree::new()
//!     // Acme is guaranteed 75 % of the account and weighs 3; Globex 25 %, weight 1.
//!     .with_node("acme".parse()?, TenantNode::new()
//!         .with_weight(NonZeroU32::new(3).unwrap())
//!         .with_guarantee(0.75))
//!     .with_node("globex".parse()?, TenantNode::new()
//!         .with_guarantee(0.25)
//!         .with_max_share(0.5)
//!         .with_cap(PeriodCap::new(Dimension::TotalTokens, nz(2_000_000), CapWindow::CalendarDayUtc)))
//!     // Every API key (depth 3) at most 60 requests a minute.
//!     .with_template(3, TenantNode::new()
//!         .with_limit(Limit::per_minute(Dimension::Requests, nz(60))));
//! let quota = Quota::new().with_limit(Limit::per_minute(Dimension::TotalTokens, nz(100_000)));
//! let budget = Budget::with_tenants(quota, tree)?;
//!
//! let key: Tenant = "acme/search/key-7".parse()?;
//! let reservation = budget.reserve(Cost::new(1_000, 200)).tenant(key.clone()).await?;
//! drop(reservation); // unsent: refunded on every node of the path
//!
//! let tenants = budget.tenants().expect("a budget with tenants");
//! tenants.pause(&"acme/search".parse()?);
//! let refused = budget.reserve(Cost::new(10, 10)).tenant(key).await.unwrap_err();
//! assert_eq!(refused.tenant_refused().unwrap().scope().as_str(), "acme/search");
//! # Ok(()) }
//! ```
//!
//! Under a [`TokenBudgetLayer`](crate::TokenBudgetLayer) (or a
//! [`QuotaStack`](crate::stack::QuotaStack) given the budget with
//! [`with_budget`](crate::stack::QuotaStack::with_budget)), put the [`Tenant`] in each
//! request's extensions; a request without one belongs to the tree's default tenant.
//!
//! # The tree
//!
//! Every node ([`TenantNode`]) may have limits of its own (any dimension, any period, a cap on
//! calls in flight, [caps over a day or a month](PeriodCap)), a weight, a guaranteed share of its parent and
//! a cap on what it may use when borrowing. A path's nodes are its prefixes: `acme`,
//! `acme/search`, `acme/search/key-7`. A node need not be configured (it then passes its
//! requests up, and can still be paused); a template per depth configures every node of
//! that depth at once.
//!
//! # Admission: all or nothing on the path
//!
//! Under the budget's mutex, the head of the ordering checks its path top-down (a pause, a
//! spent day or a cost above a node's capacity refuses it at once, with a [`TenantRefused`]
//! naming the scope), then every node's buckets and slot, then the account's buckets; only
//! when all can pay are all debited. Settlement, refunds, debt and the slot reach every node
//! on the path. A request that only one of its nodes cannot pay yet (a key's own rate) does
//! not hold up the others: it steps out of the ordering, keeping its place, until that node
//! can pay (or one of its calls ends) and then comes back to its place — as a request asking
//! a shared store does. A provider's pause (a 429) holds the account, and so every path.
//!
//! # Fair share, borrowing and reclaim
//!
//! Classes come first (an interactive request of any tenant before batch). Inside a class,
//! the next request is chosen when the ordering decides, never fixed when a request starts
//! waiting: a tenant *owed* its guarantee goes first (its guarantee's share of what the
//! class served is more than it was served), then requests are served by weighted fair
//! queuing over **token cost** (self-clocked: see the bound below), so a tenant sending
//! prompts ten times larger gets ten times fewer requests, not ten times the tokens. A
//! tenant's requests of one class are admitted in the order they came. The flow of a request
//! is its path's deepest configured node (else its top-level tenant), its weight the product
//! of the weights on its path; its guarantor the nearest node of its path with a guarantee,
//! whose share is the product of the guarantees on the path to it.
//!
//! The account is never idle while someone waits: a tenant's unused share goes to the others
//! (borrowing), bounded by the borrower's [`max_share`](TenantNode::with_max_share). When
//! the owner's traffic returns, its first request goes first (a guarantor back from idleness
//! is owed one request), and its turn in the fair share starts at the virtual time, level with
//! the borrowers' next requests: it is admitted within one refill of its own cost (plus what
//! settles as debt from calls already in flight), and from then on gets at least its
//! guarantee of what the class serves. A guarantor earns only from what is actually served,
//! so a guarantee never starves a tenant without one, whatever the account's throughput; and
//! it banks nothing while idle. Borrowed traffic never causes a provider 429 for guaranteed
//! traffic: everyone is admitted from the same account buckets.
//!
//! **Fairness bound.** Over any interval in which tenants `i` and `j` both wait in one class,
//! the tokens admitted for them satisfy `|S_i / w_i - S_j / w_j| <= L_i / w_i + L_j / w_j`,
//! `L` being each one's largest cost: the drift from the weights is at most one request of
//! each, whatever the interval, so over ten minutes of a saturated account the shares stay
//! within a fraction of a point of the weights (measured in `tests/budget/tenants.rs`). A guarantee
//! holds whatever the weights: a guaranteed tenant gets at least
//! `share × S - (share × L + L_g)` of any `S` the class serves while it waits (`L` the
//! class's largest request, `L_g` its own); with several guaranteed tenants in the class, at
//! least `share × S - (L + Σ L_h)`, one request of each. Guarantees proportional to the
//! weights keep the drift within three times the weights' bound. Property tests check the
//! statements over generated backlogs (`sched/fair.rs`).
//!
//! # Waiting for a node, or refused by it
//!
//! A request that only its own nodes cannot pay yet waits for them, out of the ordering and
//! keeping its place, by default. A node with a [`max_wait`](TenantNode::with_max_wait)
//! refuses instead what it could not admit within that time from the request's arrival,
//! with a [`TenantRefused`] saying when it could ([`Refusal::RateLimited`]) or that its calls
//! in flight are taken ([`Refusal::InFlight`]). The check and the reservation are one step
//! under the budget's lock: of 600 requests sent at once to a tenant of 20 a minute with
//! `max_wait` zero, 20 are admitted and 580 refused at once, none queued.
//!
//! # Several accounts
//!
//! The provider account is the bottom of a tenant's path, not the top of a tree: budgets of
//! several accounts serve one tenant state with
//! [`Budget::with_tenants_of`](crate::Budget::with_tenants_of), and a node's limits, calls in
//! flight, caps and pause then hold over every account the tenant uses. A node scoped
//! with [`TenantNode::for_account`] holds on the budget of that name only, and the others pass
//! over it (a tenant capped on one provider and free on the other).
//!
//! # Caps over a day or a month
//!
//! [`CapWindow::CalendarDayUtc`] counts the calendar day in UTC (what invoices use; twice the
//! cap can be spent around midnight); [`CapWindow::CalendarMonthUtc`] the calendar month in
//! UTC (a monthly spend cap); [`CapWindow::Rolling`] the last 24 hours in quarter hours. The
//! request that would take the period over its cap is refused at once, naming the scope and
//! when the period starts again ([`Refusal::PeriodCap`]); the next period admits again. Days
//! are read from a [`WallClock`], advanced by tokio's clock, so tests with a paused clock
//! pass days and months in milliseconds.
//!
//! # Scale
//!
//! Admission looks up the nodes of its path by their text (a few hash lookups, no
//! allocation once they live), so its cost does not depend on the number of tenants. A node
//! holds memory only while it has traffic, a pause, a day's use or buckets not full again;
//! a node idle for a minute is forgotten by a sweep that looks at one node per admission. The fair share
//! holds state only for flows with requests waiting.
//!
//! # Configuration file
//!
//! With the `serde` feature, a [`TenantTree`] deserializes:
//!
//! ```json
//! { "default_tenant": "anonymous", "label_depth": 1,
//!   "nodes": { "acme": { "weight": 3, "guarantee": 0.75 },
//!              "acme/search": { "limits": [ { "dimension": "total_tokens",
//!                                "amount": 20000, "period_seconds": 60 } ],
//!                               "max_in_flight": 8, "max_wait_seconds": 0,
//!                               "account": "openai",
//!                               "caps": [ { "dimension": "total_tokens",
//!                                 "amount": 1000000, "window": "calendar_day_utc" },
//!                                         { "dimension": "spend",
//!                                 "amount_usd": "500.00", "window": "calendar_month_utc" } ] } },
//!   "templates": { "3": { "limits": [ { "dimension": "requests", "amount": 60,
//!                                       "period_seconds": 60 } ] } } }
//! ```
//!
//! A spend amount is written in dollars (`amount_usd`, a decimal string, exact to the
//! nano-dollar: [`Usd`](crate::pricing::Usd)) or in nano-dollars (`amount`).
//!
//! # Across processes
//!
//! A budget shared through Redis (`tower_llm_quota_redis::RedisBudget`) takes
//! the tree with [`Budget::with_tenant_tree`](crate::Budget::with_tenant_tree): the reserve
//! script then checks and takes the buckets of every node of the path beside the account's,
//! all or nothing in one call under the account's hash tag, so **every node's limits (and
//! borrowing caps) hold across processes**; settlement reaches them the same way. **A pause
//! holds on every process**: it is kept in the store, refused by the reserve script at each
//! process's next admission, and each process's own tree follows the store's pauses and
//! resumes within a second. Daily caps and caps on calls in flight are kept by each process. Each process serves its own waiters by the weighted fair share; between
//! processes the store gives each refused process its turn (see
//! `tower_llm_quota_redis::RedisBudget`), so between processes tenants share by
//! their processes' turns, not by weight.

mod config;
mod error;
pub(crate) mod path;
mod record;
#[cfg(feature = "serde")]
mod serde;
mod snapshot;

pub use crate::budget::TenantHandle;
pub use crate::quota::{CapWindow, PeriodCap, WallClock};
pub use config::{TenantNode, TenantTree};
pub use error::{InvalidTree, Refusal, TenantRefused};
pub use path::{InvalidTenant, Tenant};
pub use record::{CapRecord, CapScope};
pub use snapshot::TenantSnapshot;
