//! The shared-store suite (the one a store over a mutex and the Redis store pass) against
//! Postgres: budgets asking per admission, and budgets leasing shares.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tower_llm_quota::{Budget, Quota};
use tower_llm_quota_test_support::postgres_server::TestDatabase;
use tower_llm_quota_test_support::store_suite::{self, Processes};

use crate::support;

/// Budgets on one database, asking per admission or leasing.
struct OverPostgres {
    database: TestDatabase,
    leasing: bool,
}

impl Processes for OverPostgres {
    fn budget(
        &self,
        account: &str,
        quota: Quota,
    ) -> Pin<Box<dyn Future<Output = Budget> + Send + '_>> {
        let account = account.to_owned();
        Box::pin(async move {
            support::budget(self.database.url(), &account, &quota, self.leasing).await
        })
    }

    fn slot_lease(&self) -> Duration {
        support::SLOT_LEASE
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_passes_the_shared_store_suite() {
    let database = support::migrated().await;
    store_suite::run(&OverPostgres {
        database,
        leasing: false,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_leasing_shares_passes_the_shared_store_suite() {
    let database = support::migrated().await;
    store_suite::run(&OverPostgres {
        database,
        leasing: true,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_s_controls_hold_over_every_process() {
    let database = support::migrated().await;
    store_suite::run_controls(&OverPostgres {
        database,
        leasing: false,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_s_controls_hold_over_every_leasing_process() {
    let database = support::migrated().await;
    store_suite::run_controls(&OverPostgres {
        database,
        leasing: true,
    })
    .await;
}
