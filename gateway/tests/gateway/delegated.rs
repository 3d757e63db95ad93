//! Delegated admins: a token scoped to a subtree reads and changes only that subtree, and
//! never sees another tenant, on every admin route.

use reqwest::Method;
use serde_json::{Value, json};

use super::support::{ADMIN, GLOBEX, Running, chat, demo};

/// The demo's delegated admin of `acme`.
const ACME_ADMIN: &str = "demo-admin-acme";

async fn call(gateway: &Running, method: Method, path: &str, body: Value) -> (u16, Value) {
    let response = gateway.admin(method, path, ACME_ADMIN, body).await;
    let status = response.status().as_u16();
    let body = response.bytes().await.unwrap();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// Every tenant path and key name in a JSON answer.
fn names(value: &Value) -> String {
    value.to_string()
}

#[tokio::test]
async fn a_delegated_admin_reads_and_changes_its_subtree_only_on_every_route() {
    let gateway = Running::start(&demo()).await;
    // Some traffic of both tenants, so that usage has rows to leak.
    for key in [super::support::SEARCH, GLOBEX] {
        let response = gateway
            .post("/v1/chat/completions", Some(key), &chat(8))
            .await;
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }

    // GET /admin/tenants and /admin/usage: acme's subtree only.
    for route in ["/tenants", "/usage"] {
        let (status, body) = call(&gateway, Method::GET, route, Value::Null).await;
        assert_eq!(status, 200, "{route}");
        let paths: Vec<&str> = body
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["path"].as_str().or(t["tenant"].as_str()).unwrap())
            .collect();
        assert!(paths.contains(&"acme/search"), "{route}: {paths:?}");
        assert!(
            paths.iter().all(|p| p.starts_with("acme")),
            "{route}: {paths:?}"
        );
        assert!(!names(&body).contains("globex"), "{route}: {body}");
    }
    // The operator sees both.
    let all = gateway
        .admin(Method::GET, "/tenants", ADMIN, Value::Null)
        .await;
    assert!(all.text().await.unwrap().contains("globex"));

    // PUT /admin/limits: below acme, within acme's own; not acme itself; globex not found.
    let limit = |tenant: &str, amount: u64| json!({"tenant": tenant, "limits": [{"dimension": "requests", "amount": amount, "period_seconds": 60}]});
    let (status, _) = call(&gateway, Method::PUT, "/limits", limit("acme/search", 100)).await;
    assert_eq!(status, 204);
    let (status, body) = call(&gateway, Method::PUT, "/limits", limit("acme/search", 301)).await;
    assert_eq!(status, 400, "above acme's 300 a minute: {body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("acme's own"),
        "{body}"
    );
    let (status, body) = call(&gateway, Method::PUT, "/limits", limit("acme", 10)).await;
    assert_eq!(
        (status, body["error"]["type"].as_str()),
        (403, Some("forbidden"))
    );
    let (status, body) = call(&gateway, Method::PUT, "/limits", limit("globex", 10)).await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["message"], "no tenant named `globex`");
    // A tenant that does not exist reads the same as one it may not see.
    let (status, _) = call(&gateway, Method::PUT, "/limits", limit("initech", 10)).await;
    assert_eq!(status, 404);

    // POST /admin/pause and /resume, by tenant and by key.
    for route in ["/pause", "/resume"] {
        let (status, _) = call(
            &gateway,
            Method::POST,
            route,
            json!({"tenant": "acme/reports"}),
        )
        .await;
        assert_eq!(status, 204, "{route}");
        let (status, _) = call(
            &gateway,
            Method::POST,
            route,
            json!({"key": "acme-search-web"}),
        )
        .await;
        assert_eq!(status, 204, "{route}");
        let (status, _) = call(&gateway, Method::POST, route, json!({"tenant": "globex"})).await;
        assert_eq!(status, 404, "{route}");
        let (status, body) =
            call(&gateway, Method::POST, route, json!({"key": "globex-app"})).await;
        assert_eq!(status, 404, "{route}");
        assert_eq!(body["error"]["message"], "no key named `globex-app`");
        let (status, _) = call(&gateway, Method::POST, route, json!({"tenant": "acme"})).await;
        assert_eq!(status, 403, "{route}: acme's own pause is the operator's");
    }
    let response = gateway
        .post("/v1/chat/completions", Some(GLOBEX), &chat(8))
        .await;
    assert_eq!(response.status(), 200, "globex untouched");
    response.bytes().await.unwrap();

    // Keys: acme's listed only; made under acme only; globex's neither rotated nor revoked.
    let (status, keys) = call(&gateway, Method::GET, "/keys", Value::Null).await;
    assert_eq!(status, 200);
    assert!(!names(&keys).contains("globex"), "{keys}");
    assert!(names(&keys).contains("acme-search-web"), "{keys}");
    let (status, _) = call(
        &gateway,
        Method::POST,
        "/keys",
        json!({"name": "g2", "tenant": "globex"}),
    )
    .await;
    assert_eq!(status, 404);
    let (status, made) = call(
        &gateway,
        Method::POST,
        "/keys",
        json!({"name": "acme-new", "tenant": "acme/reports"}),
    )
    .await;
    assert_eq!(status, 201, "{made}");
    let (status, _) = call(
        &gateway,
        Method::POST,
        "/keys/globex-app/rotate",
        Value::Null,
    )
    .await;
    assert_eq!(status, 404);
    let (status, _) = call(&gateway, Method::DELETE, "/keys/globex-app", Value::Null).await;
    assert_eq!(status, 404);
    let (status, _) = call(&gateway, Method::POST, "/keys/acme-new/rotate", Value::Null).await;
    assert_eq!(status, 200);
    let (status, _) = call(&gateway, Method::DELETE, "/keys/acme-new", Value::Null).await;
    assert_eq!(status, 204);

    // GET /admin/report: acme's rows, no account table.
    let (status, review) = call(&gateway, Method::GET, "/report", Value::Null).await;
    assert_eq!(status, 200);
    assert!(!names(&review).contains("globex"), "{review}");
    assert!(names(&review).contains("acme/search"), "{review}");
    assert_eq!(review["accounts"], serde_json::json!([]));

    // The routes of the whole gateway are the operator's.
    let (status, _) = call(&gateway, Method::GET, "/routes", Value::Null).await;
    assert_eq!(status, 403);
    let (status, _) = call(&gateway, Method::POST, "/reload", Value::Null).await;
    assert_eq!(status, 403);

    // A token of no admin: 401.
    let response = gateway
        .admin(Method::GET, "/tenants", "nobody", Value::Null)
        .await;
    assert_eq!(response.status(), 401);
    gateway.stop().await;
}
