//! Tenants against the simulated provider, in virtual time: weighted fair shares over token
//! cost, borrowing of an idle share and its reclaim, classes before fair shares, daily caps,
//! pause and resume, a node's own limit that does not hold up the others, idle state
//! forgotten. No provider 429 anywhere.

use tower_llm_quota_test_support as support;

use std::collections::HashMap;
use std::convert::Infallible;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use support::limit;
use tokio::time::{self, Instant};
use tower::util::BoxCloneService;
use tower::{Layer, ServiceBuilder, ServiceExt, service_fn};
use tower_llm_quota::error::TryReserveError;
use tower_llm_quota::stack::{QuotaBody, QuotaStack};
use tower_llm_quota::tenant::{CapWindow, PeriodCap, Tenant, TenantNode, TenantTree, WallClock};
use tower_llm_quota::{
    BoxError, Budget, Cost, Dimension, Error, Priority, Quota, Timings, TokenBudgetLayer,
};
use tower_llm_quota_sim::{SimBody, SimConfig, Simulator};

const MINUTE: Duration = Duration::from_secs(60);
/// The account: tokens per minute, all of it at once.
const TPM: u64 = 60_000;

fn tenant(path: &str) -> Tenant {
    path.parse().unwrap()
}

/// `n` requests a minute, the burst left to its default.
fn requests_per_minute(n: u64) -> tower_llm_quota::Limit {
    tower_llm_quota::Limit::per_minute(Dimension::Requests, NonZeroU64::new(n).unwrap())
}

fn weight(w: u32) -> NonZeroU32 {
    NonZeroU32::new(w).unwrap()
}

/// The provider: the account's minute at 10 % above what the budget plans, every completion
/// as long as its `max_tokens`, half a second per call.
fn simulator() -> Simulator {
    Simulator::new(
        SimConfig::openai(100_000, TPM * 11 / 10)
            .key("sk", "org")
            .latency(Duration::from_millis(500), Duration::ZERO)
            .completion_share(1.0, 1.0),
    )
}

fn quota() -> Quota {
    Quota::new().with_limit(limit(Dimension::TotalTokens, TPM, MINUTE, TPM))
}

type Llm = BoxCloneService<Request<Full<Bytes>>, u64, BoxError>;

/// The whole stack over `budget` and the simulator; a call answers the tokens it used.
fn governed(budget: &Budget, sim: &Simulator) -> Llm {
    let stack = QuotaStack::openai(quota()).with_budget(budget.clone());
    answering(stack, sim, |usage| {
        usage["total_tokens"].as_u64().expect("usage")
    })
}

/// `stack` over the simulator; a call answers what `figure` reads from the answer's usage.
fn answering(stack: QuotaStack, sim: &Simulator, figure: fn(&serde_json::Value) -> u64) -> Llm {
    let service =
        ServiceExt::<Request<Full<Bytes>>>::map_err(stack.layer(sim.service()), BoxError::from);
    let service = ServiceExt::<Request<Full<Bytes>>>::and_then(
        service,
        move |response: Response<QuotaBody<SimBody>>| async move {
            assert_eq!(response.status(), 200, "no provider refusal");
            let body = response.into_body().collect().await?.to_bytes();
            let json: serde_json::Value = serde_json::from_slice(&body)?;
            Ok(figure(&json["usage"]))
        },
    );
    BoxCloneService::new(service)
}

/// A chat request of `tenant` with a prompt of about `prompt` tokens.
fn chat(tenant: &str, class: Priority, prompt: usize, max_tokens: u64) -> Request<Full<Bytes>> {
    let text = "word ".repeat(prompt * 4 / 5);
    let body = format!(
        r#"{{"model":"m","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"{text}"}}]}}"#
    );
    Request::post("/v1/chat/completions")
        .header("authorization", "Bearer sk")
        .header("content-type", "application/json")
        .extension(class)
        .extension(self::tenant(tenant))
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

type Tally = Arc<Mutex<HashMap<String, u64>>>;

/// `workers` loops of `tenant`'s requests from `from` until `until`, each counting its tokens
/// (of calls sent from `count_from` and before `until`) in `tally`.
fn saturate(
    llm: &Llm,
    tally: &Tally,
    tenant: &'static str,
    prompt: usize,
    workers: usize,
    (from, count_from, until): (Instant, Instant, Instant),
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..workers)
        .map(|_| {
            let (llm, tally) = (llm.clone(), Arc::clone(tally));
            tokio::spawn(async move {
                time::sleep_until(from).await;
                while Instant::now() < until {
                    let counted = Instant::now() >= count_from;
                    let tokens = llm
                        .clone()
                        .oneshot(chat(tenant, Priority::Batch, prompt, 100))
                        .await
                        .expect("admitted");
                    let mut tally = tally.lock().unwrap();
                    *tally.entry(tenant.into()).or_default() += if counted { tokens } else { 0 };
                }
            })
        })
        .collect()
}

fn share(tally: &Tally, tenant: &str) -> f64 {
    let tally = tally.lock().unwrap();
    tally[tenant] as f64 / tally.values().sum::<u64>() as f64
}

async fn weighted_shares(prompt_a: usize, prompt_b: usize) -> (f64, f64) {
    let tree = TenantTree::new()
        .with_node(tenant("a"), TenantNode::new().with_weight(weight(3)))
        .with_node(tenant("b"), TenantNode::new().with_weight(weight(1)));
    let budget = Budget::with_tenants(quota(), tree).unwrap();
    let sim = simulator();
    let llm = governed(&budget, &sim);
    let tally = Tally::default();
    // Ten minutes once the account's first minute, granted at once, is spent.
    let start = Instant::now();
    let (from, end) = (start + MINUTE, start + 11 * MINUTE);
    let mut tasks = saturate(&llm, &tally, "a", prompt_a, 8, (start, from, end));
    tasks.extend(saturate(&llm, &tally, "b", prompt_b, 8, (start, from, end)));
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(sim.stats().rate_limited, 0);
    let (a, b) = (share(&tally, "a"), share(&tally, "b"));
    eprintln!("prompts {prompt_a} and {prompt_b}: token shares a {a:.4}, b {b:.4}, 0 × 429");
    (a, b)
}

/// Weights 3:1, both saturating for ten minutes (after the account's first minute, which is
/// granted at once to whoever asks): tokens 75/25 within 2 points.
#[tokio::test(start_paused = true)]
async fn token_shares_follow_the_weights() {
    let (a, b) = weighted_shares(200, 200).await;
    assert!((a - 0.75).abs() <= 0.02, "a {a:.4}, b {b:.4}");
}

/// The same when the lighter tenant sends prompts ten times larger: a share of tokens, not of
/// requests.
#[tokio::test(start_paused = true)]
async fn token_shares_follow_the_weights_with_prompts_ten_times_larger() {
    let (a, b) = weighted_shares(200, 2_000).await;
    assert!((b - 0.25).abs() <= 0.02, "a {a:.4}, b {b:.4}");
}

/// One tenant idle: the other uses at least 97 % of the account. When the idle one returns,
/// its first request is admitted within one refill of its own cost, and in its first minute
/// back it gets at least its guarantee.
#[tokio::test(start_paused = true)]
async fn an_idle_share_is_borrowed_and_taken_back() {
    let tree = TenantTree::new()
        .with_node(tenant("a"), TenantNode::new().with_guarantee(0.5))
        .with_node(tenant("b"), TenantNode::new().with_guarantee(0.5));
    let budget = Budget::with_tenants(quota(), tree).unwrap();
    let sim = simulator();
    let llm = governed(&budget, &sim);
    let tally = Tally::default();
    let start = Instant::now();
    let back = start + 5 * MINUTE;
    let end = back + MINUTE;
    let b_tasks = saturate(&llm, &tally, "b", 400, 8, (start, start, end));

    // Minutes 1 to 5 (after the first burst): b alone.
    time::sleep_until(start + MINUTE).await;
    let before = tally.lock().unwrap()["b"];
    time::sleep_until(back).await;
    let alone = tally.lock().unwrap()["b"] - before;
    assert!(
        alone as f64 >= 0.97 * 4.0 * TPM as f64,
        "b used {alone} of {}",
        4 * TPM
    );

    // a returns: its first request waits at most the refill of its cost (about 500 tokens at
    // 1,000 a second) plus the time the call in front of it takes to be admitted.
    let first = Instant::now();
    llm.clone()
        .oneshot(chat("a", Priority::Batch, 400, 100))
        .await
        .unwrap();
    let waited = first.elapsed() - Duration::from_millis(500);
    assert!(waited <= Duration::from_millis(600), "waited {waited:?}");
    let a_tasks = saturate(&llm, &tally, "a", 400, 8, (back, back, end));
    for task in a_tasks.into_iter().chain(b_tasks) {
        task.await.unwrap();
    }
    let a = tally.lock().unwrap()["a"];
    eprintln!(
        "b alone: {:.1} % of the account; a back: first admitted after {waited:?}, \
         {:.1} % of the account in its first minute (guarantee 50 %)",
        alone as f64 * 100.0 / (4 * TPM) as f64,
        a as f64 * 100.0 / TPM as f64
    );
    assert!(
        a as f64 >= 0.5 * TPM as f64 * 0.98,
        "a got {a} in its first minute back"
    );
    assert_eq!(sim.stats().rate_limited, 0);
}

/// A guarantee belongs to the node that sets it: two teams of a tenant guaranteed half the
/// account do not each claim that half (which would put all of the tenant's traffic before
/// the other tenant's, 2/3 against 1/3 over three flows); together they are held to it.
#[tokio::test(start_paused = true)]
async fn a_child_without_a_guarantee_does_not_claim_its_parent_s() {
    let tree = TenantTree::new()
        .with_node(tenant("a"), TenantNode::new().with_guarantee(0.5))
        .with_node(tenant("a/x"), TenantNode::new())
        .with_node(tenant("a/y"), TenantNode::new())
        .with_node(tenant("b"), TenantNode::new().with_guarantee(0.5));
    let budget = Budget::with_tenants(quota(), tree).unwrap();
    let handle = budget.tenants().unwrap();
    assert_eq!(handle.snapshot(&tenant("a/x")).guaranteed(), 0);
    assert_eq!(handle.snapshot(&tenant("a")).guaranteed(), TPM / 2);
    let sim = simulator();
    let llm = governed(&budget, &sim);
    let tally = Tally::default();
    let start = Instant::now();
    let (from, end) = (start + MINUTE, start + 6 * MINUTE);
    let mut tasks = saturate(&llm, &tally, "a/x", 200, 4, (start, from, end));
    tasks.extend(saturate(&llm, &tally, "a/y", 200, 4, (start, from, end)));
    tasks.extend(saturate(&llm, &tally, "b", 200, 8, (start, from, end)));
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(sim.stats().rate_limited, 0);
    let a = share(&tally, "a/x") + share(&tally, "a/y");
    eprintln!("teams of a: {a:.4} of the account's tokens (guarantee 0.5)");
    assert!((a - 0.5).abs() <= 0.03, "a {a:.4}");
}

/// Classes first: an interactive request of tenant a under tenant b's long-context batch
/// backlog waits no longer than the refill of its own cost plus one of b's items.
#[tokio::test(start_paused = true)]
async fn interactive_work_of_one_tenant_is_not_held_by_another_s_batch_backlog() {
    const RATE: u64 = 1_000; // tokens a second
    const ITEM: u64 = 4_000; // b's long-context item
    const ASK: u64 = 200;
    let tree = TenantTree::new()
        .with_node(tenant("a"), TenantNode::new())
        .with_node(tenant("b"), TenantNode::new().with_weight(weight(10)));
    let budget = Budget::with_tenants(
        Quota::new().with_limit(limit(
            Dimension::TotalTokens,
            RATE,
            Duration::from_secs(1),
            ITEM,
        )),
        tree,
    )
    .unwrap();
    let client =
        service_fn(|_request: Request<()>| async { Ok::<_, Infallible>(Response::new(())) });
    let llm = BoxCloneService::new(
        ServiceBuilder::new()
            .layer(TokenBudgetLayer::new(budget.clone()))
            .service(client),
    );
    let send = |tenant: &str, class, tokens| {
        let mut request = Request::new(());
        request.extensions_mut().insert(class);
        request.extensions_mut().insert(Cost::new(tokens, 0));
        request.extensions_mut().insert(self::tenant(tenant));
        let llm = llm.clone();
        async move {
            let response = llm.oneshot(request).await.expect("admitted");
            *response.extensions().get::<Timings>().unwrap()
        }
    };
    let backlog: Vec<_> = (0..100)
        .map(|_| tokio::spawn(send("b", Priority::Batch, ITEM)))
        .collect();
    let refill = |tokens: u64| Duration::from_millis(tokens * 1_000 / RATE);
    let mut worst = Duration::ZERO;
    for second in 0..30 {
        time::sleep(Duration::from_secs(2)).await;
        let timings = send("a", Priority::Interactive, ASK).await;
        worst = worst.max(timings.waited());
        assert!(
            timings.waited() <= refill(ASK) + refill(ITEM),
            "second {second}: waited {:?}",
            timings.waited()
        );
    }
    eprintln!(
        "interactive under a batch backlog: worst wait {worst:?}, bound {:?}",
        refill(ASK) + refill(ITEM)
    );
    backlog.into_iter().for_each(|task| task.abort());
}

/// A calendar-day cap: the first request over it is refused locally, naming the scope, and
/// nothing is sent; the next day admits again.
#[tokio::test(start_paused = true)]
async fn a_daily_cap_refuses_the_first_request_over_it_until_the_next_day() {
    // 23:50 UTC.
    let wall = UNIX_EPOCH + Duration::from_secs(20_000 * 86_400 - 600);
    let cap = PeriodCap::new(
        Dimension::TotalTokens,
        NonZeroU64::new(5_000).unwrap(),
        CapWindow::CalendarDayUtc,
    );
    let tree = TenantTree::new()
        .with_clock(WallClock::starting_at(wall))
        .with_node(tenant("acme"), TenantNode::new().with_cap(cap));
    let budget = Budget::with_tenants(quota(), tree).unwrap();
    let sim = simulator();
    let llm = governed(&budget, &sim);
    let mut used = 0;
    let refused = loop {
        match llm
            .clone()
            .oneshot(chat("acme/search/key-1", Priority::Async, 400, 100))
            .await
        {
            Ok(tokens) => used += tokens,
            Err(error) => break error,
        }
    };
    let refused = refused.downcast::<Error>().expect("a local refusal");
    let refusal = refused.tenant_refused().expect("a scope refused it");
    assert_eq!(refusal.scope().as_str(), "acme");
    assert!(refusal.is_capped() && refused.is_local(), "{refused}");
    let handle = budget.tenants().unwrap();
    let today = handle.snapshot(&tenant("acme")).used_in_period()[0].1;
    assert_eq!(today, used, "settled with the actual usage");
    assert!(used <= 5_000);
    let sent = sim.stats().received;
    // Other tenants are not capped.
    llm.clone()
        .oneshot(chat("globex", Priority::Async, 400, 100))
        .await
        .unwrap();
    assert_eq!(
        sim.stats().received,
        sent + 1,
        "the refused request was not sent"
    );
    // Midnight: a new day.
    time::sleep(Duration::from_secs(600)).await;
    llm.clone()
        .oneshot(chat("acme/search/key-1", Priority::Async, 400, 100))
        .await
        .unwrap();
    assert_eq!(sim.stats().rate_limited, 0);
    let _ = SystemTime::now();
}

/// Pause: the tenant's queued and new requests are refused at once (within 1 ms), naming
/// it, while the others go on; resumed, it is admitted again.
#[tokio::test(start_paused = true)]
async fn a_pause_refuses_queued_and_new_requests_at_once() {
    let tree = TenantTree::new();
    let budget = Budget::with_tenants(
        Quota::new().with_limit(limit(
            Dimension::TotalTokens,
            1_000,
            Duration::from_secs(1),
            1_000,
        )),
        tree,
    )
    .unwrap();
    let handle = budget.tenants().unwrap();
    // Spend the bucket: everything after waits.
    budget
        .reserve(Cost::new(1_000, 0))
        .await
        .unwrap()
        .mark_sent();
    let reserve = |path: &str| {
        let reserve = budget.reserve(Cost::new(100, 0)).tenant(tenant(path));
        tokio::spawn(async move { reserve.await.map(|mut r| r.mark_sent()) })
    };
    let queued: Vec<_> = (0..5).map(|i| reserve(&format!("acme/key-{i}"))).collect();
    let others: Vec<_> = (0..5).map(|_| reserve("globex")).collect();
    time::sleep(Duration::from_millis(10)).await;
    assert_eq!(budget.waiters(), 10);
    assert_eq!(handle.snapshot(&tenant("acme")).queued(Priority::Async), 5);
    let paused = Instant::now();
    handle.pause(&tenant("acme"));
    for task in queued {
        let error = task.await.unwrap().unwrap_err();
        let refused = error.tenant_refused().expect("refused by a scope");
        assert!(refused.is_paused());
        assert_eq!(refused.scope().as_str(), "acme");
    }
    assert!(paused.elapsed() <= Duration::from_millis(1));
    assert_eq!(budget.waiters(), 5, "the others still wait");
    let new = budget
        .reserve(Cost::new(1, 0))
        .tenant(tenant("acme/key-9"))
        .await;
    assert!(new.unwrap_err().tenant_refused().unwrap().is_paused());
    // The probe says so too, while others wait (not "not yet").
    match budget.try_reserve_for(Cost::new(1, 0), &tenant("acme/key-9")) {
        Err(TryReserveError::Tenant(refused)) => assert!(refused.is_paused()),
        other => panic!("a paused scope's probe: {other:?}"),
    }
    assert!(handle.snapshot(&tenant("acme")).is_paused());
    for task in others {
        task.await.unwrap().expect("unaffected");
    }
    handle.resume(&tenant("acme"));
    budget
        .reserve(Cost::new(100, 0))
        .tenant(tenant("acme/key-0"))
        .await
        .expect("resumed")
        .refund();
}

/// All or nothing on the path, and a node's own limit does not hold up the others: a key
/// limited to 100 tokens a second waits for its own refill while the account serves another
/// tenant; the team's limit binds across its keys; settlement reaches every node.
#[tokio::test(start_paused = true)]
async fn a_path_pays_on_every_node_and_a_node_s_limit_binds_only_below_it() {
    let per_second = |amount| {
        limit(
            Dimension::TotalTokens,
            amount,
            Duration::from_secs(1),
            amount,
        )
    };
    let tree = TenantTree::new()
        .with_node(
            tenant("acme"),
            TenantNode::new().with_limit(per_second(300)),
        )
        .with_node(
            tenant("acme/key-1"),
            TenantNode::new().with_limit(per_second(100)),
        );
    let budget = Budget::with_tenants(Quota::new().with_limit(per_second(10_000)), tree).unwrap();
    let handle = budget.tenants().unwrap();
    let start = Instant::now();
    let first = budget
        .reserve(Cost::new(100, 0))
        .tenant(tenant("acme/key-1"))
        .await
        .unwrap();
    // key-1 is spent for a second; its next request steps aside.
    let second = {
        let reserve = budget
            .reserve(Cost::new(100, 0))
            .tenant(tenant("acme/key-1"));
        tokio::spawn(reserve)
    };
    time::sleep(Duration::from_millis(1)).await;
    // It waits out of the ordering, and still counts as queued for its scopes.
    assert_eq!(budget.waiters(), 0);
    assert_eq!(handle.snapshot(&tenant("acme")).queued(Priority::Async), 1);
    assert_eq!(
        handle.snapshot(&tenant("globex")).queued(Priority::Async),
        0
    );
    // Another tenant, and another key of the team, go at once.
    let other = budget
        .reserve(Cost::new(5_000, 0))
        .tenant(tenant("globex"))
        .await;
    assert_eq!(start.elapsed(), Duration::from_millis(1));
    let key2 = budget
        .reserve(Cost::new(200, 0))
        .tenant(tenant("acme/key-2"))
        .await
        .unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(1));
    // Asked without waiting, a node that cannot pay says when it can.
    match budget.try_reserve_for(Cost::new(100, 0), &tenant("acme/key-3")) {
        Err(TryReserveError::NotYet(not_until)) => {
            // The team holds 0.3 of the 100 (refilled over 1 ms at 300 a second).
            let wait = Duration::from_nanos(332_333_334);
            assert_eq!(not_until.wait_time_from(Instant::now()), wait);
        }
        other => panic!("{other:?}"),
    }
    budget
        .try_reserve_for(Cost::new(100, 0), &tenant("initech"))
        .expect("another tenant pays now")
        .refund();
    // The team (300 a second) is spent now: key-2's next waits for the team's refill.
    let levels = |path: &str| handle.snapshot(&tenant(path)).limits()[0].level();
    assert_eq!((levels("acme"), levels("acme/key-1")), (0, 0));
    // key-1's second request is admitted once key-1 and the team hold 100 again.
    let second = second.await.unwrap().unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert_eq!(second.tenant().unwrap().as_str(), "acme/key-1");
    // A refund reaches every node of the path.
    drop(key2);
    drop(first);
    drop(other);
    // Unsent, refunded whole: the team and key-1 are full again (key-1's second request
    // holds what refilled meanwhile).
    assert_eq!(levels("acme"), 300);
    assert_eq!(levels("acme/key-1"), 100);
    assert_eq!(handle.snapshot(&tenant("acme")).in_flight(), 1);
}

/// 10,000 tenants with limits of their own: memory only while they have state.
#[tokio::test(start_paused = true)]
async fn idle_tenants_are_forgotten() {
    let tree = TenantTree::new().with_template(
        1,
        TenantNode::new().with_limit(limit(Dimension::Requests, 10, Duration::from_secs(1), 10)),
    );
    let budget = Budget::with_tenants(
        Quota::new().with_limit(limit(
            Dimension::Requests,
            1_000_000,
            Duration::from_secs(1),
            1_000_000,
        )),
        tree,
    )
    .unwrap();
    let handle = budget.tenants().unwrap();
    for i in 0..10_000 {
        let mut r = budget
            .reserve(Cost::requests_only(1))
            .tenant(tenant(&format!("t{i}")))
            .await
            .unwrap();
        r.mark_sent();
        drop(r);
    }
    assert_eq!(handle.live_nodes(), 10_000);
    // Two minutes later every bucket is full and the meters empty: nothing is kept.
    time::sleep(2 * MINUTE).await;
    assert_eq!(handle.live_nodes(), 0);
    // A paused tenant is kept while idle.
    handle.pause(&tenant("t7"));
    assert_eq!(handle.live_nodes(), 1);
}

/// A tree from a configuration file, changed live through the handle: a lowered limit and
/// a new weight apply at once, for waiting requests as for new ones; the snapshot shows them.
#[tokio::test(start_paused = true)]
async fn a_tree_from_a_file_changes_live() {
    let tree: TenantTree = serde_json::from_str(
        r#"{ "nodes": { "acme": { "weight": 2, "limits": [ { "dimension": "total_tokens",
               "amount": 1000, "period_seconds": 1, "burst": 1000 } ] } } }"#,
    )
    .unwrap();
    let budget = Budget::with_tenants(
        Quota::new().with_limit(limit(
            Dimension::TotalTokens,
            100_000,
            Duration::from_secs(1),
            100_000,
        )),
        tree,
    )
    .unwrap();
    let handle = budget.tenants().unwrap();
    let acme = tenant("acme");
    assert_eq!(handle.snapshot(&acme).weight(), 2);
    let start = Instant::now();
    budget
        .reserve(Cost::new(1_000, 0))
        .tenant(acme.clone())
        .await
        .unwrap()
        .charge_estimate();
    // Spent: the next one steps aside until acme refills 500 (half a second at 1,000 a
    // second)...
    let waiting = tokio::spawn(budget.reserve(Cost::new(500, 0)).tenant(tenant("acme/k")));
    time::sleep(Duration::from_millis(100)).await;
    // ... but the limit is lowered to 500 a second at 100 ms, keeping its level (100): the
    // 400 it lacks take 800 ms more.
    handle
        .set_limit(
            &acme,
            limit(Dimension::TotalTokens, 500, Duration::from_secs(1), 500),
        )
        .unwrap();
    handle.set_weight(&acme, weight(5)).unwrap();
    let reservation = waiting.await.unwrap().unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(900));
    let snapshot = handle.snapshot(&acme);
    assert_eq!(snapshot.limits()[0].capacity(), 500);
    assert_eq!(snapshot.limits()[0].level(), 0);
    assert_eq!(snapshot.weight(), 5);
    assert_eq!(snapshot.in_flight(), 1);
    assert_eq!(snapshot.used(), 1_500);
    drop(reservation);
}

/// Shares out of range are refused, not clamped: at install, and when a node is changed live
/// (nothing changes then); a node keeps the `Limit` it was given.
#[tokio::test(start_paused = true)]
async fn out_of_range_shares_are_refused_and_limits_kept_as_given() {
    let quota = || {
        Quota::new().with_limit(limit(
            Dimension::TotalTokens,
            1_000,
            Duration::from_secs(1),
            1_000,
        ))
    };
    let install = |node: TenantNode| {
        Budget::with_tenants(quota(), TenantTree::new().with_node(tenant("acme"), node))
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert_eq!(
        install(TenantNode::new().with_guarantee(1.5)),
        Err("invalid tenant tree at `acme`: a guarantee outside [0, 1]".into())
    );
    assert!(install(TenantNode::new().with_guarantee(f64::NAN)).is_err());
    assert!(install(TenantNode::new().with_guarantee(-0.1)).is_err());
    assert_eq!(
        install(TenantNode::new().with_max_share(0.0)),
        Err("invalid tenant tree at `acme`: a borrowing cap outside (0, 1]".into())
    );
    assert!(install(TenantNode::new().with_max_share(1.01)).is_err());
    assert!(install(TenantNode::new().with_guarantee(1.0).with_max_share(1.0)).is_ok());

    let budget = Budget::with_tenants(quota(), TenantTree::new()).unwrap();
    let handle = budget.tenants().unwrap();
    let refused = handle.set_node(&tenant("acme"), TenantNode::new().with_guarantee(2.0));
    assert_eq!(refused.unwrap_err().reason(), "a guarantee outside [0, 1]");
    assert_eq!(handle.node(&tenant("acme")), None, "nothing changed");
    // Siblings' guarantees are checked as a whole.
    handle
        .set_node(&tenant("acme"), TenantNode::new().with_guarantee(0.6))
        .unwrap();
    assert!(
        handle
            .set_node(&tenant("globex"), TenantNode::new().with_guarantee(0.6))
            .is_err()
    );

    let given = tower_llm_quota::Limit::per_minute(
        Dimension::Requests,
        std::num::NonZeroU64::new(20).unwrap(),
    );
    let node = TenantNode::new().with_limit(given);
    assert_eq!(node.limits(), [given]);
    handle.set_node(&tenant("acme/k"), node).unwrap();
    assert_eq!(handle.node(&tenant("acme/k")).unwrap().limits(), [given]);
}

/// "20 a minute" for a tenant admits 20 requests sent together (a node's burst is its whole
/// amount unless one is set), the 21st when the first's share of the minute has refilled;
/// the account keeps its own burst. Before, the node held a sixth of its minute: 4 at once.
#[tokio::test(start_paused = true)]
async fn a_tenant_limit_of_n_a_minute_admits_n_at_once() {
    let tree = TenantTree::new()
        .with_node(
            tenant("acme"),
            TenantNode::new().with_limit(requests_per_minute(20)),
        )
        .with_node(
            tenant("globex"),
            TenantNode::new()
                .with_limit(requests_per_minute(20).with_burst(NonZeroU64::new(5).unwrap())),
        );
    let account = Quota::new().with_limit(requests_per_minute(600));
    let budget = Budget::with_tenants(account, tree).unwrap();
    let try_one = |who: &str| budget.try_reserve_for(Cost::requests_only(1), &tenant(who));
    let mut held = Vec::new();
    for _ in 0..20 {
        held.push(try_one("acme").expect("within the tenant's minute"));
    }
    assert!(matches!(try_one("acme"), Err(TryReserveError::NotYet(_))));
    // A burst set on the node is kept.
    for _ in 0..5 {
        held.push(try_one("globex").unwrap());
    }
    assert!(try_one("globex").is_err());
    // The account's own limit keeps its default burst: a sixth of 600.
    assert_eq!(budget.snapshot().limits()[0].capacity(), 100);
    tokio::time::advance(Duration::from_secs(3)).await;
    held.push(try_one("acme").expect("one request refilled in 3 s"));
}

/// A node with `max_wait` zero checks and takes in one step: of 600 requests sent at once to
/// a tenant of 20 a minute, 20 are admitted and 580 refused at once with the time the node
/// could pay, none queued (before: all 600 passed the check, and what the node could not pay
/// queued for minutes).
#[tokio::test(start_paused = true)]
async fn a_node_that_refuses_when_it_cannot_pay_queues_nothing() {
    let tree = TenantTree::new().with_node(
        tenant("acme"),
        TenantNode::new()
            .with_limit(requests_per_minute(20))
            .with_max_wait(Duration::ZERO),
    );
    let budget =
        Budget::with_tenants(Quota::new().with_limit(requests_per_minute(6_000)), tree).unwrap();
    let start = Instant::now();
    let calls = (0..600).map(|_| {
        let budget = budget.clone();
        tokio::spawn(async move {
            budget
                .reserve(Cost::requests_only(1))
                .tenant(tenant("acme"))
                .await
        })
    });
    let tasks: Vec<_> = calls.collect();
    tokio::task::yield_now().await;
    assert_eq!(budget.waiters(), 0, "nobody queued");
    let (mut admitted, mut refused) = (Vec::new(), 0);
    for task in tasks {
        match task.await.unwrap() {
            Ok(reservation) => admitted.push(reservation),
            Err(e) => {
                let refusal = e.tenant_refused().expect("refused by the tenant");
                assert!(refusal.is_rate_limited());
                assert_eq!(refusal.scope().as_str(), "acme");
                // One request of the 20 a minute refills in 3 s.
                assert_eq!(refusal.retry_after(), Some(Duration::from_secs(3)));
                refused += 1;
            }
        }
    }
    assert_eq!((admitted.len(), refused), (20, 580));
    assert_eq!(start.elapsed(), Duration::ZERO, "all answered at once");
}

/// With `max_wait` of 2 s, a request the node can pay within 2 s waits for it; one it could
/// pay only later is refused at once, saying when; one waiting for a call in flight is
/// refused when its 2 s are over.
#[tokio::test(start_paused = true)]
async fn a_node_s_max_wait_bounds_the_wait_for_it() {
    let node = |per: u64| {
        TenantNode::new()
            .with_limit(limit(Dimension::Requests, 1, Duration::from_secs(per), 1))
            .with_max_wait(Duration::from_secs(2))
    };
    let tree = TenantTree::new()
        .with_node(tenant("acme"), node(1))
        .with_node(tenant("initech"), node(5))
        .with_node(
            tenant("globex"),
            TenantNode::new()
                .with_max_in_flight(std::num::NonZeroUsize::new(1).unwrap())
                .with_max_wait(Duration::from_secs(2)),
        );
    let budget = Budget::with_tenants(quota(), tree).unwrap();
    let one = |who: &str| budget.reserve(Cost::requests_only(1)).tenant(tenant(who));
    let start = Instant::now();
    one("acme").await.unwrap().charge_estimate();
    // The node refills one request a second: the second waits 1 s.
    one("acme").await.unwrap().charge_estimate();
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    // One request in 5 s: the second would wait 5 s, and is refused at once.
    let start = Instant::now();
    one("initech").await.unwrap().charge_estimate();
    let refused = one("initech").await.unwrap_err();
    let refusal = refused.tenant_refused().unwrap();
    assert!(refusal.is_rate_limited());
    assert_eq!(refusal.retry_after(), Some(Duration::from_secs(5)));
    assert_eq!(start.elapsed(), Duration::ZERO);
    // Globex has one call in flight at most: a second waits for it up to 2 s.
    let held = one("globex").await.unwrap();
    let waited = Instant::now();
    let second = one("globex").await.unwrap_err();
    assert!(matches!(
        second.tenant_refused().unwrap().reason(),
        tower_llm_quota::tenant::Refusal::InFlight { max: 1 }
    ));
    assert_eq!(waited.elapsed(), Duration::from_secs(2));
    // Given back within the 2 s, the slot admits the one waiting.
    let waiting = tokio::spawn(one("globex"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(held);
    waiting.await.unwrap().unwrap().charge_estimate();
    assert_eq!(waited.elapsed(), Duration::from_secs(3));
}

/// A node scoped to one account holds there alone: acme is limited to 4 requests a minute
/// and 1 call in flight on the `openai` account, free on the `anthropic` one, while its
/// parent's 10 a minute hold over both. Settlements give back what each account took.
#[tokio::test(start_paused = true)]
async fn a_node_scoped_to_one_account_holds_there_alone() {
    let tree = TenantTree::new()
        .with_node(
            tenant("acme"),
            TenantNode::new().with_limit(requests_per_minute(10)),
        )
        .with_node(
            tenant("acme/chat"),
            TenantNode::new()
                .with_limit(requests_per_minute(4))
                .with_max_in_flight(std::num::NonZeroUsize::MIN)
                .for_account("openai"),
        );
    let account = |name: &str| {
        Quota::new()
            .with_limit(requests_per_minute(600))
            .with_name(name.to_owned())
    };
    let openai = Budget::with_tenants(account("openai"), tree).unwrap();
    let anthropic = Budget::new(account("anthropic")).with_tenants_of(&openai);
    let chat = tenant("acme/chat");
    let one = |budget: &Budget| budget.try_reserve_for(Cost::requests_only(1), &chat);
    // One call in flight on openai; the node does not count anthropic's.
    let first = one(&openai).expect("the scoped node's first call");
    assert!(matches!(one(&openai), Err(TryReserveError::NoSlot)));
    let mut elsewhere: Vec<_> = (0..6)
        .map(|_| one(&anthropic).expect("the node is passed over on anthropic"))
        .collect();
    // 7 of the parent's 10 taken: 3 left in all, and the scoped node has 3 of its 4 left.
    first.charge_estimate();
    for _ in 0..3 {
        elsewhere.push(one(&openai).expect("within both nodes"));
        elsewhere.pop().unwrap().charge_estimate();
    }
    match one(&anthropic) {
        Err(TryReserveError::NotYet(_)) => {}
        other => panic!("the parent's 10 a minute hold over both accounts: {other:?}"),
    }
    // A minute later, openai admits 4, not 5: the scoped node's minute.
    tokio::time::advance(MINUTE).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        let reservation = one(&openai).expect("within the scoped node's minute");
        held.push(reservation.charge_estimate());
    }
    assert!(matches!(one(&openai), Err(TryReserveError::NotYet(_))));
    let node = anthropic.tenants().unwrap().node(&chat).unwrap();
    assert_eq!(node.account(), Some("openai"));
}

/// A tenant's limits hold over every account it uses: two provider accounts' budgets serving
/// one tenant state. A tenant of 20 requests a minute gets 20 in all, whichever accounts
/// its requests go to (before, each account held a copy of the tree: 20 on each, and with
/// a sixth as burst it was refused after 4 on one account and got 4 more on the other); a
/// cap on calls in flight and a pause hold over both.
#[tokio::test(start_paused = true)]
async fn a_tenant_s_limits_hold_over_every_account_it_uses() {
    let tree = TenantTree::new()
        .with_node(
            tenant("acme"),
            TenantNode::new().with_limit(requests_per_minute(20)),
        )
        .with_node(
            tenant("globex"),
            TenantNode::new().with_max_in_flight(std::num::NonZeroUsize::new(2).unwrap()),
        );
    let account = || Quota::new().with_limit(requests_per_minute(600));
    let openai = Budget::with_tenants(account(), tree).unwrap();
    // The second account's clock starts later: the shared state's times are shifted.
    tokio::time::advance(Duration::from_secs(7)).await;
    let anthropic = Budget::new(account()).with_tenants_of(&openai);
    assert!(anthropic.shares_tenants_with(&openai));
    let one =
        |budget: &Budget, who: &str| budget.try_reserve_for(Cost::requests_only(1), &tenant(who));
    let mut held = Vec::new();
    for i in 0..20 {
        let budget = if i % 2 == 0 { &openai } else { &anthropic };
        held.push(one(budget, "acme").expect("within the tenant's minute"));
    }
    for budget in [&openai, &anthropic] {
        match one(budget, "acme") {
            Err(TryReserveError::NotYet(not_until)) => {
                // One request of the 20 a minute refills in 3 s, told on either clock.
                assert_eq!(
                    not_until.wait_time_from(Instant::now()),
                    Duration::from_secs(3)
                );
            }
            other => panic!("the 21st request of the minute: {other:?}"),
        }
    }
    tokio::time::advance(Duration::from_secs(3)).await;
    held.push(one(&anthropic, "acme").expect("refilled in 3 s"));
    // Two calls in flight for globex, over both accounts.
    let first = one(&openai, "globex").unwrap();
    let _second = one(&anthropic, "globex").unwrap();
    assert!(matches!(
        one(&openai, "globex"),
        Err(TryReserveError::NoSlot)
    ));
    drop(first);
    let _third = one(&anthropic, "globex").expect("a call ended on the other account");
    // A pause through one account's handle refuses on the other.
    openai.tenants().unwrap().pause(&tenant("acme"));
    tokio::time::advance(Duration::from_secs(60)).await;
    let refused = one(&anthropic, "acme").unwrap_err();
    assert!(matches!(refused, TryReserveError::Tenant(ref e) if e.is_paused()));
}

/// The prices of the spend tests: $2.50 per million input tokens, $10 per million output.
fn spend_prices() -> tower_llm_quota::pricing::PriceTable {
    use tower_llm_quota::pricing::{ModelPrices, PriceTable, TokenPrices, Unpriced};
    let prices = TokenPrices::per_million_usd("2.50", "1.25", "2.50", "10").unwrap();
    PriceTable::new(Unpriced::Refuse).with_model("m", ModelPrices::new(prices))
}

/// The body of a chat request for `model`, its prompt made different by `n` (the simulator
/// draws a completion's length from its prompt).
fn priced_body(model: &str, n: usize, max_tokens: u64) -> String {
    let text = format!("{n} {}", "word ".repeat(300 + n % 50));
    format!(
        r#"{{"model":"{model}","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"{text}"}}]}}"#
    )
}

fn priced_chat(tenant: &str, body: String) -> Request<Full<Bytes>> {
    Request::post("/v1/chat/completions")
        .header("authorization", "Bearer sk")
        .header("content-type", "application/json")
        .extension(Priority::Async)
        .extension(self::tenant(tenant))
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// The whole stack over `budget`, priced; a call answers the spend of its usage, in
/// nano-dollars, computed here from the provider's figures (the oracle), rounded up once.
fn priced(budget: &Budget, sim: &Simulator) -> Llm {
    let stack = QuotaStack::openai(quota())
        .with_budget(budget.clone())
        .prices(Arc::new(spend_prices()));
    answering(stack, sim, |usage| {
        let prompt = usage["prompt_tokens"].as_u64().expect("usage");
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        let completion = usage["completion_tokens"].as_u64().expect("usage");
        // Pico-dollars: 2,500,000 a fresh input token, 1,250,000 a cached one, 10,000,000 an
        // output token.
        let pico = (prompt - cached) * 2_500_000 + cached * 1_250_000 + completion * 10_000_000;
        pico.div_ceil(1_000)
    })
}

/// What the crate reserves for the spend of a request of `body`, from its own estimator and
/// prices.
fn estimated_spend(body: &str) -> u64 {
    use tower_llm_quota::estimate::{CharEstimator, Defaults, read_request};
    let estimate = read_request(body.as_bytes(), &CharEstimator::new(), &Defaults::new()).unwrap();
    let counting = tower_llm_quota::provider::Profile::openai().cache_counting();
    let priced = spend_prices().priced("m", None, counting).unwrap();
    priced.estimate(&estimate.cost(&Defaults::new()))
}

/// A tenant with a monthly spend cap, priced requests from 16 workers at once: the spend
/// settled is exactly what the provider's usage costs (counted here), never above the cap and
/// within one request's estimated spend of it when the last worker is refused; the refusal
/// names the cap and the month's end, nothing refused is sent, the month refuses until its
/// last second and the next month admits again.
#[tokio::test(start_paused = true)]
async fn a_monthly_spend_cap_is_reached_within_one_request_and_holds_until_the_month_turns() {
    monthly_spend_cap(false).await;
}

/// The same month with the cap on the account itself ([`Quota::with_cap`]): every tenant's
/// request counts, the refusal names the account.
#[tokio::test(start_paused = true)]
async fn an_account_s_monthly_spend_cap_holds_as_a_tenant_s_does() {
    monthly_spend_cap(true).await;
}

async fn monthly_spend_cap(on_the_account: bool) {
    use tower_llm_quota::tenant::Refusal;
    let start = Instant::now();
    // 2026-01-31T12:00:00Z; February starts 12 hours later.
    let wall = UNIX_EPOCH + Duration::from_secs(1_769_860_800);
    let february = UNIX_EPOCH + Duration::from_secs(1_769_904_000);
    let to_february = february.duration_since(wall).unwrap();
    // $0.20: about a hundred requests.
    const CAP: u64 = 200_000_000;
    let cap = PeriodCap::new(
        Dimension::Spend,
        NonZeroU64::new(CAP).unwrap(),
        CapWindow::CalendarMonthUtc,
    );
    let tree = TenantTree::new().with_clock(WallClock::starting_at(wall));
    let budget = if on_the_account {
        Budget::with_tenants(quota().with_name("openai").with_cap(cap), tree).unwrap()
    } else {
        let tree = tree.with_node(tenant("acme"), TenantNode::new().with_cap(cap));
        Budget::with_tenants(quota(), tree).unwrap()
    };
    let sim = Simulator::new(
        SimConfig::openai(100_000, TPM * 11 / 10)
            .key("sk", "org")
            .latency(Duration::from_millis(500), Duration::ZERO)
            .completion_share(0.1, 1.0),
    );
    let llm = priced(&budget, &sim);
    let spent = Arc::new(Mutex::new(0u64));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let workers: Vec<_> = (0..16)
        .map(|_| {
            let (llm, spent, next) = (llm.clone(), Arc::clone(&spent), Arc::clone(&next));
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    // The account's cap counts every tenant's requests.
                    let who = if on_the_account && n % 2 == 1 {
                        "globex"
                    } else {
                        "acme"
                    };
                    let request = priced_chat(who, priced_body("m", n, 300));
                    match llm.clone().oneshot(request).await {
                        Ok(spend) => *spent.lock().unwrap() += spend,
                        Err(error) => return error,
                    }
                }
            })
        })
        .collect();
    let mut refusals = Vec::new();
    for worker in workers {
        refusals.push(worker.await.unwrap());
    }
    let spent = *spent.lock().unwrap();
    let month = |budget: &Budget| {
        if on_the_account {
            budget.snapshot().used_in_period()[0].1
        } else {
            let snapshot = budget.tenants().unwrap().snapshot(&tenant("acme"));
            snapshot.used_in_period()[0].1
        }
    };
    assert_eq!(
        month(&budget),
        spent,
        "the month holds the usage at its prices"
    );
    assert!(spent <= CAP, "{spent} over the cap {CAP}");
    let asked = next.load(std::sync::atomic::Ordering::Relaxed);
    let (largest, dearest) = (0..asked)
        .map(|n| (estimated_spend(&priced_body("m", n, 300)), n))
        .max()
        .unwrap();
    assert!(
        CAP - spent < largest,
        "{spent} of {CAP}: more than one request's spend ({largest}) left"
    );
    let admitted = sim.stats().received;
    let scope = if on_the_account {
        "an account"
    } else {
        "a tenant"
    };
    eprintln!(
        "monthly spend cap of {scope}: {spent} of {CAP} nano-dollars settled by {admitted} \
         requests, {} short of it (one request reserves at most {largest})",
        CAP - spent
    );
    let is_the_month = |error: &BoxError| {
        let error = error.downcast_ref::<Error>().expect("a local refusal");
        let refused = error.tenant_refused().expect("the tenant's cap");
        let account = on_the_account.then_some("openai");
        assert_eq!(refused.account(), account, "{error}");
        let Refusal::PeriodCap {
            dimension,
            window,
            resets_at,
            ..
        } = refused.reason()
        else {
            panic!("refused for {:?}", refused.reason());
        };
        assert_eq!(
            (dimension, window, resets_at),
            (Dimension::Spend, CapWindow::CalendarMonthUtc, february)
        );
        assert!(
            error.to_string().contains("2026-02-01T00:00:00Z"),
            "{error}"
        );
    };
    refusals.iter().for_each(is_the_month);

    // One second before February: the dearest request is still refused, nothing sent.
    time::sleep_until(start + to_february - Duration::from_secs(1)).await;
    let request = priced_chat("acme", priced_body("m", dearest, 300));
    is_the_month(&llm.clone().oneshot(request).await.unwrap_err());
    assert_eq!(sim.stats().received, admitted);
    // February: admitted, the month's count starting again.
    time::sleep_until(start + to_february).await;
    let request = priced_chat("acme", priced_body("m", dearest, 300));
    let spend = llm.clone().oneshot(request).await.expect("a new month");
    assert_eq!(month(&budget), spend);
}

/// A model the price table does not price, under `Unpriced::Refuse`: refused before anything
/// is reserved or sent, naming the model.
#[tokio::test(start_paused = true)]
async fn an_unpriced_model_is_refused_before_it_is_sent() {
    let budget = Budget::new(quota());
    let sim = simulator();
    let error = priced(&budget, &sim)
        .oneshot(priced_chat("acme", priced_body("gpt-unknown", 0, 300)))
        .await
        .unwrap_err();
    let error = error.downcast::<Error>().expect("a local refusal");
    assert!(error.is_unpriced(), "{error}");
    assert!(error.to_string().contains("gpt-unknown"), "{error}");
    assert_eq!(sim.stats().received, 0);
}

/// An account's caps changed at run time (`Budget::set_caps`): the period's count carries
/// over to a lowered cap, which then refuses; removed, nothing refuses; a budget made
/// without caps takes them.
#[tokio::test(start_paused = true)]
async fn an_account_s_caps_change_at_run_time_keeping_the_period_s_count() {
    let cap = |amount| {
        PeriodCap::new(
            Dimension::TotalTokens,
            NonZeroU64::new(amount).unwrap(),
            CapWindow::CalendarDayUtc,
        )
    };
    let budget = Budget::new(quota().with_name("openai").with_cap(cap(1_000)));
    let held = budget.try_reserve(Cost::new(700, 100)).unwrap();
    budget.set_caps(&[cap(500)]);
    let Err(TryReserveError::Tenant(refused)) = budget.try_reserve(Cost::new(1, 0)) else {
        panic!("admitted over a lowered cap");
    };
    assert_eq!(refused.account(), Some("openai"));
    assert_eq!(budget.snapshot().used_in_period(), [(cap(500), 800)]);
    budget.set_caps(&[]);
    assert!(budget.snapshot().used_in_period().is_empty());
    let _free = budget.try_reserve(Cost::new(1, 0)).expect("no cap left");
    drop(held);
    let plain = Budget::new(quota().with_name("anthropic"));
    let _before = plain.try_reserve(Cost::new(300, 0)).unwrap();
    plain.set_caps(&[cap(200)]);
    let _after = plain
        .try_reserve(Cost::new(200, 0))
        .expect("counted from the change");
    assert!(plain.try_reserve(Cost::new(1, 0)).is_err());
}

/// Keeps the last count of each period a budget records, as a database table would.
#[derive(Debug, Default)]
struct Kept(Mutex<HashMap<(String, u64), u64>>);

impl tower_llm_quota::tenant::CapRecord for Kept {
    fn counted(
        &self,
        scope: tower_llm_quota::tenant::CapScope<'_>,
        _cap: &PeriodCap,
        since: u64,
        used: u64,
    ) {
        let name = match scope {
            tower_llm_quota::tenant::CapScope::Node(node) => node.as_str().to_owned(),
            tower_llm_quota::tenant::CapScope::Account(account) => format!("/{account}"),
            _ => unreachable!("no other scope here"),
        };
        self.0.lock().unwrap().insert((name, since), used);
    }
}

/// A process spends part of a tenant's monthly spend cap and of its account's, is stopped,
/// and a new one restores the recorded counts: the caps go on where they were (the rest of
/// the month, no more), and a rolling cap keeps its quarter hours.
#[tokio::test(start_paused = true)]
async fn caps_restored_from_a_record_go_on_where_they_were() {
    use tower_llm_quota::tenant::CapScope;
    // 2026-12-04T20:00:00Z: December began three days ago.
    let wall = UNIX_EPOCH + Duration::from_secs(1_796_414_400);
    let month = PeriodCap::new(
        Dimension::Spend,
        NonZeroU64::new(1_000).unwrap(),
        CapWindow::CalendarMonthUtc,
    );
    let rolling = PeriodCap::new(
        Dimension::TotalTokens,
        NonZeroU64::new(5_000).unwrap(),
        CapWindow::Rolling,
    );
    let account_cap = PeriodCap::new(
        Dimension::Spend,
        NonZeroU64::new(1_500).unwrap(),
        CapWindow::CalendarMonthUtc,
    );
    let make = || {
        let tree = TenantTree::new()
            .with_clock(WallClock::starting_at(wall))
            .with_node(
                tenant("acme"),
                TenantNode::new().with_cap(month).with_cap(rolling),
            );
        Budget::with_tenants(quota().with_cap(account_cap).with_name("openai"), tree).unwrap()
    };
    let spend = |budget: &Budget, cost: Cost, path: Option<&str>| {
        let budget = budget.clone();
        let path = path.map(tenant);
        async move {
            let reserve = budget.reserve(cost);
            let reserve = match path {
                Some(path) => reserve.tenant(path),
                None => reserve,
            };
            let mut reservation = reserve.await?;
            reservation.mark_sent();
            reservation.charge_estimate();
            Ok::<_, tower_llm_quota::error::ReserveError>(())
        }
    };
    let record = Arc::new(Kept::default());
    let first = make();
    first.tenants().unwrap().record_caps(record.clone());
    for _ in 0..6 {
        spend(&first, Cost::new(100, 0).with_spend(100), Some("acme/web"))
            .await
            .unwrap();
    }
    // One reservation settled below its estimate: the record holds the settled count.
    let mut settled = first
        .reserve(Cost::new(300, 0).with_spend(300))
        .tenant(tenant("acme"))
        .await
        .unwrap();
    settled.mark_sent();
    settled.settle_cost(Cost::new(100, 0).with_spend(100));
    spend(&first, Cost::new(0, 0).with_spend(200), None)
        .await
        .unwrap();
    drop(first);
    let kept = record.0.lock().unwrap().clone();
    // December's first second, and the quarter hour of 20:00.
    assert_eq!(kept[&("acme".to_owned(), 1_796_083_200)], 700, "{kept:?}");
    assert_eq!(
        kept[&("/openai".to_owned(), 1_796_083_200)],
        900,
        "{kept:?}"
    );
    assert_eq!(kept[&("acme".to_owned(), 1_796_414_400)], 700, "{kept:?}");

    // The next process, restored from the record.
    let second = make();
    let handle = second.tenants().unwrap();
    for ((scope, since), used) in &kept {
        let (scope, cap) = match scope.strip_prefix('/') {
            Some(account) => (CapScope::Account(account), account_cap),
            None if *since == 1_796_083_200 => (CapScope::Node(&tenant(scope)), month),
            None => (CapScope::Node(&tenant(scope)), rolling),
        };
        handle.restore_cap(scope, cap, *since, *used);
    }
    let snapshot = handle.snapshot(&tenant("acme"));
    assert_eq!(snapshot.used_in_period(), [(month, 700), (rolling, 700)]);
    // 300 of acme's month are left: three more, then a refusal naming the cap.
    for _ in 0..3 {
        spend(&second, Cost::new(1, 0).with_spend(100), Some("acme"))
            .await
            .unwrap();
    }
    let refused = spend(&second, Cost::new(1, 0).with_spend(100), Some("acme"))
        .await
        .unwrap_err();
    assert!(
        refused.tenant_refused().is_some_and(|r| r.is_capped()),
        "{refused}"
    );
    // The account: 1,500 less 900 restored and 300 since: 300 left for anyone.
    spend(&second, Cost::new(1, 0).with_spend(300), Some("globex"))
        .await
        .unwrap();
    let refused = spend(&second, Cost::new(1, 0).with_spend(1), Some("globex"))
        .await
        .unwrap_err();
    assert!(
        refused.tenant_refused().is_some_and(|r| r.is_capped()),
        "{refused}"
    );
    // A count kept for a period that ended is no use: November's record restores nothing.
    let third = make();
    third.tenants().unwrap().restore_cap(
        CapScope::Node(&tenant("acme")),
        month,
        1_793_491_200,
        1_000,
    );
    spend(&third, Cost::new(1, 0).with_spend(100), Some("acme"))
        .await
        .unwrap();
}

/// A hard cap's refusal says what it has left; a soft cap's says nothing (no request is
/// reshaped to fit it). An answer that outran its reservation takes either above its amount:
/// the count says so, and the next request is refused.
#[tokio::test(start_paused = true)]
async fn a_hard_cap_says_what_it_has_left_and_a_soft_one_does_not() {
    let cap = PeriodCap::new(
        Dimension::OutputTokens,
        NonZeroU64::new(1_000).unwrap(),
        CapWindow::CalendarDayUtc,
    );
    let tree = TenantTree::new()
        .with_node(tenant("hard"), TenantNode::new().with_cap(cap))
        .with_node(tenant("soft"), TenantNode::new().with_cap(cap.soft()));
    let budget = Budget::with_tenants(quota(), tree).unwrap();
    let handle = budget.tenants().unwrap();
    for (name, soft) in [("hard", false), ("soft", true)] {
        assert_eq!(
            handle.node(&tenant(name)).unwrap().caps()[0].is_soft(),
            soft
        );
        let mut first = budget
            .reserve(Cost::new(0, 700))
            .tenant(tenant(name))
            .await
            .unwrap();
        first.mark_sent();
        let refused = budget
            .reserve(Cost::new(0, 400))
            .tenant(tenant(name))
            .await
            .expect_err("over the cap");
        let refused = refused.tenant_refused().expect("the cap refused it");
        let left = refused.cap_left();
        if soft {
            assert_eq!(left, None, "{refused}");
        } else {
            assert_eq!(left, Some((Dimension::OutputTokens, 300)), "{refused}");
        }
        // The answer was longer than its reservation: the cap is passed.
        first.settle_cost(Cost::new(0, 1_200));
        let used = handle.snapshot(&tenant(name)).used_in_period()[0].1;
        assert_eq!(used, 1_200, "{name}");
        let refused = budget
            .reserve(Cost::new(0, 1))
            .tenant(tenant(name))
            .await
            .expect_err("spent");
        let refused = refused.tenant_refused().unwrap();
        let expected = (!soft).then_some((Dimension::OutputTokens, 0));
        assert_eq!(refused.cap_left(), expected);
    }
}
