//! Answers to grouped prompts: a JSON array with one object per item, and the faults a model
//! makes with them.

use super::config::GroupFaults;
use super::wire::{self, Fnv};

/// The characters of an answer object's frame: `{"id":"","answer":""}` and a comma.
const FRAME_CHARS: u64 = 23;

/// The answer to a grouped prompt of `ids` within `max_tokens`: a JSON array, one object
/// `{"id", "answer"}` per item (the answer's length is the completion share of the item's part
/// of `max_tokens`, chosen by a hash of its id and the seed), with `faults` drawn from `rng`.
/// Returns the text (cut at `max_tokens`) and its tokens.
pub(crate) fn answer(
    ids: &[String],
    max_tokens: u64,
    share: (f64, f64),
    seed: u64,
    faults: GroupFaults,
    rng: &mut fastrand::Rng,
) -> (String, u64) {
    let n = ids.len() as u64;
    let per_item = (max_tokens / n.max(1)).max(1);
    let grow = faults.per_extra_item * (n.saturating_sub(1)) as f64;
    let mut elements = Vec::with_capacity(ids.len());
    for id in ids {
        // Four draws per item, whatever happens to it.
        let (missing, wrong, invalid, grown) = (rng.f64(), rng.f64(), rng.f64(), rng.f64());
        if missing < faults.missing {
            continue;
        }
        let id_chars = id.chars().count() as u64;
        let frame = (FRAME_CHARS + id_chars).div_ceil(4);
        let mut hash = Fnv::new();
        hash.write(id.as_bytes());
        let words = wire::completion_tokens(
            per_item.saturating_sub(frame).max(1),
            share,
            hash.finish(),
            seed,
        );
        let id = if wrong < faults.wrong_id {
            format!("{id}-unknown")
        } else {
            id.clone()
        };
        let answer = if invalid < faults.invalid || grown < grow {
            serde_json::Value::Null
        } else {
            serde_json::Value::String(wire::generated_text(words, 0).trim_start().to_owned())
        };
        elements.push(serde_json::json!({"id": id, "answer": answer}));
    }
    let mut text = serde_json::Value::Array(elements).to_string();
    if rng.f64() < faults.malformed {
        let cut = text.len() / 2;
        text.truncate(cut);
    }
    let limit = usize::try_from(max_tokens.saturating_mul(4)).unwrap_or(usize::MAX);
    if text.len() > limit {
        // The model ran out of tokens mid-array (ASCII ids aside, a char is a byte).
        let cut = text
            .char_indices()
            .nth(limit)
            .map_or(text.len(), |(i, _)| i);
        text.truncate(cut);
    }
    let tokens = wire::text_tokens(&text).clamp(1, max_tokens.max(1));
    (text, tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("t-{i}")).collect()
    }

    fn parse(text: &str) -> Vec<Value> {
        serde_json::from_str::<Value>(text)
            .expect("valid JSON")
            .as_array()
            .expect("an array")
            .clone()
    }

    #[test]
    fn every_item_is_answered_within_max_tokens() {
        let mut rng = fastrand::Rng::with_seed(1);
        let (text, tokens) = answer(
            &ids(10),
            1_000,
            (0.1, 1.0),
            7,
            GroupFaults::none(),
            &mut rng,
        );
        let elements = parse(&text);
        assert_eq!(elements.len(), 10);
        for (i, element) in elements.iter().enumerate() {
            assert_eq!(element["id"], format!("t-{i}"));
            assert!(element["answer"].as_str().is_some_and(|a| !a.is_empty()));
        }
        assert!(tokens <= 1_000);
        assert_eq!(tokens, wire::text_tokens(&text));
    }

    #[test]
    fn each_fault_shows_in_the_answer() {
        let mut rng = fastrand::Rng::with_seed(1);
        let all = |faults| {
            answer(
                &ids(4),
                800,
                (0.5, 0.5),
                0,
                faults,
                &mut fastrand::Rng::with_seed(3),
            )
            .0
        };
        assert!(serde_json::from_str::<Value>(&all(GroupFaults::none().malformed(1.0))).is_err());
        assert!(parse(&all(GroupFaults::none().missing(1.0))).is_empty());
        assert!(
            parse(&all(GroupFaults::none().wrong_id(1.0)))
                .iter()
                .all(|e| e["id"].as_str().unwrap().ends_with("-unknown"))
        );
        assert!(
            parse(&all(GroupFaults::none().invalid(1.0)))
                .iter()
                .all(|e| e["answer"].is_null())
        );
        // Grown errors: none alone, all in a group of 3 at 0.5 per extra item.
        let (alone, _) = answer(
            &ids(1),
            100,
            (0.5, 0.5),
            0,
            GroupFaults::none().per_extra_item(0.5),
            &mut rng,
        );
        assert!(parse(&alone)[0]["answer"].is_string());
        let (three, _) = answer(
            &ids(3),
            300,
            (0.5, 0.5),
            0,
            GroupFaults::none().per_extra_item(0.5),
            &mut rng,
        );
        assert!(parse(&three).iter().all(|e| e["answer"].is_null()));
    }

    #[test]
    fn an_answer_longer_than_max_tokens_is_cut() {
        let mut rng = fastrand::Rng::with_seed(1);
        let (text, tokens) = answer(&ids(50), 60, (1.0, 1.0), 0, GroupFaults::none(), &mut rng);
        assert_eq!(tokens, 60);
        assert!(text.chars().count() <= 240);
        assert!(
            serde_json::from_str::<Value>(&text).is_err(),
            "cut mid-array"
        );
    }
}
