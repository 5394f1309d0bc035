//! Filesystem operations behind `filesystem.Filesystem` and `/files`.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use buffa::MessageField;

use crate::proto::filesystem::{EntryInfo, FileType};
use crate::users::{Accounts, User};

/// Errors from filesystem calls; each carries the path involved.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// Nothing exists at the path.
    #[error("path '{0}' does not exist")]
    NotFound(PathBuf),
    /// Something already exists at the path.
    #[error("path '{0}' already exists")]
    AlreadyExists(PathBuf),
    /// The path exists but has the wrong kind.
    #[error("path '{path}' {reason}")]
    Invalid {
        /// The path.
        path: PathBuf,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The caller may not access the path.
    #[error("permission denied for '{0}'")]
    PermissionDenied(PathBuf),
    /// Any other I/O failure.
    #[error("{op} '{path}': {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

impl FsError {
    /// Classifies an I/O error on `path`.
    pub fn from_io(op: &'static str, path: &Path, source: io::Error) -> Self {
        if crate::paths::is_link_refusal(&source) || source.kind() == io::ErrorKind::InvalidInput {
            return FsError::Invalid {
                path: path.to_owned(),
                reason: "leads through a link into /proc that the agent does not follow",
            };
        }
        match source.kind() {
            io::ErrorKind::NotFound => FsError::NotFound(path.to_owned()),
            io::ErrorKind::AlreadyExists => FsError::AlreadyExists(path.to_owned()),
            io::ErrorKind::PermissionDenied => FsError::PermissionDenied(path.to_owned()),
            _ => FsError::Io {
                op,
                path: path.to_owned(),
                source,
            },
        }
    }
}

/// Makes a request path absolute: `~` and relative paths are taken from the user's home, and
/// `.`/`..` are folded lexically (as Go's `filepath.Clean`).
pub fn resolve_path(path: &str, user: &User) -> PathBuf {
    let raw = if path == "~" {
        user.home.clone()
    } else if let Some(rest) = path.strip_prefix("~/") {
        user.home.join(rest)
    } else if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        user.home.join(path)
    };
    let mut out = PathBuf::from("/");
    for component in raw.components() {
        match component {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(part) => out.push(part),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// `ls -l`-style permission string in Go's `FileMode.String` format, as envd reports it.
pub fn permissions_string(st_mode: u32) -> String {
    let mut out = String::with_capacity(11);
    match st_mode & libc::S_IFMT {
        libc::S_IFDIR => out.push('d'),
        libc::S_IFLNK => out.push('L'),
        libc::S_IFIFO => out.push('p'),
        libc::S_IFSOCK => out.push('S'),
        libc::S_IFBLK => out.push('D'),
        libc::S_IFCHR => out.push_str("Dc"),
        _ => {}
    }
    if st_mode & libc::S_ISUID != 0 {
        out.push('u');
    }
    if st_mode & libc::S_ISGID != 0 {
        out.push('g');
    }
    if st_mode & libc::S_ISVTX != 0 {
        out.push('t');
    }
    if out.is_empty() {
        out.push('-');
    }
    const RWX: &[u8; 9] = b"rwxrwxrwx";
    for (i, c) in RWX.iter().enumerate() {
        let bit = 1 << (8 - i);
        out.push(if st_mode & bit != 0 { *c as char } else { '-' });
    }
    out
}

fn timestamp(seconds: i64, nanos: i64) -> buffa_types::google::protobuf::Timestamp {
    buffa_types::google::protobuf::Timestamp {
        seconds,
        nanos: i32::try_from(nanos).unwrap_or(0),
        ..Default::default()
    }
}

/// Describes the entry at `path` without following a final symlink for its identity; a
/// symlink reports its target's type and size and sets `isSymlink`/`symlinkTarget`.
pub fn entry_info(path: &Path, accounts: &Accounts) -> Result<EntryInfo, FsError> {
    crate::paths::check_parent(path).map_err(|e| FsError::from_io("stat", path, e))?;
    let lmeta = std::fs::symlink_metadata(path).map_err(|e| FsError::from_io("stat", path, e))?;
    let is_symlink = lmeta.file_type().is_symlink();
    // The entry itself, or what a symlink leads to; a magic link's target (a host object of
    // the agent's) is never opened, so it is never described.
    let handle = crate::paths::open_path(path).ok();
    let (meta, symlink_target) = if is_symlink {
        let target = std::fs::read_link(path).ok().map(|t| {
            let base = path.parent().unwrap_or(Path::new("/"));
            let joined = base.join(t);
            resolve_path(&joined.to_string_lossy(), &User::root_like())
        });
        (handle.as_ref().and_then(|h| h.metadata().ok()), target)
    } else {
        (None, None)
    };
    let meta = meta.unwrap_or(lmeta);
    // Best effort, as in envd: an entry whose attributes cannot be read is still described.
    let metadata = handle
        .as_ref()
        .and_then(|h| crate::file_metadata::read(h, path).ok())
        .unwrap_or_default();
    let file_type = if meta.is_dir() {
        FileType::FILE_TYPE_DIRECTORY
    } else if meta.file_type().is_symlink() {
        FileType::FILE_TYPE_SYMLINK
    } else {
        FileType::FILE_TYPE_FILE
    };
    Ok(EntryInfo {
        name: path
            .file_name()
            .map_or_else(|| "/".to_owned(), |n| n.to_string_lossy().into_owned()),
        r#type: file_type.into(),
        path: path.to_string_lossy().into_owned(),
        size: i64::try_from(entry_size(&meta)).unwrap_or(i64::MAX),
        mode: meta.permissions().mode() & 0o777,
        permissions: permissions_string(meta.mode()),
        owner: accounts.user_name(meta.uid()),
        group: accounts.group_name(meta.gid()),
        modified_time: MessageField::some(timestamp(meta.mtime(), meta.mtime_nsec())),
        symlink_target: symlink_target.map(|t| t.to_string_lossy().into_owned()),
        is_symlink,
        metadata: metadata.into_iter().collect(),
        ..Default::default()
    })
}

/// The size an entry reports. A directory's is what it takes in whole blocks, at least one,
/// as on the ext4 roots E2B's sandboxes run on (4096 for a small directory): on btrfs, which
/// sandbox disks use, a directory's length is the sum of its names and an empty one's is 0,
/// which clients written against E2B read as "no directory".
fn entry_size(meta: &std::fs::Metadata) -> u64 {
    if !meta.is_dir() {
        return meta.len();
    }
    let block = meta.blksize().max(1);
    meta.len().div_ceil(block).max(1) * block
}

impl User {
    /// Placeholder account for folding paths that need no home directory.
    fn root_like() -> User {
        User {
            name: String::new(),
            uid: 0,
            gid: 0,
            home: PathBuf::from("/"),
            shell: String::new(),
        }
    }
}

/// Hands ownership of a freshly created path to the calling user.
pub fn chown_to(path: &Path, user: &User) -> Result<(), FsError> {
    std::os::unix::fs::lchown(path, Some(user.uid), Some(user.gid))
        .map_err(|e| FsError::from_io("chown", path, e))
}

/// Creates `dir` and any missing parents, giving each newly created one to `user`.
pub fn ensure_dirs(dir: &Path, user: &User) -> Result<(), FsError> {
    crate::paths::check(dir).map_err(|e| FsError::from_io("create directory", dir, e))?;
    let mut missing = Vec::new();
    let mut cursor = Some(dir);
    while let Some(current) = cursor {
        match std::fs::symlink_metadata(current) {
            Ok(meta) if meta.is_dir() || std::fs::metadata(current).is_ok_and(|m| m.is_dir()) => {
                break;
            }
            Ok(_) => {
                return Err(FsError::Invalid {
                    path: current.to_owned(),
                    reason: "is not a directory",
                });
            }
            Err(_) => missing.push(current.to_owned()),
        }
        cursor = current.parent();
    }
    for path in missing.into_iter().rev() {
        match std::fs::create_dir(&path) {
            Ok(()) => chown_to(&path, user)?,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(FsError::from_io("create directory", &path, e)),
        }
    }
    Ok(())
}

/// `Stat`.
pub fn stat(path: &Path, accounts: &Accounts) -> Result<EntryInfo, FsError> {
    entry_info(path, accounts)
}

/// `MakeDir`: creates the directory and its parents; an existing one is `AlreadyExists`.
pub fn make_dir(path: &Path, user: &User, accounts: &Accounts) -> Result<EntryInfo, FsError> {
    crate::paths::check(path).map_err(|e| FsError::from_io("create directory", path, e))?;
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => return Err(FsError::AlreadyExists(path.to_owned())),
        Ok(_) => {
            return Err(FsError::Invalid {
                path: path.to_owned(),
                reason: "already exists and is not a directory",
            });
        }
        Err(_) => {}
    }
    ensure_dirs(path, user)?;
    entry_info(path, accounts)
}

/// `Move`: renames, creating the destination's parents.
pub fn rename(
    source: &Path,
    destination: &Path,
    user: &User,
    accounts: &Accounts,
) -> Result<EntryInfo, FsError> {
    crate::paths::check_parent(source).map_err(|e| FsError::from_io("rename", source, e))?;
    std::fs::symlink_metadata(source).map_err(|e| FsError::from_io("stat", source, e))?;
    if let Some(parent) = destination.parent() {
        ensure_dirs(parent, user)?;
    }
    std::fs::rename(source, destination).map_err(|e| FsError::from_io("rename", source, e))?;
    entry_info(destination, accounts)
}

/// `Remove`: deletes a file, a symlink, or a directory tree.
/// `Remove`: like `rm -rf`, a path that is not there (or whose parent is not) is already
/// removed, which is what SDK users and watch code that clears its directory expect.
pub fn remove(path: &Path) -> Result<(), FsError> {
    let gone = |e: &io::Error| e.kind() == io::ErrorKind::NotFound;
    match crate::paths::check_parent(path) {
        Err(e) if gone(&e) => return Ok(()),
        Err(e) => return Err(FsError::from_io("remove", path, e)),
        Ok(()) => {}
    }
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if gone(&e) => return Ok(()),
        Err(e) => return Err(FsError::from_io("stat", path, e)),
    };
    let result = if meta.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match result {
        // Removed by someone else meanwhile: gone all the same.
        Err(e) if gone(&e) => Ok(()),
        other => other.map_err(|e| FsError::from_io("remove", path, e)),
    }
}

/// `ListDir`: entries below `path` down to `depth` levels (0 is treated as 1). Symlinked
/// directories are listed but not descended into, to avoid cycles.
pub fn list_dir(path: &Path, depth: u32, accounts: &Accounts) -> Result<Vec<EntryInfo>, FsError> {
    let meta = crate::paths::metadata(path).map_err(|e| FsError::from_io("stat", path, e))?;
    if !meta.is_dir() {
        return Err(FsError::Invalid {
            path: path.to_owned(),
            reason: "is not a directory",
        });
    }
    let mut out = Vec::new();
    walk(path, depth.max(1), accounts, &mut out)?;
    Ok(out)
}

fn walk(
    dir: &Path,
    depth: u32,
    accounts: &Accounts,
    out: &mut Vec<EntryInfo>,
) -> Result<(), FsError> {
    let mut children: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| FsError::from_io("read directory", dir, e))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .collect();
    children.sort();
    for child in children {
        // Entries can vanish between readdir and stat; skip them rather than fail the call.
        let Ok(info) = entry_info(&child, accounts) else {
            continue;
        };
        let descend = depth > 1
            && !info.is_symlink
            && info.r#type.as_known() == Some(FileType::FILE_TYPE_DIRECTORY);
        out.push(info);
        if descend {
            // Unreadable subdirectories are listed but not entered.
            let _ = walk(&child, depth - 1, accounts, out);
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn user() -> User {
        User {
            name: "u".into(),
            uid: 1000,
            gid: 1000,
            home: PathBuf::from("/home/u"),
            shell: "/bin/sh".into(),
        }
    }

    #[test]
    fn a_directory_reports_whole_blocks_and_a_file_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let empty = std::fs::metadata(dir.path()).unwrap();
        let block = empty.blksize();
        assert!(entry_size(&empty) >= block && entry_size(&empty).is_multiple_of(block));
        let file = dir.path().join("f");
        std::fs::write(&file, b"12345").unwrap();
        assert_eq!(entry_size(&std::fs::metadata(&file).unwrap()), 5);
    }

    #[test]
    fn formats_permissions_like_go() {
        assert_eq!(permissions_string(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(permissions_string(libc::S_IFDIR | 0o755), "drwxr-xr-x");
        assert_eq!(permissions_string(libc::S_IFLNK | 0o777), "Lrwxrwxrwx");
        assert_eq!(
            permissions_string(libc::S_IFREG | libc::S_ISUID | 0o755),
            "urwxr-xr-x"
        );
        assert_eq!(
            permissions_string(libc::S_IFDIR | libc::S_ISVTX | 0o777),
            "dtrwxrwxrwx"
        );
    }

    #[test]
    fn resolves_paths_against_home() {
        assert_eq!(resolve_path("a/b", &user()), PathBuf::from("/home/u/a/b"));
        assert_eq!(resolve_path("~/x", &user()), PathBuf::from("/home/u/x"));
        assert_eq!(resolve_path("", &user()), PathBuf::from("/home/u"));
        assert_eq!(
            resolve_path("/tmp/../etc/./x", &user()),
            PathBuf::from("/etc/x")
        );
        assert_eq!(resolve_path("/../..", &user()), PathBuf::from("/"));
    }
}
