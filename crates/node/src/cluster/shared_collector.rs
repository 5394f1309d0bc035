//! Letting go of what the layer store no longer needs: records of layers and checkpoints no
//! template names, copies of sandboxes that are gone, and the tags that keep their blobs.
//!
//! Every node with a layer store runs a collector; they agree because each step is safe to
//! repeat. Nothing goes the first time it is seen unneeded, only when it still is one pass
//! later: a build records its layers before its template names them, and a node pushes and
//! tags a blob before it records it, so what is on its way in is never taken for garbage.
//! Deleting a tag lets the registry's own garbage collection remove the blob's bytes.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sandbar_core::{LayerBlob, Store, StoreError};
use sandbar_image::BlobStoreError;

use crate::cluster::shared_layers::SharedLayers;

#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    #[error("collecting the layer store: {0}")]
    Store(#[from] StoreError),
    #[error("collecting the layer store: {0}")]
    Blob(#[from] BlobStoreError),
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Collected {
    pub records_deleted: usize,
    pub tags_deleted: usize,
}

pub struct SharedCollector {
    shared: Arc<SharedLayers>,
    store: Arc<Store>,
    /// Record names and blob digests seen unneeded in the last pass.
    unneeded_records: HashSet<String>,
    unneeded_tags: HashSet<String>,
    /// Records younger than this are never collected.
    grace: Duration,
}

impl std::fmt::Debug for SharedCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCollector")
            .field("store", &self.shared.location())
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

impl SharedCollector {
    pub fn new(shared: Arc<SharedLayers>, store: Arc<Store>, grace: Duration) -> Self {
        Self {
            shared,
            store,
            unneeded_records: HashSet::new(),
            unneeded_tags: HashSet::new(),
            grace,
        }
    }

    /// Collects every `interval`, for as long as the process runs.
    pub async fn run(mut self, interval: Duration) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match self.pass().await {
                Ok(done) if done != Collected::default() => {
                    tracing::info!(
                        records = done.records_deleted,
                        tags = done.tags_deleted,
                        "let go of what the layer store no longer needs"
                    );
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot collect the layer store"),
            }
        }
    }

    /// One pass: records first, then the tags of blobs no record names.
    pub async fn pass(&mut self) -> Result<Collected, CollectError> {
        let mut done = Collected::default();
        let needed = self.needed_names().await?;
        let young =
            Utc::now() - chrono::Duration::from_std(self.grace).unwrap_or(chrono::Duration::MAX);
        let records = self.store.layer_blobs.all_layer_blobs().await?;
        let mut unneeded = HashSet::new();
        // What the records kept name; a record made since is seen by the next pass, before
        // its blob's tag could go.
        let mut recorded = HashMap::new();
        for record in records {
            if needed.contains(&record.layer) || record.published_at > young {
                recorded.insert(record.digest, record.size_bytes);
                continue;
            }
            if self.unneeded_records.contains(&record.layer) {
                self.store
                    .layer_blobs
                    .delete_layer_blob(&record.layer)
                    .await?;
                done.records_deleted += 1;
            } else {
                recorded.insert(record.digest, record.size_bytes);
                unneeded.insert(record.layer);
            }
        }
        self.unneeded_records = unneeded;

        let mut unneeded = HashSet::new();
        let mut let_go = Vec::new();
        for digest in self.shared.kept_blobs().await? {
            if recorded.contains_key(&digest) {
                continue;
            }
            if self.unneeded_tags.contains(&digest) {
                if self.shared.let_go_of(&digest).await? {
                    done.tags_deleted += 1;
                    let_go.push(digest);
                }
            } else {
                unneeded.insert(digest);
            }
        }
        self.unneeded_tags = unneeded;
        if !let_go.is_empty() {
            // A node may have recorded one of them meanwhile (the same content published
            // again): its tag comes back before the registry could remove the bytes.
            let recorded = self.recorded_digests().await?;
            for digest in let_go {
                if let Some(size) = recorded.get(&digest) {
                    self.shared.keep_blob(&digest, *size).await?;
                    done.tags_deleted -= 1;
                }
            }
        }
        Ok(done)
    }

    /// Every name a template or a sandbox still needs from the store.
    async fn needed_names(&self) -> Result<HashSet<String>, StoreError> {
        let mut needed = HashSet::new();
        for template in self.store.templates.templates().await? {
            if let Some(image) = &template.image {
                needed.extend(image.parts());
            }
        }
        for sandbox in self.store.sandboxes.all_sandboxes().await? {
            needed.insert(LayerBlob::sandbox_files(&sandbox.id));
            needed.insert(LayerBlob::sandbox_checkpoint(&sandbox.id));
        }
        Ok(needed)
    }

    async fn recorded_digests(&self) -> Result<HashMap<String, u64>, StoreError> {
        Ok(self
            .store
            .layer_blobs
            .all_layer_blobs()
            .await?
            .into_iter()
            .map(|b| (b.digest, b.size_bytes))
            .collect())
    }
}
