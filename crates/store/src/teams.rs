//! Teams, members, API keys and access tokens.

use chrono::{DateTime, Utc};
use sandbar_core::auth::TeamLimits;
use sandbar_core::store::{StoredAccessToken, StoredApiKey, StoredSecret, TeamRecords};
use sandbar_core::{StoreError, Team};
use sqlx::Row;

use crate::backend::{Backend, Read, Transact, Write};
use crate::rows::{
    AccessTokenRow, ApiKeyRow, KeyTeamRow, TeamMemberRow, TeamRow, bind_all, bind_secret,
    free_slug, limit_columns, u64_of,
};
use crate::{SqliteDb, err};

/// Teams, members, API keys and access tokens, in either database.
#[derive(Debug, Clone)]
pub struct Teams<B> {
    pub(crate) db: B,
}

impl Teams<SqliteDb> {
    /// Teams made before names had namespaces get a slug from their name, in the order they
    /// were made, so the oldest keeps the plain one.
    pub(crate) async fn give_teams_slugs(&self) -> Result<(), StoreError> {
        let rows =
            sqlx::query("SELECT id, name FROM teams WHERE slug IS NULL ORDER BY created_at, id")
                .fetch_all(&self.db.reads)
                .await
                .map_err(err)?;
        for row in &rows {
            let id: String = row.try_get("id").map_err(err)?;
            let name: String = row.try_get("name").map_err(err)?;
            let slug = self.free_slug(&name).await?;
            sqlx::query("UPDATE teams SET slug = $1 WHERE id = $2")
                .bind(&slug)
                .bind(&id)
                .write(&self.db)
                .await?;
        }
        Ok(())
    }
}

on_both! {
    impl Teams<B> {
        /// `slug_of(name)`, or with `-2`, `-3`, … after it when a team has it already. Two
        /// hosts may pick the same one at once: the unique slug makes the later insert a
        /// conflict.
        async fn free_slug(&self, name: &str) -> Result<String, StoreError> {
            free_slug(name, |candidate| async move {
                Ok(sqlx::query("SELECT 1 FROM teams WHERE slug = $1")
                    .bind(candidate)
                    .fetch_optional(self.db.reads())
                    .await
                    .map_err(err)?
                    .is_some())
            })
            .await
        }

        async fn one_team(
            &self,
            query: &'static str,
            key: &str,
        ) -> Result<Option<Team>, StoreError> {
            sqlx::query_as::<_, TeamRow>(query)
                .bind(key)
                .one(&self.db)
                .await
        }

        /// API keys and access tokens share one shape; only their table differs.
        async fn insert_secret(
            &self,
            insert: &'static str,
            what: &'static str,
            secret: &StoredSecret,
        ) -> Result<(), StoreError> {
            bind_secret(sqlx::query(insert), secret, B::time(secret.created_at))
                .insert(&self.db, what, &secret.id)
                .await
        }
    }

    #[async_trait::async_trait]
    impl TeamRecords for Teams<B> {
        async fn team_count(&self) -> Result<u64, StoreError> {
            let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM teams")
                .fetch_one(self.db.reads())
                .await
                .map_err(err)?;
            u64_of(n, "count", "teams")
        }

        async fn insert_team(&self, team: &Team) -> Result<(), StoreError> {
            let query = sqlx::query(
                "INSERT INTO teams (id, name, slug, max_concurrent_sandboxes, max_sandbox_timeout_secs, requests_per_minute, max_vcpu, max_memory_mb, max_disk_mb, max_snapshots, max_snapshot_mb, max_templates, max_volumes, max_volume_mb, max_tags_per_template, max_api_keys, disk_read_mbps, disk_write_mbps, disk_read_iops, disk_write_iops, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21)",
            )
            .bind(&team.id)
            .bind(&team.name)
            .bind(&team.slug);
            bind_all(query, limit_columns(&team.limits))
                .bind(B::time(Utc::now()))
                .insert(&self.db, "team", &team.id)
                .await
        }

        async fn insert_api_key(&self, key: &StoredSecret) -> Result<(), StoreError> {
            self.insert_secret(
                "INSERT INTO api_keys (id, team_id, name, key_hash, mask_prefix, mask_suffix, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                "api key",
                key,
            )
            .await
        }

        async fn insert_access_token(&self, token: &StoredSecret) -> Result<(), StoreError> {
            self.insert_secret(
                "INSERT INTO access_tokens (id, team_id, name, token_hash, mask_prefix, mask_suffix, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                "access token",
                token,
            )
            .await
        }

        async fn team_by_api_key_hash(&self, hash: &str) -> Result<Option<Team>, StoreError> {
            self.one_team(
                "SELECT t.* FROM teams t JOIN api_keys k ON k.team_id = t.id WHERE k.key_hash = $1",
                hash,
            )
            .await
        }

        async fn team_by_access_token_hash(&self, hash: &str) -> Result<Option<Team>, StoreError> {
            self.one_team(
                "SELECT t.* FROM teams t JOIN access_tokens a ON a.team_id = t.id WHERE a.token_hash = $1",
                hash,
            )
            .await
        }

        async fn team_by_slug(&self, slug: &str) -> Result<Option<Team>, StoreError> {
            self.one_team("SELECT * FROM teams WHERE slug = $1", slug)
                .await
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
            sqlx::query_as::<_, KeyTeamRow<Time>>(
                "SELECT k.id, k.team_id, k.name, k.key_hash AS secret_hash, k.mask_prefix, k.mask_suffix, k.created_at, k.created_by, k.last_used, t.name AS team_name, t.slug AS team_slug, t.max_concurrent_sandboxes, t.max_sandbox_timeout_secs, t.requests_per_minute, t.max_vcpu, t.max_memory_mb, t.max_disk_mb, t.max_snapshots, t.max_snapshot_mb, t.max_templates, t.max_volumes, t.max_volume_mb, t.max_tags_per_template, t.max_api_keys, t.disk_read_mbps, t.disk_write_mbps, t.disk_read_iops, t.disk_write_iops FROM api_keys k JOIN teams t ON t.id = k.team_id WHERE k.key_hash = $1",
            )
            .bind(hash)
            .fetch_optional(self.db.reads())
            .await
            .map_err(err)?
            .map(<(StoredApiKey, Team)>::try_from)
            .transpose()
        }

        async fn touch_api_key(&self, id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
            // Touches may land out of order (several hosts, or a slow one); the newest use
            // wins. A CASE, as SQLite has no GREATEST.
            sqlx::query(
                "UPDATE api_keys SET last_used = CASE WHEN last_used IS NULL OR last_used < $1 THEN $1 ELSE last_used END WHERE id = $2",
            )
            .bind(B::time(at))
            .bind(id)
            .run(&self.db).await
        }

        async fn insert_team_api_key(&self, key: &StoredApiKey) -> Result<(), StoreError> {
            let s = &key.secret;
            bind_secret(
                sqlx::query(
                    "INSERT INTO api_keys (id, team_id, name, key_hash, mask_prefix, mask_suffix, created_at, created_by, last_used) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                ),
                s,
                B::time(s.created_at),
            )
            .bind(&key.created_by)
            .bind(key.last_used.map(B::time))
            .insert(&self.db, "api key", &s.id).await
        }

        async fn team_api_keys(&self, team_id: &str) -> Result<Vec<StoredApiKey>, StoreError> {
            sqlx::query_as::<_, ApiKeyRow<Time>>(
                "SELECT id, team_id, name, key_hash AS secret_hash, mask_prefix, mask_suffix, created_at, created_by, last_used FROM api_keys WHERE team_id = $1 ORDER BY created_at, id COLLATE \"C\"",
            )
            .bind(team_id)
            .all(&self.db).await
        }

        async fn rename_api_key(
            &self,
            team_id: &str,
            id: &str,
            name: &str,
        ) -> Result<bool, StoreError> {
            let done = sqlx::query("UPDATE api_keys SET name = $1 WHERE id = $2 AND team_id = $3")
                .bind(name)
                .bind(id)
                .bind(team_id)
                .write(&self.db)
                .await?;
            Ok(done > 0)
        }

        async fn delete_api_key(
            &self,
            team_id: Option<&str>,
            id: &str,
        ) -> Result<bool, StoreError> {
            // The cast gives PostgreSQL the type of a parameter it may only see as NULL.
            let done = sqlx::query(
                "DELETE FROM api_keys WHERE id = $1 AND (CAST($2 AS TEXT) IS NULL OR team_id = $2)",
            )
            .bind(id)
            .bind(team_id)
            .write(&self.db)
            .await?;
            Ok(done > 0)
        }

        async fn insert_user(
            &self,
            id: &str,
            team_id: &str,
            is_default: bool,
        ) -> Result<(), StoreError> {
            let user = sqlx::query("INSERT INTO users (id, created_at) VALUES ($1, $2)")
                .bind(id)
                .bind(B::time(Utc::now()));
            let member = sqlx::query(
                "INSERT INTO team_members (team_id, user_id, is_default) VALUES ($1, $2, $3)",
            )
            .bind(team_id)
            .bind(id)
            .bind(is_default);
            self.db.insert_with(user, "user", id, vec![member]).await
        }

        async fn insert_user_access_token(
            &self,
            token: &StoredAccessToken,
        ) -> Result<(), StoreError> {
            let s = &token.secret;
            bind_secret(
                sqlx::query(
                    "INSERT INTO access_tokens (id, team_id, name, token_hash, mask_prefix, mask_suffix, created_at, user_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                ),
                s,
                B::time(s.created_at),
            )
            .bind(&token.user_id)
            .insert(&self.db, "access token", &s.id).await
        }

        async fn access_token_by_hash(
            &self,
            hash: &str,
        ) -> Result<Option<StoredAccessToken>, StoreError> {
            Ok(sqlx::query_as::<_, AccessTokenRow<Time>>(
                "SELECT id, team_id, name, token_hash AS secret_hash, mask_prefix, mask_suffix, created_at, user_id
                 FROM access_tokens WHERE token_hash = $1 AND user_id IS NOT NULL",
            )
            .bind(hash)
            .fetch_optional(self.db.reads())
            .await
            .map_err(err)?
            .map(StoredAccessToken::from))
        }

        async fn delete_access_token(&self, user_id: &str, id: &str) -> Result<bool, StoreError> {
            let done = sqlx::query("DELETE FROM access_tokens WHERE id = $1 AND user_id = $2")
                .bind(id)
                .bind(user_id)
                .write(&self.db)
                .await?;
            Ok(done > 0)
        }

        async fn user_teams(&self, user_id: &str) -> Result<Vec<(Team, bool)>, StoreError> {
            sqlx::query_as::<_, TeamMemberRow>(
                "SELECT t.*, m.is_default FROM teams t JOIN team_members m ON m.team_id = t.id
                 WHERE m.user_id = $1 ORDER BY t.created_at, t.id COLLATE \"C\"",
            )
            .bind(user_id)
            .fetch_all(self.db.reads())
            .await
            .map_err(err)?
            .into_iter()
            .map(<(Team, bool)>::try_from)
            .collect()
        }

        async fn team(&self, id: &str) -> Result<Option<Team>, StoreError> {
            self.one_team("SELECT * FROM teams WHERE id = $1", id).await
        }

        async fn teams(&self) -> Result<Vec<Team>, StoreError> {
            sqlx::query_as::<_, TeamRow>(
                "SELECT * FROM teams ORDER BY created_at, id COLLATE \"C\"",
            )
            .all(&self.db)
            .await
        }

        async fn set_team_limits(&self, id: &str, limits: &TeamLimits) -> Result<bool, StoreError> {
            let done = bind_all(
                sqlx::query(
                    "UPDATE teams SET max_concurrent_sandboxes = $1, max_sandbox_timeout_secs = $2, requests_per_minute = $3, max_vcpu = $4, max_memory_mb = $5, max_disk_mb = $6, max_snapshots = $7, max_snapshot_mb = $8, max_templates = $9, max_volumes = $10, max_volume_mb = $11, max_tags_per_template = $12, max_api_keys = $13, disk_read_mbps = $14, disk_write_mbps = $15, disk_read_iops = $16, disk_write_iops = $17 WHERE id = $18",
                ),
                limit_columns(limits),
            )
            .bind(id)
            .write(&self.db).await?;
            Ok(done > 0)
        }
    }
}
