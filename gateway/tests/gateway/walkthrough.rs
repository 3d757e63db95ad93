//! The operator's walk-through of the gateway's README, run as written: each `curl` line of
//! its section, against the configuration it starts, each answer checked against the `# →`
//! line below it (the status, and text the answer holds).

use crate::support::Running;

/// A command of the walk-through and what it must answer.
struct Step {
    command: String,
    status: u16,
    holds: Vec<String>,
}

/// The `curl` lines of the README's walk-through section, each with its `# →` line.
fn steps(readme: &str) -> Vec<Step> {
    let section = readme
        .split("## An operator's walk-through\n")
        .nth(1)
        .expect("the README has the walk-through")
        .split("\n## ")
        .next()
        .unwrap();
    let mut steps = Vec::new();
    let mut lines = section.lines().peekable();
    while let Some(line) = lines.next() {
        if !line.starts_with("curl ") {
            continue;
        }
        let expected = lines
            .next()
            .and_then(|l| l.strip_prefix("# → "))
            .unwrap_or_else(|| panic!("no `# →` line after {line}"));
        let (status, rest) = expected.split_once(' ').unwrap_or((expected, ""));
        steps.push(Step {
            command: line.to_owned(),
            status: status.parse().expect("a status"),
            holds: quoted(rest),
        });
    }
    steps
}

/// The double-quoted strings of `text`, `\"` and `\\` unescaped.
fn quoted(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '"' {
            continue;
        }
        let mut string = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => string.extend(chars.next()),
                '"' => break,
                c => string.push(c),
            }
        }
        found.push(string);
    }
    found
}

#[test]
fn the_steps_read_as_written() {
    let steps = steps(
        "## An operator's walk-through\n```sh\ncurl -s $GW/x\n# → 404 \"a \\\"b\\\"\" \"c\"\n```\n## Next\ncurl -s $GW/y\n",
    );
    assert_eq!(steps.len(), 1, "the section ends at the next heading");
    assert_eq!(
        (steps[0].command.as_str(), steps[0].status),
        ("curl -s $GW/x", 404)
    );
    assert_eq!(steps[0].holds, ["a \"b\"", "c"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walkthrough_runs_as_written() {
    if std::process::Command::new("curl")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("skipped: no curl on the PATH");
        return;
    }
    let readme = include_str!("../../README.md");
    let steps = steps(readme);
    assert!(steps.len() >= 9, "the walk-through has its steps");
    let gateway = Running::start(include_str!("../../docs/walkthrough.toml")).await;
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    for step in &steps {
        let command = format!("{} -w '\\n%{{http_code}}'", step.command);
        let url = gateway.url.clone();
        let output = tokio::task::spawn_blocking(move || {
            std::process::Command::new("sh")
                .arg("-c")
                .arg(&command)
                .current_dir(root)
                .env("GW", url)
                .env("ADMIN", "walkthrough-admin")
                .env("KEY", "walkthrough-key")
                .output()
        })
        .await
        .unwrap()
        .unwrap();
        let text = String::from_utf8_lossy(&output.stdout);
        let (body, status) = text.trim_end().rsplit_once('\n').unwrap_or(("", &text));
        assert_eq!(
            status.trim().parse::<u16>().ok(),
            Some(step.status),
            "{}\n{text}{}",
            step.command,
            String::from_utf8_lossy(&output.stderr)
        );
        for held in &step.holds {
            assert!(
                body.contains(held.as_str()),
                "{}: {held} not in {body}",
                step.command
            );
        }
    }
    gateway.stop().await;
}
