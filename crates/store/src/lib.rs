//! SQLite and PostgreSQL implementations of [`sandbar_core::Store`]. This file holds the
//! SQLite pool, its migrations and the error and time conversions both databases use; each
//! aggregate's records are a type of their own in a module of their own (`Teams` in `teams`,
//! …), generic over the database (`backend`), and [`SqliteStore::open`] hands one of each to
//! the core as its `Store`. `rows` holds the rows both databases read back and how each
//! becomes a record. [`PgStore`], in `postgres`, keeps the same records in a database
//! several API hosts can share.
//!
//! Timestamps are stored as microseconds since the Unix epoch so they sort and compare as
//! integers; maps are stored as JSON text.

use std::path::Path;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use sandbar_core::store::LookupGenerations;
use sandbar_core::{Store, StoreError};
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

#[derive(Debug, thiserror::Error)]
pub enum OpenStoreError {
    #[error("cannot open database {path}: {source}")]
    Open { path: String, source: sqlx::Error },
    #[error("cannot migrate database {path}: {source}")]
    Migrate {
        path: String,
        source: sqlx::migrate::MigrateError,
    },
    #[error("cannot give the teams of database {path} their slugs: {source}")]
    Slugs { path: String, source: StoreError },
}

pub use postgres::{ConnectStoreError, PgStore, redacted_url};

/// The records kept in one SQLite file: [`SqliteStore::open`] makes the core's `Store` of it.
#[derive(Debug)]
pub enum SqliteStore {}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// A failed insert of `what` `id`: a row already holding its key is a conflict, anything else
/// the backend's failure.
fn insert_err<'a>(what: &'static str, id: &'a str) -> impl FnOnce(sqlx::Error) -> StoreError + 'a {
    move |e| match &e {
        sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict {
            what,
            id: id.to_owned(),
        },
        _ => err(e),
    }
}

fn to_json<T: serde::Serialize>(value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(err)
}

fn micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

fn time(us: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(us).unwrap_or_default()
}

#[macro_use]
mod backend;
mod builds;
mod layer_blobs;
mod lookups;
mod nodes;
mod postgres;
mod request_counts;
mod rows;
mod sandbox_events;
mod sandbox_logs;
mod sandboxes;
mod team_metrics;
mod teams;
mod templates;
mod volumes;
mod webhooks;

use builds::Builds;
use layer_blobs::LayerBlobs;
use nodes::Nodes;
use request_counts::RequestCounts;
use sandbox_events::SandboxEvents;
use sandbox_logs::SandboxLogs;
use sandboxes::Sandboxes;
use team_metrics::TeamMetrics;
use teams::Teams;
use templates::Templates;
use volumes::Volumes;
use webhooks::Webhooks;

/// A database the core's `Store` can be made on.
trait Records {
    /// One of each aggregate's records, on this database, with what its cached lookups are
    /// compared against.
    fn store(self, lookups: Arc<dyn LookupGenerations>) -> Store;
}

on_both! {
    impl Records for B {
        fn store(self, lookups: Arc<dyn LookupGenerations>) -> Store {
            Store {
                teams: Arc::new(Teams { db: self.clone() }),
                templates: Arc::new(Templates { db: self.clone() }),
                builds: Arc::new(Builds { db: self.clone() }),
                sandboxes: Arc::new(Sandboxes { db: self.clone() }),
                volumes: Arc::new(Volumes { db: self.clone() }),
                sandbox_logs: Arc::new(SandboxLogs { db: self.clone() }),
                sandbox_events: Arc::new(SandboxEvents { db: self.clone() }),
                webhooks: Arc::new(Webhooks { db: self.clone() }),
                team_metrics: Arc::new(TeamMetrics { db: self.clone() }),
                nodes: Arc::new(Nodes { db: self.clone() }),
                layer_blobs: Arc::new(LayerBlobs { db: self.clone() }),
                request_counts: Arc::new(RequestCounts { db: self }),
                lookups,
            }
        }
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the database file and applies pending migrations.
    pub async fn open(path: &Path) -> Result<Store, OpenStoreError> {
        let shown = path.display().to_string();
        let cannot_open = |source| OpenStoreError::Open {
            path: shown.clone(),
            source,
        };
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // With WAL, NORMAL keeps the database consistent and loses nothing on a process
            // crash (only on power loss), and saves an fsync per write on the create path.
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(std::time::Duration::from_secs(5))
            // PostgreSQL's byte-wise collation, under its name, so the statements both
            // databases share can ask for it; SQLite's own text order is the same.
            .collation("C", |a: &str, b: &str| a.cmp(b));
        // Made first: it creates the file and migrates it before any reader opens it.
        let writes = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .map_err(cannot_open)?;
        sqlx::migrate!("./migrations")
            .run(&writes)
            .await
            .map_err(|source| OpenStoreError::Migrate {
                path: shown.clone(),
                source,
            })?;
        // A write sent to a reader fails (`query_only`) rather than meeting the writer in
        // the busy handler: the store's tests run every statement, so none can slip there.
        let reads = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options.pragma("query_only", "ON"))
            .await
            .map_err(cannot_open)?;
        let db = SqliteDb { reads, writes };
        Teams { db: db.clone() }
            .give_teams_slugs()
            .await
            .map_err(|source| OpenStoreError::Slugs {
                path: shown,
                source,
            })?;
        let lookups = Arc::new(lookups::SqliteLookups { db: db.clone() });
        Ok(db.store(lookups))
    }
}

/// The connections to one SQLite file, by what a statement does with it.
///
/// SQLite lets one connection write at a time. Writers on several connections meet in
/// SQLite's busy handler, which sleeps 1, 2, 5, 10, 15, 20, 25 … ms between tries however
/// soon the lock frees: under 50 creates at once, that sleep was a create's slowest 60–70
/// ms. On a single connection, writers wait their turn in the pool's queue instead, each
/// woken the moment the one before it is done. Readers never wait for a writer (WAL), so
/// they keep several connections of their own.
#[derive(Debug, Clone)]
pub(crate) struct SqliteDb {
    pub(crate) reads: SqlitePool,
    /// Every statement or transaction that writes, and only those.
    pub(crate) writes: SqlitePool,
}

#[cfg(test)]
mod tests {
    use sandbar_core::{HandlePhase, SandboxStatus};
    use sqlx::migrate::Migrator;

    use super::*;

    /// A database as the last release before sandbox statuses left it, with one sandbox
    /// in each way it could be recorded.
    async fn database_before_statuses(path: &Path) {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .foreign_keys(false);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .expect("open");
        let all = sqlx::migrate!("./migrations");
        let before = Migrator {
            migrations: all
                .migrations
                .iter()
                .filter(|m| m.version < 13)
                .cloned()
                .collect::<Vec<_>>()
                .into(),
            ..Migrator::DEFAULT
        };
        before.run(&pool).await.expect("migrate to 12");
        let flags = |more: &str| format!(r#"{{"pid": 7, "start_ticks": 9, "slot": 2{more}}}"#);
        for (id, state, paused_as, handle) in [
            ("running", "running", None, flags("")),
            ("old-pause", "paused", None, "null".to_owned()),
            ("memory", "paused", Some("memory"), flags("")),
            (
                "files",
                "paused",
                Some("files"),
                flags(r#", "released": true"#),
            ),
            ("checkpointing", "paused", Some("checkpointing"), flags("")),
            (
                "checkpoint",
                "paused",
                Some("checkpoint"),
                flags(r#", "checkpointed": true"#),
            ),
            ("releasing", "paused", Some("releasing"), flags("")),
        ] {
            sqlx::query(
                "INSERT INTO sandboxes (id, team_id, template_id, started_at, end_at, cpu_count, memory_mb, disk_size_mb, metadata, env_vars, allow_internet_access, envd_access_token, envd_version, state, handle, paused_as) VALUES (?, 't', 'base', 0, 0, 1, 512, 1024, '{}', '{}', 1, 'token', '0.6.4', ?, ?, ?)",
            )
            .bind(id)
            .bind(state)
            .bind(handle)
            .bind(paused_as)
            .execute(&pool)
            .await
            .expect("insert");
        }
        pool.close().await;
    }

    /// The shared statements rely on SQLite taking PostgreSQL's numbered parameters, a
    /// number used twice being one value, and on a "C" collation sorting as SQLite's own.
    #[tokio::test]
    async fn sqlite_takes_numbered_parameters_and_the_c_collation() {
        let options = SqliteConnectOptions::new()
            .in_memory(true)
            .collation("C", |a: &str, b: &str| a.cmp(b));
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .expect("open");
        let (sum, text): (i64, String) = sqlx::query_as("SELECT $2 + $2 + $1, $3")
            .bind(1_i64)
            .bind(20_i64)
            .bind("three")
            .fetch_one(&pool)
            .await
            .expect("numbered parameters");
        assert_eq!((sum, text.as_str()), (41, "three"));
        let sorted: Vec<String> = sqlx::query_scalar(
            "SELECT x FROM (SELECT 'b' AS x UNION ALL SELECT 'B' UNION ALL SELECT 'a') ORDER BY x COLLATE \"C\"",
        )
        .fetch_all(&pool)
        .await
        .expect("collation");
        assert_eq!(sorted, ["B", "a", "b"]);
    }

    #[tokio::test]
    async fn stored_states_and_pause_kinds_become_statuses() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sandbar.db");
        database_before_statuses(&path).await;
        let store = SqliteStore::open(&path).await.expect("open and migrate");
        let mut statuses: Vec<(String, SandboxStatus)> = store
            .sandboxes
            .all_sandboxes()
            .await
            .expect("read")
            .into_iter()
            .map(|s| (s.id, s.status))
            .collect();
        statuses.sort_by(|a, b| a.0.cmp(&b.0));
        let want = |id: &str, status| (id.to_owned(), status);
        assert_eq!(
            statuses,
            vec![
                want("checkpoint", SandboxStatus::Checkpointed),
                want("checkpointing", SandboxStatus::Checkpointing),
                want("files", SandboxStatus::Shelved),
                want("memory", SandboxStatus::Paused),
                want("old-pause", SandboxStatus::Paused),
                want("releasing", SandboxStatus::Pausing),
                want("running", SandboxStatus::Running),
            ]
        );
        let phase_of = |id: &'static str| {
            let store = &store;
            async move {
                let kept = store.sandboxes.sandbox(id).await.expect("read");
                kept.expect("kept").handle.phase
            }
        };
        // The flags of the first handle layout become its phase; a null becomes a handle of
        // nothing launched, which every runtime refuses.
        assert_eq!(phase_of("checkpoint").await, HandlePhase::Checkpointed);
        assert_eq!(phase_of("files").await, HandlePhase::Released);
        assert_eq!(phase_of("running").await, HandlePhase::Running);
        assert_eq!(phase_of("old-pause").await, HandlePhase::Unlaunched);
        let running = store.sandboxes.sandbox("running").await.expect("read");
        let running = running.expect("kept").handle;
        assert_eq!((running.pid, running.start_ticks, running.slot), (7, 9, 2));
    }
}
