//! Which store the server and the operator's commands use: SQLite in the data directory by
//! default, or the PostgreSQL database `--database-url` names, which several API hosts can
//! share.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use sandbar_core::Store;
use sandbar_store::{PgStore, SqliteStore, redacted_url};

/// The `--database-url` option, shared by `serve` and the operator's commands.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct DatabaseArgs {
    /// PostgreSQL database to keep records in (`postgres://user:password@host/db`, or
    /// `postgres://user@localhost/db?host=/run/postgresql` over a Unix socket) instead of
    /// `sandbar.db` in the data directory.
    #[arg(long, env = "SANDBAR_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
}

impl DatabaseArgs {
    pub fn postgres_url(&self) -> anyhow::Result<Option<&str>> {
        let Some(url) = self.database_url.as_deref().filter(|u| !u.is_empty()) else {
            return Ok(None);
        };
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            bail!(
                "unsupported database url {}: only postgres:// urls are (SQLite is the default, in the data directory)",
                redacted_url(url)
            );
        }
        Ok(Some(url))
    }
}

/// Connects to the PostgreSQL database at `url`, migrating it first.
pub async fn connect_postgres(url: &str) -> anyhow::Result<Arc<Store>> {
    Ok(Arc::new(PgStore::connect(url).await?))
}

/// Opens (creating it if needed) the SQLite database at `path`.
pub async fn open_sqlite(path: &Path) -> anyhow::Result<Arc<Store>> {
    let store = SqliteStore::open(path)
        .await
        .with_context(|| format!("cannot open {}", path.display()))?;
    Ok(Arc::new(store))
}
