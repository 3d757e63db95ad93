//! What the Postgres store's tests share: a migrated database, and budgets over it.

use std::time::Duration;

use tower_llm_quota::{Budget, Quota};
use tower_llm_quota_postgres::PostgresBudget;
use tower_llm_quota_test_support::postgres_server::TestDatabase;

/// How long a process's slots outlive its last heartbeat.
pub(crate) const SLOT_LEASE: Duration = Duration::from_secs(1);

/// A database of its own, migrated.
pub(crate) async fn migrated() -> TestDatabase {
    let database = TestDatabase::create();
    tower_llm_quota_postgres::migrate(database.url())
        .await
        .expect("migrated");
    database
}

/// A budget over `url` for `account`, asking per admission or leasing every 100 ms, with a
/// timeout a loaded machine's commits stay within.
pub(crate) async fn budget(url: &str, account: &str, quota: &Quota, leasing: bool) -> Budget {
    let mut postgres = PostgresBudget::new(url, account)
        .timeout(Duration::from_secs(1))
        .slot_lease(SLOT_LEASE);
    if leasing {
        postgres = postgres.leased_shares(Duration::from_millis(100));
    }
    postgres.connect(quota).await.expect("connected")
}
