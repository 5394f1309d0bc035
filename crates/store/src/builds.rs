//! Template builds, tags and build logs.

use sandbar_core::store::BuildRecords;
use sandbar_core::{
    BuildFailure, BuildLogEntry, BuildRecord, BuildSpec, BuildStatus, LogLevel, StoreError,
    TemplateImage,
};
use sqlx::Row;
use sqlx::SqlitePool;
use sqlx::sqlite::SqliteRow;

use crate::{err, insert_err, json_opt, micros, time, to_json};

/// Template builds, tags and build logs, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteBuilds {
    pub(crate) pool: SqlitePool,
}

#[async_trait::async_trait]
impl BuildRecords for SqliteBuilds {
    async fn insert_build(&self, b: &BuildRecord) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO template_builds (id, template_id, team_id, status, failure, spec, image, cpu_count, memory_mb, disk_size_mb, created_at, updated_at, finished_at, node_id)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
        .bind(&b.node_id)
        .execute(&self.pool)
        .await
        .map_err(insert_err("build", &b.id))?;
        Ok(())
    }

    async fn update_build(&self, b: &BuildRecord) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE template_builds SET status = ?, failure = ?, spec = ?, image = ?, updated_at = ?, finished_at = ?, node_id = ? WHERE id = ?",
        )
        .bind(b.status.as_str())
        .bind(b.failure.as_ref().map(to_json).transpose()?)
        .bind(b.spec.as_ref().map(to_json).transpose()?)
        .bind(b.image.as_ref().map(to_json).transpose()?)
        .bind(micros(b.updated_at))
        .bind(b.finished_at.map(micros))
        .bind(&b.node_id)
        .bind(&b.id)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn assign_waiting_build(
        &self,
        build_id: &str,
        node_id: &str,
    ) -> Result<bool, StoreError> {
        let assigned = sqlx::query(
            "UPDATE template_builds SET node_id = ? WHERE id = ? AND status = 'waiting'",
        )
        .bind(node_id)
        .bind(build_id)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(assigned.rows_affected() == 1)
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
        node_id: row.try_get("node_id").map_err(err)?,
        id,
    })
}
