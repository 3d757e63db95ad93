//! A request's tenant path: its scopes from the provider account down.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// The scopes a request belongs to, below the provider account: for example organisation /
/// team / API key / model profile, written `acme/search/key-7/chat`.
///
/// Put one in a request's extensions; a [`Budget`](crate::Budget) built with a
/// [`TenantTree`](super::TenantTree) admits the request only when the account and every node
/// on its path can pay. A request without one belongs to the tree's
/// [default tenant](super::TenantTree::default_tenant). A [`Ramp`](crate::routing::Ramp) for a
/// tenant moves the requests within its scope (the node and everything below it).
///
/// Cheap to clone (one reference count); compared and hashed by its text.
///
/// # Example
///
/// ```
/// use tower_llm_quota::tenant::Tenant;
///
/// let key: Tenant = "acme/search/key-7".parse()?;
/// assert_eq!(key.depth(), 3);
/// assert_eq!(key.segments().collect::<Vec<_>>(), ["acme", "search", "key-7"]);
/// assert!(key.is_within(&"acme/search".parse()?));
/// assert!(!key.is_within(&"acme/sea".parse()?));
/// assert_eq!(key.parent().unwrap().as_str(), "acme/search");
/// # Ok::<(), tower_llm_quota::tenant::InvalidTenant>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tenant(Arc<str>);

/// A tenant path that cannot be: empty, or with a segment that is empty, `.` or `..`, or holds
/// `/`, whitespace or a control character.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidTenant(pub(crate) &'static str);

impl fmt::Display for InvalidTenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid tenant path: {}", self.0)
    }
}

impl std::error::Error for InvalidTenant {}

/// The separator of a path's segments.
const SEPARATOR: char = '/';

impl Tenant {
    /// A path from its segments, from the account down.
    ///
    /// Fails when there is no segment, or a segment is not a name: empty, `.` or `..`, or
    /// holding `/`, whitespace or a control character.
    pub fn new<I, S>(segments: I) -> Result<Self, InvalidTenant>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut text = String::new();
        for segment in segments {
            let segment = segment.as_ref();
            check_segment(segment)?;
            if !text.is_empty() {
                text.push(SEPARATOR);
            }
            text.push_str(segment);
        }
        if text.is_empty() {
            return Err(InvalidTenant("a tenant path has at least one segment"));
        }
        Ok(Tenant(text.into()))
    }

    /// A path written with `/` between its segments (`acme/search/key-7`).
    ///
    /// Fails when it is empty, or a segment is not a name (as [`new`](Self::new) says).
    pub fn parse(text: &str) -> Result<Self, InvalidTenant> {
        if text.is_empty() {
            return Err(InvalidTenant("a tenant path has at least one segment"));
        }
        for segment in text.split(SEPARATOR) {
            check_segment(segment)?;
        }
        Ok(Tenant(text.into()))
    }

    /// The scope of an account's own caps ([`Quota::with_cap`](crate::Quota::with_cap)): `/`
    /// and the account's name, never a valid path, so that it names no node of a tree.
    pub(crate) fn account(name: &str) -> Tenant {
        Tenant(format!("{SEPARATOR}{name}").into())
    }

    /// The account's name, when this is the scope of an account's own caps.
    pub(crate) fn account_name(&self) -> Option<&str> {
        self.0.strip_prefix(SEPARATOR)
    }

    /// The path as written, segments separated by `/`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The segments, from the account down.
    pub fn segments(&self) -> impl Iterator<Item = &str> + '_ {
        self.0.split(SEPARATOR)
    }

    /// How many segments the path has (1 for a top-level tenant).
    pub fn depth(&self) -> usize {
        self.0.split(SEPARATOR).count()
    }

    /// The path one level up, unless this is a top-level tenant.
    pub fn parent(&self) -> Option<Tenant> {
        self.0
            .rfind(SEPARATOR)
            .map(|end| Tenant(self.0[..end].into()))
    }

    /// The path of a child of this node.
    ///
    /// Fails when `segment` is not a name (as [`new`](Self::new) says).
    pub fn child(&self, segment: &str) -> Result<Tenant, InvalidTenant> {
        check_segment(segment)?;
        Ok(Tenant(format!("{}{SEPARATOR}{segment}", self.0).into()))
    }

    /// Whether this path is `scope` or lies below it.
    pub fn is_within(&self, scope: &Tenant) -> bool {
        within(&self.0, &scope.0)
    }

    /// The first `depth` segments as text (the whole path when it is shorter).
    pub fn prefix(&self, depth: usize) -> &str {
        self.prefixes()
            .nth(depth.saturating_sub(1))
            .unwrap_or(&self.0)
    }

    /// Every prefix of the path, from the top-level tenant to the whole path, as text; no
    /// allocation: the scopes whose limits and caps hold over the path.
    ///
    /// ```
    /// use tower_llm_quota::tenant::Tenant;
    ///
    /// let path = Tenant::parse("acme/search/key-1").unwrap();
    /// let scopes: Vec<&str> = path.prefixes().collect();
    /// assert_eq!(scopes, ["acme", "acme/search", "acme/search/key-1"]);
    /// ```
    pub fn prefixes(&self) -> impl Iterator<Item = &str> + '_ {
        let text: &str = &self.0;
        text.match_indices(SEPARATOR)
            .map(move |(end, _)| &text[..end])
            .chain(std::iter::once(text))
    }
}

/// Whether `path` is `scope` or lies below it, at a segment boundary.
pub(crate) fn within(path: &str, scope: &str) -> bool {
    path.strip_prefix(scope)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(SEPARATOR))
}

fn check_segment(segment: &str) -> Result<(), InvalidTenant> {
    if segment.is_empty() {
        return Err(InvalidTenant("a tenant path has no empty segment"));
    }
    if segment.contains(SEPARATOR) {
        return Err(InvalidTenant("a tenant segment contains no `/`"));
    }
    if segment == "." || segment == ".." {
        return Err(InvalidTenant("a tenant segment is not `.` or `..`"));
    }
    if segment.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(InvalidTenant(
            "a tenant segment holds no whitespace or control character",
        ));
    }
    Ok(())
}

// Lookups by a prefix's text, with no allocation: hashed and compared as its text, as the
// derived `Hash` and `Eq` of `Arc<str>` do.
impl std::borrow::Borrow<str> for Tenant {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&Tenant> for Tenant {
    fn from(tenant: &Tenant) -> Self {
        tenant.clone()
    }
}

impl FromStr for Tenant {
    type Err = InvalidTenant;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Tenant::parse(text)
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Tenant").field(&&*self.0).finish()
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for Tenant {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Tenant {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        Tenant::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_walk() {
        let path = Tenant::parse("a/b/c").unwrap();
        assert_eq!(path.prefixes().collect::<Vec<_>>(), ["a", "a/b", "a/b/c"]);
        assert_eq!(path.prefix(2), "a/b");
        assert_eq!(path.prefix(9), "a/b/c");
        assert_eq!(Tenant::new(["a", "b", "c"]).unwrap(), path);
        assert_eq!(path.parent().unwrap().parent().unwrap().parent(), None);
        assert_eq!(path.child("d").unwrap().as_str(), "a/b/c/d");
    }

    #[test]
    fn bad_paths_are_refused() {
        for bad in [
            "",
            "/",
            "a//b",
            "a/",
            "/a",
            "a/..",
            "./a",
            "a b",
            "a/\tb",
            "a/b\u{7f}",
        ] {
            assert!(Tenant::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Tenant::new(["a/b"]).is_err());
        assert!(Tenant::new(Vec::<&str>::new()).is_err());
    }

    #[test]
    fn scopes_end_at_segment_boundaries() {
        let key = Tenant::parse("acme/search").unwrap();
        assert!(key.is_within(&Tenant::parse("acme").unwrap()));
        assert!(key.is_within(&key));
        assert!(!key.is_within(&Tenant::parse("ac").unwrap()));
        assert!(!Tenant::parse("acme").unwrap().is_within(&key));
    }
}
