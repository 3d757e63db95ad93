//! The status page in a real browser: headless Chromium loads `/`, runs its script, and the
//! DOM it dumps shows every demo tenant with its numbers.

use std::process::Command;

use crate::support::{GLOBEX, REPORTS, Running, SEARCH, chat, demo, messages};

/// The first browser binary on the `PATH`.
fn browser() -> Option<&'static str> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|name| {
            Command::new(name)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

/// The number in the first cell of class `class` after the row of `tenant`.
fn cell(dom: &str, tenant: &str, class: &str) -> u64 {
    let row = &dom[dom
        .find(&format!("data-tenant=\"{tenant}\""))
        .unwrap_or_else(|| panic!("no row for {tenant}"))..];
    let row = &row[..row.find("</tr>").unwrap()];
    let needle = format!("class=\"n {class}\">");
    let cell = &row[row.find(&needle).unwrap() + needle.len()..];
    cell[..cell.find('<').unwrap()].parse().unwrap()
}

#[tokio::test]
async fn the_status_page_shows_every_tenant_after_traffic() {
    let Some(browser) = browser() else {
        println!("skipped: no chromium binary on the PATH (install Debian's `chromium`)");
        return;
    };
    let gateway = Running::start(&demo()).await;
    for (key, count) in [(SEARCH, 3), (REPORTS, 2), (GLOBEX, 1)] {
        for _ in 0..count {
            assert_eq!(
                gateway
                    .post("/v1/chat/completions", Some(key), &chat(20))
                    .await
                    .status(),
                200
            );
        }
    }
    assert_eq!(
        gateway
            .post("/v1/messages", Some(REPORTS), &messages(20))
            .await
            .status(),
        200
    );
    let url = format!("{}/", gateway.url);
    let output = tokio::task::spawn_blocking(move || {
        Command::new(browser)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
            ])
            .args(["--virtual-time-budget=3000", "--dump-dom", &url])
            .output()
    })
    .await
    .unwrap()
    .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let dom = String::from_utf8(output.stdout).unwrap();
    for (tenant, requests) in [
        ("acme", 6),
        ("acme/search", 3),
        ("acme/reports", 3),
        ("globex", 1),
    ] {
        assert_eq!(cell(&dom, tenant, "requests"), requests, "{tenant}");
        assert!(cell(&dom, tenant, "input") > 0, "{tenant}");
        assert!(cell(&dom, tenant, "output") > 0, "{tenant}");
        assert_eq!(cell(&dom, tenant, "local"), 0, "{tenant}");
    }
    assert!(dom.contains("data-account=\"openai-sim\""));
    gateway.stop().await;
}

/// Dumps the DOM of the page at `url` after its script ran; with `screenshot`, also saves a
/// picture of it there.
async fn dump(browser: &'static str, url: String, screenshot: Option<String>) -> String {
    tokio::task::spawn_blocking(move || {
        let run = |extra: &[&str]| {
            let output = Command::new(browser)
                .args([
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--virtual-time-budget=3000",
                ])
                .args(extra)
                .arg(&url)
                .output()
                .unwrap();
            assert!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
            output.stdout
        };
        if let Some(path) = screenshot {
            run(&["--window-size=1100,1500", &format!("--screenshot={path}")]);
        }
        String::from_utf8(run(&["--dump-dom"])).unwrap()
    })
    .await
    .unwrap()
}

/// The text of each element of class `class` (among others) in `html`.
fn texts<'a>(html: &'a str, class: &str) -> Vec<&'a str> {
    let mut found = Vec::new();
    let mut rest = html;
    while let Some(at) = rest.find("class=\"") {
        rest = &rest[at + 7..];
        let classes = &rest[..rest.find('"').unwrap()];
        if classes.split(' ').any(|c| c == class) {
            let text = &rest[rest.find('>').unwrap() + 1..];
            found.push(&text[..text.find('<').unwrap()]);
        }
    }
    found
}

/// The HTML of the table row with `attribute="value"`.
fn row<'a>(dom: &'a str, attribute: &str, value: &str) -> &'a str {
    let start = dom
        .find(&format!("{attribute}=\"{value}\""))
        .unwrap_or_else(|| panic!("no row {attribute}={value}"));
    let row = &dom[start..];
    &row[..row.find("</tr>").unwrap()]
}

/// A number as the page writes it (`en-US`: 1,000,000).
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, d) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(d);
    }
    out
}

/// The page's figures read in Chromium against the configuration and `/admin/tenants`: each
/// limit its configured amount per its own period with the burst apart, daily caps with what
/// today used, configured weights, a pause, refusals grouped with their count, each account's
/// binding limit. (Before: a 600-a-minute account read "40 of 100", the burst called a
/// minute's amount; weights multiplied; daily caps absent; identical refusal rows.)
#[tokio::test]
async fn the_status_page_tells_the_configured_figures() {
    use reqwest::Method;
    let Some(browser) = browser() else {
        println!("skipped: no chromium binary on the PATH (install Debian's `chromium`)");
        return;
    };
    let gateway = Running::start(&demo()).await;
    for _ in 0..3 {
        let response = gateway
            .post("/v1/chat/completions", Some(SEARCH), &chat(20))
            .await;
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
    // globex may send 20 requests a minute (a tenant's burst is its amount): two more are
    // refused, one row counting 2.
    let mut refused = 0;
    for _ in 0..22 {
        let response = gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await;
        refused += u32::from(response.status() == 429);
        response.bytes().await.unwrap();
    }
    assert_eq!(refused, 2);
    let paused = gateway
        .admin(
            Method::POST,
            "/pause",
            crate::support::ADMIN,
            serde_json::json!({"tenant": "acme/reports"}),
        )
        .await;
    assert_eq!(paused.status(), 204);
    // An admin override of a configured weight: marked where the weight is shown.
    let weighed = gateway
        .admin(
            Method::PUT,
            "/limits",
            crate::support::ADMIN,
            serde_json::json!({"tenant": "acme/reports", "weight": 4}),
        )
        .await;
    assert_eq!(weighed.status(), 204);
    let tenants: serde_json::Value = serde_json::from_slice(
        &gateway
            .admin(
                Method::GET,
                "/tenants",
                crate::support::ADMIN,
                serde_json::Value::Null,
            )
            .await
            .bytes()
            .await
            .unwrap(),
    )
    .unwrap();
    let screenshot = std::env::var("GATEWAY_STATUS_SCREENSHOT").ok();
    let dom = dump(browser, format!("{}/", gateway.url), screenshot).await;

    // The configuration's figures, as configured (demo.toml).
    let globex = row(&dom, "data-tenant", "globex");
    assert!(
        texts(globex, "limit")
            .iter()
            .any(|t| t.starts_with("requests per minute: 20 (burst 20)")),
        "{globex}"
    );
    assert!(
        texts(globex, "limit")
            .iter()
            .any(|t| t.starts_with("total tokens per minute: 6,000 (burst 6,000)")),
        "{globex}"
    );
    let daily = texts(globex, "cap");
    assert!(
        daily
            .iter()
            .all(|t| t.starts_with("total tokens per day: 1,000,000 (calendar day (UTC)): ")),
        "{daily:?}"
    );
    assert!(!daily.is_empty());
    let acme = row(&dom, "data-tenant", "acme");
    assert!(
        texts(acme, "limit")
            .iter()
            .any(|t| t.starts_with("requests per minute: 300 (burst 300)")),
        "{acme}"
    );
    assert_eq!(
        texts(row(&dom, "data-tenant", "acme/search"), "weight"),
        ["2"],
        "configured, not multiplied"
    );
    assert!(row(&dom, "data-tenant", "acme/reports").contains("acme/reports (paused)"));
    assert_eq!(
        texts(row(&dom, "data-tenant", "acme/reports"), "weight"),
        ["4 (override)"],
        "an override is marked"
    );
    let openai = row(&dom, "data-account", "openai-sim");
    assert!(
        texts(openai, "limit")
            .iter()
            .any(|t| t.starts_with("requests per minute: 600 (burst 100): ")),
        "{openai}"
    );
    assert_eq!(texts(openai, "binding").len(), 1, "{openai}");

    // Every figure of /admin/tenants is on the page, in the row of its tenant.
    let mut compared = 0;
    for tenant in tenants.as_array().unwrap() {
        let path = tenant["path"].as_str().unwrap();
        let html = row(&dom, "data-tenant", path);
        assert_eq!(
            texts(html, "weight"),
            [format!(
                "{}{}",
                tenant["weight"],
                if overridden(tenant, "weight") {
                    " (override)"
                } else {
                    ""
                }
            )],
            "{path}"
        );
        let limits = texts(html, "limit");
        let dailies = texts(html, "cap");
        for share in tenant["accounts"].as_array().unwrap() {
            for level in share["levels"].as_array().unwrap() {
                let text = format!(
                    "{}: {} (burst {}): ",
                    level["limit"].as_str().unwrap().replace('_', " "),
                    grouped(level["amount"].as_u64().unwrap()),
                    grouped(level["capacity"].as_u64().unwrap()),
                );
                assert!(
                    limits.iter().any(|t| t.starts_with(&text)),
                    "{path}: {text} not in {limits:?}"
                );
                compared += 1;
            }
            for cap in share["caps"].as_array().unwrap() {
                let name = cap["limit"].as_str().unwrap().replace('_', " ");
                let window = cap["window"].as_str().unwrap();
                let text = match cap["amount_usd"].as_str() {
                    Some(amount) => format!(
                        "{name}: ${} of ${amount} ({window})",
                        cap["used_usd"].as_str().unwrap()
                    ),
                    None => format!(
                        "{name}: {} ({window}): {} used",
                        grouped(cap["amount"].as_u64().unwrap()),
                        grouped(cap["used"].as_u64().unwrap()),
                    ),
                };
                assert!(
                    dailies.contains(&text.as_str()),
                    "{path}: {text} not in {dailies:?}"
                );
                compared += 1;
            }
        }
    }
    assert!(compared >= 10, "{compared} figures compared");

    // Refusals grouped: globex's two refusals are one row counting 2.
    let refusals: Vec<&str> = dom.split("class=\"refusal\"").skip(1).collect();
    let globex_rows: Vec<&&str> = refusals
        .iter()
        .filter(|r| texts(r, "tenant") == ["globex"])
        .collect();
    assert_eq!(globex_rows.len(), 1, "{refusals:?}");
    assert_eq!(texts(globex_rows[0], "count"), ["2"]);
    assert_eq!(texts(globex_rows[0], "limit"), ["requests_per_minute"]);
    assert_eq!(texts(globex_rows[0], "scope"), ["tenant:globex"]);
    gateway.stop().await;
}

/// Whether `tenant` (of `/status.json`) marks `setting` as an admin override.
fn overridden(tenant: &serde_json::Value, setting: &str) -> bool {
    tenant["overridden"]
        .as_array()
        .is_some_and(|all| all.iter().any(|s| s == setting))
}

/// The values and heights of the bars of the chart of `kind` in `html` (a row).
fn chart(html: &str, kind: &str) -> Vec<(u64, u64)> {
    let start = html
        .find(&format!("class=\"chart {kind}\""))
        .unwrap_or_else(|| panic!("no {kind} chart in {html}"));
    let svg = &html[start..];
    let svg = &svg[..svg.find("</svg>").unwrap()];
    let attribute = |rect: &str, name: &str| -> u64 {
        let at = rect.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
        rect[at..rect[at..].find('"').unwrap() + at]
            .parse()
            .unwrap()
    };
    svg.split("<rect")
        .skip(1)
        .map(|rect| (attribute(rect, "data-value"), attribute(rect, "height")))
        .collect()
}

/// The last hour charted per tenant and per account, and each cap drawn as a bar, read in
/// Chromium against `/status.json`: each bar's value is the minute's figure, its height in
/// proportion to the hour's largest; a spend cap in dollars.
#[tokio::test]
async fn the_status_page_draws_the_last_hour_and_the_caps() {
    let Some(browser) = browser() else {
        println!("skipped: no chromium binary on the PATH (install Debian's `chromium`)");
        return;
    };
    // Every model priced (dearly: spend shows), globex capped at $50 a day.
    let config = demo().replace(
        "caps = [{ dimension = \"total_tokens\", amount = 1000000, window = \"calendar_day_utc\" }]",
        "caps = [{ dimension = \"spend\", amount_usd = \"50\", window = \"calendar_day_utc\" }]",
    ) + "\n[prices.models.\"*\"]\ninput = \"1000\"\noutput = \"1000\"\n";
    assert!(config.contains("amount_usd = \"50\""));
    let gateway = Running::start(&config).await;
    for _ in 0..3 {
        let response = gateway
            .post("/v1/chat/completions", Some(SEARCH), &chat(20))
            .await;
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
    let mut refused = 0;
    for _ in 0..22 {
        let response = gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await;
        refused += u32::from(response.status() == 429);
        response.bytes().await.unwrap();
    }
    assert_eq!(refused, 2);
    let status = || async {
        let (_, text) = gateway.get("/status.json").await;
        serde_json::from_str::<serde_json::Value>(&text).unwrap()
    };
    let before = status().await;
    let dom = dump(browser, format!("{}/", gateway.url), None).await;
    let after = status().await;
    // Drawn from one of the two readings (a minute may turn between them).
    let drawn_from = |html: &str, find: &dyn Fn(&serde_json::Value) -> serde_json::Value| {
        for kind in ["tokens", "spend", "refusals"] {
            let key = if kind == "spend" {
                "spend_nano_usd"
            } else {
                kind
            };
            let bars = chart(html, kind);
            let values: Vec<u64> = bars.iter().map(|(value, _)| *value).collect();
            let read = |status: &serde_json::Value| -> Vec<u64> {
                (find(status)["hour"][key].as_array().unwrap().iter())
                    .map(|v| v.as_u64().unwrap())
                    .collect()
            };
            assert!(
                values == read(&before) || values == read(&after),
                "{kind}: drawn {values:?}, status {:?}",
                read(&after)
            );
            let max = values.iter().copied().max().unwrap_or(0).max(1);
            for (value, height) in bars {
                let expected = if value == 0 {
                    0
                } else {
                    ((value as f64 / max as f64 * 20.0).round() as u64).max(1)
                };
                assert_eq!(height, expected, "{kind}: {value} of {max}");
            }
        }
    };
    let tenant = |path: &'static str| {
        move |status: &serde_json::Value| {
            (status["tenants"].as_array().unwrap().iter())
                .find(|t| t["path"] == path)
                .unwrap()
                .clone()
        }
    };
    for path in ["acme", "acme/search", "globex"] {
        drawn_from(row(&dom, "data-tenant", path), &tenant(path));
    }
    let account = |status: &serde_json::Value| {
        (status["accounts"].as_array().unwrap().iter())
            .find(|a| a["name"] == "openai-sim")
            .unwrap()
            .clone()
    };
    drawn_from(row(&dom, "data-account", "openai-sim"), &account);
    // What was sent shows: search's tokens and spend, globex's two refusals.
    let sum = |path, kind| {
        chart(row(&dom, "data-tenant", path), kind)
            .iter()
            .map(|b| b.0)
            .sum::<u64>()
    };
    assert!(sum("acme/search", "tokens") > 0);
    assert!(sum("acme/search", "spend") > 0);
    assert_eq!(sum("globex", "refusals"), 2);
    // globex's spend cap: a bar as wide as its use, and in dollars.
    let globex = row(&dom, "data-tenant", "globex");
    let cap = &tenant("globex")(&after)["accounts"][0]["caps"][0];
    let (used, amount) = (
        cap["used"].as_u64().unwrap(),
        cap["amount"].as_u64().unwrap(),
    );
    let width = format!("width: {:.1}%", used as f64 / amount as f64 * 100.0);
    let bar = &globex[globex.find("cap-bar").expect("a cap's bar")..];
    assert!(
        bar[..200.min(bar.len())].contains(&width),
        "{width} not in {bar:.200}"
    );
    let text = format!(
        "spend per day: ${} of $50.00 (calendar day (UTC))",
        cap["used_usd"].as_str().unwrap()
    );
    assert!(
        texts(globex, "cap").contains(&text.as_str()),
        "{text} not in {globex}"
    );
    gateway.stop().await;
}
