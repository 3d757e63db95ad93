//! Attributing a group's real usage to its items, so that per-item figures add up to the
//! provider's.

/// Splits `total` in proportion to `weights` by the largest remainder: the parts add up to
/// `total` exactly. Zero weights everywhere split it evenly (the first parts take the
/// remainder).
pub(crate) fn distribute(total: u64, weights: &[u64]) -> Vec<u64> {
    if weights.is_empty() {
        return Vec::new();
    }
    let sum: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    let even;
    let (weights, sum) = if sum == 0 {
        even = vec![1; weights.len()];
        (&even[..], weights.len() as u128)
    } else {
        (weights, sum)
    };
    let total = u128::from(total);
    let mut parts: Vec<(u64, u128, usize)> = weights
        .iter()
        .enumerate()
        .map(|(i, &w)| {
            let exact = total * u128::from(w);
            // A part is at most `total`, which fits a u64.
            ((exact / sum) as u64, exact % sum, i)
        })
        .collect();
    let given: u128 = parts.iter().map(|p| u128::from(p.0)).sum();
    let mut left = (total - given) as usize;
    let mut by_remainder: Vec<usize> = (0..parts.len()).collect();
    by_remainder.sort_by(|&a, &b| parts[b].1.cmp(&parts[a].1).then(a.cmp(&b)));
    for &i in &by_remainder {
        if left == 0 {
            break;
        }
        parts[i].0 += 1;
        left -= 1;
    }
    parts.into_iter().map(|p| p.0).collect()
}

/// The input weights of a group's items: the shared part split evenly, each item's own part
/// whole (both scaled by the group's size, to stay in integers).
pub(crate) fn input_weights(shared: u64, items: &[u64]) -> Vec<u64> {
    let n = items.len() as u64;
    items
        .iter()
        .map(|&own| shared.saturating_add(own.saturating_mul(n)))
        .collect()
}

/// The output weights: each item's answer length, and what the answer holds beyond them (the
/// array's punctuation, prose, unknown elements) split evenly.
pub(crate) fn output_weights(answer_len: usize, items: &[usize]) -> Vec<u64> {
    let n = items.len() as u64;
    let own: usize = items.iter().sum();
    let rest = answer_len.saturating_sub(own) as u64;
    items
        .iter()
        .map(|&len| rest.saturating_add((len as u64).saturating_mul(n)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parts_follow_the_weights_and_add_up() {
        assert_eq!(distribute(10, &[1, 1]), [5, 5]);
        assert_eq!(distribute(10, &[1, 2, 2]), [2, 4, 4]);
        assert_eq!(distribute(7, &[1, 1, 1]), [3, 2, 2]);
        assert_eq!(distribute(5, &[0, 0]), [3, 2]);
        assert_eq!(distribute(0, &[3, 4]), [0, 0]);
        assert!(distribute(9, &[]).is_empty());
        assert_eq!(
            distribute(u64::MAX, &[u64::MAX, u64::MAX])
                .iter()
                .map(|&p| p as u128)
                .sum::<u128>(),
            u64::MAX as u128
        );
    }

    #[test]
    fn the_shared_part_is_split_evenly() {
        // 1,000 shared tokens and items of 100 and 300: 500 + 100 and 500 + 300.
        let weights = input_weights(1_000, &[100, 300]);
        assert_eq!(distribute(1_400, &weights), [600, 800]);
        // The answer's 10 characters of punctuation split evenly over 20 and 60.
        let weights = output_weights(90, &[20, 60]);
        assert_eq!(distribute(90, &weights), [25, 65]);
    }

    proptest! {
        #[test]
        fn parts_always_add_up(total in any::<u64>(), weights in proptest::collection::vec(any::<u64>(), 1..20)) {
            let parts = distribute(total, &weights);
            prop_assert_eq!(parts.len(), weights.len());
            prop_assert_eq!(parts.iter().map(|&p| u128::from(p)).sum::<u128>(), u128::from(total));
        }
    }
}
