//! The operations files shipped in `gateway/ops/`: the alerting rules pass `promtool check
//! rules` and their unit tests (`promtool test rules`); the Grafana dashboard is JSON whose
//! every query is valid PromQL; and every series the rules and the dashboard name is one the
//! gateway or the crate emits.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn ops(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("ops").join(file)
}

/// Runs promtool with `args`; `None` when it is not installed (and not required).
fn promtool(args: &[&str]) -> Option<std::process::Output> {
    match Command::new("promtool").args(args).output() {
        Ok(output) => Some(output),
        Err(_) => {
            assert!(
                std::env::var_os("PROMTOOL_REQUIRED").is_none(),
                "PROMTOOL_REQUIRED is set but promtool does not run"
            );
            println!("skipped: no promtool (Debian's `prometheus` package provides it)");
            None
        }
    }
}

fn succeeded(output: &std::process::Output, what: &str) {
    assert!(
        output.status.success(),
        "{what}:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn the_alerting_rules_check_and_pass_their_unit_tests() {
    let rules = ops("alerts.yml");
    let Some(checked) = promtool(&["check", "rules", rules.to_str().unwrap()]) else {
        return;
    };
    succeeded(&checked, "promtool check rules");
    let tests = ops("alerts_test.yml");
    let tested = promtool(&["test", "rules", tests.to_str().unwrap()]).unwrap();
    succeeded(&tested, "promtool test rules");
}

/// Every query of the dashboard's panels.
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(ops("dashboard.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10, "{} panels", panels.len());
    let mut queries = Vec::new();
    for panel in panels {
        let title = panel["title"].as_str().expect("a title").to_owned();
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for target in targets {
            let expr = target["expr"].as_str().expect("an expr").to_owned();
            queries.push((title.clone(), expr));
        }
    }
    queries
}

#[test]
fn every_dashboard_query_is_valid_promql() {
    let queries = dashboard_queries();
    // promtool parses PromQL in rules: each query as a recording rule.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in queries.iter().enumerate() {
        let expr = serde_json::to_string(expr).unwrap();
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {expr}\n"
        ));
    }
    let file = std::env::temp_dir().join(format!("dashboard-rules-{}.yml", std::process::id()));
    std::fs::write(&file, rules).unwrap();
    let Some(checked) = promtool(&["check", "rules", file.to_str().unwrap()]) else {
        return;
    };
    std::fs::remove_file(&file).ok();
    succeeded(&checked, "the dashboard's queries");
}

/// Every `.rs` file under `dir`, read.
fn sources(dir: &Path, out: &mut String) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
}

/// The series names (`gateway_*`, `llm_*`) in `text`, a histogram's `_bucket` taken off.
fn series_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let is_name = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_';
    let mut i = 0;
    while i < bytes.len() {
        let starts = (text[i..].starts_with("gateway_") || text[i..].starts_with("llm_"))
            && (i == 0 || !is_name(bytes[i - 1]));
        if !starts {
            i += 1;
            continue;
        }
        let end = (i..bytes.len())
            .find(|&j| !is_name(bytes[j]))
            .unwrap_or(bytes.len());
        let name = &text[i..end];
        names.insert(name.strip_suffix("_bucket").unwrap_or(name).to_owned());
        i = end;
    }
    names
}

#[test]
fn the_rules_and_the_dashboard_name_only_series_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut code = String::new();
    sources(&root.join("src"), &mut code);
    sources(&root.join("../src"), &mut code);
    let mut named = series_names(&std::fs::read_to_string(ops("alerts.yml")).unwrap());
    for (_, expr) in dashboard_queries() {
        named.extend(series_names(&expr));
    }
    // Recording rules' own names are not series.
    named.retain(|name| !name.starts_with("dashboard"));
    assert!(named.len() >= 12, "{named:?}");
    let missing: Vec<&String> = named
        .iter()
        .filter(|name| !code.contains(&format!("\"{name}\"")))
        .collect();
    assert!(missing.is_empty(), "no code emits {missing:?}");
    // The check itself, on a planted misspelling.
    let planted = series_names("sum(rate(gateway_account_queue[5m]))");
    assert!(
        planted
            .iter()
            .any(|name| !code.contains(&format!("\"{name}\""))),
        "a misspelt series passed"
    );
}
