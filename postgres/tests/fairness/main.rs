//! The fairness suite ([`fair_suite`]) on a database of its own: tenants share a saturated
//! account over a fleet of real processes by their weights and guarantees, per admission and
//! leased, whatever the topology. A test binary of its own: its shares are timed, and the
//! store's other tests would share the machine with it.

#[path = "../common/mod.rs"]
mod common;

use std::time::Duration;

use tower_llm_quota::Quota;
use tower_llm_quota::budget::FailurePolicy;
use tower_llm_quota_postgres::PostgresBudget;
use tower_llm_quota_test_support::fair_suite::{self, Connecting, FairStore};
use tower_llm_quota_test_support::postgres_server::TestDatabase;

struct OverPostgres(TestDatabase);

impl OverPostgres {
    fn start() -> Self {
        let database = TestDatabase::create();
        common::migrate_blocking(database.url());
        Self(database)
    }
}

impl FairStore for OverPostgres {
    fn url(&self) -> String {
        self.0.url().to_owned()
    }

    fn child_test(&self) -> &'static str {
        "fair_child"
    }

    /// Asking per admission, a quarter of the default (about 125 admissions a second): a
    /// fleet's questions on one account are serialized by its lock in Postgres (a few hundred
    /// a second on a 2-core machine, the children's debug builds beside it), and the account
    /// must bind before the database does. Leased, the default.
    fn rate(&self, mode: fair_suite::Mode) -> u64 {
        if mode == fair_suite::Mode::Leased {
            return fair_suite::RATE;
        }
        std::env::var("FAIR_RATE").map_or(fair_suite::RATE / 4, |r| r.parse().unwrap())
    }
}

fn connect(url: &str, key: &str, quota: &Quota, leased: bool) -> Connecting {
    let mut postgres = PostgresBudget::new(url, key)
        .timeout(Duration::from_millis(500))
        .failure_policy(FailurePolicy::FailClosed);
    if leased {
        postgres = postgres.leased_shares(fair_suite::REFRESH);
    }
    let quota = quota.clone();
    Box::pin(async move { postgres.connect(&quota).await.map_err(|e| e.to_string()) })
}

tower_llm_quota_test_support::fair_tests!(OverPostgres::start(), connect, cases = 2);
