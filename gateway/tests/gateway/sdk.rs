//! The official Python SDKs (`openai`, `anthropic`) against the gateway: chat completions and
//! messages, streamed and not, with usage, and the errors each SDK raises for the gateway's
//! refusals (an unknown key, a request without a model, a tenant over its limit, whose
//! `Retry-After` the SDK's own retry honours, a paused tenant). `sdk_conformance.py` holds
//! the checks.

use std::process::Command;

use crate::support::{ADMIN, GLOBEX, REPORTS, Running, SEARCH, demo};

/// A Python that imports both SDKs: `SDK_PYTHON` (`.ci/run` sets it to the virtual
/// environment it installs them in, and `SDK_REQUIRED`), else `python3` if it has them.
fn python() -> Option<String> {
    let candidates = std::env::var("SDK_PYTHON")
        .into_iter()
        .chain(["python3".into()]);
    candidates.into_iter().find(|python| {
        Command::new(python)
            .args(["-c", "import openai, anthropic"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdks_speak_to_the_gateway() {
    let Some(python) = python() else {
        // `.ci/run` installs them: there, a missing SDK is a failure, not a skip.
        assert!(
            std::env::var_os("SDK_REQUIRED").is_none(),
            "SDK_REQUIRED is set but no Python imports `openai` and `anthropic`"
        );
        println!(
            "skipped: no Python with the `openai` and `anthropic` packages (set SDK_PYTHON; \
             `.ci/run` installs them in a virtual environment)"
        );
        return;
    };
    let gateway = Running::start(&demo()).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/gateway/sdk_conformance.py"
    );
    let url = gateway.url.clone();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .env("GATEWAY_URL", url)
            .env("SEARCH_KEY", SEARCH)
            .env("REPORTS_KEY", REPORTS)
            .env("GLOBEX_KEY", GLOBEX)
            .env("ADMIN_TOKEN", ADMIN)
            .output()
    })
    .await
    .unwrap()
    .expect("the Python interpreter runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "the SDKs' checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(stdout.lines().filter(|l| l.starts_with("ok ")).count(), 11);
    gateway.stop().await;
}
