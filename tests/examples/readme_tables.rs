//! The README's tables of the batch story have the shape the example prints: the same rows,
//! in the same order, under the same columns (the figures are the maintainers' run, pasted).

use tower_llm_quota_test_support as support;

use std::process::Command;

/// The example's output with `args`.
fn run_example(args: &[&str]) -> String {
    let output = Command::new(support::batch_example())
        .args(args)
        .output()
        .expect("the example runs");
    let stdout = String::from_utf8(output.stdout).expect("UTF-8");
    assert!(
        output.status.success(),
        "the example failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The rows of a table printed as text: the lines from the one holding `header` to the first
/// empty line or `end`, each cut into its label and its cells (split at runs of two spaces).
fn text_rows(text: &str, header: &str, end: &str) -> Vec<Vec<String>> {
    let start = text
        .lines()
        .position(|line| line.contains(header))
        .unwrap_or_else(|| panic!("no line holds {header:?} in:\n{text}"));
    text.lines()
        .skip(start)
        .take_while(|line| !line.trim().is_empty() && !line.starts_with(end))
        .map(|line| {
            line.split("  ")
                .map(str::trim)
                .filter(|cell| !cell.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .collect()
}

/// The labels of `rows`: each row's first cell (the header row's cells).
fn shape(rows: &[Vec<String>]) -> Vec<String> {
    let mut shape = rows[0].clone();
    shape.extend(rows[1..].iter().map(|row| row[0].clone()));
    shape
}

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap()
}

/// The README's `text` block after `heading`.
fn readme_block(heading: &str) -> String {
    let readme = readme();
    let after = &readme[readme.find(heading).expect("the heading")..];
    let start = after.find("```text\n").expect("a text block") + "```text\n".len();
    let end = after[start..].find("```").unwrap();
    after[start..start + end].to_owned()
}

#[test]
fn the_story_table_has_the_rows_the_example_prints() {
    let printed = run_example(&["--items", "40", "--seed", "3"]);
    let printed = shape(&text_rows(
        &printed,
        "naive (join_all)",
        "theoretical minimum",
    ));
    let readme = readme_block("## The story: a batch job against a simulated provider");
    let readme = shape(&text_rows(
        &readme,
        "naive (join_all)",
        "theoretical minimum",
    ));
    assert_eq!(
        readme, printed,
        "the README's story table and the example's differ"
    );
}

#[test]
fn the_grouping_table_has_the_rows_the_example_prints() {
    let printed = run_example(&["--group", "10", "--items", "30", "--seed", "3"]);
    let printed: Vec<String> = text_rows(&printed, "one per call", "grouped:")
        .iter()
        .skip(1)
        .map(|row| row[0].clone())
        .collect();
    // The README's markdown table under the grouping section.
    let readme = readme();
    let section = &readme[readme.find("## Grouping: many items in one call").unwrap()..];
    let table = &section[section.find("| | one per call | groups of 10 |").unwrap()..];
    let labels: Vec<String> = table
        .lines()
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .map(|line| line.split('|').nth(1).unwrap().trim().to_owned())
        .collect();
    assert_eq!(
        labels, printed,
        "the README's grouping table and the example's differ"
    );
}
