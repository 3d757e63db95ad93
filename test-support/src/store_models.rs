//! The plain models a store's atomic calls (Redis scripts, Postgres functions) are checked
//! against, and the generated operations they are checked over: a bucket in integer ticks,
//! a cap's count as a list of every use, the slots of a cap on calls in flight, the lease
//! renewals of a fleet. Each store's tests drive its own medium with them.

use proptest::prelude::*;
use tower_llm_quota::CapWindow;
use tower_llm_quota::budget::store::fleet::Report;

/// The test bucket's rate: `NUM` ticks a millisecond, `DEN` ticks a unit (a unit a ms).
pub const NUM: i64 = 3;
/// Ticks a unit.
pub const DEN: i64 = 3;
/// The test bucket's capacity, in units.
pub const CAP: i64 = 1_000;
/// The test bucket's capacity, in ticks.
pub const FULL: i64 = CAP * DEN;

/// The bucket as the stores define it, in ticks; no `ts` when it is absent (full).
#[derive(Clone, Copy, Debug)]
pub struct BucketModel {
    /// Its level, in ticks.
    pub tok: i64,
    /// When it was last written (ms), if it exists.
    pub ts: Option<i64>,
}

impl BucketModel {
    /// The bucket read at `now`: refilled, never by time running back.
    #[must_use]
    pub fn at(self, now: i64) -> Self {
        match self.ts {
            None => Self {
                tok: FULL,
                ts: Some(now),
            },
            Some(ts) if now > ts => Self {
                tok: (self.tok + (now - ts) * NUM).min(FULL),
                ts: Some(now),
            },
            Some(_) => self,
        }
    }

    /// The bucket written at `now`: a full one is deleted.
    #[must_use]
    pub fn written(self, now: i64) -> Self {
        match self.ts {
            Some(ts) if self.tok >= FULL && ts <= now => Self {
                tok: FULL,
                ts: None,
            },
            _ => self,
        }
    }

    /// The bucket after `delta` units are charged at `now` (a refund when negative): a
    /// charge never takes it below minus its capacity (or its level, if lower), a refund
    /// never above its capacity.
    #[must_use]
    pub fn charge(self, delta: i64, now: i64) -> Self {
        let read = self.at(now);
        Self {
            tok: if delta > 0 {
                (read.tok - delta * DEN).max(read.tok.min(-FULL))
            } else {
                (read.tok - delta * DEN).min(FULL)
            },
            ..read
        }
        .written(now)
    }
}

/// A reservation of a generated sequence: its id, its cost, whether it was settled, and
/// whether its record expired.
#[derive(Debug)]
pub struct Reservation {
    /// Its id.
    pub id: String,
    /// Its cost, in units.
    pub cost: i64,
    /// Settled once.
    pub settled: bool,
    /// Its record expired (its lease passed).
    pub expired: bool,
}

/// The kinds of cap window, and the field of a tenant node's controls each is kept in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    /// The calendar day (UTC).
    Day,
    /// The calendar month (UTC).
    Month,
    /// The last 24 hours, by quarter hours.
    Rolling,
}

impl Window {
    /// The field a cap of this window is kept under.
    pub fn field(self) -> &'static str {
        match self {
            Window::Day => "c:total_tokens",
            Window::Month => "m:spend",
            Window::Rolling => "r:total_tokens",
        }
    }
}

/// Whether two instants (ms) fall in one calendar month (UTC): the crate's next month
/// boundary after each is the same.
pub fn same_month(a: i64, b: i64) -> bool {
    let next = |ms: i64| CapWindow::CalendarMonthUtc.resets_after((ms / 1_000) as u64);
    next(a) == next(b)
}

/// A day in milliseconds.
pub const DAY_MS: i64 = 86_400_000;
/// A quarter hour in milliseconds.
pub const QUARTER_MS: i64 = 900_000;

/// A cap's count as the stores keep it, step by step: what a tenant node used in the current
/// calendar day or month (UTC) or in the last 24 hours, in quarter hours; a refund comes off
/// the current day or month, or off the latest quarter hours, never below zero.
/// Deliberately plain: a list of every use.
#[derive(Debug, Default)]
pub struct DayModel {
    /// (quarter hour since the epoch, units), in order.
    pub uses: Vec<(i64, i64)>,
}

impl DayModel {
    fn in_window(&self, window: Window, now: i64) -> impl Iterator<Item = usize> + '_ {
        let q = now / QUARTER_MS;
        let day = now / DAY_MS;
        (0..self.uses.len()).filter(move |&i| {
            let used_at = self.uses[i].0;
            match window {
                Window::Rolling => used_at > q - 96,
                Window::Day => used_at * QUARTER_MS / DAY_MS == day,
                Window::Month => same_month(used_at * QUARTER_MS, now),
            }
        })
    }

    /// What `window` holds at `now` (ms).
    pub fn used(&self, window: Window, now: i64) -> i64 {
        self.in_window(window, now).map(|i| self.uses[i].1).sum()
    }

    /// Counts `delta` at `now` (a refund when negative).
    pub fn add(&mut self, window: Window, delta: i64, now: i64) {
        if delta > 0 {
            self.uses.push((now / QUARTER_MS, delta));
            return;
        }
        let mut left = -delta;
        let held: Vec<usize> = self.in_window(window, now).collect();
        for i in held.into_iter().rev() {
            let taken = left.min(self.uses[i].1);
            self.uses[i].1 -= taken;
            left -= taken;
        }
    }
}

/// A step of a cap on calls in flight: a process takes a slot, a call ends, a process renews
/// its lease, time passes, or someone asks whether a slot is free (at a cap of this many).
#[derive(Debug, Clone)]
pub enum SlotOp {
    /// Process `n` takes a slot.
    Take(u8),
    /// The n-th slot taken (modulo) ends.
    End(usize),
    /// Process `n` renews its lease.
    Renew(u8),
    /// Time passes (ms).
    Advance(i64),
    /// Whether the cap of this many is full.
    Full(i64),
}

/// Generated [`SlotOp`]s.
pub fn slot_op() -> impl Strategy<Value = SlotOp> {
    prop_oneof![
        3 => (0u8..3).prop_map(SlotOp::Take),
        2 => (0usize..16).prop_map(SlotOp::End),
        2 => (0u8..3).prop_map(SlotOp::Renew),
        2 => (0i64..1_500).prop_map(SlotOp::Advance),
        3 => (1i64..6).prop_map(SlotOp::Full),
    ]
}

/// A step of a fleet leasing one account.
#[derive(Debug, Clone)]
pub enum LeaseOp {
    /// A process renews: what it wants (twentieths), its waiting flows and weights, its
    /// waiting guarantees and their shares (millionths), and its report; `stale`, with the
    /// number of its previous renewal.
    Lease {
        /// The process.
        process: u8,
        /// What it wants, in twentieths of the account.
        want: u8,
        /// Its waiting flows and their weights.
        flows: Vec<(u64, u32)>,
        /// Its waiting guarantees and their shares, in millionths.
        guarantees: Vec<(u64, u32)>,
        /// Its report.
        renew: Report,
        /// Sent with the number of its previous renewal (a delayed request).
        stale: bool,
    },
    /// A process leaves, keeping and giving back these units.
    Leave(u8, i64, u64),
    /// Time passes (ms).
    Advance(i64),
}

/// Generated [`LeaseOp`]s.
pub fn lease_op() -> impl Strategy<Value = LeaseOp> {
    let flows = proptest::collection::btree_map(1u64..5, 1u32..5, 0..3)
        .prop_map(|flows| flows.into_iter().collect::<Vec<_>>());
    let guarantees = proptest::collection::btree_map(1u64..4, 0u32..=700_000, 0..2)
        .prop_map(|guarantees| guarantees.into_iter().collect::<Vec<_>>());
    let renew = (
        -30i64..60,
        0u64..40,
        prop_oneof![3 => Just(0u64), 2 => 1u64..120],
        0u64..80,
    )
        .prop_map(|(keep, back, need, ask)| Report {
            keep,
            back,
            need,
            ask,
        });
    prop_oneof![
        8 => (0u8..5, 0u8..=20, flows, guarantees, renew, proptest::bool::weighted(0.1))
            .prop_map(|(process, want, flows, guarantees, renew, stale)| LeaseOp::Lease {
                process, want, flows, guarantees, renew, stale,
            }),
        1 => (0u8..5, -20i64..10, 0u64..30).prop_map(|(p, k, b)| LeaseOp::Leave(p, k, b)),
        3 => (0i64..200).prop_map(LeaseOp::Advance),
    ]
}
