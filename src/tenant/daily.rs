//! Daily caps: a calendar day in UTC, or the last 24 hours. Pure counters over a wall clock
//! read through a seam, so tests drive the days with tokio's paused clock.

use std::fmt;
use std::num::NonZeroU64;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use crate::quota::Dimension;

const DAY: u64 = 86_400;
/// The rolling window's slot: a quarter hour.
const SLOT: u64 = 900;
const SLOTS: usize = (DAY / SLOT) as usize;

/// The kind of day a [`DailyCap`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DayWindow {
    /// The calendar day in UTC: the count starts again at 00:00 UTC, whatever was spent at
    /// 23:59. What invoices and most provider daily limits use; a tenant can spend twice
    /// its cap in a few minutes around midnight.
    CalendarUtc,
    /// The last 24 hours, counted in 96 slots of 15 minutes: a spend counts until the slot it
    /// fell in is 24 hours old. No 24 hours aligned to a quarter hour ever see more than the
    /// cap; any 24 hours at most the cap plus one quarter hour's spending. No burst at
    /// midnight.
    Rolling,
}

impl fmt::Display for DayWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DayWindow::CalendarUtc => "calendar day (UTC)",
            DayWindow::Rolling => "rolling 24 h",
        })
    }
}

/// At most `amount` of a dimension per day, for one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DailyCap {
    pub(crate) dimension: Dimension,
    pub(crate) amount: NonZeroU64,
    pub(crate) window: DayWindow,
}

impl DailyCap {
    /// At most `amount` of `dimension` in each `window`.
    pub const fn new(dimension: Dimension, amount: NonZeroU64, window: DayWindow) -> Self {
        Self {
            dimension,
            amount,
            window,
        }
    }

    /// The capped dimension.
    pub const fn dimension(&self) -> Dimension {
        self.dimension
    }

    /// The cap.
    pub const fn amount(&self) -> NonZeroU64 {
        self.amount
    }

    /// The kind of day.
    pub const fn window(&self) -> DayWindow {
        self.window
    }
}

/// Where the calendar days of [`DayWindow::CalendarUtc`] come from: the wall time at one
/// instant of tokio's clock, advanced by that clock. The wall time is read once, so a step of
/// the system clock (NTP) moves no day boundary, and under a paused clock
/// (`tokio::time::pause`) the days pass as the test advances time.
#[derive(Debug, Clone, Copy)]
pub struct WallClock {
    unix_at: Duration,
    at: Instant,
}

impl WallClock {
    /// The system's wall time now.
    pub fn system() -> Self {
        Self::starting_at(SystemTime::now())
    }

    /// `wall` now (a test's chosen date).
    pub fn starting_at(wall: SystemTime) -> Self {
        Self {
            unix_at: wall.duration_since(UNIX_EPOCH).unwrap_or_default(),
            at: Instant::now(),
        }
    }

    /// Seconds since the Unix epoch at `now`.
    pub(crate) fn unix_seconds(&self, now: Instant) -> u64 {
        (self.unix_at + now.saturating_duration_since(self.at)).as_secs()
    }
}

/// One daily cap's count.
#[derive(Debug, Clone)]
pub(crate) struct DayCount {
    pub(crate) cap: DailyCap,
    state: State,
}

#[derive(Debug, Clone)]
enum State {
    /// The day (days since the epoch) and what it used.
    Calendar { day: u64, used: u64 },
    /// Use per quarter hour, in a ring indexed by quarter hours since the epoch, and the last
    /// quarter hour written.
    Rolling { slots: Box<[u64; SLOTS]>, last: u64 },
}

impl DayCount {
    pub(crate) fn new(cap: DailyCap) -> Self {
        let state = match cap.window {
            DayWindow::CalendarUtc => State::Calendar { day: 0, used: 0 },
            DayWindow::Rolling => State::Rolling {
                slots: Box::new([0; SLOTS]),
                last: 0,
            },
        };
        Self { cap, state }
    }

    /// What the window holding `unix` (seconds) has used.
    pub(crate) fn used(&mut self, unix: u64) -> u64 {
        self.roll(unix);
        match &self.state {
            State::Calendar { used, .. } => *used,
            State::Rolling { slots, .. } => slots.iter().sum(),
        }
    }

    /// Whether `amount` more fits the cap at `unix`; if not, what is used.
    pub(crate) fn fits(&mut self, amount: u64, unix: u64) -> Result<(), u64> {
        let used = self.used(unix);
        if amount > 0 && used.saturating_add(amount) > self.cap.amount.get() {
            Err(used)
        } else {
            Ok(())
        }
    }

    /// Counts `amount` at `unix`.
    pub(crate) fn add(&mut self, amount: u64, unix: u64) {
        self.roll(unix);
        match &mut self.state {
            State::Calendar { used, .. } => *used = used.saturating_add(amount),
            State::Rolling { slots, last } => {
                let slot = &mut slots[(*last % SLOTS as u64) as usize];
                *slot = slot.saturating_add(amount);
            }
        }
    }

    /// Takes `amount` back (a refund) at `unix`: from the current day, or from the latest
    /// quarter hours of the rolling window; never below zero. A refund that arrives after the
    /// day of its admission ended is not taken from the new day beyond what it holds.
    pub(crate) fn sub(&mut self, mut amount: u64, unix: u64) {
        self.roll(unix);
        match &mut self.state {
            State::Calendar { used, .. } => *used = used.saturating_sub(amount),
            State::Rolling { slots, last } => {
                for back in 0..SLOTS as u64 {
                    if amount == 0 {
                        break;
                    }
                    let Some(q) = last.checked_sub(back) else {
                        break;
                    };
                    let slot = &mut slots[(q % SLOTS as u64) as usize];
                    let taken = amount.min(*slot);
                    *slot -= taken;
                    amount -= taken;
                }
            }
        }
    }

    /// Whether the count holds nothing at `unix` (its state may be dropped).
    pub(crate) fn is_empty(&mut self, unix: u64) -> bool {
        self.used(unix) == 0
    }

    /// Moves the window to `unix`, forgetting what left it.
    fn roll(&mut self, unix: u64) {
        match &mut self.state {
            State::Calendar { day, used } => {
                let today = unix / DAY;
                if today > *day {
                    (*day, *used) = (today, 0);
                }
            }
            State::Rolling { slots, last } => {
                let now = unix / SLOT;
                if now <= *last {
                    return;
                }
                // Clear the quarter hours between the last written and now (at most a day's).
                let gap = (now - *last).min(SLOTS as u64);
                for q in (now + 1 - gap)..=now {
                    slots[(q % SLOTS as u64) as usize] = 0;
                }
                *last = now;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(window: DayWindow) -> DayCount {
        DayCount::new(DailyCap::new(
            Dimension::TotalTokens,
            NonZeroU64::new(1_000).unwrap(),
            window,
        ))
    }

    #[test]
    fn a_calendar_day_starts_again_at_midnight_utc() {
        let mut count = cap(DayWindow::CalendarUtc);
        let late = 20 * DAY - 60;
        count.add(900, late);
        assert_eq!(count.fits(101, late), Err(900));
        assert_eq!(count.fits(100, late), Ok(()));
        // One minute later it is the next day.
        assert_eq!(count.used(20 * DAY), 0);
        assert_eq!(count.fits(1_000, 20 * DAY), Ok(()));
        count.add(1_000, 20 * DAY);
        count.sub(400, 20 * DAY + 5);
        assert_eq!(count.used(20 * DAY + 5), 600);
    }

    #[test]
    fn a_rolling_day_forgets_each_quarter_hour_a_day_later() {
        let mut count = cap(DayWindow::Rolling);
        let t0 = 20 * DAY - 60;
        count.add(900, t0);
        // Midnight changes nothing.
        assert_eq!(count.fits(101, 20 * DAY), Err(900));
        count.add(100, 20 * DAY + SLOT);
        // 24 h after the start of the first quarter hour, its 900 are gone; the 100 stay.
        assert_eq!(count.used(t0 - (t0 % SLOT) + DAY - 1), 1_000);
        assert_eq!(count.used(t0 - (t0 % SLOT) + DAY), 100);
        count.sub(150, t0 + DAY);
        assert!(count.is_empty(t0 + DAY));
        // Long idle: everything is forgotten.
        count.add(5, t0 + 2 * DAY);
        assert_eq!(count.used(t0 + 30 * DAY), 0);
    }
}
