//! PostgreSQL implementation of [`sandbar_core::Store`], for several API hosts sharing one
//! database: its connection and migrations, on which the records and their statements are the
//! SQLite store's (`backend`). Same semantics: unique violations are conflicts, lists come in
//! the same order, and what SQLite writes in one transaction is one here too.
//!
//! Timestamps are `timestamptz` (microseconds, as the SQLite store keeps them); JSON documents
//! are text, written and read whole. Text sort keys are compared byte-wise (`COLLATE "C"`), as
//! SQLite compares them, whatever the database's locale.

use std::str::FromStr;

use sandbar_core::Store;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::Records;

#[derive(Debug, thiserror::Error)]
pub enum ConnectStoreError {
    #[error("bad database url {url}: {source}")]
    Url { url: String, source: sqlx::Error },
    #[error("cannot connect to database {url}: {source}")]
    Connect { url: String, source: sqlx::Error },
    #[error("cannot migrate database {url}: {source}")]
    Migrate {
        url: String,
        source: sqlx::migrate::MigrateError,
    },
}

/// The records kept in one PostgreSQL database: [`PgStore::connect`] makes the core's
/// `Store` of it.
#[derive(Debug)]
pub enum PgStore {}

/// `url` without its password, to be shown in errors and logs.
pub fn redacted_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) => {
            if parsed.password().is_some() {
                // Only fails for URLs that cannot have a password, which this one has.
                let _ = parsed.set_password(Some("***"));
            }
            parsed.to_string()
        }
        Err(_) => "(unparsable url)".to_owned(),
    }
}

impl PgStore {
    /// Connects to the database at `url` (`postgres://…`; `?host=/dir` for a Unix socket) and
    /// applies pending migrations. Hosts starting together are safe: the migrator holds an
    /// advisory lock while it runs.
    pub async fn connect(url: &str) -> Result<Store, ConnectStoreError> {
        let shown = redacted_url(url);
        let options = PgConnectOptions::from_str(url)
            .map_err(|source| ConnectStoreError::Url {
                url: shown.clone(),
                source,
            })?
            // The migrator's `CREATE … IF NOT EXISTS` notices would be logged on every start.
            .options([("client_min_messages", "warning")]);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_with(options)
            .await
            .map_err(|source| ConnectStoreError::Connect {
                url: shown.clone(),
                source,
            })?;
        sqlx::migrate!("./migrations/postgres")
            .run(&pool)
            .await
            .map_err(|source| ConnectStoreError::Migrate {
                url: shown.clone(),
                source,
            })?;
        let lookups = crate::lookups::LookupWatch::start(&pool);
        Ok(pool.store(lookups))
    }
}
