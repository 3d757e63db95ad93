//! `GET /admin/report?since=...&until=...&format=json|csv&table=rows|accounts|spend`: the
//! review of a period ([`crate::report`]), a week back by default; `table=spend` is
//! the spend export (per day, tenant, key, model and tier). `since` and `until` are
//! RFC 3339 times in UTC (`2026-11-26`, `2026-11-26T09:00:00Z`) or Unix seconds; whole hours
//! are counted. A delegated admin gets its subtree's rows and no account table.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use http::StatusCode;
use serde::Deserialize;
use tower_llm_quota::tenant::Tenant;

use super::super::Gateway;
use super::super::auth::Admin;
use super::super::refusal::limit_name;
use super::super::report::{AccountLimits, Row, SpendRow};
use super::answers::error;

/// A week: the default period.
const WEEK: Duration = Duration::from_secs(7 * 86_400);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Period {
    since: Option<String>,
    until: Option<String>,
    #[serde(default)]
    format: Format,
    #[serde(default)]
    table: Table,
}

#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Format {
    #[default]
    Json,
    Csv,
}

#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Table {
    #[default]
    Rows,
    Accounts,
    Spend,
}

impl Period {
    /// The period asked for, `now` its default end and a week before it its start; why not,
    /// when it cannot be read, ends before it starts, or is longer than the counters kept.
    fn range(&self, now: SystemTime) -> Result<(SystemTime, SystemTime), String> {
        let parse = |text: &Option<String>, default: SystemTime, name: &str| match text {
            None => Ok(default),
            Some(text) => time(text).ok_or_else(|| {
                format!("`{name}`: `{text}` is neither an RFC 3339 time in UTC nor Unix seconds")
            }),
        };
        let since = parse(&self.since, now - WEEK, "since");
        let until = parse(&self.until, now, "until");
        let (since, until) = match (since, until) {
            (Ok(since), Ok(until)) if since <= until => (since, until),
            (Ok(_), Ok(_)) => {
                let reason = "`since` is after `until`";
                return Err(reason.to_owned());
            }
            (Err(reason), _) | (_, Err(reason)) => return Err(reason),
        };
        if until.duration_since(since).unwrap_or_default() > Duration::from_secs(35 * 86_400) {
            return Err("a report covers at most 35 days (the counters kept)".to_owned());
        }
        Ok((since, until))
    }
}

/// The accounts' table as CSV: a line per account and limit.
fn accounts_csv(review: &crate::report::Review) -> String {
    let mut text = String::from(
        "account,minutes_served,minutes_with_waiting,limit,capacity,used,idle,idle_share\n",
    );
    for account in &review.accounts {
        for limit in &account.limits {
            text.push_str(&format!(
                "{},{},{},{},{},{},{},{}\n",
                account.account,
                account.minutes_served,
                account.minutes_with_waiting,
                limit.limit,
                limit.capacity,
                limit.used,
                limit.idle,
                limit.idle_share
            ));
        }
    }
    text
}

pub(super) async fn report(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
    period: Result<Query<Period>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Query(period) = match period {
        Ok(period) => period,
        Err(rejection) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                rejection.body_text(),
            );
        }
    };
    let (since, until) = match period.range(SystemTime::now()) {
        Ok(range) => range,
        Err(reason) => return error(StatusCode::BAD_REQUEST, "invalid_request", reason),
    };
    let limits = admin.scope.is_none().then(|| account_limits(&gateway));
    let keep = |tenant: &str| Tenant::parse(tenant).is_ok_and(|t| admin.sees(&t));
    let review = match gateway
        .report
        .review((since, until), keep, limits.as_deref())
        .await
    {
        Ok(review) => review,
        Err(e) => {
            let reason = format!("the report's counters could not be read: {e}");
            return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", reason);
        }
    };
    match (period.format, period.table) {
        (Format::Json, _) => Json(review).into_response(),
        (Format::Csv, Table::Rows) => csv(table(
            Row::CSV_HEADER,
            review.rows.iter().map(Row::csv_line),
        )),
        (Format::Csv, Table::Spend) => csv(table(
            SpendRow::CSV_HEADER,
            review.spend.iter().map(SpendRow::csv_line),
        )),
        (Format::Csv, Table::Accounts) => csv(accounts_csv(&review)),
    }
}

fn csv(text: String) -> Response {
    (
        [(http::header::CONTENT_TYPE, "text/csv; charset=utf-8")],
        text,
    )
        .into_response()
}

/// Each account's configured limits: their names and amounts a minute.
fn account_limits(gateway: &Gateway) -> Vec<AccountLimits> {
    let config = gateway.config();
    config
        .accounts
        .iter()
        .map(|account| {
            let limits = account
                .quota
                .limits()
                .unwrap_or_default()
                .iter()
                .map(|l| {
                    let per_minute =
                        l.amount().get() as f64 * 60.0 / l.period().as_secs_f64().max(1e-9);
                    (limit_name(l.dimension().as_str(), l.period()), per_minute)
                })
                .collect();
            (account.name.clone(), limits)
        })
        .collect()
}

/// A time in UTC: Unix seconds, `YYYY-MM-DD`, or `YYYY-MM-DDTHH:MM[:SS[.fff]]` with `Z` or
/// `+00:00` (or nothing) after.
fn time(text: &str) -> Option<SystemTime> {
    if let Ok(seconds) = text.parse::<u64>() {
        return Some(UNIX_EPOCH + Duration::from_secs(seconds));
    }
    let (date, clock) = match text.split_once(['T', ' ']) {
        Some((date, clock)) => (date, Some(clock)),
        None => (text, None),
    };
    let mut parts = date.splitn(3, '-');
    let year: i64 = parts.next()?.parse().ok()?;
    let month: i64 = parts.next()?.parse().ok()?;
    let day: i64 = parts.next()?.parse().ok()?;
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || year < 1970 {
        return None;
    }
    let mut seconds = 0;
    if let Some(clock) = clock {
        let clock = clock
            .strip_suffix('Z')
            .or_else(|| clock.strip_suffix("+00:00"))
            .unwrap_or(clock);
        let clock = clock.split_once('.').map_or(clock, |(whole, _)| whole);
        let mut parts = clock.split(':');
        let hours: i64 = parts.next()?.parse().ok()?;
        let minutes: i64 = parts.next()?.parse().ok()?;
        let secs: i64 = parts.next().map_or(Some(0), |s| s.parse().ok())?;
        if parts.next().is_some() || hours > 23 || minutes > 59 || secs > 60 {
            return None;
        }
        seconds = hours * 3_600 + minutes * 60 + secs;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let total = u64::try_from(days * 86_400 + seconds).ok()?;
    Some(UNIX_EPOCH + Duration::from_secs(total))
}

/// A CSV table: `header`, then `lines`, each ended by a newline.
fn table(header: &str, lines: impl Iterator<Item = String>) -> String {
    let mut text = String::from(header);
    text.push('\n');
    for line in lines {
        text.push_str(&line);
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::rfc3339;

    #[test]
    fn times_read_as_rfc3339_or_unix_seconds() {
        let at = |text: &str| time(text).map(rfc3339);
        assert_eq!(
            at("2026-11-26").as_deref(),
            Some("2026-11-26T00:00:00.000Z")
        );
        assert_eq!(
            at("2026-11-26T09:30:00Z").as_deref(),
            Some("2026-11-26T09:30:00.000Z")
        );
        assert_eq!(
            at("2024-02-29T23:59:59.5+00:00").as_deref(),
            Some("2024-02-29T23:59:59.000Z")
        );
        assert_eq!(
            at("1796256000").as_deref(),
            Some("2026-12-03T00:00:00.000Z")
        );
        for bad in [
            "yesterday",
            "2026-13-01",
            "2026-11-26T25:00",
            "2026-11-26T09:30:00:00",
        ] {
            assert_eq!(time(bad), None, "{bad}");
        }
    }
}
