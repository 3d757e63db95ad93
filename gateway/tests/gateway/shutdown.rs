//! Stopping: a stream in flight finishes, a queued request gets a 503.

use std::time::Duration;

use serde_json::Value;

use crate::api::{fixed_config, fixed_upstream};
use crate::support::{Running, json};

#[tokio::test]
async fn a_stop_lets_streams_finish_and_answers_queued_requests_503() {
    let (upstream, _) = fixed_upstream(Duration::from_millis(100)).await;
    let mut gateway = Running::start(&fixed_config(&upstream)).await;
    // It asks for its usage: the upstream's events reach it unchanged.
    let body = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Hi"}]}"#;
    // The only call in flight: its head has come, its events take 400 ms.
    let streaming = gateway
        .post("/v1/chat/completions", Some("caller-secret"), body)
        .await;
    assert_eq!(streaming.status(), 200);
    // A second request waits for that slot.
    let queued = {
        let url = gateway.url.clone();
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth("caller-secret")
                .body(r#"{"model":"m","messages":[{"role":"user","content":"Hi"}]}"#)
                .send()
                .await
                .unwrap()
        })
    };
    let queued_now = |row: Value| {
        row["queued"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q[1].as_u64().unwrap())
            .sum::<u64>()
    };
    while queued_now(gateway.account("fixed").await) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    gateway.signal_stop();
    let (status, retry_after, refusal) = json(queued.await.unwrap()).await;
    assert_eq!((status, retry_after.as_deref()), (503, Some("1")));
    assert_eq!(refusal["error"]["limit"], "shutdown");
    let events = streaming.bytes().await.unwrap();
    assert_eq!(events.as_ref(), crate::api::EVENTS.concat().as_bytes());
    // The gateway stops when the stream has ended: its slot came back, nothing is left
    // reserved or queued (its status said so last).
    let gateway = {
        let handle = gateway.gateway.clone();
        gateway.stop().await;
        handle
    };
    let last = gateway.status();
    let account = last["accounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "fixed")
        .unwrap()
        .clone();
    assert_eq!(
        (queued_now(account.clone()), &account["in_flight"]),
        (0, &0.into()),
        "{account}"
    );
}

/// SIGHUP reloads the configuration file (before, it killed the process): a key added to the
/// file is served within moments, and the process runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_configuration_instead_of_stopping() {
    let mut child = crate::support::Binary::start(&crate::support::demo(), None);
    let added = crate::support::demo().replace("demo-key-globex", "demo-key-globex-new");
    child.hangup(&added);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let status = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", child.url))
            .bearer_auth("demo-key-globex-new")
            .body(crate::support::chat(20))
            .send()
            .await
            .unwrap()
            .status();
        if status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the new key is still refused ({status})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(child.is_running(), "SIGHUP stopped the gateway");
}

/// The demo (no configuration file) on SIGHUP says there is nothing to reload and runs on
/// (before, it died); a reload through the admin API is logged on stderr with what waits
/// for a restart and why, `[server]`'s changed fields named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_survives_sighup_and_reloads_are_logged() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_llm-quota-gateway"))
        .args(["--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let url = loop {
        let line = stdout.next().expect("the demo prints its address").unwrap();
        if let Some(rest) = line.strip_prefix("gateway listening on ") {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    std::thread::spawn(move || for _ in stdout {});
    let (lines, stderr) = std::sync::mpsc::channel();
    let pipe = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let wait_for = |needle: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match stderr.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => panic!("no line on stderr says {needle:?}"),
            }
        }
    };
    let sent = std::process::Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    wait_for("nothing to reload");
    assert!(
        child.try_wait().unwrap().is_none(),
        "SIGHUP stopped the demo"
    );
    let chat = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth("demo-key-acme-search")
        .body(crate::support::chat(20))
        .send()
        .await
        .unwrap();
    assert_eq!(chat.status(), 200);

    let changed = include_str!("../../demo.toml")
        .replace("max_body_bytes = 1048576", "max_body_bytes = 2097152");
    let reload = reqwest::Client::new()
        .post(format!("{url}/admin/reload"))
        .bearer_auth("demo-admin-token")
        .body(changed)
        .send()
        .await
        .unwrap();
    assert_eq!(reload.status(), 200);
    let answer: serde_json::Value = serde_json::from_slice(&reload.bytes().await.unwrap()).unwrap();
    assert_eq!(answer["restart"], serde_json::json!(["server"]), "{answer}");
    let why = answer["why"].to_string();
    assert!(why.contains("max_body_bytes"), "{answer}");
    assert!(
        !why.contains("demo-admin-token"),
        "no secret in why: {answer}"
    );
    let logged = wait_for("configuration reloaded");
    assert!(logged.contains("max_body_bytes"), "{logged}");
    let _ = child.kill();
    let _ = child.wait();
}
