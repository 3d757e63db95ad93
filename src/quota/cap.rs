//! Caps over a period: a calendar day or month in UTC, or the last 24 hours. Pure counters
//! over a wall clock read through a seam, so tests drive the days with tokio's paused clock.

use std::fmt;
use std::num::NonZeroU64;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use crate::quota::Dimension;

const DAY: u64 = 86_400;
/// The rolling window's slot: a quarter hour.
const SLOT: u64 = 900;
const SLOTS: usize = (DAY / SLOT) as usize;

/// The period a [`PeriodCap`] counts over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CapWindow {
    /// The calendar day in UTC: the count starts again at 00:00 UTC, whatever was spent at
    /// 23:59. What invoices and most provider daily limits use; a tenant can spend twice
    /// its cap in a few minutes around midnight.
    CalendarDayUtc,
    /// The calendar month in UTC: the count starts again at 00:00 UTC on the first of the
    /// month. What a monthly bill uses (a spend cap of $500 a month).
    CalendarMonthUtc,
    /// The last 24 hours, counted in 96 slots of 15 minutes: a spend counts until the slot it
    /// fell in is 24 hours old. No 24 hours aligned to a quarter hour ever see more than the
    /// cap; any 24 hours at most the cap plus one quarter hour's spending. No burst at
    /// midnight.
    Rolling,
}

impl fmt::Display for CapWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CapWindow::CalendarDayUtc => "calendar day (UTC)",
            CapWindow::CalendarMonthUtc => "calendar month (UTC)",
            CapWindow::Rolling => "rolling 24 h",
        })
    }
}

impl CapWindow {
    /// The calendar period holding `unix` (seconds since the epoch): days, or months, since
    /// the epoch; the quarter hour for a rolling window.
    pub(crate) const fn period(self, unix: u64) -> u64 {
        match self {
            CapWindow::CalendarDayUtc => unix / DAY,
            CapWindow::CalendarMonthUtc => {
                let (year, month) = year_month(unix / DAY);
                (year - 1970) * 12 + (month - 1)
            }
            CapWindow::Rolling => unix / SLOT,
        }
    }

    /// The first second (since the epoch) of the calendar `period` (days or months since the
    /// epoch; for a rolling window, quarter hours).
    pub(crate) const fn first_second(self, period: u64) -> u64 {
        match self {
            CapWindow::CalendarDayUtc => period * DAY,
            CapWindow::CalendarMonthUtc => {
                days_from_civil(1970 + period / 12, period % 12 + 1) * DAY
            }
            CapWindow::Rolling => period * SLOT,
        }
    }

    /// When a window that is spent at `unix` admits again, in seconds since the epoch: the
    /// next calendar day or month; for a rolling window, the next quarter hour, when its
    /// oldest quarter hour leaves it (which may not free enough).
    pub const fn resets_after(self, unix: u64) -> u64 {
        match self {
            CapWindow::CalendarDayUtc => (unix / DAY + 1) * DAY,
            CapWindow::CalendarMonthUtc => {
                let (year, month) = year_month(unix / DAY);
                let (year, month) = if month == 12 {
                    (year + 1, 1)
                } else {
                    (year, month + 1)
                };
                days_from_civil(year, month) * DAY
            }
            CapWindow::Rolling => (unix / SLOT + 1) * SLOT,
        }
    }

    /// When the window holding `unix` began, in seconds since the epoch: the calendar day's or
    /// month's first second; for a rolling window, 24 hours before the end of its quarter
    /// hour.
    pub const fn started_at(self, unix: u64) -> u64 {
        match self {
            CapWindow::CalendarDayUtc => unix / DAY * DAY,
            CapWindow::CalendarMonthUtc => {
                let (year, month) = year_month(unix / DAY);
                days_from_civil(year, month) * DAY
            }
            CapWindow::Rolling => ((unix / SLOT + 1) * SLOT).saturating_sub(DAY),
        }
    }

    /// [`resets_after`](Self::resets_after) as a wall time.
    pub(crate) fn resets_at(self, unix: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(self.resets_after(unix))
    }
}

/// The year and month (1 to 12) of the day `days` after 1970-01-01 (proleptic Gregorian).
const fn year_month(days: u64) -> (u64, u64) {
    let (year, month, _) = civil(days);
    (year, month)
}

/// The year, month (1 to 12) and day (1 to 31) of the day `days` after 1970-01-01.
const fn civil(days: u64) -> (u64, u64, u64) {
    // Days since 0000-03-01, in 400-year eras of 146,097 days (H. Hinnant's civil_from_days).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + if month <= 2 { 1 } else { 0 };
    (year, month, doy - (153 * mp + 2) / 5 + 1)
}

/// `unix` (seconds since the epoch) as an RFC 3339 instant in UTC, `2026-02-01T00:00:00Z`.
pub(crate) struct Utc(pub(crate) u64);

impl fmt::Display for Utc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (year, month, day) = civil(self.0 / DAY);
        let second = self.0 % DAY;
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
            second / 3_600,
            second / 60 % 60,
            second % 60
        )
    }
}

/// Days from 1970-01-01 to the first of `month` (1 to 12) of `year` (1970 or later).
const fn days_from_civil(year: u64, month: u64) -> u64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year / 400;
    let yoe = year - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// At most `amount` of a dimension per period, for one node.
///
/// A cap refuses a request whose reservation would take the period's count above it, and
/// counts what answers really used once they are settled. It is **hard** by default: it is
/// meant never to be passed, which holds when every request's reservation bounds what its
/// answer may use: a client that shapes requests (the gateway) bounds each request's output
/// under a hard cap and lowers it to what the cap has left
/// ([`TenantRefused::cap_left`](crate::tenant::TenantRefused::cap_left)). A **soft** cap
/// ([`soft`](Self::soft)) is never used to reshape a request: it refuses once its count is
/// spent, and may be passed by answers longer than their reservation. Either way the first
/// time a period's count passes its cap is logged as a warning (and counted as
/// `llm_quota_cap_passed_total` with the `metrics` feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeriodCap {
    pub(crate) dimension: Dimension,
    pub(crate) amount: NonZeroU64,
    pub(crate) window: CapWindow,
    pub(crate) soft: bool,
}

impl PeriodCap {
    /// At most `amount` of `dimension` in each `window`: a hard cap.
    pub const fn new(dimension: Dimension, amount: NonZeroU64, window: CapWindow) -> Self {
        Self {
            dimension,
            amount,
            window,
            soft: false,
        }
    }

    /// The same cap, soft: it refuses once spent, but no request is reshaped to keep it
    /// (an answer longer than its reservation may pass it; that is logged).
    #[must_use]
    pub const fn soft(self) -> Self {
        Self { soft: true, ..self }
    }

    /// Whether the cap is soft ([`soft`](Self::soft)); hard otherwise.
    pub const fn is_soft(&self) -> bool {
        self.soft
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
    pub const fn window(&self) -> CapWindow {
        self.window
    }
}

/// Where the calendar days of [`CapWindow::CalendarDayUtc`] come from: the wall time at one
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
pub(crate) struct CapCount {
    pub(crate) cap: PeriodCap,
    state: State,
    /// The periods changed since the last [`CapCount::report`]: the calendar period (bit 0),
    /// or the rolling window's quarter hours (by their place in the ring).
    changed: u128,
    /// The period (as [`CapWindow::period`] numbers it) whose passing was last told.
    passed_told: Option<u64>,
}

#[derive(Debug, Clone)]
enum State {
    /// The calendar period (days or months since the epoch) and what it used.
    Calendar { period: u64, used: u64 },
    /// Use per quarter hour, in a ring indexed by quarter hours since the epoch, and the last
    /// quarter hour written.
    Rolling { slots: Box<[u64; SLOTS]>, last: u64 },
}

impl CapCount {
    pub(crate) fn new(cap: PeriodCap) -> Self {
        let state = match cap.window {
            CapWindow::CalendarDayUtc | CapWindow::CalendarMonthUtc => {
                State::Calendar { period: 0, used: 0 }
            }
            CapWindow::Rolling => State::Rolling {
                slots: Box::new([0; SLOTS]),
                last: 0,
            },
        };
        Self {
            cap,
            state,
            changed: 0,
            passed_told: None,
        }
    }

    /// Whether the count at `unix` is above the cap for the first time in its period (each
    /// period answers `true` once).
    pub(crate) fn newly_passed(&mut self, unix: u64) -> bool {
        if self.used(unix) <= self.cap.amount.get() {
            return false;
        }
        let period = self.cap.window.period(unix);
        if self.passed_told == Some(period) {
            return false;
        }
        self.passed_told = Some(period);
        true
    }

    /// Reports each period changed since the last report, its first second since the epoch
    /// and what it holds now (a calendar day or month: its use; a rolling window: each
    /// quarter hour's), to `to`.
    pub(crate) fn report(&mut self, mut to: impl FnMut(u64, u64)) {
        if self.changed == 0 {
            return;
        }
        match &self.state {
            State::Calendar { period, used } => {
                to(self.cap.window.first_second(*period), *used);
            }
            State::Rolling { slots, last } => {
                for back in 0..SLOTS as u64 {
                    let Some(q) = last.checked_sub(back) else {
                        break;
                    };
                    let place = (q % SLOTS as u64) as usize;
                    if self.changed & (1 << place) != 0 {
                        to(q * SLOT, slots[place]);
                    }
                }
            }
        }
        self.changed = 0;
    }

    /// Counts at least `used` in the period whose first second is `since` (a count kept
    /// elsewhere, restored): raised to it, never lowered; a period that has ended is
    /// ignored. `unix` is now.
    pub(crate) fn restore(&mut self, since: u64, used: u64, unix: u64) {
        self.roll(unix);
        match &mut self.state {
            State::Calendar { period, used: own } => {
                if self.cap.window.period(since) == *period {
                    *own = (*own).max(used);
                }
            }
            State::Rolling { slots, last } => {
                let q = since / SLOT;
                if q <= *last && *last - q < SLOTS as u64 {
                    let slot = &mut slots[(q % SLOTS as u64) as usize];
                    *slot = (*slot).max(used);
                }
            }
        }
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
            State::Calendar { used, .. } => {
                *used = used.saturating_add(amount);
                self.changed |= 1;
            }
            State::Rolling { slots, last } => {
                let place = (*last % SLOTS as u64) as usize;
                slots[place] = slots[place].saturating_add(amount);
                self.changed |= 1 << place;
            }
        }
    }

    /// Takes `amount` back (a refund) at `unix`: from the current day, or from the latest
    /// quarter hours of the rolling window; never below zero. A refund that arrives after the
    /// day of its admission ended is not taken from the new day beyond what it holds.
    pub(crate) fn sub(&mut self, mut amount: u64, unix: u64) {
        self.roll(unix);
        match &mut self.state {
            State::Calendar { used, .. } => {
                *used = used.saturating_sub(amount);
                self.changed |= 1;
            }
            State::Rolling { slots, last } => {
                for back in 0..SLOTS as u64 {
                    if amount == 0 {
                        break;
                    }
                    let Some(q) = last.checked_sub(back) else {
                        break;
                    };
                    let place = (q % SLOTS as u64) as usize;
                    let taken = amount.min(slots[place]);
                    slots[place] -= taken;
                    amount -= taken;
                    if taken > 0 {
                        self.changed |= 1 << place;
                    }
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
            State::Calendar { period, used } => {
                let now = self.cap.window.period(unix);
                if now > *period {
                    (*period, *used) = (now, 0);
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

    #[test]
    fn changes_are_reported_and_restored_counts_only_raise() {
        let day = PeriodCap::new(
            Dimension::Spend,
            NonZeroU64::new(1_000).unwrap(),
            CapWindow::CalendarMonthUtc,
        );
        // 2026-12-04T20:00:00Z.
        let now = 1_796_414_400;
        let mut count = CapCount::new(day);
        count.add(300, now);
        count.sub(100, now);
        let mut seen = Vec::new();
        count.report(|since, used| seen.push((since, used)));
        // The month began 2026-12-01T00:00:00Z.
        assert_eq!(seen, [(1_796_083_200, 200)]);
        count.report(|_, _| panic!("nothing changed since"));
        count.restore(1_796_083_200, 150, now);
        assert_eq!(count.used(now), 200, "never lowered");
        count.restore(1_796_083_200, 700, now);
        assert_eq!(count.used(now), 700);
        count.restore(1_793_491_200, 5_000, now);
        assert_eq!(count.used(now), 700, "November's count is not December's");

        let mut rolling = CapCount::new(PeriodCap::new(
            Dimension::TotalTokens,
            NonZeroU64::new(1_000).unwrap(),
            CapWindow::Rolling,
        ));
        rolling.add(50, now - 1_800);
        rolling.add(70, now);
        rolling.sub(90, now);
        let mut seen = Vec::new();
        rolling.report(|since, used| seen.push((since, used)));
        assert_eq!(seen, [(now, 0), (now - 1_800, 30)]);
        let mut restored = CapCount::new(rolling.cap);
        restored.restore(now - 1_800, 30, now);
        restored.restore(now - 2 * DAY, 500, now);
        assert_eq!(restored.used(now), 30, "a quarter hour a day old is gone");
    }

    fn cap(window: CapWindow) -> CapCount {
        CapCount::new(PeriodCap::new(
            Dimension::TotalTokens,
            NonZeroU64::new(1_000).unwrap(),
            window,
        ))
    }

    #[test]
    fn a_passed_cap_is_told_once_a_period() {
        let mut count = cap(CapWindow::CalendarDayUtc);
        let noon = 20 * DAY + DAY / 2;
        count.add(1_000, noon);
        assert!(!count.newly_passed(noon), "at the cap, not over it");
        count.add(1, noon);
        assert!(count.newly_passed(noon));
        count.add(50, noon + 1);
        assert!(!count.newly_passed(noon + 1), "told once");
        count.add(1_001, noon + DAY);
        assert!(count.newly_passed(noon + DAY), "the next day is told again");
    }

    #[test]
    fn a_calendar_day_starts_again_at_midnight_utc() {
        let mut count = cap(CapWindow::CalendarDayUtc);
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
    fn a_calendar_month_starts_again_on_the_first_utc() {
        // 2026-01-31T23:59:00Z, then 2026-02-01T00:00:00Z and 2026-03-01T00:00:00Z.
        let (jan31, feb1, mar1) = (1_769_903_940, 1_769_904_000, 1_772_323_200);
        let month = CapWindow::CalendarMonthUtc;
        assert_eq!(month.resets_after(jan31), feb1);
        assert_eq!(month.resets_after(feb1), mar1);
        assert_eq!(month.started_at(feb1), feb1);
        assert_eq!(month.started_at(mar1 - 1), feb1);
        assert_eq!(
            CapWindow::CalendarDayUtc.started_at(jan31),
            jan31 - 23 * 3_600 - 59 * 60
        );
        let mut count = cap(month);
        count.add(900, jan31 - 20 * DAY);
        assert_eq!(count.fits(101, jan31), Err(900));
        assert_eq!(count.used(feb1), 0);
        count.add(1_000, feb1);
        assert_eq!(count.fits(1, mar1 - 1), Err(1_000));
        assert_eq!(count.fits(1_000, mar1), Ok(()));
    }

    #[test]
    fn months_follow_the_gregorian_calendar() {
        // Every first of the month from 1970 to 2400, by counting month lengths.
        let mut days = 0;
        for year in 1970..2400 {
            for month in 1..=12 {
                assert_eq!(days_from_civil(year, month), days, "{year}-{month}");
                assert_eq!(year_month(days), (year, month));
                let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
                let length = match month {
                    2 if leap => 29,
                    2 => 28,
                    4 | 6 | 9 | 11 => 30,
                    _ => 31,
                };
                assert_eq!(year_month(days + length - 1), (year, month));
                days += length;
            }
        }
        assert_eq!(CapWindow::CalendarDayUtc.resets_after(DAY - 1), DAY);
        assert_eq!(Utc(1_769_903_940).to_string(), "2026-01-31T23:59:00Z");
        assert_eq!(Utc(951_782_400).to_string(), "2000-02-29T00:00:00Z");
        assert_eq!(CapWindow::Rolling.resets_after(SLOT), 2 * SLOT);
    }

    #[test]
    fn a_rolling_day_forgets_each_quarter_hour_a_day_later() {
        let mut count = cap(CapWindow::Rolling);
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
