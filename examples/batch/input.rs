//! Work items read from a JSON Lines file.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tower_llm_quota::Priority;

use crate::workload::Item;

/// The latest arrival accepted: a week after the start.
const MAX_ARRIVE_MS: u64 = 7 * 24 * 3_600 * 1_000;

/// A line of the input that cannot be used, with its number.
#[derive(Debug)]
pub(crate) struct InputError {
    line: usize,
    reason: String,
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

impl std::error::Error for InputError {}

/// Reads `path`: one object a line with `id`, `prompt`, `max_tokens`, `priority`
/// (`interactive`, `async` or `batch`) and an optional `arrive_ms`. Blank lines are skipped.
pub(crate) fn read_items(path: &Path) -> Result<Vec<Item>, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
    let mut items = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let item = parse_line(line).map_err(|reason| InputError {
            line: index + 1,
            reason,
        })?;
        items.push(item);
    }
    if items.is_empty() {
        return Err(format!("{} holds no items", path.display()).into());
    }
    Ok(items)
}

fn parse_line(line: &str) -> Result<Item, String> {
    let value: Value = serde_json::from_str(line).map_err(|error| format!("not JSON: {error}"))?;
    let id = match &value["id"] {
        Value::String(id) => id.clone(),
        Value::Number(id) => id.to_string(),
        _ => return Err("`id` must be a string or a number".into()),
    };
    let prompt = value["prompt"]
        .as_str()
        .ok_or("`prompt` must be a string")?;
    let max_tokens = value["max_tokens"]
        .as_u64()
        .filter(|&n| n > 0)
        .ok_or("`max_tokens` must be a positive integer")?;
    let priority = value["priority"]
        .as_str()
        .and_then(|name| name.parse::<Priority>().ok())
        .ok_or("`priority` must be \"interactive\", \"async\" or \"batch\"")?;
    let arrive = match &value["arrive_ms"] {
        Value::Null => Duration::ZERO,
        other => Duration::from_millis(
            other
                .as_u64()
                .filter(|&ms| ms <= MAX_ARRIVE_MS)
                .ok_or("`arrive_ms` must be an integer from 0 to 604800000 (a week)")?,
        ),
    };
    Ok(Item::new(id, prompt, max_tokens, priority, arrive))
}
