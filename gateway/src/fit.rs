//! Hard caps kept whatever the request: under a hard cap of spend, output or total tokens
//! (on the request's tenant, key or account), every request has an output bound that its
//! reservation covers, lowered to what the caps have left.
//!
//! - A request that sets no bound reserves its model's largest output (the built-in table of
//!   the providers' limits, and `[output.largest]`); for a model the table does not know, a
//!   bound of `[output] unknown_model_tokens` is written into it.
//! - A request a hard cap refuses (it has less left than the request's reservation) is sent
//!   again with its bound lowered to what is left, if that is at least `[output] min_tokens`;
//!   below, it is refused with the cap's reason.
//! - The answer says what was done in `x-llm-quota-output-bound`.
//!
//! A soft cap (`enforce = "soft"`) takes no part: it refuses once spent, and answers longer
//! than their reservation may pass it (logged).

use std::sync::Arc;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::Value;
use tower_llm_quota::estimate::{Defaults, LargestOutput, RequestEstimate};
use tower_llm_quota::pricing::PriceTable;
use tower_llm_quota::tenant::PeriodCap;
use tower_llm_quota::{Cost, Dimension};

use super::config::{Api, Config, OutputConfig};

/// The header that says what was done to a request's output bound.
pub(crate) const HEADER: &str = "x-llm-quota-output-bound";

/// How requests are bounded under hard caps.
#[derive(Debug)]
pub(crate) struct Fitting {
    /// Whether a node or template of the tenant tree has a hard cap (else only the accounts'
    /// own caps are looked at): replaced by a reload.
    tree_hard: std::sync::atomic::AtomicBool,
    largest: LargestOutput,
    min_tokens: u64,
    unknown_model_tokens: u64,
    prices: Option<Arc<PriceTable>>,
}

/// What was done to a request's output bound (per choice).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Shaped {
    /// Written into a request that set none, for a model of no known largest output.
    Written(u64),
    /// Lowered to what the cap named has left.
    Lowered {
        to: u64,
        /// The cap, as refusals name it (`spend_per_month`).
        limit: String,
        /// Whose cap (`tenant:team/key`, `account:openai`).
        scope: String,
    },
}

impl Shaped {
    /// The header's value: `4096; written`, or `120; lowered; limit=spend_per_month;
    /// scope=tenant:team/key`.
    pub(crate) fn header(&self) -> String {
        match self {
            Shaped::Written(tokens) => format!("{tokens}; written"),
            Shaped::Lowered { to, limit, scope } => {
                format!("{to}; lowered; limit={limit}; scope={scope}")
            }
        }
    }
}

/// Whether one of `caps` is hard and of a dimension an output bound keeps.
pub(crate) fn any_hard(caps: &[PeriodCap]) -> bool {
    caps.iter()
        .any(|cap| !cap.is_soft() && bounds(cap.dimension()))
}

/// Whether a node or template of `config`'s tenant tree has a hard cap an output bound keeps
/// (an entry of another shape is counted as one: the per-path check then decides).
pub(crate) fn tree_has_hard_caps(config: &Config) -> bool {
    config
        .tree_caps()
        .any(|cap| PeriodCap::deserialize(cap.clone()).map_or(true, |cap| any_hard(&[cap])))
}

/// Whether an output bound keeps a cap of `dimension`: spend, output or total tokens.
fn bounds(dimension: Dimension) -> bool {
    matches!(
        dimension,
        Dimension::Spend | Dimension::OutputTokens | Dimension::TotalTokens
    )
}

impl Fitting {
    pub(crate) fn new(
        config: &OutputConfig,
        prices: Option<Arc<PriceTable>>,
        tree_hard: bool,
    ) -> Self {
        let largest = (config.largest.iter())
            .fold(LargestOutput::known(), |table, (model, &tokens)| {
                table.with_model(model.as_str(), tokens)
            });
        Self {
            tree_hard: std::sync::atomic::AtomicBool::new(tree_hard),
            largest,
            min_tokens: config.min_tokens,
            unknown_model_tokens: config.unknown_model_tokens,
            prices,
        }
    }

    /// Whether a node or template of the tenant tree has a hard cap.
    pub(crate) fn tree_hard(&self) -> bool {
        self.tree_hard.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Says whether the tree's nodes and templates have a hard cap (after a reload).
    pub(crate) fn set_tree_hard(&self, hard: bool) {
        self.tree_hard
            .store(hard, std::sync::atomic::Ordering::Relaxed);
    }

    /// The smallest bound worth sending.
    pub(crate) fn min_tokens(&self) -> u64 {
        self.min_tokens
    }

    /// Bounds `read` (a request of `model` to `api`, `body`) if it sets no bound: its model's
    /// largest output reserved, or a bound written into the body (then the new body).
    pub(crate) fn bound(
        &self,
        api: Api,
        model: &str,
        (body, read): (&[u8], RequestEstimate),
    ) -> (RequestEstimate, Option<(Bytes, Shaped)>) {
        if read.max_output_tokens().is_some() || !has_output(api) {
            return (read, None);
        }
        if let Some(largest) = self.largest.largest(model) {
            return (read.with_output_bound(largest), None);
        }
        let tokens = self.unknown_model_tokens;
        match write_bound(api, body, tokens) {
            Some(body) => (
                read.with_output_bound(tokens),
                Some((body, Shaped::Written(tokens))),
            ),
            None => (read, None),
        }
    }

    /// The largest output per choice that `left` of `dimension` pays for, with `read`'s
    /// prompt (a request of `model`), at most its bound now: `None` when its prompt alone
    /// does not fit, or nothing can be said (no bound, a dimension no bound keeps, a model
    /// without a price under a spend cap).
    pub(crate) fn room(
        &self,
        read: &RequestEstimate,
        model: &str,
        (dimension, left): (Dimension, u64),
    ) -> Option<u64> {
        let bound = read.max_output_tokens()?;
        if !bounds(dimension) {
            return None;
        }
        let prices = match dimension {
            Dimension::Spend => Some(self.prices.as_ref()?.prices(model).ok()?),
            _ => None,
        };
        let defaults = Defaults::new();
        let amount = |tokens: u64| {
            let cost: Cost = read.clone().with_output_bound(tokens).cost(&defaults);
            match prices {
                Some(prices) => prices.estimated_spend(read.service_tier(), &cost),
                None => cost.amount(dimension),
            }
        };
        if amount(0) > left {
            return None;
        }
        // The largest `n` in 0..=bound whose cost fits: the cost grows with `n`.
        let (mut fits, mut over) = (0, bound.saturating_add(1));
        while over - fits > 1 {
            let mid = fits + (over - fits) / 2;
            if amount(mid) <= left {
                fits = mid;
            } else {
                over = mid;
            }
        }
        Some(fits)
    }
}

/// Whether answers of `api` hold output a bound limits.
fn has_output(api: Api) -> bool {
    !matches!(
        api,
        Api::Embeddings | Api::CountTokens | Api::EmbedContent | Api::GeminiCountTokens
    )
}

/// `body` with its output bound set to `tokens` per choice, in the fields `api` reads: a
/// Chat Completions request's `max_completion_tokens` and `max_tokens` (the first when it
/// has neither, the one every current OpenAI model takes), a Responses request's
/// `max_output_tokens`, a Messages or Completions request's `max_tokens`, a Gemini request's
/// `generationConfig.maxOutputTokens`. `None` for a body
/// that is not a JSON object, or an API without output.
pub(crate) fn write_bound(api: Api, body: &[u8], tokens: u64) -> Option<Bytes> {
    let mut value: Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object_mut()?;
    let fields: &[&str] = match api {
        Api::Chat => &["max_completion_tokens", "max_tokens"],
        Api::Responses => &["max_output_tokens"],
        Api::Messages | Api::Completions => &["max_tokens"],
        Api::GenerateContent => {
            // Gemini's bound sits in its generation config.
            let key = if object.contains_key("generation_config") {
                "generation_config"
            } else {
                "generationConfig"
            };
            let config = object
                .entry(key)
                .or_insert_with(|| Value::Object(serde_json::Map::new()))
                .as_object_mut()?;
            config.remove("max_output_tokens");
            config.insert("maxOutputTokens".to_owned(), tokens.into());
            return serde_json::to_vec(&value).ok().map(Bytes::from);
        }
        Api::Embeddings | Api::CountTokens | Api::EmbedContent | Api::GeminiCountTokens => {
            return None;
        }
    };
    let mut written = false;
    for field in fields {
        if object.contains_key(*field) {
            object.insert((*field).to_owned(), tokens.into());
            written = true;
        }
    }
    if !written {
        object.insert(fields[0].to_owned(), tokens.into());
    }
    serde_json::to_vec(&value).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower_llm_quota::estimate::{CharEstimator, read_request};

    fn read(body: &str) -> RequestEstimate {
        read_request(body.as_bytes(), &CharEstimator::new(), &Defaults::new()).unwrap()
    }

    #[test]
    fn a_bound_is_written_in_the_field_the_api_reads() {
        let chat = br#"{"model":"m","messages":[]}"#;
        let written = write_bound(Api::Chat, chat, 300).unwrap();
        let value: Value = serde_json::from_slice(&written).unwrap();
        assert_eq!(value["max_completion_tokens"], 300);
        assert!(value.get("max_tokens").is_none());
        let old = br#"{"model":"m","max_tokens":900,"messages":[]}"#;
        let value: Value =
            serde_json::from_slice(&write_bound(Api::Chat, old, 300).unwrap()).unwrap();
        assert_eq!(value["max_tokens"], 300);
        assert!(value.get("max_completion_tokens").is_none());
        let responses = br#"{"model":"m","input":"hi"}"#;
        let value: Value =
            serde_json::from_slice(&write_bound(Api::Responses, responses, 7).unwrap()).unwrap();
        assert_eq!(value["max_output_tokens"], 7);
        assert!(write_bound(Api::Embeddings, responses, 7).is_none());
        assert!(write_bound(Api::Chat, b"[1]", 7).is_none());
        // Gemini's sits in its generation config, made when absent.
        let gemini = br#"{"contents":[],"generationConfig":{"temperature":0.2}}"#;
        let value: Value =
            serde_json::from_slice(&write_bound(Api::GenerateContent, gemini, 9).unwrap()).unwrap();
        assert_eq!(value["generationConfig"]["maxOutputTokens"], 9);
        assert_eq!(value["generationConfig"]["temperature"], 0.2);
        let bare = br#"{"contents":[]}"#;
        let value: Value =
            serde_json::from_slice(&write_bound(Api::GenerateContent, bare, 9).unwrap()).unwrap();
        assert_eq!(value["generationConfig"]["maxOutputTokens"], 9);
    }

    #[test]
    fn room_is_the_largest_bound_that_fits() {
        let prices = PriceTable::new(tower_llm_quota::pricing::Unpriced::Refuse).with_model(
            "m",
            tower_llm_quota::pricing::ModelPrices::new(
                tower_llm_quota::pricing::TokenPrices::per_million_usd(
                    "2.50", "2.50", "2.50", "10",
                )
                .unwrap(),
            ),
        );
        let fitting = Fitting::new(&OutputConfig::default(), Some(Arc::new(prices)), true);
        let request = read(
            r#"{"model":"m","max_tokens":1000,"n":2,"messages":[{"role":"user","content":"Hello there"}]}"#,
        );
        let input = request.input_tokens();
        let cost = |n: u64| request.clone().with_output_bound(n).cost(&Defaults::new());
        // Output tokens: per choice, two choices.
        assert_eq!(
            fitting.room(&request, "m", (Dimension::OutputTokens, 501)),
            Some(250)
        );
        assert_eq!(
            fitting.room(&request, "m", (Dimension::TotalTokens, input + 100)),
            Some(50)
        );
        assert_eq!(
            fitting.room(&request, "m", (Dimension::TotalTokens, input - 1)),
            None,
            "the prompt alone does not fit"
        );
        assert_eq!(
            fitting.room(&request, "m", (Dimension::OutputTokens, 1 << 40)),
            Some(1_000),
            "never above the bound asked"
        );
        // Spend: 2,500 nano-dollars an input token, 10,000 an output token.
        let left = 2_500 * input + 2 * 10_000 * 40 + 9_999;
        let room = fitting
            .room(&request, "m", (Dimension::Spend, left))
            .unwrap();
        assert_eq!(room, 40);
        let spend = |n| {
            let prices = fitting.prices.as_ref().unwrap().prices("m").unwrap();
            prices.estimated_spend(None, &cost(n))
        };
        assert!(spend(room) <= left && spend(room + 1) > left);
        assert_eq!(
            fitting.room(&request, "x", (Dimension::Spend, left)),
            None,
            "no price"
        );
        assert_eq!(fitting.room(&request, "m", (Dimension::Requests, 9)), None);
    }

    #[test]
    fn an_unbounded_request_reserves_its_model_s_largest_output_or_gets_a_bound() {
        let config = OutputConfig {
            largest: [("house-model*".to_owned(), 2_048)].into(),
            ..OutputConfig::default()
        };
        let fitting = Fitting::new(&config, None, true);
        let body = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hi"}]}"#;
        let (bounded, written) =
            fitting.bound(Api::Chat, "gpt-4o-mini", (body.as_bytes(), read(body)));
        assert_eq!((bounded.max_output_tokens(), written), (Some(16_384), None));
        let house = body.replace("gpt-4o-mini", "house-model-2");
        let (bounded, _) =
            fitting.bound(Api::Chat, "house-model-2", (house.as_bytes(), read(&house)));
        assert_eq!(bounded.max_output_tokens(), Some(2_048));
        let unknown = body.replace("gpt-4o-mini", "unknown");
        let (bounded, written) =
            fitting.bound(Api::Chat, "unknown", (unknown.as_bytes(), read(&unknown)));
        let (written, shaped) = written.expect("a bound written in");
        assert_eq!(shaped, Shaped::Written(4_096));
        assert_eq!(shaped.header(), "4096; written");
        assert_eq!(bounded.max_output_tokens(), Some(4_096));
        assert_eq!(
            read(std::str::from_utf8(&written).unwrap()).max_output_tokens(),
            Some(4_096)
        );
        let asked = body.replace("\"messages\"", "\"max_tokens\":10,\"messages\"");
        let (bounded, written) =
            fitting.bound(Api::Chat, "gpt-4o-mini", (asked.as_bytes(), read(&asked)));
        assert_eq!(
            (bounded.max_output_tokens(), written),
            (Some(10), None),
            "its own bound kept"
        );
    }
}
