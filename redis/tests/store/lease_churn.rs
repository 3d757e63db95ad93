//! The fleet suite ([`fleet_suite`]) on a private `redis-server`: a fleet on leases never
//! spends more than its account, whatever becomes of its processes, counted from outside.

use std::time::Duration;

use tower_llm_quota::Quota;
use tower_llm_quota::budget::FailurePolicy;
use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_test_support::fleet_suite::{self, Connecting, Fleet, Spec};
use tower_llm_quota_test_support::redis_server::RedisServer;

/// A private `redis-server` keeping an append-only file (a restart finds what it
/// acknowledged).
struct OverRedis {
    server: RedisServer,
}

impl OverRedis {
    fn start() -> Self {
        Self {
            server: RedisServer::start_persistent(),
        }
    }
}

/// Each renewal's timeout: long enough for a loaded machine's round trip to Redis.
const TIMEOUT: Duration = Duration::from_millis(150);

fn leased(url: &str, key: &str, quota: &Quota) -> Connecting {
    let redis = RedisBudget::new(url, key)
        .timeout(TIMEOUT)
        .failure_policy(FailurePolicy::FailClosed)
        .leased_shares(fleet_suite::REFRESH);
    let quota = quota.clone();
    Box::pin(async move { redis.connect(&quota).await.map_err(|e| e.to_string()) })
}

impl Fleet for OverRedis {
    fn port(&self) -> u16 {
        self.server.port()
    }

    fn url_via(&self, port: u16) -> String {
        format!("redis://127.0.0.1:{port}")
    }

    fn refuse_writes(&self, refused: bool) {
        if refused {
            self.server
                .command("CONFIG SET maxmemory-policy noeviction");
            self.server.command("CONFIG SET maxmemory 1");
        } else {
            self.server.command("CONFIG SET maxmemory 0");
        }
    }

    fn restart(&mut self) {
        // SIGKILL, then a start from its append-only file.
        self.server.restart();
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
    fleet_suite::a_burst_is_spent_once_whatever_becomes_of_its_first_holder(&OverRedis::start())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_leaving_gives_back_what_it_holds() {
    fleet_suite::a_process_leaving_gives_back_what_it_holds(&OverRedis::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_report_counts_what_the_leases_hold_once() {
    fleet_suite::a_provider_report_counts_what_the_leases_hold_once(&OverRedis::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overrun_is_charged_to_the_account() {
    fleet_suite::an_overrun_is_charged_to_the_account(&OverRedis::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restarts_never_admit_beyond_the_account() {
    fleet_suite::rolling_restarts_never_admit_beyond_the_account(&OverRedis::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_processes_share_an_account_of_four_units_in_turn() {
    fleet_suite::five_processes_share_an_account_of_four_units_in_turn(&OverRedis::start()).await;
}

/// The randomized churn (see [`fleet_suite`]), Redis restarted twice a run at most.
#[test]
fn a_churning_fleet_never_admits_beyond_the_account() {
    fleet_suite::a_churning_fleet_never_admits_beyond_the_account(&mut OverRedis::start(), 2);
}
