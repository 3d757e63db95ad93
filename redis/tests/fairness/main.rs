//! The fairness suite ([`fair_suite`]) on a private `redis-server`: tenants share a saturated
//! account over a fleet of real processes by their weights and guarantees, per admission and
//! leased, whatever the topology. A test binary of its own: its shares are timed, and the
//! store's other tests would share the machine with it.

use std::time::Duration;

use tower_llm_quota::Quota;
use tower_llm_quota::budget::FailurePolicy;
use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_test_support::fair_suite::{self, Connecting, FairStore};
use tower_llm_quota_test_support::redis_server::RedisServer;

struct OverRedis(RedisServer);

impl OverRedis {
    fn start() -> Self {
        Self(RedisServer::start())
    }
}

impl FairStore for OverRedis {
    fn url(&self) -> String {
        self.0.url()
    }

    fn child_test(&self) -> &'static str {
        "fair_child"
    }
}

fn connect(url: &str, key: &str, quota: &Quota, leased: bool) -> Connecting {
    let mut redis = RedisBudget::new(url, key)
        .timeout(Duration::from_millis(250))
        .failure_policy(FailurePolicy::FailClosed);
    if leased {
        redis = redis.leased_shares(fair_suite::REFRESH);
    }
    let quota = quota.clone();
    Box::pin(async move { redis.connect(&quota).await.map_err(|e| e.to_string()) })
}

tower_llm_quota_test_support::fair_tests!(OverRedis::start(), connect, cases = 2);
