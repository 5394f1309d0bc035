//! Layers published to the layer store.

use chrono::{DateTime, Utc};
use sandbar_core::store::LayerBlobRecords;
use sandbar_core::{LayerBlob, StoreError};
use sqlx::PgPool;

use crate::backend::{Backend, Read, Write};
use crate::rows::LayerBlobRow;
use crate::{SqliteDb, err};

/// Layers published to the layer store, in either database.
#[derive(Debug, Clone)]
pub struct LayerBlobs<B> {
    pub(crate) db: B,
}

/// The insert of a record; one of a name already recorded is kept or replaced.
macro_rules! insert_layer_blob {
    ($on_conflict:literal) => {
        concat!(
            "INSERT INTO layer_blobs (layer, digest, size_bytes, node_id, published_at) ",
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (layer) ",
            $on_conflict
        )
    };
}
const KEEP_FIRST: &str = insert_layer_blob!("DO NOTHING");
const REPLACE: &str = insert_layer_blob!(
    "DO UPDATE SET digest = excluded.digest, size_bytes = excluded.size_bytes, \
     node_id = excluded.node_id, published_at = excluded.published_at"
);

// SQLite has no arrays: the layers go in as one JSON document.
impl LayerBlobs<SqliteDb> {
    async fn of_layers(&self, layers: &[String]) -> Result<Vec<LayerBlobRow<i64>>, StoreError> {
        sqlx::query_as("SELECT * FROM layer_blobs WHERE layer IN (SELECT value FROM json_each($1))")
            .bind(serde_json::to_string(layers).map_err(err)?)
            .fetch_all(&self.db.reads)
            .await
            .map_err(err)
    }
}

impl LayerBlobs<PgPool> {
    async fn of_layers(
        &self,
        layers: &[String],
    ) -> Result<Vec<LayerBlobRow<DateTime<Utc>>>, StoreError> {
        sqlx::query_as("SELECT * FROM layer_blobs WHERE layer = ANY($1)")
            .bind(layers)
            .fetch_all(&self.db)
            .await
            .map_err(err)
    }
}

on_both! {
    impl LayerBlobs<B> {
        async fn insert_layer_blob(
            &self,
            blob: &LayerBlob,
            sql: &'static str,
        ) -> Result<(), StoreError> {
            sqlx::query(sql)
                .bind(&blob.layer)
                .bind(&blob.digest)
                .bind(i64::try_from(blob.size_bytes).map_err(err)?)
                .bind(&blob.node_id)
                .bind(B::time(blob.published_at))
                .run(&self.db)
                .await
        }
    }

    #[async_trait::async_trait]
    impl LayerBlobRecords for LayerBlobs<B> {
        async fn record_layer_blob(&self, blob: &LayerBlob) -> Result<(), StoreError> {
            self.insert_layer_blob(blob, KEEP_FIRST).await
        }

        async fn replace_layer_blob(&self, blob: &LayerBlob) -> Result<(), StoreError> {
            self.insert_layer_blob(blob, REPLACE).await
        }

        async fn delete_layer_blob(&self, layer: &str) -> Result<(), StoreError> {
            sqlx::query("DELETE FROM layer_blobs WHERE layer = $1")
                .bind(layer)
                .run(&self.db)
                .await
        }

        async fn layer_blobs(&self, layers: &[String]) -> Result<Vec<LayerBlob>, StoreError> {
            self.of_layers(layers)
                .await?
                .into_iter()
                .map(LayerBlob::try_from)
                .collect()
        }

        async fn all_layer_blobs(&self) -> Result<Vec<LayerBlob>, StoreError> {
            sqlx::query_as::<_, LayerBlobRow<Time>>("SELECT * FROM layer_blobs")
                .all(&self.db)
                .await
        }
    }
}
