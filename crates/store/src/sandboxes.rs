//! Sandboxes and their volume mounts.

use chrono::{DateTime, Utc};
use sandbar_core::store::SandboxRecords;
use sandbar_core::{NetworkConfig, RuntimeHandle, Sandbox, SandboxStatus, StoreError, VolumeMount};

use crate::backend::{Backend, Read, Transact, Write};
use crate::rows::{MountRow, SandboxRow};
use crate::{err, to_json};

/// Sandboxes and their volume mounts, in either database.
#[derive(Debug, Clone)]
pub struct Sandboxes<B> {
    pub(crate) db: B,
}

on_both! {
    #[async_trait::async_trait]
    impl SandboxRecords for Sandboxes<B> {
        async fn insert_sandbox(
            &self,
            s: &Sandbox,
            mounts: &[VolumeMount],
        ) -> Result<(), StoreError> {
            let insert = sqlx::query(
                "INSERT INTO sandboxes (id, team_id, template_id, alias, started_at, end_at, cpu_count, memory_mb, disk_size_mb, metadata, env_vars, allow_internet_access, envd_access_token, envd_version, status, handle, network, traffic_access_token, auto_pause, auto_resume, auto_pause_memory, image, node_id)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23)",
            )
            .bind(&s.id)
            .bind(&s.team_id)
            .bind(&s.template_id)
            .bind(&s.alias)
            .bind(B::time(s.started_at))
            .bind(B::time(s.end_at))
            .bind(i64::from(s.cpu_count))
            .bind(i64::from(s.memory_mb))
            .bind(i64::from(s.disk_size_mb))
            .bind(to_json(&s.metadata)?)
            .bind(to_json(&s.env_vars)?)
            .bind(s.allow_internet_access)
            .bind(&s.envd_access_token)
            .bind(&s.envd_version)
            .bind(s.status.name())
            .bind(s.handle.to_stored())
            .bind(to_json(&s.network)?)
            .bind(&s.traffic_access_token)
            .bind(s.auto_pause)
            .bind(s.auto_resume)
            .bind(s.auto_pause_memory)
            .bind(s.image.as_ref().map(to_json).transpose()?)
            .bind(&s.node_id);
            if mounts.is_empty() {
                return insert.insert(&self.db, "sandbox", &s.id).await;
            }
            let mounts = mounts
                .iter()
                .enumerate()
                .map(|(position, m)| {
                    Ok(sqlx::query(
                        "INSERT INTO sandbox_volumes (sandbox_id, position, volume_id, name, path) \
                         VALUES ($1, $2, $3, $4, $5)",
                    )
                    .bind(&s.id)
                    .bind(i64::try_from(position).map_err(err)?)
                    .bind(&m.volume_id)
                    .bind(&m.name)
                    .bind(&m.path))
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            // One transaction: a sandbox is never recorded without the volumes it mounts.
            self.db.insert_with(insert, "sandbox", &s.id, mounts).await
        }

        async fn sandbox(&self, id: &str) -> Result<Option<Sandbox>, StoreError> {
            sqlx::query_as::<_, SandboxRow<Time>>("SELECT * FROM sandboxes WHERE id = $1")
                .bind(id)
                .one(&self.db)
                .await
        }

        async fn team_sandboxes(&self, team_id: &str) -> Result<Vec<Sandbox>, StoreError> {
            sqlx::query_as::<_, SandboxRow<Time>>(
                "SELECT * FROM sandboxes WHERE team_id = $1 ORDER BY started_at DESC, id COLLATE \"C\" DESC",
            )
            .bind(team_id)
            .all(&self.db).await
        }

        async fn all_sandboxes(&self) -> Result<Vec<Sandbox>, StoreError> {
            sqlx::query_as::<_, SandboxRow<Time>>(
                "SELECT * FROM sandboxes ORDER BY started_at DESC, id COLLATE \"C\" DESC",
            )
            .all(&self.db)
            .await
        }

        async fn set_sandbox_end(&self, id: &str, end_at: DateTime<Utc>) -> Result<(), StoreError> {
            sqlx::query("UPDATE sandboxes SET end_at = $1 WHERE id = $2")
                .bind(B::time(end_at))
                .bind(id)
                .run(&self.db)
                .await
        }

        async fn set_sandbox_network(
            &self,
            id: &str,
            network: &NetworkConfig,
            allow_internet_access: bool,
        ) -> Result<(), StoreError> {
            sqlx::query(
                "UPDATE sandboxes SET network = $1, allow_internet_access = $2 WHERE id = $3",
            )
            .bind(to_json(network)?)
            .bind(allow_internet_access)
            .bind(id)
            .run(&self.db)
            .await
        }

        async fn set_sandbox_status(
            &self,
            id: &str,
            status: SandboxStatus,
            handle: Option<&RuntimeHandle>,
        ) -> Result<(), StoreError> {
            // One statement either way, so the status and its handle change together.
            sqlx::query(
                "UPDATE sandboxes SET status = $1, handle = COALESCE($2, handle) WHERE id = $3",
            )
            .bind(status.name())
            .bind(handle.map(RuntimeHandle::to_stored))
            .bind(id)
            .run(&self.db)
            .await
        }

        async fn delete_sandbox(&self, id: &str) -> Result<(), StoreError> {
            sqlx::query("DELETE FROM sandboxes WHERE id = $1")
                .bind(id)
                .run(&self.db)
                .await
        }

        async fn sandbox_volumes(&self, sandbox_id: &str) -> Result<Vec<VolumeMount>, StoreError> {
            sqlx::query_as::<_, MountRow>(
                "SELECT m.volume_id, v.team_id, m.name, m.path FROM sandbox_volumes m \
                 JOIN volumes v ON v.id = m.volume_id WHERE m.sandbox_id = $1 ORDER BY m.position",
            )
            .bind(sandbox_id)
            .all(&self.db)
            .await
        }
    }
}
