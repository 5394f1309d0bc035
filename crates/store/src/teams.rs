//! Teams, members, API keys and access tokens.

use chrono::{DateTime, Utc};
use sandbar_core::auth::TeamLimits;
use sandbar_core::store::{StoredAccessToken, StoredApiKey, StoredSecret, TeamRecords};
use sandbar_core::{StoreError, Team, TeamCaps};
use sqlx::Row;
use sqlx::SqlitePool;
use sqlx::sqlite::SqliteRow;

use crate::{err, insert_err, micros, time};

/// Teams, members, API keys and access tokens, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteTeams {
    pub(crate) pool: SqlitePool,
}

impl SqliteTeams {
    /// Teams made before names had namespaces get a slug from their name, in the order they
    /// were made, so the oldest keeps the plain one.
    pub(crate) async fn give_teams_slugs(&self) -> Result<(), StoreError> {
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
        what: &'static str,
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
            .map_err(insert_err(what, &secret.id))?;
        Ok(())
    }
}

#[async_trait::async_trait]
impl TeamRecords for SqliteTeams {
    async fn team_count(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM teams")
            .fetch_one(&self.pool)
            .await
            .map_err(err)?;
        Ok(n as u64)
    }

    async fn insert_team(&self, team: &Team) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO teams (id, name, slug, max_concurrent_sandboxes, max_sandbox_timeout_secs, requests_per_minute, max_vcpu, max_memory_mb, max_disk_mb, max_snapshots, max_snapshot_mb, max_templates, max_volumes, max_volume_mb, max_tags_per_template, max_api_keys, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
        .bind(team.caps.max_snapshots)
        .bind(team.caps.max_snapshot_mb)
        .bind(team.caps.max_templates)
        .bind(team.caps.max_volumes)
        .bind(team.caps.max_volume_mb)
        .bind(team.caps.max_tags_per_template)
        .bind(team.caps.max_api_keys)
        .bind(micros(Utc::now()))
        .execute(&self.pool)
        .await
        .map_err(insert_err("team", &team.id))?;
        Ok(())
    }

    async fn insert_api_key(&self, key: &StoredSecret) -> Result<(), StoreError> {
        self.insert_secret(
            "INSERT INTO api_keys (id, team_id, name, key_hash, mask_prefix, mask_suffix, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            "api key",
            key,
        )
        .await
    }

    async fn insert_access_token(&self, token: &StoredSecret) -> Result<(), StoreError> {
        self.insert_secret(
            "INSERT INTO access_tokens (id, team_id, name, token_hash, mask_prefix, mask_suffix, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            "access token",
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

    // Keys, access tokens, users and team limits
    async fn api_key_by_hash(
        &self,
        hash: &str,
    ) -> Result<Option<(StoredApiKey, Team)>, StoreError> {
        // One statement, not two: this runs for every request with an API key.
        let Some(row) = sqlx::query(
            "SELECT k.*, t.name AS team_name, t.slug AS team_slug, t.max_concurrent_sandboxes, t.max_sandbox_timeout_secs, t.requests_per_minute, t.max_vcpu, t.max_memory_mb, t.max_disk_mb, t.max_snapshots, t.max_snapshot_mb, t.max_templates, t.max_volumes, t.max_volume_mb, t.max_tags_per_template, t.max_api_keys FROM api_keys k JOIN teams t ON t.id = k.team_id WHERE k.key_hash = ?",
        )
        .bind(hash)
        .fetch_optional(&self.pool)
        .await
        .map_err(err)?
        else {
            return Ok(None);
        };
        let team = team_from_columns(&row, "team_id", "team_name", "team_slug")?;
        Ok(Some((api_key_from_row(&row)?, team)))
    }

    async fn touch_api_key(&self, id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
        // The newest use wins, whatever order concurrent touches land in.
        sqlx::query(
            "UPDATE api_keys SET last_used = MAX(COALESCE(last_used, ?1), ?1) WHERE id = ?2",
        )
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
        .map_err(insert_err("api key", &s.id))?;
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
            .map_err(insert_err("user", id))?;
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
        .map_err(insert_err("access token", &s.id))?;
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
            "UPDATE teams SET max_concurrent_sandboxes = ?, max_sandbox_timeout_secs = ?, requests_per_minute = ?, max_vcpu = ?, max_memory_mb = ?, max_disk_mb = ?, max_snapshots = ?, max_snapshot_mb = ?, max_templates = ?, max_volumes = ?, max_volume_mb = ?, max_tags_per_template = ?, max_api_keys = ? WHERE id = ?",
        )
        .bind(limits.max_concurrent_sandboxes)
        .bind(limits.max_sandbox_timeout_secs as i64)
        .bind(limits.requests_per_minute)
        .bind(limits.max_vcpu)
        .bind(limits.max_memory_mb)
        .bind(limits.max_disk_mb)
        .bind(limits.caps.max_snapshots)
        .bind(limits.caps.max_snapshot_mb)
        .bind(limits.caps.max_templates)
        .bind(limits.caps.max_volumes)
        .bind(limits.caps.max_volume_mb)
        .bind(limits.caps.max_tags_per_template)
        .bind(limits.caps.max_api_keys)
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(done.rows_affected() > 0)
    }
}

fn team_from_row(row: &SqliteRow) -> Result<Team, StoreError> {
    team_from_columns(row, "id", "name", "slug")
}

/// A team from a row whose id, name and slug columns are named as given (a join renames
/// those that clash).
fn team_from_columns(
    row: &SqliteRow,
    id: &str,
    name: &str,
    slug: &str,
) -> Result<Team, StoreError> {
    Ok(Team {
        id: row.try_get(id).map_err(err)?,
        name: row.try_get(name).map_err(err)?,
        slug: row
            .try_get::<Option<String>, _>(slug)
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
        caps: TeamCaps {
            max_snapshots: row.try_get("max_snapshots").map_err(err)?,
            max_snapshot_mb: row.try_get("max_snapshot_mb").map_err(err)?,
            max_templates: row.try_get("max_templates").map_err(err)?,
            max_volumes: row.try_get("max_volumes").map_err(err)?,
            max_volume_mb: row.try_get("max_volume_mb").map_err(err)?,
            max_tags_per_template: row.try_get("max_tags_per_template").map_err(err)?,
            max_api_keys: row.try_get("max_api_keys").map_err(err)?,
        },
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
