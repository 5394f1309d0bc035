//! Volumes on the host: one directory per volume, `<pool>/.volumes/<team>/<volume>`, in the
//! sandbox disk pool (a dot name, so the pool's sweep and its empty check skip it) and never
//! inside a sandbox's directory, so a volume outlives every sandbox. Being on the pool's own
//! filesystem also keeps host paths out of the sandbox: a bind mount's root, which every
//! sandbox reads in `/proc/self/mountinfo`, is its path within its filesystem, here
//! `/.volumes/<team>/<volume>`, where it would be the full host path on the host's root.
//!
//! Files are stored with the ids sandboxes see (0–65535, like template layers): the boot
//! id-maps the directory through each sandbox's user namespace. Sandboxes write into these
//! trees, so every host-side operation resolves paths beneath the volume's root with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` (a link that leads out, absolute or by
//! `..`, fails with `EXDEV`), and acts on the last component without following it.

#![deny(clippy::disallowed_methods)]

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;
use sandbar_core::Volume;
use sandbar_core::volumes::{
    EntryKind, EntryOwner, EntryStat, OpenedFile, StagedFile, VolumeHost, VolumeIoError, VolumePath,
};

/// Mode of a new volume's root: every sandbox user may create files in it.
const ROOT_MODE: u32 = 0o777;
const FILE_MODE: u32 = 0o644;
const DIR_MODE: u32 = 0o755;
/// Deepest listing served, and most entries in one answer.
const MAX_LIST_DEPTH: u32 = 32;
const MAX_LIST_ENTRIES: usize = 100_000;
/// Directory (next to the teams') where removed trees wait to be deleted.
const TRASH: &str = ".trash";

#[derive(Debug, Clone)]
pub struct HostVolumes {
    root: PathBuf,
}

fn io_err(path: &str, e: impl std::fmt::Display) -> VolumeIoError {
    VolumeIoError::Io {
        path: path.to_owned(),
        message: e.to_string(),
    }
}

fn errno(path: &str, e: Errno) -> VolumeIoError {
    match e {
        Errno::NOENT => VolumeIoError::NotFound(path.to_owned()),
        Errno::XDEV => VolumeIoError::Escapes(path.to_owned()),
        Errno::NOTDIR => VolumeIoError::NotADirectory(path.to_owned()),
        Errno::ISDIR => VolumeIoError::IsADirectory(path.to_owned()),
        Errno::EXIST => VolumeIoError::AlreadyExists(path.to_owned()),
        Errno::LOOP => VolumeIoError::Symlink(path.to_owned()),
        other => io_err(path, std::io::Error::from(other)),
    }
}

/// Team and volume ids become directory names: only plain names are accepted.
fn plain(name: &str) -> Result<&str, VolumeIoError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(name)
    } else {
        Err(io_err(name, "not a valid directory name"))
    }
}

fn time(secs: i64, nanos: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(secs, u32::try_from(nanos).unwrap_or(0)).unwrap_or_default()
}

fn beneath(
    dir: impl AsFd,
    path: &str,
    flags: OFlags,
    mode: u32,
    shown: &str,
) -> Result<OwnedFd, VolumeIoError> {
    sandbar_fs::open_at(
        dir,
        path,
        flags,
        Mode::from_raw_mode(mode),
        sandbar_fs::Links::Beneath,
    )
    .map_err(|e| errno(shown, e))
}

/// What a file that is neither regular nor a directory is, as an error names it.
fn special_kind(kind: std::fs::FileType) -> &'static str {
    if kind.is_fifo() {
        "fifo"
    } else if kind.is_socket() {
        "socket"
    } else if kind.is_char_device() {
        "character device"
    } else if kind.is_block_device() {
        "block device"
    } else if kind.is_symlink() {
        "symlink"
    } else {
        "special file"
    }
}

/// Describes `name` in `dir` without following it.
fn entry_at(dir: impl AsFd, name: &OsStr, shown: &str) -> Result<EntryStat, VolumeIoError> {
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| errno(shown, e))?;
    describe(fd, name, shown)
}

fn describe(fd: OwnedFd, name: &OsStr, shown: &str) -> Result<EntryStat, VolumeIoError> {
    let file = File::from(fd);
    let meta = file.metadata().map_err(|e| io_err(shown, e))?;
    let kind = if meta.file_type().is_symlink() {
        EntryKind::Symlink
    } else if meta.is_dir() {
        EntryKind::Directory
    } else if meta.is_file() {
        EntryKind::File
    } else {
        EntryKind::Unknown
    };
    let target = if kind == EntryKind::Symlink {
        rustix::fs::readlinkat(&file, "", Vec::new())
            .ok()
            .map(|t| String::from_utf8_lossy(t.as_bytes()).into_owned())
    } else {
        None
    };
    Ok(EntryStat {
        name: String::from_utf8_lossy(name.as_bytes()).into_owned(),
        path: shown.to_owned(),
        kind,
        size: meta.size(),
        mode: meta.permissions().mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        atime: time(meta.atime(), meta.atime_nsec()),
        mtime: time(meta.mtime(), meta.mtime_nsec()),
        ctime: time(meta.ctime(), meta.ctime_nsec()),
        target,
    })
}

fn apply_owner(
    fd: impl AsFd,
    owner: EntryOwner,
    default_mode: Option<u32>,
    shown: &str,
) -> Result<(), VolumeIoError> {
    if owner.uid.is_some() || owner.gid.is_some() {
        rustix::fs::fchown(
            &fd,
            owner.uid.map(rustix::fs::Uid::from_raw),
            owner.gid.map(rustix::fs::Gid::from_raw),
        )
        .map_err(|e| errno(shown, e))?;
    }
    if let Some(mode) = owner.mode.or(default_mode) {
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)).map_err(|e| errno(shown, e))?;
    }
    Ok(())
}

/// Owner for parent directories made on the way: the entry's ids, the default mode.
fn parent_owner(owner: EntryOwner) -> EntryOwner {
    EntryOwner {
        mode: Some(DIR_MODE),
        ..owner
    }
}

/// Where a node keeps its volumes: in the disk pool mounted on `<data>/sandboxes`.
pub fn volumes_root(data_dir: &Path) -> PathBuf {
    data_dir.join("sandboxes").join(".volumes")
}

/// The host directory of a volume of a node whose data directory is `data_dir`.
pub fn volume_dir(
    data_dir: &Path,
    team_id: &str,
    volume_id: &str,
) -> Result<PathBuf, VolumeIoError> {
    Ok(volumes_root(data_dir)
        .join(plain(team_id)?)
        .join(plain(volume_id)?))
}

impl HostVolumes {
    /// Volumes under `root` (created 0700 when missing).
    #[allow(
        clippy::disallowed_methods,
        reason = "the server's own directories under the pool, never a volume's contents"
    )]
    pub fn open(root: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(root.join(TRASH))?;
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))?;
        let volumes = Self {
            root: root.to_owned(),
        };
        // Trees whose removal a crash interrupted.
        if let Ok(entries) = std::fs::read_dir(root.join(TRASH)) {
            for entry in entries.flatten() {
                if let Err(e) = crate::storage::disks::remove_tree(&entry.path()) {
                    tracing::warn!(path = %entry.path().display(), error = %e, "cannot empty volume trash");
                }
            }
        }
        Ok(volumes)
    }

    /// The host directory of a volume.
    pub fn dir(&self, team_id: &str, volume_id: &str) -> Result<PathBuf, VolumeIoError> {
        Ok(self.root.join(plain(team_id)?).join(plain(volume_id)?))
    }

    fn root_fd(&self, volume: &Volume) -> Result<OwnedFd, VolumeIoError> {
        let dir = self.dir(&volume.team_id, &volume.id)?;
        rustix::fs::open(
            &dir,
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            io_err(
                &volume.id,
                format!("cannot open the volume's directory: {e}"),
            )
        })
    }

    /// The directory holding `path`'s last component, and that component. With `create`,
    /// missing directories on the way are made (owned as `owner` says).
    fn parent_of(
        &self,
        root: &OwnedFd,
        path: &VolumePath,
        create: Option<EntryOwner>,
    ) -> Result<(OwnedFd, String), VolumeIoError> {
        let parts = path.components();
        let Some((name, dirs)) = parts.split_last() else {
            return Err(VolumeIoError::Root);
        };
        let mut prefix = String::from(".");
        let mut dir = beneath(root, ".", OFlags::PATH | OFlags::DIRECTORY, 0, "/")?;
        for part in dirs {
            prefix = format!("{prefix}/{part}");
            let shown = &prefix[1..];
            let flags = OFlags::PATH | OFlags::DIRECTORY;
            dir = match (beneath(root, &prefix, flags, 0, shown), create) {
                (Ok(fd), _) => fd,
                (Err(VolumeIoError::NotFound(_)), Some(owner)) => {
                    match rustix::fs::mkdirat(&dir, part.as_str(), Mode::from_raw_mode(DIR_MODE)) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(errno(shown, e)),
                    }
                    let made = beneath(
                        root,
                        &prefix,
                        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW,
                        0,
                        shown,
                    )?;
                    apply_owner(&made, parent_owner(owner), None, shown)?;
                    made
                }
                (Err(e), _) => return Err(e),
            };
        }
        Ok((dir, name.clone()))
    }

    fn trash_tree(&self, parent: &OwnedFd, name: &str, shown: &str) -> Result<(), VolumeIoError> {
        let trash = self.root.join(TRASH);
        let fresh = sandbar_core::ids::new_uuid();
        let trash_fd = rustix::fs::open(
            &trash,
            OFlags::DIRECTORY | OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err(shown, e))?;
        rustix::fs::renameat(parent, name, &trash_fd, fresh.as_str())
            .map_err(|e| errno(shown, e))?;
        crate::storage::disks::remove_tree(&trash.join(&fresh)).map_err(|e| io_err(shown, e))
    }

    fn walk(
        &self,
        dir: &OwnedFd,
        shown: &str,
        depth: u32,
        out: &mut Vec<EntryStat>,
    ) -> Result<(), VolumeIoError> {
        let mut names = Vec::new();
        let reader = rustix::fs::Dir::read_from(dir).map_err(|e| errno(shown, e))?;
        for entry in reader {
            let entry = entry.map_err(|e| errno(shown, e))?;
            let name = entry.file_name().to_bytes();
            if name != b"." && name != b".." {
                names.push(OsStr::from_bytes(name).to_owned());
            }
        }
        names.sort();
        for name in names {
            if out.len() >= MAX_LIST_ENTRIES {
                return Err(io_err(
                    shown,
                    format!("more than {MAX_LIST_ENTRIES} entries; list a smaller depth"),
                ));
            }
            let child_path = format!(
                "{}/{}",
                shown.trim_end_matches('/'),
                String::from_utf8_lossy(name.as_bytes())
            );
            let stat = match entry_at(dir, &name, &child_path) {
                Ok(stat) => stat,
                // Removed while listing.
                Err(VolumeIoError::NotFound(_)) => continue,
                Err(e) => return Err(e),
            };
            let is_dir = stat.kind == EntryKind::Directory;
            out.push(stat);
            if is_dir && depth > 1 {
                let child = rustix::fs::openat(
                    dir,
                    &name,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| errno(&child_path, e))?;
                self.walk(&child, &child_path, depth - 1, out)?;
            }
        }
        Ok(())
    }
}

/// A file being written beside its target in a volume, by the descriptor of the directory
/// that was resolved beneath the volume's root when it was made.
struct Staged {
    file: File,
    parent: OwnedFd,
    temp: String,
    name: String,
    owner: EntryOwner,
    shown: String,
    committed: bool,
}

impl StagedFile for Staged {
    fn file(&self) -> &File {
        &self.file
    }

    fn commit(mut self: Box<Self>) -> Result<EntryStat, VolumeIoError> {
        apply_owner(&self.file, self.owner, Some(FILE_MODE), &self.shown)?;
        rustix::fs::renameat(
            &self.parent,
            self.temp.as_str(),
            &self.parent,
            self.name.as_str(),
        )
        .map_err(|e| errno(&self.shown, e))?;
        self.committed = true;
        entry_at(&self.parent, OsStr::new(&self.name), &self.shown)
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.committed {
            let _ = rustix::fs::unlinkat(&self.parent, self.temp.as_str(), AtFlags::empty());
        }
    }
}

impl VolumeHost for HostVolumes {
    fn create(&self, team_id: &str, volume_id: &str) -> Result<(), VolumeIoError> {
        let (team, volume) = (plain(team_id)?, plain(volume_id)?);
        let root = sandbar_fs::Dir::open_host(&self.root).map_err(|e| io_err(team_id, e))?;
        let team_dir = root
            .ensure_dir(OsStr::new(team), 0o755)
            .map_err(|e| io_err(team_id, e))?;
        let dir = team_dir
            .create_dir(OsStr::new(volume), ROOT_MODE)
            .map_err(|e| io_err(volume_id, e))?;
        dir.chown_self(0, 0)
            .and_then(|()| dir.chmod_self(ROOT_MODE))
            .map_err(|e| io_err(volume_id, e))
    }

    fn usage(&self, team_id: &str, volume_id: &str) -> Result<u64, VolumeIoError> {
        let dir = self.dir(team_id, volume_id)?;
        // A volume is written by its sandboxes: the walk never follows a link in it.
        Ok(crate::storage::image_layers::disk_usage(&dir))
    }

    fn remove(&self, team_id: &str, volume_id: &str) -> Result<(), VolumeIoError> {
        let dir = self.dir(team_id, volume_id)?;
        crate::storage::disks::remove_tree(&dir).map_err(|e| io_err(volume_id, e))
    }

    fn stat(&self, volume: &Volume, path: &VolumePath) -> Result<EntryStat, VolumeIoError> {
        let root = self.root_fd(volume)?;
        if path.is_root() {
            return describe(root, OsStr::new(""), "/");
        }
        let (parent, name) = self.parent_of(&root, path, None)?;
        entry_at(&parent, OsStr::new(&name), &path.display())
    }

    fn open_file(&self, volume: &Volume, path: &VolumePath) -> Result<OpenedFile, VolumeIoError> {
        let root = self.root_fd(volume)?;
        let shown = path.display();
        // Non-blocking: a FIFO planted by a sandbox must not hang the server.
        let relative = path.relative();
        let opened = sandbar_fs::open_at(
            &root,
            &relative,
            OFlags::RDONLY | OFlags::NONBLOCK,
            Mode::empty(),
            sandbar_fs::Links::Beneath,
        );
        let fd = match opened {
            Ok(fd) => fd,
            // A socket (or a device without a driver) cannot be opened for reading at all:
            // looked at without opening it, to say what it is.
            Err(Errno::NXIO | Errno::NODEV) => {
                let fd = beneath(&root, &relative, OFlags::PATH, 0, &shown)?;
                let meta = File::from(fd).metadata().map_err(|e| io_err(&shown, e))?;
                return Err(VolumeIoError::NotAFile {
                    path: shown,
                    kind: special_kind(meta.file_type()),
                });
            }
            Err(e) => return Err(errno(&shown, e)),
        };
        let file = File::from(fd);
        let meta = file.metadata().map_err(|e| io_err(&shown, e))?;
        if meta.is_dir() {
            return Err(VolumeIoError::IsADirectory(shown));
        }
        if !meta.is_file() {
            return Err(VolumeIoError::NotAFile {
                path: shown,
                kind: special_kind(meta.file_type()),
            });
        }
        Ok(OpenedFile {
            file,
            size: meta.len(),
        })
    }

    fn stage_file(
        &self,
        volume: &Volume,
        path: &VolumePath,
        owner: EntryOwner,
        parents: bool,
    ) -> Result<Box<dyn StagedFile>, VolumeIoError> {
        let root = self.root_fd(volume)?;
        let shown = path.display();
        let (parent, name) = self.parent_of(&root, path, parents.then_some(owner))?;
        let mut owner = owner;
        match rustix::fs::statat(&parent, name.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => {
                let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
                if kind.is_dir() {
                    return Err(VolumeIoError::IsADirectory(shown));
                }
                if kind.is_file() {
                    // Replacing a file keeps what it had unless told otherwise.
                    owner.uid = owner.uid.or(Some(st.st_uid));
                    owner.gid = owner.gid.or(Some(st.st_gid));
                    owner.mode = owner.mode.or(Some(st.st_mode & 0o7777));
                }
            }
            Err(Errno::NOENT) => {}
            Err(e) => return Err(errno(&shown, e)),
        }
        // Written beside the target and renamed over it: a reader never sees half a file,
        // and a link in its place is replaced, never written through.
        let temp = format!(".sandbar-upload-{}", sandbar_core::ids::new_uuid());
        let fd = rustix::fs::openat(
            &parent,
            temp.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| errno(&shown, e))?;
        Ok(Box::new(Staged {
            file: File::from(fd),
            parent,
            temp,
            name,
            owner,
            shown,
            committed: false,
        }))
    }

    fn make_dir(
        &self,
        volume: &Volume,
        path: &VolumePath,
        owner: EntryOwner,
        parents: bool,
    ) -> Result<EntryStat, VolumeIoError> {
        let root = self.root_fd(volume)?;
        let shown = path.display();
        if path.is_root() {
            return if parents {
                describe(root, OsStr::new(""), "/")
            } else {
                Err(VolumeIoError::AlreadyExists(shown))
            };
        }
        let (parent, name) = self.parent_of(&root, path, parents.then_some(owner))?;
        match rustix::fs::mkdirat(&parent, name.as_str(), Mode::from_raw_mode(DIR_MODE)) {
            Ok(()) => {}
            Err(Errno::EXIST) if parents => {
                let existing = entry_at(&parent, OsStr::new(&name), &shown)?;
                if existing.kind != EntryKind::Directory {
                    return Err(VolumeIoError::AlreadyExists(shown));
                }
                return Ok(existing);
            }
            Err(e) => return Err(errno(&shown, e)),
        }
        let made = rustix::fs::openat(
            &parent,
            name.as_str(),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| errno(&shown, e))?;
        apply_owner(&made, owner, Some(DIR_MODE), &shown)?;
        entry_at(&parent, OsStr::new(&name), &shown)
    }

    fn list(
        &self,
        volume: &Volume,
        path: &VolumePath,
        depth: u32,
    ) -> Result<Vec<EntryStat>, VolumeIoError> {
        let root = self.root_fd(volume)?;
        let shown = path.display();
        let dir = beneath(
            &root,
            &path.relative(),
            OFlags::RDONLY | OFlags::DIRECTORY,
            0,
            &shown,
        )?;
        let mut out = Vec::new();
        self.walk(&dir, &shown, depth.clamp(1, MAX_LIST_DEPTH), &mut out)?;
        Ok(out)
    }

    fn remove_path(&self, volume: &Volume, path: &VolumePath) -> Result<(), VolumeIoError> {
        let root = self.root_fd(volume)?;
        let shown = path.display();
        let (parent, name) = self.parent_of(&root, path, None)?;
        let st = rustix::fs::statat(&parent, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| errno(&shown, e))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode).is_dir() {
            self.trash_tree(&parent, &name, &shown)
        } else {
            rustix::fs::unlinkat(&parent, name.as_str(), AtFlags::empty())
                .map_err(|e| errno(&shown, e))
        }
    }

    fn set_owner(
        &self,
        volume: &Volume,
        path: &VolumePath,
        owner: EntryOwner,
    ) -> Result<EntryStat, VolumeIoError> {
        let root = self.root_fd(volume)?;
        let shown = path.display();
        if path.is_root() {
            apply_owner(&root, owner, None, &shown)?;
            return describe(root, OsStr::new(""), "/");
        }
        let (parent, name) = self.parent_of(&root, path, None)?;
        let fd = rustix::fs::openat(
            &parent,
            name.as_str(),
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| errno(&shown, e))?;
        apply_owner(&fd, owner, None, &shown)?;
        entry_at(&parent, OsStr::new(&name), &shown)
    }
}
