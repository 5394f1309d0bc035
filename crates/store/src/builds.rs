//! Template builds, tags and build logs.

use sandbar_core::store::BuildRecords;
use sandbar_core::{BuildLogEntry, BuildRecord, LogLevel, StoreError};
use sqlx::PgPool;

use crate::backend::{Backend, Read, Transact, Write};
use crate::rows::{BuildLogRow, BuildRow, TaggedBuildRow, big, build_log_page};
use crate::{SqliteDb, err, to_json};

/// Template builds, tags and build logs, in either database.
#[derive(Debug, Clone)]
pub struct Builds<B> {
    pub(crate) db: B,
}

// SQLite has no arrays: it deletes a template's tags one statement each.
impl Builds<SqliteDb> {
    async fn delete_tags(&self, template_id: &str, tags: &[String]) -> Result<u64, StoreError> {
        let mut removed = 0;
        for tag in tags {
            removed += sqlx::query("DELETE FROM build_tags WHERE template_id = $1 AND tag = $2")
                .bind(template_id)
                .bind(tag)
                .write(&self.db)
                .await?;
        }
        Ok(removed)
    }
}

impl Builds<PgPool> {
    async fn delete_tags(&self, template_id: &str, tags: &[String]) -> Result<u64, StoreError> {
        sqlx::query("DELETE FROM build_tags WHERE template_id = $1 AND tag = ANY($2)")
            .bind(template_id)
            .bind(tags)
            .write(&self.db)
            .await
    }
}

on_both! {
    #[async_trait::async_trait]
    impl BuildRecords for Builds<B> {
        async fn insert_build(&self, b: &BuildRecord) -> Result<(), StoreError> {
            sqlx::query(
                "INSERT INTO template_builds (id, template_id, team_id, status, failure, spec, image, cpu_count, memory_mb, disk_size_mb, created_at, updated_at, finished_at, node_id)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
            )
            .bind(&b.id)
            .bind(&b.template_id)
            .bind(&b.team_id)
            .bind(b.status.as_str())
            .bind(b.failure.as_ref().map(to_json).transpose()?)
            .bind(b.spec.as_ref().map(to_json).transpose()?)
            .bind(b.image.as_ref().map(to_json).transpose()?)
            .bind(i64::from(b.cpu_count))
            .bind(i64::from(b.memory_mb))
            .bind(i64::from(b.disk_size_mb))
            .bind(B::time(b.created_at))
            .bind(B::time(b.updated_at))
            .bind(b.finished_at.map(B::time))
            .bind(&b.node_id)
            .insert(&self.db, "build", &b.id).await
        }

        async fn update_build(&self, b: &BuildRecord) -> Result<(), StoreError> {
            sqlx::query(
                "UPDATE template_builds SET status = $1, failure = $2, spec = $3, image = $4, updated_at = $5, finished_at = $6, node_id = $7 WHERE id = $8",
            )
            .bind(b.status.as_str())
            .bind(b.failure.as_ref().map(to_json).transpose()?)
            .bind(b.spec.as_ref().map(to_json).transpose()?)
            .bind(b.image.as_ref().map(to_json).transpose()?)
            .bind(B::time(b.updated_at))
            .bind(b.finished_at.map(B::time))
            .bind(&b.node_id)
            .bind(&b.id)
            .run(&self.db).await
        }

        async fn assign_waiting_build(
            &self,
            build_id: &str,
            node_id: &str,
        ) -> Result<bool, StoreError> {
            let assigned = sqlx::query(
                "UPDATE template_builds SET node_id = $1 WHERE id = $2 AND status = 'waiting'",
            )
            .bind(node_id)
            .bind(build_id)
            .write(&self.db)
            .await?;
            Ok(assigned == 1)
        }

        async fn build(&self, id: &str) -> Result<Option<BuildRecord>, StoreError> {
            sqlx::query_as::<_, BuildRow<Time>>("SELECT * FROM template_builds WHERE id = $1")
                .bind(id)
                .one(&self.db)
                .await
        }

        async fn template_builds(&self, template_id: &str) -> Result<Vec<BuildRecord>, StoreError> {
            sqlx::query_as::<_, BuildRow<Time>>(
                "SELECT * FROM template_builds WHERE template_id = $1 ORDER BY created_at DESC, id COLLATE \"C\"",
            )
            .bind(template_id)
            .all(&self.db).await
        }

        async fn unfinished_builds(&self) -> Result<Vec<BuildRecord>, StoreError> {
            sqlx::query_as::<_, BuildRow<Time>>(
                "SELECT * FROM template_builds WHERE status IN ('waiting', 'building') ORDER BY created_at, id COLLATE \"C\"",
            )
            .all(&self.db).await
        }

        async fn set_build_tags(
            &self,
            template_id: &str,
            build_id: &str,
            tags: &[String],
        ) -> Result<(), StoreError> {
            let inserts = tags.iter().map(|tag| {
                sqlx::query(
                    "INSERT INTO build_tags (template_id, build_id, tag) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
                )
                .bind(template_id)
                .bind(build_id)
                .bind(tag)
            });
            self.db.write_all(inserts.collect()).await
        }

        async fn delete_build_tags(
            &self,
            template_id: &str,
            tags: &[String],
        ) -> Result<u64, StoreError> {
            self.delete_tags(template_id, tags).await
        }

        async fn template_tags(
            &self,
            template_id: &str,
        ) -> Result<Vec<(String, BuildRecord)>, StoreError> {
            let rows = sqlx::query_as::<_, TaggedBuildRow<Time>>(
                "SELECT t.tag AS tag, b.* FROM build_tags t JOIN template_builds b ON b.id = t.build_id
                 WHERE t.template_id = $1 AND b.status = 'ready'
                 ORDER BY t.tag COLLATE \"C\", b.finished_at DESC NULLS LAST",
            )
            .bind(template_id)
            .fetch_all(self.db.reads())
            .await
            .map_err(err)?;
            let mut out: Vec<(String, BuildRecord)> = Vec::new();
            for row in rows {
                // Only the newest build per tag is what the tag names.
                if out.last().is_some_and(|(t, _)| *t == row.tag) {
                    continue;
                }
                out.push(row.try_into()?);
            }
            Ok(out)
        }

        async fn tagged_build(
            &self,
            template_id: &str,
            tag: &str,
        ) -> Result<Option<BuildRecord>, StoreError> {
            sqlx::query_as::<_, BuildRow<Time>>(
                "SELECT b.* FROM template_builds b JOIN build_tags t ON t.build_id = b.id
                 WHERE t.template_id = $1 AND t.tag = $2 AND b.status = 'ready'
                 ORDER BY b.finished_at DESC NULLS LAST LIMIT 1",
            )
            .bind(template_id)
            .bind(tag)
            .one(&self.db)
            .await
        }

        async fn append_build_log(
            &self,
            build_id: &str,
            seq: u64,
            entry: &BuildLogEntry,
        ) -> Result<(), StoreError> {
            sqlx::query(
                "INSERT INTO build_logs (build_id, seq, at, level, step, message) VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(build_id)
            .bind(big(seq))
            .bind(B::time(entry.timestamp))
            .bind(entry.level.as_str())
            .bind(&entry.step)
            .bind(&entry.message)
            .run(&self.db).await
        }

        async fn build_logs(
            &self,
            build_id: &str,
            offset: u64,
            limit: u64,
            min_level: Option<LogLevel>,
        ) -> Result<Vec<BuildLogEntry>, StoreError> {
            let rows = sqlx::query_as::<_, BuildLogRow<Time>>(
                "SELECT at, level, step, message FROM build_logs WHERE build_id = $1 ORDER BY seq",
            )
            .bind(build_id)
            .fetch_all(self.db.reads())
            .await
            .map_err(err)?;
            Ok(build_log_page(rows, offset, limit, min_level))
        }
    }
}
