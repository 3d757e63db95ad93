//! Helpers shared by the unit tests.

use http::HeaderMap;

/// A header map from `(name, value)` pairs.
pub(crate) fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    pairs
        .iter()
        .map(|(k, v)| (k.parse().unwrap(), v.parse().unwrap()))
        .collect()
}
