//! The fleet suite ([`fleet_suite`]) on a private Postgres cluster: a fleet on leases never
//! spends more than its account, whatever becomes of its processes (or of Postgres: restarted
//! as after a crash, refusing writes, its connections cut), counted from outside.

use std::time::Duration;

use tower_llm_quota::Quota;
use tower_llm_quota::budget::FailurePolicy;
use tower_llm_quota_postgres::PostgresBudget;
use tower_llm_quota_test_support::fleet_suite::{self, Connecting, Fleet};
use tower_llm_quota_test_support::postgres_server::PostgresServer;

/// A private cluster, migrated.
struct OverPostgres {
    server: PostgresServer,
}

impl OverPostgres {
    fn start() -> Self {
        let server = PostgresServer::start();
        crate::common::migrate_blocking(&server.url());
        Self { server }
    }
}

/// Each renewal's timeout: long enough for a loaded machine's commit.
const TIMEOUT: Duration = Duration::from_millis(300);

fn leased(url: &str, key: &str, quota: &Quota) -> Connecting {
    let postgres = PostgresBudget::new(url, key)
        .timeout(TIMEOUT)
        .failure_policy(FailurePolicy::FailClosed)
        .leased_shares(fleet_suite::REFRESH);
    let quota = quota.clone();
    Box::pin(async move { postgres.connect(&quota).await.map_err(|e| e.to_string()) })
}

impl Fleet for OverPostgres {
    fn port(&self) -> u16 {
        self.server.port()
    }

    fn url_via(&self, port: u16) -> String {
        self.server.url_via(port)
    }

    fn refuse_writes(&self, refused: bool) {
        self.server.refuse_writes(refused);
    }

    fn restart(&mut self) {
        // `pg_ctl restart -m immediate`: a crash, then recovery from the write-ahead log.
        self.server.restart_immediate();
    }

    fn timeout(&self) -> Duration {
        TIMEOUT
    }

    fn leased(&self, url: &str, key: &str, quota: &Quota) -> Connecting {
        leased(url, key, quota)
    }

    fn child_test(&self) -> &'static str {
        "lease_churn::child_process"
    }
}

// Each scenario on its own server; the churn with Postgres restarted as after a crash twice a run at most.
tower_llm_quota_test_support::fleet_tests!(OverPostgres::start(), leased, restarts = 2);
