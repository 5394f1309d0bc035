//! SQLite implementation of [`sandbar_core::Store`].
//!
//! Timestamps are stored as microseconds since the Unix epoch so they sort and compare as
//! integers; maps are stored as JSON text.

use std::path::Path;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use sandbar_core::auth::TeamLimits;
use sandbar_core::store::{StoredAccessToken, StoredApiKey, StoredSecret};
use sandbar_core::{BuildFailure, BuildLogEntry, BuildRecord, BuildSpec, LogLevel, TemplateImage};
use sandbar_core::{
    BuildStatus, NetworkConfig, PauseKind, RuntimeHandle, Sandbox, SandboxState, Store, StoreError,
    Team, Template, Volume, VolumeMount,
};
use sandbar_core::{SandboxLogEntry, SandboxLogQuery, TeamMetricBucket};
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
    StoreError(e.to_string())
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

fn build_from_row(row: &SqliteRow) -> Result<BuildRecord, StoreError> {
    let id: String = row.try_get("id").map_err(err)?;
    let status: String = row.try_get("status").map_err(err)?;
    Ok(BuildRecord {
        template_id: row.try_get("template_id").map_err(err)?,
        team_id: row.try_get("team_id").map_err(err)?,
        status: BuildStatus::parse(&status)
            .ok_or_else(|| err(format!("build {id} has unknown status {status}")))?,
        failure: json_opt::<BuildFailure>(row, "failure")?,
        spec: json_opt::<BuildSpec>(row, "spec")?,
        image: json_opt::<TemplateImage>(row, "image")?,
        cpu_count: row.try_get("cpu_count").map_err(err)?,
        memory_mb: row.try_get("memory_mb").map_err(err)?,
        disk_size_mb: row.try_get("disk_size_mb").map_err(err)?,
        created_at: time(row.try_get("created_at").map_err(err)?),
        updated_at: time(row.try_get("updated_at").map_err(err)?),
        finished_at: row
            .try_get::<Option<i64>, _>("finished_at")
            .map_err(err)?
            .map(time),
        id,
    })
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

    /// Teams made before names had namespaces get a slug from their name, in the order they
    /// were made, so the oldest keeps the plain one.
    async fn give_teams_slugs(&self) -> Result<(), StoreError> {
        let rows =
            sqlx::query("SELECT id, name FROM teams WHERE slug IS NULL ORDER BY created_at, id")
                .fetch_all(&self.pool)
                .await
                .map_err(err)?;
        for row in &rows {
            let id: String = row.try_get("id").map_err(err)?;
            let name: String = row.try_get("name").map_err(err)?;
            let slug = self.free_slug(&name).await?;
            sqlx::query("UPDATE teams SET slug = ? WHERE id = ?")
                .bind(&slug)
                .bind(&id)
                .execute(&self.pool)
                .await
                .map_err(err)?;
        }
        Ok(())
    }

    /// `slug_of(name)`, or with `-2`, `-3`, … after it when a team has it already.
    async fn free_slug(&self, name: &str) -> Result<String, StoreError> {
        let base = sandbar_core::model::slug_of(name);
        let mut candidate = base.clone();
        for n in 2.. {
            let taken = sqlx::query("SELECT 1 FROM teams WHERE slug = ?")
                .bind(&candidate)
                .fetch_optional(&self.pool)
                .await
                .map_err(err)?
                .is_some();
            if !taken {
                break;
            }
            candidate = format!("{base}-{n}");
        }
        Ok(candidate)
    }

    /// API keys and access tokens share one shape; only their table differs.
    async fn insert_secret(
        &self,
        insert: &'static str,
        secret: &StoredSecret,
    ) -> Result<(), StoreError> {
        sqlx::query(insert)
            .bind(&secret.id)
            .bind(&secret.team_id)
            .bind(&secret.name)
            .bind(&secret.secret_hash)
            .bind(&secret.mask_prefix)
            .bind(&secret.mask_suffix)
            .bind(micros(secret.created_at))
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn aliases(&self, template_id: &str) -> Result<Vec<String>, StoreError> {
        let rows =
            sqlx::query("SELECT alias FROM template_aliases WHERE template_id = ? ORDER BY alias")
                .bind(template_id)
                .fetch_all(&self.pool)
                .await
                .map_err(err)?;
        rows.iter()
            .map(|r| r.try_get("alias").map_err(err))
            .collect()
    }

    async fn templates_from_rows(&self, rows: &[SqliteRow]) -> Result<Vec<Template>, StoreError> {
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            out.push(self.template_from_row(row).await?);
        }
        Ok(out)
    }

    /// A row selected by a `template_query!`.
    async fn template_from_row(&self, row: &SqliteRow) -> Result<Template, StoreError> {
        let id: String = row.try_get("id").map_err(err)?;
        let status: String = row.try_get("build_status").map_err(err)?;
        Ok(Template {
            aliases: self.aliases(&id).await?,
            team_id: row.try_get("team_id").map_err(err)?,
            namespace: row.try_get("namespace").map_err(err)?,
            public: row.try_get("public").map_err(err)?,
            build_id: row.try_get("build_id").map_err(err)?,
            build_status: BuildStatus::parse(&status)
                .ok_or_else(|| err(format!("template {id} has unknown build status {status}")))?,
            build_error: row.try_get("build_error").map_err(err)?,
            cpu_count: row.try_get("cpu_count").map_err(err)?,
            memory_mb: row.try_get("memory_mb").map_err(err)?,
            disk_size_mb: row.try_get("disk_size_mb").map_err(err)?,
            envd_version: row.try_get("envd_version").map_err(err)?,
            image: json_opt::<TemplateImage>(row, "image")?,
            created_at: time(row.try_get("created_at").map_err(err)?),
            updated_at: time(row.try_get("updated_at").map_err(err)?),
            last_spawned_at: row
                .try_get::<Option<i64>, _>("last_spawned_at")
                .map_err(err)?
                .map(time),
            spawn_count: row.try_get::<i64, _>("spawn_count").map_err(err)? as u64,
            build_count: row.try_get::<i64, _>("build_count").map_err(err)? as u64,
            id,
        })
    }
}

fn team_from_row(row: &SqliteRow) -> Result<Team, StoreError> {
    Ok(Team {
        id: row.try_get("id").map_err(err)?,
        name: row.try_get("name").map_err(err)?,
        slug: row
            .try_get::<Option<String>, _>("slug")
            .map_err(err)?
            .unwrap_or_default(),
        max_concurrent_sandboxes: row.try_get("max_concurrent_sandboxes").map_err(err)?,
        max_sandbox_timeout_secs: row
            .try_get::<i64, _>("max_sandbox_timeout_secs")
            .map_err(err)? as u64,
        requests_per_minute: row.try_get("requests_per_minute").map_err(err)?,
        max_vcpu: row.try_get("max_vcpu").map_err(err)?,
        max_memory_mb: row.try_get("max_memory_mb").map_err(err)?,
        max_disk_mb: row.try_get("max_disk_mb").map_err(err)?,
    })
}

fn secret_from_row(row: &SqliteRow, hash_column: &str) -> Result<StoredSecret, StoreError> {
    Ok(StoredSecret {
        id: row.try_get("id").map_err(err)?,
        team_id: row.try_get("team_id").map_err(err)?,
        name: row.try_get("name").map_err(err)?,
        secret_hash: row.try_get(hash_column).map_err(err)?,
        mask_prefix: row.try_get("mask_prefix").map_err(err)?,
        mask_suffix: row.try_get("mask_suffix").map_err(err)?,
        created_at: time(row.try_get("created_at").map_err(err)?),
    })
}

fn api_key_from_row(row: &SqliteRow) -> Result<StoredApiKey, StoreError> {
    Ok(StoredApiKey {
        secret: secret_from_row(row, "key_hash")?,
        created_by: row.try_get("created_by").map_err(err)?,
        last_used: row
            .try_get::<Option<i64>, _>("last_used")
            .map_err(err)?
            .map(time),
    })
}

fn sandbox_from_row(row: &SqliteRow) -> Result<Sandbox, StoreError> {
    let id: String = row.try_get("id").map_err(err)?;
    let state: String = row.try_get("state").map_err(err)?;
    let metadata: String = row.try_get("metadata").map_err(err)?;
    let env_vars: String = row.try_get("env_vars").map_err(err)?;
    let handle: String = row.try_get("handle").map_err(err)?;
    let network: String = row.try_get("network").map_err(err)?;
    let paused_as: Option<String> = row.try_get("paused_as").map_err(err)?;
    let image: Option<String> = row.try_get("image").map_err(err)?;
    let state = SandboxState::parse(&state)
        .ok_or_else(|| err(format!("sandbox {id} has unknown state {state}")))?;
    let paused_as = match (state, paused_as.as_deref()) {
        (SandboxState::Running, _) => None,
        // Paused before the kind was recorded: only memory pauses existed.
        (SandboxState::Paused, None) => Some(PauseKind::Memory),
        (SandboxState::Paused, Some(kind)) => Some(
            PauseKind::parse(kind)
                .ok_or_else(|| err(format!("sandbox {id} has unknown pause kind {kind}")))?,
        ),
    };
    Ok(Sandbox {
        team_id: row.try_get("team_id").map_err(err)?,
        template_id: row.try_get("template_id").map_err(err)?,
        alias: row.try_get("alias").map_err(err)?,
        started_at: time(row.try_get("started_at").map_err(err)?),
        end_at: time(row.try_get("end_at").map_err(err)?),
        cpu_count: row.try_get("cpu_count").map_err(err)?,
        memory_mb: row.try_get("memory_mb").map_err(err)?,
        disk_size_mb: row.try_get("disk_size_mb").map_err(err)?,
        metadata: serde_json::from_str(&metadata).map_err(err)?,
        env_vars: serde_json::from_str(&env_vars).map_err(err)?,
        allow_internet_access: row.try_get("allow_internet_access").map_err(err)?,
        network: serde_json::from_str(&network).map_err(err)?,
        traffic_access_token: row.try_get("traffic_access_token").map_err(err)?,
        auto_pause: row.try_get("auto_pause").map_err(err)?,
        auto_resume: row.try_get("auto_resume").map_err(err)?,
        auto_pause_memory: row.try_get("auto_pause_memory").map_err(err)?,
        image: image
            .map(|i| serde_json::from_str(&i))
            .transpose()
            .map_err(err)?,
        envd_access_token: row.try_get("envd_access_token").map_err(err)?,
        envd_version: row.try_get("envd_version").map_err(err)?,
        state,
        paused_as,
        handle: RuntimeHandle(serde_json::Value::from_str(&handle).map_err(err)?),
        id,
    })
}

fn level_rank(level: LogLevel) -> i64 {
    match level {
        LogLevel::Debug => 0,
        LogLevel::Info => 1,
        LogLevel::Warn => 2,
        LogLevel::Error => 3,
    }
}

fn level_of_rank(rank: i64) -> LogLevel {
    match rank {
        i64::MIN..=0 => LogLevel::Debug,
        1 => LogLevel::Info,
        2 => LogLevel::Warn,
        _ => LogLevel::Error,
    }
}

async fn insert_log_lines(
    tx: &mut sqlx::SqliteConnection,
    sandbox_id: &str,
    first_seq: i64,
    entries: &[SandboxLogEntry],
) -> Result<(), StoreError> {
    for (i, entry) in entries.iter().enumerate() {
        sqlx::query(
            "INSERT INTO sandbox_logs (sandbox_id, seq, at, level, message, fields) VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(sandbox_id)
        .bind(first_seq + i as i64)
        .bind(micros(entry.at))
        .bind(level_rank(entry.level))
        .bind(&entry.message)
        .bind(to_json(&entry.fields)?)
        .execute(&mut *tx)
        .await
        .map_err(err)?;
    }
    Ok(())
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    async fn team_count(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM teams")
            .fetch_one(&self.pool)
            .await
            .map_err(err)?;
        Ok(n as u64)
    }

    async fn insert_team(&self, team: &Team) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO teams (id, name, slug, max_concurrent_sandboxes, max_sandbox_timeout_secs, requests_per_minute, max_vcpu, max_memory_mb, max_disk_mb, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&team.id)
        .bind(&team.name)
        .bind(&team.slug)
        .bind(team.max_concurrent_sandboxes)
        .bind(team.max_sandbox_timeout_secs as i64)
        .bind(team.requests_per_minute)
        .bind(team.max_vcpu)
        .bind(team.max_memory_mb)
        .bind(team.max_disk_mb)
        .bind(micros(Utc::now()))
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn insert_api_key(&self, key: &StoredSecret) -> Result<(), StoreError> {
        self.insert_secret(
            "INSERT INTO api_keys (id, team_id, name, key_hash, mask_prefix, mask_suffix, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            key,
        )
        .await
    }

    async fn insert_access_token(&self, token: &StoredSecret) -> Result<(), StoreError> {
        self.insert_secret(
            "INSERT INTO access_tokens (id, team_id, name, token_hash, mask_prefix, mask_suffix, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            token,
        )
        .await
    }

    async fn team_by_api_key_hash(&self, hash: &str) -> Result<Option<Team>, StoreError> {
        let row = sqlx::query(
            "SELECT t.* FROM teams t JOIN api_keys k ON k.team_id = t.id WHERE k.key_hash = ?",
        )
        .bind(hash)
        .fetch_optional(&self.pool)
        .await
        .map_err(err)?;
        row.as_ref().map(team_from_row).transpose()
    }

    async fn team_by_access_token_hash(&self, hash: &str) -> Result<Option<Team>, StoreError> {
        let row = sqlx::query(
            "SELECT t.* FROM teams t JOIN access_tokens a ON a.team_id = t.id WHERE a.token_hash = ?",
        )
        .bind(hash)
        .fetch_optional(&self.pool)
        .await
        .map_err(err)?;
        row.as_ref().map(team_from_row).transpose()
    }

    async fn upsert_template(&self, t: &Template) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(err)?;
        sqlx::query(
            "INSERT INTO templates (id, team_id, public, build_id, build_status, build_error, cpu_count, memory_mb, disk_size_mb, envd_version, image, created_at, updated_at, last_spawned_at, spawn_count, build_count)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
             ON CONFLICT(id) DO UPDATE SET team_id = excluded.team_id, public = excluded.public, build_id = excluded.build_id,
               build_status = excluded.build_status, build_error = excluded.build_error, cpu_count = excluded.cpu_count,
               memory_mb = excluded.memory_mb, disk_size_mb = excluded.disk_size_mb, envd_version = excluded.envd_version,
               image = excluded.image, updated_at = excluded.updated_at, build_count = excluded.build_count",
        )
        .bind(&t.id)
        .bind(&t.team_id)
        .bind(t.public)
        .bind(&t.build_id)
        .bind(t.build_status.as_str())
        .bind(&t.build_error)
        .bind(t.cpu_count)
        .bind(t.memory_mb)
        .bind(t.disk_size_mb)
        .bind(&t.envd_version)
        .bind(t.image.as_ref().map(to_json).transpose()?)
        .bind(micros(t.created_at))
        .bind(micros(t.updated_at))
        .bind(t.last_spawned_at.map(micros))
        .bind(t.spawn_count as i64)
        .bind(t.build_count as i64)
        .execute(&mut *tx)
        .await
        .map_err(err)?;
        for alias in &t.aliases {
            sqlx::query(
                "INSERT INTO template_aliases (scope, alias, template_id) VALUES (?, ?, ?)
                 ON CONFLICT(scope, alias) DO UPDATE SET template_id = excluded.template_id",
            )
            .bind(t.team_id.as_deref().unwrap_or(""))
            .bind(alias)
            .bind(&t.id)
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        }
        tx.commit().await.map_err(err)?;
        Ok(())
    }

    async fn template(&self, id: &str) -> Result<Option<Template>, StoreError> {
        let row = sqlx::query(template_query!("WHERE t.id = ?"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?;
        match row {
            Some(row) => Ok(Some(self.template_from_row(&row).await?)),
            None => Ok(None),
        }
    }

    async fn template_by_name(
        &self,
        team_id: Option<&str>,
        alias: &str,
    ) -> Result<Option<Template>, StoreError> {
        let row = sqlx::query(template_query!(
            "JOIN template_aliases a ON a.template_id = t.id WHERE a.scope = ? AND a.alias = ?"
        ))
        .bind(team_id.unwrap_or(""))
        .bind(alias)
        .fetch_optional(&self.pool)
        .await
        .map_err(err)?;
        match row {
            Some(row) => Ok(Some(self.template_from_row(&row).await?)),
            None => Ok(None),
        }
    }

    async fn public_templates_named(&self, alias: &str) -> Result<Vec<Template>, StoreError> {
        let rows = sqlx::query(template_query!(
            "JOIN template_aliases a ON a.template_id = t.id
             WHERE a.alias = ? AND a.scope != '' AND t.public ORDER BY t.created_at, t.id"
        ))
        .bind(alias)
        .fetch_all(&self.pool)
        .await
        .map_err(err)?;
        self.templates_from_rows(&rows).await
    }

    async fn team_by_slug(&self, slug: &str) -> Result<Option<Team>, StoreError> {
        let row = sqlx::query("SELECT * FROM teams WHERE slug = ?")
            .bind(slug)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?;
        row.as_ref().map(team_from_row).transpose()
    }

    async fn free_team_slug(&self, name: &str) -> Result<String, StoreError> {
        self.free_slug(name).await
    }

    async fn templates(&self) -> Result<Vec<Template>, StoreError> {
        let rows = sqlx::query(template_query!("ORDER BY t.created_at DESC, t.id"))
            .fetch_all(&self.pool)
            .await
            .map_err(err)?;
        self.templates_from_rows(&rows).await
    }

    async fn set_template_build(
        &self,
        id: &str,
        status: BuildStatus,
        error: Option<&str>,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE templates SET build_status = ?, build_error = ?, updated_at = ? WHERE id = ?",
        )
        .bind(status.as_str())
        .bind(error)
        .bind(micros(Utc::now()))
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn set_template_image(
        &self,
        id: &str,
        build_id: &str,
        image: &TemplateImage,
    ) -> Result<(), StoreError> {
        // Only the latest build also sets the template's status: an older build finishing
        // late still becomes the image, but must not hide a newer build's progress.
        sqlx::query(
            "UPDATE templates SET image = ?, ready_build_id = ?, updated_at = ?,
               build_status = CASE WHEN build_id = ? THEN 'ready' ELSE build_status END,
               build_error = CASE WHEN build_id = ? THEN NULL ELSE build_error END
             WHERE id = ?",
        )
        .bind(to_json(image)?)
        .bind(build_id)
        .bind(micros(Utc::now()))
        .bind(build_id)
        .bind(build_id)
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn delete_template(&self, id: &str) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(err)?;
        for statement in [
            "DELETE FROM build_logs WHERE build_id IN (SELECT id FROM template_builds WHERE template_id = ?)",
            "DELETE FROM build_tags WHERE template_id = ?",
            "DELETE FROM template_builds WHERE template_id = ?",
            "DELETE FROM template_aliases WHERE template_id = ?",
            "DELETE FROM templates WHERE id = ?",
        ] {
            sqlx::query(statement)
                .bind(id)
                .execute(&mut *tx)
                .await
                .map_err(err)?;
        }
        tx.commit().await.map_err(err)?;
        Ok(())
    }

    async fn insert_build(&self, b: &BuildRecord) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO template_builds (id, template_id, team_id, status, failure, spec, image, cpu_count, memory_mb, disk_size_mb, created_at, updated_at, finished_at)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&b.id)
        .bind(&b.template_id)
        .bind(&b.team_id)
        .bind(b.status.as_str())
        .bind(b.failure.as_ref().map(to_json).transpose()?)
        .bind(b.spec.as_ref().map(to_json).transpose()?)
        .bind(b.image.as_ref().map(to_json).transpose()?)
        .bind(b.cpu_count)
        .bind(b.memory_mb)
        .bind(b.disk_size_mb)
        .bind(micros(b.created_at))
        .bind(micros(b.updated_at))
        .bind(b.finished_at.map(micros))
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn update_build(&self, b: &BuildRecord) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE template_builds SET status = ?, failure = ?, spec = ?, image = ?, updated_at = ?, finished_at = ? WHERE id = ?",
        )
        .bind(b.status.as_str())
        .bind(b.failure.as_ref().map(to_json).transpose()?)
        .bind(b.spec.as_ref().map(to_json).transpose()?)
        .bind(b.image.as_ref().map(to_json).transpose()?)
        .bind(micros(b.updated_at))
        .bind(b.finished_at.map(micros))
        .bind(&b.id)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn build(&self, id: &str) -> Result<Option<BuildRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM template_builds WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?;
        row.as_ref().map(build_from_row).transpose()
    }

    async fn template_builds(&self, template_id: &str) -> Result<Vec<BuildRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM template_builds WHERE template_id = ? ORDER BY created_at DESC, id",
        )
        .bind(template_id)
        .fetch_all(&self.pool)
        .await
        .map_err(err)?;
        rows.iter().map(build_from_row).collect()
    }

    async fn unfinished_builds(&self) -> Result<Vec<BuildRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM template_builds WHERE status IN ('waiting', 'building') ORDER BY created_at",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(err)?;
        rows.iter().map(build_from_row).collect()
    }

    async fn set_build_tags(
        &self,
        template_id: &str,
        build_id: &str,
        tags: &[String],
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(err)?;
        for tag in tags {
            sqlx::query(
                "INSERT INTO build_tags (template_id, build_id, tag) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            )
            .bind(template_id)
            .bind(build_id)
            .bind(tag)
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        }
        tx.commit().await.map_err(err)?;
        Ok(())
    }

    async fn delete_build_tags(
        &self,
        template_id: &str,
        tags: &[String],
    ) -> Result<u64, StoreError> {
        let mut removed = 0;
        for tag in tags {
            removed += sqlx::query("DELETE FROM build_tags WHERE template_id = ? AND tag = ?")
                .bind(template_id)
                .bind(tag)
                .execute(&self.pool)
                .await
                .map_err(err)?
                .rows_affected();
        }
        Ok(removed)
    }

    async fn template_tags(
        &self,
        template_id: &str,
    ) -> Result<Vec<(String, BuildRecord)>, StoreError> {
        let rows = sqlx::query(
            "SELECT t.tag AS tag, b.* FROM build_tags t JOIN template_builds b ON b.id = t.build_id
             WHERE t.template_id = ? AND b.status = 'ready' ORDER BY t.tag, b.finished_at DESC",
        )
        .bind(template_id)
        .fetch_all(&self.pool)
        .await
        .map_err(err)?;
        let mut out: Vec<(String, BuildRecord)> = Vec::new();
        for row in &rows {
            let tag: String = row.try_get("tag").map_err(err)?;
            // Only the newest build per tag is what the tag names.
            if out.last().is_some_and(|(t, _)| *t == tag) {
                continue;
            }
            out.push((tag, build_from_row(row)?));
        }
        Ok(out)
    }

    async fn tagged_build(
        &self,
        template_id: &str,
        tag: &str,
    ) -> Result<Option<BuildRecord>, StoreError> {
        let row = sqlx::query(
            "SELECT b.* FROM template_builds b JOIN build_tags t ON t.build_id = b.id
             WHERE t.template_id = ? AND t.tag = ? AND b.status = 'ready'
             ORDER BY b.finished_at DESC LIMIT 1",
        )
        .bind(template_id)
        .bind(tag)
        .fetch_optional(&self.pool)
        .await
        .map_err(err)?;
        row.as_ref().map(build_from_row).transpose()
    }

    async fn append_build_log(
        &self,
        build_id: &str,
        seq: u64,
        entry: &BuildLogEntry,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO build_logs (build_id, seq, at, level, step, message) VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(build_id)
        .bind(seq as i64)
        .bind(micros(entry.timestamp))
        .bind(entry.level.as_str())
        .bind(&entry.step)
        .bind(&entry.message)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn build_logs(
        &self,
        build_id: &str,
        offset: u64,
        limit: u64,
        min_level: Option<LogLevel>,
    ) -> Result<Vec<BuildLogEntry>, StoreError> {
        let rows = sqlx::query(
            "SELECT at, level, step, message FROM build_logs WHERE build_id = ? ORDER BY seq",
        )
        .bind(build_id)
        .fetch_all(&self.pool)
        .await
        .map_err(err)?;
        let mut out = Vec::new();
        for row in &rows {
            let level: String = row.try_get("level").map_err(err)?;
            let level = LogLevel::parse(&level).unwrap_or(LogLevel::Info);
            if min_level.is_some_and(|min| level < min) {
                continue;
            }
            out.push(BuildLogEntry {
                timestamp: time(row.try_get("at").map_err(err)?),
                level,
                step: row.try_get("step").map_err(err)?,
                message: row.try_get("message").map_err(err)?,
            });
        }
        Ok(out
            .into_iter()
            .skip(offset.min(usize::MAX as u64) as usize)
            .take(limit.min(usize::MAX as u64) as usize)
            .collect())
    }

    async fn layers_in_use(&self) -> Result<Vec<String>, StoreError> {
        let rows = sqlx::query(
            "SELECT image FROM templates WHERE image IS NOT NULL
             UNION ALL
             SELECT b.image FROM template_builds b JOIN build_tags t ON t.build_id = b.id
             WHERE b.image IS NOT NULL",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(err)?;
        let mut layers = Vec::new();
        for row in &rows {
            let text: String = row.try_get("image").map_err(err)?;
            let image: TemplateImage = serde_json::from_str(&text).map_err(err)?;
            layers.extend(image.layers);
            // A snapshot's checkpoint lives as long as its layers, a capture's as long as
            // the image naming it.
            layers.extend(image.snapshot.and_then(|s| s.checkpoint));
            layers.extend(
                image
                    .started
                    .into_iter()
                    .flat_map(|s| [s.layer, s.checkpoint]),
            );
        }
        // Recorded sandboxes (running, paused, shelved, checkpointed) keep the layers they
        // booted from even after their template moved on: a collection that runs before the
        // node has adopted them again (at start) must not take their roots away. The
        // checkpoint they were made from is not theirs to keep.
        let sandboxes = sqlx::query("SELECT image FROM sandboxes WHERE image IS NOT NULL")
            .fetch_all(&self.pool)
            .await
            .map_err(err)?;
        for row in &sandboxes {
            let text: String = row.try_get("image").map_err(err)?;
            let image: TemplateImage = serde_json::from_str(&text).map_err(err)?;
            layers.extend(image.layers);
        }
        layers.sort();
        layers.dedup();
        Ok(layers)
    }

    async fn record_template_spawn(&self, id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE templates SET spawn_count = spawn_count + 1, last_spawned_at = ? WHERE id = ?",
        )
        .bind(micros(at))
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn insert_sandbox(&self, s: &Sandbox) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO sandboxes (id, team_id, template_id, alias, started_at, end_at, cpu_count, memory_mb, disk_size_mb, metadata, env_vars, allow_internet_access, envd_access_token, envd_version, state, handle, network, traffic_access_token, auto_pause, auto_resume, paused_as, auto_pause_memory, image)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&s.id)
        .bind(&s.team_id)
        .bind(&s.template_id)
        .bind(&s.alias)
        .bind(micros(s.started_at))
        .bind(micros(s.end_at))
        .bind(s.cpu_count)
        .bind(s.memory_mb)
        .bind(s.disk_size_mb)
        .bind(serde_json::to_string(&s.metadata).map_err(err)?)
        .bind(serde_json::to_string(&s.env_vars).map_err(err)?)
        .bind(s.allow_internet_access)
        .bind(&s.envd_access_token)
        .bind(&s.envd_version)
        .bind(s.state.as_str())
        .bind(s.handle.0.to_string())
        .bind(serde_json::to_string(&s.network).map_err(err)?)
        .bind(&s.traffic_access_token)
        .bind(s.auto_pause)
        .bind(s.auto_resume)
        .bind(s.paused_as.map(PauseKind::as_str))
        .bind(s.auto_pause_memory)
        .bind(
            s.image
                .as_ref()
                .map(serde_json::to_string)
                .transpose()
                .map_err(err)?,
        )
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn sandbox(&self, id: &str) -> Result<Option<Sandbox>, StoreError> {
        let row = sqlx::query("SELECT * FROM sandboxes WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?;
        row.as_ref().map(sandbox_from_row).transpose()
    }

    async fn team_sandboxes(&self, team_id: &str) -> Result<Vec<Sandbox>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM sandboxes WHERE team_id = ? ORDER BY started_at DESC, id DESC",
        )
        .bind(team_id)
        .fetch_all(&self.pool)
        .await
        .map_err(err)?;
        rows.iter().map(sandbox_from_row).collect()
    }

    async fn all_sandboxes(&self) -> Result<Vec<Sandbox>, StoreError> {
        let rows = sqlx::query("SELECT * FROM sandboxes ORDER BY started_at DESC, id DESC")
            .fetch_all(&self.pool)
            .await
            .map_err(err)?;
        rows.iter().map(sandbox_from_row).collect()
    }

    async fn set_sandbox_end(&self, id: &str, end_at: DateTime<Utc>) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET end_at = ? WHERE id = ?")
            .bind(micros(end_at))
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn set_sandbox_network(
        &self,
        id: &str,
        network: &NetworkConfig,
        allow_internet_access: bool,
    ) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET network = ?, allow_internet_access = ? WHERE id = ?")
            .bind(serde_json::to_string(network).map_err(err)?)
            .bind(allow_internet_access)
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn set_sandbox_state(&self, id: &str, state: SandboxState) -> Result<(), StoreError> {
        let paused_as = (state == SandboxState::Paused).then_some(PauseKind::Memory.as_str());
        sqlx::query("UPDATE sandboxes SET state = ?, paused_as = ? WHERE id = ?")
            .bind(state.as_str())
            .bind(paused_as)
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn set_sandbox_paused(
        &self,
        id: &str,
        paused_as: Option<PauseKind>,
        handle: &RuntimeHandle,
    ) -> Result<(), StoreError> {
        let state = match paused_as {
            Some(_) => SandboxState::Paused,
            None => SandboxState::Running,
        };
        sqlx::query("UPDATE sandboxes SET state = ?, paused_as = ?, handle = ? WHERE id = ?")
            .bind(state.as_str())
            .bind(paused_as.map(PauseKind::as_str))
            .bind(handle.0.to_string())
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn delete_sandbox(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM sandboxes WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(())
    }

    // Keys, access tokens, users and team limits
    async fn api_key_by_hash(
        &self,
        hash: &str,
    ) -> Result<Option<(StoredApiKey, Team)>, StoreError> {
        let Some(key) = sqlx::query("SELECT * FROM api_keys WHERE key_hash = ?")
            .bind(hash)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?
        else {
            return Ok(None);
        };
        let key = api_key_from_row(&key)?;
        Ok(self
            .team(&key.secret.team_id)
            .await?
            .map(|team| (key, team)))
    }

    async fn touch_api_key(&self, id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
        sqlx::query("UPDATE api_keys SET last_used = ? WHERE id = ?")
            .bind(micros(at))
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn insert_team_api_key(&self, key: &StoredApiKey) -> Result<(), StoreError> {
        let s = &key.secret;
        sqlx::query(
            "INSERT INTO api_keys (id, team_id, name, key_hash, mask_prefix, mask_suffix, created_at, created_by, last_used) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&s.id)
        .bind(&s.team_id)
        .bind(&s.name)
        .bind(&s.secret_hash)
        .bind(&s.mask_prefix)
        .bind(&s.mask_suffix)
        .bind(micros(s.created_at))
        .bind(&key.created_by)
        .bind(key.last_used.map(micros))
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn team_api_keys(&self, team_id: &str) -> Result<Vec<StoredApiKey>, StoreError> {
        sqlx::query("SELECT * FROM api_keys WHERE team_id = ? ORDER BY created_at, id")
            .bind(team_id)
            .fetch_all(&self.pool)
            .await
            .map_err(err)?
            .iter()
            .map(api_key_from_row)
            .collect()
    }

    async fn rename_api_key(
        &self,
        team_id: &str,
        id: &str,
        name: &str,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE api_keys SET name = ? WHERE id = ? AND team_id = ?")
            .bind(name)
            .bind(id)
            .bind(team_id)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(done.rows_affected() > 0)
    }

    async fn delete_api_key(&self, team_id: Option<&str>, id: &str) -> Result<bool, StoreError> {
        let done =
            sqlx::query("DELETE FROM api_keys WHERE id = ? AND (?2 IS NULL OR team_id = ?2)")
                .bind(id)
                .bind(team_id)
                .execute(&self.pool)
                .await
                .map_err(err)?;
        Ok(done.rows_affected() > 0)
    }

    async fn insert_user(
        &self,
        id: &str,
        team_id: &str,
        is_default: bool,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(err)?;
        sqlx::query("INSERT INTO users (id, created_at) VALUES (?, ?)")
            .bind(id)
            .bind(micros(Utc::now()))
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        sqlx::query("INSERT INTO team_members (team_id, user_id, is_default) VALUES (?, ?, ?)")
            .bind(team_id)
            .bind(id)
            .bind(is_default)
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        tx.commit().await.map_err(err)
    }

    async fn insert_user_access_token(&self, token: &StoredAccessToken) -> Result<(), StoreError> {
        let s = &token.secret;
        sqlx::query(
            "INSERT INTO access_tokens (id, team_id, name, token_hash, mask_prefix, mask_suffix, created_at, user_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&s.id)
        .bind(&s.team_id)
        .bind(&s.name)
        .bind(&s.secret_hash)
        .bind(&s.mask_prefix)
        .bind(&s.mask_suffix)
        .bind(micros(s.created_at))
        .bind(&token.user_id)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn access_token_by_hash(
        &self,
        hash: &str,
    ) -> Result<Option<StoredAccessToken>, StoreError> {
        let Some(row) =
            sqlx::query("SELECT * FROM access_tokens WHERE token_hash = ? AND user_id IS NOT NULL")
                .bind(hash)
                .fetch_optional(&self.pool)
                .await
                .map_err(err)?
        else {
            return Ok(None);
        };
        Ok(Some(StoredAccessToken {
            secret: secret_from_row(&row, "token_hash")?,
            user_id: row.try_get("user_id").map_err(err)?,
        }))
    }

    async fn delete_access_token(&self, user_id: &str, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM access_tokens WHERE id = ? AND user_id = ?")
            .bind(id)
            .bind(user_id)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(done.rows_affected() > 0)
    }

    async fn user_teams(&self, user_id: &str) -> Result<Vec<(Team, bool)>, StoreError> {
        sqlx::query(
            "SELECT t.*, m.is_default FROM teams t JOIN team_members m ON m.team_id = t.id WHERE m.user_id = ? ORDER BY t.created_at, t.id",
        )
        .bind(user_id)
        .fetch_all(&self.pool)
        .await
        .map_err(err)?
        .iter()
        .map(|row| Ok((team_from_row(row)?, row.try_get("is_default").map_err(err)?)))
        .collect()
    }

    async fn team(&self, id: &str) -> Result<Option<Team>, StoreError> {
        sqlx::query("SELECT * FROM teams WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?
            .as_ref()
            .map(team_from_row)
            .transpose()
    }

    async fn teams(&self) -> Result<Vec<Team>, StoreError> {
        sqlx::query("SELECT * FROM teams ORDER BY created_at, id")
            .fetch_all(&self.pool)
            .await
            .map_err(err)?
            .iter()
            .map(team_from_row)
            .collect()
    }

    async fn set_team_limits(&self, id: &str, limits: &TeamLimits) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE teams SET max_concurrent_sandboxes = ?, max_sandbox_timeout_secs = ?, requests_per_minute = ?, max_vcpu = ?, max_memory_mb = ?, max_disk_mb = ? WHERE id = ?",
        )
        .bind(limits.max_concurrent_sandboxes)
        .bind(limits.max_sandbox_timeout_secs as i64)
        .bind(limits.requests_per_minute)
        .bind(limits.max_vcpu)
        .bind(limits.max_memory_mb)
        .bind(limits.max_disk_mb)
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(done.rows_affected() > 0)
    }

    async fn insert_volume(&self, v: &Volume) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "INSERT INTO volumes (id, team_id, name, token_hash, created_at) VALUES (?, ?, ?, ?, ?) \
             ON CONFLICT (team_id, name) DO NOTHING",
        )
        .bind(&v.id)
        .bind(&v.team_id)
        .bind(&v.name)
        .bind(&v.token_hash)
        .bind(micros(v.created_at))
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(done.rows_affected() == 1)
    }

    async fn volume(&self, id: &str) -> Result<Option<Volume>, StoreError> {
        let row = sqlx::query("SELECT * FROM volumes WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?;
        row.as_ref().map(volume_from_row).transpose()
    }

    async fn volume_by_name(
        &self,
        team_id: &str,
        name: &str,
    ) -> Result<Option<Volume>, StoreError> {
        let row = sqlx::query("SELECT * FROM volumes WHERE team_id = ? AND name = ?")
            .bind(team_id)
            .bind(name)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?;
        row.as_ref().map(volume_from_row).transpose()
    }

    async fn team_volumes(&self, team_id: &str) -> Result<Vec<Volume>, StoreError> {
        let rows = sqlx::query("SELECT * FROM volumes WHERE team_id = ? ORDER BY created_at, id")
            .bind(team_id)
            .fetch_all(&self.pool)
            .await
            .map_err(err)?;
        rows.iter().map(volume_from_row).collect()
    }

    async fn volume_users(&self, volume_id: &str) -> Result<Vec<String>, StoreError> {
        sqlx::query_scalar(
            "SELECT DISTINCT sandbox_id FROM sandbox_volumes WHERE volume_id = ? ORDER BY sandbox_id",
        )
        .bind(volume_id)
        .fetch_all(&self.pool)
        .await
        .map_err(err)
    }

    async fn delete_volume(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM volumes WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn insert_sandbox_volumes(
        &self,
        sandbox_id: &str,
        mounts: &[VolumeMount],
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(err)?;
        for (position, m) in mounts.iter().enumerate() {
            sqlx::query(
                "INSERT INTO sandbox_volumes (sandbox_id, position, volume_id, name, path) \
                 VALUES (?, ?, ?, ?, ?)",
            )
            .bind(sandbox_id)
            .bind(i64::try_from(position).map_err(err)?)
            .bind(&m.volume_id)
            .bind(&m.name)
            .bind(&m.path)
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        }
        tx.commit().await.map_err(err)
    }

    async fn sandbox_volumes(&self, sandbox_id: &str) -> Result<Vec<VolumeMount>, StoreError> {
        let rows = sqlx::query(
            "SELECT m.volume_id, v.team_id, m.name, m.path FROM sandbox_volumes m \
             JOIN volumes v ON v.id = m.volume_id WHERE m.sandbox_id = ? ORDER BY m.position",
        )
        .bind(sandbox_id)
        .fetch_all(&self.pool)
        .await
        .map_err(err)?;
        rows.iter()
            .map(|row| {
                Ok(VolumeMount {
                    volume_id: row.try_get("volume_id").map_err(err)?,
                    team_id: row.try_get("team_id").map_err(err)?,
                    name: row.try_get("name").map_err(err)?,
                    path: row.try_get("path").map_err(err)?,
                })
            })
            .collect()
    }

    async fn open_sandbox_log(
        &self,
        sandbox_id: &str,
        team_id: &str,
        at: DateTime<Utc>,
        entries: &[SandboxLogEntry],
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(err)?;
        let opened = sqlx::query(
            "INSERT INTO sandbox_log_sources (sandbox_id, team_id, created_at, next_seq) VALUES (?, ?, ?, ?) ON CONFLICT (sandbox_id) DO NOTHING",
        )
        .bind(sandbox_id)
        .bind(team_id)
        .bind(micros(at))
        .bind(entries.len() as i64)
        .execute(&mut *tx)
        .await
        .map_err(err)?
        .rows_affected();
        if opened > 0 {
            insert_log_lines(&mut tx, sandbox_id, 0, entries).await?;
        }
        tx.commit().await.map_err(err)
    }

    async fn sandbox_log_team(&self, sandbox_id: &str) -> Result<Option<String>, StoreError> {
        sqlx::query_scalar("SELECT team_id FROM sandbox_log_sources WHERE sandbox_id = ?")
            .bind(sandbox_id)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)
    }

    async fn sandbox_log_offset(&self, sandbox_id: &str) -> Result<u64, StoreError> {
        let offset: Option<i64> = sqlx::query_scalar(
            "SELECT agent_log_offset FROM sandbox_log_sources WHERE sandbox_id = ?",
        )
        .bind(sandbox_id)
        .fetch_optional(&self.pool)
        .await
        .map_err(err)?;
        Ok(offset.unwrap_or(0).max(0) as u64)
    }

    async fn append_sandbox_logs(
        &self,
        sandbox_id: &str,
        entries: &[SandboxLogEntry],
        agent_log_offset: Option<u64>,
        keep: u64,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(err)?;
        let next: Option<i64> = sqlx::query_scalar(
            "UPDATE sandbox_log_sources SET next_seq = next_seq + ?, agent_log_offset = COALESCE(?, agent_log_offset) WHERE sandbox_id = ? RETURNING next_seq",
        )
        .bind(entries.len() as i64)
        .bind(agent_log_offset.map(|o| o.min(i64::MAX as u64) as i64))
        .bind(sandbox_id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(err)?;
        let Some(next) = next else {
            return Ok(());
        };
        insert_log_lines(&mut tx, sandbox_id, next - entries.len() as i64, entries).await?;
        let oldest_kept = next - keep.min(i64::MAX as u64) as i64;
        if oldest_kept > 0 && !entries.is_empty() {
            sqlx::query("DELETE FROM sandbox_logs WHERE sandbox_id = ? AND seq < ?")
                .bind(sandbox_id)
                .bind(oldest_kept)
                .execute(&mut *tx)
                .await
                .map_err(err)?;
        }
        tx.commit().await.map_err(err)
    }

    async fn end_sandbox_log(&self, sandbox_id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE sandbox_log_sources SET ended_at = ? WHERE sandbox_id = ? AND ended_at IS NULL",
        )
        .bind(micros(at))
        .bind(sandbox_id)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn sandbox_logs(
        &self,
        sandbox_id: &str,
        query: &SandboxLogQuery,
    ) -> Result<Vec<SandboxLogEntry>, StoreError> {
        // instr is case-sensitive, unlike LIKE.
        const FORWARD: &str = "SELECT at, level, message, fields FROM sandbox_logs \
             WHERE sandbox_id = ? AND level >= ? AND (? IS NULL OR at >= ?) \
             AND (? IS NULL OR instr(message, ?) > 0) ORDER BY at, seq LIMIT ?";
        const BACKWARD: &str = "SELECT at, level, message, fields FROM sandbox_logs \
             WHERE sandbox_id = ? AND level >= ? AND (? IS NULL OR at <= ?) \
             AND (? IS NULL OR instr(message, ?) > 0) ORDER BY at DESC, seq DESC LIMIT ?";
        let cursor = query.cursor_ms.map(|ms| {
            if query.forward {
                ms.saturating_mul(1000)
            } else {
                // The whole millisecond the cursor names.
                ms.saturating_mul(1000).saturating_add(999)
            }
        });
        let q = sqlx::query(if query.forward { FORWARD } else { BACKWARD })
            .bind(sandbox_id)
            .bind(query.min_level.map(level_rank).unwrap_or(0))
            .bind(cursor)
            .bind(cursor)
            .bind(&query.search)
            .bind(&query.search);
        let rows = q
            .bind(i64::from(query.limit))
            .fetch_all(&self.pool)
            .await
            .map_err(err)?;
        rows.iter()
            .map(|row| {
                let fields: String = row.try_get("fields").map_err(err)?;
                Ok(SandboxLogEntry {
                    at: time(row.try_get("at").map_err(err)?),
                    level: level_of_rank(row.try_get("level").map_err(err)?),
                    message: row.try_get("message").map_err(err)?,
                    fields: serde_json::from_str(&fields).map_err(err)?,
                })
            })
            .collect()
    }

    async fn prune_sandbox_logs(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        let result = sqlx::query("DELETE FROM sandbox_log_sources WHERE ended_at < ?")
            .bind(micros(before))
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(result.rows_affected())
    }

    async fn add_team_metrics(&self, buckets: &[TeamMetricBucket]) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(err)?;
        for b in buckets {
            sqlx::query(
                "INSERT INTO team_metrics (team_id, bucket, concurrent, starts) VALUES (?, ?, ?, ?) \
                 ON CONFLICT (team_id, bucket) DO UPDATE SET \
                 concurrent = MAX(concurrent, excluded.concurrent), starts = starts + excluded.starts",
            )
            .bind(&b.team_id)
            .bind(b.bucket)
            .bind(b.concurrent)
            .bind(b.starts)
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        }
        tx.commit().await.map_err(err)
    }

    async fn team_metrics(
        &self,
        team_id: &str,
        start: i64,
        end: i64,
    ) -> Result<Vec<TeamMetricBucket>, StoreError> {
        let rows = sqlx::query(
            "SELECT bucket, concurrent, starts FROM team_metrics WHERE team_id = ? AND bucket >= ? AND bucket <= ? ORDER BY bucket",
        )
        .bind(team_id)
        .bind(start)
        .bind(end)
        .fetch_all(&self.pool)
        .await
        .map_err(err)?;
        rows.iter()
            .map(|row| {
                Ok(TeamMetricBucket {
                    team_id: team_id.to_owned(),
                    bucket: row.try_get("bucket").map_err(err)?,
                    concurrent: row.try_get("concurrent").map_err(err)?,
                    starts: row.try_get("starts").map_err(err)?,
                })
            })
            .collect()
    }

    async fn prune_team_metrics(&self, before: i64) -> Result<u64, StoreError> {
        let result = sqlx::query("DELETE FROM team_metrics WHERE bucket < ?")
            .bind(before)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(result.rows_affected())
    }
}

fn volume_from_row(row: &SqliteRow) -> Result<Volume, StoreError> {
    Ok(Volume {
        id: row.try_get("id").map_err(err)?,
        team_id: row.try_get("team_id").map_err(err)?,
        name: row.try_get("name").map_err(err)?,
        token_hash: row.try_get("token_hash").map_err(err)?,
        created_at: time(row.try_get("created_at").map_err(err)?),
    })
}
