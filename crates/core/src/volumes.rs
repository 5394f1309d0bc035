//! Team-owned persistent volumes: the control plane (create, list, get, delete), the rules for
//! mounting them into sandboxes, and the content operations the volume API serves with a
//! volume's own token.
//!
//! The bytes live on the node (see [`VolumeHost`]); the core decides who may touch which
//! volume and which paths are acceptable before the host sees them.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::builds::UploadBody;
use crate::caps::{CapError, check_bytes, check_count};
use crate::ids;
use crate::lock;
use crate::model::Team;
use crate::secrets::hash_secret;
use crate::store::{Store, StoreError};

/// Most mounts one sandbox may ask for.
pub const MAX_MOUNTS: usize = 16;
/// Longest volume name accepted.
pub const MAX_NAME_LEN: usize = 128;
/// Longest path accepted, in bytes (Linux's `PATH_MAX`).
pub const MAX_PATH_LEN: usize = 4096;
/// Sandbox ids every sandbox maps; files in a volume are owned by ids in this range.
pub const MAX_OWNER_ID: u32 = 65535;
/// Content API requests one team may make per minute unless the operator says otherwise.
pub const DEFAULT_CONTENT_REQUESTS_PER_MINUTE: u32 = 6000;
/// Bytes moved between an upload's body and its file at a time: what one write holds.
const COPY_CHUNK: usize = 256 << 10;

const TOKEN_PREFIX: &str = "vol_";

pub use crate::model::volumes::{Volume, VolumeMount};

/// A mount as a client asks for it on create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountRequest {
    pub name: String,
    pub path: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    Directory,
    File,
    Symlink,
    Unknown,
}

impl EntryKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EntryKind::Directory => "directory",
            EntryKind::File => "file",
            EntryKind::Symlink => "symlink",
            EntryKind::Unknown => "unknown",
        }
    }
}

/// What the content API reports about one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryStat {
    pub name: String,
    /// From the volume's root, starting with `/`.
    pub path: String,
    pub kind: EntryKind,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: DateTime<Utc>,
    pub mtime: DateTime<Utc>,
    pub ctime: DateTime<Utc>,
    /// A symlink's target, as stored (never followed).
    pub target: Option<String>,
}

/// Owner and mode for entries the content API creates or changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EntryOwner {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

/// Why a path inside a volume is refused; the error that wraps it names the path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VolumePathError {
    #[error("is longer than {MAX_PATH_LEN} bytes")]
    TooLong,
    #[error("contains a NUL byte")]
    Nul,
    #[error("contains '..'")]
    ParentDir,
}

/// Why a mount point is refused; the error that wraps it names the path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MountPathError {
    #[error("must be absolute")]
    NotAbsolute,
    #[error("is longer than {MAX_PATH_LEN} bytes")]
    TooLong,
    #[error("contains a NUL byte")]
    Nul,
    #[error("cannot be '/'")]
    Root,
    #[error("contains an empty component")]
    EmptyComponent,
    #[error("contains '{0}'")]
    DotComponent(&'static str),
    #[error("cannot be under /{0}")]
    KernelTree(&'static str),
}

/// A path inside a volume, already checked: relative components without `.`, `..` or NUL.
/// The host still resolves it beneath the volume's root, since a sandbox may have planted
/// symlinks anywhere in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumePath {
    components: Vec<String>,
}

impl VolumePath {
    pub fn parse(raw: &str) -> Result<Self, VolumePathError> {
        if raw.len() > MAX_PATH_LEN {
            return Err(VolumePathError::TooLong);
        }
        if raw.contains('\0') {
            return Err(VolumePathError::Nul);
        }
        let mut components = Vec::new();
        for part in raw.split('/') {
            match part {
                "" | "." => {}
                ".." => return Err(VolumePathError::ParentDir),
                name => components.push(name.to_owned()),
            }
        }
        Ok(Self { components })
    }

    pub fn is_root(&self) -> bool {
        self.components.is_empty()
    }

    pub fn components(&self) -> &[String] {
        &self.components
    }

    /// The path relative to the volume's root (`.` for the root).
    pub fn relative(&self) -> String {
        if self.components.is_empty() {
            ".".into()
        } else {
            self.components.join("/")
        }
    }

    /// The path as the API reports it: from the root, with a leading `/`.
    pub fn display(&self) -> String {
        format!("/{}", self.components.join("/"))
    }
}

/// Failures of the host's file operations inside a volume.
#[derive(Debug, thiserror::Error)]
pub enum VolumeIoError {
    #[error("path '{0}' not found")]
    NotFound(String),
    #[error("path '{0}' leads outside the volume")]
    Escapes(String),
    #[error("path '{0}' is not a directory")]
    NotADirectory(String),
    #[error("path '{0}' is a directory")]
    IsADirectory(String),
    #[error("path '{0}' is a symlink; it is never followed")]
    Symlink(String),
    #[error("path '{0}' already exists")]
    AlreadyExists(String),
    #[error("path '{path}' is a {kind}, not a regular file")]
    NotAFile { path: String, kind: &'static str },
    #[error("the volume's root cannot be removed")]
    Root,
    #[error("{path}: {message}")]
    Io { path: String, message: String },
}

/// A regular file of a volume opened for reading, and its size when it was opened.
#[derive(Debug)]
pub struct OpenedFile {
    pub file: std::fs::File,
    pub size: u64,
}

/// A file being written into a volume: made beside its target, so nothing is visible at the
/// path until [`StagedFile::commit`] renames it over the target. Dropped uncommitted, it is
/// removed.
pub trait StagedFile: Send {
    /// The new file, open for writing.
    fn file(&self) -> &std::fs::File;
    /// Gives the file its owner and mode and puts it in place; describes the result.
    fn commit(self: Box<Self>) -> Result<EntryStat, VolumeIoError>;
}

/// The node's side of volumes: directories that outlive sandboxes, and file operations that
/// never leave them. Paths are resolved beneath the volume's root without following symlinks
/// out of it.
pub trait VolumeHost: Send + Sync + 'static {
    fn create(&self, team_id: &str, volume_id: &str) -> Result<(), VolumeIoError>;
    fn remove(&self, team_id: &str, volume_id: &str) -> Result<(), VolumeIoError>;
    fn stat(&self, volume: &Volume, path: &VolumePath) -> Result<EntryStat, VolumeIoError>;
    /// Opens a regular file for reading; anything else is refused.
    fn open_file(&self, volume: &Volume, path: &VolumePath) -> Result<OpenedFile, VolumeIoError>;
    /// Starts creating or replacing a regular file; `parents` creates missing directories.
    fn stage_file(
        &self,
        volume: &Volume,
        path: &VolumePath,
        owner: EntryOwner,
        parents: bool,
    ) -> Result<Box<dyn StagedFile>, VolumeIoError>;
    fn make_dir(
        &self,
        volume: &Volume,
        path: &VolumePath,
        owner: EntryOwner,
        parents: bool,
    ) -> Result<EntryStat, VolumeIoError>;
    /// The entries below a directory, `depth` levels deep (1: its children).
    fn list(
        &self,
        volume: &Volume,
        path: &VolumePath,
        depth: u32,
    ) -> Result<Vec<EntryStat>, VolumeIoError>;
    /// Removes a file, symlink or directory tree.
    fn remove_path(&self, volume: &Volume, path: &VolumePath) -> Result<(), VolumeIoError>;
    fn set_owner(
        &self,
        volume: &Volume,
        path: &VolumePath,
        owner: EntryOwner,
    ) -> Result<EntryStat, VolumeIoError>;
    /// Bytes the volume's files take on disk.
    fn usage(&self, team_id: &str, volume_id: &str) -> Result<u64, VolumeIoError>;
}

#[derive(Debug, thiserror::Error)]
pub enum CreateVolumeError {
    #[error(
        "invalid volume name '{0}': use 1 to 128 letters, digits, '_' or '-' (pattern ^[a-zA-Z0-9_-]+$)"
    )]
    BadName(String),
    #[error("a volume named '{0}' already exists in this team")]
    NameTaken(String),
    #[error(transparent)]
    Cap(#[from] CapError),
    #[error("cannot create the storage of volume {volume_id}: {source}")]
    Host {
        volume_id: String,
        source: VolumeIoError,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum GetVolumeError {
    #[error("volume '{0}' not found")]
    NotFound(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum DeleteVolumeError {
    #[error("volume '{0}' not found")]
    NotFound(String),
    #[error("volume '{volume_id}' is mounted by sandbox {sandbox_id}; kill the sandbox first")]
    InUse {
        volume_id: String,
        sandbox_id: String,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Errors of the `volumeMounts` of a create request; each names the entry.
#[derive(Debug, thiserror::Error)]
pub enum VolumeMountError {
    #[error("volumeMounts[{index}]: invalid path '{path}': {reason}")]
    BadPath {
        index: usize,
        path: String,
        reason: MountPathError,
    },
    #[error("volumeMounts[{index}]: volume '{name}' not found")]
    UnknownVolume { index: usize, name: String },
    #[error("volumeMounts[{index}]: {what} '{value}' is mounted more than once")]
    Duplicate {
        index: usize,
        what: &'static str,
        value: String,
    },
    #[error("at most {MAX_MOUNTS} volume mounts per sandbox, got {0}")]
    TooMany(usize),
    #[error("this server has no volume storage")]
    Disabled,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Errors of the volume content API.
#[derive(Debug, thiserror::Error)]
pub enum VolumeContentError {
    #[error("invalid or missing token for volume '{0}'")]
    Unauthorized(String),
    #[error("volume {volume_id}: invalid path '{path}': {reason}")]
    BadPath {
        volume_id: String,
        path: String,
        reason: VolumePathError,
    },
    #[error("volume {volume_id}: {reason}")]
    BadRequest { volume_id: String, reason: String },
    #[error("volume {volume_id}: {source}")]
    Io {
        volume_id: String,
        source: VolumeIoError,
    },
    #[error("volume {volume_id}: the upload is larger than the limit of {limit} bytes")]
    TooLarge { volume_id: String, limit: u64 },
    #[error("volume {volume_id}: cannot read the upload: {message}")]
    Upload { volume_id: String, message: String },
    #[error(
        "volume {volume_id}: team {team_id} exceeded its limit of {per_minute} volume content requests per minute"
    )]
    RateLimited {
        volume_id: String,
        team_id: String,
        per_minute: u32,
        /// How long until the next request would be accepted.
        retry_after: Duration,
    },
    #[error(transparent)]
    Cap(#[from] CapError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A file of a volume being read: `size` bytes from `reader`, as they were when it was
/// opened.
#[derive(Debug)]
pub struct VolumeFile {
    pub reader: tokio::fs::File,
    pub size: u64,
}

/// One GCRA bucket per team, all at one rate, for the content API: it moves bytes from the
/// host's disk, so a team's token holder is held to a rate whatever the team's own limits.
struct ContentRate {
    per_minute: Option<NonZeroU32>,
    buckets: Mutex<HashMap<String, Arc<DefaultDirectRateLimiter>>>,
}

impl ContentRate {
    fn new(per_minute: u32) -> Self {
        Self {
            per_minute: NonZeroU32::new(per_minute),
            buckets: Mutex::default(),
        }
    }

    /// Counts one request of `team_id`; `Err` holds the wait before the next is accepted.
    fn check(&self, team_id: &str) -> Result<(), (u32, Duration)> {
        let Some(per_minute) = self.per_minute else {
            return Ok(());
        };
        let bucket = lock(&self.buckets)
            .entry(team_id.to_owned())
            .or_insert_with(|| Arc::new(RateLimiter::direct(Quota::per_minute(per_minute))))
            .clone();
        bucket.check().map_err(|not_until| {
            (
                per_minute.get(),
                not_until.wait_time_from(DefaultClock::default().now()),
            )
        })
    }
}

/// HMAC-SHA-256 (RFC 2104), so a volume's token can be given again on `GET /volumes/{id}`
/// without the store keeping anything but its hash.
fn hmac_sha256(key: &[u8; 32], message: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    block[..32].copy_from_slice(key);
    let mut inner = Sha256::new();
    inner.update(block.map(|b| b ^ 0x36));
    inner.update(message);
    let mut outer = Sha256::new();
    outer.update(block.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

fn valid_name(name: &str) -> bool {
    crate::ids::is_plain_name(name, MAX_NAME_LEN, b"_-")
}

/// Checks a mount point: absolute, normalised, not `/` and not in the kernel's trees.
fn mount_path(raw: &str) -> Result<String, MountPathError> {
    if !raw.starts_with('/') {
        return Err(MountPathError::NotAbsolute);
    }
    if raw.len() > MAX_PATH_LEN {
        return Err(MountPathError::TooLong);
    }
    if raw.contains('\0') {
        return Err(MountPathError::Nul);
    }
    let trimmed = raw.trim_end_matches('/');
    let parts: Vec<&str> = trimmed.split('/').skip(1).collect();
    if trimmed.is_empty() {
        return Err(MountPathError::Root);
    }
    for part in &parts {
        match *part {
            "" => return Err(MountPathError::EmptyComponent),
            "." => return Err(MountPathError::DotComponent(".")),
            ".." => return Err(MountPathError::DotComponent("..")),
            _ => {}
        }
    }
    if let Some(kernel) = parts
        .first()
        .and_then(|first| ["proc", "sys", "dev"].into_iter().find(|k| k == first))
    {
        return Err(MountPathError::KernelTree(kernel));
    }
    Ok(trimmed.to_owned())
}

pub struct Volumes {
    store: Arc<Store>,
    host: Arc<dyn VolumeHost>,
    token_key: [u8; 32],
    /// Held shared from resolving a create's mounts until they are recorded, and exclusively
    /// by a delete, so a volume cannot disappear under a sandbox that is still starting.
    mounting: tokio::sync::RwLock<()>,
    content_rate: ContentRate,
    /// Held from counting a team's volumes to recording a new one.
    cap_gate: crate::caps::TeamGate,
}

impl std::fmt::Debug for Volumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Volumes").finish_non_exhaustive()
    }
}

/// Shared guard a create holds while its mounts are not yet recorded.
pub type MountGuard<'a> = tokio::sync::RwLockReadGuard<'a, ()>;

impl Volumes {
    pub fn new(store: Arc<Store>, host: Arc<dyn VolumeHost>, token_key: [u8; 32]) -> Self {
        Self {
            store,
            host,
            token_key,
            mounting: tokio::sync::RwLock::new(()),
            content_rate: ContentRate::new(DEFAULT_CONTENT_REQUESTS_PER_MINUTE),
            cap_gate: crate::caps::TeamGate::default(),
        }
    }

    /// Holds each team to `per_minute` content API requests (0: no limit).
    pub fn with_content_rate(mut self, per_minute: u32) -> Self {
        self.content_rate = ContentRate::new(per_minute);
        self
    }

    /// The volume's content token: derived from the server's key, never stored.
    pub fn token(&self, volume: &Volume) -> String {
        format!(
            "{TOKEN_PREFIX}{}",
            hex::encode(hmac_sha256(&self.token_key, volume.id.as_bytes()))
        )
    }

    pub async fn create(&self, team: &Team, name: &str) -> Result<Volume, CreateVolumeError> {
        if !valid_name(name) {
            return Err(CreateVolumeError::BadName(name.to_owned()));
        }
        let mut volume = Volume {
            id: ids::new_uuid(),
            team_id: team.id.clone(),
            name: name.to_owned(),
            token_hash: String::new(),
            created_at: Utc::now(),
        };
        volume.token_hash = hash_secret(&self.token(&volume));
        let _turn = self.cap_gate.enter(&team.id).await;
        if self
            .store
            .volumes
            .volume_by_name(&team.id, name)
            .await?
            .is_some()
        {
            return Err(CreateVolumeError::NameTaken(name.to_owned()));
        }
        let kept = self.store.volumes.team_volumes(&team.id).await?;
        check_count(team, "volumes", team.limits.caps.max_volumes, kept.len())?;
        if team.limits.caps.max_volume_mb != 0 {
            let used = self
                .usage(&kept)
                .await
                .map_err(|source| CreateVolumeError::Host {
                    volume_id: volume.id.clone(),
                    source,
                })?;
            check_bytes(team, "volumes", team.limits.caps.max_volume_mb, used, None)?;
        }
        let host = self.host.clone();
        let (team_id, volume_id) = (volume.team_id.clone(), volume.id.clone());
        blocking(move || host.create(&team_id, &volume_id))
            .await
            .map_err(|source| CreateVolumeError::Host {
                volume_id: volume.id.clone(),
                source,
            })?;
        if !self.store.volumes.insert_volume(&volume).await? {
            self.remove_storage(&volume).await;
            return Err(CreateVolumeError::NameTaken(name.to_owned()));
        }
        tracing::info!(volume_id = %volume.id, team_id = %team.id, "volume created");
        Ok(volume)
    }

    pub async fn list(&self, team: &Team) -> Result<Vec<Volume>, StoreError> {
        self.store.volumes.team_volumes(&team.id).await
    }

    /// A team's volume; another team's is reported as not found.
    pub async fn get(&self, team: &Team, id: &str) -> Result<Volume, GetVolumeError> {
        match self.store.volumes.volume(id).await? {
            Some(v) if v.team_id == team.id => Ok(v),
            _ => Err(GetVolumeError::NotFound(id.to_owned())),
        }
    }

    pub async fn delete(&self, team: &Team, id: &str) -> Result<(), DeleteVolumeError> {
        let _exclusive = self.mounting.write().await;
        let volume = match self.store.volumes.volume(id).await? {
            Some(v) if v.team_id == team.id => v,
            _ => return Err(DeleteVolumeError::NotFound(id.to_owned())),
        };
        if let Some(sandbox_id) = self
            .store
            .volumes
            .volume_users(id)
            .await?
            .into_iter()
            .next()
        {
            return Err(DeleteVolumeError::InUse {
                volume_id: id.to_owned(),
                sandbox_id,
            });
        }
        self.store.volumes.delete_volume(id).await?;
        self.remove_storage(&volume).await;
        tracing::info!(volume_id = %id, "volume deleted");
        Ok(())
    }

    /// Bytes the files of `volumes` take together.
    async fn usage(&self, volumes: &[Volume]) -> Result<u64, VolumeIoError> {
        let host = self.host.clone();
        let ids: Vec<(String, String)> = volumes
            .iter()
            .map(|v| (v.team_id.clone(), v.id.clone()))
            .collect();
        blocking(move || {
            ids.iter().try_fold(0u64, |sum, (team_id, volume_id)| {
                Ok(sum.saturating_add(host.usage(team_id, volume_id)?))
            })
        })
        .await
    }

    async fn remove_storage(&self, volume: &Volume) {
        let host = self.host.clone();
        let (team_id, volume_id) = (volume.team_id.clone(), volume.id.clone());
        if let Err(err) = blocking(move || host.remove(&team_id, &volume_id)).await {
            tracing::error!(volume_id = %volume.id, error = %err, "cannot remove volume storage");
        }
    }

    /// Checks a create's mounts and resolves them to the team's volumes. The guard must be
    /// held until the mounts are recorded with the sandbox.
    pub async fn resolve_mounts(
        &self,
        team: &Team,
        requests: &[MountRequest],
    ) -> Result<(Vec<VolumeMount>, MountGuard<'_>), VolumeMountError> {
        if requests.len() > MAX_MOUNTS {
            return Err(VolumeMountError::TooMany(requests.len()));
        }
        let mut mounts: Vec<VolumeMount> = Vec::with_capacity(requests.len());
        for (index, request) in requests.iter().enumerate() {
            let path = mount_path(&request.path).map_err(|reason| VolumeMountError::BadPath {
                index,
                path: request.path.clone(),
                reason,
            })?;
            if mounts.iter().any(|m| m.path == path) {
                return Err(VolumeMountError::Duplicate {
                    index,
                    what: "path",
                    value: path,
                });
            }
            if mounts.iter().any(|m| m.name == request.name) {
                return Err(VolumeMountError::Duplicate {
                    index,
                    what: "volume",
                    value: request.name.clone(),
                });
            }
            mounts.push(VolumeMount {
                volume_id: String::new(),
                team_id: team.id.clone(),
                name: request.name.clone(),
                path,
            });
        }
        let guard = self.mounting.read().await;
        for (index, mount) in mounts.iter_mut().enumerate() {
            let volume = if valid_name(&mount.name) {
                self.store
                    .volumes
                    .volume_by_name(&team.id, &mount.name)
                    .await?
            } else {
                None
            };
            let Some(volume) = volume else {
                return Err(VolumeMountError::UnknownVolume {
                    index,
                    name: mount.name.clone(),
                });
            };
            mount.volume_id = volume.id;
        }
        Ok((mounts, guard))
    }

    /// The mounts recorded with a sandbox.
    pub async fn sandbox_mounts(&self, sandbox_id: &str) -> Result<Vec<VolumeMount>, StoreError> {
        self.store.sandboxes.sandbox_volumes(sandbox_id).await
    }

    /// The volume a content request names, if `token` is its token. Unknown volumes and wrong
    /// tokens are one answer, so the API does not reveal which volume ids exist.
    pub async fn authorize(
        &self,
        volume_id: &str,
        token: Option<&str>,
    ) -> Result<Volume, VolumeContentError> {
        let unauthorized = || VolumeContentError::Unauthorized(volume_id.to_owned());
        let token = token.ok_or_else(unauthorized)?;
        let volume = self
            .store
            .volumes
            .volume(volume_id)
            .await?
            .ok_or_else(unauthorized)?;
        let presented = hash_secret(token);
        if !bool::from(presented.as_bytes().ct_eq(volume.token_hash.as_bytes())) {
            return Err(unauthorized());
        }
        // Counted only once the token is right: a stranger knowing a volume's id cannot
        // spend its team's requests.
        self.content_rate
            .check(&volume.team_id)
            .map_err(
                |(per_minute, retry_after)| VolumeContentError::RateLimited {
                    volume_id: volume.id.clone(),
                    team_id: volume.team_id.clone(),
                    per_minute,
                    retry_after,
                },
            )?;
        Ok(volume)
    }

    pub fn parse_path(volume: &Volume, raw: &str) -> Result<VolumePath, VolumeContentError> {
        VolumePath::parse(raw).map_err(|reason| VolumeContentError::BadPath {
            volume_id: volume.id.clone(),
            path: raw.to_owned(),
            reason,
        })
    }

    fn check_owner(volume: &Volume, owner: EntryOwner) -> Result<(), VolumeContentError> {
        let bad = |reason: String| VolumeContentError::BadRequest {
            volume_id: volume.id.clone(),
            reason,
        };
        for (what, id) in [("uid", owner.uid), ("gid", owner.gid)] {
            if let Some(id) = id
                && id > MAX_OWNER_ID
            {
                return Err(bad(format!(
                    "{what} {id} is outside the ids sandboxes map (0 to {MAX_OWNER_ID})"
                )));
            }
        }
        if let Some(mode) = owner.mode
            && mode & !0o1777 != 0
        {
            return Err(bad(format!(
                "mode {mode:o} is not allowed: only permission bits and the sticky bit (at most 1777 octal)"
            )));
        }
        Ok(())
    }

    async fn run<T: Send + 'static>(
        &self,
        volume: &Volume,
        op: impl FnOnce(&dyn VolumeHost, &Volume) -> Result<T, VolumeIoError> + Send + 'static,
    ) -> Result<T, VolumeContentError> {
        let host = self.host.clone();
        let owned = volume.clone();
        blocking(move || op(host.as_ref(), &owned))
            .await
            .map_err(|source| VolumeContentError::Io {
                volume_id: volume.id.clone(),
                source,
            })
    }

    pub async fn stat(
        &self,
        volume: &Volume,
        path: VolumePath,
    ) -> Result<EntryStat, VolumeContentError> {
        self.run(volume, move |h, v| h.stat(v, &path)).await
    }

    /// Opens a file to be read as a stream: nothing of it is held in memory here.
    pub async fn read(
        &self,
        volume: &Volume,
        path: VolumePath,
    ) -> Result<VolumeFile, VolumeContentError> {
        let opened = self.run(volume, move |h, v| h.open_file(v, &path)).await?;
        Ok(VolumeFile {
            reader: tokio::fs::File::from_std(opened.file),
            size: opened.size,
        })
    }

    /// Writes `body` to a new file as it arrives, at most `limit` bytes, and puts it in place
    /// once all of it is on disk.
    pub async fn write(
        &self,
        volume: &Volume,
        path: VolumePath,
        body: UploadBody,
        limit: u64,
        owner: EntryOwner,
        parents: bool,
    ) -> Result<EntryStat, VolumeContentError> {
        Self::check_owner(volume, owner)?;
        if path.is_root() {
            return Err(VolumeContentError::Io {
                volume_id: volume.id.clone(),
                source: VolumeIoError::IsADirectory("/".into()),
            });
        }
        // A team already at its volume bytes cap writes nothing more.
        self.check_room(volume, 0).await?;
        let shown = path.display();
        let staged = self
            .run(volume, move |h, v| h.stage_file(v, &path, owner, parents))
            .await?;
        let io = |e: std::io::Error| VolumeContentError::Io {
            volume_id: volume.id.clone(),
            source: VolumeIoError::Io {
                path: shown.clone(),
                message: e.to_string(),
            },
        };
        let mut file = tokio::fs::File::from_std(staged.file().try_clone().map_err(io)?);
        let mut body = body;
        let mut buf = vec![0u8; COPY_CHUNK];
        let mut total: u64 = 0;
        loop {
            let n = body
                .read(&mut buf)
                .await
                .map_err(|e| VolumeContentError::Upload {
                    volume_id: volume.id.clone(),
                    message: e.to_string(),
                })?;
            if n == 0 {
                break;
            }
            total += n as u64;
            if total > limit {
                return Err(VolumeContentError::TooLarge {
                    volume_id: volume.id.clone(),
                    limit,
                });
            }
            file.write_all(&buf[..n]).await.map_err(io)?;
        }
        // The last write may still be under way: its error, if any, comes from the flush.
        file.flush().await.map_err(io)?;
        drop(file);
        // The staged file counts now; past the cap it is dropped, and with it removed.
        self.check_room(volume, 0).await?;
        self.run(volume, move |_, _| staged.commit()).await
    }

    /// Refuses a write of `adding` bytes that would take the team's volumes past its cap.
    /// Writes from sandboxes that mount the volume are not held back here: they count
    /// towards the cap, which then refuses the team's next volume and content write.
    async fn check_room(&self, volume: &Volume, adding: u64) -> Result<(), VolumeContentError> {
        let Some(team) = self.store.teams.team(&volume.team_id).await? else {
            return Ok(());
        };
        if team.limits.caps.max_volume_mb == 0 {
            return Ok(());
        }
        let kept = self.store.volumes.team_volumes(&team.id).await?;
        let used = self
            .usage(&kept)
            .await
            .map_err(|source| VolumeContentError::Io {
                volume_id: volume.id.clone(),
                source,
            })?;
        check_bytes(
            &team,
            "volumes",
            team.limits.caps.max_volume_mb,
            used,
            Some(adding),
        )?;
        Ok(())
    }

    pub async fn make_dir(
        &self,
        volume: &Volume,
        path: VolumePath,
        owner: EntryOwner,
        parents: bool,
    ) -> Result<EntryStat, VolumeContentError> {
        Self::check_owner(volume, owner)?;
        self.run(volume, move |h, v| h.make_dir(v, &path, owner, parents))
            .await
    }

    pub async fn list_dir(
        &self,
        volume: &Volume,
        path: VolumePath,
        depth: u32,
    ) -> Result<Vec<EntryStat>, VolumeContentError> {
        self.run(volume, move |h, v| h.list(v, &path, depth.max(1)))
            .await
    }

    pub async fn remove(
        &self,
        volume: &Volume,
        path: VolumePath,
    ) -> Result<(), VolumeContentError> {
        if path.is_root() {
            return Err(VolumeContentError::Io {
                volume_id: volume.id.clone(),
                source: VolumeIoError::Root,
            });
        }
        self.run(volume, move |h, v| h.remove_path(v, &path)).await
    }

    pub async fn set_owner(
        &self,
        volume: &Volume,
        path: VolumePath,
        owner: EntryOwner,
    ) -> Result<EntryStat, VolumeContentError> {
        Self::check_owner(volume, owner)?;
        self.run(volume, move |h, v| h.set_owner(v, &path, owner))
            .await
    }
}

/// Host file operations block; they run off the async workers.
async fn blocking<T: Send + 'static>(
    op: impl FnOnce() -> Result<T, VolumeIoError> + Send + 'static,
) -> Result<T, VolumeIoError> {
    tokio::task::spawn_blocking(op).await.unwrap_or_else(|e| {
        Err(VolumeIoError::Io {
            path: String::new(),
            message: format!("host operation panicked: {e}"),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc4231_test_case_1() {
        // HMAC pads the key with zeros to the block size, so the 20-byte key of the RFC's
        // first case padded to 32 bytes is the same key.
        let mut key = [0u8; 32];
        key[..20].fill(0x0b);
        assert_eq!(
            hex::encode(hmac_sha256(&key, b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
    }

    #[test]
    fn mount_paths_are_checked() {
        assert_eq!(mount_path("/data").as_deref(), Ok("/data"));
        assert_eq!(mount_path("/mnt/vol/").as_deref(), Ok("/mnt/vol"));
        for (bad, why) in [
            ("data", "must be absolute"),
            ("/", "cannot be '/'"),
            ("//", "cannot be '/'"),
            ("/a/../b", "contains '..'"),
            ("/a/./b", "contains '.'"),
            ("/a//b", "contains an empty component"),
            ("/proc", "cannot be under /proc"),
            ("/proc/x", "cannot be under /proc"),
            ("/sys/fs", "cannot be under /sys"),
            ("/dev/shm", "cannot be under /dev"),
            ("/a\0b", "contains a NUL byte"),
        ] {
            assert_eq!(
                mount_path(bad).map_err(|e| e.to_string()),
                Err(why.to_owned()),
                "{bad:?}"
            );
        }
        assert!(mount_path("/devices").is_ok());
    }

    #[test]
    fn volume_paths_never_climb() {
        assert_eq!(VolumePath::parse("/a/./b/").expect("ok").relative(), "a/b");
        assert!(VolumePath::parse("").expect("root").is_root());
        assert_eq!(
            VolumePath::parse("/a/../../etc")
                .err()
                .map(|e| e.to_string())
                .as_deref(),
            Some("contains '..'")
        );
        assert_eq!(
            VolumePath::parse("a\0")
                .err()
                .map(|e| e.to_string())
                .as_deref(),
            Some("contains a NUL byte")
        );
    }

    #[test]
    fn each_team_has_a_content_bucket_of_its_own() {
        let rate = ContentRate::new(10);
        let accepted = (0..50).filter(|_| rate.check("a").is_ok()).count();
        assert_eq!(accepted, 10);
        let (per_minute, wait) = rate.check("a").expect_err("past the burst");
        assert_eq!(per_minute, 10);
        // One request comes back every six seconds.
        assert!(
            wait > Duration::from_secs(5) && wait <= Duration::from_secs(6),
            "{wait:?}"
        );
        assert!(rate.check("b").is_ok(), "another team's bucket is full");
        let unlimited = ContentRate::new(0);
        assert!((0..10_000).all(|_| unlimited.check("a").is_ok()));
    }

    #[test]
    fn names_follow_the_pattern() {
        assert!(valid_name("data_1-x"));
        assert!(!valid_name(""));
        assert!(!valid_name("a b"));
        assert!(!valid_name("a/b"));
        assert!(!valid_name(&"a".repeat(129)));
    }
}
