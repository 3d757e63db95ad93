//! Prices: what a request costs in money, in exact integers.
//!
//! A [`PriceTable`] holds, per model (a name, or a prefix ending in `*`), the price of input,
//! cached input read, cache writes and output tokens per million, per service tier where the
//! provider prices tiers apart (OpenAI's flex and priority, Anthropic's batch, Gemini's
//! tiers). Spend is counted in **nano-dollars** (10⁻⁹ USD) as a `u64` (at most about 18.4
//! billion dollars); a price is kept per token in pico-dollars (10⁻¹² USD), so that any price
//! written with up to six decimals per million tokens is exact (`$0.0375` per million is 37,500
//! pico-dollars a token). A request's spend is the sum over its kinds of tokens, rounded up to
//! the nano-dollar once.
//!
//! No price ships with the crate: prices change, differ per contract, and a price shipped as
//! a fact would be wrong somewhere. They are entered by the user, in code or, with the `serde`
//! feature, from a file.
//!
//! ```
//! use tower_llm_quota::pricing::{ModelPrices, PriceTable, PricedTokens, TokenPrices, Unpriced};
//! use tower_llm_quota::usage::ServiceTier;
//!
//! // $2.50 per million input tokens, $1.25 cached, $10 output; flex at half.
//! let standard = TokenPrices::per_million_usd("2.50", "1.25", "2.50", "10")?;
//! let flex = TokenPrices::per_million_usd("1.25", "0.625", "1.25", "5")?;
//! let table = PriceTable::new(Unpriced::Refuse)
//!     .with_model("gpt-4o*", ModelPrices::new(standard).with_tier(ServiceTier::Flex, flex));
//!
//! let prices = table.prices("gpt-4o-2024-08-06")?;
//! let tokens = PricedTokens { input: 1_000, cache_read: 0, cache_write: 0, output: 200 };
//! // 1,000 × $2.50/M + 200 × $10/M = $0.0045.
//! assert_eq!(prices.spend(Some(ServiceTier::Standard), tokens), 4_500_000);
//! assert_eq!(prices.spend(Some(ServiceTier::Flex), tokens), 2_250_000);
//! assert!(table.prices("claude-opus-4-1").is_err());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Configuration file
//!
//! With the `serde` feature, [`PriceTable`] implements `Deserialize`. Prices are US dollars
//! per million tokens, written as strings (`"2.50"`: a decimal read exactly, where a float
//! would not be); `cache_read` and `cache_write` default to `input`. A tier named apart
//! (`standard`, `flex`, `priority`, `batch`, `scale`) gives the prices it changes, the others
//! its model's standard ones. A model is named exactly, or by a prefix ending in `*`.
//! `unpriced` says what a model no entry names costs: `"refuse"` (the default), or
//! `{ default = { input = "...", output = "..." } }`.
//!
//! ```toml
//! unpriced = "refuse"
//!
//! [models."gpt-4o-mini"]
//! input = "0.15"
//! cache_read = "0.075"
//! output = "0.60"
//! tiers.flex = { input = "0.075", cache_read = "0.0375", output = "0.30" }
//!
//! [models."claude-sonnet-4*"]
//! input = "3"
//! cache_read = "0.30"
//! cache_write = "3.75"
//! output = "15"
//! tiers.batch = { input = "1.50", cache_read = "0.15", cache_write = "1.875", output = "7.50" }
//! ```
//!
//! (Figures for the format's sake: enter your own.)
//!
//! # Spend as a quota dimension
//!
//! [`EstimateLayer::prices`](crate::EstimateLayer::prices) prices each request: its
//! [`Cost`] gains the spend of its estimate ([`Dimension::Spend`](crate::Dimension::Spend)),
//! and its extensions a [`Priced`], which the [`TokenBudget`](crate::token_budget::TokenBudget)
//! hands to the reservation, so that settling with the real [`Usage`] charges the spend of the
//! tokens really used, at the tier that served them, cache reads and writes at their own
//! prices. Limits of spend are limits like the others: a [`Limit`](crate::Limit) of
//! `Dimension::Spend` over any period on an account or a tenant node, and a
//! [`PeriodCap`](crate::tenant::PeriodCap) over a calendar day or month on a tenant node;
//! with Redis, reserved in the same scripts and leases as tokens.
//!
//! ```
//! use std::num::NonZeroU64;
//! use std::sync::Arc;
//! use tower_llm_quota::pricing::{ModelPrices, PriceTable, TokenPrices, Unpriced};
//! use tower_llm_quota::provider::Profile;
//! use tower_llm_quota::{Dimension, EstimateLayer, Limit, Quota};
//!
//! let table = PriceTable::new(Unpriced::Refuse).with_model(
//!     "gpt-4o-mini*",
//!     ModelPrices::new(TokenPrices::per_million_usd("0.15", "0.075", "0.15", "0.60")?),
//! );
//! let counting = Profile::openai().cache_counting();
//! let estimate = EstimateLayer::new().prices(Arc::new(table), counting);
//! // At most $5 an hour, as a bucket ($5 at once, refilled over the hour).
//! let five_dollars = NonZeroU64::new(5_000_000_000).unwrap();
//! let hour = std::time::Duration::from_secs(3_600);
//! let quota = Quota::new().with_limit(
//!     Limit::new(Dimension::Spend, five_dollars, hour)?.with_burst(five_dollars),
//! );
//! # let _ = (estimate, quota);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#[cfg(feature = "serde")]
mod serde;

use std::fmt;
use std::sync::Arc;

use crate::cost::{Cost, Usage};
use crate::usage::ServiceTier;

/// Pico-dollars (10⁻¹² USD) in a nano-dollar.
const PICO_PER_NANO: u128 = 1_000;

/// The price of one kind of token: pico-dollars (10⁻¹² USD) a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Price(u64);

impl Price {
    /// A price of `pico` pico-dollars (10⁻¹² USD) a token.
    pub const fn from_pico_per_token(pico: u64) -> Self {
        Self(pico)
    }

    /// A price in US dollars per million tokens, written as a decimal (`"2.50"`, `"0.0375"`,
    /// `"15"`): exact up to six decimals.
    ///
    /// # Errors
    ///
    /// [`InvalidPrice`] for text that is not a non-negative decimal, one with more than six
    /// decimals (it would not be exact), or a price above about 18 million dollars per million
    /// tokens.
    pub fn per_million_usd(text: &str) -> Result<Self, InvalidPrice> {
        // Dollars per million tokens × 10⁶ = pico-dollars a token.
        let exact = Exact {
            decimals: 6,
            unit: "dollars per million tokens",
            inexact: "more than six decimals: not exact in pico-dollars a token",
        };
        exact.read(text.trim()).map(Self)
    }

    /// Pico-dollars (10⁻¹² USD) a token.
    pub const fn pico_per_token(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Price {
    /// Dollars per million tokens: `$2.5/M`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (whole, fraction) = (self.0 / 1_000_000, self.0 % 1_000_000);
        if fraction == 0 {
            write!(f, "${whole}/M")
        } else {
            let fraction = format!("{fraction:06}");
            write!(f, "${whole}.{}/M", fraction.trim_end_matches('0'))
        }
    }
}

/// An amount of US dollars, kept as nano-dollars (10⁻⁹ USD, the unit of
/// [`Dimension::Spend`](crate::Dimension::Spend)): read from and shown as a decimal
/// (`"500.00"`), exactly.
///
/// ```
/// use tower_llm_quota::pricing::Usd;
///
/// let cap = Usd::parse("500.00")?;
/// assert_eq!(cap.nanos(), 500_000_000_000);
/// assert_eq!(Usd::from_nanos(371_500_000).to_string(), "$0.3715");
/// assert_eq!(Usd::from_nanos(370_000_000).to_string(), "$0.37");
/// assert_eq!(Usd::from_nanos(500_000_000_000).decimal(), "500.00");
/// # Ok::<(), tower_llm_quota::pricing::InvalidPrice>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Usd(u64);

impl Usd {
    /// `nanos` nano-dollars.
    pub const fn from_nanos(nanos: u64) -> Self {
        Self(nanos)
    }

    /// Nano-dollars (10⁻⁹ USD).
    pub const fn nanos(self) -> u64 {
        self.0
    }

    /// Dollars written as a decimal (`"500"`, `"0.37"`, `"0.000000001"`): exact up to nine
    /// decimals.
    ///
    /// # Errors
    ///
    /// [`InvalidPrice`] for text that is not a non-negative decimal, one with more than nine
    /// decimals, or an amount above about 18 billion dollars.
    pub fn parse(text: &str) -> Result<Self, InvalidPrice> {
        let exact = Exact {
            decimals: 9,
            unit: "dollars",
            inexact: "more than nine decimals: not exact in nano-dollars",
        };
        exact.read(text.trim().trim_start_matches('$')).map(Self)
    }

    /// The amount as a decimal without the sign: at least two decimals, and as many more as
    /// it needs to be exact (`"500.00"`, `"0.3715"`).
    pub fn decimal(self) -> String {
        let (whole, fraction) = (self.0 / 1_000_000_000, self.0 % 1_000_000_000);
        let fraction = format!("{fraction:09}");
        let kept = fraction.trim_end_matches('0');
        let kept = if kept.len() < 2 { &fraction[..2] } else { kept };
        format!("{whole}.{kept}")
    }
}

impl fmt::Display for Usd {
    /// `$500.00`, `$0.3715`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "${}", self.decimal())
    }
}

/// A non-negative decimal read exactly as an integer of `decimals` decimals.
struct Exact {
    decimals: usize,
    /// What the text is read as, for the error.
    unit: &'static str,
    /// Why a text with more decimals is refused.
    inexact: &'static str,
}

impl Exact {
    fn read(&self, text: &str) -> Result<u64, InvalidPrice> {
        let invalid = |why: &'static str| InvalidPrice {
            text: text.to_owned(),
            unit: self.unit,
            why,
        };
        let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
        let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if (whole.is_empty() && fraction.is_empty()) || !digits(whole) || !digits(fraction) {
            return Err(invalid("not a non-negative decimal number of dollars"));
        }
        if fraction.len() > self.decimals {
            return Err(invalid(self.inexact));
        }
        let whole: u64 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| invalid("too large"))?
        };
        let fraction: u64 = format!("{fraction:0<width$}", width = self.decimals)
            .parse()
            .map_err(|_| invalid("not a decimal"))?;
        whole
            .checked_mul(10u64.pow(self.decimals as u32))
            .and_then(|w| w.checked_add(fraction))
            .ok_or_else(|| invalid("too large"))
    }
}

/// A price that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidPrice {
    text: String,
    /// What the text was read as: `dollars per million tokens`, `dollars`.
    unit: &'static str,
    why: &'static str,
}

impl fmt::Display for InvalidPrice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid price `{}` ({}): {}",
            self.text, self.unit, self.why
        )
    }
}

impl std::error::Error for InvalidPrice {}

/// Tokens of a request by the kind each is priced as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PricedTokens {
    /// Input tokens neither read from nor written to the prompt cache.
    pub input: u64,
    /// Input tokens read from the prompt cache.
    pub cache_read: u64,
    /// Input tokens written to the prompt cache.
    pub cache_write: u64,
    /// Output tokens (reasoning tokens included).
    pub output: u64,
}

impl PricedTokens {
    /// The tokens of `usage`, whose input count holds the cache tokens `counting` says (as
    /// its profile built it, [`Profile::cache_counting`](crate::provider::Profile::cache_counting):
    /// OpenAI's prompt count includes cached tokens; Anthropic's excludes the cache, the
    /// profile adding the writes, and the reads when they count), taken apart again.
    pub fn of(usage: &Usage, counting: CacheCounting) -> Self {
        let (read, write) = (usage.cache_read_tokens(), usage.cache_write_tokens());
        let counted_reads = if counting.reads { read } else { 0 };
        let counted_writes = if counting.writes { write } else { 0 };
        Self {
            input: usage
                .input_tokens()
                .saturating_sub(counted_reads)
                .saturating_sub(counted_writes),
            cache_read: read,
            cache_write: write,
            output: usage.output_tokens(),
        }
    }

    /// The tokens of an estimate: its input priced as uncached input (how much the cache will
    /// serve is not known before the answer), its output at what it reserves.
    pub const fn of_estimate(cost: &Cost) -> Self {
        Self {
            input: cost.input_tokens(),
            cache_read: 0,
            cache_write: 0,
            output: cost.output_tokens(),
        }
    }
}

/// Which cache tokens the input count of a [`Usage`] holds, as the provider profile that
/// built it says ([`Profile::cache_counting`](crate::provider::Profile::cache_counting)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CacheCounting {
    reads: bool,
    writes: bool,
}

impl CacheCounting {
    /// Input counts that hold the cache reads (`reads`) and the cache writes (`writes`).
    pub const fn new(reads: bool, writes: bool) -> Self {
        Self { reads, writes }
    }
}

/// The prices of one tier of a model: input, cached input read, cache writes and output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TokenPrices {
    /// Uncached input.
    pub input: Price,
    /// Input read from the prompt cache.
    pub cache_read: Price,
    /// Input written to the prompt cache.
    pub cache_write: Price,
    /// Output.
    pub output: Price,
}

impl TokenPrices {
    /// Prices in US dollars per million tokens, as decimals: input, cached input read, cache
    /// writes, output.
    ///
    /// # Errors
    ///
    /// As [`Price::per_million_usd`].
    pub fn per_million_usd(
        input: &str,
        cache_read: &str,
        cache_write: &str,
        output: &str,
    ) -> Result<Self, InvalidPrice> {
        Ok(Self {
            input: Price::per_million_usd(input)?,
            cache_read: Price::per_million_usd(cache_read)?,
            cache_write: Price::per_million_usd(cache_write)?,
            output: Price::per_million_usd(output)?,
        })
    }

    /// The spend of `tokens` in nano-dollars, rounded up once (saturating at `u64::MAX`).
    pub fn spend(&self, tokens: PricedTokens) -> u64 {
        let pico = |n: u64, price: Price| u128::from(n) * u128::from(price.0);
        let total = pico(tokens.input, self.input)
            + pico(tokens.cache_read, self.cache_read)
            + pico(tokens.cache_write, self.cache_write)
            + pico(tokens.output, self.output);
        u64::try_from(total.div_ceil(PICO_PER_NANO)).unwrap_or(u64::MAX)
    }

    /// The spend of an estimate in nano-dollars: its input at the dearest of the input prices
    /// (uncached, or a cache write, which some providers charge above it), its output at the
    /// output price; a reservation never below what the answer can cost for its tokens.
    pub fn estimated_spend(&self, cost: &Cost) -> u64 {
        let dearest = TokenPrices {
            input: self.input.max(self.cache_write).max(self.cache_read),
            ..*self
        };
        dearest.spend(PricedTokens::of_estimate(cost))
    }
}

/// A model's prices: its standard tier's, and those of the tiers priced apart.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModelPrices {
    standard: TokenPrices,
    tiers: Vec<(ServiceTier, TokenPrices)>,
}

impl ModelPrices {
    /// Prices of the standard tier; every other tier costs the same until
    /// [`with_tier`](Self::with_tier) prices it apart.
    pub fn new(standard: TokenPrices) -> Self {
        Self {
            standard,
            tiers: Vec::new(),
        }
    }

    /// Prices `tier` apart (replacing an earlier price of it).
    pub fn with_tier(mut self, tier: ServiceTier, prices: TokenPrices) -> Self {
        self.tiers.retain(|(t, _)| *t != tier);
        self.tiers.push((tier, prices));
        self
    }

    /// The prices of `tier`: its own, else the standard tier's (for a tier not priced apart,
    /// or none said).
    pub fn tier(&self, tier: Option<ServiceTier>) -> &TokenPrices {
        tier.and_then(|tier| self.tiers.iter().find(|(t, _)| *t == tier))
            .map_or(&self.standard, |(_, prices)| prices)
    }

    /// The spend of `tokens` at `tier`, in nano-dollars.
    pub fn spend(&self, tier: Option<ServiceTier>, tokens: PricedTokens) -> u64 {
        self.tier(tier).spend(tokens)
    }

    /// The spend to reserve for `cost` before a call that asks for `tier`: the dearest the
    /// answer can cost, since the provider may serve it at another tier than asked (a flex
    /// request served at the standard tier): the dearest of the asked tier and the standard.
    pub fn estimated_spend(&self, tier: Option<ServiceTier>, cost: &Cost) -> u64 {
        let asked = self.tier(tier).estimated_spend(cost);
        asked.max(self.standard.estimated_spend(cost))
    }
}

/// The value of `model` in `entries` keyed by patterns: its exact name's, else its longest
/// matching prefix's (a pattern ending in `*`).
pub(crate) fn by_model<'a, T>(entries: &'a [(String, T)], model: &str) -> Option<&'a T> {
    let exact = entries.iter().find(|(p, _)| p == model);
    let prefix = || {
        entries
            .iter()
            .filter_map(|(p, value)| {
                let prefix = p.strip_suffix('*')?;
                model.starts_with(prefix).then_some((prefix.len(), value))
            })
            .max_by_key(|(len, _)| *len)
            .map(|(_, value)| value)
    };
    exact.map(|(_, value)| value).or_else(prefix)
}

/// What a [`PriceTable`] does for a model it has no price for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Unpriced {
    /// Refuse it: [`PriceTable::prices`] fails (a spend limit cannot be kept for it).
    Refuse,
    /// Price it at these prices.
    Default(ModelPrices),
}

/// Prices per model: exact names, and prefixes ending in `*` (the longest match wins).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PriceTable {
    models: Vec<(String, Arc<ModelPrices>)>,
    /// The prices of a model no entry names, unless refused.
    default: Option<Arc<ModelPrices>>,
}

impl PriceTable {
    /// An empty table with its policy for a model it has no price for.
    pub fn new(unpriced: Unpriced) -> Self {
        Self {
            models: Vec::new(),
            default: match unpriced {
                Unpriced::Refuse => None,
                Unpriced::Default(prices) => Some(Arc::new(prices)),
            },
        }
    }

    /// Prices `pattern`: a model's name (`gpt-4o-mini`), or a prefix ending in `*`
    /// (`claude-opus-4*`). A later entry of the same pattern replaces an earlier one.
    pub fn with_model(mut self, pattern: impl Into<String>, prices: ModelPrices) -> Self {
        let pattern = pattern.into();
        self.models.retain(|(p, _)| *p != pattern);
        self.models.push((pattern, Arc::new(prices)));
        self
    }

    /// The prices of `model`: its exact name's, else its longest matching prefix's, else the
    /// default.
    ///
    /// # Errors
    ///
    /// [`NoPrice`] for a model nothing prices under [`Unpriced::Refuse`].
    pub fn prices(&self, model: &str) -> Result<&ModelPrices, NoPrice> {
        self.shared(model).map(|prices| &**prices)
    }

    /// [`prices`](Self::prices), shared (what a [`Priced`] holds).
    fn shared(&self, model: &str) -> Result<&Arc<ModelPrices>, NoPrice> {
        by_model(&self.models, model)
            .or(self.default.as_ref())
            .ok_or_else(|| NoPrice {
                model: model.to_owned(),
            })
    }

    /// The prices a request for `model` at `tier` is reserved and settled at, its usage's
    /// input count holding the cache tokens `counting` says.
    ///
    /// # Errors
    ///
    /// [`NoPrice`] for a model nothing prices under [`Unpriced::Refuse`].
    pub fn priced(
        &self,
        model: &str,
        tier: Option<ServiceTier>,
        counting: CacheCounting,
    ) -> Result<Priced, NoPrice> {
        Ok(Priced {
            prices: Arc::clone(self.shared(model)?),
            tier,
            counting,
        })
    }
}

/// The prices one request is reserved and settled at: its model's, the tier it asked for, and
/// how its provider counts the cache in a [`Usage`].
///
/// The [`EstimateLayer`](crate::EstimateLayer) puts one in the extensions of each request it
/// prices; the [`TokenBudget`](crate::token_budget::TokenBudget) gives it to the request's
/// [`Reservation`](crate::Reservation) ([`Reservation::set_priced`](crate::Reservation::set_priced)),
/// which settles the spend of the real usage with it, and puts it in the extensions of the
/// response, so that whoever reads the usage there (an audit log, a spend export) counts
/// the spend the budget settled: [`spend`](Self::spend) of the same usage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Priced {
    prices: Arc<ModelPrices>,
    tier: Option<ServiceTier>,
    counting: CacheCounting,
}

impl Priced {
    /// The spend to reserve for `cost` (see [`ModelPrices::estimated_spend`]).
    pub fn estimate(&self, cost: &Cost) -> u64 {
        self.prices.estimated_spend(self.tier, cost)
    }

    /// The spend of `usage`: what it records ([`Usage::with_spend`]), else its tokens at the
    /// prices of the tier that served it (the asked tier when the provider did not say).
    pub fn spend(&self, usage: &Usage) -> u64 {
        usage.spend().unwrap_or_else(|| {
            let tier = usage.service_tier().or(self.tier);
            (self.prices).spend(tier, PricedTokens::of(usage, self.counting))
        })
    }

    /// The tier asked for, if the request named one.
    pub fn tier(&self) -> Option<ServiceTier> {
        self.tier
    }

    /// The tokens of `usage` by the kind each is priced as.
    pub fn tokens(&self, usage: &Usage) -> PricedTokens {
        PricedTokens::of(usage, self.counting)
    }
}

/// A model the price table has no price for, under [`Unpriced::Refuse`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoPrice {
    model: String,
}

impl NoPrice {
    /// The model.
    pub fn model(&self) -> &str {
        &self.model
    }
}

impl fmt::Display for NoPrice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no price for model `{}`", self.model)
    }
}

impl std::error::Error for NoPrice {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_read_exactly_up_to_six_decimals() {
        let pico = |text| Price::per_million_usd(text).map(Price::pico_per_token);
        assert_eq!(pico("2.50"), Ok(2_500_000));
        assert_eq!(pico("0.0375"), Ok(37_500));
        assert_eq!(pico("15"), Ok(15_000_000));
        assert_eq!(pico(".5"), Ok(500_000));
        assert_eq!(pico("0.000001"), Ok(1));
        assert_eq!(pico("0"), Ok(0));
        for bad in [
            "",
            ".",
            "-1",
            "1e3",
            "$2",
            "0.0000001",
            "2.5.0",
            "99999999999999999999",
        ] {
            assert!(pico(bad).is_err(), "{bad}");
        }
        assert_eq!(
            Price::per_million_usd("0.0375").unwrap().to_string(),
            "$0.0375/M"
        );
        assert_eq!(Price::per_million_usd("15").unwrap().to_string(), "$15/M");
    }

    #[test]
    fn spend_is_exact_and_rounded_up_once() {
        let prices = TokenPrices::per_million_usd("3", "0.3", "3.75", "15").unwrap();
        let tokens = PricedTokens {
            input: 1_000,
            cache_read: 10_000,
            cache_write: 2_000,
            output: 500,
        };
        // 3,000,000 + 3,000,000 + 7,500,000 + 7,500,000 nano-dollars.
        assert_eq!(prices.spend(tokens), 21_000_000);
        // One token at $0.0375/M: 37.5 nano-dollars, rounded up to 38; three: 112.5 -> 113
        // (rounded once, not 3 × 38).
        let cheap = TokenPrices::per_million_usd("0.0375", "0", "0", "0").unwrap();
        let one = PricedTokens {
            input: 1,
            ..PricedTokens::default()
        };
        let three = PricedTokens {
            input: 3,
            ..PricedTokens::default()
        };
        assert_eq!((cheap.spend(one), cheap.spend(three)), (38, 113));
        // Saturates instead of wrapping.
        let dear = TokenPrices::per_million_usd("1000000", "0", "0", "0").unwrap();
        let many = PricedTokens {
            input: u64::MAX,
            ..PricedTokens::default()
        };
        assert_eq!(dear.spend(many), u64::MAX);
    }

    #[test]
    fn an_estimate_is_never_below_what_its_tokens_can_cost() {
        // Anthropic-like: cache writes dearer than input.
        let prices = TokenPrices::per_million_usd("3", "0.3", "3.75", "15").unwrap();
        let model = ModelPrices::new(prices).with_tier(
            ServiceTier::Flex,
            TokenPrices::per_million_usd("1.5", "0.15", "1.875", "7.5").unwrap(),
        );
        let cost = Cost::new(1_000, 100);
        // Input at the cache-write price: 3,750,000 + 1,500,000.
        assert_eq!(prices.estimated_spend(&cost), 5_250_000);
        // Any split of those 1,000 input tokens and up to 100 output costs no more.
        for written in [0, 400, 1_000] {
            for read in [0, 1_000 - written] {
                let used = PricedTokens {
                    input: 1_000 - written - read,
                    cache_read: read,
                    cache_write: written,
                    output: 100,
                };
                assert!(prices.spend(used) <= prices.estimated_spend(&cost));
            }
        }
        // Flex asked: reserved at the standard tier's (it may serve there).
        assert_eq!(
            model.estimated_spend(Some(ServiceTier::Flex), &cost),
            model.estimated_spend(None, &cost)
        );
        assert_eq!(
            model.spend(Some(ServiceTier::Flex), PricedTokens::of_estimate(&cost)),
            2_250_000
        );
        // A tier not priced apart costs the standard's.
        assert_eq!(model.tier(Some(ServiceTier::Priority)), &prices);
    }

    #[test]
    fn a_usage_is_taken_apart_as_its_profile_built_it() {
        use crate::provider::Profile;
        use crate::usage::RawUsage;
        let raw = |input, read, write| RawUsage {
            input: Some(input),
            cache_read: Some(read),
            cache_write: Some(write),
            output: Some(50),
            ..RawUsage::default()
        };
        let parts = |profile: Profile, raw: RawUsage| {
            let usage = profile.usage(&raw).unwrap();
            PricedTokens::of(&usage, profile.cache_counting())
        };
        let expected = |input, cache_read, cache_write| PricedTokens {
            input,
            cache_read,
            cache_write,
            output: 50,
        };
        // OpenAI: a prompt of 1,000 of which 600 cached, reads counted or not.
        let openai = Profile::openai();
        assert_eq!(parts(openai, raw(1_000, 600, 0)), expected(400, 600, 0));
        assert_eq!(
            parts(openai.cache_reads_count(false), raw(1_000, 600, 0)),
            expected(400, 600, 0)
        );
        // Anthropic: 400 uncached, 600 read, 200 written, reads counted or not.
        let anthropic = Profile::anthropic();
        assert_eq!(
            parts(anthropic, raw(400, 600, 200)),
            expected(400, 600, 200)
        );
        let counted = anthropic.cache_reads_count(true);
        assert_eq!(parts(counted, raw(400, 600, 200)), expected(400, 600, 200));
    }

    #[test]
    fn the_longest_prefix_wins_and_the_policy_decides_the_rest() {
        let at = |dollars: &str| {
            ModelPrices::new(TokenPrices::per_million_usd(dollars, "0", "0", dollars).unwrap())
        };
        let table = PriceTable::new(Unpriced::Refuse)
            .with_model("claude-*", at("1"))
            .with_model("claude-opus-4*", at("15"))
            .with_model("claude-opus-4-1", at("20"));
        let input = |model: &str| {
            table
                .prices(model)
                .map(|p| p.tier(None).input.pico_per_token())
        };
        assert_eq!(input("claude-opus-4-1"), Ok(20_000_000));
        assert_eq!(input("claude-opus-4-5"), Ok(15_000_000));
        assert_eq!(input("claude-sonnet-4-5"), Ok(1_000_000));
        assert_eq!(input("gpt-4o").unwrap_err().model(), "gpt-4o");
        let fallback = table.clone();
        let fallback = PriceTable {
            default: Some(Arc::new(at("99"))),
            ..fallback
        };
        assert_eq!(
            fallback
                .prices("gpt-4o")
                .map(|p| p.tier(None).input.pico_per_token()),
            Ok(99_000_000)
        );
    }
}
