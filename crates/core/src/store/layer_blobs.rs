//! Layers published to the layer store.

use super::StoreError;
use crate::model::LayerBlob;

#[async_trait::async_trait]
pub trait LayerBlobRecords: Send + Sync {
    /// Records a published layer. A layer already recorded keeps its first record: nodes
    /// that published the same layer each made a faithful copy, and every fetch must agree
    /// on one.
    async fn record_layer_blob(&self, blob: &LayerBlob) -> Result<(), StoreError>;
    /// Records a published copy that replaces any earlier one of the same name: a paused
    /// sandbox's files (`files/<sandbox id>`), newer at every pause.
    async fn replace_layer_blob(&self, blob: &LayerBlob) -> Result<(), StoreError>;
    /// Forgets the record named `layer`, if any.
    async fn delete_layer_blob(&self, layer: &str) -> Result<(), StoreError>;
    /// The records of those of `layers` that were published.
    async fn layer_blobs(&self, layers: &[String]) -> Result<Vec<LayerBlob>, StoreError>;
    /// Every record, for the collector of the layer store.
    async fn all_layer_blobs(&self) -> Result<Vec<LayerBlob>, StoreError>;
}
