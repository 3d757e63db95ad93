//! The fleet suite ([`fleet_suite`]) on a private `redis-server`: a fleet on leases never
//! spends more than its account, whatever becomes of its processes, counted from outside.

use std::time::Duration;

use tower_llm_quota::Quota;
use tower_llm_quota::budget::FailurePolicy;
use tower_llm_quota_redis::RedisBudget;
use tower_llm_quota_test_support::fleet_suite::{self, Connecting, Fleet};
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

// Each scenario on its own server; the churn with Redis restarted from its append-only file twice a run at most.
tower_llm_quota_test_support::fleet_tests!(OverRedis::start(), leased, restarts = 2);
