//! The admin state: what the admin API changed (a node's limits and weight, the keys it
//! created, rotated or revoked), kept apart from the configuration file and applied over it.
//!
//! It is a flat map of fields, written a few at a time and read whole:
//!
//! | field | value |
//! |---|---|
//! | `limit:<dimension>:<period seconds>:<tenant path>` | the amount (`amount/burst` with a burst of its own), or `-`: the configured limit removed |
//! | `weight:<tenant path>` | the node's weight |
//! | `key:<name>` | a `KeyRecord` in JSON: its tenant, class, secrets' digests |
//! | `by:<field>` | who changed `<field>` last and when: `{"admin": name, "at": RFC 3339}` |
//!
//! One field per limit means two admins changing two limits of one node at once on two
//! replicas both win: no field is read, changed and written back.
//!
//! Where it lives: in the gateway's state ([`Persistence`]). In Redis, a hash beside a version
//! counter that every write bumps in the same script; in Postgres (or SQLite), the table
//! `admin` beside the version in `meta`, bumped in the same transaction. With a store the
//! replicas share, each reads the version every `admin_sync_ms` and, when it moved, the whole
//! map, and applies it. In memory (the demo's) it is lost at exit, unless `server.state_file`
//! names a JSON file (written whole, through a temporary file and a rename, readable by its
//! owner only); with an SQL state, such a file of an earlier version is read once into the
//! table `admin` when the table is empty.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use std::num::{NonZeroU32, NonZeroU64};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tower_llm_quota::tenant::{Tenant, TenantNode};
use tower_llm_quota::{Dimension, Limit};

use super::auth::KeyRecord;
use super::config::ConfigError;
use super::store::{Database, Persistence, Statement, Value};

/// The fields of the admin state.
pub(crate) type Fields = BTreeMap<String, String>;

/// A change: each field set to a value, or removed (`None`).
pub(crate) type Change = Vec<(String, Option<String>)>;

/// The store of the admin state.
pub(crate) struct StateStore {
    backend: Backend,
    /// The version last read (Redis): a reading that finds it unchanged reads nothing more.
    read: Mutex<Option<u64>>,
}

enum Backend {
    Memory(Mutex<Fields>),
    File {
        path: PathBuf,
        fields: Mutex<Fields>,
    },
    Redis(Box<Shared>),
    Database(Database),
}

struct Shared {
    connection: ConnectionManager,
    /// The hash, and the version counter (one hash tag: one slot).
    keys: [String; 2],
    write: redis::Script,
    read: redis::Script,
}

impl std::fmt::Debug for StateStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.backend {
            Backend::Memory(_) => "memory".to_owned(),
            Backend::File { path, .. } => format!("file {}", path.display()),
            Backend::Redis(shared) => format!("redis {}", shared.keys[0]),
            Backend::Database(database) => database.name(),
        };
        f.debug_struct("StateStore").field("in", &kind).finish()
    }
}

/// Sets and removes the fields of `ARGV` (pairs; an empty value removes) and bumps the
/// version, at once.
const WRITE: &str = r"
for i = 1, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[1], ARGV[i])
  else
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
return redis.call('INCR', KEYS[2])
";

/// The version and, when it is not `ARGV[1]`, every field.
const READ: &str = r"
local version = tonumber(redis.call('GET', KEYS[2]) or '0')
if tostring(version) == ARGV[1] then
  return {version}
end
return {version, redis.call('HGETALL', KEYS[1])}
";

impl StateStore {
    /// The store of `persistence`: Redis, the SQL `database`, or memory (in the file `file`,
    /// when one is given). A file that exists is read now (an unreadable one is an error: the
    /// gateway does not start over it); with a database, it is read into the table `admin`
    /// when the table is empty (the admin state of an earlier version).
    pub(crate) async fn open(
        persistence: &Persistence,
        database: Option<&Database>,
        file: Option<&Path>,
    ) -> Result<Self, ConfigError> {
        let backend = match (persistence.redis(), database, file) {
            (Some(url), _, _) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(1)))
                    .set_response_timeout(Some(Duration::from_secs(1)))
                    .set_number_of_retries(1);
                let client = redis::Client::open(url)
                    .map_err(|e| ConfigError(format!("redis (admin state): {e}")))?;
                let connection = ConnectionManager::new_lazy_with_config(client, config)
                    .map_err(|e| ConfigError(format!("redis (admin state): {e}")))?;
                Backend::Redis(Box::new(Shared {
                    connection,
                    keys: [
                        "{gateway:admin}".to_owned(),
                        "{gateway:admin}:version".to_owned(),
                    ],
                    write: redis::Script::new(WRITE),
                    read: redis::Script::new(READ),
                }))
            }
            (None, Some(database), file) => {
                if let Some(path) = file {
                    import(database, &read_file(path)?).await?;
                }
                Backend::Database(database.clone())
            }
            (None, None, Some(path)) => Backend::File {
                path: path.to_owned(),
                fields: Mutex::new(read_file(path)?),
            },
            (None, None, None) => Backend::Memory(Mutex::default()),
        };
        Ok(Self {
            backend,
            read: Mutex::new(None),
        })
    }

    /// Whether other replicas write it too (Redis, Postgres): it is then read again now and
    /// then.
    pub(crate) fn is_shared(&self) -> bool {
        matches!(
            self.backend,
            Backend::Redis(_) | Backend::Database(Database::Postgres(_))
        )
    }

    /// Applies `change` and returns every field after it (with Redis, as this write left
    /// them: another replica's later write is read at the next sync).
    ///
    /// # Cancel safety
    ///
    /// With Redis, dropped after the script was sent, the change may or may not be written;
    /// the next sync reads which.
    pub(crate) async fn write(&self, change: Change) -> Result<Fields, StoreError> {
        match &self.backend {
            Backend::Memory(fields) => {
                let mut fields = fields.lock().unwrap_or_else(|e| e.into_inner());
                apply(&mut fields, change);
                Ok(fields.clone())
            }
            Backend::File { path, fields } => {
                let mut fields = fields.lock().unwrap_or_else(|e| e.into_inner());
                let mut next = fields.clone();
                apply(&mut next, change);
                save(path, &next)
                    .map_err(|e| StoreError::write(format!("{}: {e}", path.display())))?;
                *fields = next;
                Ok(fields.clone())
            }
            Backend::Redis(shared) => {
                let mut invocation = shared.write.prepare_invoke();
                invocation.key(&shared.keys[0]).key(&shared.keys[1]);
                for (field, value) in change {
                    invocation.arg(field).arg(value.unwrap_or_default());
                }
                let mut connection = shared.connection.clone();
                let _version: u64 = invocation
                    .invoke_async(&mut connection)
                    .await
                    .map_err(|e| StoreError::write(format!("redis: {e}")))?;
                *self.read.lock().unwrap_or_else(|e| e.into_inner()) = None;
                self.read_all()
                    .await
                    .map(|fields| fields.unwrap_or_default())
            }
            Backend::Database(database) => {
                let mut statements = Vec::with_capacity(change.len() + 2);
                for (field, value) in change {
                    statements.push(match value {
                        Some(value) => Statement::new(SET_FIELD, vec![field.into(), value.into()]),
                        None => Statement::new(REMOVE_FIELD, vec![field.into()]),
                    });
                }
                statements.push(Statement::new(BUMP_VERSION, Vec::new()));
                statements.push(Statement::new(FIELDS, Vec::new()));
                let answers = database
                    .transaction(statements)
                    .await
                    .map_err(|e| StoreError::write(e.to_string()))?;
                let version = answers.iter().rev().nth(1).and_then(|rows| rows.first());
                *self.read.lock().unwrap_or_else(|e| e.into_inner()) =
                    version.and_then(|row| u64::try_from(row[0].int()).ok());
                Ok(fields_of(answers.last()))
            }
        }
    }

    /// Every field, when they may have changed since the last reading (always the first time);
    /// `None` when the version read is the one read before.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a reading changes nothing but which version counts as read.
    pub(crate) async fn read_all(&self) -> Result<Option<Fields>, StoreError> {
        if let Backend::Database(database) = &self.backend {
            let last = *self.read.lock().unwrap_or_else(|e| e.into_inner());
            let answers = database
                .transaction(vec![
                    Statement::new(VERSION, Vec::new()),
                    Statement::new(FIELDS, Vec::new()),
                ])
                .await
                .map_err(|e| StoreError::read(e.to_string()))?;
            let version = (answers.first().and_then(|rows| rows.first()))
                .map_or(0, |row| u64::try_from(row[0].int()).unwrap_or(0));
            if last == Some(version) {
                return Ok(None);
            }
            *self.read.lock().unwrap_or_else(|e| e.into_inner()) = Some(version);
            return Ok(Some(fields_of(answers.last())));
        }
        let Backend::Redis(shared) = &self.backend else {
            let mut read = self.read.lock().unwrap_or_else(|e| e.into_inner());
            if read.replace(0).is_some() {
                return Ok(None);
            }
            return Ok(Some(self.local().unwrap_or_default()));
        };
        let last = *self.read.lock().unwrap_or_else(|e| e.into_inner());
        let mut connection = shared.connection.clone();
        let reply: Vec<redis::Value> = shared
            .read
            .key(&shared.keys[0])
            .key(&shared.keys[1])
            .arg(last.map_or_else(|| "none".to_owned(), |v| v.to_string()))
            .invoke_async(&mut connection)
            .await
            .map_err(|e| StoreError::read(format!("redis: {e}")))?;
        let version: u64 = reply
            .first()
            .map(redis::from_redis_value_ref)
            .transpose()
            .map_err(|e| StoreError::read(format!("redis: {e}")))?
            .unwrap_or(0);
        let Some(fields) = reply.get(1) else {
            return Ok(None);
        };
        let fields: Fields = redis::from_redis_value_ref(fields)
            .map_err(|e| StoreError::read(format!("redis: {e}")))?;
        *self.read.lock().unwrap_or_else(|e| e.into_inner()) = Some(version);
        Ok(Some(fields))
    }

    /// The fields of a local store (memory or file).
    fn local(&self) -> Option<Fields> {
        match &self.backend {
            Backend::Memory(fields) | Backend::File { fields, .. } => {
                Some(fields.lock().unwrap_or_else(|e| e.into_inner()).clone())
            }
            Backend::Redis(_) | Backend::Database(_) => None,
        }
    }
}

const SET_FIELD: &str = "INSERT INTO admin (field, value) VALUES ($1, $2) \
    ON CONFLICT (field) DO UPDATE SET value = excluded.value";
const REMOVE_FIELD: &str = "DELETE FROM admin WHERE field = $1";
const BUMP_VERSION: &str = "INSERT INTO meta (name, value) VALUES ('admin_version', 1) \
    ON CONFLICT (name) DO UPDATE SET value = meta.value + 1 RETURNING value";
const VERSION: &str = "SELECT coalesce(max(value), 0) FROM meta WHERE name = 'admin_version'";
const FIELDS: &str = "SELECT field, value FROM admin";
const COUNT_FIELDS: &str = "SELECT count(*) FROM admin";

/// The fields of a statement's rows (`field`, `value`).
fn fields_of(rows: Option<&Vec<super::store::Row>>) -> Fields {
    (rows.into_iter().flatten())
        .map(|row| (row[0].text().to_owned(), row[1].text().to_owned()))
        .collect()
}

/// The fields of the JSON file at `path`, none if it does not exist.
fn read_file(path: &Path) -> Result<Fields, ConfigError> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map_err(|e| ConfigError(format!("server.state_file {}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Fields::new()),
        Err(e) => Err(ConfigError(format!(
            "server.state_file {}: {e}",
            path.display()
        ))),
    }
}

/// Writes `fields` (an earlier version's file) into `database`'s empty table `admin`.
async fn import(database: &Database, fields: &Fields) -> Result<(), ConfigError> {
    if fields.is_empty() {
        return Ok(());
    }
    let failed = |e: &dyn std::fmt::Display| ConfigError(format!("server.state_file: {e}"));
    let answers = database
        .transaction(vec![Statement::new(COUNT_FIELDS, Vec::new())])
        .await
        .map_err(|e| failed(&e))?;
    let count = (answers.first().and_then(|rows| rows.first())).map_or(0, |row| row[0].int());
    if count > 0 {
        return Ok(());
    }
    let mut statements: Vec<Statement> = fields
        .iter()
        .map(|(field, value)| {
            Statement::new(
                SET_FIELD,
                vec![Value::from(field.as_str()), value.as_str().into()],
            )
        })
        .collect();
    statements.push(Statement::new(BUMP_VERSION, Vec::new()));
    database
        .transaction(statements)
        .await
        .map_err(|e| failed(&e))?;
    tracing::warn!(
        fields = fields.len(),
        "server.state_file read into the state database"
    );
    Ok(())
}

/// The field of a node's limit of `dimension` per `period_seconds`.
pub(crate) fn limit_field(path: &Tenant, dimension: Dimension, period_seconds: u64) -> String {
    format!("limit:{}:{period_seconds}:{path}", dimension.as_str())
}

/// The field of a node's weight.
pub(crate) fn weight_field(path: &Tenant) -> String {
    format!("weight:{path}")
}

/// The field of a caller key's record.
pub(crate) fn key_field(name: &str) -> String {
    format!("key:{name}")
}

/// Who changed a field last, and when.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Stamp {
    pub(crate) admin: String,
    /// RFC 3339.
    pub(crate) at: String,
}

/// `change` with each field's stamp beside it (`by:<field>`): set with the field, removed
/// with it.
pub(crate) fn stamped(change: Change, stamp: &Stamp) -> Change {
    let value = serde_json::to_string(stamp).unwrap_or_default();
    let stamps: Vec<_> = (change.iter())
        .map(|(field, set)| (format!("by:{field}"), set.as_ref().map(|_| value.clone())))
        .collect();
    change.into_iter().chain(stamps).collect()
}

/// What the admin API changed of a node: limits set (`Some`: the amount, and the burst when it
/// has one of its own) or removed (`None`) by dimension and period, and its weight.
#[derive(Debug, Default, Clone)]
pub(crate) struct NodeOverride {
    pub(crate) limits: BTreeMap<(Dimension, u64), Option<SetLimit>>,
    pub(crate) weight: Option<NonZeroU32>,
}

/// A limit the admin API set: its amount, and its burst when given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SetLimit {
    pub(crate) amount: NonZeroU64,
    pub(crate) burst: Option<NonZeroU64>,
}

impl SetLimit {
    /// As the admin state keeps it: `amount`, or `amount/burst`.
    pub(crate) fn field_value(&self) -> String {
        match self.burst {
            Some(burst) => format!("{}/{burst}", self.amount),
            None => self.amount.to_string(),
        }
    }

    fn parse(value: &str) -> Option<Self> {
        let (amount, burst) = match value.split_once('/') {
            Some((amount, burst)) => (amount, Some(burst.parse().ok()?)),
            None => (value, None),
        };
        Some(Self {
            amount: amount.parse().ok()?,
            burst,
        })
    }
}

impl NodeOverride {
    /// `base` (the configuration's node) with these changes.
    pub(crate) fn over(&self, base: &TenantNode) -> TenantNode {
        let kept = base
            .limits()
            .iter()
            .filter(|l| {
                !self
                    .limits
                    .contains_key(&(l.dimension(), l.period().as_secs()))
            })
            .copied()
            .collect::<Vec<_>>();
        let set = self
            .limits
            .iter()
            .filter_map(|(&(dimension, period), set)| {
                let set = (*set)?;
                let limit = Limit::new(dimension, set.amount, Duration::from_secs(period)).ok()?;
                Some(set.burst.map_or(limit, |burst| limit.with_burst(burst)))
            });
        let mut node = kept
            .into_iter()
            .chain(set)
            .fold(without_limits(base), TenantNode::with_limit);
        if let Some(weight) = self.weight {
            node = node.with_weight(weight);
        }
        node
    }
}

/// The admin state read into its parts.
#[derive(Debug, Default)]
pub(crate) struct Parsed {
    pub(crate) nodes: BTreeMap<Tenant, NodeOverride>,
    pub(crate) keys: Vec<(String, KeyRecord)>,
    /// Who changed each field last, by field (none for a field written before stamps).
    pub(crate) stamps: BTreeMap<String, Stamp>,
}

/// Reads the fields; one that cannot be read is skipped and named in the second part (a
/// later version wrote it, or a hand did).
pub(crate) fn parse(fields: &Fields) -> (Parsed, Vec<String>) {
    let mut parsed = Parsed::default();
    let mut skipped = Vec::new();
    for (field, value) in fields {
        let mut read = || -> Option<()> {
            let (kind, rest) = field.split_once(':')?;
            match kind {
                "limit" => {
                    let (dimension, rest) = rest.split_once(':')?;
                    let (period, path) = rest.split_once(':')?;
                    let dimension = Dimension::ALL
                        .into_iter()
                        .find(|d| d.as_str() == dimension)?;
                    let amount = match value.as_str() {
                        "-" => None,
                        amount => Some(SetLimit::parse(amount)?),
                    };
                    let path = Tenant::parse(path).ok()?;
                    parsed
                        .nodes
                        .entry(path)
                        .or_default()
                        .limits
                        .insert((dimension, period.parse().ok()?), amount);
                }
                "weight" => {
                    let path = Tenant::parse(rest).ok()?;
                    parsed.nodes.entry(path).or_default().weight = Some(value.parse().ok()?);
                }
                "key" => parsed
                    .keys
                    .push((rest.to_owned(), serde_json::from_str(value).ok()?)),
                "by" => {
                    let stamp = serde_json::from_str(value).ok()?;
                    parsed.stamps.insert(rest.to_owned(), stamp);
                }
                _ => return None,
            }
            Some(())
        };
        if read().is_none() {
            skipped.push(field.clone());
        }
    }
    (parsed, skipped)
}

/// `node` without its limits, the rest kept.
pub(crate) fn without_limits(node: &TenantNode) -> TenantNode {
    let mut fresh = TenantNode::new()
        .with_weight(node.weight())
        .with_guarantee(node.guarantee());
    if let Some(share) = node.max_share() {
        fresh = fresh.with_max_share(share);
    }
    if let Some(max) = node.max_in_flight() {
        fresh = fresh.with_max_in_flight(max);
    }
    if let Some(max_wait) = node.max_wait() {
        fresh = fresh.with_max_wait(max_wait);
    }
    node.caps().iter().fold(fresh, |n, cap| n.with_cap(*cap))
}

fn apply(fields: &mut Fields, change: Change) {
    for (field, value) in change {
        match value {
            Some(value) => fields.insert(field, value),
            None => fields.remove(&field),
        };
    }
}

/// Writes `fields` to `path` whole: a temporary file beside it, readable by its owner only,
/// renamed over it.
fn save(path: &Path, fields: &Fields) -> std::io::Result<()> {
    use std::io::Write as _;
    let text = serde_json::to_string_pretty(fields).map_err(std::io::Error::other)?;
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut file = options.open(&temporary)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&temporary, path)
}

/// The admin state could not be written or read: which, and why.
#[derive(Debug)]
pub(crate) struct StoreError {
    reading: bool,
    reason: String,
}

impl StoreError {
    /// A write refused (or its answer lost).
    pub(crate) fn write(reason: String) -> Self {
        Self {
            reading: false,
            reason,
        }
    }

    /// A read that failed.
    pub(crate) fn read(reason: String) -> Self {
        Self {
            reading: true,
            reason,
        }
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.reading { "read" } else { "stored" };
        write!(f, "the admin state could not be {what}: {}", self.reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_read_says_read() {
        let read = StoreError::read("redis: connection refused".into()).to_string();
        assert_eq!(
            read,
            "the admin state could not be read: redis: connection refused"
        );
        let write = StoreError::write("disk full".into()).to_string();
        assert_eq!(write, "the admin state could not be stored: disk full");
    }

    #[tokio::test]
    async fn a_file_store_keeps_its_fields_over_a_restart() {
        let dir = std::env::temp_dir().join(format!("llm-quota-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.json");
        let _ = std::fs::remove_file(&path);
        let store = StateStore::open(&Persistence::Memory, None, Some(&path))
            .await
            .unwrap();
        assert_eq!(store.read_all().await.unwrap(), Some(Fields::new()));
        assert_eq!(store.read_all().await.unwrap(), None, "nothing new");
        let fields = store
            .write(vec![
                ("weight:a".into(), Some("3".into())),
                ("limit:requests:60:a".into(), Some("10".into())),
            ])
            .await
            .unwrap();
        assert_eq!(fields.len(), 2);
        store.write(vec![("weight:a".into(), None)]).await.unwrap();
        let again = StateStore::open(&Persistence::Memory, None, Some(&path))
            .await
            .unwrap();
        let fields = again.read_all().await.unwrap().unwrap();
        assert_eq!(
            fields.into_iter().collect::<Vec<_>>(),
            [("limit:requests:60:a".to_owned(), "10".to_owned())]
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "readable by its owner only");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_override_replaces_and_removes_limits_by_dimension_and_period() {
        let minute = Duration::from_secs(60);
        let base = TenantNode::new()
            .with_limit(
                Limit::new(Dimension::Requests, NonZeroU64::new(10).unwrap(), minute).unwrap(),
            )
            .with_limit(
                Limit::new(
                    Dimension::TotalTokens,
                    NonZeroU64::new(9_000).unwrap(),
                    minute,
                )
                .unwrap(),
            )
            .with_guarantee(0.25);
        let fields = Fields::from([
            ("limit:requests:60:a/b".to_owned(), "20".to_owned()),
            ("limit:total_tokens:60:a/b".to_owned(), "-".to_owned()),
            (
                "limit:output_tokens:3600:a/b".to_owned(),
                "500/50".to_owned(),
            ),
            ("weight:a/b".to_owned(), "4".to_owned()),
            ("weight:a//b".to_owned(), "4".to_owned()),
            ("limit:furlongs:60:a".to_owned(), "1".to_owned()),
        ]);
        let (parsed, skipped) = parse(&fields);
        assert_eq!(skipped, ["limit:furlongs:60:a", "weight:a//b"]);
        let node = parsed.nodes[&Tenant::parse("a/b").unwrap()].over(&base);
        let limits: Vec<(Dimension, u64, u64)> = node
            .limits()
            .iter()
            .map(|l| (l.dimension(), l.amount().get(), l.period().as_secs()))
            .collect();
        assert_eq!(
            limits,
            [
                (Dimension::Requests, 20, 60),
                (Dimension::OutputTokens, 500, 3600)
            ]
        );
        assert_eq!(node.limits()[1].capacity(), 50, "its own burst");
        assert_eq!(node.weight().get(), 4);
        assert_eq!(node.guarantee(), 0.25, "the rest of the node is kept");
    }

    #[tokio::test]
    async fn an_unreadable_file_stops_the_start() {
        let path = std::env::temp_dir().join(format!("llm-quota-bad-{}.json", std::process::id()));
        std::fs::write(&path, "not json").unwrap();
        let error = StateStore::open(&Persistence::Memory, None, Some(&path))
            .await
            .unwrap_err();
        assert!(error.0.contains("server.state_file"), "{error}");
        std::fs::remove_file(&path).unwrap();
    }
}
