//! File operations on directory trees whose contents a tenant controls: build contexts, image
//! and template layers, the writable layers of build sandboxes, volumes.
//!
//! Such a tree can hold any link (`etc -> /etc`, `x -> ../../..`, loops), and the server acts
//! on it as host root, so a path string is never handed to the host's resolver. A [`Tree`] is
//! an open directory plus a rule for the links met below it ([`Links`]); the kernel resolves
//! every path relative to the tree's descriptor with `openat2`, which also closes the races a
//! check-then-use in user space would leave. Every change (create, write, remove, rename,
//! chown, chmod, link) is an `*at` call on the parent's descriptor that never follows the last
//! component. Once a tree is open, nothing here takes a host path again.
//!
//! [`Dir`] is one open directory of a tree; its methods take a single name, for walks that
//! copy or re-own whole subtrees without resolving a path per entry.

#![deny(clippy::disallowed_methods)]

use std::ffi::{OsStr, OsString};
use std::fs::{File, Metadata};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, Gid, Mode, OFlags, ResolveFlags, Uid};
use rustix::io::Errno;

/// How the links met while resolving a path below a tree are treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Links {
    /// Followed as they would be with the tree as `/`: an absolute link or a `..` that climbs
    /// past the top stays at the tree's root. For a root filesystem, where a link must mean
    /// what it means inside the sandbox.
    InRoot,
    /// Followed while they stay below the tree; one that leads out fails.
    Beneath,
    /// Never followed: a path that passes through a link fails. For build contexts and for
    /// reading layers one at a time, where a link is data, not a way to go.
    Refused,
    /// Ordinary links followed anywhere, `/proc`'s magic links refused. Only for a process
    /// whose root is itself the tenant's tree (the agent inside its sandbox).
    Ordinary,
}

impl Links {
    fn resolve_flags(self) -> ResolveFlags {
        match self {
            Links::InRoot => ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
            Links::Beneath => ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
            Links::Refused => {
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV
            }
            Links::Ordinary => ResolveFlags::NO_MAGICLINKS,
        }
    }
}

/// What went wrong, with the path inside the tree (never the host path, since these messages
/// reach the tenant).
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("path '{0}' leads out of its tree")]
    Escapes(String),
    #[error("path '{0}' passes through a symbolic link")]
    Link(String),
    #[error("path '{0}' does not exist")]
    NotFound(String),
    #[error("path '{0}' is not a directory")]
    NotADirectory(String),
    #[error("path '{0}' is a directory")]
    IsADirectory(String),
    #[error("path '{0}' already exists")]
    AlreadyExists(String),
    #[error("path '{0}' does not name an entry")]
    NotAName(String),
    #[error("path '{0}' is not a regular file")]
    NotAFile(String),
    #[error("path '{0}' holds {1} mount point(s), left in place")]
    MountPoints(String, u64),
    #[error("path '{0}' moved while its tree was walked")]
    Moved(String),
    #[error("cannot {op} '{path}': {source}")]
    Io {
        op: &'static str,
        path: String,
        source: io::Error,
    },
}

impl FsError {
    fn from_errno(op: &'static str, path: &str, e: Errno) -> Self {
        let path = path.to_owned();
        match e {
            Errno::XDEV => FsError::Escapes(path),
            Errno::LOOP => FsError::Link(path),
            Errno::NOENT => FsError::NotFound(path),
            Errno::NOTDIR => FsError::NotADirectory(path),
            Errno::ISDIR => FsError::IsADirectory(path),
            Errno::EXIST => FsError::AlreadyExists(path),
            other => FsError::Io {
                op,
                path,
                source: other.into(),
            },
        }
    }

    fn io(op: &'static str, path: &str, source: io::Error) -> Self {
        match source.raw_os_error() {
            Some(raw) if raw != libc::EIO => {
                Self::from_errno(op, path, Errno::from_raw_os_error(raw))
            }
            _ => FsError::Io {
                op,
                path: path.to_owned(),
                source,
            },
        }
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, FsError::NotFound(_))
    }
}

impl From<FsError> for io::Error {
    fn from(e: FsError) -> Self {
        let kind = match &e {
            FsError::NotFound(_) => io::ErrorKind::NotFound,
            FsError::AlreadyExists(_) => io::ErrorKind::AlreadyExists,
            FsError::NotADirectory(_) => io::ErrorKind::NotADirectory,
            FsError::IsADirectory(_) => io::ErrorKind::IsADirectory,
            FsError::MountPoints(..) => io::ErrorKind::ResourceBusy,
            FsError::Io { source, .. } => source.kind(),
            _ => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, e)
    }
}

pub type Result<T> = std::result::Result<T, FsError>;

/// Opens `path` relative to `dir` with the kernel applying `links` to every component. The one
/// `openat2` call of the project: everything that resolves a path a tenant can influence
/// comes through here.
pub fn open_at(
    dir: impl AsFd,
    path: impl AsRef<Path>,
    flags: OFlags,
    mode: Mode,
    links: Links,
) -> std::result::Result<OwnedFd, Errno> {
    let path = path.as_ref();
    let path = if path.as_os_str().is_empty() {
        Path::new(".")
    } else {
        path
    };
    // openat2 refuses O_PATH with any flag that only matters to an opened file.
    let extra = if flags.contains(OFlags::PATH) {
        OFlags::CLOEXEC
    } else {
        OFlags::CLOEXEC | OFlags::NOCTTY
    };
    let mut attempts = 0;
    loop {
        match rustix::fs::openat2(
            dir.as_fd(),
            path,
            flags | extra,
            mode,
            links.resolve_flags(),
        ) {
            // A rename anywhere on the system during a lookup that checks `..` makes the
            // kernel give up rather than guess; the lookup is safe to repeat.
            Err(Errno::AGAIN) if attempts < 32 => attempts += 1,
            result => return result,
        }
    }
}

/// Opens the directory `name` in `parent` for a walk that must stay on one mount: a link is
/// not followed, and `Ok(None)` means `name` is a mount point (whatever is mounted there, a
/// `/proc` or a read-only sysfs left by a build, is not the walk's to touch).
pub fn open_dir_on_same_mount(parent: impl AsFd, name: &OsStr) -> io::Result<Option<OwnedFd>> {
    match rustix::fs::openat2(
        parent.as_fd(),
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::NO_XDEV | ResolveFlags::NO_SYMLINKS | ResolveFlags::BENEATH,
    ) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::XDEV) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// `path` as the kernel should see it below a tree: no leading `/`, no `.`; `..` is kept for
/// the rule to judge.
fn in_tree(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| matches!(c, Component::Normal(_) | Component::ParentDir))
        .collect()
}

/// Splits `path` into its parent and its last name, which must be a real name.
fn split(path: &Path) -> Result<(PathBuf, OsString)> {
    let relative = in_tree(path);
    match relative.components().next_back() {
        Some(Component::Normal(name)) => {
            let parent = relative.parent().map(Path::to_owned).unwrap_or_default();
            Ok((parent, name.to_owned()))
        }
        _ => Err(FsError::NotAName(shown(path))),
    }
}

fn shown(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

fn check_name(name: &OsStr) -> Result<()> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes == b"." || bytes == b".." || bytes.contains(&b'/') {
        return Err(FsError::NotAName(name.to_string_lossy().into_owned()));
    }
    Ok(())
}

/// A directory whose contents a tenant controls, and the rule for links below it.
#[derive(Debug)]
pub struct Tree {
    fd: OwnedFd,
    links: Links,
}

impl Tree {
    /// Opens the host directory `dir` (a path the server made, not one a tenant named). The
    /// last component is not followed.
    pub fn open(dir: &Path, links: Links) -> io::Result<Tree> {
        let fd = rustix::fs::open(
            dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Tree { fd, links })
    }

    /// The tree at an already open directory.
    pub fn from_dir(dir: Dir, links: Links) -> Tree {
        Tree { fd: dir.fd, links }
    }

    pub fn links(&self) -> Links {
        self.links
    }

    /// The same directory under another rule.
    pub fn with_links(&self, links: Links) -> io::Result<Tree> {
        Ok(Tree {
            fd: self.fd.try_clone()?,
            links,
        })
    }

    /// The tree's top directory.
    pub fn root(&self) -> io::Result<Dir> {
        Ok(Dir {
            fd: self.fd.try_clone()?,
        })
    }

    fn open_raw(&self, op: &'static str, path: &Path, flags: OFlags) -> Result<OwnedFd> {
        open_at(&self.fd, in_tree(path), flags, Mode::empty(), self.links)
            .map_err(|e| FsError::from_errno(op, &shown(path), e))
    }

    /// The directory at `path`, every component resolved by the tree's rule.
    pub fn dir(&self, path: impl AsRef<Path>) -> Result<Dir> {
        let path = path.as_ref();
        let fd = self.open_raw("open", path, OFlags::RDONLY | OFlags::DIRECTORY)?;
        Ok(Dir { fd })
    }

    /// The directory holding `path`'s last component, and that name.
    pub fn parent(&self, path: impl AsRef<Path>) -> Result<(Dir, OsString)> {
        let path = path.as_ref();
        let (parent, name) = split(path)?;
        let fd = open_at(
            &self.fd,
            &parent,
            OFlags::RDONLY | OFlags::DIRECTORY,
            Mode::empty(),
            self.links,
        )
        .map_err(|e| FsError::from_errno("open", &shown(path), e))?;
        Ok((Dir { fd }, name))
    }

    /// What `path` is, without following its last component; `None` when it does not exist.
    pub fn symlink_metadata(&self, path: impl AsRef<Path>) -> Result<Option<Metadata>> {
        let path = path.as_ref();
        if in_tree(path).as_os_str().is_empty() {
            return self
                .root()
                .and_then(|d| d.metadata())
                .map(Some)
                .map_err(|e| FsError::io("stat", "/", e));
        }
        let (dir, name) = match self.parent(path) {
            Ok(found) => found,
            Err(FsError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        dir.stat(&name).map_err(|e| rename_path(e, path))
    }

    /// What `path` leads to, following it by the tree's rule.
    pub fn metadata(&self, path: impl AsRef<Path>) -> Result<Metadata> {
        let path = path.as_ref();
        let fd = self.open_raw("stat", path, OFlags::PATH)?;
        File::from(fd)
            .metadata()
            .map_err(|e| FsError::io("stat", &shown(path), e))
    }

    /// Opens the regular file at `path` for reading.
    pub fn open_file(&self, path: impl AsRef<Path>) -> Result<File> {
        let path = path.as_ref();
        match self.links {
            // The last component is followed like the others, still by the rule.
            Links::InRoot | Links::Beneath | Links::Ordinary => {
                let fd = self.open_raw("open", path, OFlags::PATH)?;
                let meta = File::from(fd)
                    .metadata()
                    .map_err(|e| FsError::io("open", &shown(path), e))?;
                if !meta.is_file() {
                    return Err(FsError::NotAFile(shown(path)));
                }
                let fd = self.open_raw("open", path, OFlags::RDONLY | OFlags::NONBLOCK)?;
                let file = File::from(fd);
                same_inode(&file, &meta, path)?;
                Ok(file)
            }
            Links::Refused => {
                let (dir, name) = self.parent(path)?;
                dir.open_file(&name).map_err(|e| rename_path(e, path))
            }
        }
    }

    /// The whole content of the regular file at `path`.
    pub fn read(&self, path: impl AsRef<Path>) -> Result<Vec<u8>> {
        let path = path.as_ref();
        let mut data = Vec::new();
        self.open_file(path)?
            .read_to_end(&mut data)
            .map_err(|e| FsError::io("read", &shown(path), e))?;
        Ok(data)
    }

    pub fn read_to_string(&self, path: impl AsRef<Path>) -> Result<String> {
        let path = path.as_ref();
        String::from_utf8(self.read(path)?).map_err(|e| FsError::Io {
            op: "read",
            path: shown(path),
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        })
    }

    /// The target of the link at `path`.
    pub fn read_link(&self, path: impl AsRef<Path>) -> Result<PathBuf> {
        let path = path.as_ref();
        let (dir, name) = self.parent(path)?;
        dir.read_link(&name).map_err(|e| rename_path(e, path))
    }

    /// The entries of the directory at `path`, sorted by name.
    pub fn read_dir(&self, path: impl AsRef<Path>) -> Result<Vec<Entry>> {
        let path = path.as_ref();
        self.dir(path)?.entries().map_err(|e| rename_path(e, path))
    }

    /// Makes the directory `path` with `mode` (not reduced by the umask).
    pub fn create_dir(&self, path: impl AsRef<Path>, mode: u32) -> Result<Dir> {
        let path = path.as_ref();
        let (dir, name) = self.parent(path)?;
        dir.create_dir(&name, mode)
            .map_err(|e| rename_path(e, path))
    }

    /// Makes `path` and the missing directories above it, each with `mode`.
    pub fn create_dir_all(&self, path: impl AsRef<Path>, mode: u32) -> Result<Dir> {
        let path = path.as_ref();
        let relative = in_tree(path);
        let mut so_far = PathBuf::new();
        let mut current = self.root().map_err(|e| FsError::io("open", "/", e))?;
        for component in relative.components() {
            so_far.push(component);
            current = match self.dir(&so_far) {
                Ok(dir) => dir,
                Err(FsError::NotFound(_)) => match self.create_dir(&so_far, mode) {
                    Ok(dir) => dir,
                    // Made by someone else meanwhile: open it by the rule like any other.
                    Err(FsError::AlreadyExists(_)) => self.dir(&so_far)?,
                    Err(e) => return Err(e),
                },
                Err(e) => return Err(e),
            };
        }
        Ok(current)
    }

    /// Creates (or truncates) the regular file at `path`; a link there is an error, never
    /// followed. A new file gets `mode`.
    pub fn create_file(&self, path: impl AsRef<Path>, mode: u32) -> Result<File> {
        let path = path.as_ref();
        let (dir, name) = self.parent(path)?;
        dir.create_file(&name, mode, false)
            .map_err(|e| rename_path(e, path))
    }

    /// Writes `data` as the whole content of `path` and gives it `mode`.
    pub fn write(&self, path: impl AsRef<Path>, data: &[u8], mode: u32) -> Result<()> {
        let path = path.as_ref();
        let mut file = self.create_file(path, mode)?;
        file.write_all(data)
            .map_err(|e| FsError::io("write", &shown(path), e))?;
        rustix::fs::fchmod(&file, Mode::from_raw_mode(mode))
            .map_err(|e| FsError::from_errno("chmod", &shown(path), e))
    }

    /// Makes a link at `path` pointing at `target` (stored as given: a link's target is data).
    pub fn symlink(&self, target: impl AsRef<Path>, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let (dir, name) = self.parent(path)?;
        dir.symlink(target.as_ref(), &name)
            .map_err(|e| rename_path(e, path))
    }

    /// Makes `new` another name of the file at `existing`, both in this tree. Neither last
    /// component is followed.
    pub fn hard_link(&self, existing: impl AsRef<Path>, new: impl AsRef<Path>) -> Result<()> {
        let (existing, new) = (existing.as_ref(), new.as_ref());
        let (from_dir, from_name) = self.parent(existing)?;
        let (to_dir, to_name) = self.parent(new)?;
        rustix::fs::linkat(
            &from_dir.fd,
            &from_name,
            &to_dir.fd,
            &to_name,
            AtFlags::empty(),
        )
        .map_err(|e| FsError::from_errno("link", &shown(new), e))
    }

    /// Removes the file, link or empty directory at `path`, without following it.
    pub fn remove(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let (dir, name) = self.parent(path)?;
        dir.remove(&name).map_err(|e| rename_path(e, path))
    }

    /// Removes `path` and everything below it, following no link; a missing path is fine.
    pub fn remove_all(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let (dir, name) = match self.parent(path) {
            Ok(found) => found,
            Err(FsError::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        dir.remove_all(&name).map_err(|e| rename_path(e, path))
    }

    /// Renames `from` to `to` within the tree, replacing a file at `to`.
    pub fn rename(&self, from: impl AsRef<Path>, to: impl AsRef<Path>) -> Result<()> {
        let (from, to) = (from.as_ref(), to.as_ref());
        let (from_dir, from_name) = self.parent(from)?;
        let (to_dir, to_name) = self.parent(to)?;
        rustix::fs::renameat(&from_dir.fd, &from_name, &to_dir.fd, &to_name)
            .map_err(|e| FsError::from_errno("rename", &shown(from), e))
    }

    /// Gives `path` (not what a link there points at) the owner `uid:gid`.
    pub fn chown(&self, path: impl AsRef<Path>, uid: u32, gid: u32) -> Result<()> {
        let path = path.as_ref();
        if in_tree(path).as_os_str().is_empty() {
            return self
                .root()
                .map_err(|e| FsError::io("chown", "/", e))?
                .chown_self(uid, gid)
                .map_err(|e| FsError::io("chown", "/", e));
        }
        let (dir, name) = self.parent(path)?;
        dir.chown(&name, uid, gid).map_err(|e| rename_path(e, path))
    }

    /// Gives `path` the permission bits `mode`; a link there is an error, never followed.
    pub fn chmod(&self, path: impl AsRef<Path>, mode: u32) -> Result<()> {
        let path = path.as_ref();
        if in_tree(path).as_os_str().is_empty() {
            return rustix::fs::fchmod(&self.fd, Mode::from_raw_mode(mode))
                .map_err(|e| FsError::from_errno("chmod", "/", e));
        }
        let (dir, name) = self.parent(path)?;
        dir.chmod(&name, mode).map_err(|e| rename_path(e, path))
    }
}

impl AsFd for Tree {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// The kind of a directory entry, as `lstat` sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    /// Devices, FIFOs and sockets.
    Other,
}

impl Kind {
    pub fn of(meta: &Metadata) -> Kind {
        let t = meta.file_type();
        if t.is_symlink() {
            Kind::Symlink
        } else if t.is_dir() {
            Kind::Dir
        } else if t.is_file() {
            Kind::File
        } else {
            Kind::Other
        }
    }
}

/// One entry of a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: OsString,
    pub kind: Kind,
}

/// One open directory. Every method takes a single name (no `/`, not `.` or `..`) and never
/// follows it, so a walk of a tenant's tree with these cannot step outside.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
}

fn rename_path(e: FsError, path: &Path) -> FsError {
    let path = shown(path);
    match e {
        FsError::Escapes(_) => FsError::Escapes(path),
        FsError::Link(_) => FsError::Link(path),
        FsError::NotFound(_) => FsError::NotFound(path),
        FsError::NotADirectory(_) => FsError::NotADirectory(path),
        FsError::IsADirectory(_) => FsError::IsADirectory(path),
        FsError::AlreadyExists(_) => FsError::AlreadyExists(path),
        FsError::NotAName(_) => FsError::NotAName(path),
        FsError::NotAFile(_) => FsError::NotAFile(path),
        FsError::MountPoints(_, count) => FsError::MountPoints(path, count),
        FsError::Moved(_) => FsError::Moved(path),
        FsError::Io { op, source, .. } => FsError::Io { op, path, source },
    }
}

fn same_inode(file: &File, expected: &Metadata, path: &Path) -> Result<()> {
    let meta = file
        .metadata()
        .map_err(|e| FsError::io("open", &shown(path), e))?;
    if meta.dev() != expected.dev() || meta.ino() != expected.ino() {
        // Swapped between the look and the open: refuse rather than read something else.
        return Err(FsError::NotAFile(shown(path)));
    }
    Ok(())
}

impl Dir {
    fn name_err<'a>(op: &'static str, name: &'a OsStr) -> impl FnOnce(Errno) -> FsError + 'a {
        move |e| FsError::from_errno(op, &name.to_string_lossy(), e)
    }

    /// Opens the host directory `path` (a path the server made).
    pub fn open_host(path: &Path) -> io::Result<Dir> {
        Ok(Dir {
            fd: rustix::fs::open(
                path,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )?,
        })
    }

    pub fn metadata(&self) -> io::Result<Metadata> {
        File::from(self.fd.try_clone()?).metadata()
    }

    pub fn try_clone(&self) -> io::Result<Dir> {
        Ok(Dir {
            fd: self.fd.try_clone()?,
        })
    }

    /// The entries, sorted by name, without `.` and `..`.
    pub fn entries(&self) -> Result<Vec<Entry>> {
        let fd = rustix::fs::openat(
            &self.fd,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| FsError::from_errno("list", ".", e))?;
        let mut dir = rustix::fs::Dir::new(fd).map_err(|e| FsError::from_errno("list", ".", e))?;
        let mut out = Vec::new();
        while let Some(entry) = dir.read() {
            let entry = entry.map_err(|e| FsError::from_errno("list", ".", e))?;
            let name = OsStr::from_bytes(entry.file_name().to_bytes());
            if name == "." || name == ".." {
                continue;
            }
            let kind = match entry.file_type() {
                rustix::fs::FileType::RegularFile => Kind::File,
                rustix::fs::FileType::Directory => Kind::Dir,
                rustix::fs::FileType::Symlink => Kind::Symlink,
                rustix::fs::FileType::Unknown => match self.stat(name)? {
                    Some(meta) => Kind::of(&meta),
                    None => continue,
                },
                _ => Kind::Other,
            };
            out.push(Entry {
                name: name.to_owned(),
                kind,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// What `name` is, without following it; `None` when it does not exist.
    pub fn stat(&self, name: &OsStr) -> Result<Option<Metadata>> {
        check_name(name)?;
        match rustix::fs::openat(
            &self.fd,
            name,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => File::from(fd)
                .metadata()
                .map(Some)
                .map_err(|e| FsError::io("stat", &name.to_string_lossy(), e)),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(Self::name_err("stat", name)(e)),
        }
    }

    /// The directory `name`; a link there is an error.
    pub fn open_dir(&self, name: &OsStr) -> Result<Dir> {
        check_name(name)?;
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(Self::name_err("open", name))?;
        Ok(Dir { fd })
    }

    /// Opens the regular file `name` for reading; anything else (a link, a device, a FIFO)
    /// is refused before it is opened, so opening has no side effect.
    pub fn open_file(&self, name: &OsStr) -> Result<File> {
        let meta = self
            .stat(name)?
            .ok_or_else(|| FsError::NotFound(name.to_string_lossy().into_owned()))?;
        self.open_looked_at(name, &meta)
    }

    /// [`Dir::open_file`] for a caller that already has `name`'s `lstat` in `meta`: the file is
    /// opened only if that says it is regular, and only if it is still the same inode.
    pub fn open_looked_at(&self, name: &OsStr, meta: &Metadata) -> Result<File> {
        if meta.file_type().is_symlink() {
            return Err(FsError::Link(name.to_string_lossy().into_owned()));
        }
        if !meta.is_file() {
            return Err(FsError::NotAFile(name.to_string_lossy().into_owned()));
        }
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(Self::name_err("open", name))?;
        let file = File::from(fd);
        same_inode(&file, meta, Path::new(name))?;
        Ok(file)
    }

    /// Makes the directory `name` with exactly `mode`.
    pub fn create_dir(&self, name: &OsStr, mode: u32) -> Result<Dir> {
        check_name(name)?;
        rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(mode & 0o7777))
            .map_err(Self::name_err("create", name))?;
        let dir = self.open_dir(name)?;
        // The umask took bits away; the directory is empty and ours, so set them on its fd.
        rustix::fs::fchmod(&dir.fd, Mode::from_raw_mode(mode & 0o7777))
            .map_err(Self::name_err("chmod", name))?;
        Ok(dir)
    }

    /// Opens `name` as a directory, making it with `mode` when missing.
    pub fn ensure_dir(&self, name: &OsStr, mode: u32) -> Result<Dir> {
        match self.open_dir(name) {
            Err(FsError::NotFound(_)) => match self.create_dir(name, mode) {
                Err(FsError::AlreadyExists(_)) => self.open_dir(name),
                other => other,
            },
            other => other,
        }
    }

    /// Creates the regular file `name` for writing with `mode`. An existing regular file is
    /// truncated, unless `exclusive`; a link or anything else there is an error.
    pub fn create_file(&self, name: &OsStr, mode: u32, exclusive: bool) -> Result<File> {
        check_name(name)?;
        let mut flags = OFlags::WRONLY | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        flags |= if exclusive {
            OFlags::EXCL
        } else {
            OFlags::TRUNC | OFlags::NONBLOCK | OFlags::NOCTTY
        };
        if !exclusive
            && let Some(meta) = self.stat(name)?
            && !meta.is_file()
        {
            return Err(if meta.file_type().is_symlink() {
                FsError::Link(name.to_string_lossy().into_owned())
            } else if meta.is_dir() {
                FsError::IsADirectory(name.to_string_lossy().into_owned())
            } else {
                FsError::NotAFile(name.to_string_lossy().into_owned())
            });
        }
        let fd = rustix::fs::openat(&self.fd, name, flags, Mode::from_raw_mode(mode & 0o7777))
            .map_err(Self::name_err("create", name))?;
        let file = File::from(fd);
        if !file
            .metadata()
            .map_err(|e| FsError::io("create", &name.to_string_lossy(), e))?
            .is_file()
        {
            return Err(FsError::NotAFile(name.to_string_lossy().into_owned()));
        }
        if !exclusive {
            // Clear O_NONBLOCK, which only guarded the open against a FIFO swapped in.
            rustix::fs::fcntl_setfl(&file, OFlags::empty())
                .map_err(Self::name_err("create", name))?;
        }
        Ok(file)
    }

    /// Makes room for a new entry `name`: a file, link or other non-directory there goes; a
    /// directory is an error (a tree is never silently replaced).
    pub fn clear_for(&self, name: &OsStr) -> Result<()> {
        match self.stat(name)? {
            None => Ok(()),
            Some(meta) if meta.is_dir() => {
                Err(FsError::IsADirectory(name.to_string_lossy().into_owned()))
            }
            Some(_) => rustix::fs::unlinkat(&self.fd, name, AtFlags::empty())
                .map_err(Self::name_err("remove", name)),
        }
    }

    pub fn symlink(&self, target: &Path, name: &OsStr) -> Result<()> {
        check_name(name)?;
        rustix::fs::symlinkat(target, &self.fd, name).map_err(Self::name_err("link", name))
    }

    pub fn read_link(&self, name: &OsStr) -> Result<PathBuf> {
        check_name(name)?;
        rustix::fs::readlinkat(&self.fd, name, Vec::new())
            .map(|t| PathBuf::from(OsStr::from_bytes(t.as_bytes())))
            .map_err(|e| match e {
                Errno::INVAL => FsError::NotAName(name.to_string_lossy().into_owned()),
                other => Self::name_err("read link", name)(other),
            })
    }

    /// Removes the non-directory or empty directory `name`.
    pub fn remove(&self, name: &OsStr) -> Result<()> {
        let meta = self
            .stat(name)?
            .ok_or_else(|| FsError::NotFound(name.to_string_lossy().into_owned()))?;
        let flags = if meta.is_dir() {
            AtFlags::REMOVEDIR
        } else {
            AtFlags::empty()
        };
        rustix::fs::unlinkat(&self.fd, name, flags).map_err(Self::name_err("remove", name))
    }

    /// Removes `name` and everything below it; missing is fine. Subdirectories are moved up
    /// into the one being emptied before they are emptied, so however deep the tree, at most
    /// two directories are open at once. The walk never enters another mount: a mount point
    /// below `name` is left in place with the directories holding it, and the removal fails
    /// with [`FsError::MountPoints`] once everything else is gone.
    pub fn remove_all(&self, name: &OsStr) -> Result<()> {
        let Some(meta) = self.stat(name)? else {
            return Ok(());
        };
        if !meta.is_dir() {
            return rustix::fs::unlinkat(&self.fd, name, AtFlags::empty())
                .map_err(Self::name_err("remove", name));
        }
        let shown = name.to_string_lossy();
        let Some(fd) =
            open_dir_on_same_mount(&self.fd, name).map_err(|e| FsError::io("open", &shown, e))?
        else {
            return Err(FsError::MountPoints(shown.into_owned(), 1));
        };
        let top = Dir { fd };
        let mut moved = 0u64;
        let mut kept = 0u64;
        let mut pending: Vec<OsString> = Vec::new();
        top.empty_into(&top, &mut pending, &mut moved, &mut kept)?;
        while let Some(sub) = pending.pop() {
            let Some(fd) = open_dir_on_same_mount(&top.fd, &sub)
                .map_err(|e| FsError::io("open", &shown, e))?
            else {
                kept += 1;
                continue;
            };
            let dir = Dir { fd };
            dir.empty_into(&top, &mut pending, &mut moved, &mut kept)?;
            drop(dir);
            match rustix::fs::unlinkat(&top.fd, &sub, AtFlags::REMOVEDIR) {
                // A directory holding a mount point kept below it stays too.
                Err(Errno::NOTEMPTY | Errno::BUSY) if kept > 0 => {}
                other => other.map_err(Self::name_err("remove", name))?,
            }
        }
        drop(top);
        if kept > 0 {
            return Err(FsError::MountPoints(shown.into_owned(), kept));
        }
        rustix::fs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR)
            .map_err(Self::name_err("remove", name))
    }

    fn empty_into(
        &self,
        top: &Dir,
        pending: &mut Vec<OsString>,
        moved: &mut u64,
        kept: &mut u64,
    ) -> Result<()> {
        for entry in self.entries()? {
            if entry.kind == Kind::Dir {
                if std::ptr::eq(self, top) {
                    pending.push(entry.name);
                    continue;
                }
                *moved += 1;
                let fresh = OsString::from(format!(".removing-{moved}"));
                match rustix::fs::renameat(&self.fd, &entry.name, &top.fd, &fresh) {
                    Ok(()) => pending.push(fresh),
                    // A mount point cannot be moved; it stays where it is, untouched.
                    Err(Errno::BUSY) => *kept += 1,
                    Err(e) => return Err(Self::name_err("remove", &entry.name)(e)),
                }
            } else {
                match rustix::fs::unlinkat(&self.fd, &entry.name, AtFlags::empty()) {
                    Ok(()) => {}
                    // A file something is bind-mounted on.
                    Err(Errno::BUSY) => *kept += 1,
                    Err(e) => return Err(Self::name_err("remove", &entry.name)(e)),
                }
            }
        }
        Ok(())
    }

    /// Gives `name` itself (a link is not followed) the owner `uid:gid`.
    pub fn chown(&self, name: &OsStr, uid: u32, gid: u32) -> Result<()> {
        check_name(name)?;
        rustix::fs::chownat(
            &self.fd,
            name,
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(Self::name_err("chown", name))
    }

    /// Gives `name` the permission bits `mode`; a link is an error, never followed.
    pub fn chmod(&self, name: &OsStr, mode: u32) -> Result<()> {
        check_name(name)?;
        let bits = mode & 0o7777;
        let mode = Mode::from_raw_mode(bits);
        match fchmodat2_nofollow(&self.fd, name, bits) {
            Ok(()) => Ok(()),
            Err(Errno::OPNOTSUPP) => Err(FsError::Link(name.to_string_lossy().into_owned())),
            // Kernels before fchmodat2 (6.6): look first, then change the opened file.
            Err(Errno::NOSYS) => {
                let meta = self
                    .stat(name)?
                    .ok_or_else(|| FsError::NotFound(name.to_string_lossy().into_owned()))?;
                let fd = match Kind::of(&meta) {
                    Kind::Dir => self.open_dir(name)?.fd,
                    Kind::File => self.open_file(name)?.into(),
                    Kind::Symlink => {
                        return Err(FsError::Link(name.to_string_lossy().into_owned()));
                    }
                    Kind::Other => {
                        return Err(FsError::NotAFile(name.to_string_lossy().into_owned()));
                    }
                };
                rustix::fs::fchmod(&fd, mode).map_err(Self::name_err("chmod", name))
            }
            Err(e) => Err(Self::name_err("chmod", name)(e)),
        }
    }

    /// Gives this directory the owner `uid:gid`.
    pub fn chown_self(&self, uid: u32, gid: u32) -> io::Result<()> {
        rustix::fs::fchown(&self.fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))?;
        Ok(())
    }

    /// Gives this directory the permission bits `mode`.
    pub fn chmod_self(&self, mode: u32) -> io::Result<()> {
        rustix::fs::fchmod(&self.fd, Mode::from_raw_mode(mode & 0o7777))?;
        Ok(())
    }

    /// Renames `from` here to `to` in `target` (same filesystem), replacing a file there.
    pub fn rename_to(&self, from: &OsStr, target: &Dir, to: &OsStr) -> Result<()> {
        check_name(from)?;
        check_name(to)?;
        rustix::fs::renameat(&self.fd, from, &target.fd, to).map_err(Self::name_err("rename", from))
    }
}

impl AsFd for Dir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Whether the host path `path`, which the server made itself, is a directory; a link there
/// is not followed.
pub fn host_is_dir(path: &Path) -> bool {
    rustix::fs::lstat(path).is_ok_and(|st| rustix::fs::FileType::from_raw_mode(st.st_mode).is_dir())
}

/// Whether the host path `path`, which the server made itself, is a regular file; a link
/// there is not followed.
pub fn host_is_file(path: &Path) -> bool {
    rustix::fs::lstat(path).is_ok_and(|st| {
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile
    })
}

/// Opens the host file `path`, which the server made itself, for reading; a link there is
/// refused.
pub fn open_host_file(path: &Path) -> io::Result<File> {
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let file = File::from(fd);
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        ));
    }
    rustix::fs::fcntl_setfl(&file, OFlags::empty())?;
    Ok(file)
}

/// `fchmodat2(dir, name, mode, AT_SYMLINK_NOFOLLOW)`: a link fails with `EOPNOTSUPP`
/// instead of passing the change to its target.
fn fchmodat2_nofollow(dir: &OwnedFd, name: &OsStr, mode: u32) -> std::result::Result<(), Errno> {
    use std::os::fd::AsRawFd;
    let name = std::ffi::CString::new(name.as_bytes()).map_err(|_| Errno::INVAL)?;
    // SAFETY: the descriptor is open for the call and the name is nul-terminated; the
    // syscall only reads them.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_fchmodat2,
            dir.as_raw_fd(),
            name.as_ptr(),
            mode,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(Errno::from_io_error(&io::Error::last_os_error()).unwrap_or(Errno::IO))
    }
}

/// Whether `meta` is an overlayfs whiteout (a 0:0 character device).
pub fn is_whiteout(meta: &Metadata) -> bool {
    meta.file_type().is_char_device() && meta.rdev() == 0
}

/// What a [`walk`] does at each directory it enters and at each entry it meets.
pub trait Visitor {
    type Error: From<FsError>;

    /// `dir`, at `path` below the top (empty for the top), was opened; its entries follow.
    fn enter(&mut self, dir: &Dir, path: &Path) -> std::result::Result<(), Self::Error>;

    /// `entry` of `parent`, at `path`; for a directory, `true` walks into it.
    fn entry(
        &mut self,
        parent: &Dir,
        entry: &Entry,
        path: &Path,
    ) -> std::result::Result<bool, Self::Error>;
}

/// Directories a [`walk`] keeps open at most, however deep or wide the tree: a tenant's tree
/// may hold millions of directories, and the server's descriptors are shared by everything.
pub const WALK_OPEN_DIRS: usize = 16;

/// One directory of a walk under way: its entries still to visit, and its handle unless the
/// walk let go of it (it is reopened through its child's `..` when the walk comes back).
struct Level {
    dir: Option<Dir>,
    identity: (u64, u64),
    path: PathBuf,
    entries: std::vec::IntoIter<Entry>,
}

impl Level {
    fn open(dir: Dir, path: PathBuf) -> Result<Level> {
        let meta = dir
            .metadata()
            .map_err(|e| FsError::io("stat", &shown(&path), e))?;
        let entries = dir.entries().map_err(|e| rename_path(e, &path))?;
        Ok(Level {
            dir: Some(dir),
            identity: (meta.dev(), meta.ino()),
            path,
            entries: entries.into_iter(),
        })
    }
}

/// Walks the tree below `top` depth first (each directory's entries sorted by name, a
/// directory's own entries right after the entry that named it), never following a link and
/// holding at most [`WALK_OPEN_DIRS`] directories open. A directory the walk had to let go
/// of is opened again as `..` of the child it walked, and must be the same directory.
pub fn walk<V: Visitor>(top: Dir, visitor: &mut V) -> std::result::Result<(), V::Error> {
    visitor.enter(&top, Path::new(""))?;
    let mut levels = vec![Level::open(top, PathBuf::new())?];
    let mut open = 1;
    while let Some(level) = levels.last_mut() {
        let Some(entry) = level.entries.next() else {
            let Some(done) = levels.pop() else { break };
            reopen_parent(&mut levels, &mut open, done)?;
            continue;
        };
        // The deepest level is always open: see `reopen_parent`.
        let Some(dir) = level.dir.as_ref() else {
            return Err(FsError::Moved(shown(&level.path)).into());
        };
        let path = level.path.join(&entry.name);
        if !visitor.entry(dir, &entry, &path)? || entry.kind != Kind::Dir {
            continue;
        }
        let sub = dir
            .open_dir(&entry.name)
            .map_err(|e| rename_path(e, &path))?;
        visitor.enter(&sub, &path)?;
        let sub = Level::open(sub, path)?;
        levels.push(sub);
        open += 1;
        // The open levels are always the deepest ones; the shallowest of them lets go.
        if open > WALK_OPEN_DIRS {
            let shallowest = levels.len() - open;
            levels[shallowest].dir = None;
            open -= 1;
        }
    }
    Ok(())
}

/// After `done` was walked: its parent, now the deepest level, gets its handle back if the
/// walk let go of it, through `done`'s `..`, refused unless it is the directory it was.
fn reopen_parent(levels: &mut [Level], open: &mut usize, done: Level) -> Result<()> {
    let child = done.dir;
    if child.is_some() {
        // Closed when this returns.
        *open -= 1;
    }
    let Some(parent) = levels.last_mut() else {
        return Ok(());
    };
    if parent.dir.is_some() {
        return Ok(());
    }
    let Some(child) = child else {
        return Err(FsError::Moved(shown(&parent.path)));
    };
    let fd = rustix::fs::openat(
        &child.fd,
        "..",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| FsError::from_errno("open", &shown(&parent.path), e))?;
    let dir = Dir { fd };
    let meta = dir
        .metadata()
        .map_err(|e| FsError::io("stat", &shown(&parent.path), e))?;
    if (meta.dev(), meta.ino()) != parent.identity {
        return Err(FsError::Moved(shown(&parent.path)));
    }
    parent.dir = Some(dir);
    *open += 1;
    Ok(())
}

#[cfg(test)]
mod tests;
