//! Sandboxes and the volumes each mounts.

use chrono::{DateTime, Utc};

use super::StoreError;
use crate::lifecycle::SandboxStatus;
use crate::model::{Sandbox, VolumeMount};
use crate::network::NetworkConfig;
use crate::runtime::RuntimeHandle;

#[async_trait::async_trait]
pub trait SandboxRecords: Send + Sync {
    /// Records a sandbox with the volumes it mounts, in order, all or nothing.
    async fn insert_sandbox(
        &self,
        sandbox: &Sandbox,
        mounts: &[VolumeMount],
    ) -> Result<(), StoreError>;
    async fn sandbox(&self, id: &str) -> Result<Option<Sandbox>, StoreError>;
    /// A team's sandboxes, newest first.
    async fn team_sandboxes(&self, team_id: &str) -> Result<Vec<Sandbox>, StoreError>;
    async fn all_sandboxes(&self) -> Result<Vec<Sandbox>, StoreError>;
    async fn set_sandbox_end(&self, id: &str, end_at: DateTime<Utc>) -> Result<(), StoreError>;
    async fn set_sandbox_network(
        &self,
        id: &str,
        network: &NetworkConfig,
        allow_internet_access: bool,
    ) -> Result<(), StoreError>;
    /// Records the sandbox's status, and the runtime handle that now describes it when
    /// `handle` is given, in one write.
    async fn set_sandbox_status(
        &self,
        id: &str,
        status: SandboxStatus,
        handle: Option<&RuntimeHandle>,
    ) -> Result<(), StoreError>;
    async fn delete_sandbox(&self, id: &str) -> Result<(), StoreError>;
    async fn sandbox_volumes(&self, sandbox_id: &str) -> Result<Vec<VolumeMount>, StoreError>;
}
