//! Applying tar archives from untrusted sources to a directory.
//!
//! Image layers come from any registry on the internet and build contexts from users, and both
//! are unpacked by root, so no path from an archive is ever resolved the usual way: every parent
//! directory is opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` relative to the
//! destination, and the last component is created with an `*at` call relative to that parent.
//! A symlink planted by an earlier entry can therefore never redirect a later one, whatever the
//! order or the spelling of the names.

#![deny(clippy::disallowed_methods)]

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Cursor, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use flate2::read::MultiGzDecoder;
use rustix::fs::{
    self as rfs, AtFlags, FileType, Gid, Mode, OFlags, Timespec, Timestamps, Uid, XattrFlags,
};
use rustix::io::Errno;

/// Most entries one archive may hold.
pub const MAX_ENTRIES: u64 = 1_000_000;
/// Longest entry name (after normalisation) and longest link target, in bytes.
pub const MAX_PATH_LEN: usize = 4096;
/// Longest single path component, as on every Linux filesystem.
const MAX_NAME_LEN: usize = 255;
/// How much the tar reader may consume between two entries: headers, GNU long names and PAX
/// records are held in memory whole, so without a cap a few kilobytes of gzip could expand into
/// a multi-gigabyte "file name".
const MAX_METADATA_BYTES: u64 = 8 << 20;
const COPY_BUFFER: usize = 256 << 10;
/// What an entry is charged against a [`ByteBudget`] besides its content: its inode and
/// directory entry. File content is charged in whole 4 KiB blocks, so a million one-byte
/// files cost what they take on disk rather than a megabyte.
pub const ENTRY_COST: u64 = 512;
const BLOCK: u64 = 4096;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
const CAPABILITY_XATTR: &str = "security.capability";
const PAX_CAPABILITY: &[u8] = b"SCHILY.xattr.security.capability";
/// overlayfs mounted with `userxattr` reads its markers from the `user.` namespace; the
/// `trusted.` spelling is what a mount without it reads.
const OPAQUE_XATTRS: [&str; 2] = ["user.overlay.opaque", "trusted.overlay.opaque"];

/// What an archive contained, counted as it was applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnpackStats {
    /// Every entry read from the archive, including skipped ones.
    pub entries: u64,
    pub files: u64,
    /// Bytes of regular-file content written.
    pub bytes: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub hardlinks: u64,
    pub fifos: u64,
    /// Whiteouts turned into character devices 0:0.
    pub whiteouts: u64,
    /// Directories marked opaque.
    pub opaque_dirs: u64,
    /// Character and block devices left out of an image layer.
    pub devices_skipped: u64,
}

/// Disk space a set of unpacks may take between them (the layers of one image pulled in
/// parallel, say): content in whole blocks plus [`ENTRY_COST`] per entry. Clones share it.
#[derive(Debug, Clone)]
pub struct ByteBudget {
    limit: u64,
    used: Arc<AtomicU64>,
}

impl ByteBudget {
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            used: Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Takes `bytes` from what is left; false, taking nothing, when they do not fit.
    fn charge(&self, bytes: u64) -> bool {
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .is_ok()
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UnpackError {
    #[error("unsafe path in archive entry `{entry}`")]
    UnsafePath { entry: String },
    #[error(
        "hard link `{entry}` must point at an existing non-directory inside the archive, not `{target}`"
    )]
    LinkOutside { entry: String, target: String },
    #[error("archive entry `{entry}` is a device node or fifo, which is not allowed here")]
    Device { entry: String },
    #[error("unpacking `{entry}`: {source}")]
    Io {
        entry: String,
        #[source]
        source: io::Error,
    },
    #[error("reading the archive: {0}")]
    Tar(#[source] io::Error),
    #[error("archive entry `{entry}`: {what}")]
    Limit { entry: String, what: &'static str },
    #[error("archive entry `{entry}`: the unpacked files exceed the limit of {limit} bytes")]
    TooLarge { entry: String, limit: u64 },
}

/// Applies one OCI image layer to `dest`, an existing empty directory, so that `dest` becomes
/// an overlayfs lower layer: whiteouts become character devices 0:0 and opaque markers the
/// `user.overlay.opaque` (and `trusted.overlay.opaque`) xattr on their directory.
///
/// Ownership, modes (setuid, setgid and sticky included), mtimes, symlinks, hard links within
/// the layer, FIFOs and `security.capability` are kept; device nodes are left out.
pub fn apply_layer<R: Read>(tar: R, dest: &Path) -> Result<UnpackStats, UnpackError> {
    unpack(tar, dest, Flavor::Layer, MAX_ENTRIES, None)
}

/// [`apply_layer`] within `budget`: the unpack fails with [`UnpackError::TooLarge`] as soon
/// as what it wrote would take more than the budget has left.
pub fn apply_layer_within<R: Read>(
    tar: R,
    dest: &Path,
    budget: &ByteBudget,
) -> Result<UnpackStats, UnpackError> {
    unpack(tar, dest, Flavor::Layer, MAX_ENTRIES, Some(budget.clone()))
}

/// Extracts a user-uploaded archive (plain or gzip-compressed tar) into `dest`, an existing
/// directory. The same path rules as [`apply_layer`] apply; in addition whiteout names, device
/// nodes and FIFOs are refused, and everything is owned by root.
pub fn extract_upload<R: Read>(tar: R, dest: &Path) -> Result<UnpackStats, UnpackError> {
    extract(tar, dest, None)
}

/// [`extract_upload`] writing no more than `budget` allows (a build context may not take more
/// than its build's disk).
pub fn extract_upload_within<R: Read>(
    tar: R,
    dest: &Path,
    budget: &ByteBudget,
) -> Result<UnpackStats, UnpackError> {
    extract(tar, dest, Some(budget.clone()))
}

fn extract<R: Read>(
    tar: R,
    dest: &Path,
    budget: Option<ByteBudget>,
) -> Result<UnpackStats, UnpackError> {
    let mut tar = tar;
    let mut magic = [0u8; 2];
    let mut seen = 0;
    while seen < magic.len() {
        match tar.read(&mut magic[seen..]) {
            Ok(0) => break,
            Ok(n) => seen += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(UnpackError::Tar(e)),
        }
    }
    let stream = Cursor::new(magic[..seen].to_vec()).chain(tar);
    if magic[..seen] == [0x1f, 0x8b] {
        unpack(
            MultiGzDecoder::new(stream),
            dest,
            Flavor::Upload,
            MAX_ENTRIES,
            budget,
        )
    } else {
        unpack(stream, dest, Flavor::Upload, MAX_ENTRIES, budget)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    Layer,
    Upload,
}

fn unpack<R: Read>(
    tar: R,
    dest: &Path,
    flavor: Flavor,
    max_entries: u64,
    space: Option<ByteBudget>,
) -> Result<UnpackStats, UnpackError> {
    let dest_name = dest.display().to_string();
    let root = rfs::open(
        dest,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(errno_at(&dest_name))?;

    let budget = Rc::new(Cell::new(None));
    let mut archive = tar::Archive::new(Budgeted {
        inner: tar,
        budget: Rc::clone(&budget),
    });
    let mut unpacker = Unpacker {
        root,
        flavor,
        // Without CAP_CHOWN an upload simply belongs to whoever unpacks it.
        chown: flavor == Flavor::Layer || rustix::process::geteuid().is_root(),
        dirs: HashMap::new(),
        parent_cache: None,
        stats: UnpackStats::default(),
        buffer: vec![0; COPY_BUFFER],
        space,
    };

    let mut entries = archive.entries().map_err(UnpackError::Tar)?;
    loop {
        budget.set(Some(MAX_METADATA_BYTES));
        let next = entries.next();
        budget.set(None);
        let Some(entry) = next else { break };
        let mut entry = entry.map_err(UnpackError::Tar)?;
        unpacker.stats.entries += 1;
        if unpacker.stats.entries > max_entries {
            return Err(UnpackError::Limit {
                entry: lossy(&entry.path_bytes()),
                what: "too many entries in the archive",
            });
        }
        unpacker.charge(ENTRY_COST, &entry.path_bytes())?;
        unpacker.entry(&mut entry)?;
        // Whatever the entry did not consume is skipped here rather than inside the tar
        // reader, where it would count against the metadata budget.
        io::copy(&mut entry, &mut io::sink()).map_err(UnpackError::Tar)?;
    }
    unpacker.finish()
}

/// Fails reads once `budget` (when set) is used up.
struct Budgeted<R> {
    inner: R,
    budget: Rc<Cell<Option<u64>>>,
}

impl<R: Read> Read for Budgeted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(left) = self.budget.get() else {
            return self.inner.read(buf);
        };
        if left == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "tar headers, long names or pax records exceed the size limit",
            ));
        }
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let got = self.inner.read(&mut buf[..want])?;
        self.budget.set(Some(left.saturating_sub(got as u64)));
        Ok(got)
    }
}

/// Metadata of one entry, as it is applied.
#[derive(Debug, Clone)]
struct Meta {
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: Timespec,
    capability: Option<Vec<u8>>,
}

/// Where an archive entry goes in the layer.
#[derive(Clone, Copy)]
struct Place<'a> {
    /// The directories above it, from the layer's root down.
    parents: &'a [&'a [u8]],
    /// Its own name in the last of them.
    base: &'a [u8],
    /// Its whole path in the layer.
    path: &'a [u8],
    /// Its path as the archive spells it, for errors and logs.
    name: &'a str,
}

struct Unpacker {
    root: OwnedFd,
    flavor: Flavor,
    chown: bool,
    /// Directory metadata, applied once every entry is in place: creating children would
    /// change a directory's mtime, and a read-only mode would stop the children being created.
    dirs: HashMap<Vec<u8>, Meta>,
    /// The last parent directory opened, since archives list siblings together.
    parent_cache: Option<(Vec<u8>, OwnedFd)>,
    stats: UnpackStats,
    buffer: Vec<u8>,
    /// Disk space the unpack may still take, when bounded.
    space: Option<ByteBudget>,
}

impl Unpacker {
    fn charge(&self, bytes: u64, entry: &[u8]) -> Result<(), UnpackError> {
        match &self.space {
            Some(space) if !space.charge(bytes) => Err(UnpackError::TooLarge {
                entry: lossy(entry),
                limit: space.limit(),
            }),
            _ => Ok(()),
        }
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), UnpackError> {
        let raw = entry.path_bytes().into_owned();
        let name = lossy(&raw);
        let kind = entry.header().entry_type();
        if kind.is_pax_global_extensions()
            || kind.is_pax_local_extensions()
            || kind.is_gnu_longname()
            || kind.is_gnu_longlink()
        {
            return Ok(());
        }

        let comps = components(&raw, &name)?;
        let path = comps.join(&b'/');
        let is_dir = kind.is_dir()
            || (matches!(kind, tar::EntryType::Regular | tar::EntryType::Continuous)
                && raw.ends_with(b"/"));
        let mut meta = read_meta(entry, &name)?;
        if self.flavor == Flavor::Upload {
            meta.uid = 0;
            meta.gid = 0;
        }

        let Some((base, parents)) = comps.split_last() else {
            if is_dir {
                // "./": the metadata of the layer's root directory.
                self.dirs.insert(Vec::new(), meta);
                self.stats.dirs += 1;
                return Ok(());
            }
            return Err(UnpackError::UnsafePath { entry: name });
        };
        if parents.iter().any(|c| c.starts_with(WHITEOUT_PREFIX)) {
            return Err(UnpackError::UnsafePath { entry: name });
        }
        if base.starts_with(WHITEOUT_PREFIX) {
            if self.flavor == Flavor::Upload {
                return Err(UnpackError::UnsafePath { entry: name });
            }
            return self.whiteout(parents, base, &name);
        }

        let at = Place {
            parents,
            base,
            path: &path,
            name: &name,
        };
        if is_dir {
            return self.directory(at, meta);
        }
        match kind {
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                self.file(entry, at, &meta)
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                self.symlink(at, &target, &meta)
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                self.hardlink(at, &target)
            }
            tar::EntryType::Fifo => {
                if self.flavor == Flavor::Upload {
                    return Err(UnpackError::Device { entry: name });
                }
                self.fifo(at, &meta)
            }
            tar::EntryType::Char | tar::EntryType::Block => {
                if self.flavor == Flavor::Upload {
                    return Err(UnpackError::Device { entry: name });
                }
                // A sandbox gets its /dev from the host; a device node in an image is at best
                // useless and at worst a door to host hardware.
                tracing::warn!(entry = %name, "leaving a device node out of an image layer");
                self.stats.devices_skipped += 1;
                Ok(())
            }
            other => {
                tracing::warn!(entry = %name, kind = ?other, "skipping archive entry of unknown type");
                Ok(())
            }
        }
    }

    fn directory(&mut self, at: Place<'_>, meta: Meta) -> Result<(), UnpackError> {
        let parent = self.parent(at.parents, at.name)?;
        if !self.make_room(parent.as_fd(), at, true)? {
            rfs::mkdirat(&parent, at.base, Mode::from_raw_mode(0o755))
                .map_err(errno_at(at.name))?;
        }
        self.dirs.insert(at.path.to_vec(), meta);
        self.stats.dirs += 1;
        Ok(())
    }

    fn file<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        at: Place<'_>,
        meta: &Meta,
    ) -> Result<(), UnpackError> {
        let Place { base, name, .. } = at;
        let parent = self.parent_with_room(at)?;
        let fd = rfs::openat(
            &parent,
            base,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(errno_at(name))?;
        let mut file = File::from(fd);
        let mut written = 0u64;
        loop {
            let n = match entry.read(&mut self.buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_at(name, e)),
            };
            // Charged in whole blocks as they are started, before anything is written.
            let blocks = (written + n as u64).div_ceil(BLOCK) - written.div_ceil(BLOCK);
            self.charge(blocks * BLOCK, name.as_bytes())?;
            file.write_all(&self.buffer[..n])
                .map_err(|e| io_at(name, e))?;
            written += n as u64;
        }
        self.set_meta(file.as_fd(), meta, true, name)?;
        self.stats.files += 1;
        self.stats.bytes += written;
        Ok(())
    }

    fn symlink(&mut self, at: Place<'_>, target: &[u8], meta: &Meta) -> Result<(), UnpackError> {
        let Place { base, name, .. } = at;
        if target.is_empty() {
            return Err(io_at(name, invalid_data("symbolic link without a target")));
        }
        if target.len() > MAX_PATH_LEN {
            return Err(UnpackError::Limit {
                entry: name.to_owned(),
                what: "symbolic link target too long",
            });
        }
        let parent = self.parent_with_room(at)?;
        // The target is stored as written: it is only ever resolved inside the sandbox.
        rfs::symlinkat(target, &parent, base).map_err(errno_at(name))?;
        self.chown_by_name(&parent, at, meta)?;
        rfs::utimensat(&parent, base, &timestamps(meta), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(errno_at(name))?;
        self.stats.symlinks += 1;
        Ok(())
    }

    fn hardlink(&mut self, at: Place<'_>, target: &[u8]) -> Result<(), UnpackError> {
        let Place {
            base, path, name, ..
        } = at;
        let outside = || UnpackError::LinkOutside {
            entry: name.to_owned(),
            target: lossy(target),
        };
        let target_comps = components(target, name).map_err(|_| outside())?;
        let Some((target_base, target_parents)) = target_comps.split_last() else {
            return Err(outside());
        };
        let target_parent = self
            .open_beneath(
                &target_parents.join(&b'/'),
                OFlags::PATH | OFlags::DIRECTORY,
            )
            .map_err(|_| outside())?;
        let stat = rfs::statat(&target_parent, *target_base, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|_| outside())?;
        if FileType::from_raw_mode(stat.st_mode) == FileType::Directory {
            return Err(outside());
        }
        if target_comps.join(&b'/') == path {
            // A link to itself: the file is already there.
            return Ok(());
        }

        let parent = self.parent_with_room(at)?;
        rfs::linkat(
            &target_parent,
            *target_base,
            &parent,
            base,
            AtFlags::empty(),
        )
        .map_err(errno_at(name))?;
        self.stats.hardlinks += 1;
        Ok(())
    }

    fn fifo(&mut self, at: Place<'_>, meta: &Meta) -> Result<(), UnpackError> {
        let Place { base, name, .. } = at;
        let parent = self.parent_with_room(at)?;
        rfs::mknodat(&parent, base, FileType::Fifo, Mode::from_raw_mode(0o600), 0)
            .map_err(errno_at(name))?;
        // Opening a FIFO would block, so it is changed by name: it was created just above in a
        // directory nothing else writes to, so the name still refers to it.
        self.chown_by_name(&parent, at, meta)?;
        rfs::chmodat(
            &parent,
            base,
            Mode::from_raw_mode(meta.mode),
            AtFlags::empty(),
        )
        .map_err(errno_at(name))?;
        rfs::utimensat(&parent, base, &timestamps(meta), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(errno_at(name))?;
        self.stats.fifos += 1;
        Ok(())
    }

    fn whiteout(&mut self, parents: &[&[u8]], base: &[u8], name: &str) -> Result<(), UnpackError> {
        if base == OPAQUE_MARKER {
            // Make sure the directory exists even if the archive never listed it.
            drop(self.parent(parents, name)?);
            let dir = self
                .open_beneath(&parents.join(&b'/'), OFlags::RDONLY | OFlags::DIRECTORY)
                .map_err(|e| resolve_error(e, name))?;
            rfs::fsetxattr(&dir, OPAQUE_XATTRS[0], b"y", XattrFlags::empty())
                .map_err(errno_at(name))?;
            if let Err(e) = rfs::fsetxattr(&dir, OPAQUE_XATTRS[1], b"y", XattrFlags::empty()) {
                tracing::debug!(entry = %name, error = %e, "cannot set the trusted opaque xattr");
            }
            self.stats.opaque_dirs += 1;
            return Ok(());
        }

        let hidden = &base[WHITEOUT_PREFIX.len()..];
        if hidden.starts_with(WHITEOUT_PREFIX) {
            // Other `.wh..wh.` names are aufs bookkeeping with no meaning for overlayfs.
            tracing::warn!(entry = %name, "skipping unknown whiteout marker");
            return Ok(());
        }
        if hidden.is_empty() || hidden == b"." || hidden == b".." {
            return Err(UnpackError::UnsafePath {
                entry: name.to_owned(),
            });
        }
        let parent = self.parent(parents, name)?;
        match rfs::mknodat(
            &parent,
            hidden,
            FileType::CharacterDevice,
            Mode::empty(),
            rfs::makedev(0, 0),
        ) {
            Ok(()) => self.stats.whiteouts += 1,
            // A whiteout only hides what lower layers hold; an entry of this very layer with
            // the same name stays.
            Err(Errno::EXIST) => {
                tracing::debug!(entry = %name, "whiteout of an entry of the same layer ignored");
            }
            Err(e) => return Err(errno_at(name)(e)),
        }
        Ok(())
    }

    /// Opens the directory that holds an entry, creating missing directories (root-owned, 0755)
    /// on the way. Any symlink on the way is an error.
    /// Gives `base` in `parent` its recorded owner when owners are kept, without following
    /// it: for a link or FIFO, which cannot be opened to be changed.
    fn chown_by_name(
        &self,
        parent: &OwnedFd,
        at: Place<'_>,
        meta: &Meta,
    ) -> Result<(), UnpackError> {
        if !self.chown {
            return Ok(());
        }
        rfs::chownat(
            parent,
            at.base,
            Some(Uid::from_raw(meta.uid)),
            Some(Gid::from_raw(meta.gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(errno_at(at.name))
    }

    fn parent(&mut self, parents: &[&[u8]], name: &str) -> Result<OwnedFd, UnpackError> {
        let path = parents.join(&b'/');
        if let Some((cached, fd)) = &self.parent_cache
            && *cached == path
        {
            return fd.try_clone().map_err(|e| io_at(name, e));
        }
        let fd = match self.open_beneath(&path, OFlags::PATH | OFlags::DIRECTORY) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => self.create_parents(parents, name)?,
            Err(e) => return Err(resolve_error(e, name)),
        };
        let cached = fd.try_clone().map_err(|e| io_at(name, e))?;
        self.parent_cache = Some((path, cached));
        Ok(fd)
    }

    fn create_parents(&self, parents: &[&[u8]], name: &str) -> Result<OwnedFd, UnpackError> {
        let mut dir = self.root.try_clone().map_err(|e| io_at(name, e))?;
        for component in parents {
            let open = |dir: &OwnedFd| {
                sandbar_fs::open_at(
                    dir,
                    std::ffi::OsStr::from_bytes(component),
                    OFlags::PATH | OFlags::DIRECTORY,
                    Mode::empty(),
                    sandbar_fs::Links::Refused,
                )
            };
            dir = match open(&dir) {
                Ok(fd) => fd,
                Err(Errno::NOENT) => {
                    match rfs::mkdirat(&dir, *component, Mode::from_raw_mode(0o755)) {
                        // Fresh and empty, so following the name cannot lead anywhere else;
                        // the chmod undoes the umask.
                        Ok(()) => rfs::chmodat(
                            &dir,
                            *component,
                            Mode::from_raw_mode(0o755),
                            AtFlags::empty(),
                        )
                        .map_err(errno_at(name))?,
                        Err(Errno::EXIST) => {}
                        Err(e) => return Err(errno_at(name)(e)),
                    }
                    open(&dir).map_err(|e| resolve_error(e, name))?
                }
                Err(e) => return Err(resolve_error(e, name)),
            };
        }
        Ok(dir)
    }

    fn open_beneath(&self, path: &[u8], flags: OFlags) -> Result<OwnedFd, Errno> {
        sandbar_fs::open_at(
            &self.root,
            std::ffi::OsStr::from_bytes(path),
            flags,
            Mode::empty(),
            sandbar_fs::Links::Refused,
        )
    }

    /// Opens the directory that holds a non-directory entry, its name there cleared for it.
    fn parent_with_room(&mut self, at: Place<'_>) -> Result<OwnedFd, UnpackError> {
        let parent = self.parent(at.parents, at.name)?;
        self.make_room(parent.as_fd(), at, false)?;
        Ok(parent)
    }

    /// Clears the way for an entry: a later entry replaces an earlier one of the same name,
    /// except that a directory over a directory keeps the contents. Returns whether a
    /// directory was kept.
    fn make_room(
        &mut self,
        parent: BorrowedFd<'_>,
        at: Place<'_>,
        want_dir: bool,
    ) -> Result<bool, UnpackError> {
        let Place {
            base, path, name, ..
        } = at;
        let stat = match rfs::statat(parent, base, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => stat,
            Err(Errno::NOENT) => return Ok(false),
            Err(e) => return Err(errno_at(name)(e)),
        };
        let is_dir = FileType::from_raw_mode(stat.st_mode) == FileType::Directory;
        if is_dir && want_dir {
            return Ok(true);
        }
        if is_dir {
            remove_tree(parent, base).map_err(|e| io_at(name, e))?;
            self.parent_cache = None;
            self.dirs.retain(|dir, _| {
                !(dir.starts_with(path) && matches!(dir.get(path.len()), None | Some(b'/')))
            });
        } else {
            rfs::unlinkat(parent, base, AtFlags::empty()).map_err(errno_at(name))?;
        }
        Ok(false)
    }

    fn set_meta(
        &self,
        fd: BorrowedFd<'_>,
        meta: &Meta,
        regular: bool,
        name: &str,
    ) -> Result<(), UnpackError> {
        if self.chown {
            rfs::fchown(
                fd,
                Some(Uid::from_raw(meta.uid)),
                Some(Gid::from_raw(meta.gid)),
            )
            .map_err(errno_at(name))?;
        }
        // After the chown, which clears setuid and setgid.
        rfs::fchmod(fd, Mode::from_raw_mode(meta.mode)).map_err(errno_at(name))?;
        if regular
            && self.flavor == Flavor::Layer
            && let Some(capability) = &meta.capability
        {
            // Also after the chown, which drops file capabilities.
            if let Err(e) = rfs::fsetxattr(fd, CAPABILITY_XATTR, capability, XattrFlags::empty()) {
                tracing::warn!(entry = %name, error = %e, "cannot keep file capabilities");
            }
        }
        rfs::futimens(fd, &timestamps(meta)).map_err(errno_at(name))?;
        Ok(())
    }

    fn finish(mut self) -> Result<UnpackStats, UnpackError> {
        let mut dirs: Vec<(Vec<u8>, Meta)> = self.dirs.drain().collect();
        // Deepest first, so that a parent made read-only does not get in the way.
        dirs.sort_by_key(|(path, _)| Reverse(depth(path)));
        for (path, meta) in dirs {
            let name = if path.is_empty() {
                ".".to_owned()
            } else {
                lossy(&path)
            };
            let fd = match self.open_beneath(&path, OFlags::RDONLY | OFlags::DIRECTORY) {
                Ok(fd) => fd,
                // Replaced by a later entry that is not a directory.
                Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP | Errno::XDEV) => continue,
                Err(e) => return Err(errno_at(&name)(e)),
            };
            self.set_meta(fd.as_fd(), &meta, false, &name)?;
        }
        Ok(self.stats)
    }
}

/// Removes a directory tree without following any symlink in it.
fn remove_tree(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<()> {
    let dir = rfs::openat(
        parent,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut children = Vec::new();
    for child in rfs::Dir::read_from(&dir)? {
        let child = child?;
        let child = child.file_name().to_bytes();
        if child != b"." && child != b".." {
            children.push(child.to_vec());
        }
    }
    for child in children {
        match rfs::unlinkat(&dir, child.as_slice(), AtFlags::empty()) {
            Ok(()) => {}
            Err(Errno::ISDIR) => remove_tree(dir.as_fd(), &child)?,
            Err(e) => return Err(e.into()),
        }
    }
    rfs::unlinkat(parent, name, AtFlags::REMOVEDIR)?;
    Ok(())
}

/// Splits an entry name into its components: a leading `./`, `.` components and repeated
/// slashes disappear; absolute names and `..` anywhere are refused.
fn components<'a>(raw: &'a [u8], entry: &str) -> Result<Vec<&'a [u8]>, UnpackError> {
    if raw.len() > MAX_PATH_LEN {
        return Err(UnpackError::Limit {
            entry: entry.to_owned(),
            what: "name too long",
        });
    }
    if raw.first() == Some(&b'/') {
        return Err(UnpackError::UnsafePath {
            entry: entry.to_owned(),
        });
    }
    let mut out = Vec::new();
    for component in raw.split(|b| *b == b'/') {
        match component {
            b"" | b"." => {}
            b".." => {
                return Err(UnpackError::UnsafePath {
                    entry: entry.to_owned(),
                });
            }
            c if c.len() > MAX_NAME_LEN => {
                return Err(UnpackError::Limit {
                    entry: entry.to_owned(),
                    what: "path component too long",
                });
            }
            c => out.push(c),
        }
    }
    Ok(out)
}

fn read_meta<R: Read>(entry: &mut tar::Entry<'_, R>, name: &str) -> Result<Meta, UnpackError> {
    let bad = |e: io::Error| io_at(name, e);
    let header = entry.header();
    let old = header.as_old();
    let mut uid = numeric(&old.uid, header.uid()).map_err(bad)?;
    let mut gid = numeric(&old.gid, header.gid()).map_err(bad)?;
    let mode = numeric(&old.mode, header.mode().map(u64::from)).map_err(bad)?;
    let mtime = numeric(&old.mtime, header.mtime()).map_err(bad)?;
    let mut mtime = Timespec {
        tv_sec: i64::try_from(mtime).unwrap_or(i64::MAX),
        tv_nsec: 0,
    };
    let mut capability = None;
    if let Some(extensions) = entry.pax_extensions().map_err(bad)? {
        for extension in extensions {
            let extension = extension.map_err(bad)?;
            match extension.key_bytes() {
                b"uid" => uid = parse_id(extension.value_bytes()).unwrap_or(uid),
                b"gid" => gid = parse_id(extension.value_bytes()).unwrap_or(gid),
                b"mtime" => mtime = parse_pax_time(extension.value_bytes()).unwrap_or(mtime),
                PAX_CAPABILITY => capability = Some(extension.value_bytes().to_vec()),
                _ => {}
            }
        }
    }
    // -1 would mean "leave unchanged" to chown, and larger values do not exist.
    let id = |id: u64| {
        u32::try_from(id)
            .ok()
            .filter(|id| *id != u32::MAX)
            .ok_or_else(|| io_at(name, invalid_data("owner or group id out of range")))
    };
    Ok(Meta {
        uid: id(uid)?,
        gid: id(gid)?,
        // Masked first, so the narrowing cannot lose anything.
        mode: u32::try_from(mode & 0o7777).unwrap_or(0),
        mtime,
        capability,
    })
}

/// A numeric header field, where an empty field (as some writers leave unused ones) is 0.
fn numeric(field: &[u8], parsed: io::Result<u64>) -> io::Result<u64> {
    if field.iter().all(|b| *b == 0 || *b == b' ') {
        Ok(0)
    } else {
        parsed
    }
}

fn parse_id(value: &[u8]) -> Option<u64> {
    std::str::from_utf8(value).ok()?.parse().ok()
}

/// PAX times are decimal seconds with an optional fraction, e.g. `1700000000.123456789`.
fn parse_pax_time(value: &[u8]) -> Option<Timespec> {
    let value = std::str::from_utf8(value).ok()?;
    let (secs, frac) = value.split_once('.').unwrap_or((value, ""));
    let mut secs: i64 = secs.parse().ok()?;
    let digits: String = frac.chars().take(9).collect();
    if !digits.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let mut nanos: i64 = if digits.is_empty() {
        0
    } else {
        format!("{digits:0<9}").parse().ok()?
    };
    if value.starts_with('-') && nanos > 0 {
        secs -= 1;
        nanos = 1_000_000_000 - nanos;
    }
    Some(Timespec {
        tv_sec: secs,
        tv_nsec: nanos,
    })
}

fn timestamps(meta: &Meta) -> Timestamps {
    Timestamps {
        last_access: meta.mtime,
        last_modification: meta.mtime,
    }
}

fn depth(path: &[u8]) -> usize {
    if path.is_empty() {
        0
    } else {
        1 + path.iter().filter(|b| **b == b'/').count()
    }
}

fn resolve_error(e: Errno, name: &str) -> UnpackError {
    match e {
        // A symlink (or an escape attempt) on the way to the entry.
        Errno::LOOP | Errno::XDEV => UnpackError::UnsafePath {
            entry: name.to_owned(),
        },
        e => errno_at(name)(e),
    }
}

fn errno_at(name: &str) -> impl FnOnce(Errno) -> UnpackError + '_ {
    move |e| io_at(name, e.into())
}

fn io_at(name: &str, source: io::Error) -> UnpackError {
    UnpackError::Io {
        entry: name.to_owned(),
        source,
    }
}

fn invalid_data(message: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::fs;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    use std::path::PathBuf;

    use tar::EntryType;

    const MTIME: u64 = 1_600_000_000;

    /// Writes headers byte by byte, so that names `tar::Builder` would refuse really end up
    /// in the archive.
    struct Tar(tar::Builder<Vec<u8>>);

    impl Tar {
        fn new() -> Self {
            Tar(tar::Builder::new(Vec::new()))
        }

        fn raw(
            &mut self,
            name: &[u8],
            kind: EntryType,
            link: &[u8],
            data: &[u8],
            customize: impl FnOnce(&mut tar::Header),
        ) -> &mut Self {
            if name.len() > 100 {
                self.long(b'L', name);
            }
            if link.len() > 100 {
                self.long(b'K', link);
            }
            let mut header = tar::Header::new_gnu();
            let n = name.len().min(100);
            header.as_old_mut().name[..n].copy_from_slice(&name[..n]);
            let l = link.len().min(100);
            header.as_old_mut().linkname[..l].copy_from_slice(&link[..l]);
            header.set_entry_type(kind);
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(MTIME);
            customize(&mut header);
            header.set_cksum();
            self.0.append(&header, data).unwrap();
            self
        }

        fn long(&mut self, kind: u8, value: &[u8]) {
            let mut header = tar::Header::new_gnu();
            header.as_old_mut().name[..13].copy_from_slice(b"././@LongLink");
            header.set_entry_type(EntryType::new(kind));
            let mut data = value.to_vec();
            data.push(0);
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            self.0.append(&header, data.as_slice()).unwrap();
        }

        fn dir(&mut self, name: &str) -> &mut Self {
            self.raw(name.as_bytes(), EntryType::Directory, b"", b"", |h| {
                h.set_mode(0o755)
            })
        }

        fn file(&mut self, name: &str, data: &str) -> &mut Self {
            self.raw(
                name.as_bytes(),
                EntryType::Regular,
                b"",
                data.as_bytes(),
                |_| {},
            )
        }

        fn symlink(&mut self, name: &str, target: &[u8]) -> &mut Self {
            self.raw(name.as_bytes(), EntryType::Symlink, target, b"", |h| {
                h.set_mode(0o777)
            })
        }

        fn hardlink(&mut self, name: &str, target: &[u8]) -> &mut Self {
            self.raw(name.as_bytes(), EntryType::Link, target, b"", |_| {})
        }

        fn bytes(self) -> Vec<u8> {
            self.0.into_inner().unwrap()
        }
    }

    /// A destination inside `outer`, which must end up holding nothing else, and a canary
    /// directory next to it that malicious entries aim at.
    struct Sandbox {
        _tmp: tempfile::TempDir,
        outer: PathBuf,
        dest: PathBuf,
        canary: PathBuf,
    }

    impl Sandbox {
        fn new() -> Self {
            let tmp = tempfile::tempdir().unwrap();
            let outer = tmp.path().join("outer");
            let dest = outer.join("dest");
            let canary = tmp.path().join("canary");
            fs::create_dir_all(&dest).unwrap();
            fs::create_dir_all(&canary).unwrap();
            fs::write(canary.join("secret"), "secret").unwrap();
            Sandbox {
                _tmp: tmp,
                outer,
                dest,
                canary,
            }
        }

        fn layer(&self, tar: Vec<u8>) -> Result<UnpackStats, UnpackError> {
            apply_layer(tar.as_slice(), &self.dest)
        }

        fn upload(&self, tar: Vec<u8>) -> Result<UnpackStats, UnpackError> {
            extract_upload(tar.as_slice(), &self.dest)
        }

        /// Why `tar` is refused as an upload (`upload`) or as a layer.
        fn refused(&self, tar: Vec<u8>, upload: bool) -> UnpackError {
            if upload {
                self.upload(tar)
            } else {
                self.layer(tar)
            }
            .unwrap_err()
        }

        fn path(&self, name: &str) -> PathBuf {
            self.dest.join(name)
        }

        fn assert_contained(&self) {
            assert_eq!(names(&self.outer), ["dest"]);
            assert_eq!(names(&self.canary), ["secret"]);
            let secret = self.canary.join("secret");
            assert_eq!(fs::read_to_string(&secret).unwrap(), "secret");
            assert_eq!(fs::metadata(&secret).unwrap().nlink(), 1);
            assert_eq!(
                names(&self.outer.join("..")).len(),
                2,
                "outer and canary only"
            );
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        let n = rfs::lgetxattr(path, name, &mut buf).ok()?;
        buf.truncate(n);
        Some(buf)
    }

    fn lstat(path: &Path) -> fs::Metadata {
        fs::symlink_metadata(path).unwrap()
    }

    #[test]
    fn layer_keeps_owners_modes_times_and_links() {
        let sb = Sandbox::new();
        let mut tar = Tar::new();
        tar.dir("usr/")
            .dir("usr/bin/")
            .raw(b"usr/bin/su", EntryType::Regular, b"", b"su!", |h| {
                h.set_mode(0o4755)
            })
            .raw(b"usr/bin/user-suid", EntryType::Regular, b"", b"x", |h| {
                h.set_mode(0o4750);
                h.set_uid(1000);
                h.set_gid(1000);
            })
            .raw(b"usr/bin/sgid", EntryType::Regular, b"", b"x", |h| {
                h.set_mode(0o2711);
                h.set_gid(50);
            })
            .raw(b"home/user/notes", EntryType::Regular, b"", b"hello", |h| {
                h.set_mode(0o640);
                h.set_uid(1000);
                h.set_gid(1001);
                h.set_mtime(1_500_000_000);
            })
            .raw(b"tmp/", EntryType::Directory, b"", b"", |h| {
                h.set_mode(0o1777)
            })
            .raw(
                b"usr/bin/sh",
                EntryType::Symlink,
                b"/bin/busybox",
                b"",
                |h| {
                    h.set_uid(1000);
                    h.set_gid(1000);
                    h.set_mtime(1_400_000_000);
                },
            )
            .hardlink("usr/bin/su-again", b"usr/bin/su")
            .raw(b"run/fifo", EntryType::Fifo, b"", b"", |h| {
                h.set_mode(0o620);
                h.set_uid(5);
            });
        let stats = sb.layer(tar.bytes()).unwrap();

        let su = lstat(&sb.path("usr/bin/su"));
        assert_eq!(su.mode() & 0o7777, 0o4755);
        assert_eq!((su.uid(), su.gid()), (0, 0));
        assert_eq!(fs::read(sb.path("usr/bin/su")).unwrap(), b"su!");
        assert_eq!(su.mtime(), MTIME as i64);
        assert_eq!(su.nlink(), 2);
        assert_eq!(lstat(&sb.path("usr/bin/su-again")).ino(), su.ino());

        let user_suid = lstat(&sb.path("usr/bin/user-suid"));
        assert_eq!(user_suid.mode() & 0o7777, 0o4750);
        assert_eq!((user_suid.uid(), user_suid.gid()), (1000, 1000));
        let sgid = lstat(&sb.path("usr/bin/sgid"));
        assert_eq!((sgid.mode() & 0o7777, sgid.gid()), (0o2711, 50));

        let notes = lstat(&sb.path("home/user/notes"));
        assert_eq!(notes.mode() & 0o7777, 0o640);
        assert_eq!((notes.uid(), notes.gid()), (1000, 1001));
        assert_eq!(notes.mtime(), 1_500_000_000);
        // Implicit parents are root's, 0755.
        let home = lstat(&sb.path("home"));
        assert_eq!((home.mode() & 0o7777, home.uid()), (0o755, 0));

        let tmp = lstat(&sb.path("tmp"));
        assert!(tmp.is_dir());
        assert_eq!(tmp.mode() & 0o7777, 0o1777);

        let sh = lstat(&sb.path("usr/bin/sh"));
        assert!(sh.file_type().is_symlink());
        assert_eq!(
            fs::read_link(sb.path("usr/bin/sh")).unwrap(),
            Path::new("/bin/busybox")
        );
        assert_eq!(
            (sh.uid(), sh.gid(), sh.mtime()),
            (1000, 1000, 1_400_000_000)
        );

        let fifo = lstat(&sb.path("run/fifo"));
        assert!(fifo.file_type().is_fifo());
        assert_eq!((fifo.mode() & 0o7777, fifo.uid()), (0o620, 5));

        assert_eq!(stats.files, 4);
        assert_eq!(stats.dirs, 3);
        assert_eq!(stats.symlinks, 1);
        assert_eq!(stats.hardlinks, 1);
        assert_eq!(stats.fifos, 1);
        assert_eq!(stats.bytes, 3 + 1 + 1 + 5);
        sb.assert_contained();
    }

    #[test]
    fn layer_keeps_file_capabilities() {
        let sb = Sandbox::new();
        // VFS_CAP_REVISION_2 | effective, permitted = CAP_NET_BIND_SERVICE.
        let mut capability = Vec::new();
        for word in [0x0200_0001u32, 1 << 10, 0, 0, 0] {
            capability.extend_from_slice(&word.to_le_bytes());
        }
        let mut tar = Tar::new();
        tar.0
            .append_pax_extensions([("SCHILY.xattr.security.capability", capability.as_slice())])
            .unwrap();
        tar.raw(b"bin/ping", EntryType::Regular, b"", b"ping", |h| {
            h.set_mode(0o755);
            h.set_uid(0);
        });
        sb.layer(tar.bytes()).unwrap();
        assert_eq!(
            xattr(&sb.path("bin/ping"), "security.capability"),
            Some(capability)
        );
    }

    #[test]
    fn pax_records_override_owner_and_mtime() {
        let sb = Sandbox::new();
        let mut tar = Tar::new();
        tar.0
            .append_pax_extensions([
                ("uid", b"3000000".as_slice()),
                ("gid", b"3000001".as_slice()),
                ("mtime", b"1700000000.25".as_slice()),
            ])
            .unwrap();
        tar.file("big-ids", "x");
        sb.layer(tar.bytes()).unwrap();
        let meta = lstat(&sb.path("big-ids"));
        assert_eq!((meta.uid(), meta.gid()), (3_000_000, 3_000_001));
        assert_eq!(
            (meta.mtime(), meta.mtime_nsec()),
            (1_700_000_000, 250_000_000)
        );
    }

    #[test]
    fn whiteouts_become_char_devices_and_opaque_markers_xattrs() {
        let sb = Sandbox::new();
        let mut tar = Tar::new();
        tar.dir("etc/")
            .file("etc/.wh.passwd", "")
            .dir("var/")
            .file("var/.wh..wh..opq", "")
            .file("var/new", "new")
            .file("keep", "mine")
            .file(".wh.keep", "")
            .file("deep/er/.wh.gone", "");
        let stats = sb.layer(tar.bytes()).unwrap();

        let passwd = lstat(&sb.path("etc/passwd"));
        assert!(passwd.file_type().is_char_device());
        assert_eq!(passwd.rdev(), 0);
        assert!(!sb.path("etc/.wh.passwd").exists());
        assert!(lstat(&sb.path("deep/er/gone")).file_type().is_char_device());

        assert_eq!(
            xattr(&sb.path("var"), "user.overlay.opaque"),
            Some(b"y".to_vec())
        );
        assert_eq!(
            xattr(&sb.path("var"), "trusted.overlay.opaque"),
            Some(b"y".to_vec())
        );
        assert!(!sb.path("var/.wh..wh..opq").exists());
        assert_eq!(fs::read_to_string(sb.path("var/new")).unwrap(), "new");

        // A whiteout hides lower layers only; the same layer's file stays.
        assert_eq!(fs::read_to_string(sb.path("keep")).unwrap(), "mine");
        assert_eq!((stats.whiteouts, stats.opaque_dirs), (2, 1));
        sb.assert_contained();
    }

    #[test]
    fn upload_refuses_whiteouts() {
        for name in [".wh.x", "dir/.wh..wh..opq", ".wh.dir/file"] {
            let sb = Sandbox::new();
            let mut tar = Tar::new();
            tar.file(name, "");
            let err = sb.upload(tar.bytes()).unwrap_err();
            assert!(
                matches!(&err, UnpackError::UnsafePath { entry } if entry == name),
                "{name}: {err}"
            );
            sb.assert_contained();
        }
    }

    #[test]
    fn refuses_absolute_names_and_parent_components() {
        let long_escape = format!("{}/../../../escaped", "a".repeat(120));
        let sb = Sandbox::new();
        let absolute = sb.canary.join("absolute");
        let cases: Vec<(Vec<u8>, EntryType)> = vec![
            (b"../escaped".to_vec(), EntryType::Regular),
            (b"./../escaped".to_vec(), EntryType::Regular),
            (b"a/../../escaped".to_vec(), EntryType::Regular),
            (b"a/b/../../../escaped".to_vec(), EntryType::Directory),
            (absolute.as_os_str().as_bytes().to_vec(), EntryType::Regular),
            (b"/escaped-dir/".to_vec(), EntryType::Directory),
            (b"../escaped-link".to_vec(), EntryType::Symlink),
            (b"../escaped-fifo".to_vec(), EntryType::Fifo),
            (long_escape.into_bytes(), EntryType::Regular),
        ];
        for (name, kind) in cases {
            for upload in [false, true] {
                let sb = Sandbox::new();
                let mut tar = Tar::new();
                tar.file("ok", "fine")
                    .raw(&name, kind, b"target", b"data", |_| {});
                let tar = tar.bytes();
                let err = sb.refused(tar, upload);
                let shown = String::from_utf8_lossy(&name).into_owned();
                assert!(
                    matches!(&err, UnpackError::UnsafePath { entry } if *entry == shown),
                    "{shown}: {err}"
                );
                sb.assert_contained();
                assert!(!absolute.exists());
            }
        }
    }

    #[test]
    fn never_follows_a_symlink_to_create_an_entry() {
        let sb = Sandbox::new();
        let canary = sb.canary.as_os_str().as_bytes().to_vec();
        let escapes: [(&str, &[u8]); 2] = [("abs", &canary), ("rel", b"../../canary")];
        for (link, target) in escapes {
            let follow_ups: [(String, EntryType); 6] = [
                (format!("{link}/pwn"), EntryType::Regular),
                (format!("{link}/pwn-dir/"), EntryType::Directory),
                (format!("{link}/sub/pwn"), EntryType::Regular),
                (format!("{link}/.wh.secret"), EntryType::Regular),
                (format!("{link}/.wh..wh..opq"), EntryType::Regular),
                (format!("{link}/pwn-link"), EntryType::Symlink),
            ];
            for (name, kind) in follow_ups {
                let sb = Sandbox::new();
                let mut tar = Tar::new();
                tar.symlink(link, target)
                    .raw(name.as_bytes(), kind, b"x", b"pwned", |_| {});
                let err = sb.layer(tar.bytes()).unwrap_err();
                assert!(
                    matches!(&err, UnpackError::UnsafePath { entry } if *entry == name),
                    "{name}: {err}"
                );
                sb.assert_contained();
                assert!(xattr(&sb.canary, "user.overlay.opaque").is_none());
            }
        }

        // The same for uploads.
        let sb = Sandbox::new();
        let mut tar = Tar::new();
        tar.symlink("abs", &canary).file("abs/pwn", "pwned");
        let err = sb.upload(tar.bytes()).unwrap_err();
        assert!(matches!(err, UnpackError::UnsafePath { .. }), "{err}");
        sb.assert_contained();
    }

    #[test]
    fn hard_links_stay_inside() {
        let sb = Sandbox::new();
        let secret = sb.canary.join("secret");
        let canary = sb.canary.as_os_str().as_bytes().to_vec();
        let targets: Vec<Vec<u8>> = vec![
            b"../outside".to_vec(),
            b"dir/../../canary/secret".to_vec(),
            secret.as_os_str().as_bytes().to_vec(),
            b"via-link/secret".to_vec(),
            b"missing".to_vec(),
            b"dir".to_vec(),
            b"dir/".to_vec(),
            b"".to_vec(),
            b".".to_vec(),
        ];
        for target in targets {
            for upload in [false, true] {
                let sb = Sandbox::new();
                let mut tar = Tar::new();
                tar.dir("dir/")
                    .symlink("via-link", &canary)
                    .hardlink("link", &target);
                let tar = tar.bytes();
                let err = sb.refused(tar, upload);
                let shown = String::from_utf8_lossy(&target).into_owned();
                assert!(
                    matches!(&err, UnpackError::LinkOutside { entry, target }
                        if entry == "link" && *target == shown),
                    "{shown}: {err}"
                );
                assert!(!sb.path("link").exists());
                sb.assert_contained();
            }
        }
    }

    #[test]
    fn hard_links_within_the_archive_work_in_uploads() {
        let sb = Sandbox::new();
        let mut tar = Tar::new();
        tar.file("a/original", "data")
            .hardlink("b/copy", b"./a//original");
        let stats = sb.upload(tar.bytes()).unwrap();
        assert_eq!(stats.hardlinks, 1);
        assert_eq!(
            lstat(&sb.path("b/copy")).ino(),
            lstat(&sb.path("a/original")).ino()
        );
    }

    #[test]
    fn devices_are_skipped_in_layers_and_refused_in_uploads() {
        let device = |tar: &mut Tar, name: &str, kind| {
            tar.raw(name.as_bytes(), kind, b"", b"", |h| {
                h.set_device_major(1).unwrap();
                h.set_device_minor(3).unwrap();
            });
        };
        let sb = Sandbox::new();
        let mut tar = Tar::new();
        device(&mut tar, "dev/null", EntryType::Char);
        device(&mut tar, "dev/sda", EntryType::Block);
        tar.file("after", "still here");
        let stats = sb.layer(tar.bytes()).unwrap();
        assert_eq!(stats.devices_skipped, 2);
        assert!(!sb.path("dev/null").exists() && !sb.path("dev/sda").exists());
        assert!(sb.path("after").exists());
        sb.assert_contained();

        for kind in [EntryType::Char, EntryType::Block, EntryType::Fifo] {
            let sb = Sandbox::new();
            let mut tar = Tar::new();
            device(&mut tar, "node", kind);
            let err = sb.upload(tar.bytes()).unwrap_err();
            assert!(
                matches!(&err, UnpackError::Device { entry } if entry == "node"),
                "{err}"
            );
            assert!(!sb.path("node").exists());
        }
    }

    #[test]
    fn uploads_detect_gzip_and_belong_to_root() {
        let mut tar = Tar::new();
        tar.raw(b"app/", EntryType::Directory, b"", b"", |h| {
            h.set_mode(0o2775);
            h.set_uid(1000);
        })
        .raw(b"app/run", EntryType::Regular, b"", b"#!/bin/sh\n", |h| {
            h.set_mode(0o4755);
            h.set_uid(1000);
            h.set_gid(1000);
        })
        .symlink("app/latest", b"/etc/passwd");
        let plain = tar.bytes();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&plain).unwrap();
        let gzipped = gz.finish().unwrap();
        assert_eq!(gzipped[..2], [0x1f, 0x8b]);

        for archive in [plain, gzipped] {
            let sb = Sandbox::new();
            let stats = sb.upload(archive).unwrap();
            assert_eq!((stats.files, stats.dirs, stats.symlinks), (1, 1, 1));
            let run = lstat(&sb.path("app/run"));
            assert_eq!((run.uid(), run.gid()), (0, 0));
            assert_eq!(run.mode() & 0o7777, 0o4755);
            let app = lstat(&sb.path("app"));
            assert_eq!((app.uid(), app.mode() & 0o7777), (0, 0o2775));
            assert_eq!(
                fs::read_link(sb.path("app/latest")).unwrap(),
                Path::new("/etc/passwd")
            );
            sb.assert_contained();
        }

        // Not a tar at all, compressed or not.
        let sb = Sandbox::new();
        let err = sb
            .upload(b"\x1f\x8bnot gzip".to_vec())
            .expect_err("a gzip magic over garbage");
        assert!(
            matches!(&err, UnpackError::Tar(source) if source.kind() == io::ErrorKind::InvalidInput),
            "{err:?}"
        );
    }

    #[test]
    fn later_entries_replace_earlier_ones() {
        let sb = Sandbox::new();
        let canary = sb.canary.join("secret");
        let mut tar = Tar::new();
        tar.file("x", "one")
            .file("x", "two")
            .dir("d/")
            .file("d/keep", "kept")
            .raw(b"d/", EntryType::Directory, b"", b"", |h| h.set_mode(0o700))
            .file("f", "file")
            .dir("f/")
            .file("t/sub/deep", "deep")
            .file("t", "now a file")
            .symlink("l", canary.as_os_str().as_bytes())
            .file("l", "mine")
            .hardlink("h", b"x")
            .file("h", "other")
            .file("gone-dir/child", "c")
            .symlink("gone-dir", b"/etc");
        sb.layer(tar.bytes()).unwrap();

        assert_eq!(fs::read_to_string(sb.path("x")).unwrap(), "two");
        assert_eq!(fs::read_to_string(sb.path("d/keep")).unwrap(), "kept");
        assert_eq!(lstat(&sb.path("d")).mode() & 0o7777, 0o700);
        assert!(lstat(&sb.path("f")).is_dir());
        assert_eq!(fs::read_to_string(sb.path("t")).unwrap(), "now a file");
        assert!(lstat(&sb.path("l")).is_file());
        assert_eq!(fs::read_to_string(sb.path("l")).unwrap(), "mine");
        assert_eq!(fs::read_to_string(sb.path("h")).unwrap(), "other");
        assert_eq!(lstat(&sb.path("x")).nlink(), 1);
        assert!(lstat(&sb.path("gone-dir")).file_type().is_symlink());
        sb.assert_contained();
    }

    #[test]
    fn directory_metadata_is_applied_after_children() {
        let sb = Sandbox::new();
        let mut tar = Tar::new();
        tar.raw(b"./", EntryType::Directory, b"", b"", |h| {
            h.set_mode(0o750);
            h.set_mtime(1_000_000_000);
        })
        .file("d/first", "1")
        .raw(b"d/", EntryType::Directory, b"", b"", |h| {
            h.set_mode(0o555);
            h.set_uid(7);
            h.set_mtime(1_234_567_890);
        })
        .file("d/second", "2")
        .raw(b"ro/", EntryType::Directory, b"", b"", |h| {
            h.set_mode(0o500)
        })
        .file("ro/inner/file", "3")
        .raw(b"ro/inner/", EntryType::Directory, b"", b"", |h| {
            h.set_mode(0o500);
            h.set_mtime(1_111_111_111);
        });
        sb.layer(tar.bytes()).unwrap();

        let d = lstat(&sb.path("d"));
        assert_eq!(
            (d.mode() & 0o7777, d.uid(), d.mtime()),
            (0o555, 7, 1_234_567_890)
        );
        assert!(sb.path("d/first").exists() && sb.path("d/second").exists());
        assert_eq!(lstat(&sb.path("ro")).mode() & 0o7777, 0o500);
        let inner = lstat(&sb.path("ro/inner"));
        assert_eq!(
            (inner.mode() & 0o7777, inner.mtime()),
            (0o500, 1_111_111_111)
        );
        assert_eq!(fs::read_to_string(sb.path("ro/inner/file")).unwrap(), "3");
        let root = lstat(&sb.dest);
        assert_eq!((root.mode() & 0o7777, root.mtime()), (0o750, 1_000_000_000));
    }

    #[test]
    fn names_are_normalised() {
        let sb = Sandbox::new();
        let mut tar = Tar::new();
        tar.file("./a//b/./c", "abc").file("a/b/c/", "");
        // The second entry is a directory by its trailing slash and replaces the file.
        sb.layer(tar.bytes()).unwrap();
        assert!(lstat(&sb.path("a/b/c")).is_dir());
        let sb = Sandbox::new();
        let mut tar = Tar::new();
        tar.file("./a//b/./c", "abc");
        sb.layer(tar.bytes()).unwrap();
        assert_eq!(fs::read_to_string(sb.path("a/b/c")).unwrap(), "abc");
        assert_eq!(names(&sb.dest), ["a"]);
    }

    #[test]
    fn odd_entries_are_errors() {
        let cases: [(&[u8], EntryType, &[u8]); 5] = [
            (b"file/child", EntryType::Regular, b""),
            (b".wh.dir/child", EntryType::Regular, b""),
            (b".", EntryType::Regular, b""),
            (b"dir/.wh..", EntryType::Regular, b""),
            (b"empty-link", EntryType::Symlink, b""),
        ];
        for (name, kind, link) in cases {
            let sb = Sandbox::new();
            let mut tar = Tar::new();
            tar.file("file", "x").raw(name, kind, link, b"", |_| {});
            let err = sb.layer(tar.bytes()).unwrap_err();
            let shown = String::from_utf8_lossy(name).into_owned();
            assert!(err.to_string().contains(&shown), "{shown}: {err}");
            sb.assert_contained();
        }
    }

    #[test]
    fn a_budget_bounds_the_disk_space_of_several_layers_together() {
        let sb = Sandbox::new();
        // Two layers of 3 × 5000 bytes each: 8 KiB and an entry charge per file.
        let layer = |prefix: &str| {
            let mut tar = Tar::new();
            for i in 0..3 {
                tar.file(&format!("{prefix}{i}"), &"x".repeat(5000));
            }
            tar.bytes()
        };
        let per_layer = 3 * (2 * BLOCK + ENTRY_COST);
        let budget = ByteBudget::new(per_layer * 2);
        let first = sb.dest.join("first");
        let second = sb.dest.join("second");
        fs::create_dir(&first).unwrap();
        fs::create_dir(&second).unwrap();
        apply_layer_within(layer("a").as_slice(), &first, &budget).unwrap();
        assert_eq!(budget.used(), per_layer);
        apply_layer_within(layer("b").as_slice(), &second, &budget).unwrap();
        assert_eq!(budget.used(), per_layer * 2);
        // The budget is spent: one more byte of content is refused, naming the entry.
        let third = sb.dest.join("third");
        fs::create_dir(&third).unwrap();
        let mut tar = Tar::new();
        tar.file("c0", "");
        let err = apply_layer_within(tar.bytes().as_slice(), &third, &budget).unwrap_err();
        assert!(
            matches!(&err, UnpackError::TooLarge { entry, limit } if entry == "c0" && *limit == per_layer * 2),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains(&format!("{} bytes", per_layer * 2))
        );

        // A file larger than what is left stops while it is written.
        let budget = ByteBudget::new(1 << 20);
        let mut tar = Tar::new();
        tar.file("small", "hello");
        tar.file("big", &"y".repeat(2 << 20));
        let fourth = sb.dest.join("fourth");
        fs::create_dir(&fourth).unwrap();
        let err = apply_layer_within(tar.bytes().as_slice(), &fourth, &budget).unwrap_err();
        assert!(
            matches!(&err, UnpackError::TooLarge { entry, .. } if entry == "big"),
            "{err}"
        );
        assert!(budget.used() <= 1 << 20);
        sb.assert_contained();
    }

    #[test]
    fn limits_are_enforced() {
        let sb = Sandbox::new();
        let mut tar = Tar::new();
        for i in 0..5 {
            tar.file(&format!("f{i}"), "");
        }
        let err = unpack(tar.bytes().as_slice(), &sb.dest, Flavor::Layer, 3, None).unwrap_err();
        assert!(
            matches!(&err, UnpackError::Limit { entry, .. } if entry == "f3"),
            "{err}"
        );

        // A gigantic GNU long name must fail before it is held in memory.
        let mut tar = Tar::new();
        tar.long(b'L', &vec![b'a'; (MAX_METADATA_BYTES + 1024) as usize]);
        tar.file("x", "");
        let err = sb.layer(tar.bytes()).unwrap_err();
        assert!(matches!(err, UnpackError::Tar(_)), "{err}");

        let mut tar = Tar::new();
        tar.file(&format!("{}/x", "n".repeat(300)), "");
        let err = sb.layer(tar.bytes()).unwrap_err();
        assert!(matches!(err, UnpackError::Limit { .. }), "{err}");
        sb.assert_contained();
    }

    #[test]
    fn layer_stack_applies_in_order() {
        let tmp = tempfile::tempdir().unwrap();
        let lower = tmp.path().join("lower");
        let upper = tmp.path().join("upper");
        fs::create_dir(&lower).unwrap();
        fs::create_dir(&upper).unwrap();

        let mut first = Tar::new();
        first
            .dir("bin/")
            .file("bin/tool", "v1")
            .dir("etc/")
            .file("etc/conf", "a")
            .dir("data/")
            .file("data/old1", "1")
            .file("data/old2", "2");
        apply_layer(first.bytes().as_slice(), &lower).unwrap();

        let mut second = Tar::new();
        second
            .file("etc/.wh.conf", "")
            .dir("data/")
            .file("data/.wh..wh..opq", "")
            .file("data/new", "n")
            .file("bin/tool", "v2");
        apply_layer(second.bytes().as_slice(), &upper).unwrap();

        assert!(lstat(&upper.join("etc/conf")).file_type().is_char_device());
        assert_eq!(
            xattr(&upper.join("data"), "user.overlay.opaque"),
            Some(b"y".to_vec())
        );
        assert_eq!(names(&upper.join("data")), ["new"]);

        // Where mounting is allowed, overlayfs itself shows what the stack means.
        let merged = tmp.path().join("merged");
        fs::create_dir(&merged).unwrap();
        let options = CString::new(format!(
            "lowerdir={}:{},userxattr",
            upper.display(),
            lower.display()
        ))
        .unwrap();
        if let Err(e) = rustix::mount::mount(
            "overlay",
            &merged,
            "overlay",
            rustix::mount::MountFlags::RDONLY,
            Some(options.as_c_str()),
        ) {
            eprintln!("overlay mount not possible here ({e}); checked the layer contents only");
            return;
        }
        let view = (
            fs::read_to_string(merged.join("bin/tool")).unwrap(),
            merged.join("etc/conf").exists(),
            names(&merged.join("data")),
        );
        rustix::mount::unmount(&merged, rustix::mount::UnmountFlags::DETACH).unwrap();
        assert_eq!(view, ("v2".to_owned(), false, vec!["new".to_owned()]));
    }
}
