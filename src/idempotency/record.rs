//! What a completed operation leaves behind, and its wire form in a shared store.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde_json::{Value, json};

use crate::usage::RawUsage;

/// Headers never stored: they describe one connection or one transfer, not the answer.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
    "content-length",
];

/// A completed operation: its status, headers, usage and body, as a duplicate receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) usage: Option<RawUsage>,
    /// `None` when the body was larger than the layer keeps: the operation is done, but its
    /// answer cannot be replayed.
    pub(crate) body: Option<Bytes>,
    /// A digest of the request a caller's key was given with (its endpoint and body), so that
    /// the key used again for another request is refused; `None` for a derived key (the key
    /// is that digest already).
    pub(crate) request: Option<String>,
}

impl Record {
    /// A record of an answer with `status` and `headers` (those describing the transfer are
    /// left out), `usage` if known, and `body` if kept.
    pub fn new(
        status: StatusCode,
        headers: &HeaderMap,
        usage: Option<RawUsage>,
        body: Option<Bytes>,
    ) -> Self {
        let mut kept = HeaderMap::with_capacity(headers.len());
        for (name, value) in headers {
            if !HOP_BY_HOP.contains(&name.as_str()) {
                kept.append(name.clone(), value.clone());
            }
        }
        Self {
            status,
            headers: kept,
            usage,
            body,
            request: None,
        }
    }

    /// The same record, for the request of `digest` (see [`Record::request_digest`]).
    pub fn with_request_digest(mut self, digest: Option<String>) -> Self {
        self.request = digest;
        self
    }

    /// A digest of the request whose answer this is, when its key was the caller's: the key
    /// used again with another digest is refused.
    pub fn request_digest(&self) -> Option<&str> {
        self.request.as_deref()
    }

    /// The status of the answer.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The headers of the answer, without those describing its transfer.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The usage the provider reported in the body, if it did.
    pub fn usage(&self) -> Option<RawUsage> {
        self.usage
    }

    /// The body, when it was small enough to keep.
    pub fn body(&self) -> Option<&Bytes> {
        self.body.as_ref()
    }

    /// The metadata (all but the body) as JSON, for a store that keeps strings: with the
    /// body, what [`Record::decode`] reads back. Header values that are not text are left out.
    pub fn encode_meta(&self) -> String {
        let headers: Vec<Value> = self
            .headers
            .iter()
            .filter_map(|(name, value)| {
                // Values that are not text are dropped rather than mangled.
                value.to_str().ok().map(|v| json!([name.as_str(), v]))
            })
            .collect();
        let usage = self.usage.map(|u| {
            json!([
                u.input,
                u.cache_read,
                u.cache_write,
                u.output,
                u.reasoning,
                u.total
            ])
        });
        json!({
            "status": self.status.as_u16(),
            "headers": headers,
            "usage": usage,
            "kept": self.body.is_some(),
            "request": self.request,
        })
        .to_string()
    }

    /// The record from its metadata and body; `None` when the metadata is not what
    /// [`Record::encode_meta`] writes (a foreign or corrupted value). The body is ignored when
    /// the metadata says it was not kept.
    pub fn decode(meta: &[u8], body: Bytes) -> Option<Self> {
        let meta: Value = serde_json::from_slice(meta).ok()?;
        let status =
            StatusCode::from_u16(u16::try_from(meta.get("status")?.as_u64()?).ok()?).ok()?;
        let mut headers = HeaderMap::new();
        for pair in meta.get("headers")?.as_array()? {
            let name = HeaderName::from_bytes(pair.get(0)?.as_str()?.as_bytes()).ok()?;
            let value = HeaderValue::from_str(pair.get(1)?.as_str()?).ok()?;
            headers.append(name, value);
        }
        let usage = match meta.get("usage")? {
            Value::Null => None,
            Value::Array(fields) if fields.len() == 6 => {
                let f = |i: usize| fields[i].as_u64();
                Some(RawUsage {
                    input: f(0),
                    cache_read: f(1),
                    cache_write: f(2),
                    output: f(3),
                    reasoning: f(4),
                    total: f(5),
                })
            }
            _ => return None,
        };
        let kept = meta.get("kept")?.as_bool()?;
        // Absent from records written before it was kept.
        let request = meta
            .get("request")
            .and_then(Value::as_str)
            .map(str::to_owned);
        Some(Self {
            status,
            headers,
            usage,
            body: kept.then_some(body),
            request,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_drops_transfer_headers() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("content-length", HeaderValue::from_static("12"));
        headers.insert("x-request-id", HeaderValue::from_static("req_1"));
        let usage = RawUsage {
            input: Some(10),
            output: Some(3),
            total: Some(13),
            ..RawUsage::default()
        };
        let record = Record::new(
            StatusCode::OK,
            &headers,
            Some(usage),
            Some(Bytes::from_static(b"{\"ok\":true}")),
        )
        .with_request_digest(Some("ab12".into()));
        assert!(record.headers().get("content-length").is_none());
        let decoded = Record::decode(
            record.encode_meta().as_bytes(),
            Bytes::from_static(b"{\"ok\":true}"),
        )
        .unwrap();
        assert_eq!(decoded, record);

        let unkept = Record::new(StatusCode::OK, &headers, None, None);
        let decoded = Record::decode(unkept.encode_meta().as_bytes(), Bytes::new()).unwrap();
        assert_eq!(decoded.body(), None);
    }

    #[test]
    fn foreign_metadata_is_refused_not_trusted() {
        for bad in [
            &b""[..],
            b"{}",
            b"[1]",
            br#"{"status":99,"headers":[],"usage":null,"kept":true}"#,
            br#"{"status":200,"headers":[["bad name","v"]],"usage":null,"kept":true}"#,
            br#"{"status":200,"headers":[],"usage":[1],"kept":true}"#,
        ] {
            assert_eq!(Record::decode(bad, Bytes::new()), None);
        }
    }
}
