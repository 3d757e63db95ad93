//! An account's budgets and stacks: the budget of its quota or of a scope's, in memory or in
//! the replicas' store; a governed stack per API over it; with scopes, the account-wide gate
//! every scope's requests also pass.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt};
use tower_llm_quota::budget::FailurePolicy;
use tower_llm_quota::pricing::PriceTable;
use tower_llm_quota::provider::Profile;
use tower_llm_quota::stack::QuotaStack;
use tower_llm_quota::{BoxError, Budget, Quota};
use tower_llm_quota_postgres::PostgresBudget;
use tower_llm_quota_redis::RedisBudget;

use crate::config::{AccountConfig, Api, ConfigError, ProfileName};
use crate::store::Persistence;
use crate::store::caps::CapsRecord;

use crate::clients::Client;

/// Where an account's budgets are kept, and what holds while the state cannot be written.
#[derive(Debug, Clone)]
pub(crate) struct Keeping {
    /// In memory (one gateway), or in the replicas' store (Redis or Postgres).
    pub(crate) persistence: Persistence,
    /// Refuse while the store cannot answer (else admit from `1 / n` of the quota, `n` the
    /// live replicas the store last counted).
    pub(crate) fail_closed: bool,
    /// With a store: admit from leased shares renewed this often (else ask per admission).
    pub(crate) lease: Option<Duration>,
    /// With a store: how long a call to it may take.
    pub(crate) store_timeout: Duration,
    /// One gateway's caps, recorded in its SQLite state: a request they count is sent once
    /// its admission's counts are committed.
    pub(crate) caps: Option<Arc<CapsRecord>>,
}

/// A request the state could not make durable (its caps' counts not committed): refused,
/// nothing sent.
#[derive(Debug)]
pub(crate) struct StateRefused(pub(crate) crate::store::DatabaseError);

impl std::fmt::Display for StateRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the gateway's state refused the caps' counts: {}",
            self.0
        )
    }
}

impl std::error::Error for StateRefused {}

/// A governed stack over a client.
pub(crate) type Governed = tower_llm_quota::stack::QuotaService<Client>;

/// A set of buckets of an account and a governed stack per API over it.
#[derive(Debug, Clone)]
pub(crate) struct Scoped {
    /// `None` for the account's own.
    pub(super) name: Option<Arc<str>>,
    pub(super) budget: Budget,
    pub(super) stacks: Arc<[(Api, Profile, Governed)]>,
}

impl Scoped {
    /// The scope's name, `None` for the account's own budget.
    pub(crate) fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Its budget.
    pub(crate) fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Where a refusal of this scope of `account` says it applies: `account:NAME`, or
    /// `account:NAME/scope:SCOPE`.
    pub(crate) fn label(&self, account: &str) -> String {
        match &self.name {
            Some(scope) => format!("account:{account}/scope:{scope}"),
            None => format!("account:{account}"),
        }
    }

    pub(crate) fn stack(&self, api: Api) -> Option<Governed> {
        self.stacks
            .iter()
            .find(|(a, ..)| *a == api)
            .map(|(.., governed)| governed.clone())
    }
}

/// Every limit `config` gives an account and its scopes.
pub(super) fn configured(
    config: &AccountConfig,
) -> Result<Vec<tower_llm_quota::Limit>, ConfigError> {
    Ok(std::iter::once(&config.quota)
        .chain(config.scopes.iter().map(|s| &s.quota))
        .chain(&config.model_quota)
        .map(crate::config::Limits::limits)
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .flatten()
        .collect())
}

/// What a new scope of an account is made with.
#[derive(Debug, Clone)]
pub(super) struct Maker {
    pub(super) account: AccountConfig,
    /// The budget whose tenant state every scope serves.
    pub(super) tenants_of: Budget,
    pub(super) keeping: Keeping,
    /// The client under the stacks: through the gate, with scopes.
    pub(super) upstream: Upstream,
    pub(super) prices: Option<Arc<PriceTable>>,
}

impl Maker {
    /// The scope `name`'s budget (named `account/name` in the store) and stacks.
    pub(super) async fn make(&self, name: &str, quota: &Quota) -> Result<Scoped, ConfigError> {
        let full = format!("{}/{name}", self.account.name);
        let quota = quota.clone().with_name(full.as_str());
        let budget = budget(&full, &quota, &self.keeping).await?;
        let budget = budget.with_tenants_of(&self.tenants_of);
        Ok(Scoped {
            name: Some(name.into()),
            stacks: stacks(
                &self.account,
                &quota,
                (&budget, self.prices.as_ref()),
                &self.upstream,
            ),
            budget,
        })
    }
}

/// A budget of `quota`, in memory or shared through the replicas' store under `name`.
pub(super) async fn budget(
    name: &str,
    quota: &Quota,
    keeping: &Keeping,
) -> Result<Budget, ConfigError> {
    let policy = if keeping.fail_closed {
        FailurePolicy::FailClosed
    } else {
        FailurePolicy::live_share(2)
    };
    match &keeping.persistence {
        Persistence::Redis(url) => {
            let mut budget = RedisBudget::new(url, name.to_owned())
                .prefix("gateway")
                .timeout(keeping.store_timeout)
                .failure_policy(policy);
            if let Some(refresh) = keeping.lease {
                budget = budget.leased_shares(refresh);
            }
            budget
                .connect(quota)
                .await
                .map_err(|e| ConfigError(format!("account `{name}`: redis: {e}")))
        }
        Persistence::Postgres(url) => {
            let mut budget = PostgresBudget::new(url, name.to_owned())
                .prefix("gateway")
                .timeout(keeping.store_timeout)
                .failure_policy(policy);
            if let Some(refresh) = keeping.lease {
                budget = budget.leased_shares(refresh);
            }
            budget
                .connect(quota)
                .await
                .map_err(|e| ConfigError(format!("account `{name}`: {e}")))
        }
        Persistence::Memory | Persistence::Sqlite(_) => Ok(Budget::new(quota.clone())),
    }
}

/// `client`, sending a request only once the caps' counts of its admission are committed
/// (`caps`: one gateway's SQLite state); when they cannot be, refused (`fail_closed`) or sent
/// with a warning.
pub(super) fn durable(client: Client, caps: Option<Arc<CapsRecord>>, fail_closed: bool) -> Client {
    let Some(caps) = caps else {
        return client;
    };
    BoxCloneSyncService::new(tower::service_fn(move |request: Request<Full<Bytes>>| {
        let (client, caps) = (client.clone(), Arc::clone(&caps));
        async move {
            if let Err(error) = caps.durable() {
                if fail_closed {
                    return Err(Box::new(StateRefused(error)) as BoxError);
                }
                tracing::warn!(%error, "sent though the caps' counts are not durable");
            }
            client.oneshot(request).await
        }
    }))
}

/// A governed stack per API of the account over `budget`, pricing requests at `prices`.
pub(super) fn stacks(
    config: &AccountConfig,
    quota: &Quota,
    (budget, prices): (&Budget, Option<&Arc<PriceTable>>),
    upstream: &Upstream,
) -> Arc<[(Api, Profile, Governed)]> {
    let minute = config.quota.minute();
    config
        .apis
        .iter()
        .map(|&api| {
            let profile = profile(config.profile, api).windows(minute, minute);
            let mut stack = QuotaStack::for_profile(profile, quota.clone())
                .with_budget(budget.clone())
                .retry(config.tier_unavailable.retry_policy());
            if let Some(prices) = prices {
                stack = stack.prices(Arc::clone(prices));
            }
            (api, profile, stack.layer(upstream.client(profile)))
        })
        .collect()
}

/// What an account's stacks call: the client, through the gate of the account-wide budget
/// when the account has scopes.
#[derive(Debug, Clone)]
pub(super) struct Upstream {
    pub(super) client: Client,
    pub(super) gate: Option<Budget>,
}

impl Upstream {
    /// The client under a stack of `profile`: through the gate, if any, a reservation in
    /// the account-wide budget per attempt, its slot held until the answer's body ends and
    /// settled with the answer's usage (read in `profile`'s format: an account's caps of
    /// spend count what was spent). The request's tenant is not asked again (its scope's
    /// budget charged it).
    fn client(&self, profile: Profile) -> Client {
        use tower_llm_quota::{ReconcileLayer, TokenBudgetLayer};
        let Some(budget) = &self.gate else {
            return self.client.clone();
        };
        let gate = tower::ServiceBuilder::new()
            .map_request(|mut request: Request<Full<Bytes>>| {
                request
                    .extensions_mut()
                    .remove::<tower_llm_quota::tenant::Tenant>();
                request
            })
            .layer(TokenBudgetLayer::new(budget.clone()))
            .layer(ReconcileLayer::with_extractor(GateUsage(profile)))
            .service(self.client.clone());
        BoxCloneSyncService::new(
            gate.map_response(|r| r.map(|b| b.map_err(BoxError::from).boxed()))
                .map_err(BoxError::from),
        )
    }
}

/// The gate's reading of an answer's usage: as its profile writes it, without adapting the
/// gate's limits to the answer's rate-limit headers (they are the scope's, which its own
/// stack adapts).
#[derive(Debug, Clone, Copy)]
pub(super) struct GateUsage(Profile);

impl tower_llm_quota::reconcile::ExtractUsage for GateUsage {
    type Scanner = tower_llm_quota::provider::ProviderScan;

    fn start(&self, head: &http::response::Parts, _budget: &Budget) -> Self::Scanner {
        tower_llm_quota::provider::ProviderScan::of_response(self.0, head)
    }
}

pub(super) fn profile(name: ProfileName, api: Api) -> Profile {
    match (name, api) {
        (ProfileName::Openai, Api::Responses) => Profile::openai_responses(),
        (ProfileName::Openai, _) => Profile::openai(),
        (ProfileName::Anthropic, _) => Profile::anthropic(),
        (ProfileName::AzureOpenai, _) => Profile::azure_openai(),
        (ProfileName::Groq, _) => Profile::groq(),
        (ProfileName::Gemini, _) => Profile::gemini(),
        // Google sends no rate-limit headers there either: the windows are the
        // configuration's.
        (ProfileName::GeminiOpenai, _) => {
            Profile::openai_compatible(Duration::from_secs(60), Duration::from_secs(60))
        }
    }
}
