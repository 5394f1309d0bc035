//! Volumes.

use super::StoreError;
use crate::model::Volume;

#[async_trait::async_trait]
pub trait VolumeRecords: Send + Sync {
    /// Records a new volume; false if the team already has a volume of that name.
    async fn insert_volume(&self, volume: &Volume) -> Result<bool, StoreError>;
    async fn volume(&self, id: &str) -> Result<Option<Volume>, StoreError>;
    async fn volume_by_name(&self, team_id: &str, name: &str)
    -> Result<Option<Volume>, StoreError>;
    /// A team's volumes, oldest first.
    async fn team_volumes(&self, team_id: &str) -> Result<Vec<Volume>, StoreError>;
    /// Recorded sandboxes (running or paused) that mount the volume.
    async fn volume_users(&self, volume_id: &str) -> Result<Vec<String>, StoreError>;
    async fn delete_volume(&self, id: &str) -> Result<(), StoreError>;
}
