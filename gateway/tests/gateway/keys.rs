//! `/admin/keys`: keys created, rotated with an overlap and revoked without a restart, kept as
//! digests in the admin state (a file here, so a restart keeps them).

use reqwest::Method;
use serde_json::{Value, json};

use super::support::{ADMIN, GLOBEX, Running, chat, demo};

async fn json(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let body = response.bytes().await.unwrap();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// The status of a chat request with `key`.
async fn call(gateway: &Running, key: &str) -> u16 {
    let response = gateway
        .post("/v1/chat/completions", Some(key), &chat(8))
        .await;
    let status = response.status().as_u16();
    response.bytes().await.unwrap();
    status
}

/// Rotates the key `name`: the answer, a 200.
async fn rotate(gateway: &Running, name: &str, body: Value) -> Value {
    let path = format!("/keys/{name}/rotate");
    let (status, rotated) = json(gateway.admin(Method::POST, &path, ADMIN, body).await).await;
    assert_eq!(status, 200, "{rotated}");
    rotated
}

/// A configuration of the demo's whose admin state lives in `file`.
fn with_state_file(file: &std::path::Path) -> String {
    demo().replace(
        "admin_token = \"demo-admin-token\"",
        &format!(
            "admin_token = \"demo-admin-token\"\nstate_file = {:?}",
            file.display().to_string()
        ),
    )
}

#[tokio::test]
async fn keys_are_created_rotated_and_revoked_without_a_restart() {
    let dir = std::env::temp_dir().join(format!("gateway-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("state.json");
    let _ = std::fs::remove_file(&file);
    let config = with_state_file(&file);
    let gateway = Running::start(&config).await;

    let (status, created) = json(
        gateway
            .admin(
                Method::POST,
                "/keys",
                ADMIN,
                json!({"name": "acme-etl", "tenant": "acme/reports", "default_class": "batch"}),
            )
            .await,
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let first = created["key"].as_str().unwrap().to_owned();
    assert!(first.starts_with("sk-gw-") && first.len() == 54, "{first}");
    assert_eq!(call(&gateway, &first).await, 200, "served at once");
    // The secret is stored as its digest only.
    let stored = std::fs::read_to_string(&file).unwrap();
    assert!(!stored.contains(&first), "{stored}");
    assert!(stored.contains("sha256"), "{stored}");

    // A name taken, a tenant that cannot be, a model not configured.
    let again = json!({"name": "acme-etl", "tenant": "acme"});
    let (status, body) = json(gateway.admin(Method::POST, "/keys", ADMIN, again).await).await;
    assert_eq!(
        (status, body["error"]["type"].as_str()),
        (409, Some("conflict"))
    );
    let bad = json!({"name": "x", "tenant": "a//b"});
    let (status, _) = json(gateway.admin(Method::POST, "/keys", ADMIN, bad).await).await;
    assert_eq!(status, 400);
    let model = json!({"name": "y", "tenant": "acme", "models": ["gpt-9"]});
    let (status, body) = json(gateway.admin(Method::POST, "/keys", ADMIN, model).await).await;
    assert_eq!(status, 400, "{body}");

    // A rotation with an hour's overlap: the old and the new secret both serve.
    let rotated = rotate(&gateway, "acme-etl", json!({"overlap_seconds": 3600})).await;
    let second = rotated["key"].as_str().unwrap().to_owned();
    assert!(rotated["previous_valid_until"].is_string(), "{rotated}");
    assert_eq!(call(&gateway, &first).await, 200, "the overlap");
    assert_eq!(call(&gateway, &second).await, 200);
    let (_, listed) = json(
        gateway
            .admin(Method::GET, "/keys", ADMIN, Value::Null)
            .await,
    )
    .await;
    let etl = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["name"] == "acme-etl")
        .unwrap()
        .clone();
    assert_eq!(etl["origin"], "admin");
    assert_eq!(etl["secrets"].as_array().unwrap().len(), 2, "{etl}");
    assert!(!listed.to_string().contains("sk-gw-"), "no secret listed");

    // Another rotation without overlap: only the newest serves.
    let rotated = rotate(&gateway, "acme-etl", json!({"overlap_seconds": 0})).await;
    let third = rotated["key"].as_str().unwrap().to_owned();
    assert_eq!(call(&gateway, &first).await, 401);
    assert_eq!(call(&gateway, &second).await, 401);
    assert_eq!(call(&gateway, &third).await, 200);

    // A configured key rotated: its configured secret serves for the overlap.
    let rotated = rotate(&gateway, "globex-app", Value::Null).await;
    let globex = rotated["key"].as_str().unwrap().to_owned();
    assert_eq!(call(&gateway, GLOBEX).await, 200);
    assert_eq!(call(&gateway, &globex).await, 200);

    // A restart reads the file: the keys and their secrets hold.
    gateway.stop().await;
    let gateway = Running::start(&config).await;
    assert_eq!(call(&gateway, &third).await, 200, "kept over a restart");
    assert_eq!(call(&gateway, &globex).await, 200);

    // Revoked: refused at once; a configured key too, also after a reload.
    let revoke = |name: &'static str| gateway.admin(Method::DELETE, name, ADMIN, Value::Null);
    assert_eq!(revoke("/keys/acme-etl").await.status(), 204);
    assert_eq!(revoke("/keys/globex-app").await.status(), 204);
    assert_eq!(revoke("/keys/nobody").await.status(), 404);
    assert_eq!(call(&gateway, &third).await, 401);
    assert_eq!(call(&gateway, GLOBEX).await, 401);
    assert_eq!(call(&gateway, &globex).await, 401);
    let reloaded = reqwest::Client::new()
        .post(format!("{}/admin/reload", gateway.url))
        .bearer_auth(ADMIN)
        .body(config.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(reloaded.status(), 200);
    assert_eq!(call(&gateway, GLOBEX).await, 401, "revoked over a reload");
    // The name is free again once revoked.
    let (status, _) = json(
        gateway
            .admin(
                Method::POST,
                "/keys",
                ADMIN,
                json!({"name": "acme-etl", "tenant": "acme"}),
            )
            .await,
    )
    .await;
    assert_eq!(status, 201);
    gateway.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A key names a tenant the gateway knows: an unknown one is a 404 naming it, with the
/// nearest known name (a misspelling would otherwise serve a new top-level tenant with no
/// limits); a segment `..`, `.` or with a space is a 400; a reload whose key names a tenant
/// not in `[tenants.nodes]` is a 400 with the file's line, and nothing changes.
#[tokio::test]
async fn a_key_of_an_unknown_tenant_is_refused() {
    let gateway = Running::start(&demo()).await;
    let create = |body: Value| {
        let gateway = &gateway;
        async move { json(gateway.admin(Method::POST, "/keys", ADMIN, body).await).await }
    };
    let (status, body) = create(json!({"name": "k1", "tenant": "nosuch"})).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["message"], "no tenant named `nosuch`");
    let (status, body) = create(json!({"name": "k2", "tenant": "acme/serch"})).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(
        body["error"]["message"],
        "no tenant named `acme/serch` (did you mean `acme/search`?)"
    );
    for (tenant, name) in [
        ("acme", ".."),
        ("acme/..", "k3"),
        ("acme", "a b"),
        (".", "k4"),
    ] {
        let (status, body) = create(json!({"name": name, "tenant": tenant})).await;
        assert_eq!(status, 400, "{tenant} {name}: {body}");
    }
    let (status, body) = create(json!({"name": "k5", "tenant": "acme/search"})).await;
    assert_eq!(status, 201, "{body}");
    let (_, tenants) = json(
        gateway
            .admin(Method::GET, "/tenants", ADMIN, Value::Null)
            .await,
    )
    .await;
    let paths: Vec<&str> = (tenants["nodes"].as_array().or(tenants.as_array()))
        .unwrap()
        .iter()
        .filter_map(|n| n["path"].as_str())
        .collect();
    assert!(
        paths.iter().all(|p| !p.contains("..") && *p != "nosuch"),
        "{paths:?}"
    );

    // A reload whose key names `acme/serch`: refused with the line, nothing applied.
    let config = demo().replace("tenant = \"acme/search\"", "tenant = \"acme/serch\"");
    let line = config
        .lines()
        .position(|l| l.contains("tenant = \"acme/serch\""))
        .unwrap()
        + 1;
    let response = reqwest::Client::new()
        .post(format!("{}/admin/reload", gateway.url))
        .bearer_auth(ADMIN)
        .body(config)
        .send()
        .await
        .unwrap();
    let (status, body) = json(response).await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!(
            "line {line}: key `acme-search-web`: tenant `acme/serch` is not in [tenants.nodes] \
             (did you mean `acme/search`?)"
        )),
        "{message}"
    );
    gateway.stop().await;
}
