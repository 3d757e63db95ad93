//! What the Postgres crate's test binaries share.

/// Migrates the database at `url` on a runtime of its own (for sync callers and async ones
/// alike).
pub(crate) fn migrate_blocking(url: &str) {
    let url = url.to_owned();
    std::thread::spawn(move || {
        tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(tower_llm_quota_postgres::migrate(&url))
            .expect("migrated")
    })
    .join()
    .unwrap();
}
