//! Template layers as the runtime keeps them: what live sandboxes run on and the collector.

use std::collections::BTreeSet;

use sandbar_core::{RuntimeError, RuntimeHandle};

use super::handle::launched;
use super::in_flight::InFlightGuard;
use super::{SANDBOX_IDS, sandbox_err};

/// How long the collector leaves a new snapshot's parts alone at most.
pub(super) const FRESH_SNAPSHOT: std::time::Duration = std::time::Duration::from_secs(600);

/// Whether `key` names a snapshot's checkpoint (the 32 hex digits a snapshot is given).
pub(super) fn is_snapshot_key(key: &str) -> bool {
    key.len() == 32 && key.bytes().all(|c| c.is_ascii_hexdigit())
}

node_part! {
    /// Keeps the node's layers: its store, the cluster's where one is configured, the layers
    /// builds commit and the collection of those nothing keeps.
    pub struct LayerKeeper;
}

impl LayerKeeper {
    pub fn layer_store(&self) -> &crate::storage::layers::LayerStore {
        &self.node.layers
    }

    /// Shares this node's layers through the cluster's layer store from now on.
    pub fn use_shared_layers(
        &self,
        shared: std::sync::Arc<crate::cluster::shared_layers::SharedLayers>,
    ) {
        if self.node.shared_layers.set(shared).is_err() {
            tracing::warn!("the layer store was already set; the second one is ignored");
        }
    }

    pub fn shared_layers(
        &self,
    ) -> Option<&std::sync::Arc<crate::cluster::shared_layers::SharedLayers>> {
        self.node.shared_layers.get()
    }

    /// Fetches from the layer store the layers of `layers` this node lacks, if there is a
    /// store; without one a missing layer is found missing when the sandbox boots.
    pub(super) async fn fetch_missing_layers(
        &self,
        template_id: &str,
        layers: &[String],
    ) -> Result<(), RuntimeError> {
        let Some(shared) = self.node.shared_layers.get() else {
            return Ok(());
        };
        shared
            .ensure(layers)
            .await
            .map_err(|e| RuntimeError::TemplateMissing {
                template_id: format!("{template_id} ({e})"),
            })
    }

    /// Counts a build sandbox's launch or removal running in a task of its own.
    pub(crate) fn build_sandbox_in_flight(&self) -> InFlightGuard {
        self.node.build_sandboxes_settling.enter()
    }

    /// Layers live sandboxes run on.
    pub fn layers_of_live_sandboxes(&self) -> Vec<String> {
        self.node.holdings.layers_in_use()
    }
}

impl LayerKeeper {
    /// Stops a build sandbox and makes its writable layer the step layer `key`: owners
    /// shifted into the sandbox id range every sandbox maps, read-only from now on.
    pub async fn commit_layer(
        &self,
        id: &str,
        handle: &RuntimeHandle,
        key: &str,
    ) -> Result<(), RuntimeError> {
        let h = launched(id, handle)?;
        self.node.stop(id, Some(h)).await?;
        self.node.remove_log(id);
        // The disk becomes a layer, which the template now holds.
        drop(self.node.holdings.remove(id));
        let base = h.id_base.unwrap_or(0);
        let dir = self.node.disks.path(id);
        let target = self.node.layers.steps_dir().join(key);
        let disks = self.node.disks.clone();
        let owned_id = id.to_owned();
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            crate::storage::layers::seal_layer(&dir, base, SANDBOX_IDS)?;
            if target.exists() {
                // Another build made the same layer meanwhile; keep theirs.
                return disks.remove(&owned_id).map_err(std::io::Error::other);
            }
            std::fs::rename(&dir, &target)
        })
        .await
        .map_err(|e| sandbox_err(id, e))?
        .map_err(|e| sandbox_err(id, format!("cannot keep the layer {key}: {e}")))?;
        Ok(())
    }

    /// `keep` and the layers live sandboxes and new snapshots use.
    pub fn layers_to_keep(&self, keep: &[String]) -> BTreeSet<String> {
        let mut keep: BTreeSet<String> = keep.iter().cloned().collect();
        keep.extend(self.layers_of_live_sandboxes());
        let mut fresh = self
            .node
            .fresh_snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        fresh.retain(|(_, made)| made.elapsed() < FRESH_SNAPSHOT);
        keep.extend(fresh.iter().map(|(name, _)| name.clone()));
        keep
    }

    /// Removes step layers and checkpoints that `keep` (see [`Self::layers_to_keep`]) does
    /// not name. Image layers are a cache with a limit of its own (`image_layers`).
    pub fn collect_layers(&self, keep: &BTreeSet<String>) {
        let steps = self.node.layers.steps_dir().to_owned();
        let snapshots = self.node.places.snapshots_dir();
        for (dir, kind) in [
            (steps.as_path(), "layer"),
            (snapshots.as_path(), "checkpoint"),
        ] {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') || keep.contains(&format!("{kind}/{name}")) {
                    continue;
                }
                let path = entry.path();
                let removed = if kind == "layer" {
                    self.node
                        .disks
                        .remove_at(&steps, &name)
                        .map_err(|e| e.to_string())
                } else {
                    crate::storage::disks::remove_tree(&path).map_err(|e| e.to_string())
                };
                match removed {
                    Ok(()) => {
                        tracing::info!(layer = %format!("{kind}/{name}"), "removed unused layer")
                    }
                    Err(e) => {
                        tracing::warn!(layer = %name, error = %e, "cannot remove unused layer")
                    }
                }
            }
        }
    }
}
