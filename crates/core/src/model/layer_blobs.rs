//! Template layers published to the cluster's layer store, so that any node can start any
//! template.

use chrono::{DateTime, Utc};

/// One layer as an archive in the layer store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBlob {
    /// The layer's name, as templates list it (`layer/<key>`, `image/<hex>`, `base/v2`).
    pub layer: String,
    /// `sha256:<hex>` of the archive: the blob's name in the store.
    pub digest: String,
    pub size_bytes: u64,
    /// The node that published it.
    pub node_id: String,
    pub published_at: DateTime<Utc>,
}

impl LayerBlob {
    /// The name a paused sandbox's files are recorded under: replaced at every pause,
    /// forgotten at every wake.
    pub fn sandbox_files(sandbox_id: &str) -> String {
        format!("files/{sandbox_id}")
    }

    /// The name the checkpoint of a paused sandbox's processes is recorded under, beside its
    /// files: replaced at every checkpoint, forgotten at every wake.
    pub fn sandbox_checkpoint(sandbox_id: &str) -> String {
        format!("memory/{sandbox_id}")
    }
}
