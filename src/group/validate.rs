//! Checking each item's answer.

use std::fmt;

use serde_json::Value;

use super::item::GroupItem;

/// Checks one item's element of a group's answer (an object whose `id` is the item's) and turns
/// it into the item's result, or says why it is not acceptable: the item is then sent again.
///
/// Parse, check a schema, compare with the item: whatever makes the answer usable. The trait
/// is object safe for a given `Output`.
pub trait Validator: Send + Sync + 'static {
    /// An item's result.
    type Output: Send + 'static;

    /// The result of `item` from `answer`, or why the answer is not acceptable.
    fn validate(&self, item: &GroupItem, answer: &Value) -> Result<Self::Output, String>;
}

/// A [`Validator`] from a closure (a newtype, so that closures do not need a blanket impl).
///
/// # Example
///
/// ```
/// use serde_json::{Value, json};
/// use tower_llm_quota::group::{GroupItem, ValidateFn, Validator};
///
/// let labels = ValidateFn::new(|_item: &GroupItem, answer: &Value| {
///     match answer["label"].as_str() {
///         Some(label @ ("billing" | "bug" | "other")) => Ok(label.to_owned()),
///         _ => Err(String::from("no known label")),
///     }
/// });
/// let item = GroupItem::new("t1", "...");
/// assert_eq!(labels.validate(&item, &json!({"id": "t1", "label": "bug"})), Ok("bug".into()));
/// assert!(labels.validate(&item, &json!({"id": "t1", "label": "?"})).is_err());
/// ```
pub struct ValidateFn<F>(F);

impl<F> ValidateFn<F> {
    /// The validator `f`.
    pub fn new(f: F) -> Self {
        Self(f)
    }
}

impl<F> fmt::Debug for ValidateFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ValidateFn").finish_non_exhaustive()
    }
}

impl<F, T> Validator for ValidateFn<F>
where
    F: Fn(&GroupItem, &Value) -> Result<T, String> + Send + Sync + 'static,
    T: Send + 'static,
{
    type Output = T;

    fn validate(&self, item: &GroupItem, answer: &Value) -> Result<T, String> {
        (self.0)(item, answer)
    }
}

/// The default [`Validator`], for the default template: the element's `answer` field, which
/// must be present and neither `null` nor an empty string.
#[derive(Debug, Clone, Copy, Default)]
pub struct AnswerField;

impl Validator for AnswerField {
    type Output = Value;

    fn validate(&self, _item: &GroupItem, answer: &Value) -> Result<Value, String> {
        match answer.get("answer") {
            None | Some(Value::Null) => Err(String::from("the answer has no `answer`")),
            Some(Value::String(s)) if s.trim().is_empty() => {
                Err(String::from("the answer's `answer` is empty"))
            }
            Some(value) => Ok(value.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_answer_field_must_hold_something() {
        let item = GroupItem::new("a", "");
        assert_eq!(
            AnswerField.validate(&item, &json!({"id": "a", "answer": "ok"})),
            Ok(json!("ok"))
        );
        for bad in [
            json!({"id": "a"}),
            json!({"id": "a", "answer": null}),
            json!({"id": "a", "answer": " "}),
        ] {
            assert!(AnswerField.validate(&item, &bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_validator_is_object_safe() {
        fn _object_safe(_: &dyn Validator<Output = Value>) {}
    }
}
