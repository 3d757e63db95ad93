//! The in-process simulator behind an account whose `base_url` is `"sim"` (the demo): the
//! account's limits, latency and faults as the configuration gives them.

use std::time::Duration;

use tower_llm_quota_sim::{Faults, SimConfig, Simulator};

use crate::config::{AccountConfig, ProfileName};

/// The simulator's own key for the gateway (the gateway's provider key in the demo).
pub(crate) const SIM_KEY: &str = "sim-gateway-key";

pub(crate) fn simulator(config: &AccountConfig) -> Simulator {
    let limits = &config.quota;
    let amount = |n: Option<std::num::NonZeroU64>| n.map_or(u64::MAX / 4, |n| n.get());
    let sim = match config.profile {
        ProfileName::Anthropic => SimConfig::anthropic(
            amount(limits.requests_per_minute),
            amount(limits.input_tokens_per_minute),
            amount(limits.output_tokens_per_minute),
        ),
        ProfileName::Gemini => SimConfig::gemini(
            amount(limits.requests_per_minute),
            amount(limits.input_tokens_per_minute.or(limits.tokens_per_minute)),
        ),
        _ => SimConfig::openai(
            amount(limits.requests_per_minute),
            amount(limits.tokens_per_minute),
        ),
    };
    let sim = match limits.requests_per_day {
        Some(day) => sim.limit(
            tower_llm_quota::Dimension::Requests,
            day.get(),
            Duration::from_secs(86_400),
        ),
        None => sim,
    };
    Simulator::new(
        sim.minute(limits.minute())
            .latency(
                Duration::from_millis(config.sim.base_ms),
                Duration::from_millis(config.sim.per_token_ms),
            )
            .faults(Faults::none().server_errors(config.sim.server_error_share))
            .default_max_tokens(config.sim.default_max_tokens)
            .max_output_tokens(config.sim.max_output_tokens)
            .key(SIM_KEY, config.name.clone()),
    )
}
