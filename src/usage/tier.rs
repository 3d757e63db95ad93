//! The service tier that served a request, as the provider names it.

use std::fmt;

/// The service tier a provider says served a request: OpenAI's answer's `service_tier`
/// (`default`, `flex`, `priority`, `scale`), Anthropic's `usage.service_tier` (`standard`,
/// `priority`, `batch`), Gemini's `x-gemini-service-tier` header (`standard`, `flex`,
/// `priority`). OpenAI's `default` and the others' `standard` are one tier,
/// [`ServiceTier::Standard`].
///
/// ```
/// use tower_llm_quota::usage::ServiceTier;
///
/// assert_eq!(ServiceTier::parse("flex"), ServiceTier::Flex);
/// assert_eq!(ServiceTier::parse("default"), ServiceTier::Standard);
/// assert_eq!(ServiceTier::parse("Priority"), ServiceTier::Priority);
/// assert_eq!(ServiceTier::parse("on_demand").as_str(), "other");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ServiceTier {
    /// The standard tier: OpenAI's `default`, the others' `standard`.
    Standard,
    /// Flex: cheaper, slower, sheddable (OpenAI, Gemini).
    Flex,
    /// Priority: faster, dearer, with limits of its own (OpenAI, Anthropic, Gemini).
    Priority,
    /// Anthropic's batch tier (the Message Batches API).
    Batch,
    /// OpenAI's Scale Tier (reserved capacity).
    Scale,
    /// A tier this crate does not know by name.
    Other,
}

impl ServiceTier {
    /// The tier a provider's name (any case) stands for; [`ServiceTier::Other`] for a name
    /// this crate does not know.
    pub fn parse(name: &str) -> Self {
        let name = name.trim();
        let is = |known: &str| name.eq_ignore_ascii_case(known);
        if is("default") || is("standard") {
            Self::Standard
        } else if is("flex") {
            Self::Flex
        } else if is("priority") {
            Self::Priority
        } else if is("batch") {
            Self::Batch
        } else if is("scale") {
            Self::Scale
        } else {
            Self::Other
        }
    }

    /// Its name in logs and metric labels: `standard`, `flex`, `priority`, `batch`, `scale`,
    /// `other`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Standard => "standard",
            Self::Flex => "flex",
            Self::Priority => "priority",
            Self::Batch => "batch",
            Self::Scale => "scale",
            Self::Other => "other",
        }
    }

    /// The tier Gemini's `x-gemini-service-tier` response header names, if present.
    pub fn from_headers(headers: &http::HeaderMap) -> Option<Self> {
        let value = headers.get("x-gemini-service-tier")?.to_str().ok()?;
        Some(Self::parse(value))
    }
}

impl fmt::Display for ServiceTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_provider_name_reads_as_its_tier() {
        for (name, tier) in [
            ("default", ServiceTier::Standard),
            ("standard", ServiceTier::Standard),
            ("STANDARD", ServiceTier::Standard),
            ("flex", ServiceTier::Flex),
            ("priority", ServiceTier::Priority),
            ("batch", ServiceTier::Batch),
            ("scale", ServiceTier::Scale),
            ("", ServiceTier::Other),
            ("auto", ServiceTier::Other),
        ] {
            assert_eq!(ServiceTier::parse(name), tier, "{name}");
        }
        let mut headers = http::HeaderMap::new();
        assert_eq!(ServiceTier::from_headers(&headers), None);
        headers.insert("x-gemini-service-tier", "flex".parse().unwrap());
        assert_eq!(ServiceTier::from_headers(&headers), Some(ServiceTier::Flex));
    }
}
