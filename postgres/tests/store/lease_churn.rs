//! The fleet suite ([`fleet_suite`]) on a private Postgres cluster: a fleet on leases never
//! spends more than its account, whatever becomes of its processes (or of Postgres: restarted
//! as after a crash, refusing writes, its connections cut), counted from outside.

use std::time::Duration;

use tower_llm_quota::Quota;
use tower_llm_quota::budget::FailurePolicy;
use tower_llm_quota_postgres::PostgresBudget;
use tower_llm_quota_test_support::fleet_suite::{self, Connecting, Fleet, Spec};
use tower_llm_quota_test_support::postgres_server::PostgresServer;

/// A private cluster, migrated.
struct OverPostgres {
    server: PostgresServer,
}

impl OverPostgres {
    fn start() -> Self {
        let server = PostgresServer::start();
        let url = server.url();
        // Migrated on a runtime of its own: the callers are sync tests and async ones alike.
        std::thread::spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(tower_llm_quota_postgres::migrate(&url))
                .expect("migrated")
        })
        .join()
        .unwrap();
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

/// The entry point of the children: does nothing unless started as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_process() {
    if let Some(spec) = Spec::of_child() {
        let budget = loop {
            match leased(&spec.url, &spec.key, &spec.account.quota()).await {
                Ok(budget) => break budget,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        fleet_suite::child(budget, spec.cost).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_is_spent_once_whatever_becomes_of_its_first_holder() {
    fleet_suite::a_burst_is_spent_once_whatever_becomes_of_its_first_holder(&OverPostgres::start())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_leaving_gives_back_what_it_holds() {
    fleet_suite::a_process_leaving_gives_back_what_it_holds(&OverPostgres::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_report_counts_what_the_leases_hold_once() {
    fleet_suite::a_provider_report_counts_what_the_leases_hold_once(&OverPostgres::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overrun_is_charged_to_the_account() {
    fleet_suite::an_overrun_is_charged_to_the_account(&OverPostgres::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restarts_never_admit_beyond_the_account() {
    fleet_suite::rolling_restarts_never_admit_beyond_the_account(&OverPostgres::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_processes_share_an_account_of_four_units_in_turn() {
    fleet_suite::five_processes_share_an_account_of_four_units_in_turn(&OverPostgres::start())
        .await;
}

/// The randomized churn (see [`fleet_suite`]), Postgres restarted as after a crash twice a
/// run at most.
#[test]
fn a_churning_fleet_never_admits_beyond_the_account() {
    fleet_suite::a_churning_fleet_never_admits_beyond_the_account(&mut OverPostgres::start(), 2);
}
