//! "Did you mean": the known name nearest a misspelled one, for errors that name what the
//! gateway does not know (a tenant, a key, a model).

/// The candidate nearest `name` by edit distance (Levenshtein, over characters), when it is
/// near enough to be a likely misspelling: at most a third of the longer name's characters
/// apart, and at least one. Ties go to the first candidate.
pub(crate) fn nearest<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let name: Vec<char> = name.chars().collect();
    candidates
        .into_iter()
        .filter_map(|candidate| {
            let other: Vec<char> = candidate.chars().collect();
            let distance = distance(&name, &other);
            let near = (name.len().max(other.len()) / 3).max(1);
            (distance > 0 && distance <= near).then_some((distance, candidate))
        })
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

/// ` (did you mean `x`?)` when a candidate is near `name`, else nothing.
pub(crate) fn hint<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    nearest(name, candidates).map_or_else(String::new, |near| format!(" (did you mean `{near}`?)"))
}

/// The edit distance of `a` and `b`: insertions, deletions and substitutions, one row kept.
fn distance(a: &[char], b: &[char]) -> usize {
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substituted = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substituted.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distances() {
        let d = |a: &str, b: &str| {
            distance(
                &a.chars().collect::<Vec<_>>(),
                &b.chars().collect::<Vec<_>>(),
            )
        };
        assert_eq!(d("", "abc"), 3);
        assert_eq!(d("kitten", "sitting"), 3);
        assert_eq!(d("acme/wbe", "acme/web"), 2);
        assert_eq!(d("same", "same"), 0);
    }

    #[test]
    fn suggests_only_near_names() {
        let known = ["acme", "acme/web", "acme/search", "globex"];
        assert_eq!(nearest("acme/wbe", known), Some("acme/web"));
        assert_eq!(nearest("globx", known), Some("globex"));
        assert_eq!(nearest("nosuch", known), None);
        assert_eq!(nearest("acme", known), None, "itself is not a suggestion");
        assert_eq!(hint("acme/serch", known), " (did you mean `acme/search`?)");
        assert_eq!(hint("zzz", known), "");
    }
}
