//! `/admin/keys`: the callers' keys, created, rotated and revoked without a restart.
//!
//! A new secret is shown once, in the answer that made it; the gateway keeps its SHA-256
//! digest only (in the admin state: Redis with `--redis-url`, else `server.state_file`). A
//! rotation keeps the old secrets valid for an overlap, so that callers move to the new one
//! without a refused request; a revocation refuses the key at once, on every replica within
//! `admin_sync_ms`. A configured key can be rotated or revoked too: its record in the admin
//! state then stands for it (and the configuration's secret stays refused after a reload).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Extension;
use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde::{Deserialize, Serialize};
use tower_llm_quota::tenant::Tenant;

use super::super::Gateway;
use super::super::audit::{AdminEntry, rfc3339};
use super::super::auth::{Admin, KeyRecord, Origin, SecretDigest, configured_secret, new_secret};
use super::super::config::{Class, Retries};
use super::super::state;
use super::answers::{Refused, error, not_found, store, unreadable};

/// The overlap of a rotation when none is asked: an hour.
const DEFAULT_OVERLAP: Duration = Duration::from_secs(3_600);

/// The longest overlap: thirty days.
const MAX_OVERLAP: Duration = Duration::from_secs(30 * 86_400);

/// A key as `GET /admin/keys` lists it (never its secret).
#[derive(Debug, Serialize)]
pub(super) struct KeyView {
    name: String,
    tenant: String,
    default_class: &'static str,
    allow_priority_header: bool,
    models: Option<Vec<String>>,
    origin: Origin,
    /// Until when each of its secrets is valid (RFC 3339); `null`: until rotated or revoked.
    secrets: Vec<Option<String>>,
}

pub(super) async fn list(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
) -> Json<Vec<KeyView>> {
    let keys = gateway.keys();
    let now = SystemTime::now();
    let views = keys
        .list()
        .filter(|(caller, ..)| admin.sees(&caller.path))
        .map(|(caller, origin, secrets)| KeyView {
            name: caller.name.clone(),
            tenant: caller.tenant.clone(),
            default_class: caller.default_class.as_str(),
            allow_priority_header: caller.allow_priority_header,
            models: caller.models.as_ref().map(|m| m.to_vec()),
            origin,
            secrets: secrets
                .into_iter()
                .filter(|until| until.is_none_or(|until| until > now))
                .map(|until| until.map(rfc3339))
                .collect(),
        })
        .collect();
    Json(views)
}

/// `POST /admin/keys`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct NewKey {
    name: String,
    tenant: String,
    #[serde(default = "default_class")]
    default_class: Class,
    #[serde(default)]
    allow_priority_header: bool,
    models: Option<Vec<String>>,
    #[serde(default)]
    retries: Retries,
}

fn default_class() -> Class {
    Class::Async
}

/// A new secret, shown once.
#[derive(Debug, Serialize)]
struct Issued {
    name: String,
    tenant: String,
    /// The secret: kept by the gateway as a digest only, not shown again.
    key: String,
    /// After a rotation: until when the previous secrets are still accepted.
    #[serde(skip_serializing_if = "Option::is_none")]
    previous_valid_until: Option<String>,
}

/// The refusal of `new` to `admin`, if it cannot be made: its path, its tenant, its name or
/// its models.
fn refusal_of(gateway: &Gateway, admin: &Admin, new: &NewKey) -> Option<Response> {
    let parsed = Tenant::parse(&new.tenant).and_then(|t| Ok((t.child(&new.name)?, t)));
    let (path, tenant) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            let reason = format!("the tenant and the key's name must make a tenant path: {e}");
            return Some(error(StatusCode::BAD_REQUEST, "invalid_request", reason));
        }
    };
    if !admin.sees(&path) {
        return Some(not_found("tenant", &new.tenant));
    }
    if !gateway.tenants.knows(&tenant) {
        // A key serves its tenant's limits: a name the gateway does not know is a mistake
        // (a misspelling would make a new top-level tenant with no limits), not a new node.
        let hint = gateway.tenants.hint(&new.tenant, admin.scope.as_ref());
        let reason = format!("no tenant named `{}`{hint}", new.tenant);
        return Some(error(StatusCode::NOT_FOUND, "not_found", reason));
    }
    if gateway.keys().get(&new.name).is_some() {
        let reason = format!("a key named `{}` exists: rotate or revoke it", new.name);
        return Some(error(StatusCode::CONFLICT, "conflict", reason));
    }
    if let Some(unknown) = unknown_model(gateway, new.models.as_deref()) {
        let reason = format!("model `{unknown}` is not in [[models]]");
        return Some(error(StatusCode::BAD_REQUEST, "invalid_request", reason));
    }
    None
}

pub(super) async fn create(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
    new: Result<Json<NewKey>, JsonRejection>,
) -> Response {
    let new = match new {
        Ok(Json(new)) => new,
        Err(rejection) => return unreadable(&rejection),
    };
    if let Some(refused) = refusal_of(&gateway, &admin, &new) {
        return refused;
    }
    let Ok(secret) = new_secret() else {
        let reason = "the system's randomness is not available";
        return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", reason);
    };
    let record = KeyRecord {
        tenant: new.tenant.clone(),
        default_class: new.default_class,
        allow_priority_header: new.allow_priority_header,
        models: new.models,
        retries: new.retries,
        secrets: vec![SecretDigest::of(&secret, None)],
        revoked: false,
    };
    if let Err(refused) = save(&gateway, &admin, &new.name, &record).await {
        return refused.into_response();
    }
    audit(
        &gateway,
        &admin,
        "create_key",
        &new.name,
        None,
        Some(&record),
    );
    let issued = Issued {
        name: new.name,
        tenant: new.tenant,
        key: secret,
        previous_valid_until: None,
    };
    (StatusCode::CREATED, Json(issued)).into_response()
}

/// `POST /admin/keys/{name}/rotate`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Rotation {
    overlap_seconds: Option<u64>,
}

pub(super) async fn rotate(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    // No body (or `null`): the default overlap.
    let rotation: Rotation = match serde_json::from_slice::<Option<Rotation>>(&body) {
        Ok(rotation) => rotation.unwrap_or_default(),
        Err(_) if body.iter().all(u8::is_ascii_whitespace) => Rotation::default(),
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_request", e),
    };
    let overlap = rotation
        .overlap_seconds
        .map_or(DEFAULT_OVERLAP, Duration::from_secs);
    if overlap > MAX_OVERLAP {
        let reason = format!(
            "overlap_seconds must be at most {} (30 days)",
            MAX_OVERLAP.as_secs()
        );
        return error(StatusCode::BAD_REQUEST, "invalid_request", reason);
    }
    let Some(before) = current(&gateway, &admin, &name) else {
        return not_found("key", &name);
    };
    let Ok(secret) = new_secret() else {
        let reason = "the system's randomness is not available";
        return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", reason);
    };
    let now = unix_seconds(SystemTime::now());
    let until = now + overlap.as_secs();
    let mut record = before.clone();
    // The old secrets end at the overlap's end (sooner if they did), the spent ones go.
    record.secrets.retain(|s| s.until.is_none_or(|t| t > now));
    for old in &mut record.secrets {
        old.until = Some(old.until.map_or(until, |t| t.min(until)));
    }
    record.secrets.push(SecretDigest::of(&secret, None));
    if let Err(refused) = save(&gateway, &admin, &name, &record).await {
        return refused.into_response();
    }
    audit(
        &gateway,
        &admin,
        "rotate_key",
        &name,
        Some(&before),
        Some(&record),
    );
    let issued = Issued {
        name,
        tenant: record.tenant,
        key: secret,
        previous_valid_until: Some(rfc3339(UNIX_EPOCH + Duration::from_secs(until))),
    };
    Json(issued).into_response()
}

pub(super) async fn revoke(
    State(gateway): State<Arc<Gateway>>,
    Extension(admin): Extension<Admin>,
    Path(name): Path<String>,
) -> Response {
    let Some(before) = current(&gateway, &admin, &name) else {
        return not_found("key", &name);
    };
    let record = KeyRecord {
        secrets: Vec::new(),
        revoked: true,
        ..before.clone()
    };
    if let Err(refused) = save(&gateway, &admin, &name, &record).await {
        return refused.into_response();
    }
    audit(
        &gateway,
        &admin,
        "revoke_key",
        &name,
        Some(&before),
        Some(&record),
    );
    StatusCode::NO_CONTENT.into_response()
}

/// The record of the key `name` as served now, if `admin` may see it: the admin state's, or
/// one made of the configured key (with its secret's digest, for a rotation's overlap).
fn current(gateway: &Gateway, admin: &Admin, name: &str) -> Option<KeyRecord> {
    let keys = gateway.keys();
    let (caller, origin) = keys.get(name)?;
    if !admin.sees(&caller.path) {
        return None;
    }
    match origin {
        Origin::Admin => {
            let fields = gateway.applied_state();
            let text = fields.get(&state::key_field(name))?;
            serde_json::from_str(text).ok()
        }
        Origin::Config => {
            let config = gateway.config();
            let key = config.keys.iter().find(|k| k.name == name)?;
            let mut record = KeyRecord::from_config(key);
            let secret = configured_secret(key).ok()?;
            record.secrets.push(SecretDigest::of(&secret, None));
            Some(record)
        }
    }
}

async fn save(
    gateway: &Gateway,
    admin: &Admin,
    name: &str,
    record: &KeyRecord,
) -> Result<(), Refused> {
    let value = serde_json::to_string(record).unwrap_or_default();
    store(gateway, admin, vec![(state::key_field(name), Some(value))]).await
}

/// The first of `models` the configuration does not name (when it names models at all).
fn unknown_model(gateway: &Gateway, models: Option<&[String]>) -> Option<String> {
    let config = gateway.config();
    models?
        .iter()
        .find(|m| !config.models.iter().any(|c| c.name == **m))
        .cloned()
}

/// A key change in the audit log; the record's digests are left out (as the key).
fn audit(
    gateway: &Gateway,
    admin: &Admin,
    action: &'static str,
    name: &str,
    before: Option<&KeyRecord>,
    after: Option<&KeyRecord>,
) {
    let summary = |record: Option<&KeyRecord>| match record {
        None => serde_json::Value::Null,
        Some(record) => serde_json::json!({
            "tenant": record.tenant,
            "secrets": record.secrets.len(),
            "revoked": record.revoked,
        }),
    };
    gateway.audit.write(&AdminEntry {
        time: rfc3339(SystemTime::now()),
        admin: &admin.name,
        action,
        target: name,
        before: summary(before),
        after: summary(after),
    });
}

fn unix_seconds(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}
