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

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::config::{AdminConfig, Class, ConfigError, KeyConfig, Retries, secret};

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

/// The callers' keys, by digest: the configuration's, with the admin API's records over them.
#[derive(Debug, Clone)]
pub(crate) struct KeyRing {
    digests: Vec<[u8; 32]>,
    /// For each digest: its caller (an index into `callers`) and until when it is valid.
    owners: Vec<(usize, Option<SystemTime>)>,
    callers: Vec<Caller>,
    /// Where each caller's key comes from.
    origins: Vec<Origin>,
}

/// Where a caller key comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Origin {
    /// `[[keys]]` of the configuration.
    Config,
    /// The admin API (created, or rotated from a configured one).
    Admin,
}

pub(crate) fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// A key the admin API created or rotated, or a configured one it revoked: the admin state's
/// `key:<name>` field. Its secrets are kept as SHA-256 digests only.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct KeyRecord {
    pub(crate) tenant: String,
    pub(crate) default_class: Class,
    #[serde(default)]
    pub(crate) allow_priority_header: bool,
    #[serde(default)]
    pub(crate) models: Option<Vec<String>>,
    #[serde(default)]
    pub(crate) retries: Retries,
    /// The digests it accepts; empty once revoked.
    #[serde(default)]
    pub(crate) secrets: Vec<SecretDigest>,
    /// Revoked: it hides a configured key of its name too.
    #[serde(default)]
    pub(crate) revoked: bool,
}

/// A secret's SHA-256 digest (hex), and until when it is valid (Unix seconds; `None`: until
/// the key is rotated or revoked).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SecretDigest {
    pub(crate) sha256: String,
    pub(crate) until: Option<u64>,
}

impl SecretDigest {
    /// A secret's digest, valid until `until`.
    pub(crate) fn of(secret: &str, until: Option<u64>) -> Self {
        Self {
            sha256: hex(&digest(secret.as_bytes())),
            until,
        }
    }

    fn bytes(&self) -> Option<[u8; 32]> {
        let text = self.sha256.as_bytes();
        if text.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (byte, pair) in out.iter_mut().zip(text.chunks(2)) {
            let pair = std::str::from_utf8(pair).ok()?;
            *byte = u8::from_str_radix(pair, 16).ok()?;
        }
        Some(out)
    }
}

/// Lowercase hexadecimal.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A new caller key: `sk-gw-` and 48 hexadecimal digits of the system's randomness (192 bits).
pub(crate) fn new_secret() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 24];
    getrandom::fill(&mut bytes)?;
    Ok(format!("sk-gw-{}", hex(&bytes)))
}

/// A configured key's secret, reading its `key_env` variable now.
pub(crate) fn configured_secret(key: &KeyConfig) -> Result<String, ConfigError> {
    let what = format!("key `{}`", key.name);
    let secret = secret(key.key.as_ref(), key.key_env.as_ref(), &what)?
        .ok_or_else(|| ConfigError(format!("{what} has no secret")))?;
    if secret.is_empty() {
        return Err(ConfigError(format!("key `{}` is empty", key.name)));
    }
    Ok(secret)
}

impl KeyRecord {
    /// The record of a configured key, with its settings and no secret yet.
    pub(crate) fn from_config(key: &KeyConfig) -> Self {
        Self {
            tenant: key.tenant.clone(),
            default_class: key.default_class,
            allow_priority_header: key.allow_priority_header,
            models: key.models.clone(),
            retries: key.retries,
            secrets: Vec::new(),
            revoked: false,
        }
    }

    fn caller(&self, name: &str) -> Result<Caller, ConfigError> {
        let path = Tenant::parse(&self.tenant)
            .and_then(|tenant| tenant.child(name))
            .map_err(|e| ConfigError(format!("key `{name}`: {e}")))?;
        Ok(Caller {
            name: name.to_owned(),
            tenant: self.tenant.clone(),
            path,
            default_class: self.default_class.into(),
            allow_priority_header: self.allow_priority_header,
            models: self.models.as_deref().map(Into::into),
            retries: self.retries,
        })
    }
}

impl KeyRing {
    /// The keys of a configuration (reading `key_env` variables now), with the admin API's
    /// `records` over them: a record replaces the configured key of its name (a rotation), a
    /// revoked one removes it.
    pub(crate) fn new(
        keys: &[KeyConfig],
        records: &[(String, KeyRecord)],
    ) -> Result<Self, ConfigError> {
        let mut ring = Self {
            digests: Vec::with_capacity(keys.len() + records.len()),
            owners: Vec::with_capacity(keys.len() + records.len()),
            callers: Vec::with_capacity(keys.len() + records.len()),
            origins: Vec::with_capacity(keys.len() + records.len()),
        };
        for key in keys {
            if records.iter().any(|(name, _)| *name == key.name) {
                continue;
            }
            let secret = configured_secret(key)?;
            let record = KeyRecord::from_config(key);
            ring.push(
                record.caller(&key.name)?,
                Origin::Config,
                &[(digest(secret.as_bytes()), None)],
            );
        }
        for (name, record) in records.iter().filter(|(_, r)| !r.revoked) {
            let secrets: Vec<_> = record
                .secrets
                .iter()
                .map(|s| {
                    let bytes = s.bytes().ok_or_else(|| {
                        ConfigError(format!("key `{name}`: a stored digest is not SHA-256 hex"))
                    })?;
                    Ok((bytes, s.until.map(|t| UNIX_EPOCH + Duration::from_secs(t))))
                })
                .collect::<Result<_, ConfigError>>()?;
            ring.push(record.caller(name)?, Origin::Admin, &secrets);
        }
        Ok(ring)
    }

    fn push(&mut self, caller: Caller, origin: Origin, secrets: &[([u8; 32], Option<SystemTime>)]) {
        let index = self.callers.len();
        self.callers.push(caller);
        self.origins.push(origin);
        for (digest, until) in secrets {
            self.digests.push(*digest);
            self.owners.push((index, *until));
        }
    }

    /// Every key: its caller, where it comes from, and until when each of its secrets is valid.
    pub(crate) fn list(&self) -> impl Iterator<Item = (&Caller, Origin, Vec<Option<SystemTime>>)> {
        self.callers.iter().enumerate().map(|(i, caller)| {
            let secrets = self
                .owners
                .iter()
                .filter(|(owner, _)| *owner == i)
                .map(|(_, until)| *until)
                .collect();
            (caller, self.origins[i], secrets)
        })
    }

    /// The caller of the key named `name`, and where it comes from.
    pub(crate) fn get(&self, name: &str) -> Option<(&Caller, Origin)> {
        let i = self.callers.iter().position(|c| c.name == name)?;
        Some((&self.callers[i], self.origins[i]))
    }

    /// The node of the key of that name.
    pub(crate) fn path_of(&self, name: &str) -> Option<&Tenant> {
        self.get(name).map(|(c, _)| &c.path)
    }

    /// Whether `path` is a key's own path (its tenant and its name).
    pub(crate) fn is_key_path(&self, path: &Tenant) -> bool {
        self.callers.iter().any(|c| c.path == *path)
    }

    /// The caller a request's key (`Authorization: Bearer`, `x-api-key` or `x-goog-api-key`)
    /// belongs to; a secret past its overlap after a rotation is refused like an unknown one.
    pub(crate) fn authenticate(&self, headers: &HeaderMap) -> Option<&Caller> {
        let index = find(&self.digests, presented_key(headers)?)?;
        let (owner, until) = self.owners[index];
        if until.is_some_and(|until| SystemTime::now() >= until) {
            return None;
        }
        Some(&self.callers[owner])
    }
}

/// The index of the digest of `presented` among `digests`: every digest is compared, in
/// constant time, whatever matches (the time taken tells nothing of which, or how much of one).
fn find(digests: &[[u8; 32]], presented: &str) -> Option<usize> {
    let presented = digest(presented.as_bytes());
    let mut found = subtle::Choice::from(0);
    let mut index = 0u32;
    for (i, stored) in digests.iter().enumerate() {
        let matches = stored.ct_eq(&presented);
        let i = u32::try_from(i).unwrap_or(u32::MAX);
        index.conditional_assign(&i, matches);
        found |= matches;
    }
    bool::from(found).then_some(index as usize)
}

/// Who calls the admin API: a token's name and the subtree it may read and change (the whole
/// tree for the operator's tokens).
#[derive(Debug, Clone)]
pub(crate) struct Admin {
    pub(crate) name: String,
    /// The subtree of a delegated admin (a partner's, a team's); `None`: every tenant, and
    /// the routes that concern the whole gateway.
    pub(crate) scope: Option<Tenant>,
}

/// The admin tokens, by digest.
#[derive(Debug, Clone, Default)]
pub(crate) struct AdminRing {
    digests: Vec<[u8; 32]>,
    admins: Vec<Admin>,
}

impl AdminRing {
    /// The operator's token (`server.admin_token`, named `admin`) and the configured
    /// `[[admins]]`.
    pub(crate) fn new(root: &str, admins: &[AdminConfig]) -> Result<Self, ConfigError> {
        let mut ring = Self::default();
        ring.digests.push(digest(root.as_bytes()));
        ring.admins.push(Admin {
            name: "admin".to_owned(),
            scope: None,
        });
        for admin in admins {
            let what = format!("admin `{}`", admin.name);
            let token = secret(admin.token.as_ref(), admin.token_env.as_ref(), &what)?
                .ok_or_else(|| ConfigError(format!("{what} has no token")))?;
            if token.is_empty() {
                return Err(ConfigError(format!(
                    "admin `{}`: the token is empty",
                    admin.name
                )));
            }
            let scope = admin
                .tenant
                .as_deref()
                .map(Tenant::parse)
                .transpose()
                .map_err(|e| ConfigError(format!("admin `{}`: {e}", admin.name)))?;
            ring.digests.push(digest(token.as_bytes()));
            ring.admins.push(Admin {
                name: admin.name.clone(),
                scope,
            });
        }
        Ok(ring)
    }

    /// The admin whose token a request carries (`Authorization: Bearer`).
    pub(crate) fn authenticate(&self, headers: &HeaderMap) -> Option<&Admin> {
        let presented = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))?;
        find(&self.digests, presented).map(|i| &self.admins[i])
    }
}

/// Constant-time equality of a presented secret with the expected one (the admin token).
pub(crate) fn secret_matches(presented: Option<&str>, expected: &str) -> bool {
    let presented = digest(presented.unwrap_or_default().as_bytes());
    bool::from(presented.ct_eq(&digest(expected.as_bytes())))
}

/// The key a request presents: `Authorization: Bearer <key>` (OpenAI), `x-api-key`
/// (Anthropic) or `x-goog-api-key` (Gemini, where a `?key=` is moved before).
pub(crate) fn presented_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(value) = headers.get(http::header::AUTHORIZATION) {
        let value = value.to_str().ok()?;
        let (scheme, key) = value.split_once(' ')?;
        return scheme.eq_ignore_ascii_case("bearer").then(|| key.trim());
    }
    ["x-api-key", super::gemini::KEY_HEADER]
        .into_iter()
        .find_map(|name| headers.get(name))
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let ring = KeyRing::new(&[key("a", "sk-a"), key("b", "sk-b")], &[]).unwrap();
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
