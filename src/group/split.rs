//! Splitting a group's answer back into one answer per item.

use serde_json::Value;

/// What a group's answer says of one of its items.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Found {
    /// One element names the item: the element, and its length in the answer's text.
    Answered(Value, usize),
    /// No element names the item.
    Missing,
    /// Several elements name the item.
    Duplicated,
}

/// A group's answer split by item.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Split {
    /// No JSON array could be read from the answer.
    Malformed(String),
    /// One entry per item of the group, in order, and how many elements named no item.
    Items { found: Vec<Found>, unknown: usize },
}

/// Splits `answer` (the model's text) for the items `ids`.
///
/// The array is read from the first `[` to the last `]` (so a fenced ```` ```json ```` block or
/// a sentence around it does not matter), or from an object holding one array (what a JSON
/// mode that insists on objects gives, `{"items": [...]}`). Each element must be an object
/// whose `id` is a string or a number equal to an item's id.
pub(crate) fn split(answer: &str, ids: &[&str]) -> Split {
    let elements = match read_array(answer) {
        Ok(elements) => elements,
        Err(why) => return Split::Malformed(why),
    };
    let mut found: Vec<Found> = vec![Found::Missing; ids.len()];
    let mut unknown = 0;
    for element in elements {
        let id = match element.get("id") {
            Some(Value::String(id)) => id.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => {
                unknown += 1;
                continue;
            }
        };
        let Some(index) = ids.iter().position(|known| *known == id) else {
            unknown += 1;
            continue;
        };
        found[index] = match &found[index] {
            Found::Missing => {
                let length = element.to_string().len();
                Found::Answered(element, length)
            }
            Found::Answered(..) | Found::Duplicated => Found::Duplicated,
        };
    }
    Split::Items { found, unknown }
}

fn read_array(answer: &str) -> Result<Vec<Value>, String> {
    let start = answer
        .find(['[', '{'])
        .ok_or_else(|| String::from("the answer holds no JSON array"))?;
    let close = if answer[start..].starts_with('[') {
        ']'
    } else {
        '}'
    };
    let end = answer
        .rfind(close)
        .filter(|&end| end > start)
        .ok_or_else(|| String::from("the answer's JSON is cut short"))?;
    let parsed = serde_json::from_str::<Value>(&answer[start..=end])
        .map_err(|error| format!("the answer is not valid JSON: {error}"))?;
    match parsed {
        Value::Array(elements) => Ok(elements),
        Value::Object(object) => {
            let mut arrays = object.into_iter().filter_map(|(_, v)| match v {
                Value::Array(elements) => Some(elements),
                _ => None,
            });
            match (arrays.next(), arrays.next()) {
                (Some(elements), None) => Ok(elements),
                _ => Err(String::from(
                    "the answer is an object without exactly one array in it",
                )),
            }
        }
        _ => Err(String::from("the answer is not a JSON array")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn items(split: Split) -> (Vec<Found>, usize) {
        match split {
            Split::Items { found, unknown } => (found, unknown),
            Split::Malformed(why) => panic!("malformed: {why}"),
        }
    }

    #[test]
    fn each_item_gets_its_element_whatever_the_order() {
        let answer = r#"[{"id":"b","answer":2},{"id":"a","answer":1}]"#;
        let (found, unknown) = items(split(answer, &["a", "b"]));
        assert_eq!(unknown, 0);
        assert_eq!(
            found[0],
            Found::Answered(json!({"id": "a", "answer": 1}), 21)
        );
        assert!(matches!(&found[1], Found::Answered(v, _) if v["answer"] == 2));
    }

    #[test]
    fn missing_duplicated_and_unknown_ids_are_told_apart() {
        let answer = r#"[{"id":"a"},{"id":"a"},{"id":"zz"},{"answer":1},3,{"id":7}]"#;
        let (found, unknown) = items(split(answer, &["a", "b", "7"]));
        assert_eq!(found[0], Found::Duplicated);
        assert_eq!(found[1], Found::Missing);
        assert!(
            matches!(found[2], Found::Answered(..)),
            "a numeric id matches"
        );
        assert_eq!(unknown, 3);
    }

    #[test]
    fn fences_prose_and_wrapping_objects_are_read_through() {
        let fenced = "Here you are:\n```json\n[{\"id\":\"a\",\"answer\":\"x\"}]\n```";
        assert!(matches!(
            items(split(fenced, &["a"])).0[0],
            Found::Answered(..)
        ));
        let wrapped = r#"{"items":[{"id":"a","answer":"x"}]}"#;
        assert!(matches!(
            items(split(wrapped, &["a"])).0[0],
            Found::Answered(..)
        ));
    }

    #[test]
    fn an_answer_without_an_array_is_malformed() {
        for answer in [
            "",
            "no json here",
            r#"[{"id":"a","answer":"cut"#,
            r#"{"a":1}"#,
            r#"{"a":[],"b":[]}"#,
            "42",
        ] {
            assert!(
                matches!(split(answer, &["a"]), Split::Malformed(_)),
                "{answer:?}"
            );
        }
    }
}
