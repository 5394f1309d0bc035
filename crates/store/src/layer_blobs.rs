//! Layers published to the layer store.

use sandbar_core::store::LayerBlobRecords;
use sandbar_core::{LayerBlob, StoreError};
use sqlx::Row;

use crate::{SqliteStore, err, micros, time};

#[async_trait::async_trait]
impl LayerBlobRecords for SqliteStore {
    async fn record_layer_blob(&self, blob: &LayerBlob) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO layer_blobs (layer, digest, size_bytes, node_id, published_at) \
             VALUES (?, ?, ?, ?, ?) ON CONFLICT (layer) DO NOTHING",
        )
        .bind(&blob.layer)
        .bind(&blob.digest)
        .bind(i64::try_from(blob.size_bytes).map_err(err)?)
        .bind(&blob.node_id)
        .bind(micros(blob.published_at))
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn replace_layer_blob(&self, blob: &LayerBlob) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO layer_blobs (layer, digest, size_bytes, node_id, published_at) \
             VALUES (?, ?, ?, ?, ?) ON CONFLICT (layer) DO UPDATE SET digest = excluded.digest, \
             size_bytes = excluded.size_bytes, node_id = excluded.node_id, \
             published_at = excluded.published_at",
        )
        .bind(&blob.layer)
        .bind(&blob.digest)
        .bind(i64::try_from(blob.size_bytes).map_err(err)?)
        .bind(&blob.node_id)
        .bind(micros(blob.published_at))
        .execute(&self.pool)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn delete_layer_blob(&self, layer: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM layer_blobs WHERE layer = ?")
            .bind(layer)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn layer_blobs(&self, layers: &[String]) -> Result<Vec<LayerBlob>, StoreError> {
        let mut found = Vec::new();
        for layer in layers {
            let row = sqlx::query("SELECT * FROM layer_blobs WHERE layer = ?")
                .bind(layer)
                .fetch_optional(&self.pool)
                .await
                .map_err(err)?;
            let Some(row) = row else { continue };
            let size: i64 = row.try_get("size_bytes").map_err(err)?;
            found.push(LayerBlob {
                layer: row.try_get("layer").map_err(err)?,
                digest: row.try_get("digest").map_err(err)?,
                size_bytes: u64::try_from(size).map_err(err)?,
                node_id: row.try_get("node_id").map_err(err)?,
                published_at: time(row.try_get("published_at").map_err(err)?),
            });
        }
        Ok(found)
    }
}
