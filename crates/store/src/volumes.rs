//! Volumes.

use sandbar_core::store::VolumeRecords;
use sandbar_core::{StoreError, Volume};

use crate::backend::{Backend, Read, Write};
use crate::err;
use crate::rows::VolumeRow;

/// Volumes, in either database.
#[derive(Debug, Clone)]
pub struct Volumes<B> {
    pub(crate) db: B,
}

on_both! {
    #[async_trait::async_trait]
    impl VolumeRecords for Volumes<B> {
        async fn insert_volume(&self, v: &Volume) -> Result<bool, StoreError> {
            // The (team, name) constraint decides between two hosts creating the same name.
            let done = sqlx::query(
                "INSERT INTO volumes (id, team_id, name, token_hash, created_at) VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (team_id, name) DO NOTHING",
            )
            .bind(&v.id)
            .bind(&v.team_id)
            .bind(&v.name)
            .bind(&v.token_hash)
            .bind(B::time(v.created_at))
            .write(&self.db).await?;
            Ok(done == 1)
        }

        async fn volume(&self, id: &str) -> Result<Option<Volume>, StoreError> {
            Ok(
                sqlx::query_as::<_, VolumeRow<Time>>("SELECT * FROM volumes WHERE id = $1")
                    .bind(id)
                    .fetch_optional(self.db.reads())
                    .await
                    .map_err(err)?
                    .map(Volume::from),
            )
        }

        async fn volume_by_name(
            &self,
            team_id: &str,
            name: &str,
        ) -> Result<Option<Volume>, StoreError> {
            Ok(sqlx::query_as::<_, VolumeRow<Time>>(
                "SELECT * FROM volumes WHERE team_id = $1 AND name = $2",
            )
            .bind(team_id)
            .bind(name)
            .fetch_optional(self.db.reads())
            .await
            .map_err(err)?
            .map(Volume::from))
        }

        async fn team_volumes(&self, team_id: &str) -> Result<Vec<Volume>, StoreError> {
            sqlx::query_as::<_, VolumeRow<Time>>(
                "SELECT * FROM volumes WHERE team_id = $1 ORDER BY created_at, id COLLATE \"C\"",
            )
            .bind(team_id)
            .all(&self.db)
            .await
        }

        async fn volume_users(&self, volume_id: &str) -> Result<Vec<String>, StoreError> {
            sqlx::query_scalar(
                "SELECT DISTINCT sandbox_id COLLATE \"C\" AS sandbox_id FROM sandbox_volumes WHERE volume_id = $1 ORDER BY 1",
            )
            .bind(volume_id)
            .fetch_all(self.db.reads())
            .await
            .map_err(err)
        }

        async fn delete_volume(&self, id: &str) -> Result<(), StoreError> {
            sqlx::query("DELETE FROM volumes WHERE id = $1")
                .bind(id)
                .run(&self.db)
                .await
        }
    }
}
