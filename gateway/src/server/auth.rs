//! Caller keys: which tenant a key spends, checked in constant time.
//!
//! Every configured key is kept as its SHA-256 digest only, and a presented key is compared
//! with every one of them, in constant time (`subtle`), whatever matches: the time taken
//! tells nothing about which key, or how much of one, was right. Keys are never logged; a
//! key's configured name stands for it everywhere.

use http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};
use tower_llm_quota::Priority;
use tower_llm_quota::tenant::Tenant;

use super::config::{ConfigError, KeyConfig, Retries};

/// What a valid key may do.
#[derive(Debug, Clone)]
pub(crate) struct Caller {
    /// The key's name (never the key).
    pub(crate) name: String,
    /// The tenant path it spends.
    pub(crate) tenant: String,
    /// The path of its requests: the tenant's, then the key's name.
    pub(crate) path: Tenant,
    pub(crate) default_class: Priority,
    pub(crate) allow_priority_header: bool,
    /// The public models the key may use; all when `None`.
    pub(crate) models: Option<std::sync::Arc<[String]>>,
    /// Who retries the provider for its requests.
    pub(crate) retries: Retries,
}

impl Caller {
    /// Whether the key may use the public model `name`.
    pub(crate) fn may_use(&self, name: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|models| models.iter().any(|m| m == name))
    }
}

impl Caller {
    /// The class of a request: `x-priority` where the key allows it, else the key's default.
    /// An unknown `x-priority` value is ignored.
    pub(crate) fn class(&self, headers: &HeaderMap) -> Priority {
        if !self.allow_priority_header {
            return self.default_class;
        }
        headers
            .get("x-priority")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(self.default_class)
    }
}

/// The configured keys, by digest.
#[derive(Debug, Clone)]
pub(crate) struct KeyRing {
    digests: Vec<[u8; 32]>,
    callers: Vec<Caller>,
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

impl KeyRing {
    /// The keys of a configuration, reading `key_env` variables now.
    pub(crate) fn new(keys: &[KeyConfig]) -> Result<Self, ConfigError> {
        let mut ring = Self {
            digests: Vec::with_capacity(keys.len()),
            callers: Vec::with_capacity(keys.len()),
        };
        for key in keys {
            let secret = match (&key.key, &key.key_env) {
                (Some(secret), _) => secret.clone(),
                (None, Some(var)) => std::env::var(var).map_err(|_| {
                    ConfigError(format!("key `{}`: the variable {var} is not set", key.name))
                })?,
                (None, None) => {
                    return Err(ConfigError(format!("key `{}` has no secret", key.name)));
                }
            };
            if secret.is_empty() {
                return Err(ConfigError(format!("key `{}` is empty", key.name)));
            }
            ring.digests.push(digest(secret.as_bytes()));
            let path = Tenant::parse(&key.tenant)
                .and_then(|tenant| tenant.child(&key.name))
                .map_err(|e| ConfigError(format!("key `{}`: {e}", key.name)))?;
            ring.callers.push(Caller {
                name: key.name.clone(),
                tenant: key.tenant.clone(),
                path,
                default_class: key.default_class.into(),
                allow_priority_header: key.allow_priority_header,
                models: key.models.as_deref().map(Into::into),
                retries: key.retries,
            });
        }
        Ok(ring)
    }

    /// The node of the key of that name.
    pub(crate) fn path_of(&self, name: &str) -> Option<&Tenant> {
        self.callers
            .iter()
            .find(|c| c.name == name)
            .map(|c| &c.path)
    }

    /// Whether `path` is a key's own path (its tenant and its name).
    pub(crate) fn is_key_path(&self, path: &Tenant) -> bool {
        self.callers.iter().any(|c| c.path == *path)
    }

    /// The caller a request's key (`Authorization: Bearer` or `x-api-key`) belongs to.
    pub(crate) fn authenticate(&self, headers: &HeaderMap) -> Option<&Caller> {
        let presented = presented_key(headers)?;
        let presented = digest(presented.as_bytes());
        // Look at every key, keep the index of a match without branching on it.
        let mut found = subtle::Choice::from(0);
        let mut index = 0u32;
        for (i, stored) in self.digests.iter().enumerate() {
            let matches = stored.ct_eq(&presented);
            let i = u32::try_from(i).unwrap_or(u32::MAX);
            index.conditional_assign(&i, matches);
            found |= matches;
        }
        bool::from(found).then(|| &self.callers[index as usize])
    }
}

/// Constant-time equality of a presented secret with the expected one (the admin token).
pub(crate) fn secret_matches(presented: Option<&str>, expected: &str) -> bool {
    let presented = digest(presented.unwrap_or_default().as_bytes());
    bool::from(presented.ct_eq(&digest(expected.as_bytes())))
}

/// The key a request presents: `Authorization: Bearer <key>` (OpenAI) or `x-api-key`
/// (Anthropic).
pub(crate) fn presented_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(value) = headers.get(http::header::AUTHORIZATION) {
        let value = value.to_str().ok()?;
        let (scheme, key) = value.split_once(' ')?;
        return scheme.eq_ignore_ascii_case("bearer").then(|| key.trim());
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::config::Class;

    fn key(name: &str, secret: &str) -> KeyConfig {
        KeyConfig {
            name: name.into(),
            key_env: None,
            key: Some(secret.into()),
            tenant: format!("t-{name}"),
            default_class: Class::Batch,
            allow_priority_header: false,
            models: None,
            retries: Retries::default(),
        }
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn finds_the_matching_key_only() {
        let ring = KeyRing::new(&[key("a", "sk-a"), key("b", "sk-b")]).unwrap();
        let b = ring.authenticate(&headers(&[("authorization", "Bearer sk-b")]));
        assert_eq!(b.map(|c| c.name.as_str()), Some("b"));
        let a = ring.authenticate(&headers(&[("x-api-key", "sk-a")]));
        assert_eq!(a.map(|c| c.name.as_str()), Some("a"));
        assert!(
            ring.authenticate(&headers(&[("authorization", "Bearer sk-c")]))
                .is_none()
        );
        assert!(
            ring.authenticate(&headers(&[("authorization", "Basic sk-a")]))
                .is_none()
        );
        assert!(ring.authenticate(&HeaderMap::new()).is_none());
        assert_eq!(
            b.unwrap().class(&headers(&[("x-priority", "interactive")])),
            Priority::Batch
        );
    }
}
