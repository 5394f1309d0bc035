//! Templates and their names.

use chrono::{DateTime, Utc};
use sandbar_core::store::TemplateRecords;
use sandbar_core::{BuildStatus, StoreError, Template, TemplateImage};
use sqlx::Row;

use crate::rows::TemplateRow;
use crate::{SqliteDb, err, micros, to_json};

/// Templates and their names, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteTemplates {
    pub(crate) db: SqliteDb,
}

#[async_trait::async_trait]
impl TemplateRecords for SqliteTemplates {
    async fn upsert_template(&self, t: &Template) -> Result<(), StoreError> {
        let mut tx = self.db.writes.begin().await.map_err(err)?;
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
        let row = sqlx::query_as::<_, TemplateRow<i64, Option<String>>>(template_query!(
            "WHERE t.id = ?"
        ))
        .bind(id)
        .fetch_optional(&self.db.reads)
        .await
        .map_err(err)?;
        row.map(Template::try_from).transpose()
    }

    async fn template_by_name(
        &self,
        team_id: Option<&str>,
        alias: &str,
    ) -> Result<Option<Template>, StoreError> {
        let row = sqlx::query_as::<_, TemplateRow<i64, Option<String>>>(template_query!(
            "JOIN template_aliases a ON a.template_id = t.id WHERE a.scope = ? AND a.alias = ?"
        ))
        .bind(team_id.unwrap_or(""))
        .bind(alias)
        .fetch_optional(&self.db.reads)
        .await
        .map_err(err)?;
        row.map(Template::try_from).transpose()
    }

    async fn public_templates_named(&self, alias: &str) -> Result<Vec<Template>, StoreError> {
        let rows = sqlx::query_as::<_, TemplateRow<i64, Option<String>>>(template_query!(
            "JOIN template_aliases a ON a.template_id = t.id
             WHERE a.alias = ? AND a.scope != '' AND t.public ORDER BY t.created_at, t.id"
        ))
        .bind(alias)
        .fetch_all(&self.db.reads)
        .await
        .map_err(err)?;
        rows.into_iter().map(Template::try_from).collect()
    }

    async fn templates(&self) -> Result<Vec<Template>, StoreError> {
        let rows = sqlx::query_as::<_, TemplateRow<i64, Option<String>>>(template_query!(
            "ORDER BY t.created_at DESC, t.id"
        ))
        .fetch_all(&self.db.reads)
        .await
        .map_err(err)?;
        rows.into_iter().map(Template::try_from).collect()
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
        .execute(&self.db.writes)
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
        .execute(&self.db.writes)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn delete_template(&self, id: &str) -> Result<(), StoreError> {
        let mut tx = self.db.writes.begin().await.map_err(err)?;
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

    async fn layers_in_use(&self) -> Result<Vec<String>, StoreError> {
        let rows = sqlx::query(
            "SELECT image FROM templates WHERE image IS NOT NULL
             UNION ALL
             SELECT b.image FROM template_builds b JOIN build_tags t ON t.build_id = b.id
             WHERE b.image IS NOT NULL",
        )
        .fetch_all(&self.db.reads)
        .await
        .map_err(err)?;
        let mut layers = Vec::new();
        for row in &rows {
            let text: String = row.try_get("image").map_err(err)?;
            let image: TemplateImage = serde_json::from_str(&text).map_err(err)?;
            layers.extend(image.layers);
            // A snapshot's checkpoint lives as long as its layers.
            // A capture's checkpoint lives as long as the image naming it.
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
            .fetch_all(&self.db.reads)
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

    async fn record_template_spawns(
        &self,
        id: &str,
        count: u32,
        last: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE templates SET spawn_count = spawn_count + ?1, \
             last_spawned_at = max(COALESCE(last_spawned_at, ?2), ?2) WHERE id = ?3",
        )
        .bind(count)
        .bind(micros(last))
        .bind(id)
        .execute(&self.db.writes)
        .await
        .map_err(err)?;
        Ok(())
    }
}
