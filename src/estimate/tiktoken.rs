use tiktoken_rs::CoreBPE;

use super::Estimator;

/// A tiktoken encoding [`TiktokenEstimator`] counts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum TiktokenEncoding {
    /// `o200k_base`: GPT-4o, GPT-4.1, GPT-4.5, GPT-5, the o1, o3 and o4 reasoning models.
    O200kBase,
    /// `cl100k_base`: GPT-4, GPT-3.5 Turbo, the `text-embedding-3` models. The fallback: it
    /// counts more tokens than `o200k_base` for the same text, so it errs high.
    #[default]
    Cl100kBase,
}

impl TiktokenEncoding {
    /// The encoding of an OpenAI `model`, or `None` when the name is not an OpenAI model this
    /// crate knows. A provider prefix (`openai/gpt-4o`) and a fine-tune's `ft:` wrapping
    /// (`ft:gpt-4o-mini:org::id`) are looked through.
    ///
    /// ```
    /// use tower_llm_quota::estimate::TiktokenEncoding;
    ///
    /// assert_eq!(TiktokenEncoding::for_model("gpt-4o-mini"), Some(TiktokenEncoding::O200kBase));
    /// assert_eq!(TiktokenEncoding::for_model("o3"), Some(TiktokenEncoding::O200kBase));
    /// assert_eq!(TiktokenEncoding::for_model("gpt-4-turbo"), Some(TiktokenEncoding::Cl100kBase));
    /// assert_eq!(TiktokenEncoding::for_model("claude-sonnet-4"), None);
    /// ```
    pub fn for_model(model: &str) -> Option<Self> {
        let name = model.rsplit('/').next().unwrap_or(model);
        let name = match name.strip_prefix("ft:") {
            Some(rest) => rest.split(':').next().unwrap_or(rest),
            None => name,
        };
        let name = name.to_ascii_lowercase();
        let family = |prefix: &str| {
            name.strip_prefix(prefix)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(['-', '.', '_']))
        };
        const O200K_PREFIXES: [&str; 6] = [
            "gpt-4o",
            "chatgpt-4o",
            "gpt-4.1",
            "gpt-4.5",
            "gpt-5",
            "codex-mini",
        ];
        if O200K_PREFIXES.iter().any(|p| name.starts_with(p))
            || ["o1", "o3", "o4", "gpt-oss"].iter().any(|p| family(p))
        {
            Some(Self::O200kBase)
        } else if ["gpt-4", "gpt-3.5", "gpt-35"].iter().any(|p| family(p))
            || name.starts_with("text-embedding-")
        {
            Some(Self::Cl100kBase)
        } else {
            None
        }
    }

    /// The tokens of `text` in this encoding, special-token markers counted as plain text (as
    /// the APIs treat user text).
    ///
    /// The first call for an encoding builds it from the vocabulary embedded in `tiktoken-rs`
    /// (nothing is downloaded), once per process; that takes a fraction of a second in an
    /// optimized build.
    pub fn count(self, text: &str) -> u64 {
        self.bpe().encode_ordinary(text).len() as u64
    }

    fn bpe(self) -> &'static CoreBPE {
        // tiktoken-rs builds each encoding once, in a `LazyLock`, and shares it.
        match self {
            Self::O200kBase => tiktoken_rs::o200k_base_singleton(),
            Self::Cl100kBase => tiktoken_rs::cl100k_base_singleton(),
        }
    }
}

/// An exact [`Estimator`] for OpenAI models: tiktoken's `o200k_base` or `cl100k_base`, chosen
/// by the request's model (see [`TiktokenEncoding::for_model`]), with a fallback encoding
/// (`cl100k_base` by default) for unknown models and bodies without a model.
///
/// Available with the `tiktoken` feature. The vocabularies are compiled into the binary (about
/// 5 MiB for these two); nothing is fetched at run time. Each encoding is built once per process, on first
/// use; [`TiktokenEstimator::warm_up`] builds them ahead of time.
///
/// The count is the text's exact token count; the per-message framing, which no tokenizer
/// sees, is added by the [body reader](super::read_request). Other providers' tokenizers
/// (Anthropic's is not public) differ: for their models prefer [`CharEstimator`], which errs
/// high by design.
///
/// [`CharEstimator`]: super::CharEstimator
///
/// # Example
///
/// ```
/// use tower_llm_quota::estimate::{Estimator, TiktokenEstimator};
///
/// let estimator = TiktokenEstimator::new();
/// assert_eq!(estimator.count_for("gpt-4o", "hello world"), 2);
/// assert_eq!(estimator.count("hello world"), 2);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TiktokenEstimator {
    fallback: TiktokenEncoding,
}

impl TiktokenEstimator {
    /// Counts with the model's encoding, `cl100k_base` when the model is unknown.
    pub const fn new() -> Self {
        Self {
            fallback: TiktokenEncoding::Cl100kBase,
        }
    }

    /// The same estimator with `fallback` for unknown models and bodies without a model.
    pub const fn with_fallback(self, fallback: TiktokenEncoding) -> Self {
        Self { fallback }
    }

    /// The encoding used for `model`.
    pub fn encoding_for(&self, model: Option<&str>) -> TiktokenEncoding {
        model
            .and_then(TiktokenEncoding::for_model)
            .unwrap_or(self.fallback)
    }

    /// Builds both encodings now rather than on the first request.
    pub fn warm_up(&self) {
        let _ = TiktokenEncoding::O200kBase.bpe();
        let _ = TiktokenEncoding::Cl100kBase.bpe();
    }
}

impl Estimator for TiktokenEstimator {
    fn count(&self, text: &str) -> u64 {
        self.fallback.count(text)
    }

    fn count_for(&self, model: &str, text: &str) -> u64 {
        self.encoding_for(Some(model)).count(text)
    }
}
