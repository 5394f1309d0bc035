//! Templates and their names.

use chrono::{DateTime, Utc};
use sandbar_core::store::TemplateRecords;
use sandbar_core::{BuildStatus, StoreError, Template, TemplateImage};
use sqlx::PgPool;

use crate::backend::{Backend, Read, Transact, Write};
use crate::rows::{Aliases, TemplateRow, big};
use crate::{SqliteDb, err, to_json};

/// Templates and their names, in either database.
#[derive(Debug, Clone)]
pub struct Templates<B> {
    pub(crate) db: B,
}

/// How a database gathers a template's names into the one column `template_query!` selects.
trait GathersNames {
    type Names: Aliases;
}

// SQLite has no arrays: a JSON array, sorted as it is read.
impl GathersNames for SqliteDb {
    type Names = Option<String>;
}

impl GathersNames for PgPool {
    type Names = Vec<String>;
}

/// A template query on backend `$b`: the template (`t`) with its names and its owner's slug,
/// which namespaces its names (`tm`, joined on the owner), then `$rest`. Literals, so the SQL
/// stays static.
macro_rules! template_query {
    ($b:ty, $rest:literal) => {
        // The names come in the same statement: every create reads its template.
        <$b as Backend>::either(
            concat!(
                "SELECT t.*, tm.slug AS namespace,
                   (SELECT json_group_array(n.alias) FROM template_aliases n WHERE n.template_id = t.id) AS aliases
                 FROM templates t LEFT JOIN teams tm ON tm.id = t.team_id ",
                $rest
            ),
            concat!(
                "SELECT t.*, tm.slug AS namespace,
                   ARRAY(SELECT n.alias FROM template_aliases n WHERE n.template_id = t.id
                         ORDER BY n.alias COLLATE \"C\") AS aliases
                 FROM templates t LEFT JOIN teams tm ON tm.id = t.team_id ",
                $rest
            ),
        )
    };
}

on_both! {
    type Row = TemplateRow<Time, <B as GathersNames>::Names>;

    #[async_trait::async_trait]
    impl TemplateRecords for Templates<B> {
        async fn upsert_template(&self, t: &Template) -> Result<(), StoreError> {
            let upsert = sqlx::query(
                "INSERT INTO templates (id, team_id, public, build_id, build_status, build_error, cpu_count, memory_mb, disk_size_mb, envd_version, image, created_at, updated_at, last_spawned_at, spawn_count, build_count)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)
                 ON CONFLICT (id) DO UPDATE SET team_id = excluded.team_id, public = excluded.public, build_id = excluded.build_id,
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
            .bind(i64::from(t.cpu_count))
            .bind(i64::from(t.memory_mb))
            .bind(i64::from(t.disk_size_mb))
            .bind(&t.envd_version)
            .bind(t.image.as_ref().map(to_json).transpose()?)
            .bind(B::time(t.created_at))
            .bind(B::time(t.updated_at))
            .bind(t.last_spawned_at.map(B::time))
            .bind(big(t.spawn_count))
            .bind(big(t.build_count));
            // A name taken by another template of the namespace moves to this one; the
            // (scope, alias) key makes two hosts naming at once end with one owner.
            let names = t.aliases.iter().map(|alias| {
                sqlx::query(
                    "INSERT INTO template_aliases (scope, alias, template_id) VALUES ($1, $2, $3)
                     ON CONFLICT (scope, alias) DO UPDATE SET template_id = excluded.template_id",
                )
                .bind(t.team_id.as_deref().unwrap_or(""))
                .bind(alias)
                .bind(&t.id)
            });
            self.db
                .write_all(std::iter::once(upsert).chain(names).collect())
                .await
        }

        async fn template(&self, id: &str) -> Result<Option<Template>, StoreError> {
            sqlx::query_as::<_, Row>(template_query!(B, "WHERE t.id = $1"))
                .bind(id)
                .one(&self.db)
                .await
        }

        async fn template_by_name(
            &self,
            team_id: Option<&str>,
            alias: &str,
        ) -> Result<Option<Template>, StoreError> {
            sqlx::query_as::<_, Row>(template_query!(
                B,
                "JOIN template_aliases a ON a.template_id = t.id WHERE a.scope = $1 AND a.alias = $2"
            ))
            .bind(team_id.unwrap_or(""))
            .bind(alias)
            .one(&self.db)
            .await
        }

        async fn public_templates_named(&self, alias: &str) -> Result<Vec<Template>, StoreError> {
            sqlx::query_as::<_, Row>(template_query!(
                B,
                "JOIN template_aliases a ON a.template_id = t.id
                 WHERE a.alias = $1 AND a.scope != '' AND t.public
                 ORDER BY t.created_at, t.id COLLATE \"C\""
            ))
            .bind(alias)
            .all(&self.db)
            .await
        }

        async fn templates(&self) -> Result<Vec<Template>, StoreError> {
            sqlx::query_as::<_, Row>(template_query!(
                B,
                "ORDER BY t.created_at DESC, t.id COLLATE \"C\""
            ))
            .all(&self.db)
            .await
        }

        async fn set_template_build(
            &self,
            id: &str,
            status: BuildStatus,
            error: Option<&str>,
        ) -> Result<(), StoreError> {
            sqlx::query(
                "UPDATE templates SET build_status = $1, build_error = $2, updated_at = $3 WHERE id = $4",
            )
            .bind(status.as_str())
            .bind(error)
            .bind(B::time(Utc::now()))
            .bind(id)
            .run(&self.db).await
        }

        async fn set_template_image(
            &self,
            id: &str,
            build_id: &str,
            image: &TemplateImage,
        ) -> Result<(), StoreError> {
            // Only the latest build also sets the template's status: an older build finishing
            // late still becomes the image, but must not hide a newer build's progress. One
            // statement, so the comparison and the write see the same row.
            sqlx::query(
                "UPDATE templates SET image = $1, ready_build_id = $2, updated_at = $3,
                   build_status = CASE WHEN build_id = $2 THEN 'ready' ELSE build_status END,
                   build_error = CASE WHEN build_id = $2 THEN NULL ELSE build_error END
                 WHERE id = $4",
            )
            .bind(to_json(image)?)
            .bind(build_id)
            .bind(B::time(Utc::now()))
            .bind(id)
            .run(&self.db)
            .await
        }

        async fn delete_template(&self, id: &str) -> Result<(), StoreError> {
            let deletes = [
                "DELETE FROM build_logs WHERE build_id IN (SELECT id FROM template_builds WHERE template_id = $1)",
                "DELETE FROM build_tags WHERE template_id = $1",
                "DELETE FROM template_builds WHERE template_id = $1",
                "DELETE FROM template_aliases WHERE template_id = $1",
                "DELETE FROM templates WHERE id = $1",
            ]
            .map(|statement| sqlx::query(statement).bind(id));
            self.db.write_all(deletes.into()).await
        }

        async fn layers_in_use(&self) -> Result<Vec<String>, StoreError> {
            // One statement: one snapshot of templates, tags and sandboxes, so a layer moving
            // from one to another while another host writes is seen in at least one of them.
            let rows: Vec<(String, bool)> = sqlx::query_as(
                "SELECT image, TRUE AS with_checkpoint FROM templates WHERE image IS NOT NULL
                 UNION ALL
                 SELECT b.image, TRUE FROM template_builds b JOIN build_tags t ON t.build_id = b.id
                 WHERE b.image IS NOT NULL
                 UNION ALL
                 SELECT image, FALSE FROM sandboxes WHERE image IS NOT NULL",
            )
            .fetch_all(self.db.reads())
            .await
            .map_err(err)?;
            let mut layers = Vec::new();
            for (text, with_checkpoint) in rows {
                let image: TemplateImage = serde_json::from_str(&text).map_err(err)?;
                layers.extend(image.layers);
                // A snapshot's checkpoint lives as long as its layers. Recorded sandboxes
                // (running, paused, shelved, checkpointed) keep the layers they booted from
                // even after their template moved on: a collection that runs before the node
                // has adopted them again (at start) must not take their roots away. The
                // checkpoint they were made from is not theirs to keep.
                if with_checkpoint {
                    layers.extend(image.snapshot.and_then(|s| s.checkpoint));
                    // A capture's layer and checkpoint live as long as the image naming it.
                    layers.extend(
                        image
                            .started
                            .into_iter()
                            .flat_map(|s| [s.layer, s.checkpoint]),
                    );
                }
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
            // A CASE, as SQLite has no GREATEST: the newest spawn wins, whatever the order.
            sqlx::query(
                "UPDATE templates SET spawn_count = spawn_count + $1,
                   last_spawned_at = CASE WHEN last_spawned_at IS NULL OR last_spawned_at < $2 THEN $2 ELSE last_spawned_at END
                 WHERE id = $3",
            )
            .bind(i64::from(count))
            .bind(B::time(last))
            .bind(id)
            .run(&self.db).await
        }
    }
}
