//! Tenants: what a path costs at admission, what many tenants cost, what an active tenant
//! holds in memory, and how fair the shares are under skewed demand.
//!
//! Run with `cargo bench --bench tenants` (criterion; extra options after `--`).
//!
//! Groups, side by side in one run:
//!
//! - `path_depth`: one admission (`reserve` ready at once, polled once) and its refund, for a
//!   budget without tenants, a one-level path and a four-level path whose every node has a
//!   limit of its own.
//! - `tenant_count`: the same four-level admission, cycling over 10 hot keys, with 10 and with
//!   10,000 live tenants in the tree.
//!
//! Printed once, before the groups (not criterion measurements):
//!
//! - the memory an active tenant holds: the growth of the process's data segment over
//!   10,000 tenants' first admissions (each keeps its reservation), per tenant, for a
//!   one-level and a four-level path whose every node has a limit;
//! - Jain's fairness index of the weighted token shares of 10 tenants with demand skewed
//!   (tenant `i` sends prompts `2^i` times larger, see `jain`), served in virtual time by
//!   the tenant tree, against the same traffic in a budget without tenants (first come,
//!   first served).

#[path = "support/memory.rs"]
mod memory;

use std::future::Future;
use std::hint::black_box;
use std::num::NonZeroU64;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use criterion::{Criterion, Throughput};
use memory::data_segment;
use tower_llm_quota::tenant::{Tenant, TenantNode, TenantTree};
use tower_llm_quota::{Budget, Cost, Dimension, Limit, Quota, Reservation};

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).unwrap()
}

/// Never runs out.
fn huge(dimension: Dimension) -> Limit {
    Limit::per_second(dimension, nz(1_000_000_000_000))
        .with_headroom(1.0)
        .unwrap()
        .with_burst(nz(1_000_000_000_000_000))
}

fn quota() -> Quota {
    Quota::new().with_limit(huge(Dimension::TotalTokens))
}

/// A tree whose every node at depths 1 to `depth` has a limit of its own.
fn tree(depth: usize) -> TenantTree {
    (1..=depth).fold(TenantTree::new(), |tree, d| {
        tree.with_template(d, TenantNode::new().with_limit(huge(Dimension::Requests)))
    })
}

fn path(depth: usize, key: usize) -> Tenant {
    let segments = ["org", "team", "key", "profile"];
    Tenant::new((0..depth).map(|d| {
        if d == depth - 1 {
            format!("{}-{key}", segments[d])
        } else {
            segments[d].to_owned()
        }
    }))
    .unwrap()
}

/// One admission, ready at once.
fn admit(budget: &Budget, tenant: Option<&Tenant>) -> Reservation {
    let reserve = budget.reserve(Cost::new(1_000, 200));
    let reserve = match tenant {
        Some(tenant) => reserve.tenant(tenant.clone()),
        None => reserve,
    };
    let mut reserve = pin!(reserve);
    match reserve
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(Ok(reservation)) => reservation,
        other => panic!("not admitted at once: {other:?}"),
    }
}

fn path_depth(c: &mut Criterion) {
    let mut group = c.benchmark_group("path_depth");
    group.throughput(Throughput::Elements(1));
    let flat = Budget::new(quota());
    group.bench_function("no_tenants", |b| {
        b.iter(|| black_box(admit(&flat, None)).refund())
    });
    for depth in [1, 4] {
        let budget = Budget::with_tenants(quota(), tree(depth)).unwrap();
        let tenant = path(depth, 0);
        group.bench_function(format!("depth_{depth}"), |b| {
            b.iter(|| black_box(admit(&budget, Some(&tenant))).refund())
        });
    }
    group.finish();
}

fn tenant_count(c: &mut Criterion) {
    let mut group = c.benchmark_group("tenant_count");
    group.throughput(Throughput::Elements(1));
    for count in [10, 10_000] {
        let budget = Budget::with_tenants(quota(), tree(4)).unwrap();
        let tenants: Vec<Tenant> = (0..count).map(|key| path(4, key)).collect();
        // Every tenant live: a reservation held by each.
        let held: Vec<Reservation> = tenants.iter().map(|t| admit(&budget, Some(t))).collect();
        let mut next = 0;
        group.bench_function(format!("live_{count}"), |b| {
            b.iter(|| {
                next = (next + 1) % 10;
                black_box(admit(&budget, Some(&tenants[next]))).refund()
            })
        });
        drop(held);
    }
    group.finish();
}

/// Bytes held per active tenant (a reservation in flight on each), at `depth`.
fn memory_per_tenant(depth: usize) -> usize {
    const TENANTS: usize = 10_000;
    let budget = Budget::with_tenants(quota(), tree(depth)).unwrap();
    let tenants: Vec<Tenant> = (0..TENANTS).map(|key| path(depth, key)).collect();
    let mut held = Vec::with_capacity(TENANTS);
    let before = data_segment();
    for tenant in &tenants {
        held.push(admit(&budget, Some(tenant)));
    }
    let after = data_segment();
    drop(held);
    after.saturating_sub(before) / TENANTS
}

/// Jain's index of the weighted token shares (`x_i = tokens_i / weight_i`:
/// `(sum x)^2 / (n sum x^2)`, 1 when perfectly fair) of 10 saturating tenants over ten
/// minutes of virtual time: tenant `i` weighs 1 and sends prompts of `100 × 2^i` tokens (a
/// thousandfold skew), 4 requests at a time; the account 100,000 tokens a minute.
fn jain(with_tenants: bool) -> f64 {
    const TENANTS: usize = 10;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async move {
        let quota = Quota::new().with_limit(
            Limit::per_minute(Dimension::TotalTokens, nz(100_000))
                .with_headroom(1.0)
                .unwrap()
                .with_burst(nz(60_000)),
        );
        let budget = if with_tenants {
            Budget::with_tenants(quota, TenantTree::new()).unwrap()
        } else {
            Budget::new(quota)
        };
        let start = tokio::time::Instant::now();
        let (from, end) = (
            start + Duration::from_secs(60),
            start + Duration::from_secs(660),
        );
        let mut tasks = Vec::new();
        for i in 0..TENANTS {
            for _ in 0..4 {
                let budget = budget.clone();
                let tenant = path(1, i);
                tasks.push(tokio::spawn(async move {
                    let cost = Cost::new(100 << i, 0);
                    let mut tokens = 0u64;
                    while tokio::time::Instant::now() < end {
                        let counted = tokio::time::Instant::now() >= from;
                        let mut reservation =
                            budget.reserve(cost).tenant(tenant.clone()).await.unwrap();
                        reservation.mark_sent();
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        reservation.charge_estimate();
                        tokens += if counted { cost.total_tokens() } else { 0 };
                    }
                    (i, tokens)
                }));
            }
        }
        let mut shares = [0f64; TENANTS];
        for task in tasks {
            let (i, tokens) = task.await.unwrap();
            shares[i] += tokens as f64;
        }
        let sum: f64 = shares.iter().sum();
        let squares: f64 = shares.iter().map(|x| x * x).sum();
        sum * sum / (TENANTS as f64 * squares)
    })
}

fn report() {
    for depth in [1, 4] {
        println!(
            "memory per active tenant, {depth}-level path: {} bytes",
            memory_per_tenant(depth)
        );
    }
    let (fair, fifo) = (jain(true), jain(false));
    println!("Jain's index, skewed demand: tenants {fair:.4}, without tenants {fifo:.4}");
}

fn main() {
    report();
    let mut criterion = Criterion::default().configure_from_args();
    path_depth(&mut criterion);
    tenant_count(&mut criterion);
    criterion.final_summary();
}
