//! Sandbox disks: every sandbox's directory is a btrfs subvolume in one pool, with a qgroup
//! limit of its `diskSizeMB`. The quota counts data and metadata alike, so it bounds bytes and
//! inodes together: a sandbox that fills its disk gets `EDQUOT` while the host and every other
//! sandbox carry on. No filesystem is made or mounted per sandbox: a subvolume and its limit
//! are two ioctls, and removing one is another, however deep the tree inside it.
//!
//! The pool is a btrfs filesystem in an image file under the data directory, loop-mounted
//! once on the sandboxes directory (ext4 and XFS quotas are not available on every kernel,
//! btrfs qgroups are). The image's blocks are allocated when it is made: a sparse image
//! would take its blocks from the host filesystem as sandboxes write, and when the host
//! filesystem fills, btrfs sees write errors, aborts its transaction and turns every
//! sandbox's disk read-only.
//!
//! Quotas add up past the pool (most sandboxes use a small part of theirs), so a new disk
//! is admitted by what the pool really holds: it must be able to fill its whole quota and
//! still leave the pool's reserve free, and all quotas together stay within an overcommit
//! ratio of the pool.

use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use rustix::fs::{AtFlags, Mode, OFlags};
use sandbar_jail::layout;

const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;
/// Inode number of every btrfs subvolume's root directory.
const SUBVOLUME_ROOT_INODE: u64 = 256;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("cannot prepare the disk pool at {path}: {message}")]
    Pool { path: PathBuf, message: String },
    #[error("cannot create the disk of sandbox {sandbox_id}: {source}")]
    Create {
        sandbox_id: String,
        source: std::io::Error,
    },
    #[error("cannot remove the disk of sandbox {sandbox_id}: {source}")]
    Remove {
        sandbox_id: String,
        source: std::io::Error,
    },
    /// The pool cannot take a disk of this size now; other disks ending or emptying frees it.
    #[error("no room for the disk of sandbox {sandbox_id}: {message}")]
    NoRoom { sandbox_id: String, message: String },
    /// The pool is too small for even one sandbox of the default disk: serving would answer
    /// every create 503, so the server does not start.
    #[error("the disk pool at {path} is too small: {message}")]
    TooSmall { path: PathBuf, message: String },
}

/// Why a pool image of the size asked for, or of the default size, cannot be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolSizeError {
    #[error(
        "--disk-pool-gb {asked_gb} is too small: {needs}; set --disk-pool-gb to at least {needed_gb}"
    )]
    AskedTooSmall {
        asked_gb: u64,
        /// What one sandbox's disk, the reserve and btrfs need together.
        needs: String,
        needed_gb: u64,
    },
    #[error(
        "its filesystem has {free_mib} MiB free and {needs}; free space there or set --disk-pool-gb"
    )]
    NoRoom { free_mib: u64, needs: String },
}

/// A program the pool runs (mount, umount, losetup, btrfs, mkfs.btrfs) that failed.
#[derive(Debug, thiserror::Error)]
pub enum PoolCommandError {
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{program} failed with {status}: {stderr}")]
    Failed {
        program: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
}

/// Why the pool's image cannot be made, grown or mounted with quotas.
#[derive(Debug, thiserror::Error)]
pub enum PoolSetupError {
    #[error(transparent)]
    Command(#[from] PoolCommandError),
    #[error(transparent)]
    Size(#[from] PoolSizeError),
    #[error("{source}")]
    Space {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot allocate {size_mib} MiB for the pool image {image}: {source} (free space there, or choose a smaller --disk-pool-gb)"
    )]
    Allocate {
        image: PathBuf,
        size_mib: u64,
        source: rustix::io::Errno,
    },
    #[error("{0} (is btrfs-progs installed?)")]
    Mkfs(PoolCommandError),
    #[error("cannot grow the pool image {image} from {from_mib} to {to_mib} MiB: {source}")]
    Grow {
        image: PathBuf,
        from_mib: u64,
        to_mib: u64,
        source: rustix::io::Errno,
    },
    #[error("no loop device holds {image}")]
    NoLoopDevice { image: PathBuf },
    #[error("cannot enable quotas: {0}")]
    Quotas(std::io::Error),
}

/// Why a read-only pool cannot be mounted afresh.
#[derive(Debug, thiserror::Error)]
pub enum PoolRecoverError {
    #[error("the pool is still in use by running sandboxes ({0})")]
    InUse(PoolCommandError),
    #[error(transparent)]
    Mount(#[from] PoolCommandError),
    #[error(transparent)]
    Setup(#[from] PoolSetupError),
    #[error("{source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the pool is read-only again after mounting it")]
    StillReadOnly { path: PathBuf },
}

/// Why the pool turns a disk down now; other disks ending or emptying may make the room.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdmissionRefusal {
    #[error("the sandbox disk pool is read-only (its filesystem failed)")]
    ReadOnly,
    #[error(
        "the sandbox disk pool has {free_mib} MiB free and keeps {reserve_mib} MiB in reserve, so it cannot take a {size_mib} MiB disk; try again when sandboxes end"
    )]
    NoRoom {
        free_mib: u64,
        reserve_mib: u64,
        size_mib: u64,
    },
    #[error(
        "the sandbox disks on this node already have {promised_mib} MiB of quota, and {size_mib} MiB more would pass the disk pool's limit of {limit_mib} MiB ({overcommit}x its size); try again when sandboxes end"
    )]
    PastLimit {
        promised_mib: u64,
        size_mib: u64,
        limit_mib: u64,
        overcommit: u64,
    },
}

/// Why a sandbox's directory cannot be copied.
#[derive(Debug, thiserror::Error)]
pub enum DiskSnapshotError {
    #[error("{path}: {source}")]
    Stat {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("snapshot {path}: {source}")]
    Snapshot {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("snapshot name {name} is too long")]
    NameTooLong { name: String },
    #[error("run cp: {source}")]
    RunCp {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("copy {from} to {to}: {stderr}")]
    Copy {
        from: PathBuf,
        to: PathBuf,
        stderr: String,
    },
}

/// The default pool is this share of the free space where its image goes: a second data
/// directory on the same filesystem (a second install, a test run) still finds room.
const DEFAULT_SHARE: u64 = 4;
/// ... and at most this much; a larger pool is asked for with `--disk-pool-gb`.
const DEFAULT_CEILING: u64 = 64 << 30;
/// What btrfs keeps for itself on a small pool (metadata and system chunks, its reserve).
const BTRFS_OWN: u64 = 256 << 20;

fn gib_ceil(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 30)
}

/// The size of a new pool image: the one asked for, or the default share of `free` with its
/// ceiling; either must hold one disk of `smallest_disk` beside the reserve, which the
/// default grows to when the share falls short and the filesystem has the room.
fn new_pool_size(
    requested: Option<u64>,
    free: u64,
    smallest_disk: u64,
    reserve: u64,
) -> Result<u64, PoolSizeError> {
    let needed = smallest_disk
        .saturating_add(reserve)
        .saturating_add(BTRFS_OWN)
        .max(1 << 30);
    let explain = format!(
        "one sandbox's {} MiB disk (--base-disk-mb), the {} MiB reserve (--disk-pool-reserve-mb) and btrfs's own {} MiB need {} GiB",
        mib(smallest_disk),
        mib(reserve),
        mib(BTRFS_OWN),
        gib_ceil(needed)
    );
    match requested {
        Some(size) if size < needed => Err(PoolSizeError::AskedTooSmall {
            asked_gb: size >> 30,
            needs: explain,
            needed_gb: gib_ceil(needed),
        }),
        Some(size) => Ok(size),
        None => {
            let size = (free / DEFAULT_SHARE).min(DEFAULT_CEILING).max(needed);
            if size > free {
                return Err(PoolSizeError::NoRoom {
                    free_mib: mib(free),
                    needs: explain,
                });
            }
            Ok(size)
        }
    }
}

/// Refuses, before anything is set up, a `--disk-pool-gb` that cannot hold one sandbox of the
/// default disk beside the reserve.
pub fn check_asked_pool_size(
    pool_dir: &Path,
    asked: u64,
    smallest_disk: u64,
    reserve: u64,
) -> Result<(), DiskError> {
    new_pool_size(Some(asked), 0, smallest_disk, reserve)
        .map(|_| ())
        .map_err(|e| DiskError::TooSmall {
            path: pool_dir.to_path_buf(),
            message: e.to_string(),
        })
}

/// How many sandboxes of `disk` bytes a pool of `size` holds: each filled to its quota beside
/// the reserve, and by the overcommitted promise limit (what admission allows while disks are
/// mostly empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolHolds {
    pub filled: u64,
    pub promised: u64,
}

impl PoolHolds {
    pub fn of(size: u64, reserve: u64, overcommit: u64, disk: u64) -> Self {
        let usable = size.saturating_sub(reserve);
        Self {
            filled: usable.checked_div(disk).unwrap_or(0),
            promised: usable
                .saturating_mul(overcommit)
                .checked_div(disk)
                .unwrap_or(0),
        }
    }
}

/// Size and free space of a filesystem, as `statvfs` counts them for an unprivileged writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Space {
    pub size: u64,
    pub free: u64,
    pub read_only: bool,
}

impl Space {
    pub fn of(path: &Path) -> std::io::Result<Self> {
        let stat = rustix::fs::statvfs(path)?;
        Ok(Self {
            size: stat.f_blocks.saturating_mul(stat.f_frsize),
            free: stat.f_bavail.saturating_mul(stat.f_frsize),
            read_only: stat.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY),
        })
    }
}

/// The pool's state for reports: its space, what is promised to disks, and how far
/// promises may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolReport {
    pub space: Space,
    pub reserve: u64,
    pub overcommit: u64,
    pub promised: u64,
    pub promise_limit: u64,
}

fn mib(bytes: u64) -> u64 {
    bytes >> 20
}

/// Where and how big the pool is.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Directory holding one entry per sandbox; the pool is mounted here.
    pub dir: PathBuf,
    /// The pool's image file, made on first start.
    pub image: PathBuf,
    /// Size of the image: a new one is made this size (`None`: a share of the free space
    /// where it goes, see [`DEFAULT_SHARE`]); an existing smaller one grows to it in place,
    /// with its sandboxes running. A pool is never shrunk.
    pub size_bytes: Option<u64>,
    /// The default template's disk: a pool that cannot hold one beside its reserve refuses
    /// to open.
    pub smallest_disk_bytes: u64,
    /// Without quotas, sandbox directories are plain directories and disk sizes are not
    /// enforced.
    pub quotas: bool,
    /// Bytes of the pool no new disk may count on: when one sandbox fills its quota, its
    /// neighbours still have this much to write.
    pub reserve_bytes: u64,
    /// How many times the pool (less its reserve) the quotas of all disks may add up to.
    pub overcommit: u32,
}

#[derive(Debug, Clone)]
pub struct DiskPool {
    dir: PathBuf,
    image: PathBuf,
    quotas: bool,
    reserve: u64,
    overcommit: u64,
    /// `/sys/fs/btrfs/<fsid>`: qgroup usage without a syscall per sample.
    sysfs: Option<PathBuf>,
    /// Quota of every disk on the pool, by sandbox id, with the ticket of the
    /// [`DiskPromise`] that counts it (0 for disks found at start).
    promised: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, Promised>>>,
    /// The last ticket handed out.
    tickets: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// One remount at a time, however many creates find the pool failed.
    recovering: std::sync::Arc<tokio::sync::Mutex<()>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Promised {
    bytes: u64,
    ticket: u64,
}

/// What the pool counts for one sandbox's disk, given back when dropped. A promise made
/// later for the same sandbox replaces it: dropping the earlier one then leaves the later
/// one counted.
#[derive(Debug)]
pub struct DiskPromise {
    pool: DiskPool,
    sandbox_id: String,
    ticket: u64,
}

impl Drop for DiskPromise {
    fn drop(&mut self) {
        let mut promised = self.pool.promised.lock().unwrap_or_else(|e| e.into_inner());
        if promised
            .get(&self.sandbox_id)
            .is_some_and(|p| p.ticket == self.ticket)
        {
            promised.remove(&self.sandbox_id);
        }
    }
}

/// Used and total bytes of one sandbox's disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskUsage {
    pub used: u64,
    pub total: u64,
}

// Linux `_IOC` request numbers for the btrfs ioctls used here (magic 0x94).
const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (0x94 << 8) | nr
}
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; 4088],
}

/// `btrfs_ioctl_vol_args_v2`, for snapshots.
#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; 4040],
}

#[repr(C)]
#[derive(Default)]
struct QgroupLimit {
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

#[repr(C)]
struct QgroupLimitArgs {
    qgroupid: u64,
    lim: QgroupLimit,
}

#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

#[repr(C)]
struct FsInfoArgs {
    max_id: u64,
    num_devices: u64,
    fsid: [u8; 16],
    rest: [u8; 1024 - 32],
}

const SUBVOL_CREATE: u64 = ioc(IOC_WRITE, 14, size_of::<VolArgs>());
const SNAP_CREATE_V2: u64 = ioc(IOC_WRITE, 23, size_of::<VolArgsV2>());
const SNAP_DESTROY: u64 = ioc(IOC_WRITE, 15, size_of::<VolArgs>());
const INO_LOOKUP: u64 = ioc(IOC_READ | IOC_WRITE, 18, size_of::<InoLookupArgs>());
const FS_INFO: u64 = ioc(IOC_READ, 31, size_of::<FsInfoArgs>());
const QUOTA_CTL: u64 = ioc(IOC_READ | IOC_WRITE, 40, size_of::<QuotaCtlArgs>());
const QGROUP_LIMIT: u64 = ioc(IOC_READ, 43, size_of::<QgroupLimitArgs>());
const QUOTA_CTL_ENABLE: u64 = 1;
const QGROUP_LIMIT_MAX_RFER: u64 = 1;

/// # Safety
/// `arg` must point to the structure the request `request` expects.
unsafe fn ioctl<T>(fd: BorrowedFd<'_>, request: u64, arg: *mut T) -> std::io::Result<()> {
    // SAFETY: guaranteed by the caller.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn vol_args(name: &OsStr) -> std::io::Result<VolArgs> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= 4088 || bytes.contains(&b'/') || bytes.contains(&0) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a plain directory name",
        ));
    }
    let mut args = VolArgs {
        fd: 0,
        name: [0; 4088],
    };
    args.name[..bytes.len()].copy_from_slice(bytes);
    Ok(args)
}

fn open_dir(path: &Path) -> std::io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        path,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
    )?)
}

/// Limits what the subvolume at `path` may hold to `size_mb`.
fn set_quota(path: &Path, size_mb: u32) -> std::io::Result<()> {
    let subvolume = open_dir(path)?;
    let mut limit = QgroupLimitArgs {
        // Zero means the subvolume the descriptor is in.
        qgroupid: 0,
        lim: QgroupLimit {
            flags: QGROUP_LIMIT_MAX_RFER,
            max_rfer: u64::from(size_mb) * 1024 * 1024,
            ..QgroupLimit::default()
        },
    };
    // SAFETY: QGROUP_LIMIT takes a btrfs_ioctl_qgroup_limit_args, which `limit` is.
    unsafe { ioctl(subvolume.as_fd(), QGROUP_LIMIT, &mut limit) }
}

fn is_btrfs(path: &Path) -> bool {
    rustix::fs::statfs(path).is_ok_and(|s| s.f_type == BTRFS_SUPER_MAGIC)
}

fn is_mount_point(path: &Path) -> bool {
    let (Ok(dir), Some(Ok(parent))) = (
        std::fs::metadata(path),
        path.parent().map(std::fs::metadata),
    ) else {
        return false;
    };
    dir.dev() != parent.dev()
}

async fn run(program: &str, args: &[&OsStr]) -> Result<(), PoolCommandError> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|source| PoolCommandError::Spawn {
            program: program.to_owned(),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(PoolCommandError::Failed {
            program: program.to_owned(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// The rule a new disk is admitted by, apart from the pool it applies to.
#[derive(Debug, Clone, Copy)]
struct Admission {
    space: Space,
    reserve: u64,
    overcommit: u64,
    /// Quotas of the disks already on the pool.
    promised: u64,
}

impl Admission {
    fn check(&self, size: u64) -> Result<(), AdmissionRefusal> {
        if self.space.read_only {
            return Err(AdmissionRefusal::ReadOnly);
        }
        if self.space.free < size.saturating_add(self.reserve) {
            return Err(AdmissionRefusal::NoRoom {
                free_mib: mib(self.space.free),
                reserve_mib: mib(self.reserve),
                size_mib: mib(size),
            });
        }
        let limit = self.space.size.saturating_sub(self.reserve) * self.overcommit;
        if self.promised.saturating_add(size) > limit {
            return Err(AdmissionRefusal::PastLimit {
                promised_mib: mib(self.promised),
                size_mib: mib(size),
                limit_mib: mib(limit),
                overcommit: self.overcommit,
            });
        }
        Ok(())
    }
}

impl DiskPool {
    /// Mounts (making it first if needed) the pool and turns quotas on. A pool found
    /// read-only (its filesystem failed) is mounted afresh; when sandboxes still hold it, the
    /// pool opens read-only, reports so, and admits no disk until it recovers.
    pub async fn open(config: &PoolConfig) -> Result<Self, DiskError> {
        let fail = |message: String| DiskError::Pool {
            path: config.dir.clone(),
            message,
        };
        std::fs::create_dir_all(&config.dir).map_err(|e| fail(e.to_string()))?;
        let mut pool = Self {
            dir: config.dir.clone(),
            image: config.image.clone(),
            quotas: config.quotas,
            reserve: config.reserve_bytes,
            overcommit: u64::from(config.overcommit.max(1)),
            sysfs: None,
            promised: Default::default(),
            tickets: Default::default(),
            recovering: Default::default(),
        };
        if !config.quotas {
            return Ok(pool);
        }
        let mounted = is_mount_point(&config.dir) && is_btrfs(&config.dir);
        let grown = match config.size_bytes {
            Some(size) if config.image.exists() => {
                grow_image(&config.image, size).map_err(|e| fail(e.to_string()))?
            }
            _ => false,
        };
        if !mounted {
            if config.image.exists() {
                reserve_blocks(&config.image);
            } else {
                make_image(config).await.map_err(|e| fail(e.to_string()))?;
            }
            pool.mount().await.map_err(|e| fail(e.to_string()))?;
        }
        if grown {
            // A mounted pool's loop device learns the new size first; the filesystem then
            // takes the room online, under running sandboxes.
            if mounted {
                refresh_loop_device(&config.image)
                    .await
                    .map_err(|e| fail(e.to_string()))?;
            }
            run(
                "btrfs",
                &[
                    OsStr::new("filesystem"),
                    OsStr::new("resize"),
                    OsStr::new("max"),
                    config.dir.as_os_str(),
                ],
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
        }
        if mounted
            && Space::of(&config.dir).is_ok_and(|s| s.read_only)
            && let Err(e) = pool.recover().await
        {
            tracing::error!(pool = %config.dir.display(), error = %e, "the sandbox disk pool is read-only; no sandbox is admitted until it recovers");
        }
        let root = open_dir(&config.dir).map_err(|e| fail(e.to_string()))?;
        let mut info = FsInfoArgs {
            max_id: 0,
            num_devices: 0,
            fsid: [0; 16],
            rest: [0; 1024 - 32],
        };
        // SAFETY: FS_INFO fills a btrfs_ioctl_fs_info_args, which `info` is.
        unsafe { ioctl(root.as_fd(), FS_INFO, &mut info) }
            .map_err(|e| fail(format!("cannot read the pool's id: {e}")))?;
        pool.sysfs = Some(Path::new("/sys/fs/btrfs").join(format_uuid(&info.fsid)));
        if !Space::of(&config.dir).is_ok_and(|s| s.read_only) {
            enable_quotas(&root).map_err(|e| fail(e.to_string()))?;
            // Sandbox layers are the host's business only.
            let _ = std::fs::set_permissions(&config.dir, std::fs::Permissions::from_mode(0o700));
        }
        if let Ok(space) = Space::of(&config.dir) {
            let disk = config.smallest_disk_bytes;
            if space.size < disk.saturating_add(config.reserve_bytes) {
                let needed = disk + config.reserve_bytes + BTRFS_OWN;
                return Err(DiskError::TooSmall {
                    path: config.dir.clone(),
                    message: format!(
                        "it holds {} MiB, not one sandbox's {} MiB disk (--base-disk-mb) beside its {} MiB reserve (--disk-pool-reserve-mb); set --disk-pool-gb to at least {} (an existing pool grows in place, its sandboxes running)",
                        mib(space.size),
                        mib(disk),
                        mib(config.reserve_bytes),
                        gib_ceil(needed)
                    ),
                });
            }
            let holds = PoolHolds::of(space.size, config.reserve_bytes, pool.overcommit, disk);
            tracing::info!(
                pool = %config.dir.display(),
                size_mib = mib(space.size),
                free_mib = mib(space.free),
                reserve_mib = mib(config.reserve_bytes),
                default_disk_mib = mib(disk),
                filled_sandboxes = holds.filled,
                admitted_sandboxes = holds.promised,
                "sandbox disk pool: room for {} sandboxes of the default disk filled to their quota, {} admitted while mostly empty (--disk-overcommit {})",
                holds.filled,
                holds.promised,
                pool.overcommit
            );
        }
        let promised = pool
            .list()
            .into_iter()
            .filter_map(|id| {
                let bytes = pool.usage(&id)?.total;
                Some((id, Promised { bytes, ticket: 0 }))
            })
            .collect();
        *pool.promised.lock().unwrap_or_else(|e| e.into_inner()) = promised;
        tracing::info!(pool = %config.dir.display(), "sandbox disk pool ready, quotas on");
        Ok(pool)
    }

    async fn mount(&self) -> Result<(), PoolCommandError> {
        // commit=5: qgroup counters (the disk usage in sandbox metrics) move at each
        // transaction commit, so this bounds how stale they are (30 s by default).
        run(
            "mount",
            &[
                OsStr::new("-t"),
                OsStr::new("btrfs"),
                OsStr::new("-o"),
                OsStr::new("loop,noatime,commit=5"),
                self.image.as_os_str(),
                self.dir.as_os_str(),
            ],
        )
        .await
    }

    /// Mounts a read-only pool afresh: a btrfs that aborted a transaction stays read-only
    /// until its last mount goes, and comes back writable (at its last committed state) when
    /// mounted again. Fails while a sandbox still has its root on the pool.
    pub async fn recover(&self) -> Result<(), PoolRecoverError> {
        let _one_at_a_time = self.recovering.lock().await;
        if !self.quotas || !Space::of(&self.dir).is_ok_and(|s| s.read_only) {
            return Ok(());
        }
        tracing::warn!(pool = %self.dir.display(), "the sandbox disk pool is read-only; mounting it again");
        run("umount", &[self.dir.as_os_str()])
            .await
            .map_err(PoolRecoverError::InUse)?;
        self.mount().await?;
        let root = open_dir(&self.dir).map_err(|source| PoolRecoverError::Open {
            path: self.dir.clone(),
            source,
        })?;
        enable_quotas(&root)?;
        if Space::of(&self.dir).is_ok_and(|s| s.read_only) {
            return Err(PoolRecoverError::StillReadOnly {
                path: self.dir.clone(),
            });
        }
        tracing::info!(pool = %self.dir.display(), "the sandbox disk pool is writable again");
        Ok(())
    }

    /// The pool's space and promises; `None` without quotas (there is no pool).
    pub fn report(&self) -> Option<PoolReport> {
        if !self.quotas {
            return None;
        }
        let space = Space::of(&self.dir).ok()?;
        let promised = self
            .promised
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|p| p.bytes)
            .sum();
        Some(PoolReport {
            space,
            reserve: self.reserve,
            overcommit: self.overcommit,
            promised,
            promise_limit: space.size.saturating_sub(self.reserve) * self.overcommit,
        })
    }

    /// Counts a disk of `size_mb` for sandbox `sandbox_id` against the pool for as long as
    /// the returned promise lives, or says why the pool cannot take it now.
    pub fn admit(&self, sandbox_id: &str, size_mb: u32) -> Result<DiskPromise, DiskError> {
        let promise = |ticket| DiskPromise {
            pool: self.clone(),
            sandbox_id: sandbox_id.to_owned(),
            ticket,
        };
        let ticket = self
            .tickets
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        if !self.quotas {
            return Ok(promise(ticket));
        }
        let no_room = |message: String| DiskError::NoRoom {
            sandbox_id: sandbox_id.to_owned(),
            message,
        };
        let space = Space::of(&self.dir)
            .map_err(|e| no_room(format!("cannot read the disk pool's space: {e}")))?;
        let mut promised = self.promised.lock().unwrap_or_else(|e| e.into_inner());
        let others: u64 = promised
            .iter()
            .filter(|(id, _)| id.as_str() != sandbox_id)
            .map(|(_, p)| p.bytes)
            .sum();
        let size = u64::from(size_mb) << 20;
        Admission {
            space,
            reserve: self.reserve,
            overcommit: self.overcommit,
            promised: others,
        }
        .check(size)
        .map_err(|refusal| no_room(refusal.to_string()))?;
        promised.insert(
            sandbox_id.to_owned(),
            Promised {
                bytes: size,
                ticket,
            },
        );
        Ok(promise(ticket))
    }

    /// The promise of a disk this pool already counts (one found at start, or a sandbox an
    /// earlier owner let go of without removing its disk), to be given back when its new
    /// owner drops it; `None` when nothing is counted for `sandbox_id`.
    pub fn adopt(&self, sandbox_id: &str) -> Option<DiskPromise> {
        let promised = self.promised.lock().unwrap_or_else(|e| e.into_inner());
        let ticket = promised.get(sandbox_id)?.ticket;
        Some(DiskPromise {
            pool: self.clone(),
            sandbox_id: sandbox_id.to_owned(),
            ticket,
        })
    }

    /// Lets go of what the pool counts for `sandbox_id`, whoever holds its promise: its
    /// disk is gone or another name's now.
    fn forget(&self, sandbox_id: &str) {
        self.promised
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(sandbox_id);
    }

    /// Where the pool is mounted.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn enforces_quotas(&self) -> bool {
        self.quotas
    }

    /// The sandbox's directory (whether or not it exists).
    pub fn path(&self, sandbox_id: &str) -> PathBuf {
        self.dir.join(sandbox_id)
    }

    /// Makes the sandbox's directory with the [`layout`] entries: the writable layer and the
    /// overlay's work directory owned by `owner` (the sandbox's root on the host).
    pub fn create(&self, sandbox_id: &str, size_mb: u32, owner: u32) -> Result<PathBuf, DiskError> {
        let fail = |source| DiskError::Create {
            sandbox_id: sandbox_id.to_owned(),
            source,
        };
        let path = self.path(sandbox_id);
        if self.quotas {
            let parent = open_dir(&self.dir).map_err(fail)?;
            let mut args = vol_args(OsStr::new(sandbox_id)).map_err(fail)?;
            // SAFETY: SUBVOL_CREATE takes a btrfs_ioctl_vol_args, which `args` is.
            unsafe { ioctl(parent.as_fd(), SUBVOL_CREATE, &mut args) }.map_err(fail)?;
            set_quota(&path, size_mb).map_err(fail)?;
        } else {
            std::fs::create_dir(&path).map_err(fail)?;
        }
        for (name, owned) in [
            (layout::UPPER, true),
            (layout::WORK, true),
            (layout::LOWER, false),
            (layout::ROOT, false),
        ] {
            let sub = path.join(name);
            std::fs::create_dir(&sub).map_err(fail)?;
            if owned {
                std::os::unix::fs::chown(&sub, Some(owner), Some(owner)).map_err(fail)?;
            }
        }
        // The sandbox's boot works relative to this directory as the sandbox's root, which
        // must be able to search it; nobody else may.
        std::os::unix::fs::chown(&path, Some(owner), Some(owner)).map_err(fail)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).map_err(fail)?;
        Ok(path)
    }

    /// Gives the disk made for `from` to sandbox `to` with a quota of `size_mb`: the
    /// directory is renamed (a sandbox running on it keeps running) and what the pool counted
    /// for `from` is let go; [`Self::admit`] counted `to` already.
    pub fn hand_over(&self, from: &str, to: &str, size_mb: u32) -> Result<PathBuf, DiskError> {
        let fail = |source| DiskError::Create {
            sandbox_id: to.to_owned(),
            source,
        };
        let path = self.path(to);
        std::fs::rename(self.path(from), &path).map_err(fail)?;
        self.forget(from);
        if self.quotas {
            set_quota(&path, size_mb).map_err(fail)?;
        }
        Ok(path)
    }

    /// Copies the sandbox's directory to `parent/name` as it is at this moment: a btrfs
    /// snapshot (no data copied) when the sandbox has a subvolume, else a copy that keeps
    /// owners, modes, extended attributes and links. The caller holds the sandbox's
    /// processes still, so the copy is consistent.
    pub fn snapshot(
        &self,
        sandbox_id: &str,
        parent: &Path,
        name: &str,
    ) -> Result<(), DiskSnapshotError> {
        let source = self.path(sandbox_id);
        let meta = std::fs::symlink_metadata(&source).map_err(|e| DiskSnapshotError::Stat {
            path: source.clone(),
            source: e,
        })?;
        if meta.is_dir() && meta.ino() == SUBVOLUME_ROOT_INODE && is_btrfs(&source) {
            let fail = |e: std::io::Error| DiskSnapshotError::Snapshot {
                path: source.clone(),
                source: e,
            };
            let source_dir = open_dir(&source).map_err(fail)?;
            let target_dir = open_dir(parent).map_err(fail)?;
            let plain = vol_args(OsStr::new(name)).map_err(fail)?;
            let mut args = VolArgsV2 {
                fd: i64::from(source_dir.as_raw_fd()),
                transid: 0,
                flags: 0,
                unused: [0; 4],
                name: [0; 4040],
            };
            let len = plain.name.iter().position(|b| *b == 0).unwrap_or(0);
            if len >= args.name.len() {
                return Err(DiskSnapshotError::NameTooLong {
                    name: name.to_owned(),
                });
            }
            args.name[..len].copy_from_slice(&plain.name[..len]);
            // SAFETY: SNAP_CREATE_V2 takes a btrfs_ioctl_vol_args_v2, which `args` is.
            return unsafe { ioctl(target_dir.as_fd(), SNAP_CREATE_V2, &mut args) }.map_err(fail);
        }
        let target = parent.join(name);
        let output = std::process::Command::new("cp")
            .arg("-a")
            .arg("--reflink=auto")
            .arg("--")
            .arg(&source)
            .arg(&target)
            .output()
            .map_err(|e| DiskSnapshotError::RunCp {
                path: target.clone(),
                source: e,
            })?;
        if !output.status.success() {
            let _ = remove_tree(&target);
            return Err(DiskSnapshotError::Copy {
                from: source,
                to: target,
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
        Ok(())
    }

    /// Removes the sandbox's directory and everything in it; succeeds if it is already gone.
    pub fn remove(&self, sandbox_id: &str) -> Result<(), DiskError> {
        self.remove_in(&self.dir, sandbox_id)?;
        self.forget(sandbox_id);
        Ok(())
    }

    /// Removes `parent/name` (a subvolume or a plain tree) on the pool, e.g. a step layer.
    pub fn remove_at(&self, parent: &Path, name: &str) -> Result<(), DiskError> {
        self.remove_in(parent, name)
    }

    fn remove_in(&self, parent_dir: &Path, sandbox_id: &str) -> Result<(), DiskError> {
        let fail = |source| DiskError::Remove {
            sandbox_id: sandbox_id.to_owned(),
            source,
        };
        let path = parent_dir.join(sandbox_id);
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(fail(e)),
        };
        if meta.is_dir() && meta.ino() == SUBVOLUME_ROOT_INODE && is_btrfs(&path) {
            let parent = open_dir(parent_dir).map_err(fail)?;
            let mut args = vol_args(OsStr::new(sandbox_id)).map_err(fail)?;
            // SAFETY: SNAP_DESTROY takes a btrfs_ioctl_vol_args, which `args` is.
            return unsafe { ioctl(parent.as_fd(), SNAP_DESTROY, &mut args) }.map_err(fail);
        }
        remove_tree(&path).map_err(fail)
    }

    /// Names of every sandbox directory in the pool (dot names hold the node's own data,
    /// such as step layers).
    pub fn list(&self) -> Vec<String> {
        std::fs::read_dir(&self.dir)
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .filter(|e| !e.file_name().as_encoded_bytes().starts_with(b"."))
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// What the sandbox's disk holds against its limit (from the qgroup's counters).
    pub fn usage(&self, sandbox_id: &str) -> Option<DiskUsage> {
        let sysfs = self.sysfs.as_ref()?;
        let dir = open_dir(&self.path(sandbox_id)).ok()?;
        let mut lookup = InoLookupArgs {
            treeid: 0,
            objectid: SUBVOLUME_ROOT_INODE,
            name: [0; 4080],
        };
        // SAFETY: INO_LOOKUP takes a btrfs_ioctl_ino_lookup_args, which `lookup` is.
        unsafe { ioctl(dir.as_fd(), INO_LOOKUP, &mut lookup) }.ok()?;
        let qgroup = sysfs.join("qgroups").join(format!("0_{}", lookup.treeid));
        let read = |name: &str| -> Option<u64> {
            std::fs::read_to_string(qgroup.join(name))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        Some(DiskUsage {
            used: read("referenced")?,
            total: read("max_referenced")?,
        })
    }

    /// Unmounts the pool when no sandbox directory is left in it (on a clean shutdown), so
    /// the node leaves no mount behind; a pool with sandboxes stays mounted for them.
    pub async fn release_if_empty(&self) {
        if !self.quotas || !self.list().is_empty() || !is_mount_point(&self.dir) {
            return;
        }
        match run("umount", &[self.dir.as_os_str()]).await {
            Ok(()) => tracing::info!(pool = %self.dir.display(), "sandbox disk pool unmounted"),
            Err(e) => tracing::warn!(error = %e, "cannot unmount the sandbox disk pool"),
        }
    }
}

async fn make_image(config: &PoolConfig) -> Result<(), PoolSetupError> {
    let parent = config.image.parent().unwrap_or(Path::new("/"));
    let free = Space::of(parent)
        .map_err(|source| PoolSetupError::Space {
            path: parent.to_owned(),
            source,
        })?
        .free;
    let size = new_pool_size(
        config.size_bytes,
        free,
        config.smallest_disk_bytes,
        config.reserve_bytes,
    )?;
    let staging = config.image.with_extension("partial");
    let file = File::create(&staging).map_err(|source| PoolSetupError::Open {
        path: staging.clone(),
        source,
    })?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(|source| PoolSetupError::Io {
            path: staging.clone(),
            source,
        })?;
    // On a copy-on-write host filesystem an allocated block still needs a new one at each
    // overwrite; without copy-on-write (set while the file is empty) it is written in place.
    if let Ok(flags) = rustix::fs::ioctl_getflags(&file) {
        let _ = rustix::fs::ioctl_setflags(&file, flags | rustix::fs::IFlags::NOCOW);
    }
    if let Err(e) = rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, size) {
        drop(file);
        let _ = std::fs::remove_file(&staging);
        return Err(PoolSetupError::Allocate {
            image: config.image.clone(),
            size_mib: mib(size),
            source: e,
        });
    }
    drop(file);
    tracing::info!(image = %config.image.display(), size_mib = size >> 20, "making the sandbox disk pool");
    run(
        "mkfs.btrfs",
        &[
            OsStr::new("-q"),
            OsStr::new("-m"),
            OsStr::new("single"),
            staging.as_os_str(),
        ],
    )
    .await
    .map_err(PoolSetupError::Mkfs)?;
    std::fs::rename(&staging, &config.image).map_err(|source| PoolSetupError::Io {
        path: config.image.clone(),
        source,
    })
}

/// Extends the pool image to `size` bytes, all allocated; says whether it grew. A smaller
/// `size` leaves it as it is: a pool is never shrunk under its sandboxes.
fn grow_image(image: &Path, size: u64) -> Result<bool, PoolSetupError> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(image)
        .map_err(|source| PoolSetupError::Open {
            path: image.to_owned(),
            source,
        })?;
    let len = file
        .metadata()
        .map_err(|source| PoolSetupError::Io {
            path: image.to_owned(),
            source,
        })?
        .len();
    if size <= len {
        if size < len {
            tracing::warn!(image = %image.display(), size_mib = mib(len), asked_mib = mib(size), "the sandbox disk pool is larger than --disk-pool-gb asks; it is never shrunk");
        }
        return Ok(false);
    }
    rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, size).map_err(
        |source| PoolSetupError::Grow {
            image: image.to_owned(),
            from_mib: mib(len),
            to_mib: mib(size),
            source,
        },
    )?;
    tracing::info!(image = %image.display(), from_mib = mib(len), to_mib = mib(size), "growing the sandbox disk pool");
    Ok(true)
}

/// Has the loop device behind a mounted pool image read the image's new size.
async fn refresh_loop_device(image: &Path) -> Result<(), PoolSetupError> {
    let out = tokio::process::Command::new("losetup")
        .arg("-j")
        .arg(image)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|source| PoolCommandError::Spawn {
            program: "losetup".to_owned(),
            source,
        })?;
    let listing = String::from_utf8_lossy(&out.stdout);
    let device = listing
        .lines()
        .find_map(|line| line.split_once(':').map(|(device, _)| device.to_owned()))
        .ok_or_else(|| PoolSetupError::NoLoopDevice {
            image: image.to_owned(),
        })?;
    Ok(run("losetup", &[OsStr::new("-c"), OsStr::new(&device)]).await?)
}

/// Gives a pool image made sparse (by an older version) all its blocks, so that a host
/// filesystem filling up can no longer fail the pool's writes. Keeps going without them when
/// the host has no room, saying so.
fn reserve_blocks(image: &Path) {
    let Ok(file) = std::fs::OpenOptions::new().write(true).open(image) else {
        return;
    };
    let Ok(meta) = file.metadata() else { return };
    let allocated = meta.blocks().saturating_mul(512);
    if allocated >= meta.len() {
        return;
    }
    match rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::KEEP_SIZE, 0, meta.len()) {
        Ok(()) => {
            tracing::info!(image = %image.display(), allocated_mib = mib(meta.len() - allocated), "allocated the sandbox disk pool's missing blocks")
        }
        Err(e) => tracing::warn!(
            image = %image.display(),
            missing_mib = mib(meta.len() - allocated),
            error = %e,
            "the sandbox disk pool's image is sparse and its blocks cannot be allocated: if the host filesystem fills, the pool fails"
        ),
    }
}

fn enable_quotas(root: &OwnedFd) -> Result<(), PoolSetupError> {
    let mut ctl = QuotaCtlArgs {
        cmd: QUOTA_CTL_ENABLE,
        status: 0,
    };
    // SAFETY: QUOTA_CTL takes a btrfs_ioctl_quota_ctl_args, which `ctl` is.
    unsafe { ioctl(root.as_fd(), QUOTA_CTL, &mut ctl) }.map_err(PoolSetupError::Quotas)
}

fn format_uuid(bytes: &[u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Removes a directory tree without recursion and with at most two directories open: every
/// nested directory is first moved up to the top of the tree, so a tree deeper than the
/// open-file limit or the stack (which a sandbox can build) goes like a flat one. The walk
/// never enters another mount: a mount point in the tree (or the tree itself being one) is
/// left in place with the directories holding it, and once everything else is gone the
/// removal fails with `ResourceBusy` naming the path.
pub fn remove_tree(path: &Path) -> std::io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} does not name a directory to remove", path.display()),
        ));
    };
    let parent = match open_dir(if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    }) {
        Ok(fd) => fd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let top = match sandbar_fs::open_dir_on_same_mount(&parent, name) {
        Ok(Some(fd)) => fd,
        Ok(None) => return Err(mount_points_kept(path, 1)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e)
            if e.raw_os_error() == Some(libc::ENOTDIR) || e.raw_os_error() == Some(libc::ELOOP) =>
        {
            return Ok(rustix::fs::unlinkat(&parent, name, AtFlags::empty())?);
        }
        Err(e) => return Err(e),
    };
    let mut moved = 0u64;
    let mut kept = 0u64;
    let mut pending: Vec<OsString> = Vec::new();
    empty_into(&top, &top, &mut pending, &mut moved, &mut kept)?;
    while let Some(name) = pending.pop() {
        let Some(dir) = sandbar_fs::open_dir_on_same_mount(&top, &name)? else {
            kept += 1;
            continue;
        };
        empty_into(&dir, &top, &mut pending, &mut moved, &mut kept)?;
        drop(dir);
        match rustix::fs::unlinkat(&top, name.as_os_str(), AtFlags::REMOVEDIR) {
            // A directory holding a mount point kept below it stays too.
            Err(rustix::io::Errno::NOTEMPTY | rustix::io::Errno::BUSY) if kept > 0 => {}
            other => other?,
        }
    }
    drop(top);
    if kept > 0 {
        return Err(mount_points_kept(path, kept));
    }
    Ok(rustix::fs::unlinkat(&parent, name, AtFlags::REMOVEDIR)?)
}

fn mount_points_kept(path: &Path, count: u64) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ResourceBusy,
        format!(
            "{} holds {count} mount point(s), left in place",
            path.display()
        ),
    )
}

/// Unlinks every non-directory in `dir` and moves every directory in it to `top` under a
/// fresh name, recording those names in `pending`. Mount points stay where they are and are
/// counted in `kept`.
fn empty_into(
    dir: &OwnedFd,
    top: &OwnedFd,
    pending: &mut Vec<OsString>,
    moved: &mut u64,
    kept: &mut u64,
) -> std::io::Result<()> {
    let mut left: std::collections::HashSet<OsString> = std::collections::HashSet::new();
    loop {
        // Collect first: changing a directory while reading it may skip entries.
        let mut entries = Vec::new();
        let mut reader = rustix::fs::Dir::read_from(dir)?;
        for entry in reader.by_ref() {
            let entry = entry?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." || left.contains(OsStr::from_bytes(name)) {
                continue;
            }
            entries.push((
                OsStr::from_bytes(name).to_owned(),
                entry.file_type() == rustix::fs::FileType::Directory,
            ));
        }
        if entries.is_empty() {
            return Ok(());
        }
        for (name, is_dir) in entries {
            let is_dir = is_dir
                || (rustix::fs::statat(dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok_and(|s| rustix::fs::FileType::from_raw_mode(s.st_mode).is_dir()));
            if !is_dir {
                match rustix::fs::unlinkat(dir, name.as_os_str(), AtFlags::empty()) {
                    Ok(()) => {}
                    // A file something is bind-mounted on.
                    Err(rustix::io::Errno::BUSY) => {
                        *kept += 1;
                        left.insert(name);
                    }
                    Err(e) => return Err(e.into()),
                }
                continue;
            }
            if std::ptr::eq(dir, top) {
                pending.push(name);
                continue;
            }
            // The name it moves to may be taken: by a directory an interrupted removal of the
            // same tree moved there, or by one the tree itself holds under that name. Such a
            // name is skipped, never replaced (a plain rename would replace an empty
            // directory).
            loop {
                *moved += 1;
                let fresh = OsString::from(format!(".removing-{moved}"));
                let fresh_c = CString::new(fresh.as_bytes()).map_err(std::io::Error::other)?;
                match rustix::fs::renameat_with(
                    dir,
                    name.as_os_str(),
                    top,
                    fresh_c.as_c_str(),
                    rustix::fs::RenameFlags::NOREPLACE,
                ) {
                    Ok(()) => pending.push(fresh),
                    Err(rustix::io::Errno::EXIST) => continue,
                    // A mount point cannot be moved; it stays where it is, untouched.
                    Err(rustix::io::Errno::BUSY) => {
                        *kept += 1;
                        left.insert(name);
                    }
                    Err(e) => return Err(e.into()),
                }
                break;
            }
        }
        if std::ptr::eq(dir, top) {
            // Directories at the top stay where they are until popped.
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn a_default_pool_is_a_quarter_of_the_free_space_with_a_ceiling() {
        assert_eq!(
            new_pool_size(None, 40 * GIB, 2048 * MIB, 512 * MIB),
            Ok(10 * GIB)
        );
        assert_eq!(
            new_pool_size(None, 4000 * GIB, 2048 * MIB, 512 * MIB),
            Ok(DEFAULT_CEILING)
        );
    }

    #[test]
    fn a_default_pool_grows_to_hold_one_default_disk_when_the_share_falls_short() {
        let needed = 2048 * MIB + 512 * MIB + BTRFS_OWN;
        assert_eq!(
            new_pool_size(None, 8 * GIB, 2048 * MIB, 512 * MIB),
            Ok(needed)
        );
        let short = new_pool_size(None, 2 * GIB, 2048 * MIB, 512 * MIB)
            .expect_err("no room")
            .to_string();
        assert!(
            short.contains("2048 MiB free") && short.contains("--disk-pool-gb"),
            "{short}"
        );
    }

    #[test]
    fn an_asked_pool_must_hold_one_default_disk() {
        assert_eq!(
            new_pool_size(Some(8 * GIB), 1, 2048 * MIB, 512 * MIB),
            Ok(8 * GIB)
        );
        let small = new_pool_size(Some(2 * GIB), 100 * GIB, 2048 * MIB, 512 * MIB)
            .expect_err("too small")
            .to_string();
        assert!(small.contains("--disk-pool-gb 2 is too small"), "{small}");
        assert!(small.contains("at least 3"), "{small}");
    }

    #[test]
    fn what_a_pool_holds_filled_and_promised() {
        let holds = PoolHolds::of(8704 * MIB, 512 * MIB, 250, 2048 * MIB);
        assert_eq!(
            holds,
            PoolHolds {
                filled: 4,
                promised: 1000
            }
        );
        assert_eq!(PoolHolds::of(GIB, 2 * GIB, 250, 2048 * MIB).filled, 0);
        assert_eq!(
            PoolHolds::of(GIB, 0, 1, 0),
            PoolHolds {
                filled: 0,
                promised: 0
            }
        );
    }

    #[test]
    fn request_numbers_match_the_kernel_headers() {
        assert_eq!(SUBVOL_CREATE, 0x5000_940e);
        assert_eq!(SNAP_DESTROY, 0x5000_940f);
        assert_eq!(QGROUP_LIMIT, 0x8030_942b);
        assert_eq!(QUOTA_CTL, 0xc010_9428);
        assert_eq!(INO_LOOKUP, 0xd000_9412);
        assert_eq!(FS_INFO, 0x8400_941f);
    }

    #[test]
    fn removes_a_tree_deeper_than_the_open_file_limit() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let top = tmp.path().join("tree");
        std::fs::create_dir(&top).expect("mkdir");
        // Build the chain with *at calls so its depth is not limited by PATH_MAX.
        let mut dir = open_dir(&top).expect("open");
        let depth = 5000;
        for i in 0..depth {
            rustix::fs::mkdirat(&dir, "d", Mode::from_raw_mode(0o755)).expect("mkdirat");
            if i % 7 == 0 {
                let f = rustix::fs::openat(
                    &dir,
                    "f",
                    OFlags::CREATE | OFlags::WRONLY | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o644),
                )
                .expect("file");
                drop(f);
                rustix::fs::symlinkat("/etc/passwd", &dir, "link").expect("symlink");
            }
            dir = rustix::fs::openat(
                &dir,
                "d",
                OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .expect("descend");
        }
        drop(dir);
        // Keep the process's descriptor limit far below the depth while removing.
        let before = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        rustix::process::setrlimit(
            rustix::process::Resource::Nofile,
            rustix::process::Rlimit {
                current: Some(64),
                maximum: before.maximum,
            },
        )
        .expect("lower the limit");
        let result = remove_tree(&top);
        rustix::process::setrlimit(rustix::process::Resource::Nofile, before).expect("restore");
        result.expect("remove");
        assert!(!top.exists());
        assert!(Path::new("/etc/passwd").exists());
    }

    /// Gives the calling test thread a mount namespace of its own with private propagation,
    /// so what it mounts never reaches the host and vanishes with the thread. `false` where
    /// that is not allowed (not root).
    fn private_mount_namespace() -> bool {
        // SAFETY: only the mount namespace (and with it this thread's fs context) is unshared;
        // no descriptor table is.
        if unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNS) }.is_err() {
            return false;
        }
        rustix::mount::mount_change(
            "/",
            rustix::mount::MountPropagationFlags::PRIVATE
                | rustix::mount::MountPropagationFlags::REC,
        )
        .is_ok()
    }

    fn mount_tmpfs(at: &Path) {
        rustix::mount::mount(
            "test",
            at,
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            None,
        )
        .expect("mount tmpfs");
        std::fs::write(at.join("inside"), b"kept").expect("write into the mount");
    }

    #[test]
    fn removal_never_enters_a_mount_and_goes_once_it_is_detached() {
        if !private_mount_namespace() {
            eprintln!("skipped: needs root for a private mount namespace");
            return;
        }
        let tmp = tempfile::tempdir().expect("tempdir");
        let top = tmp.path().join("tree");
        for dir in ["a/b/c", "a/mnt", "top-mnt", "plain"] {
            std::fs::create_dir_all(top.join(dir)).expect("mkdir");
        }
        std::fs::write(top.join("a/b/c/f"), b"x").expect("file");
        std::fs::write(top.join("file"), b"x").expect("file");
        mount_tmpfs(&top.join("a/mnt"));
        mount_tmpfs(&top.join("top-mnt"));

        let err = remove_tree(&top).expect_err("mount points stop the removal");
        assert_eq!(err.kind(), std::io::ErrorKind::ResourceBusy);
        assert!(err.to_string().contains("2 mount point(s)"), "{err}");
        // Nothing inside the mounts was touched; everything else went.
        assert_eq!(
            std::fs::read(top.join("a/mnt/inside")).expect("kept"),
            b"kept"
        );
        assert_eq!(
            std::fs::read(top.join("top-mnt/inside")).expect("kept"),
            b"kept"
        );
        assert!(!top.join("file").exists());
        assert!(!top.join("plain").exists());
        assert!(!top.join("a/b").exists());

        // A tree that is itself a mount point is refused whole.
        let err = remove_tree(&top.join("top-mnt")).expect_err("a mount point");
        assert_eq!(err.kind(), std::io::ErrorKind::ResourceBusy);
        assert!(top.join("top-mnt/inside").exists());

        assert_eq!(
            crate::storage::mounts::detach_below(&top).expect("detach"),
            2
        );
        remove_tree(&top).expect("remove once detached");
        assert!(!top.exists());
    }

    fn admission(free_mib: u64, promised_mib: u64) -> Admission {
        Admission {
            space: Space {
                size: 10 << 30,
                free: free_mib << 20,
                read_only: false,
            },
            reserve: 512 << 20,
            overcommit: 4,
            promised: promised_mib << 20,
        }
    }

    #[test]
    fn a_disk_is_admitted_when_it_could_fill_up_and_leave_the_reserve() {
        assert_eq!(admission(2560, 0).check(2 << 30), Ok(()));
        let refused = admission(2559, 0)
            .check(2 << 30)
            .expect_err("refused")
            .to_string();
        assert!(refused.contains("disk pool has 2559 MiB free"), "{refused}");
        assert!(refused.contains("512 MiB in reserve"), "{refused}");
    }

    #[test]
    fn quotas_add_up_to_the_overcommit_limit_and_no_further() {
        // 4 x (10 GiB - 512 MiB) = 38912 MiB.
        assert_eq!(admission(9000, 38912 - 2048).check(2 << 30), Ok(()));
        let refused = admission(9000, 38912 - 2047)
            .check(2 << 30)
            .expect_err("refused")
            .to_string();
        assert!(refused.contains("limit of 38912 MiB (4x"), "{refused}");
    }

    #[test]
    fn a_read_only_pool_admits_nothing() {
        let mut rule = admission(9000, 0);
        rule.space.read_only = true;
        assert!(
            rule.check(1 << 20)
                .expect_err("refused")
                .to_string()
                .contains("read-only")
        );
    }

    #[test]
    fn a_removal_goes_past_names_an_interrupted_one_left() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let top = tmp.path().join("tree");
        // What a removal stopped halfway leaves at the top (nested directories moved up under
        // its names), beside a tree it had not reached yet.
        for dir in [".removing-1/a/b", ".removing-2", "usr/lib/x", "etc/deep/er"] {
            std::fs::create_dir_all(top.join(dir)).expect("mkdir");
        }
        for file in [".removing-1/a/b/f", "usr/lib/x/g", "etc/deep/er/h"] {
            std::fs::write(top.join(file), b"x").expect("write");
        }
        remove_tree(&top).expect("remove");
        assert!(!top.exists());
    }

    #[test]
    fn removing_a_missing_tree_succeeds() {
        let tmp = tempfile::tempdir().expect("tempdir");
        remove_tree(&tmp.path().join("absent")).expect("absent is fine");
    }

    #[test]
    fn formats_a_filesystem_id_like_sysfs() {
        let id = [
            0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ];
        assert_eq!(format_uuid(&id), "01234567-89ab-cdef-0123-456789abcdef");
    }
}
