//! The shared-store suite (the one a store over a mutex passes in the core's tests) against
//! Redis: budgets asking per admission, and budgets leasing shares.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tower_llm_quota::{Budget, Quota};
use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_test_support::redis_server::RedisServer;
use tower_llm_quota_test_support::store_suite::{self, Processes};

/// Budgets on one private `redis-server`, asking per admission or leasing.
struct OverRedis {
    server: RedisServer,
    leasing: bool,
}

impl Processes for OverRedis {
    fn budget(
        &self,
        account: &str,
        quota: Quota,
    ) -> Pin<Box<dyn Future<Output = Budget> + Send + '_>> {
        let mut redis = RedisBudget::new(self.server.url(), account)
            .timeout(Duration::from_secs(1))
            .slot_lease(SLOT_LEASE);
        if self.leasing {
            redis = redis.leased_shares(Duration::from_millis(100));
        }
        Box::pin(async move { redis.connect(&quota).await.expect("connected") })
    }

    fn slot_lease(&self) -> Duration {
        SLOT_LEASE
    }
}

/// How long a process's slots outlive its last heartbeat.
const SLOT_LEASE: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_passes_the_shared_store_suite() {
    let server = RedisServer::start();
    store_suite::run(&OverRedis {
        server,
        leasing: false,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_leasing_shares_passes_the_shared_store_suite() {
    let server = RedisServer::start();
    store_suite::run(&OverRedis {
        server,
        leasing: true,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_process_s_slots_come_back_within_their_lease() {
    let server = RedisServer::start();
    store_suite::a_dead_process_s_slots_come_back_within_their_lease(&OverRedis {
        server,
        leasing: false,
    })
    .await;
}
