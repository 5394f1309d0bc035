//! Template layers shared by the nodes of a cluster through a layer store (a repository of an
//! OCI registry the operator runs): the node that builds a layer publishes it as an archive
//! and records its digest; a node asked to start a template whose layers it lacks fetches
//! them, checks each against its recorded digest and unpacks it where a layer of that name
//! lives, before the sandbox boots.
//!
//! Archives are uncompressed: the store is on the cluster's network, where compressing a
//! few hundred megabytes would cost more time than sending them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use chrono::Utc;
use sandbar_core::LayerBlob;
use sandbar_core::store::LayerBlobRecords;
use sandbar_image::{BlobStore, BlobStoreError};

use crate::storage::layers::{BUILT_IN_ROOTS, LayerStore};

/// Where archives and layers in transit are kept, beside where they end up (a dot name,
/// which the layer collectors skip).
const STAGING_PREFIX: &str = ".shared-";

#[derive(Debug, thiserror::Error)]
pub enum SharedLayerError {
    #[error("layer {layer} is not on this node and was never published to the layer store")]
    NotPublished { layer: String },
    #[error("layer {layer} has a name no node stores a layer under")]
    BadName { layer: String },
    #[error("layer {layer}: {source}")]
    Store {
        layer: String,
        #[source]
        source: sandbar_core::StoreError,
    },
    #[error("layer {layer}: {source}")]
    Blob {
        layer: String,
        #[source]
        source: BlobStoreError,
    },
    #[error("layer {layer}: {}: {source}", path.display())]
    Io {
        layer: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("layer {layer}: unpacking it: {source}")]
    Unpack {
        layer: String,
        #[source]
        source: sandbar_image::UnpackError,
    },
}

/// The layer store and the records of what is in it, as one node uses them.
pub struct SharedLayers {
    blobs: BlobStore,
    records: Arc<dyn LayerBlobRecords>,
    layers: LayerStore,
    node_id: String,
    /// One transfer per layer at a time: a second create of the same template waits for the
    /// first one's fetch instead of fetching again.
    transfers: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for SharedLayers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLayers")
            .field("store", &self.blobs.location())
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

/// Where a layer's directory goes, and what is renamed into place to put it there.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Placement {
    /// The directory renamed into place: the layer itself, or the directory holding it.
    unit: PathBuf,
    /// The layer's directory relative to `unit` (empty when the unit is the layer).
    inside: PathBuf,
    /// A built-in root is complete once this file exists in its unit.
    marker: Option<&'static str>,
}

fn placement(layers: &LayerStore, layer: &str) -> Option<Placement> {
    let path = layers.path(layer)?;
    let kind = layer.split_once('/')?.0;
    match kind {
        "image" | "checkpoint" => Some(Placement {
            unit: path,
            inside: PathBuf::new(),
            marker: None,
        }),
        kind if kind == "layer" || BUILT_IN_ROOTS.contains(&kind) => Some(Placement {
            unit: path.parent()?.to_owned(),
            inside: PathBuf::from(path.file_name()?),
            marker: BUILT_IN_ROOTS.contains(&kind).then_some("complete"),
        }),
        _ => None,
    }
}

fn staging_name() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{STAGING_PREFIX}{}-{n}", std::process::id())
}

impl SharedLayers {
    pub fn new(
        blobs: BlobStore,
        records: Arc<dyn LayerBlobRecords>,
        layers: LayerStore,
        node_id: String,
    ) -> Self {
        Self {
            blobs,
            records,
            layers,
            node_id,
            transfers: Mutex::new(HashMap::new()),
        }
    }

    /// Removes what transfers a previous run of the node left half done.
    pub fn sweep_staging(&self) {
        for parent in self.layers.dirs() {
            let Ok(entries) = std::fs::read_dir(parent) else {
                continue;
            };
            for entry in entries.flatten() {
                if !entry
                    .file_name()
                    .to_string_lossy()
                    .starts_with(STAGING_PREFIX)
                {
                    continue;
                }
                let path = entry.path();
                let removed = if path.is_dir() {
                    crate::storage::disks::remove_tree(&path)
                } else {
                    std::fs::remove_file(&path)
                };
                if let Err(e) = removed {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a layer transfer's leftovers");
                }
            }
        }
    }

    pub fn location(&self) -> &str {
        self.blobs.location()
    }

    /// The digests of every blob the store keeps.
    pub async fn kept_blobs(&self) -> Result<Vec<String>, BlobStoreError> {
        self.blobs.kept().await
    }

    /// Stops keeping blob `digest`; whether it was kept.
    pub async fn let_go_of(&self, digest: &str) -> Result<bool, BlobStoreError> {
        self.blobs.let_go(digest).await
    }

    /// Keeps blob `digest` (of `size` bytes) again.
    pub async fn keep_blob(&self, digest: &str, size: u64) -> Result<(), BlobStoreError> {
        self.blobs.keep(digest, size).await
    }

    fn transfer_lock(&self, layer: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut transfers = self
            .transfers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        transfers.retain(|_, lock| Arc::strong_count(lock) > 1);
        Arc::clone(transfers.entry(layer.to_owned()).or_default())
    }

    /// Publishes those of `layers` (all on this node) that are not recorded yet.
    pub async fn publish(&self, layers: &[String]) -> Result<(), SharedLayerError> {
        let recorded = self.recorded(layers).await?;
        for layer in layers {
            if recorded.contains_key(layer) {
                continue;
            }
            let lock = self.transfer_lock(layer);
            let _held = lock.lock().await;
            if !self.recorded(std::slice::from_ref(layer)).await?.is_empty() {
                continue;
            }
            self.publish_one(layer).await?;
        }
        Ok(())
    }

    /// [`Self::publish`] for an image whose layers are all on this node; one that is not
    /// is left to the node that holds it.
    pub async fn ensure_published_if_here(
        &self,
        layers: &[String],
    ) -> Result<(), SharedLayerError> {
        if layers.iter().all(|l| self.layers.exists(l)) {
            self.publish(layers).await
        } else {
            Ok(())
        }
    }

    async fn recorded(
        &self,
        layers: &[String],
    ) -> Result<HashMap<String, LayerBlob>, SharedLayerError> {
        let found =
            self.records
                .layer_blobs(layers)
                .await
                .map_err(|source| SharedLayerError::Store {
                    layer: layers.join(", "),
                    source,
                })?;
        Ok(found.into_iter().map(|b| (b.layer.clone(), b)).collect())
    }

    async fn publish_one(&self, layer: &str) -> Result<(), SharedLayerError> {
        let bad = || SharedLayerError::BadName {
            layer: layer.to_owned(),
        };
        let place = placement(&self.layers, layer).ok_or_else(bad)?;
        let staging = place.unit.parent().ok_or_else(bad)?;
        let blob = self
            .archive_and_push(layer, &place.unit.join(&place.inside), None, staging)
            .await?;
        self.records
            .record_layer_blob(&blob)
            .await
            .map_err(|source| SharedLayerError::Store {
                layer: layer.to_owned(),
                source,
            })
    }

    /// Writes the directory `dir` as an archive in `staging`, pushes it and removes it;
    /// the record of what was pushed, for the caller to keep. `id_base`: the host id the
    /// files' owners start from, for a sandbox's writable layer.
    async fn archive_and_push(
        &self,
        layer: &str,
        dir: &Path,
        id_base: Option<u32>,
        staging: &Path,
    ) -> Result<LayerBlob, SharedLayerError> {
        let io = |source| SharedLayerError::Io {
            layer: layer.to_owned(),
            path: dir.to_owned(),
            source,
        };
        let archive = staging.join(format!("{}.tar", staging_name()));
        let started = Instant::now();
        let written = {
            let (archive, dir) = (archive.clone(), dir.to_owned());
            tokio::task::spawn_blocking(move || {
                let file = std::fs::File::create_new(&archive)?;
                match id_base {
                    None => crate::storage::layer_archive::write_layer(&dir, file),
                    Some(base) => {
                        crate::storage::layer_archive::write_sandbox_layer(&dir, file, base)
                    }
                }
            })
            .await
            .map_err(|e| io(std::io::Error::other(e)))?
        };
        let pushed = match written {
            Ok(archived) => self
                .blobs
                .push_file(&archive, &archived.digest)
                .await
                .map(|()| archived)
                .map_err(|source| SharedLayerError::Blob {
                    layer: layer.to_owned(),
                    source,
                }),
            Err(source) => Err(io(source)),
        };
        let _ = std::fs::remove_file(&archive);
        let archived = pushed?;
        tracing::info!(
            %layer,
            digest = %archived.digest,
            bytes = archived.size,
            ms = started.elapsed().as_millis() as u64,
            "published to the layer store"
        );
        Ok(LayerBlob {
            layer: layer.to_owned(),
            digest: archived.digest,
            size_bytes: archived.size,
            node_id: self.node_id.clone(),
            published_at: Utc::now(),
        })
    }

    /// Downloads `blob` into an archive in `staging` and unpacks it with `unpack`; the
    /// archive is removed whatever happens.
    async fn download_and_unpack<T: Send + 'static>(
        &self,
        blob: &LayerBlob,
        staging: &Path,
        unpack: impl FnOnce(&Path) -> T + Send + 'static,
    ) -> Result<T, SharedLayerError> {
        let archive = staging.join(format!("{}.tar", staging_name()));
        self.blobs
            .fetch_to(&blob.digest, blob.size_bytes, &archive)
            .await
            .map_err(|source| SharedLayerError::Blob {
                layer: blob.layer.clone(),
                source,
            })?;
        let unpacked = {
            let archive = archive.clone();
            tokio::task::spawn_blocking(move || unpack(&archive)).await
        };
        let _ = std::fs::remove_file(&archive);
        unpacked.map_err(|e| SharedLayerError::Io {
            layer: blob.layer.clone(),
            path: archive,
            source: std::io::Error::other(e),
        })
    }

    /// Fetches those of `layers` this node lacks. Fails, naming the layer, when one is
    /// neither here nor published.
    pub async fn ensure(&self, layers: &[String]) -> Result<(), SharedLayerError> {
        let missing: Vec<String> = layers
            .iter()
            .filter(|l| !self.layers.exists(l))
            .cloned()
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let recorded = self.recorded(&missing).await?;
        for layer in &missing {
            let blob = recorded
                .get(layer)
                .ok_or_else(|| SharedLayerError::NotPublished {
                    layer: layer.clone(),
                })?;
            let lock = self.transfer_lock(layer);
            let _held = lock.lock().await;
            if self.layers.exists(layer) {
                continue;
            }
            self.fetch_one(blob).await?;
        }
        Ok(())
    }

    /// Copies a paused sandbox's writable layer (`upper`, owned from host id `id_base` on)
    /// to the store; the record it returns is the caller's to keep.
    pub async fn share_sandbox_files(
        &self,
        sandbox_id: &str,
        upper: &Path,
        id_base: u32,
    ) -> Result<LayerBlob, SharedLayerError> {
        self.archive_and_push(
            &LayerBlob::sandbox_files(sandbox_id),
            upper,
            Some(id_base),
            self.layers.steps_dir(),
        )
        .await
    }

    /// Copies the checkpoint of a sandbox's processes (the directory `images`, owned by the
    /// host) to the store; the record it returns is the caller's to keep.
    pub async fn share_sandbox_checkpoint(
        &self,
        sandbox_id: &str,
        images: &Path,
    ) -> Result<LayerBlob, SharedLayerError> {
        self.archive_and_push(
            &LayerBlob::sandbox_checkpoint(sandbox_id),
            images,
            None,
            self.layers.steps_dir(),
        )
        .await
    }

    /// Unpacks a sandbox's shared files (or checkpoint) into `upper`, an empty directory,
    /// with the owners they have inside the sandbox (or on the host).
    pub async fn fetch_sandbox_files(
        &self,
        files: &LayerBlob,
        upper: &Path,
    ) -> Result<(), SharedLayerError> {
        let dest = upper.to_owned();
        self.download_and_unpack(files, self.layers.steps_dir(), move |archive| {
            let file = std::fs::File::open(archive)
                .map_err(|e| UnpackFailure::Io(archive.to_owned(), e))?;
            sandbar_image::apply_layer(std::io::BufReader::with_capacity(1 << 20, file), &dest)
                .map(|_| ())
                .map_err(UnpackFailure::Unpack)
        })
        .await?
        .map_err(|failure| failure.for_layer(&files.layer))
    }

    async fn fetch_one(&self, blob: &LayerBlob) -> Result<(), SharedLayerError> {
        let layer = blob.layer.as_str();
        let bad = || SharedLayerError::BadName {
            layer: layer.to_owned(),
        };
        let place = placement(&self.layers, layer).ok_or_else(bad)?;
        let parent = place.unit.parent().ok_or_else(bad)?.to_owned();
        std::fs::create_dir_all(&parent).map_err(|source| SharedLayerError::Io {
            layer: layer.to_owned(),
            path: parent.clone(),
            source,
        })?;
        let started = Instant::now();
        let staged = parent.join(staging_name());
        let placed = {
            let (into, place) = (staged.clone(), place.clone());
            self.download_and_unpack(blob, &parent, move |archive| {
                unpack_into(archive, &into, &place)?;
                std::fs::rename(&into, &place.unit)
                    .map_err(|e| UnpackFailure::Io(place.unit.clone(), e))
            })
            .await?
        };
        if let Err(failure) = placed {
            let _ = crate::storage::disks::remove_tree(&staged);
            return Err(failure.for_layer(layer));
        }
        tracing::info!(
            %layer,
            digest = %blob.digest,
            bytes = blob.size_bytes,
            ms = started.elapsed().as_millis() as u64,
            "fetched a layer from the layer store"
        );
        Ok(())
    }
}

enum UnpackFailure {
    Io(PathBuf, std::io::Error),
    Unpack(sandbar_image::UnpackError),
}

impl UnpackFailure {
    fn for_layer(self, layer: &str) -> SharedLayerError {
        match self {
            UnpackFailure::Io(path, source) => SharedLayerError::Io {
                layer: layer.to_owned(),
                path,
                source,
            },
            UnpackFailure::Unpack(source) => SharedLayerError::Unpack {
                layer: layer.to_owned(),
                source,
            },
        }
    }
}

/// Unpacks `archive` as a layer into `staged`, laid out like the unit it becomes.
fn unpack_into(archive: &Path, staged: &Path, place: &Placement) -> Result<(), UnpackFailure> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |e| UnpackFailure::Io(path, e)
    };
    std::fs::create_dir(staged).map_err(io(staged))?;
    let dest = staged.join(&place.inside);
    if dest != staged {
        std::fs::create_dir(&dest).map_err(io(&dest))?;
    }
    let file = std::fs::File::open(archive).map_err(io(archive))?;
    sandbar_image::apply_layer(std::io::BufReader::with_capacity(1 << 20, file), &dest)
        .map_err(UnpackFailure::Unpack)?;
    if let Some(marker) = place.marker {
        std::fs::write(staged.join(marker), b"").map_err(io(&staged.join(marker)))?;
    }
    // On disk before it is renamed into place: a crash must not leave a layer whose files
    // are empty under a name every later create trusts.
    let dir = std::fs::File::open(staged).map_err(io(staged))?;
    rustix::fs::syncfs(&dir).map_err(|e| UnpackFailure::Io(staged.to_owned(), e.into()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_layer_lands_where_its_name_says() {
        let layers = LayerStore::new("/d/templates".into(), "/d/images".into(), "/d/steps".into());
        assert_eq!(
            placement(&layers, "layer/abc1"),
            Some(Placement {
                unit: "/d/steps/abc1".into(),
                inside: "upper".into(),
                marker: None,
            })
        );
        assert_eq!(
            placement(&layers, "image/ff00"),
            Some(Placement {
                unit: "/d/images/ff00".into(),
                inside: PathBuf::new(),
                marker: None,
            })
        );
        assert_eq!(
            placement(&layers, "base/v2"),
            Some(Placement {
                unit: "/d/templates/base-v2".into(),
                inside: "rootfs".into(),
                marker: Some("complete"),
            })
        );
        for bad in ["layer/../x", "image/", "other/ab", "base/x", "layer"] {
            assert_eq!(placement(&layers, bad), None, "{bad}");
        }
    }
}
