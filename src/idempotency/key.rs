//! The operation key: from the caller's header, or a stable hash of what the request asks.
//!
//! Pure: no I/O, no clock.

use std::fmt;

use http::{HeaderMap, HeaderName};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::InvalidKey;

/// The longest key accepted from a header (Stripe's limit).
pub(crate) const MAX_KEY_LEN: usize = 255;

/// The logical operation a request belongs to: who asks (`tenant`) and for what (`task`). A
/// request extension, read by [`IdempotencyLayer`](super::IdempotencyLayer).
///
/// Both take part in the operation key, so two tenants sending the same body, or the same
/// header key, never share a response; `task` is also the `task_type` label of
/// `llm_duplicate_suppressed_total` (keep it to a bounded set of names).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Operation {
    tenant: Option<String>,
    task: Option<String>,
}

impl Operation {
    /// An operation of `tenant` for `task`.
    pub fn new(tenant: impl Into<String>, task: impl Into<String>) -> Self {
        Self {
            tenant: Some(tenant.into()),
            task: Some(task.into()),
        }
    }

    /// An operation of `tenant`, with no task named.
    pub fn tenant(tenant: impl Into<String>) -> Self {
        Self {
            tenant: Some(tenant.into()),
            task: None,
        }
    }

    /// The tenant, if named.
    pub fn tenant_name(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// The task, if named.
    pub fn task_name(&self) -> Option<&str> {
        self.task.as_deref()
    }
}

/// The key of one logical operation, as [`IdempotencyLayer`](super::IdempotencyLayer) uses
/// it: put in the request's extensions (so that inner layers, such as the retry layer, can
/// see that the request carries one) and forwarded upstream.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    /// What the provider is sent: the caller's key, or the derived hash in hex.
    sent: String,
    /// What the store is asked about: a hash of the tenant and the sent key, in hex.
    stored: String,
    /// Whether the caller gave it (`true`) or it was derived from the body.
    given: bool,
}

impl IdempotencyKey {
    /// The key the caller gave in a header, scoped by `operation`'s tenant.
    ///
    /// Fails when the value is empty, longer than 255 bytes, or not visible ASCII.
    pub fn given(value: &[u8], operation: &Operation) -> Result<Self, InvalidKey> {
        if value.is_empty() {
            return Err(InvalidKey("the idempotency key is empty"));
        }
        if value.len() > MAX_KEY_LEN {
            return Err(InvalidKey("the idempotency key is longer than 255 bytes"));
        }
        if !value.iter().all(|b| b.is_ascii_graphic()) {
            return Err(InvalidKey(
                "the idempotency key holds a byte that is not visible ASCII",
            ));
        }
        // Checked above: visible ASCII is UTF-8.
        let sent = String::from_utf8_lossy(value).into_owned();
        let mut hasher = framed("given");
        field(
            &mut hasher,
            operation.tenant.as_deref().unwrap_or("").as_bytes(),
        );
        field(&mut hasher, sent.as_bytes());
        Ok(Self {
            stored: hex(&hasher.finalize()),
            sent,
            given: true,
        })
    }

    /// The key of a request without one: a SHA-256 of the tenant, the task, the request's
    /// path and its body in canonical form (a JSON body with its object keys sorted and no
    /// insignificant whitespace; any other body as its bytes).
    ///
    /// Two requests get the same key exactly when they ask the same thing of the same
    /// endpoint for the same tenant and task, however their JSON was laid out.
    pub fn derived(operation: &Operation, path: &str, body: &[u8]) -> Self {
        let mut hasher = framed("derived");
        field(
            &mut hasher,
            operation.tenant.as_deref().unwrap_or("").as_bytes(),
        );
        field(
            &mut hasher,
            operation.task.as_deref().unwrap_or("").as_bytes(),
        );
        field(&mut hasher, path.as_bytes());
        match serde_json::from_slice::<Value>(body) {
            Ok(value) => {
                hasher.update(b"json\0");
                let mut canonical = Vec::with_capacity(body.len());
                canonical_json(&value, &mut canonical);
                field(&mut hasher, &canonical);
            }
            Err(_) => {
                hasher.update(b"raw\0");
                field(&mut hasher, body);
            }
        }
        let digest = hex(&hasher.finalize());
        Self {
            sent: digest.clone(),
            stored: digest,
            given: false,
        }
    }

    /// The key sent upstream.
    pub fn as_str(&self) -> &str {
        &self.sent
    }

    /// The key under which the operation's record is stored (64 hex digits).
    pub fn stored(&self) -> &str {
        &self.stored
    }

    /// Whether the caller gave the key (rather than the layer deriving it).
    pub fn is_given(&self) -> bool {
        self.given
    }

    /// The key in `headers` under `name`, if any: `Ok(None)` when absent, an error when
    /// malformed or repeated.
    pub(crate) fn from_headers(
        headers: &HeaderMap,
        name: &HeaderName,
        operation: &Operation,
    ) -> Result<Option<Self>, InvalidKey> {
        let mut values = headers.get_all(name).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(InvalidKey("the idempotency key header is repeated"));
        }
        Self::given(value.as_bytes(), operation).map(Some)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.sent).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.sent)
    }
}

/// A hasher that starts with the scheme's version and the key's origin.
fn framed(origin: &str) -> Sha256 {
    let mut hasher = Sha256::new();
    hasher.update(b"tower-llm-quota/idempotency/v1\0");
    hasher.update(origin.as_bytes());
    hasher.update(b"\0");
    hasher
}

/// A length-prefixed field, so that no two sequences of fields hash alike.
fn field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    out
}

/// Writes `value` with object keys sorted (by their bytes) and no whitespace. Numbers and
/// strings are written as serde_json writes them, so equal documents give equal bytes
/// whatever the order in which a map type keeps its keys.
fn canonical_json(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => {
            // Writing a scalar into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut *out, value);
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical_json(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                let _ = serde_json::to_writer(&mut *out, key);
                out.push(b':');
                canonical_json(item, out);
            }
            out.push(b'}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_json_sorts_keys_at_every_depth() {
        let a: Value =
            serde_json::from_str(r#"{ "b": 1, "a": {"y": [1, {"d":2,"c":3}], "x": "é"} }"#)
                .unwrap();
        let mut out = Vec::new();
        canonical_json(&a, &mut out);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"a":{"x":"é","y":[1,{"c":3,"d":2}]},"b":1}"#
        );
    }

    #[test]
    fn derived_keys_ignore_layout_and_see_content() {
        let op = Operation::new("acme", "classify");
        let a = IdempotencyKey::derived(&op, "/v1/chat", br#"{"model":"m","max_tokens":5}"#);
        let b = IdempotencyKey::derived(
            &op,
            "/v1/chat",
            b"{ \"max_tokens\" : 5,\n \"model\":\"m\" }",
        );
        assert_eq!(a, b);
        assert_eq!(a.as_str().len(), 64);
        let other_value =
            IdempotencyKey::derived(&op, "/v1/chat", br#"{"model":"m","max_tokens":6}"#);
        let other_tenant = IdempotencyKey::derived(
            &Operation::new("globex", "classify"),
            "/v1/chat",
            br#"{"model":"m","max_tokens":5}"#,
        );
        let other_path =
            IdempotencyKey::derived(&op, "/v1/messages", br#"{"model":"m","max_tokens":5}"#);
        assert_ne!(a, other_value);
        assert_ne!(a, other_tenant);
        assert_ne!(a, other_path);
        // Not JSON: the bytes themselves.
        let raw = IdempotencyKey::derived(&op, "/v1/chat", b"not json");
        assert_ne!(raw, IdempotencyKey::derived(&op, "/v1/chat", b"not json "));
    }

    #[test]
    fn given_keys_are_scoped_by_tenant_and_validated() {
        let a = IdempotencyKey::given(b"job-42", &Operation::tenant("acme")).unwrap();
        let b = IdempotencyKey::given(b"job-42", &Operation::tenant("globex")).unwrap();
        assert_eq!(a.as_str(), "job-42");
        assert_eq!(b.as_str(), "job-42");
        assert_ne!(a.stored(), b.stored());
        assert!(a.is_given());
        for bad in [&b""[..], b"has space", b"\xff\xfe", &[b'k'; 256][..]] {
            assert!(IdempotencyKey::given(bad, &Operation::default()).is_err());
        }
        let mut headers = HeaderMap::new();
        let name = HeaderName::from_static("idempotency-key");
        assert_eq!(
            IdempotencyKey::from_headers(&headers, &name, &Operation::default()),
            Ok(None)
        );
        headers.append(&name, "a".parse().unwrap());
        headers.append(&name, "b".parse().unwrap());
        assert!(IdempotencyKey::from_headers(&headers, &name, &Operation::default()).is_err());
    }
}
