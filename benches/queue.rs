//! Cost of the [`PriorityQueueLayer`] per request, with 10 and with 100 000 requests waiting,
//! and its memory per waiting request.
//!
//! Run with `cargo bench --bench queue` (criterion; extra options after `--`, e.g.
//! `cargo bench --bench queue -- --warm-up-time 1 --measurement-time 3`).
//!
//! Everything goes through the public API: a [`PriorityQueue`] around `Gate`, an inner service
//! whose readiness the bench opens and closes, and a backlog of `N` requests that each had
//! their first poll (so they wait in the queue; the first deadline arms the queue's one alarm), kept pinned
//! and never polled again. Groups, `N` = 10 and `N` = 100 000 side by side (the cost per
//! operation should grow no faster than log `N`; the bench prints the ratio):
//!
//! - `enqueue_cancel`: backlog of the three classes in turn; one more request (of each class in
//!   turn) is called and polled once (it waits: it is not first), then dropped, which leaves the
//!   queue.
//! - `enqueue_front_cancel`: backlog of async and batch requests, the inner service not ready;
//!   one more request, interactive, so it is first: polled once, it asks the inner service,
//!   which is not ready, and waits; then dropped, so the next one becomes the front.
//! - `enqueue_dispatch`: the same backlog; the gate is opened, one more interactive request is
//!   called and polled once: it is first, the inner service is ready, it is handed over and
//!   completes at once; the gate is closed again.
//! - `baseline`: what the request itself costs in those operations, without any queue: the
//!   an extension of the size of the placement the queue inserts, and dropping it.
//!
//! Requests are built outside the timed span; dropping them (and the response) is inside.
//! Classes never age nor expire during the run: the ceilings and maximum waits are an hour or
//! more, so the interactive newcomer stays first whatever the run's length. The depth is checked
//! to be `N` again after each benchmark.
//!
//! Before the groups, a `memory` step prints the memory per waiting request, measured on
//! 100 000 requests. The crate forbids `unsafe` code, benches included, so no counting global
//! allocator is possible here: the step reads the process's data segment size (`VmData` in
//! `/proc/self/status`, Linux only; heap growth in whole pages, over 100 000 requests) around
//! each phase, and keeps everything alive until its end so that no phase reuses memory freed by
//! another. The figures so include the allocator's own overhead per allocation (with glibc,
//! 8 bytes plus rounding to 16, at least 32 bytes): they are what the process really spends.

use std::convert::Infallible;
use std::future::{Future, Ready, ready};
use std::hint::black_box;
use std::mem::size_of;
use std::num::NonZeroUsize;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use http::{Request, Response};
use tower::{Layer, Service};
use tower_llm_quota::queue::ResponseFuture;
use tower_llm_quota::{
    Cost, Deadline, Priority, PriorityQueueLayer, QueueConfig,
    queue::{PriorityQueue, QueueHandle},
};

/// The backlog sizes compared.
const SIZES: [usize; 2] = [10, 100_000];
/// Requests built ahead of one timed span.
const BATCH: u64 = 1_024;
/// Requests enqueued by the `memory` step.
const MEMORY_N: usize = 100_000;

/// An inner service that is ready only while its gate is open.
#[derive(Debug, Clone)]
struct Gate {
    open: Arc<AtomicBool>,
}

impl Gate {
    fn set(&self, open: bool) {
        self.open.store(open, Ordering::Release);
    }
}

impl Service<Request<()>> for Gate {
    type Response = Response<()>;
    type Error = Infallible;
    type Future = Ready<Result<Response<()>, Infallible>>;

    /// Registers no waker when closed: nothing in the bench waits to be woken, every poll is
    /// made by hand.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        if self.open.load(Ordering::Acquire) {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    fn call(&mut self, _request: Request<()>) -> Self::Future {
        ready(Ok(Response::new(())))
    }
}

type Queue = PriorityQueue<Gate>;
type Waiting = ResponseFuture<Gate, ()>;

/// A queue of a million at most, no aging nor expiry within the run, and a closed gate.
fn queue() -> (Queue, Gate, QueueHandle) {
    let hour = Duration::from_secs(3_600);
    let config = QueueConfig::new()
        .max_depth(NonZeroUsize::new(1_000_000).unwrap())
        .max_wait(Priority::Interactive, 2 * hour)
        .max_wait(Priority::Async, 2 * hour)
        .max_wait(Priority::Batch, 2 * hour)
        .promote_after(Priority::Async, Some(hour))
        .promote_after(Priority::Batch, Some(hour));
    let layer = PriorityQueueLayer::new(config);
    let gate = Gate {
        open: Arc::new(AtomicBool::new(false)),
    };
    (layer.layer(gate.clone()), gate, layer.handle())
}

/// A request as a client would send it: a cost and a class in its extensions.
fn request(priority: Priority) -> Request<()> {
    let mut request = Request::new(());
    request.extensions_mut().insert(Cost::new(1_200, 200));
    request.extensions_mut().insert(priority);
    request
}

/// `n` requests waiting in `queue`, of `classes` in turn, each polled once.
fn backlog(queue: &mut Queue, n: usize, classes: &[Priority]) -> Vec<Pin<Box<Waiting>>> {
    let mut cx = Context::from_waker(Waker::noop());
    (0..n)
        .map(|i| {
            let mut waiting = Box::pin(queue.call(request(classes[i % classes.len()])));
            assert!(waiting.as_mut().poll(&mut cx).is_pending());
            waiting
        })
        .collect()
}

/// Times `op` on `iters` requests of `classes` in turn, built outside the timed spans.
fn timed(
    iters: u64,
    classes: &[Priority],
    mut op: impl FnMut(Request<()>),
    record: &mut (u64, Duration),
) -> Duration {
    let mut requests = Vec::with_capacity(BATCH as usize);
    let (mut done, mut total) = (0, Duration::ZERO);
    while done < iters {
        let batch = (iters - done).min(BATCH);
        requests.extend((done..done + batch).map(|i| request(classes[i as usize % classes.len()])));
        let began = Instant::now();
        for request in requests.drain(..) {
            op(request);
        }
        total += began.elapsed();
        done += batch;
    }
    record.0 += iters;
    record.1 += total;
    total
}

/// Prints the mean time per operation of each size (every timed iteration, warm-up included:
/// criterion's own estimates are in its report) and their ratio.
fn print_ratio(group: &str, records: &[(u64, Duration)]) {
    let per_op: Vec<f64> = records
        .iter()
        .map(|(iters, total)| total.as_nanos() as f64 / (*iters).max(1) as f64)
        .collect();
    println!(
        "{group}: mean {:.1} ns/op at N={}, {:.1} ns/op at N={}: ratio {:.2}\n",
        per_op[0],
        SIZES[0],
        per_op[1],
        SIZES[1],
        per_op[1] / per_op[0]
    );
}

fn enqueue_cancel(c: &mut Criterion) {
    let mut group = c.benchmark_group("enqueue_cancel");
    group.throughput(Throughput::Elements(1));
    let mut records = [(0, Duration::ZERO); 2];
    for (n, record) in SIZES.into_iter().zip(&mut records) {
        let (mut queue, _gate, handle) = queue();
        let waiting = backlog(&mut queue, n, &Priority::ALL);
        assert_eq!(handle.snapshot().depth(), n);
        let mut cx = Context::from_waker(Waker::noop());
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| {
                timed(
                    iters,
                    &Priority::ALL,
                    |request| {
                        let future = pin!(queue.call(black_box(request)));
                        assert!(future.poll(&mut cx).is_pending());
                    },
                    record,
                )
            })
        });
        assert_eq!(handle.snapshot().depth(), n);
        drop(waiting);
    }
    group.finish();
    print_ratio("enqueue_cancel", &records);
}

fn enqueue_front_cancel(c: &mut Criterion) {
    let mut group = c.benchmark_group("enqueue_front_cancel");
    group.throughput(Throughput::Elements(1));
    let mut records = [(0, Duration::ZERO); 2];
    for (n, record) in SIZES.into_iter().zip(&mut records) {
        let (mut queue, _gate, handle) = queue();
        let waiting = backlog(&mut queue, n, &[Priority::Async, Priority::Batch]);
        let mut cx = Context::from_waker(Waker::noop());
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| {
                timed(
                    iters,
                    &[Priority::Interactive],
                    |request| {
                        let future = pin!(queue.call(black_box(request)));
                        assert!(future.poll(&mut cx).is_pending());
                    },
                    record,
                )
            })
        });
        let snapshot = handle.snapshot();
        assert_eq!(snapshot.depth(), n);
        assert_eq!(snapshot.class(Priority::Interactive).depth(), 0);
        drop(waiting);
    }
    group.finish();
    print_ratio("enqueue_front_cancel", &records);
}

fn enqueue_dispatch(c: &mut Criterion) {
    let mut group = c.benchmark_group("enqueue_dispatch");
    group.throughput(Throughput::Elements(1));
    let mut records = [(0, Duration::ZERO); 2];
    for (n, record) in SIZES.into_iter().zip(&mut records) {
        let (mut queue, gate, handle) = queue();
        let waiting = backlog(&mut queue, n, &[Priority::Async, Priority::Batch]);
        let mut cx = Context::from_waker(Waker::noop());
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| {
                timed(
                    iters,
                    &[Priority::Interactive],
                    |request| {
                        gate.set(true);
                        let future = pin!(queue.call(black_box(request)));
                        let Poll::Ready(Ok(response)) = future.poll(&mut cx) else {
                            panic!("the interactive request was not served at once");
                        };
                        black_box(response);
                        gate.set(false);
                    },
                    record,
                )
            })
        });
        assert_eq!(handle.snapshot().depth(), n);
        drop(waiting);
    }
    group.finish();
    print_ratio("enqueue_dispatch", &records);
}

fn baseline(c: &mut Criterion) {
    let mut group = c.benchmark_group("baseline");
    group.throughput(Throughput::Elements(1));
    let deadline = Deadline::after(Duration::from_secs(7_200));
    let mut record = (0, Duration::ZERO);
    group.bench_function("request_insert_deadline_drop", |b| {
        b.iter_custom(|iters| {
            timed(
                iters,
                &Priority::ALL,
                |mut request| {
                    request.extensions_mut().insert(black_box(deadline));
                    drop(black_box(request));
                },
                &mut record,
            )
        })
    });
    group.finish();
}

/// The process's data segment (heap included), in bytes, if the system tells.
fn data_segment() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmData:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1_024)
}

/// The growth of the data segment while `phase` runs, per request of `MEMORY_N`.
fn per_request<T>(phase: impl FnOnce() -> T) -> (T, f64) {
    let before = data_segment().unwrap_or(0);
    let kept = phase();
    let after = data_segment().unwrap_or(0);
    (kept, after.saturating_sub(before) as f64 / MEMORY_N as f64)
}

/// Memory per waiting request, in phases over `MEMORY_N` requests, each measured by the
/// growth of the data segment. Every buffer that outlives a phase is reserved before it, and
/// nothing is freed until the end, so a phase neither counts the others' memory nor reuses it:
///
/// 1. `request`: building the requests (cost and class in their extensions), as the client
///    would: the heap behind each request (its extension map and boxed values).
/// 2. `called`: calling a queue with them (its inner service was not ready), keeping the futures
///    unboxed and never polled: the boxed waiting state each future holds (the request moves
///    into it). A request joins the ordering only once it has to wait, at its first poll, and
///    its placement is stamped into its extensions only when it is handed over.
/// 3. `enqueued`: what a caller does, on a second queue: call with the requests of phase 1,
///    box the future and poll it once, so that it waits: the future's box, its boxed waiting
///    state and the ordering's entry (its place in its class and in the deadline index). The
///    request's own struct moves into the waiting state, so the cost excluding the request is
///    this minus `size_of::<Request<()>>()` (its heap was counted in phase 1, outside this
///    phase).
fn memory() {
    let Some(start) = data_segment() else {
        println!("memory: /proc/self/status has no VmData here; skipped\n");
        return;
    };
    let classes = Priority::ALL;
    let class = |i: usize| classes[i % classes.len()];

    let mut plain = Vec::with_capacity(MEMORY_N);
    let mut for_call = Vec::with_capacity(MEMORY_N);
    let mut unpolled: Vec<Waiting> = Vec::with_capacity(MEMORY_N);
    let mut waiting: Vec<Pin<Box<Waiting>>> = Vec::with_capacity(MEMORY_N);
    let (mut queue_a, _gate_a, _handle_a) = queue();
    let (mut queue_b, _gate_b, handle_b) = queue();

    let ((), request_heap) = per_request(|| plain.extend((0..MEMORY_N).map(|i| request(class(i)))));
    for_call.extend((0..MEMORY_N).map(|i| request(class(i))));
    let ((), stamp) = per_request(|| {
        for request in for_call.drain(..) {
            unpolled.push(queue_a.call(request));
        }
    });
    let mut cx = Context::from_waker(Waker::noop());
    let ((), enqueued) = per_request(|| {
        for request in plain.drain(..) {
            let mut future = Box::pin(queue_b.call(request));
            assert!(future.as_mut().poll(&mut cx).is_pending());
            waiting.push(future);
        }
    });
    assert_eq!(handle_b.snapshot().depth(), MEMORY_N);
    let end = data_segment().unwrap_or(start);

    let request_size = size_of::<Request<()>>();
    let future_size = size_of::<Waiting>();
    let excluding_request = enqueued - request_size as f64;
    println!("memory, {MEMORY_N} requests (growth of VmData, allocator overhead included):");
    println!(
        "  sizes: Request<()> {request_size} B, ResponseFuture<Gate, ()> {future_size} B \
         (of which Response<()> {} B), Priority {} B, Deadline {} B",
        size_of::<Response<()>>(),
        size_of::<Priority>(),
        size_of::<Deadline>(),
    );
    println!("  request heap (cost, class):                {request_heap:>8.1} B/request");
    println!("  waiting state a call boxes (request in it): {stamp:>7.1} B/request");
    println!(
        "  enqueued (box + waiting state + entry + first poll), total {:.1} MiB: \
         {enqueued:.1} B/request",
        enqueued * MEMORY_N as f64 / (1 << 20) as f64
    );
    println!(
        "  => per waiting request, excluding the request ({request_size} B struct + \
         {request_heap:.1} B heap): {excluding_request:.1} B (target < 256); including it: {:.1} B",
        enqueued + request_heap
    );
    println!(
        "  whole step: {:.1} MiB\n",
        end.saturating_sub(start) as f64 / (1 << 20) as f64
    );
    drop((unpolled, waiting, plain, for_call));
}

// What `criterion_group!`/`criterion_main!` expand to, without their undocumented `pub fn`.
fn main() {
    // The queue arms one tokio timer (for the first deadline): a runtime with time enabled
    // (real clock), entered for the whole run and never driven.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _entered = runtime.enter();
    memory();
    let mut c = Criterion::default().configure_from_args();
    enqueue_cancel(&mut c);
    enqueue_front_cancel(&mut c);
    enqueue_dispatch(&mut c);
    baseline(&mut c);
    c.final_summary();
}
