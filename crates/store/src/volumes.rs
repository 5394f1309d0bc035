//! Volumes.

use sandbar_core::store::VolumeRecords;
use sandbar_core::{StoreError, Volume};

use crate::rows::VolumeRow;
use crate::{SqliteDb, err, micros};

/// Volumes, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteVolumes {
    pub(crate) db: SqliteDb,
}

#[async_trait::async_trait]
impl VolumeRecords for SqliteVolumes {
    async fn insert_volume(&self, v: &Volume) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "INSERT INTO volumes (id, team_id, name, token_hash, created_at) VALUES (?, ?, ?, ?, ?) \
             ON CONFLICT (team_id, name) DO NOTHING",
        )
        .bind(&v.id)
        .bind(&v.team_id)
        .bind(&v.name)
        .bind(&v.token_hash)
        .bind(micros(v.created_at))
        .execute(&self.db.writes)
        .await
        .map_err(err)?;
        Ok(done.rows_affected() == 1)
    }

    async fn volume(&self, id: &str) -> Result<Option<Volume>, StoreError> {
        let row = sqlx::query_as::<_, VolumeRow<i64>>("SELECT * FROM volumes WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.db.reads)
            .await
            .map_err(err)?;
        Ok(row.map(Volume::from))
    }

    async fn volume_by_name(
        &self,
        team_id: &str,
        name: &str,
    ) -> Result<Option<Volume>, StoreError> {
        let row = sqlx::query_as::<_, VolumeRow<i64>>(
            "SELECT * FROM volumes WHERE team_id = ? AND name = ?",
        )
        .bind(team_id)
        .bind(name)
        .fetch_optional(&self.db.reads)
        .await
        .map_err(err)?;
        Ok(row.map(Volume::from))
    }

    async fn team_volumes(&self, team_id: &str) -> Result<Vec<Volume>, StoreError> {
        let rows = sqlx::query_as::<_, VolumeRow<i64>>(
            "SELECT * FROM volumes WHERE team_id = ? ORDER BY created_at, id",
        )
        .bind(team_id)
        .fetch_all(&self.db.reads)
        .await
        .map_err(err)?;
        Ok(rows.into_iter().map(Volume::from).collect())
    }

    async fn volume_users(&self, volume_id: &str) -> Result<Vec<String>, StoreError> {
        sqlx::query_scalar(
            "SELECT DISTINCT sandbox_id FROM sandbox_volumes WHERE volume_id = ? ORDER BY sandbox_id",
        )
        .bind(volume_id)
        .fetch_all(&self.db.reads)
        .await
        .map_err(err)
    }

    async fn delete_volume(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM volumes WHERE id = ?")
            .bind(id)
            .execute(&self.db.writes)
            .await
            .map_err(err)?;
        Ok(())
    }
}
