//! A price table from a configuration file (feature `serde`); the format is in the
//! [module docs](super#configuration-file).

use std::collections::BTreeMap;

use serde::Deserialize;
use serde::de::Error as _;

use super::{ModelPrices, Price, PriceTable, TokenPrices, Unpriced};
use crate::usage::ServiceTier;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    #[serde(default)]
    unpriced: Option<Policy>,
    #[serde(default)]
    models: BTreeMap<String, Model>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
enum Policy {
    Refuse,
    Default(Model),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Model {
    #[serde(flatten)]
    prices: Prices,
    #[serde(default)]
    tiers: BTreeMap<String, Prices>,
}

/// A tier's prices: each one left out is the standard tier's (for `input` and `output` of
/// the standard tier itself, required; the cache prices default to `input`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Prices {
    input: Option<String>,
    cache_read: Option<String>,
    cache_write: Option<String>,
    output: Option<String>,
}

fn price<E: serde::de::Error>(text: &str) -> Result<Price, E> {
    Price::per_million_usd(text).map_err(E::custom)
}

fn model<E: serde::de::Error>(name: &str, config: Model) -> Result<ModelPrices, E> {
    let required = |field: &Option<String>, what: &str| {
        field
            .as_deref()
            .ok_or_else(|| E::custom(format!("model `{name}`: `{what}` is required")))
            .and_then(price)
    };
    let input = required(&config.prices.input, "input")?;
    let or =
        |field: &Option<String>, default: Price| field.as_deref().map_or(Ok(default), price::<E>);
    let standard = TokenPrices {
        input,
        cache_read: or(&config.prices.cache_read, input)?,
        cache_write: or(&config.prices.cache_write, input)?,
        output: required(&config.prices.output, "output")?,
    };
    let mut prices = ModelPrices::new(standard);
    for (tier_name, tier) in config.tiers {
        let parsed = ServiceTier::parse(&tier_name);
        if parsed == ServiceTier::Other {
            return Err(E::custom(format!(
                "model `{name}`: unknown tier `{tier_name}` (standard, flex, priority, batch, scale)"
            )));
        }
        let tier_input = or(&tier.input, standard.input)?;
        let tier_prices = TokenPrices {
            input: tier_input,
            cache_read: or(&tier.cache_read, standard.cache_read)?,
            cache_write: or(&tier.cache_write, standard.cache_write)?,
            output: or(&tier.output, standard.output)?,
        };
        prices = if parsed == ServiceTier::Standard {
            ModelPrices {
                standard: tier_prices,
                ..prices
            }
        } else {
            prices.with_tier(parsed, tier_prices)
        };
    }
    Ok(prices)
}

impl<'de> Deserialize<'de> for PriceTable {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let config = Table::deserialize(deserializer)?;
        let unpriced = match config.unpriced {
            None | Some(Policy::Refuse) => Unpriced::Refuse,
            Some(Policy::Default(config)) => Unpriced::Default(model("(default)", config)?),
        };
        let mut table = PriceTable::new(unpriced);
        for (pattern, config) in config.models {
            if pattern.is_empty() || pattern.strip_suffix('*').unwrap_or(&pattern).contains('*') {
                return Err(D::Error::custom(format!(
                    "model `{pattern}`: a name, or a prefix with one `*` at its end"
                )));
            }
            let prices = model(&pattern, config)?;
            table = table.with_model(pattern, prices);
        }
        Ok(table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pricing::PricedTokens;

    const TABLE: &str = r#"
        unpriced = "refuse"

        [models."gpt-4o-mini"]
        input = "0.15"
        cache_read = "0.075"
        output = "0.60"
        tiers.flex = { input = "0.075", cache_read = "0.0375", output = "0.30" }

        [models."claude-sonnet-4*"]
        input = "3"
        cache_read = "0.30"
        cache_write = "3.75"
        output = "15"
        tiers.batch = { input = "1.50", output = "7.50" }
    "#;

    #[test]
    fn a_table_reads_from_toml() {
        let table: PriceTable = toml::from_str(TABLE).unwrap();
        let mini = table.prices("gpt-4o-mini").unwrap();
        assert_eq!(
            mini.tier(None).cache_write,
            mini.tier(None).input,
            "defaults to input"
        );
        assert_eq!(
            mini.tier(Some(ServiceTier::Flex))
                .cache_read
                .pico_per_token(),
            37_500
        );
        let sonnet = table.prices("claude-sonnet-4-5").unwrap();
        let batch = sonnet.tier(Some(ServiceTier::Batch));
        assert_eq!(batch.input.pico_per_token(), 1_500_000);
        // Left out of the tier: the standard tier's.
        assert_eq!(batch.cache_write.pico_per_token(), 3_750_000);
        let tokens = PricedTokens {
            input: 1_000_000,
            cache_read: 0,
            cache_write: 0,
            output: 1_000_000,
        };
        assert_eq!(
            sonnet.spend(Some(ServiceTier::Batch), tokens),
            9_000_000_000
        );
        assert!(table.prices("gpt-5").is_err());
    }

    #[test]
    fn mistakes_are_named() {
        let error = |text: &str| toml::from_str::<PriceTable>(text).unwrap_err().to_string();
        assert!(
            error(
                r#"[models.m]
            output = "1""#
            )
            .contains("`input` is required")
        );
        assert!(
            error(
                r#"[models.m]
            input = "1"
            output = "1.0000001""#
            )
            .contains("more than six decimals")
        );
        assert!(
            error(
                r#"[models.m]
            input = "1"
            output = "1"
            tiers.turbo = { input = "2" }"#
            )
            .contains("unknown tier `turbo`")
        );
        assert!(
            error(
                r#"[models."é*b"]
            input = "1"
            output = "1""#
            )
            .contains("a prefix with one `*` at its end")
        );
        let defaulted: PriceTable =
            toml::from_str(r#"unpriced = { default = { input = "1", output = "2" } }"#).unwrap();
        assert_eq!(
            defaulted
                .prices("anything")
                .unwrap()
                .tier(None)
                .output
                .pico_per_token(),
            2_000_000
        );
    }
}
