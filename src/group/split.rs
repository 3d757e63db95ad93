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
/// The answer is the first JSON value in the text that is an array of objects (or an object
/// holding exactly one such array, what a JSON mode that insists on objects gives,
/// `{"items": [...]}`), read wherever it starts: after prose ("Answers [2 items]: ..."),
/// inside a fenced ```` ```json ```` block, before trailing text. Each element must be an
/// object whose `id` is a string or a number equal to an item's id.
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

/// Places in an answer tried as the start of its JSON, at most: prose holding many brackets
/// costs no more than this many parses.
const MAX_STARTS: usize = 64;

/// The elements of the first array of objects in `answer` (see [`split`]), or why there is
/// none: the first parse error met, or what the values found were.
fn read_array(answer: &str) -> Result<Vec<Value>, String> {
    let mut first_error = None;
    let mut from = 0;
    for _ in 0..MAX_STARTS {
        let Some(start) = answer[from..].find(['[', '{']).map(|at| from + at) else {
            break;
        };
        // One value from here; whatever follows it (a closing fence, a sentence) is ignored.
        let mut values = serde_json::Deserializer::from_str(&answer[start..]).into_iter::<Value>();
        match values.next() {
            Some(Ok(value)) => {
                if let Some(elements) = answers_in(value) {
                    return Ok(elements);
                }
                // A value, but not the answer (`[1, 2]`, `{"a": []}`): what it holds is not
                // read apart.
                from = start + values.byte_offset().max(1);
            }
            Some(Err(error)) => {
                first_error.get_or_insert_with(|| {
                    if error.is_eof() {
                        String::from("the answer's JSON is cut short")
                    } else {
                        format!("the answer is not valid JSON: {error}")
                    }
                });
                from = start + 1;
            }
            None => from = start + 1,
        }
    }
    Err(first_error.unwrap_or_else(|| String::from("the answer holds no JSON array of objects")))
}

/// The elements of `value` when it is an array of objects (an empty one included), or an
/// object holding exactly one array.
fn answers_in(value: Value) -> Option<Vec<Value>> {
    let objects = |elements: &[Value]| elements.iter().all(Value::is_object);
    match value {
        Value::Array(elements) if objects(&elements) => Some(elements),
        Value::Object(object) => {
            let mut arrays = object.into_iter().filter_map(|(_, v)| match v {
                Value::Array(elements) => Some(elements),
                _ => None,
            });
            match (arrays.next(), arrays.next()) {
                (Some(elements), None) if objects(&elements) => Some(elements),
                _ => None,
            }
        }
        _ => None,
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
        let answer = r#"[{"id":"a"},{"id":"a"},{"id":"zz"},{"answer":1},{"id":7}]"#;
        let (found, unknown) = items(split(answer, &["a", "b", "7"]));
        assert_eq!(found[0], Found::Duplicated);
        assert_eq!(found[1], Found::Missing);
        assert!(
            matches!(found[2], Found::Answered(..)),
            "a numeric id matches"
        );
        assert_eq!(unknown, 2);
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
        // Brackets in the prose before the JSON, and text after it.
        for answer in [
            "Answers [2 items]: [{\"id\":\"a\",\"answer\":\"x\"},{\"id\":\"b\",\"answer\":\"y\"}]",
            "[{\"id\":\"a\",\"answer\":\"x\"},{\"id\":\"b\",\"answer\":\"y\"}]\nHope this helps [really].",
            "Sure {see below}:\n```json\n[{\"id\":\"a\",\"answer\":\"x\"},{\"id\":\"b\",\"answer\":\"y\"}]\n``` Done.",
            "[1, 2] then {\"answers\": [{\"id\":\"a\",\"answer\":\"x\"},{\"id\":\"b\",\"answer\":\"y\"}]}",
        ] {
            let (found, unknown) = items(split(answer, &["a", "b"]));
            assert!(
                found.iter().all(|f| matches!(f, Found::Answered(..))) && unknown == 0,
                "{answer:?}: {found:?}"
            );
        }
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
            "[1, 2, 3]",
            "Answers [2 items]: none today",
        ] {
            assert!(
                matches!(split(answer, &["a"]), Split::Malformed(_)),
                "{answer:?}"
            );
        }
    }
}
