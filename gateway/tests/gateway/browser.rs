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
