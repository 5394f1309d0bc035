//! SQLite implementation of [`sandbar_core::Store`]: this file holds the pool, the migrations
//! and the helpers every table shares; each aggregate's records are in a module of its own.
//!
//! Timestamps are stored as microseconds since the Unix epoch so they sort and compare as
//! integers; maps are stored as JSON text.

use std::path::Path;

use chrono::{DateTime, Utc};
use sandbar_core::StoreError;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{Row, SqlitePool};

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

#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
}

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

fn json_opt<T: serde::de::DeserializeOwned>(
    row: &SqliteRow,
    column: &str,
) -> Result<Option<T>, StoreError> {
    let text: Option<String> = row.try_get(column).map_err(err)?;
    text.map(|t| serde_json::from_str(&t).map_err(err))
        .transpose()
}

fn micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

fn time(us: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(us).unwrap_or_default()
}

/// A template query: the template (`t`) with its owner's slug, which namespaces its names
/// (`tm`, joined on the owner), then `$rest`. A literal, so the SQL stays static.
macro_rules! template_query {
    ($rest:literal) => {
        concat!(
            "SELECT t.*, tm.slug AS namespace FROM templates t LEFT JOIN teams tm ON tm.id = t.team_id ",
            $rest
        )
    };
}

mod builds;
mod sandbox_logs;
mod sandboxes;
mod team_metrics;
mod teams;
mod templates;
mod volumes;

impl SqliteStore {
    /// Opens (creating if needed) the database file and applies pending migrations.
    pub async fn open(path: &Path) -> Result<Self, OpenStoreError> {
        let shown = path.display().to_string();
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // With WAL, NORMAL keeps the database consistent and loses nothing on a process
            // crash (only on power loss), and saves an fsync per write on the create path.
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(std::time::Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .map_err(|source| OpenStoreError::Open {
                path: shown.clone(),
                source,
            })?;
        sqlx::migrate!("./migrations")
            .run(&pool)
            .await
            .map_err(|source| OpenStoreError::Migrate {
                path: shown.clone(),
                source,
            })?;
        let store = Self { pool };
        store
            .give_teams_slugs()
            .await
            .map_err(|source| OpenStoreError::Slugs {
                path: shown,
                source,
            })?;
        Ok(store)
    }
}
