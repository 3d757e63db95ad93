//! Where a limit applies: provider, model, key.

/// Where the limit applies, as far as known: place one in a request's extensions to name it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Scope {
    /// The provider (`"openai"`, `"anthropic"`, ...).
    pub provider: Option<String>,
    /// The model or deployment.
    pub model: Option<String>,
    /// The API key's name (never the key itself).
    pub key: Option<String>,
}
