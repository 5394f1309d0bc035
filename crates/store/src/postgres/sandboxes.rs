//! Sandboxes and their volume mounts.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use sandbar_core::store::SandboxRecords;
use sandbar_core::{NetworkConfig, RuntimeHandle, Sandbox, SandboxStatus, StoreError, VolumeMount};
use sqlx::PgPool;

use super::{json_of, u32_of};
use crate::{err, insert_err, to_json};

/// Sandboxes and their volume mounts, in PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgSandboxes {
    pub(crate) pool: PgPool,
}

#[derive(sqlx::FromRow)]
struct SandboxRow {
    id: String,
    team_id: String,
    template_id: String,
    alias: Option<String>,
    started_at: DateTime<Utc>,
    end_at: DateTime<Utc>,
    cpu_count: i64,
    memory_mb: i64,
    disk_size_mb: i64,
    metadata: String,
    env_vars: String,
    allow_internet_access: bool,
    envd_access_token: String,
    envd_version: String,
    status: String,
    handle: String,
    network: String,
    traffic_access_token: Option<String>,
    auto_pause: bool,
    auto_resume: bool,
    auto_pause_memory: bool,
    image: Option<String>,
    node_id: String,
}

impl TryFrom<SandboxRow> for Sandbox {
    type Error = StoreError;

    fn try_from(r: SandboxRow) -> Result<Self, StoreError> {
        let id = r.id;
        let status = SandboxStatus::parse(&r.status)
            .ok_or_else(|| err(format!("sandbox {id} has unknown status {}", r.status)))?;
        Ok(Sandbox {
            cpu_count: u32_of(r.cpu_count, "cpu count", &id)?,
            memory_mb: u32_of(r.memory_mb, "memory", &id)?,
            disk_size_mb: u32_of(r.disk_size_mb, "disk size", &id)?,
            team_id: r.team_id,
            template_id: r.template_id,
            alias: r.alias,
            started_at: r.started_at,
            end_at: r.end_at,
            metadata: serde_json::from_str(&r.metadata).map_err(err)?,
            env_vars: serde_json::from_str(&r.env_vars).map_err(err)?,
            allow_internet_access: r.allow_internet_access,
            network: serde_json::from_str(&r.network).map_err(err)?,
            traffic_access_token: r.traffic_access_token,
            auto_pause: r.auto_pause,
            auto_resume: r.auto_resume,
            auto_pause_memory: r.auto_pause_memory,
            image: json_of(r.image)?,
            envd_access_token: r.envd_access_token,
            envd_version: r.envd_version,
            status,
            handle: RuntimeHandle(serde_json::Value::from_str(&r.handle).map_err(err)?),
            node_id: r.node_id,
            id,
        })
    }
}

#[derive(sqlx::FromRow)]
struct MountRow {
    volume_id: String,
    team_id: String,
    name: String,
    path: String,
}

#[async_trait::async_trait]
impl SandboxRecords for PgSandboxes {
    async fn insert_sandbox(&self, s: &Sandbox) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO sandboxes (id, team_id, template_id, alias, started_at, end_at, cpu_count, memory_mb, disk_size_mb, metadata, env_vars, allow_internet_access, envd_access_token, envd_version, status, handle, network, traffic_access_token, auto_pause, auto_resume, auto_pause_memory, image, node_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23)",
        )
        .bind(&s.id)
        .bind(&s.team_id)
        .bind(&s.template_id)
        .bind(&s.alias)
        .bind(s.started_at)
        .bind(s.end_at)
        .bind(i64::from(s.cpu_count))
        .bind(i64::from(s.memory_mb))
        .bind(i64::from(s.disk_size_mb))
        .bind(to_json(&s.metadata)?)
        .bind(to_json(&s.env_vars)?)
        .bind(s.allow_internet_access)
        .bind(&s.envd_access_token)
        .bind(&s.envd_version)
        .bind(s.status.name())
        .bind(s.handle.0.to_string())
        .bind(to_json(&s.network)?)
        .bind(&s.traffic_access_token)
        .bind(s.auto_pause)
        .bind(s.auto_resume)
        .bind(s.auto_pause_memory)
        .bind(s.image.as_ref().map(to_json).transpose()?)
        .bind(&s.node_id)
        .execute(&self.pool)
        .await
        .map_err(insert_err("sandbox", &s.id))?;
        Ok(())
    }

    async fn sandbox(&self, id: &str) -> Result<Option<Sandbox>, StoreError> {
        sqlx::query_as::<_, SandboxRow>("SELECT * FROM sandboxes WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?
            .map(Sandbox::try_from)
            .transpose()
    }

    async fn team_sandboxes(&self, team_id: &str) -> Result<Vec<Sandbox>, StoreError> {
        sqlx::query_as::<_, SandboxRow>(
            "SELECT * FROM sandboxes WHERE team_id = $1 ORDER BY started_at DESC, id COLLATE \"C\" DESC",
        )
        .bind(team_id)
        .fetch_all(&self.pool)
        .await
        .map_err(err)?
        .into_iter()
        .map(Sandbox::try_from)
        .collect()
    }

    async fn all_sandboxes(&self) -> Result<Vec<Sandbox>, StoreError> {
        sqlx::query_as::<_, SandboxRow>(
            "SELECT * FROM sandboxes ORDER BY started_at DESC, id COLLATE \"C\" DESC",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(err)?
        .into_iter()
        .map(Sandbox::try_from)
        .collect()
    }

    async fn set_sandbox_end(&self, id: &str, end_at: DateTime<Utc>) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET end_at = $1 WHERE id = $2")
            .bind(end_at)
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
        sqlx::query("UPDATE sandboxes SET network = $1, allow_internet_access = $2 WHERE id = $3")
            .bind(to_json(network)?)
            .bind(allow_internet_access)
            .bind(id)
            .execute(&self.pool)
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
        // One statement either way, so the status and its handle change together.
        sqlx::query(
            "UPDATE sandboxes SET status = $1, handle = COALESCE($2, handle) WHERE id = $3",
        )
        .bind(status.name())
        .bind(handle.map(|h| h.0.to_string()))
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn delete_sandbox(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM sandboxes WHERE id = $1")
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
                 VALUES ($1, $2, $3, $4, $5)",
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
             JOIN volumes v ON v.id = m.volume_id WHERE m.sandbox_id = $1 ORDER BY m.position",
        )
        .bind(sandbox_id)
        .fetch_all(&self.pool)
        .await
        .map_err(err)?
        .into_iter()
        .map(|r| VolumeMount {
            volume_id: r.volume_id,
            team_id: r.team_id,
            name: r.name,
            path: r.path,
        })
        .collect())
    }
}
