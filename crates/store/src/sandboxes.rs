//! Sandboxes and their volume mounts.

use chrono::{DateTime, Utc};
use sandbar_core::store::SandboxRecords;
use sandbar_core::{NetworkConfig, RuntimeHandle, Sandbox, SandboxStatus, StoreError, VolumeMount};

use crate::rows::{MountRow, SandboxRow};
use crate::{SqliteDb, err, insert_err, micros};

/// Sandboxes and their volume mounts, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteSandboxes {
    pub(crate) db: SqliteDb,
}

#[async_trait::async_trait]
impl SandboxRecords for SqliteSandboxes {
    async fn insert_sandbox(&self, s: &Sandbox) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO sandboxes (id, team_id, template_id, alias, started_at, end_at, cpu_count, memory_mb, disk_size_mb, metadata, env_vars, allow_internet_access, envd_access_token, envd_version, status, handle, network, traffic_access_token, auto_pause, auto_resume, auto_pause_memory, image, node_id)
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
        .bind(s.status.name())
        .bind(s.handle.to_stored())
        .bind(serde_json::to_string(&s.network).map_err(err)?)
        .bind(&s.traffic_access_token)
        .bind(s.auto_pause)
        .bind(s.auto_resume)
        .bind(s.auto_pause_memory)
        .bind(
            s.image
                .as_ref()
                .map(serde_json::to_string)
                .transpose()
                .map_err(err)?,
        )
        .bind(&s.node_id)
        .execute(&self.db.writes)
        .await
        .map_err(insert_err("sandbox", &s.id))?;
        Ok(())
    }

    async fn sandbox(&self, id: &str) -> Result<Option<Sandbox>, StoreError> {
        let row = sqlx::query_as::<_, SandboxRow<i64>>("SELECT * FROM sandboxes WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.db.reads)
            .await
            .map_err(err)?;
        row.map(Sandbox::try_from).transpose()
    }

    async fn team_sandboxes(&self, team_id: &str) -> Result<Vec<Sandbox>, StoreError> {
        let rows = sqlx::query_as::<_, SandboxRow<i64>>(
            "SELECT * FROM sandboxes WHERE team_id = ? ORDER BY started_at DESC, id DESC",
        )
        .bind(team_id)
        .fetch_all(&self.db.reads)
        .await
        .map_err(err)?;
        rows.into_iter().map(Sandbox::try_from).collect()
    }

    async fn all_sandboxes(&self) -> Result<Vec<Sandbox>, StoreError> {
        let rows = sqlx::query_as::<_, SandboxRow<i64>>(
            "SELECT * FROM sandboxes ORDER BY started_at DESC, id DESC",
        )
        .fetch_all(&self.db.reads)
        .await
        .map_err(err)?;
        rows.into_iter().map(Sandbox::try_from).collect()
    }

    async fn set_sandbox_end(&self, id: &str, end_at: DateTime<Utc>) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET end_at = ? WHERE id = ?")
            .bind(micros(end_at))
            .bind(id)
            .execute(&self.db.writes)
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
            .execute(&self.db.writes)
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn set_sandbox_status(
        &self,
        id: &str,
        status: SandboxStatus,
        handle: Option<&RuntimeHandle>,
    ) -> Result<(), StoreError> {
        let query = match handle {
            Some(_) => "UPDATE sandboxes SET status = ?, handle = ? WHERE id = ?",
            None => "UPDATE sandboxes SET status = ? WHERE id = ?",
        };
        let mut query = sqlx::query(query).bind(status.name());
        if let Some(handle) = handle {
            query = query.bind(handle.to_stored());
        }
        query.bind(id).execute(&self.db.writes).await.map_err(err)?;
        Ok(())
    }

    async fn delete_sandbox(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM sandboxes WHERE id = ?")
            .bind(id)
            .execute(&self.db.writes)
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn insert_sandbox_volumes(
        &self,
        sandbox_id: &str,
        mounts: &[VolumeMount],
    ) -> Result<(), StoreError> {
        let mut tx = self.db.writes.begin().await.map_err(err)?;
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
        Ok(sqlx::query_as::<_, MountRow>(
            "SELECT m.volume_id, v.team_id, m.name, m.path FROM sandbox_volumes m \
             JOIN volumes v ON v.id = m.volume_id WHERE m.sandbox_id = ? ORDER BY m.position",
        )
        .bind(sandbox_id)
        .fetch_all(&self.db.reads)
        .await
        .map_err(err)?
        .into_iter()
        .map(VolumeMount::from)
        .collect())
    }
}
