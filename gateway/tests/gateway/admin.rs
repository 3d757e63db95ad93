//! The quota API: its token, pause and resume, limits, the tree and usage.

use reqwest::Method;
use serde_json::{Value, json};

use crate::support::{ADMIN, GLOBEX, Running, SEARCH, chat, demo, json};

#[tokio::test]
async fn the_admin_api_needs_its_own_token() {
    let gateway = Running::start(&demo()).await;
    for token in ["wrong", SEARCH] {
        let response = gateway
            .admin(Method::GET, "/tenants", token, Value::Null)
            .await;
        assert_eq!(response.status(), 401);
    }
    let response = gateway
        .admin(Method::POST, "/pause", SEARCH, json!({"tenant": "globex"}))
        .await;
    assert_eq!(response.status(), 401);
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        200
    );
    gateway.stop().await;
}

#[tokio::test]
async fn pause_refuses_a_tenant_at_once_and_resume_restores_it() {
    let gateway = Running::start(&demo()).await;
    let paused = gateway
        .admin(Method::POST, "/pause", ADMIN, json!({"tenant": "acme"}))
        .await;
    assert_eq!(paused.status(), 204);
    // A child of a paused node is refused, naming the paused node; others go on. A pause
    // has no known end: the caller is told to look again in a minute.
    let (status, retry_after, body) = json(
        gateway
            .post("/v1/chat/completions", Some(SEARCH), &chat(20))
            .await,
    )
    .await;
    assert_eq!((status, retry_after.as_deref()), (429, Some("60")));
    assert_eq!(body["error"]["limit"], "paused");
    assert_eq!(body["error"]["scope"], "tenant:acme");
    assert_eq!(body["error"]["gateway_decision"], "local");
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        200
    );
    let resumed = gateway
        .admin(Method::POST, "/resume", ADMIN, json!({"tenant": "acme"}))
        .await;
    assert_eq!(resumed.status(), 204);
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(SEARCH), &chat(20))
            .await
            .status(),
        200
    );

    // A key alone.
    let paused = gateway
        .admin(Method::POST, "/pause", ADMIN, json!({"key": "globex-app"}))
        .await;
    assert_eq!(paused.status(), 204);
    let (status, _, body) = json(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await,
    )
    .await;
    assert_eq!(
        (status, body["error"]["scope"].as_str()),
        (429, Some("tenant:globex/globex-app"))
    );
    gateway
        .admin(Method::POST, "/resume", ADMIN, json!({"key": "globex-app"}))
        .await;
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        200
    );

    let unknown = gateway
        .admin(
            Method::POST,
            "/pause",
            ADMIN,
            json!({"tenant": "initech//x"}),
        )
        .await;
    assert_eq!(unknown.status(), 400);
    // The provider saw none of the refused requests.
    assert_eq!(gateway.simulator("openai-sim").await.1, 3);
    gateway.stop().await;
}

#[tokio::test]
async fn limits_change_and_the_tree_shows_levels_and_usage() {
    let gateway = Running::start(&demo()).await;
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        200
    );
    // Down to one request a minute (a burst of one, the level kept but clamped), weight 5.
    let limits = json!([
        {"dimension": "requests", "amount": 1, "period_seconds": 60},
        {"dimension": "total_tokens", "amount": 6000, "period_seconds": 60},
    ]);
    let change = json!({"tenant": "globex", "limits": limits, "weight": 5});
    assert_eq!(
        gateway
            .admin(Method::PUT, "/limits", ADMIN, change)
            .await
            .status(),
        204
    );
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        200
    );
    let (status, _, body) = json(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await,
    )
    .await;
    assert_eq!(
        (status, body["error"]["scope"].as_str()),
        (429, Some("tenant:globex"))
    );

    let tree: Value = gateway
        .admin(Method::GET, "/tenants", ADMIN, Value::Null)
        .await
        .json_value()
        .await;
    let paths: Vec<&str> = tree
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths, ["acme", "acme/reports", "acme/search", "globex"]);
    let globex = &tree[3];
    assert_eq!(globex["weight"], 5);
    assert_eq!(
        globex["accounts"][0]["levels"][0]["limit"],
        "requests_per_minute"
    );
    assert_eq!(globex["accounts"][0]["levels"][0]["capacity"], 1);
    assert_eq!(globex["accounts"][0]["levels"][0]["amount"], 1);
    assert_eq!(globex["accounts"][0]["levels"][0]["period_seconds"], 60.0);
    assert_eq!(globex["accounts"][0]["levels"][0]["level"], 0);
    assert_eq!(globex["usage"]["requests"], 2);
    // Its daily cap, with what today used of it (the two answers' tokens).
    let daily = &globex["accounts"][0]["caps"][0];
    assert_eq!(
        (&daily["limit"], &daily["amount"], &daily["window"]),
        (
            &json!("total_tokens_per_day"),
            &json!(1_000_000),
            &json!("calendar day (UTC)")
        )
    );
    assert!(daily["used"].as_u64().unwrap() > 0, "{daily}");
    // Each account names the limit that binds: the one with the least of its burst left.
    let (_, text) = gateway.get("/status.json").await;
    let status: Value = serde_json::from_str(&text).unwrap();
    let account = &status["accounts"][0];
    let least = account["levels"]
        .as_array()
        .unwrap()
        .iter()
        .min_by(|a, b| {
            let left = |l: &Value| l["level"].as_f64().unwrap() / l["capacity"].as_f64().unwrap();
            left(a).total_cmp(&left(b))
        })
        .unwrap();
    assert_eq!(account["binding"], least["limit"], "{account}");
    assert_eq!(globex["usage"]["local_refusals"], 1);
    assert!(globex["usage"]["input_tokens"].as_u64().unwrap() > 0);

    let usage: Value = gateway
        .admin(Method::GET, "/usage", ADMIN, Value::Null)
        .await
        .json_value()
        .await;
    let globex = usage
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["tenant"] == "globex")
        .unwrap();
    assert_eq!(
        (
            globex["requests"].as_u64(),
            globex["local_refusals"].as_u64()
        ),
        (Some(2), Some(1))
    );
    let bad = json!({"tenant": "globex", "limits": [{"dimension": "requests", "amount": 0, "period_seconds": 60}]});
    assert_eq!(
        gateway
            .admin(Method::PUT, "/limits", ADMIN, bad)
            .await
            .status(),
        400
    );
    gateway.stop().await;
}

/// The admin API refuses mistakes: an unknown tenant or key is a 404 naming it (before: 204,
/// nothing done); a value out of range or an unknown dimension is a 400 with the reason; every
/// error is JSON; one limit changed keeps the others (before: setting a request limit dropped
/// the tenant's token limit); a limit is removed by its dimension and period.
#[tokio::test]
async fn the_admin_api_refuses_mistakes_and_changes_one_limit_at_a_time() {
    let gateway = Running::start(&demo()).await;
    let expect = |response: reqwest::Response,
                  status: u16,
                  kind: &'static str,
                  says: &'static str| async move {
        assert_eq!(response.status(), status);
        let body: Value = response.json_value().await;
        assert_eq!(body["error"]["type"], kind, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{message}");
    };
    for (path, target) in [
        ("/pause", json!({"tenant": "globx"})),
        ("/resume", json!({"tenant": "globx"})),
    ] {
        let response = gateway.admin(Method::POST, path, ADMIN, target).await;
        expect(response, 404, "not_found", "no tenant named `globx`").await;
    }
    let response = gateway
        .admin(Method::POST, "/pause", ADMIN, json!({"key": "globex-ap"}))
        .await;
    expect(response, 404, "not_found", "no key named `globex-ap`").await;
    let change = json!({"tenant": "initech", "limits": [{"dimension": "requests", "amount": 5, "period_seconds": 60}]});
    let response = gateway.admin(Method::PUT, "/limits", ADMIN, change).await;
    expect(response, 404, "not_found", "no tenant named `initech`").await;
    let change = json!({"tenant": "globex", "limits": [{"dimension": "tokens", "amount": 5, "period_seconds": 60}]});
    let response = gateway.admin(Method::PUT, "/limits", ADMIN, change).await;
    expect(
        response,
        400,
        "invalid_request",
        "unknown dimension `tokens`",
    )
    .await;
    let response = gateway
        .admin(
            Method::PUT,
            "/limits",
            ADMIN,
            json!({"tenant": "globex", "amount": 5}),
        )
        .await;
    expect(response, 400, "invalid_request", "amount").await;
    let response = gateway
        .admin(Method::GET, "/tenants", "wrong-token", Value::Null)
        .await;
    expect(response, 401, "authentication", "admin token").await;
    // A key's own path is a node too.
    let response = gateway
        .admin(
            Method::POST,
            "/pause",
            ADMIN,
            json!({"tenant": "globex/globex-app"}),
        )
        .await;
    assert_eq!(response.status(), 204);

    // acme/search has a token limit of its own: a request limit added keeps it.
    let levels = |tree: &Value, path: &str| -> Vec<String> {
        let node = tree
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["path"] == path)
            .unwrap();
        let mut limits: Vec<String> = node["accounts"][0]["levels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["limit"].as_str().unwrap().to_owned())
            .collect();
        limits.sort();
        limits
    };
    let before = levels(&tree(&gateway).await, "acme/search");
    assert!(
        before.iter().any(|l| l.starts_with("total_tokens")),
        "{before:?}"
    );
    let change = json!({"tenant": "acme/search", "limits": [{"dimension": "requests", "amount": 30, "period_seconds": 60}]});
    assert_eq!(
        gateway
            .admin(Method::PUT, "/limits", ADMIN, change)
            .await
            .status(),
        204
    );
    let after = levels(&tree(&gateway).await, "acme/search");
    let mut expected = before.clone();
    expected.push("requests_per_minute".into());
    expected.sort();
    assert_eq!(after, expected);
    // Removed by its dimension and period; removing it again is a 400.
    let remove = json!({"tenant": "acme/search", "remove": [{"dimension": "requests", "period_seconds": 60}]});
    assert_eq!(
        gateway
            .admin(Method::PUT, "/limits", ADMIN, remove.clone())
            .await
            .status(),
        204
    );
    assert_eq!(levels(&tree(&gateway).await, "acme/search"), before);
    let response = gateway.admin(Method::PUT, "/limits", ADMIN, remove).await;
    expect(
        response,
        400,
        "invalid_request",
        "no requests limit per 60 s",
    )
    .await;

    // A limit is named by its own period, with its amount and burst apart (before: five a
    // 10 s window was called `requests_per_minute`); the weight shown is the configured one.
    let change = json!({"tenant": "globex", "limits": [{"dimension": "requests", "amount": 5, "period_seconds": 10}]});
    assert_eq!(
        gateway
            .admin(Method::PUT, "/limits", ADMIN, change)
            .await
            .status(),
        204
    );
    let tree = tree(&gateway).await;
    let node = |path: &str| {
        tree.as_array()
            .unwrap()
            .iter()
            .find(|n| n["path"] == path)
            .unwrap()
            .clone()
    };
    let globex = node("globex");
    let level = globex["accounts"][0]["levels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["limit"] == "requests_per_10_seconds")
        .unwrap_or_else(|| panic!("{globex}"))
        .clone();
    assert_eq!(
        (level["amount"].as_u64(), level["period_seconds"].as_f64()),
        (Some(5), Some(10.0))
    );
    // acme/search weighs 2 under acme's 3: configured 2, served at 6.
    let search = node("acme/search");
    assert_eq!(
        (search["weight"].as_u64(), search["path_weight"].as_u64()),
        (Some(2), Some(6))
    );
    gateway.stop().await;
}

trait JsonValue {
    async fn json_value(self) -> Value;
}

impl JsonValue for reqwest::Response {
    async fn json_value(self) -> Value {
        serde_json::from_slice(&self.bytes().await.unwrap()).unwrap()
    }
}

/// The tenant tree as `GET /admin/tenants` shows it.
async fn tree(gateway: &Running) -> Value {
    gateway
        .admin(Method::GET, "/tenants", ADMIN, Value::Null)
        .await
        .json_value()
        .await
}

/// The status page groups refusals by kind (tenant, status, decision, limit, scope): three
/// refusals of an unknown key are one row counting 3, the latest kind first (before: three
/// identical rows).
#[tokio::test]
async fn refusals_are_grouped_by_scope_and_reason() {
    let gateway = Running::start(&demo()).await;
    for _ in 0..3 {
        let response = gateway
            .post("/v1/chat/completions", Some("not-a-key"), &chat(20))
            .await;
        assert_eq!(response.status(), 401);
    }
    let unknown_model = chat(20).replace("gpt-4o-mini", "gpt-9");
    let response = gateway
        .post("/v1/chat/completions", Some(GLOBEX), &unknown_model)
        .await;
    assert_eq!(response.status(), 404);
    let (_, text) = gateway.get("/status.json").await;
    let status: Value = serde_json::from_str(&text).unwrap();
    let refusals = status["refusals"].as_array().unwrap();
    assert_eq!(refusals.len(), 2, "{refusals:?}");
    assert_eq!(
        (
            &refusals[0]["status"],
            &refusals[0]["count"],
            &refusals[0]["tenant"]
        ),
        (&json!(404), &json!(1), &json!("globex"))
    );
    assert_eq!(
        (&refusals[1]["status"], &refusals[1]["count"]),
        (&json!(401), &json!(3))
    );
    gateway.stop().await;
}

/// With a status token, `/status.json` and `/metrics` need it (a Prometheus scrape sends it
/// as a bearer token); the page itself holds no figures and stays open; `/healthz` too.
#[tokio::test]
async fn a_status_token_guards_the_status_data_and_the_metrics() {
    let config = demo().replace("[server]\n", "[server]\nstatus_token = \"status-secret\"\n");
    let gateway = Running::start(&config).await;
    let client = reqwest::Client::new();
    for path in ["/status.json", "/metrics"] {
        let url = format!("{}{path}", gateway.url);
        let open = client.get(&url).send().await.unwrap();
        assert_eq!(open.status(), 401, "{path}");
        let body: Value = open.json_value().await;
        assert_eq!(body["error"]["type"], "authentication", "{path}");
        let wrong = client
            .get(&url)
            .bearer_auth("status-secre")
            .send()
            .await
            .unwrap();
        assert_eq!(wrong.status(), 401, "{path}");
        let right = client
            .get(&url)
            .bearer_auth("status-secret")
            .send()
            .await
            .unwrap();
        assert_eq!(right.status(), 200, "{path}");
    }
    for path in ["/", "/healthz"] {
        let response = client
            .get(format!("{}{path}", gateway.url))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{path}");
    }
    gateway.stop().await;
}

/// `POST /admin/reload`: keys added and revoked, a tenant's limit changed, without a restart
/// (the tenant's spending kept); changes that need a restart are reported, not applied; an
/// invalid configuration changes nothing and says why.
#[tokio::test]
async fn a_reload_applies_keys_and_tenants_and_refuses_a_bad_configuration() {
    // The audit log named, as the reloaded file names it.
    let demo = || demo().replace("[server]\n", "[server]\naudit_log = \"off\"\n");
    let gateway = Running::start(&demo()).await;
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        200
    );
    let level = |tree: &Value| {
        tree.as_array()
            .unwrap()
            .iter()
            .find(|n| n["path"] == "globex")
            .unwrap()["accounts"][0]["levels"][0]
            .clone()
    };
    let before = level(&tree(&gateway).await);
    // globex's key rotated (the old one revoked), its request limit raised, an account's
    // simulator slower (a restart's business).
    let config = demo()
        .replace("demo-key-globex", "demo-key-globex-2")
        .replace(
            "{ dimension = \"requests\", amount = 20, period_seconds = 60 }",
            "{ dimension = \"requests\", amount = 40, period_seconds = 60 }",
        )
        .replacen(
            "sim = { base_ms = 0, per_token_ms = 0 }",
            "sim = { base_ms = 1, per_token_ms = 0 }",
            1,
        );
    let client = reqwest::Client::new();
    let reload = |body: String| {
        client
            .post(format!("{}/admin/reload", gateway.url))
            .bearer_auth(ADMIN)
            .body(body)
            .send()
    };
    let response = reload(config).await.unwrap();
    assert_eq!(response.status(), 200);
    let reloaded: Value = response.json_value().await;
    assert_eq!(reloaded["restart"], json!(["accounts"]), "{reloaded}");
    assert_eq!(reloaded["keys"], 3);
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await
            .status(),
        401,
        "the revoked key still served"
    );
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some("demo-key-globex-2"), &chat(20))
            .await
            .status(),
        200
    );
    let after = level(&tree(&gateway).await);
    assert_eq!(after["amount"], 40, "{after}");
    // What globex spent before the reload still counts: its level is not reset to the burst.
    assert!(
        after["level"].as_i64().unwrap() < after["capacity"].as_i64().unwrap(),
        "before {before}, after {after}"
    );
    // An invalid configuration: 400 with the reason; the running one kept.
    let response = reload("[server]\nnot_a_key = 1\n".to_owned())
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json_value().await;
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not_a_key"),
        "{body}"
    );
    assert_eq!(
        gateway
            .post("/v1/chat/completions", Some("demo-key-globex-2"), &chat(20))
            .await
            .status(),
        200
    );
    gateway.stop().await;
}

/// A small account for the reload of its figures: 100 requests a minute, a model `fast`, and
/// `extra` more TOML in the account.
fn tunable(requests: u64, extra: &str, models: &[&str]) -> String {
    let models: String = models
        .iter()
        .map(|m| {
            format!("[[models]]\nname = \"{m}\"\naccount = \"sim\"\nmodel = \"gpt-4o-mini\"\n")
        })
        .collect();
    format!(
        r#"
[server]
admin_token = "{ADMIN}"
audit_log = "off"
[[accounts]]
name = "sim"
base_url = "sim"
profile = "openai"
apis = ["chat"]
quota = {{ requests_per_minute = {requests}, tokens_per_minute = 600000 }}
sim = {{ base_ms = 0, per_token_ms = 0 }}
{extra}
[[keys]]
name = "team-key"
key = "team-secret"
tenant = "team"
{models}"#
    )
}

/// The account `sim`'s request limit and caps, as `/status.json` shows them.
async fn account_status(gateway: &Running) -> Value {
    let (_, status) = gateway.get("/status.json").await;
    let status: Value = serde_json::from_str(&status).unwrap();
    status["accounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "sim")
        .unwrap()
        .clone()
}

/// `POST /admin/reload` changes an account's figures in place: its request limit raised (the
/// level kept, not refilled to the new burst), a daily cap added (counting from then), a
/// model added to its routes; what it cannot apply (the simulator's latency, a limit the
/// account did not have) is listed as needing a restart, with why, and stays listed at the
/// next reload of the same file (the running configuration keeps what was not applied).
#[tokio::test]
async fn a_reload_applies_an_account_s_limits_caps_and_models_in_place() {
    let gateway = Running::start(&tunable(120, "", &["fast"])).await;
    let chat = |model: &str| {
        format!(
            r#"{{"model":"{model}","max_tokens":20,"messages":[{{"role":"user","content":"hi"}}]}}"#
        )
    };
    for _ in 0..5 {
        let response = gateway
            .post("/v1/chat/completions", Some("team-secret"), &chat("fast"))
            .await;
        assert_eq!(response.status(), 200);
    }
    let requests = |account: &Value| {
        account["levels"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["limit"] == "requests_per_minute")
            .unwrap()
            .clone()
    };
    let before = requests(&account_status(&gateway).await);
    assert_eq!(before["amount"], 120, "{before}");
    let client = reqwest::Client::new();
    let reload = async |body: String| -> (u16, Value) {
        let response = client
            .post(format!("{}/admin/reload", gateway.url))
            .bearer_auth(ADMIN)
            .body(body)
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.json_value().await)
    };
    let cap = r#"caps = [{ dimension = "requests", amount = 1000, window = "calendar_day_utc" }]"#;
    let (status, reloaded) = reload(tunable(600, cap, &["fast", "faster"])).await;
    assert_eq!(status, 200, "{reloaded}");
    assert_eq!(reloaded["accounts"], 1, "{reloaded}");
    assert_eq!(reloaded["restart"], json!([]), "{reloaded}");
    let account = account_status(&gateway).await;
    let after = requests(&account);
    assert_eq!(after["amount"], 600, "{after}");
    // The burst grew with the limit; what was spent before still counts.
    let spent = |l: &Value| l["capacity"].as_i64().unwrap() - l["level"].as_i64().unwrap();
    assert!(
        after["capacity"].as_i64() > before["capacity"].as_i64(),
        "{after}"
    );
    assert!(
        spent(&after) > 0,
        "refilled by the reload: before {before}, after {after}"
    );
    assert_eq!(account["caps"][0]["limit"], "requests_per_day", "{account}");
    assert_eq!(account["caps"][0]["used"], 0, "{account}");
    let response = gateway
        .post("/v1/chat/completions", Some("team-secret"), &chat("faster"))
        .await;
    assert_eq!(response.status(), 200, "the new model is routed");
    assert_eq!(account_status(&gateway).await["caps"][0]["used"], 1);
    // What a reload cannot apply: listed, with why, and not taken as running.
    let slower = tunable(
        600,
        &format!("{cap}\nsim = {{ base_ms = 1, per_token_ms = 0 }}"),
        &["fast"],
    );
    let slower = slower.replacen("sim = { base_ms = 0, per_token_ms = 0 }\n", "", 1);
    let more = tunable(600, cap, &["fast"]).replace(
        "tokens_per_minute = 600000",
        "tokens_per_minute = 600000, input_tokens_per_minute = 500000",
    );
    for (text, reason) in [(&slower, "more than its limits"), (&more, "which limits")] {
        for _ in 0..2 {
            let (status, reloaded) = reload(text.clone()).await;
            assert_eq!(status, 200, "{reloaded}");
            assert_eq!(reloaded["restart"], json!(["accounts"]), "{reloaded}");
            let why = reloaded["why"][0].as_str().unwrap();
            assert!(why.contains(reason), "{why}");
        }
    }
    // The models did apply: `faster` is gone.
    let response = gateway
        .post("/v1/chat/completions", Some("team-secret"), &chat("faster"))
        .await;
    assert_eq!(response.status(), 404, "a removed model still routed");
    gateway.stop().await;
}

/// The file is the base, admin changes are overrides: each listed with who made it, when and
/// the file's value it shadows; a reload lists what they shadow; deleting one gives the
/// file's value back (a limit's, a removed limit's, a configured key's secret); the status
/// marks what is overridden. (Before: after a reload the admin's 10 held over the file's 20
/// and nothing said so; after a `remove` the tenant had no request limit and no way back.)
#[tokio::test]
async fn admin_changes_are_overrides_with_a_way_back() {
    let gateway = Running::start(&demo()).await;
    let call = |method: Method, path: &'static str, body: Value| {
        let gateway = &gateway;
        async move {
            let response = gateway.admin(method, path, ADMIN, body).await;
            let status = response.status().as_u16();
            let body = response.bytes().await.unwrap();
            (
                status,
                serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null),
            )
        }
    };
    let requests_of = |tenants: &Value| {
        let globex = (tenants.as_array().unwrap().iter())
            .find(|n| n["path"] == "globex")
            .unwrap()
            .clone();
        (globex["accounts"][0]["levels"].as_array().unwrap().iter())
            .find(|l| l["limit"] == "requests_per_minute")
            .map(|l| l["amount"].as_u64().unwrap())
    };
    let id = "limit:requests:60:globex";
    let change = json!({"tenant": "globex", "limits": [
        {"dimension": "requests", "amount": 10, "period_seconds": 60}]});
    assert_eq!(call(Method::PUT, "/limits", change).await.0, 204);
    let (status, overrides) = call(Method::GET, "/overrides", Value::Null).await;
    assert_eq!(status, 200);
    let listed = overrides.as_array().unwrap();
    assert_eq!(listed.len(), 1, "{overrides}");
    let first = &listed[0];
    assert_eq!(first["id"], id);
    assert_eq!(first["tenant"], "globex");
    assert_eq!(first["setting"], "requests_per_minute");
    assert_eq!(
        (first["value"].as_u64(), first["file"].as_u64()),
        (Some(10), Some(20))
    );
    assert_eq!(first["by"], "admin");
    assert!(first["at"].as_str().unwrap().ends_with('Z'), "{first}");

    // A reload of the same file says what the override shadows.
    let reloaded = reqwest::Client::new()
        .post(format!("{}/admin/reload", gateway.url))
        .bearer_auth(ADMIN)
        .body(demo())
        .send()
        .await
        .unwrap();
    let reloaded: Value = serde_json::from_slice(&reloaded.bytes().await.unwrap()).unwrap();
    assert_eq!(reloaded["shadowed"][0]["id"], id, "{reloaded}");
    let (_, tenants) = call(Method::GET, "/tenants", Value::Null).await;
    assert_eq!(requests_of(&tenants), Some(10), "the override still holds");
    let globex = (tenants.as_array().unwrap().iter())
        .find(|n| n["path"] == "globex")
        .unwrap();
    assert_eq!(
        globex["overridden"],
        json!(["requests_per_minute"]),
        "{globex}"
    );

    // Removed: listed as such, against the file's 20; deleted: the file's 20 again.
    let remove = json!({"tenant": "globex", "remove": [
        {"dimension": "requests", "period_seconds": 60}]});
    assert_eq!(call(Method::PUT, "/limits", remove).await.0, 204);
    let (_, overrides) = call(Method::GET, "/overrides", Value::Null).await;
    assert_eq!(overrides[0]["value"], "removed", "{overrides}");
    let (_, tenants) = call(Method::GET, "/tenants", Value::Null).await;
    assert_eq!(requests_of(&tenants), None);
    let response = gateway
        .admin(
            Method::DELETE,
            &format!("/overrides?id={id}"),
            ADMIN,
            Value::Null,
        )
        .await;
    assert_eq!(response.status(), 200);
    let (_, tenants) = call(Method::GET, "/tenants", Value::Null).await;
    assert_eq!(requests_of(&tenants), Some(20), "the file's value is back");
    let (_, overrides) = call(Method::GET, "/overrides", Value::Null).await;
    assert_eq!(overrides, json!([]));
    let response = gateway
        .admin(Method::DELETE, "/overrides?id=nosuch", ADMIN, Value::Null)
        .await;
    assert_eq!(response.status(), 404);

    // A configured key rotated through the API: its file secret shadowed, then given back.
    let response = gateway
        .admin(
            Method::POST,
            "/keys/globex-app/rotate",
            ADMIN,
            json!({"overlap_seconds": 0}),
        )
        .await;
    assert_eq!(response.status(), 200);
    let (_, overrides) = call(Method::GET, "/overrides", Value::Null).await;
    let key = &overrides[0];
    assert_eq!(
        (
            key["key"].as_str(),
            key["value"].as_str(),
            key["file"].as_str()
        ),
        (Some("globex-app"), Some("rotated"), Some("key (inline)")),
        "{overrides}"
    );
    let status = |key: &'static str| {
        let gateway = &gateway;
        async move {
            gateway
                .post("/v1/chat/completions", Some(key), &chat(20))
                .await
                .status()
                .as_u16()
        }
    };
    assert_eq!(status(GLOBEX).await, 401, "the file's secret is shadowed");
    let response = gateway
        .admin(
            Method::DELETE,
            "/overrides?id=key:globex-app",
            ADMIN,
            Value::Null,
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(status(GLOBEX).await, 200, "the file's secret serves again");
    gateway.stop().await;
}

/// The admin API sets a limit's burst: the node admits that much at once (here, a request
/// limit of 60 a minute with a burst of 3: the fourth at once is refused), kept in the admin
/// state with its amount.
#[tokio::test]
async fn a_limit_s_burst_is_set_through_the_admin_api() {
    let gateway = Running::start(&demo()).await;
    let change = json!({"tenant": "globex", "limits": [
        {"dimension": "requests", "amount": 60, "period_seconds": 60, "burst": 3}]});
    let response = gateway.admin(Method::PUT, "/limits", ADMIN, change).await;
    assert_eq!(response.status(), 204);
    let tenants = gateway
        .admin(Method::GET, "/tenants", ADMIN, Value::Null)
        .await;
    let tenants: Value = serde_json::from_slice(&tenants.bytes().await.unwrap()).unwrap();
    let globex = (tenants.as_array().unwrap().iter())
        .find(|n| n["path"] == "globex")
        .unwrap();
    let level = (globex["accounts"][0]["levels"].as_array().unwrap().iter())
        .find(|l| l["limit"] == "requests_per_minute")
        .unwrap();
    assert_eq!(
        (level["amount"].as_u64(), level["capacity"].as_u64()),
        (Some(60), Some(3))
    );
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let response = gateway
            .post("/v1/chat/completions", Some(GLOBEX), &chat(20))
            .await;
        statuses.push(response.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    gateway.stop().await;
}

/// `/admin/usage` and the status say whose requests they count: this replica's when replicas
/// share the state (the report counts the fleet), the gateway's alone otherwise.
#[tokio::test]
async fn usage_says_whose_requests_it_counts() {
    let redis = crate::redis_server::RedisServer::start();
    for (shared, expected) in [(false, "the gateway"), (true, "this replica")] {
        let gateway = match shared {
            false => Running::start(&demo()).await,
            true => Running::start_shared(&demo(), &redis.url()).await,
        };
        let response = gateway
            .post("/v1/chat/completions", Some(SEARCH), &chat(20))
            .await;
        assert_eq!(response.status(), 200);
        let usage = gateway
            .admin(Method::GET, "/usage", ADMIN, Value::Null)
            .await;
        let usage: Value = serde_json::from_slice(&usage.bytes().await.unwrap()).unwrap();
        let search = (usage.as_array().unwrap().iter())
            .find(|u| u["tenant"] == "acme/search")
            .unwrap();
        assert_eq!(search["counted_by"], expected, "{search}");
        assert_eq!(search["requests"], 1, "{search}");
        let (_, status) = gateway.get("/status.json").await;
        let status: Value = serde_json::from_str(&status).unwrap();
        assert_eq!(status["usage_counted_by"], expected);
        gateway.stop().await;
    }
}
