//! Pulling images from OCI and Docker registries into a content-addressed layer cache.
//!
//! Layout under the cache root:
//! - `blobs/sha256/<hex>`: image configs (layer blobs only pass through here while they are
//!   downloaded and unpacked, since the unpacked layer is what is kept);
//! - `layers/<hex of the diff id>/`: unpacked layers, ready to be overlayfs lower layers.
//!
//! Both directories are private to root: unpacked layers hold setuid binaries of whatever
//! image was pulled, which no other user of the host may reach.
//!
//! Everything in the cache is complete once its name exists: layers are unpacked into
//! `layers/.tmp-<random>` and renamed into place only after their digest is verified, so
//! concurrent pulls of one layer (in this process or another) at worst do the work twice, and
//! a crash leaves only `.tmp-*` names, removed by [`ImageCache::new`].

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use oci_client::Reference;
use oci_client::manifest::{
    IMAGE_MANIFEST_LIST_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_INDEX_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE,
};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;
use url::Url;

pub use crate::distribution::RegistryAuth;
use crate::distribution::Session;
pub use crate::pull_error::PullError;
use crate::registry_address::{Destination, RegistryPolicy, RegistryRefused, ResolveError};

use crate::unpack::{ByteBudget, UnpackError, UnpackStats, apply_layer_within};

const MANIFEST_TYPES: [&str; 4] = [
    OCI_IMAGE_INDEX_MEDIA_TYPE,
    IMAGE_MANIFEST_LIST_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE,
    IMAGE_MANIFEST_MEDIA_TYPE,
];
const CONFIG_TYPES: [&str; 2] = [
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
];
/// The compression is read from the blob itself, so one list covers gzip, zstd and plain tar.
const LAYER_TYPES: [&str; 10] = [
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
];
/// Image configs are a few kilobytes; the cap keeps a hostile registry from filling memory.
const MAX_CONFIG_BYTES: u64 = 16 << 20;
const PARALLEL_LAYERS: usize = 3;
const STAGING_PREFIX: &str = ".tmp-";

/// What an image asks for at run time, from its config.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    pub env: Vec<(String, String)>,
    pub user: Option<String>,
    pub workdir: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledLayer {
    /// `sha256:<hex>` of the uncompressed layer tar.
    pub diff_id: String,
    /// The directory holding the unpacked layer.
    pub path: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledImage {
    /// The normalised reference, e.g. `docker.io/library/python:3.12`.
    pub reference: String,
    /// Digest of the platform-specific image manifest (not of the index that led to it).
    pub manifest_digest: String,
    /// Bottom (first applied) first.
    pub layers: Vec<PulledLayer>,
    pub config: ImageConfig,
}

/// A content-addressed cache of unpacked image layers, shared by every pull.
///
/// One `ImageCache` per root: creating one removes the staging directories that pulls in
/// progress would be using.
#[derive(Debug)]
pub struct ImageCache {
    root: PathBuf,
    /// Unpacked layers; `root/layers` unless the owner keeps them elsewhere.
    layers: PathBuf,
    /// Which registries may be contacted, and which over plain HTTP.
    policy: Arc<RegistryPolicy>,
    /// One lock per layer being fetched, so concurrent pulls of one image download it once.
    inflight: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl ImageCache {
    /// `root` is a directory the cache owns: blobs in `root/blobs/sha256/<hex>`, unpacked
    /// layers in `root/layers/<hex-of-diff-id>/`.
    ///
    /// `policy` decides which registries may be contacted (every connection of a pull is
    /// checked) and which are reached over plain HTTP.
    pub fn new(root: PathBuf, policy: Arc<RegistryPolicy>) -> Self {
        let layers = root.join("layers");
        Self::with_layers_dir(root, layers, policy)
    }

    /// [`ImageCache::new`] with the unpacked layers in `layers` (which must be on one
    /// filesystem with its own staging directories, and may be another than `root`'s).
    pub fn with_layers_dir(root: PathBuf, layers: PathBuf, policy: Arc<RegistryPolicy>) -> Self {
        let cache = Self {
            root,
            layers,
            policy,
            inflight: Mutex::new(HashMap::new()),
        };
        cache.remove_stale_staging();
        cache
    }

    /// Where unpacked layers live, one directory per diff id, for garbage collection by the
    /// caller. Names starting with `.tmp-` are pulls in progress.
    pub fn layers_dir(&self) -> PathBuf {
        self.layers.clone()
    }

    fn blobs_dir(&self) -> PathBuf {
        self.root.join("blobs").join("sha256")
    }

    /// Pulls `reference` (Docker Hub by default: `python:3.12` is
    /// `docker.io/library/python:3.12`; `host:port/repo:tag`; `repo@sha256:…`) for linux and
    /// the host's architecture, verifying every digest. Layers already unpacked are reused.
    /// `progress` gets one human-readable line per notable event.
    pub async fn pull(
        &self,
        reference: &str,
        auth: Option<&RegistryAuth>,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<PulledImage, PullError> {
        self.pull_for("", reference, auth, progress, MAX_LAYER_BYTES)
            .await
    }

    /// [`ImageCache::pull`] on behalf of `owner` (a tenant): a layer another owner unpacked
    /// is reused only after this owner downloaded its blob and it decompressed to the same
    /// diff id. Knowing a private layer's digests is then not enough to get its contents.
    ///
    /// `limit` bounds, in bytes, what the pull may write: the layers it unpacks together
    /// (file content in whole blocks plus a charge per entry), and each blob it downloads
    /// or decompresses. Layers already unpacked cost nothing.
    pub async fn pull_for(
        &self,
        owner: &str,
        reference: &str,
        auth: Option<&RegistryAuth>,
        progress: &(dyn Fn(String) + Send + Sync),
        limit: u64,
    ) -> Result<PulledImage, PullError> {
        let image = parse_reference(reference)?;
        let name = image.whole();
        self.prepare_dirs()?;
        // A session per pull: credentials and tokens must not carry over to another caller's
        // pull.
        let registry = Session::new(
            Arc::clone(&self.policy),
            &registry_url(&image, &self.policy)?,
            image.repository(),
            &name,
            auth,
        )?;
        let (arch, variant) = host_platform();

        progress(format!("resolving {name}"));
        let resolved = resolve_manifest(&registry, &image, &name, (arch, variant)).await?;
        check_media_types(&resolved.config, &resolved.layers, &name)?;
        let config = self
            .platform_config(&registry, &resolved.config, &name, arch)
            .await?;
        let diff_ids = config
            .rootfs
            .as_ref()
            .map(|r| r.diff_ids.clone())
            .unwrap_or_default();
        if diff_ids.len() != resolved.layers.len() {
            return Err(PullError::Registry {
                reference: name,
                message: format!(
                    "the config lists {} layers but the manifest {}",
                    diff_ids.len(),
                    resolved.layers.len()
                ),
            });
        }
        let budget = ByteBudget::new(limit);
        let pulled = self
            .fetch_layers(
                &registry,
                &resolved.layers,
                &diff_ids,
                (&name, owner),
                progress,
                &budget,
            )
            .await?;

        progress(format!("pulled {name} ({})", short(&resolved.digest)));
        Ok(PulledImage {
            reference: name,
            manifest_digest: resolved.digest,
            layers: pulled,
            config: image_config(config.config.unwrap_or_default()),
        })
    }

    /// Reads the image's config blob, refusing an image built for another platform than the
    /// host's.
    async fn platform_config(
        &self,
        registry: &Session,
        descriptor: &Descriptor,
        name: &str,
        arch: &str,
    ) -> Result<ConfigDoc, PullError> {
        let config_bytes = self.config_blob(registry, descriptor, name).await?;
        let config: ConfigDoc =
            serde_json::from_slice(&config_bytes).map_err(|e| PullError::Registry {
                reference: name.to_owned(),
                message: format!("invalid image config: {e}"),
            })?;
        if (!config.os.is_empty() && config.os != "linux")
            || (!config.architecture.is_empty() && config.architecture != arch)
        {
            return Err(PullError::NoPlatform {
                reference: name.to_owned(),
                platform: format!(
                    "linux/{arch} (the image is {}/{})",
                    config.os, config.architecture
                ),
            });
        }
        Ok(config)
    }

    /// Downloads and unpacks the layers, [`PARALLEL_LAYERS`] at a time, in the manifest's
    /// order.
    async fn fetch_layers(
        &self,
        registry: &Session,
        layers: &[Descriptor],
        diff_ids: &[String],
        (name, owner): (&str, &str),
        progress: &(dyn Fn(String) + Send + Sync),
        budget: &ByteBudget,
    ) -> Result<Vec<PulledLayer>, PullError> {
        // Collected before awaiting: a lazy `map` closure held across the await would make
        // this future lose `Send`.
        let tasks: Vec<_> = layers
            .iter()
            .zip(diff_ids)
            .map(|(layer, diff_id)| {
                self.layer(registry, layer, diff_id, (name, owner), progress, budget)
            })
            .collect();
        // After a failure no further layer is started, but the ones under way are awaited:
        // a dropped download would leave its unpacking thread writing after the pull answered.
        let mut pulled: Vec<PulledLayer> = Vec::new();
        let mut first_error = None;
        let mut waiting = tasks.into_iter();
        let mut running = futures_util::stream::FuturesOrdered::new();
        for task in waiting.by_ref().take(PARALLEL_LAYERS) {
            running.push_back(task);
        }
        while let Some(result) = running.next().await {
            match result {
                Ok(layer) => pulled.push(layer),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
            if first_error.is_none()
                && let Some(task) = waiting.next()
            {
                running.push_back(task);
            }
        }
        drop((running, waiting));
        match first_error {
            Some(e) => Err(e),
            None => Ok(pulled),
        }
    }

    fn prepare_dirs(&self) -> Result<(), PullError> {
        for dir in [self.layers_dir(), self.blobs_dir()] {
            std::fs::create_dir_all(&dir).map_err(io_at(&dir))?;
        }
        for dir in [self.layers_dir(), self.root.join("blobs")] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                .map_err(io_at(&dir))?;
        }
        Ok(())
    }

    fn remove_stale_staging(&self) {
        for dir in [self.layers_dir(), self.blobs_dir()] {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                if !entry
                    .file_name()
                    .as_bytes()
                    .starts_with(STAGING_PREFIX.as_bytes())
                {
                    continue;
                }
                let path = entry.path();
                let removed = match entry.file_type() {
                    Ok(kind) if kind.is_dir() => std::fs::remove_dir_all(&path),
                    _ => std::fs::remove_file(&path),
                };
                match removed {
                    Ok(()) => tracing::info!(path = %path.display(), "removed an interrupted pull"),
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "cannot remove an interrupted pull");
                    }
                }
            }
        }
    }

    async fn config_blob(
        &self,
        registry: &Session,
        descriptor: &Descriptor,
        name: &str,
    ) -> Result<Vec<u8>, PullError> {
        let hex = checked_hex(&descriptor.digest, name)?;
        let path = self.blobs_dir().join(hex);
        if let Ok(cached) = tokio::fs::read(&path).await
            && sha256_digest(&cached) == descriptor.digest
        {
            return Ok(cached);
        }

        let limit = descriptor
            .size
            .map_or(MAX_CONFIG_BYTES, |s| s.min(MAX_CONFIG_BYTES));
        let mut response = registry.blob(&descriptor.digest).await?;
        let mut data = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| registry.stream_error(&e))?
        {
            if data.len() as u64 + chunk.len() as u64 > limit {
                return Err(PullError::Registry {
                    reference: name.to_owned(),
                    message: format!("image config larger than {limit} bytes"),
                });
            }
            data.extend_from_slice(&chunk);
        }
        let actual = sha256_digest(&data);
        if actual != descriptor.digest {
            return Err(PullError::DigestMismatch {
                expected: descriptor.digest.clone(),
                actual,
            });
        }

        let tmp = TempPath(self.blobs_dir().join(staging_name()));
        tokio::fs::write(&tmp.0, &data)
            .await
            .map_err(io_at(&tmp.0))?;
        tokio::fs::rename(&tmp.0, &path)
            .await
            .map_err(io_at(&path))?;
        Ok(data)
    }

    #[allow(clippy::too_many_arguments)]
    async fn layer(
        &self,
        registry: &Session,
        descriptor: &Descriptor,
        diff_id: &str,
        (name, owner): (&str, &str),
        progress: &(dyn Fn(String) + Send + Sync),
        budget: &ByteBudget,
    ) -> Result<PulledLayer, PullError> {
        let Some(diff_hex) = sha256_hex(diff_id) else {
            return Err(PullError::Unsupported {
                reference: name.to_owned(),
                what: format!("layer diff id `{diff_id}`"),
            });
        };
        let path = self.layers_dir().join(diff_hex);
        let slot = self.inflight_slot(diff_hex);
        let _held = Arc::clone(&slot.lock).lock_owned().await;

        let proof = self.owner_proof(owner, diff_hex);
        let unpacked = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
        if unpacked && proof.as_ref().is_none_or(|p| p.exists()) {
            progress(format!("layer {} cached", short(diff_id)));
            return Ok(PulledLayer {
                diff_id: diff_id.to_owned(),
                path,
            });
        }
        // A cached layer is downloaded again only for its owner to prove access to it.
        if unpacked {
            progress(format!(
                "verifying access to cached layer {}",
                short(diff_id)
            ));
        } else {
            progress(format!(
                "pulling layer {} ({})",
                short(diff_id),
                descriptor
                    .size
                    .map_or_else(|| "size unknown".to_owned(), human_size)
            ));
        }
        let blob = self
            .download(registry, descriptor, name, budget.limit())
            .await?;
        let blob_path = blob.0.clone();
        let layers_dir = self.layers_dir();
        let expected = diff_hex.to_owned();
        let budget = budget.clone();
        let unpacked_stats = tokio::task::spawn_blocking(move || {
            if unpacked {
                verify_diff_id(&blob_path, &expected, budget.limit()).map(|()| None)
            } else {
                unpack_blob(&blob_path, &layers_dir, &expected, &budget).map(Some)
            }
        })
        .await
        .map_err(|e| PullError::Io {
            path: path.clone(),
            source: io::Error::other(e),
        })??;
        drop(blob);
        self.record_proof(proof.as_deref())?;
        if let Some(stats) = unpacked_stats {
            progress(format!(
                "layer {} unpacked ({} files, {})",
                short(diff_id),
                stats.files,
                human_size(stats.bytes)
            ));
        }
        Ok(PulledLayer {
            diff_id: diff_id.to_owned(),
            path,
        })
    }

    /// Where the cache records that `owner` proved it can download the layer; `None` for
    /// the shared owner, who trusts every cached layer.
    fn owner_proof(&self, owner: &str, diff_hex: &str) -> Option<PathBuf> {
        (!owner.is_empty()).then(|| {
            let owner_dir = hex::encode(Sha256::digest(owner.as_bytes()));
            self.root.join("owners").join(owner_dir).join(diff_hex)
        })
    }

    fn record_proof(&self, proof: Option<&Path>) -> Result<(), PullError> {
        let Some(proof) = proof else { return Ok(()) };
        if let Some(dir) = proof.parent() {
            std::fs::create_dir_all(dir).map_err(io_at(dir))?;
        }
        std::fs::write(proof, b"").map_err(io_at(proof))
    }

    fn inflight_slot(&self, key: &str) -> InflightSlot<'_> {
        let mut map = self.inflight.lock().unwrap_or_else(PoisonError::into_inner);
        let lock = Arc::clone(map.entry(key.to_owned()).or_default());
        InflightSlot {
            map: &self.inflight,
            key: key.to_owned(),
            lock,
        }
    }

    /// Downloads a layer blob to a temporary file, checking its size (at most `limit`) and
    /// digest.
    async fn download(
        &self,
        registry: &Session,
        descriptor: &Descriptor,
        name: &str,
        limit: u64,
    ) -> Result<TempPath, PullError> {
        let tmp = TempPath(self.blobs_dir().join(staging_name()));
        let mut file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp.0)
            .await
            .map_err(io_at(&tmp.0))?;
        // Only the digest is handed over: a descriptor's `urls` would make the server fetch
        // from wherever the manifest's author likes.
        let mut response = registry.blob(&descriptor.digest).await?;
        let mut hasher = Sha256::new();
        let mut total = 0u64;
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| registry.stream_error(&e))?
        {
            total += chunk.len() as u64;
            if descriptor.size.is_some_and(|size| total > size) {
                return Err(PullError::Registry {
                    reference: name.to_owned(),
                    message: format!(
                        "blob {} is larger than its manifest says",
                        descriptor.digest
                    ),
                });
            }
            if total > limit {
                return Err(PullError::Registry {
                    reference: name.to_owned(),
                    message: format!(
                        "blob {} is larger than the limit of {limit} bytes",
                        descriptor.digest
                    ),
                });
            }
            hasher.update(&chunk);
            file.write_all(&chunk).await.map_err(io_at(&tmp.0))?;
        }
        file.flush().await.map_err(io_at(&tmp.0))?;
        let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
        if actual != descriptor.digest {
            return Err(PullError::DigestMismatch {
                expected: descriptor.digest.clone(),
                actual,
            });
        }
        Ok(tmp)
    }
}

/// Holds this pull's reference to a layer's lock; the map entry goes when nobody else does.
struct InflightSlot<'a> {
    map: &'a Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    key: String,
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl Drop for InflightSlot<'_> {
    fn drop(&mut self) {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        // The map's reference and ours: no other pull waits for this layer. Clones are only
        // made under the map's lock, so the count cannot grow meanwhile.
        if Arc::strong_count(&self.lock) <= 2 {
            map.remove(&self.key);
        }
    }
}

/// A file removed when dropped.
struct TempPath(PathBuf);

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A staging directory removed (with its contents) when dropped, unless kept.
struct Staging {
    path: PathBuf,
    keep: bool,
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.keep
            && let Err(e) = std::fs::remove_dir_all(&self.path)
        {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot remove a staging directory");
        }
    }
}

/// What [`ImageCache::pull`], which has no caller's limit, lets one pull write.
pub const MAX_LAYER_BYTES: u64 = 32 << 30;

/// The uncompressed tar stream of `blob`, failing once it grows past `limit` bytes: a small
/// compressed blob must not keep the unpacker busy for ever.
fn open_layer_stream(blob: &Path, limit: u64) -> Result<HashingReader<Box<dyn Read>>, PullError> {
    let file = File::open(blob).map_err(io_at(blob))?;
    let mut reader = BufReader::with_capacity(256 << 10, file);
    let magic = reader.fill_buf().map_err(io_at(blob))?;
    // Media types are not always honest about compression; the magic numbers are.
    let tar: Box<dyn Read> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::MultiGzDecoder::new(reader))
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Box::new(zstd::stream::read::Decoder::with_buffer(reader).map_err(io_at(blob))?)
    } else {
        Box::new(reader)
    };
    Ok(HashingReader {
        inner: Box::new(Capped {
            inner: tar,
            left: limit,
            limit,
        }),
        hasher: Sha256::new(),
    })
}

/// Fails reads past `limit` bytes instead of ending the stream, which would pass for a
/// truncated layer.
struct Capped<R> {
    inner: R,
    left: u64,
    limit: u64,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            // One byte more tells a stream of exactly `limit` bytes from a longer one.
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(io::Error::other(format!(
                    "the uncompressed layer is larger than the limit of {} bytes",
                    self.limit
                ))),
            };
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// Checks that `blob` decompresses to the layer `diff_hex` names.
fn verify_diff_id(blob: &Path, diff_hex: &str, limit: u64) -> Result<(), PullError> {
    check_layer_digest(open_layer_stream(blob, limit)?, diff_hex)
}

/// Reads what is left of `tar` and checks that the whole stream hashes to `diff_hex`.
fn check_layer_digest(
    mut tar: HashingReader<Box<dyn Read>>,
    diff_hex: &str,
) -> Result<(), PullError> {
    io::copy(&mut tar, &mut io::sink()).map_err(|e| PullError::Unpack(UnpackError::Tar(e)))?;
    let actual = hex::encode(tar.hasher.finalize());
    if actual != diff_hex {
        return Err(PullError::DigestMismatch {
            expected: format!("sha256:{diff_hex}"),
            actual: format!("sha256:{actual}"),
        });
    }
    Ok(())
}

/// Decompresses and unpacks a downloaded layer blob within `budget`, verifies the
/// uncompressed digest against the config's diff id and moves the result into place.
fn unpack_blob(
    blob: &Path,
    layers_dir: &Path,
    diff_hex: &str,
    budget: &ByteBudget,
) -> Result<UnpackStats, PullError> {
    let mut tar = open_layer_stream(blob, budget.limit())?;

    let staging = Staging {
        path: layers_dir.join(staging_name()),
        keep: false,
    };
    std::fs::create_dir(&staging.path).map_err(io_at(&staging.path))?;
    std::fs::set_permissions(&staging.path, std::fs::Permissions::from_mode(0o755))
        .map_err(io_at(&staging.path))?;
    let stats = apply_layer_within(&mut tar, &staging.path, budget).map_err(PullError::Unpack)?;
    // The digest covers the whole stream, including the padding after the end of the archive.
    check_layer_digest(tar, diff_hex)?;

    // The layer's name promises a complete layer, also after a power cut.
    let dir = File::open(&staging.path).map_err(io_at(&staging.path))?;
    rustix::fs::syncfs(&dir).map_err(|e| PullError::Io {
        path: staging.path.clone(),
        source: e.into(),
    })?;
    let target = layers_dir.join(diff_hex);
    let mut staging = staging;
    match std::fs::rename(&staging.path, &target) {
        Ok(()) => staging.keep = true,
        // Another pull finished the same layer first; ours is dropped.
        Err(_) if std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_dir()) => {}
        Err(e) => return Err(io_at(&target)(e)),
    }
    Ok(stats)
}

struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ManifestDoc {
    schema_version: Option<i64>,
    media_type: Option<String>,
    config: Option<Descriptor>,
    layers: Option<Vec<Descriptor>>,
    manifests: Option<Vec<IndexEntry>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    #[serde(default)]
    media_type: String,
    digest: String,
    /// Negative sizes are as good as none.
    #[serde(default, deserialize_with = "size")]
    size: Option<u64>,
}

fn size<'de, D: serde::Deserializer<'de>>(de: D) -> Result<Option<u64>, D::Error> {
    let size = Option::<i64>::deserialize(de)?;
    Ok(size.and_then(|s| u64::try_from(s).ok()))
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct IndexEntry {
    #[serde(default)]
    media_type: String,
    digest: String,
    platform: Option<Platform>,
}

#[derive(Debug, Clone, Deserialize)]
struct Platform {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
    variant: Option<String>,
}

#[derive(Debug)]
enum Manifest {
    Image {
        config: Descriptor,
        layers: Vec<Descriptor>,
    },
    Index(Vec<IndexEntry>),
}

#[derive(Debug, Default, Deserialize)]
struct ConfigDoc {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
    config: Option<RunConfig>,
    rootfs: Option<RootFs>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RunConfig {
    env: Option<Vec<String>>,
    user: Option<String>,
    working_dir: Option<String>,
    entrypoint: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

/// The image manifest a pull settled on.
struct ResolvedManifest {
    /// The digest of the image manifest itself (not of an index naming it).
    digest: String,
    config: Descriptor,
    layers: Vec<Descriptor>,
}

/// Fetches the manifest `image` names and, when it is an index, the host platform's entry
/// in it; every manifest's digest is checked against what named it.
async fn resolve_manifest(
    registry: &Session,
    image: &Reference,
    name: &str,
    (arch, variant): (&str, Option<&str>),
) -> Result<ResolvedManifest, PullError> {
    let top = image.digest().or(image.tag()).unwrap_or("latest");
    let body = registry.manifest(top, &MANIFEST_TYPES).await?;
    let top_digest = sha256_digest(&body);
    if let Some(expected) = image.digest()
        && expected != top_digest
    {
        return Err(PullError::DigestMismatch {
            expected: expected.to_owned(),
            actual: top_digest,
        });
    }
    let entries = match parse_manifest(&body, name)? {
        Manifest::Image { config, layers } => {
            return Ok(ResolvedManifest {
                digest: top_digest,
                config,
                layers,
            });
        }
        Manifest::Index(entries) => entries,
    };
    let entry = select_manifest(&entries, arch, variant).ok_or_else(|| PullError::NoPlatform {
        reference: name.to_owned(),
        platform: format!("linux/{arch}"),
    })?;
    checked_hex(&entry.digest, name)?;
    let body = registry.manifest(&entry.digest, &MANIFEST_TYPES).await?;
    let actual = sha256_digest(&body);
    if actual != entry.digest {
        return Err(PullError::DigestMismatch {
            expected: entry.digest.clone(),
            actual,
        });
    }
    match parse_manifest(&body, name)? {
        Manifest::Image { config, layers } => Ok(ResolvedManifest {
            digest: actual,
            config,
            layers,
        }),
        Manifest::Index(_) => Err(PullError::Unsupported {
            reference: name.to_owned(),
            what: "an image index nested in an image index".to_owned(),
        }),
    }
}

/// Refuses config and layer kinds the unpacker does not know, and digests other than
/// sha256, before anything is downloaded.
fn check_media_types(
    config: &Descriptor,
    layers: &[Descriptor],
    name: &str,
) -> Result<(), PullError> {
    if !CONFIG_TYPES.contains(&config.media_type.as_str()) {
        return Err(PullError::Unsupported {
            reference: name.to_owned(),
            what: format!("config media type `{}`", config.media_type),
        });
    }
    for layer in layers {
        if !LAYER_TYPES.contains(&layer.media_type.as_str()) {
            return Err(PullError::Unsupported {
                reference: name.to_owned(),
                what: format!("layer media type `{}`", layer.media_type),
            });
        }
        checked_hex(&layer.digest, name)?;
    }
    Ok(())
}

fn parse_manifest(body: &[u8], name: &str) -> Result<Manifest, PullError> {
    let doc: ManifestDoc = serde_json::from_slice(body).map_err(|e| PullError::Registry {
        reference: name.to_owned(),
        message: format!("invalid manifest: {e}"),
    })?;
    if doc.schema_version != Some(2) {
        return Err(PullError::Unsupported {
            reference: name.to_owned(),
            what: format!(
                "manifest schema version {}",
                doc.schema_version
                    .map_or_else(|| "(none)".to_owned(), |v| v.to_string())
            ),
        });
    }
    let is_index = match doc.media_type.as_deref() {
        Some(OCI_IMAGE_INDEX_MEDIA_TYPE | IMAGE_MANIFEST_LIST_MEDIA_TYPE) => true,
        Some(OCI_IMAGE_MEDIA_TYPE | IMAGE_MANIFEST_MEDIA_TYPE) => false,
        Some(other) => {
            return Err(PullError::Unsupported {
                reference: name.to_owned(),
                what: format!("manifest media type `{other}`"),
            });
        }
        // The OCI spec makes the field optional; the shape tells.
        None => doc.manifests.is_some(),
    };
    let malformed = |what: &str| PullError::Registry {
        reference: name.to_owned(),
        message: format!("invalid manifest: {what}"),
    };
    if is_index {
        let entries = doc
            .manifests
            .ok_or_else(|| malformed("an index without manifests"))?;
        Ok(Manifest::Index(entries))
    } else {
        let config = doc
            .config
            .ok_or_else(|| malformed("a manifest without a config"))?;
        Ok(Manifest::Image {
            config,
            layers: doc.layers.unwrap_or_default(),
        })
    }
}

/// The OCI name of the host's architecture and its preferred variant.
fn host_platform() -> (&'static str, Option<&'static str>) {
    match std::env::consts::ARCH {
        "x86_64" => ("amd64", None),
        "aarch64" => ("arm64", Some("v8")),
        "arm" => ("arm", Some("v7")),
        "x86" => ("386", None),
        "powerpc64" if cfg!(target_endian = "little") => ("ppc64le", None),
        "loongarch64" => ("loong64", None),
        other => (other, None),
    }
}

/// Picks the linux manifest for `arch` from an index: the exact variant first, then one
/// without a variant, then any other variant.
fn select_manifest<'a>(
    entries: &'a [IndexEntry],
    arch: &str,
    variant: Option<&str>,
) -> Option<&'a IndexEntry> {
    entries
        .iter()
        .filter(|entry| {
            !matches!(
                entry.media_type.as_str(),
                OCI_IMAGE_INDEX_MEDIA_TYPE | IMAGE_MANIFEST_LIST_MEDIA_TYPE
            )
        })
        .filter_map(|entry| {
            let platform = entry.platform.as_ref()?;
            if platform.os != "linux" || platform.architecture != arch {
                return None;
            }
            // amd64's baseline is spelled either way.
            let got = platform
                .variant
                .as_deref()
                .filter(|v| !v.is_empty() && *v != "v1");
            let rank = if got == variant {
                0
            } else if got.is_none() {
                1
            } else {
                2
            };
            Some((rank, entry))
        })
        .min_by_key(|(rank, _)| *rank)
        .map(|(_, entry)| entry)
}

fn image_config(run: RunConfig) -> ImageConfig {
    ImageConfig {
        env: run
            .env
            .unwrap_or_default()
            .into_iter()
            .map(|pair| match pair.split_once('=') {
                Some((key, value)) => (key.to_owned(), value.to_owned()),
                None => (pair, String::new()),
            })
            .collect(),
        user: run.user.filter(|u| !u.is_empty()),
        workdir: run.working_dir.filter(|w| !w.is_empty()),
        entrypoint: run.entrypoint.unwrap_or_default(),
        cmd: run.cmd.unwrap_or_default(),
    }
}

pub(crate) fn parse_reference(reference: &str) -> Result<Reference, PullError> {
    let bad = |reason: String| PullError::BadReference {
        reference: reference.to_owned(),
        reason,
    };
    let trimmed = reference.trim();
    if trimmed.is_empty() {
        return Err(bad("empty".to_owned()));
    }
    let parsed = Reference::try_from(trimmed).map_err(|e| bad(e.to_string()))?;
    if parsed.repository().bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(bad("repository names must be lowercase".to_owned()));
    }
    if let Some(digest) = parsed.digest()
        && sha256_hex(digest).is_none()
    {
        return Err(bad(format!(
            "only sha256 digests are supported, not `{digest}`"
        )));
    }
    Ok(parsed)
}

/// The registry (`host` or `host:port`) an image reference is pulled from.
pub fn registry_of(reference: &str) -> Result<String, PullError> {
    Ok(parse_reference(reference)?.resolve_registry().to_owned())
}

/// `<scheme>://<registry>/` of an image.
pub(crate) fn registry_url(image: &Reference, policy: &RegistryPolicy) -> Result<Url, PullError> {
    let registry = image.resolve_registry();
    let scheme = if is_plain_http(image.registry(), policy.plain_http_hosts()) {
        "http"
    } else {
        "https"
    };
    Url::parse(&format!("{scheme}://{registry}/")).map_err(|e| PullError::BadReference {
        reference: image.whole(),
        reason: format!("registry `{registry}` is not a host: {e}"),
    })
}

/// A name lookup made only to answer a build request early; the pull checks again anyway.
const EARLY_LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

impl RegistryPolicy {
    /// Whether the registry of an image reference may be contacted, decided before a build is
    /// queued so the caller learns it at once. References that do not parse and names that do
    /// not resolve (soon) pass: the pull reports those, and checks every connection again.
    pub async fn check_reference(&self, reference: &str) -> Result<(), RegistryRefused> {
        let Ok(image) = parse_reference(reference) else {
            return Ok(());
        };
        let Some(destination) = registry_url(&image, self)
            .ok()
            .as_ref()
            .and_then(Destination::of)
        else {
            return Ok(());
        };
        if let Some(address) = destination.literal {
            return self.check(&destination.host, destination.port, address);
        }
        match tokio::time::timeout(
            EARLY_LOOKUP_TIMEOUT,
            self.resolve(&destination.host, destination.port),
        )
        .await
        {
            Ok(Err(ResolveError::Refused(refused))) => Err(refused),
            _ => Ok(()),
        }
    }
}

/// Whether a registry (`host` or `host:port`) is reached over plain HTTP.
pub(crate) fn is_plain_http(registry: &str, plain_http_hosts: &[String]) -> bool {
    let host = host_of(registry);
    if matches!(host, "localhost" | "127.0.0.1" | "[::1]") {
        return true;
    }
    plain_http_hosts.iter().map(|h| h.trim()).any(|listed| {
        listed.eq_ignore_ascii_case(registry)
            || (host_of(listed) == listed && listed.eq_ignore_ascii_case(host))
    })
}

fn host_of(registry: &str) -> &str {
    if registry.starts_with('[')
        && let Some(end) = registry.find(']')
    {
        return &registry[..=end];
    }
    match registry.rsplit_once(':') {
        Some((host, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => registry,
    }
}

/// The hex part of a well-formed `sha256:` digest. Digests become file names, so nothing
/// else may pass.
fn sha256_hex(digest: &str) -> Option<&str> {
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then_some(hex)
}

fn checked_hex<'a>(digest: &'a str, name: &str) -> Result<&'a str, PullError> {
    sha256_hex(digest).ok_or_else(|| PullError::Unsupported {
        reference: name.to_owned(),
        what: format!("digest `{digest}` (only sha256 is supported)"),
    })
}

fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

fn staging_name() -> String {
    format!("{STAGING_PREFIX}{:016x}", rand::random::<u64>())
}

/// `sha256:0123456789ab…`
fn short(digest: &str) -> String {
    match digest.get(..19) {
        Some(prefix) if digest.len() > 19 => format!("{prefix}…"),
        _ => digest.to_owned(),
    }
}

fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> PullError + '_ {
    move |source| PullError::Io {
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::io::Write as _;
    use std::sync::atomic::Ordering;

    use crate::registry_address::RefusedRange;
    use crate::test_server::fixed_server;

    /// A policy allowing the given registries (plain HTTP on loopback needs no listing).
    fn allowing(registries: &[&str]) -> Arc<RegistryPolicy> {
        let allowed = registries.iter().map(|r| r.parse().unwrap()).collect();
        Arc::new(RegistryPolicy::new(allowed, vec![], vec![]).unwrap())
    }

    fn normalised(reference: &str) -> String {
        parse_reference(reference).unwrap().whole()
    }

    #[test]
    fn references_default_to_docker_hub_library() {
        assert_eq!(normalised("python:3.12"), "docker.io/library/python:3.12");
        assert_eq!(normalised("ubuntu"), "docker.io/library/ubuntu:latest");
        assert_eq!(normalised("  alpine:3  "), "docker.io/library/alpine:3");
        assert_eq!(normalised("bitnami/redis:7"), "docker.io/bitnami/redis:7");
        assert_eq!(
            normalised("docker.io/library/busybox"),
            "docker.io/library/busybox:latest"
        );
        assert_eq!(
            normalised("index.docker.io/library/busybox:1"),
            "docker.io/library/busybox:1"
        );
        let hub = parse_reference("busybox").unwrap();
        assert_eq!(
            (hub.registry(), hub.resolve_registry()),
            ("docker.io", "index.docker.io")
        );
        assert_eq!(hub.repository(), "library/busybox");
    }

    #[test]
    fn references_detect_registry_hosts_and_digests() {
        let local = parse_reference("localhost:5000/team/app:v1").unwrap();
        assert_eq!(
            (local.registry(), local.repository(), local.tag()),
            ("localhost:5000", "team/app", Some("v1"))
        );
        let ip = parse_reference("127.0.0.1:5000/tiny:1").unwrap();
        assert_eq!(ip.registry(), "127.0.0.1:5000");
        let dotted = parse_reference("ghcr.io/owner/image").unwrap();
        assert_eq!(
            (dotted.registry(), dotted.tag()),
            ("ghcr.io", Some("latest"))
        );
        // Without a dot, a colon or "localhost" the first part is a Docker Hub namespace.
        let namespace = parse_reference("myhost/image:1").unwrap();
        assert_eq!(
            (namespace.registry(), namespace.repository()),
            ("docker.io", "myhost/image")
        );

        let digest = format!("sha256:{}", "a".repeat(64));
        let pinned = parse_reference(&format!("127.0.0.1:5000/tiny@{digest}")).unwrap();
        assert_eq!(pinned.digest(), Some(digest.as_str()));
        assert_eq!(pinned.whole(), format!("127.0.0.1:5000/tiny@{digest}"));
        let both = parse_reference(&format!("python:3.12@{digest}")).unwrap();
        assert_eq!(
            (both.tag(), both.digest()),
            (Some("3.12"), Some(digest.as_str()))
        );
    }

    #[test]
    fn bad_references_are_refused() {
        let digest512 = format!("sha512:{}", "a".repeat(128));
        for bad in [
            "",
            "   ",
            "UPPER/case",
            "a:b:c",
            "image@sha256:short",
            &format!("image@{digest512}"),
            "has space:1",
        ] {
            let err = parse_reference(bad).unwrap_err();
            assert!(
                matches!(err, PullError::BadReference { .. }),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn plain_http_is_for_loopback_and_listed_hosts() {
        let listed = vec!["registry.lan".to_owned(), "10.0.0.5:5000".to_owned()];
        for plain in [
            "localhost",
            "localhost:5000",
            "127.0.0.1",
            "127.0.0.1:32768",
            "[::1]:5000",
            "registry.lan",
            "registry.lan:443",
            "REGISTRY.lan:5000",
            "10.0.0.5:5000",
        ] {
            assert!(is_plain_http(plain, &listed), "{plain}");
        }
        for tls in [
            "docker.io",
            "ghcr.io",
            "10.0.0.5",
            "10.0.0.5:5001",
            "localhost.example.com",
            "127.0.0.10:5000",
            "registry.lan.evil.com",
        ] {
            assert!(!is_plain_http(tls, &listed), "{tls}");
        }
        assert!(!is_plain_http("registry.lan", &[]));
    }

    fn entry(digest: &str, os: &str, arch: &str, variant: Option<&str>) -> IndexEntry {
        IndexEntry {
            media_type: OCI_IMAGE_MEDIA_TYPE.to_owned(),
            digest: digest.to_owned(),
            platform: Some(Platform {
                architecture: arch.to_owned(),
                os: os.to_owned(),
                variant: variant.map(str::to_owned),
            }),
        }
    }

    #[test]
    fn platform_selection_prefers_the_exact_variant() {
        let entries = vec![
            entry("win", "windows", "amd64", None),
            entry("attestation", "unknown", "unknown", None),
            entry("arm6", "linux", "arm", Some("v6")),
            entry("arm7", "linux", "arm", Some("v7")),
            entry("arm64", "linux", "arm64", Some("v8")),
            entry("amd64v3", "linux", "amd64", Some("v3")),
            entry("amd64", "linux", "amd64", None),
        ];
        let pick =
            |arch, variant| select_manifest(&entries, arch, variant).map(|e| e.digest.as_str());
        assert_eq!(pick("amd64", None), Some("amd64"));
        assert_eq!(pick("arm64", Some("v8")), Some("arm64"));
        assert_eq!(pick("arm", Some("v7")), Some("arm7"));
        assert_eq!(pick("s390x", None), None);

        let bare_arm64 = vec![entry("plain", "linux", "arm64", None)];
        assert_eq!(
            select_manifest(&bare_arm64, "arm64", Some("v8"))
                .unwrap()
                .digest,
            "plain"
        );
        let v1 = vec![
            entry("v3", "linux", "amd64", Some("v3")),
            entry("v1", "linux", "amd64", Some("v1")),
        ];
        assert_eq!(select_manifest(&v1, "amd64", None).unwrap().digest, "v1");
        let nested = vec![IndexEntry {
            media_type: OCI_IMAGE_INDEX_MEDIA_TYPE.to_owned(),
            ..entry("nested", "linux", "amd64", None)
        }];
        assert!(select_manifest(&nested, "amd64", None).is_none());
        assert!(!host_platform().0.is_empty());
    }

    #[test]
    fn manifests_are_classified() {
        let image = br#"{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",
            "config":{"mediaType":"application/vnd.docker.container.image.v1+json","digest":"sha256:00","size":10},
            "layers":[{"mediaType":"application/vnd.docker.image.rootfs.diff.tar.gzip","digest":"sha256:01","size":-1}]}"#;
        match parse_manifest(image, "x").unwrap() {
            Manifest::Image { config, layers } => {
                assert_eq!(config.size, Some(10));
                assert_eq!(layers.len(), 1);
                assert_eq!(layers[0].size, None);
            }
            other => panic!("{other:?}"),
        }
        let bare_oci = br#"{"schemaVersion":2,"config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:00","size":1},"layers":[]}"#;
        assert!(matches!(
            parse_manifest(bare_oci, "x").unwrap(),
            Manifest::Image { .. }
        ));
        let index = br#"{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:02","size":3,"platform":{"architecture":"amd64","os":"linux"}}]}"#;
        assert!(matches!(parse_manifest(index, "x").unwrap(), Manifest::Index(e) if e.len() == 1));

        let schema1 = br#"{"schemaVersion":1,"name":"x","fsLayers":[]}"#;
        assert!(matches!(
            parse_manifest(schema1, "x"),
            Err(PullError::Unsupported { .. })
        ));
        let artifact = br#"{"schemaVersion":2,"mediaType":"application/vnd.cncf.helm.chart","config":{"digest":"sha256:00"}}"#;
        assert!(matches!(
            parse_manifest(artifact, "x"),
            Err(PullError::Unsupported { .. })
        ));
        assert!(matches!(
            parse_manifest(b"<html>", "x"),
            Err(PullError::Registry { .. })
        ));
    }

    #[test]
    fn image_config_is_read() {
        let config: ConfigDoc = serde_json::from_str(
            r#"{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/bin:/bin","EMPTY=","ODD","EQ=a=b"],
            "User":"1000:1000","WorkingDir":"","Entrypoint":null,"Cmd":["python3"]},
            "rootfs":{"type":"layers","diff_ids":["sha256:aa"]}}"#,
        )
        .unwrap();
        assert_eq!(config.rootfs.as_ref().unwrap().diff_ids, ["sha256:aa"]);
        let image = image_config(config.config.unwrap());
        assert_eq!(
            image,
            ImageConfig {
                env: vec![
                    ("PATH".into(), "/usr/bin:/bin".into()),
                    ("EMPTY".into(), String::new()),
                    ("ODD".into(), String::new()),
                    ("EQ".into(), "a=b".into()),
                ],
                user: Some("1000:1000".into()),
                workdir: None,
                entrypoint: vec![],
                cmd: vec!["python3".into()],
            }
        );
    }

    #[test]
    fn digests_must_be_well_formed_sha256() {
        let good = format!("sha256:{}", "0123456789abcdef".repeat(4));
        assert_eq!(sha256_hex(&good), Some(&good[7..]));
        for bad in [
            format!("sha256:{}", "A".repeat(64)),
            format!("sha256:{}", "a".repeat(63)),
            format!("sha256:../../{}", "a".repeat(58)),
            format!("sha512:{}", "a".repeat(64)),
            "a".repeat(64),
        ] {
            assert_eq!(sha256_hex(&bad), None, "{bad}");
        }
        assert_eq!(short(&good), "sha256:0123456789ab…");
        assert_eq!(human_size(999), "999 B");
        assert_eq!(human_size(12_345_678), "12.3 MB");
        assert_eq!(human_size(2_500_000_000), "2.5 GB");
    }

    /// A layer tar holding one file, and its diff id.
    fn layer_tar() -> (Vec<u8>, String) {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(5);
        header.set_mode(0o644);
        builder
            .append_data(&mut header, "hello.txt", &b"hello"[..])
            .unwrap();
        let tar = builder.into_inner().unwrap();
        let hex = hex::encode(Sha256::digest(&tar));
        (tar, hex)
    }

    #[test]
    fn blobs_unpack_whatever_their_compression() {
        let (tar, hex) = layer_tar();
        let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gzip.write_all(&tar).unwrap();
        let gzip = gzip.finish().unwrap();
        let zstd = zstd::encode_all(tar.as_slice(), 3).unwrap();

        for blob in [tar.clone(), gzip, zstd] {
            let tmp = tempfile::tempdir().unwrap();
            let layers = tmp.path().join("layers");
            std::fs::create_dir(&layers).unwrap();
            let blob_path = tmp.path().join("blob");
            std::fs::write(&blob_path, &blob).unwrap();
            let stats = unpack_blob(&blob_path, &layers, &hex, &ByteBudget::new(1 << 20)).unwrap();
            assert_eq!(stats.files, 1);
            assert_eq!(
                std::fs::read_to_string(layers.join(&hex).join("hello.txt")).unwrap(),
                "hello"
            );
            assert_eq!(
                std::fs::read_dir(&layers).unwrap().count(),
                1,
                "no staging left"
            );

            // A second unpack of the same layer finds it in place and throws its copy away.
            unpack_blob(&blob_path, &layers, &hex, &ByteBudget::new(1 << 20)).unwrap();
            assert_eq!(std::fs::read_dir(&layers).unwrap().count(), 1);
        }
    }

    #[test]
    fn wrong_diff_id_leaves_nothing_behind() {
        let (tar, _) = layer_tar();
        let tmp = tempfile::tempdir().unwrap();
        let layers = tmp.path().join("layers");
        std::fs::create_dir(&layers).unwrap();
        let blob_path = tmp.path().join("blob");
        std::fs::write(&blob_path, &tar).unwrap();
        let wrong = "f".repeat(64);
        let err = unpack_blob(&blob_path, &layers, &wrong, &ByteBudget::new(1 << 20)).unwrap_err();
        assert!(
            matches!(&err, PullError::DigestMismatch { expected, .. } if *expected == format!("sha256:{wrong}")),
            "{err}"
        );
        assert_eq!(std::fs::read_dir(&layers).unwrap().count(), 0);

        // A corrupt archive is an unpack error and leaves nothing either.
        std::fs::write(&blob_path, b"\x1f\x8b\x08\x00garbage").unwrap();
        let err = unpack_blob(&blob_path, &layers, &wrong, &ByteBudget::new(1 << 20)).unwrap_err();
        assert!(matches!(err, PullError::Unpack(_)), "{err}");
        assert_eq!(std::fs::read_dir(&layers).unwrap().count(), 0);
    }

    #[test]
    fn a_layer_past_the_pull_limit_is_refused_and_leaves_nothing() {
        // A megabyte of zeros compresses to about a kilobyte.
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(1 << 20);
        header.set_mode(0o644);
        builder
            .append_data(&mut header, "zeros", &vec![0u8; 1 << 20][..])
            .unwrap();
        let tar = builder.into_inner().unwrap();
        let hex = hex::encode(Sha256::digest(&tar));
        let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gzip.write_all(&tar).unwrap();
        let gzip = gzip.finish().unwrap();
        assert!(gzip.len() < 16 << 10);

        let tmp = tempfile::tempdir().unwrap();
        let layers = tmp.path().join("layers");
        std::fs::create_dir(&layers).unwrap();
        let blob_path = tmp.path().join("blob");
        std::fs::write(&blob_path, &gzip).unwrap();
        for limit in [64 << 10, 1 << 20] {
            let err = unpack_blob(&blob_path, &layers, &hex, &ByteBudget::new(limit)).unwrap_err();
            assert!(matches!(err, PullError::Unpack(_)), "{err}");
            assert!(err.to_string().contains(&format!("{limit} bytes")), "{err}");
            assert_eq!(std::fs::read_dir(&layers).unwrap().count(), 0);
            let err = verify_diff_id(&blob_path, &hex, limit).unwrap_err();
            assert!(matches!(err, PullError::Unpack(_)), "{err}");
        }
        // With room for the content, the stream, and an entry's charge, it fits.
        unpack_blob(&blob_path, &layers, &hex, &ByteBudget::new(2 << 20)).unwrap();
        verify_diff_id(&blob_path, &hex, 2 << 20).unwrap();
    }

    #[test]
    fn new_removes_interrupted_pulls() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(tmp.path().to_owned(), allowing(&[]));
        cache.prepare_dirs().unwrap();
        let layers = cache.layers_dir();
        let stale = layers.join(".tmp-0123");
        std::fs::create_dir_all(stale.join("usr/bin")).unwrap();
        std::fs::write(stale.join("usr/bin/half"), "x").unwrap();
        let kept = layers.join("a".repeat(64));
        std::fs::create_dir(&kept).unwrap();
        std::fs::write(cache.blobs_dir().join(".tmp-4567"), "partial").unwrap();

        let cache = ImageCache::new(tmp.path().to_owned(), allowing(&[]));
        assert!(!stale.exists());
        assert!(kept.exists());
        assert_eq!(std::fs::read_dir(cache.blobs_dir()).unwrap().count(), 0);
        let mode = std::fs::metadata(&layers).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
    }

    fn response(status: &str, extra_headers: &str, body: &str) -> String {
        format!(
            "HTTP/1.1 {status}\r\n{extra_headers}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    }

    #[tokio::test]
    async fn wrong_credentials_are_unauthorized() {
        let body = r#"{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}"#;
        let (port, hits) = fixed_server(response(
            "401 Unauthorized",
            "WWW-Authenticate: Basic realm=\"registry\"\r\n",
            body,
        ))
        .await;
        let tmp = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(tmp.path().to_owned(), allowing(&["127.0.0.1"]));
        let auth = RegistryAuth {
            username: "user".into(),
            password: "wrong".into(),
        };
        let reference = format!("127.0.0.1:{port}/private:1");
        let err = cache
            .pull(&reference, Some(&auth), &|_| {})
            .await
            .unwrap_err();
        assert!(
            matches!(&err, PullError::Unauthorized { reference: r } if *r == reference),
            "{err}"
        );
        assert!(hits.load(Ordering::SeqCst) > 0);
        let err = cache.pull(&reference, None, &|_| {}).await.unwrap_err();
        assert!(matches!(err, PullError::Unauthorized { .. }), "{err}");
        assert!(!format!("{auth:?}").contains("wrong"));
    }

    #[tokio::test]
    async fn unknown_manifest_is_not_found() {
        let body = r#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}"#;
        let (port, _) = fixed_server(response("404 Not Found", "", body)).await;
        let tmp = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(tmp.path().to_owned(), allowing(&["localhost"]));
        let err = cache
            .pull(&format!("localhost:{port}/tiny:nope"), None, &|_| {})
            .await
            .unwrap_err();
        assert!(matches!(err, PullError::NotFound { .. }), "{err}");
    }

    #[test]
    fn pull_can_run_on_any_runtime_thread() {
        fn assert_send<T: Send>(_: &T) {}
        let cache = ImageCache::new(PathBuf::from("/nonexistent"), allowing(&[]));
        let pull = cache.pull("busybox", None, &|_| {});
        assert_send(&pull);
    }

    #[tokio::test]
    async fn closed_port_is_unreachable() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let policy = allowing(&[&format!("127.0.0.1:{port}")]);
        let err = failed_pull(policy.clone(), &format!("127.0.0.1:{port}/tiny:1")).await;
        assert!(matches!(err, PullError::Unreachable { .. }), "{err}");
        let err = failed_pull(policy, "Not A Reference").await;
        assert!(matches!(err, PullError::BadReference { .. }), "{err}");
    }

    /// What pulling `reference` into an empty cache under `policy` fails with.
    async fn failed_pull(policy: Arc<RegistryPolicy>, reference: &str) -> PullError {
        let tmp = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(tmp.path().to_owned(), policy);
        cache.pull(reference, None, &|_| {}).await.unwrap_err()
    }

    async fn refused_pull(policy: Arc<RegistryPolicy>, reference: &str) -> RegistryRefused {
        match failed_pull(policy, reference).await {
            PullError::Refused(refused) => refused,
            other => panic!("{reference}: {other:?}"),
        }
    }

    #[tokio::test]
    async fn loopback_registries_are_refused_before_any_connection() {
        let (port, hits) = fixed_server(response("404 Not Found", "", "{}")).await;
        let refused = refused_pull(allowing(&[]), &format!("127.0.0.1:{port}/x/y:1")).await;
        assert_eq!(refused.registry, format!("127.0.0.1:{port}"));
        assert_eq!(refused.range, RefusedRange::Loopback);
        // A name is refused by the resolver, at connect time.
        let refused = refused_pull(allowing(&[]), &format!("localhost:{port}/x/y:1")).await;
        assert_eq!(refused.range, RefusedRange::Loopback);
        // Another port of an allowed address is not allowed.
        let other = allowing(&[&format!("127.0.0.1:{}", port.wrapping_add(1))]);
        refused_pull(other, &format!("127.0.0.1:{port}/x/y:1")).await;
        assert_eq!(hits.load(Ordering::SeqCst), 0);
        // Numeric spellings of loopback are addresses too.
        for spelled in ["2130706433", "0x7f.1", "127.1"] {
            let err = refused_pull(allowing(&[]), &format!("{spelled}:{port}/x/y")).await;
            assert_eq!(
                err.address,
                "127.0.0.1".parse::<std::net::IpAddr>().unwrap()
            );
            assert!(err.to_string().contains("--allow-registry"), "{err}");
        }
    }

    #[tokio::test]
    async fn redirects_are_checked_hop_by_hop() {
        let (target, target_hits) = fixed_server(response("404 Not Found", "", "{}")).await;
        for location in [
            format!("http://127.0.0.1:{target}/elsewhere"),
            format!("http://localhost:{target}/elsewhere"),
            format!("http://[::ffff:127.0.0.1]:{target}/elsewhere"),
        ] {
            let (port, hits) = fixed_server(response(
                "307 Temporary Redirect",
                &format!("Location: {location}\r\n"),
                "",
            ))
            .await;
            let policy = allowing(&[&format!("127.0.0.1:{port}")]);
            let refused = refused_pull(policy, &format!("127.0.0.1:{port}/x/y:1")).await;
            assert_eq!(refused.range, RefusedRange::Loopback, "{location}");
            assert_eq!(hits.load(Ordering::SeqCst), 1, "{location}");
        }
        assert_eq!(target_hits.load(Ordering::SeqCst), 0);

        // Hops the operator allowed are followed.
        let body = r#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}"#;
        let (target, target_hits) = fixed_server(response("404 Not Found", "", body)).await;
        let (port, _) = fixed_server(response(
            "302 Found",
            &format!("Location: http://127.0.0.1:{target}/v2/x/y/manifests/1\r\n"),
            "",
        ))
        .await;
        let policy = allowing(&[&format!("127.0.0.1:{port}"), &format!("127.0.0.1:{target}")]);
        let err = failed_pull(policy, &format!("127.0.0.1:{port}/x/y:1")).await;
        assert!(matches!(err, PullError::NotFound { .. }), "{err}");
        assert_eq!(target_hits.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn token_services_are_checked_too() {
        let (realm, realm_hits) = fixed_server(response("200 OK", "", r#"{"token":"t"}"#)).await;
        let (port, _) = fixed_server(response(
            "401 Unauthorized",
            &format!(
                "WWW-Authenticate: Bearer realm=\"http://localhost:{realm}/token\",service=\"x\"\r\n"
            ),
            "{}",
        ))
        .await;
        let policy = allowing(&[&format!("127.0.0.1:{port}")]);
        let refused = refused_pull(policy, &format!("127.0.0.1:{port}/x/y:1")).await;
        assert_eq!(refused.registry, format!("localhost:{realm}"));
        assert_eq!(realm_hits.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn remote_answers_never_reach_the_error() {
        let marker = "remote-text-4f1c9a";
        for status in [
            "500 Internal Server Error",
            "400 Bad Request",
            "418 I'm a teapot",
        ] {
            let (port, hits) =
                fixed_server(response(status, "", &format!("<h1>{marker}</h1>"))).await;
            let policy = allowing(&[&format!("127.0.0.1:{port}")]);
            let err = failed_pull(policy, &format!("127.0.0.1:{port}/x/y:1")).await;
            let text = err.to_string();
            assert!(!text.contains(marker), "{text}");
            let code = &status[..3];
            assert!(text.contains(&format!("http status {code}")), "{text}");
            assert_eq!(hits.load(Ordering::SeqCst), 1);
        }
    }
}
