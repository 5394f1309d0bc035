//! Opening paths on behalf of a call without crossing a magic link.
//!
//! Inside a sandbox the agent is PID 1, so `/proc/self/…` and `/proc/1/…` are its own
//! descriptors and executable, which are host objects (its log file, its binary). Sandbox code
//! can plant an ordinary symlink to them, so every path a call names is resolved with
//! `RESOLVE_NO_MAGICLINKS`: ordinary symlinks are followed as envd follows them, `/proc`'s
//! magic links are not, and neither is anything they would lead to.

use std::fs::File;
use std::io;
use std::path::Path;

use rustix::fs::{Mode, OFlags};

/// Whether `e` means the resolution met a magic link (or a symlink loop).
pub fn is_link_refusal(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ELOOP) || e.raw_os_error() == Some(libc::EXDEV)
}

/// The error a call gets for a path that leads through a magic link.
pub fn link_refusal(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "path '{}' leads through a link into /proc that the agent does not follow",
            path.display()
        ),
    )
}

fn open(path: &Path, flags: OFlags, mode: u32) -> io::Result<File> {
    match sandbar_fs::open_at(
        rustix::fs::CWD,
        path,
        flags,
        Mode::from_raw_mode(mode),
        sandbar_fs::Links::Ordinary,
    ) {
        Ok(fd) => Ok(File::from(fd)),
        Err(e) => {
            let e = io::Error::from(e);
            if is_link_refusal(&e) {
                Err(link_refusal(path))
            } else {
                Err(e)
            }
        }
    }
}

/// Opens `path` for reading.
pub fn open_read(path: &Path) -> io::Result<File> {
    open(path, OFlags::RDONLY, 0)
}

/// Creates or truncates `path` for writing (mode 0644 before the umask when created).
pub fn create_write(path: &Path) -> io::Result<File> {
    open(path, OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC, 0o644)
}

/// An `O_PATH` handle on what `path` leads to (following ordinary symlinks, never magic
/// links): enough to stat it or read its attributes, and nothing it could do on open.
pub fn open_path(path: &Path) -> io::Result<File> {
    open(path, OFlags::PATH, 0)
}

/// The metadata of what `path` leads to (following ordinary symlinks, never magic links).
pub fn metadata(path: &Path) -> io::Result<std::fs::Metadata> {
    open_path(path)?.metadata()
}

/// Fails if resolving `path` (following ordinary symlinks) would cross a magic link; a path
/// that does not exist passes, so the caller reports it as it always did. Operations that do
/// not follow their last component (rename, unlink, mkdir) call this for the parent.
pub fn check(path: &Path) -> io::Result<()> {
    match open(path, OFlags::PATH, 0) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::InvalidInput => Err(e),
        // Other failures (permissions, not a directory) surface from the real operation.
        Err(_) => Ok(()),
    }
}

/// [`check`] for the directory holding `path`'s last component and, when `path` is itself a
/// symlink that the operation would follow, for `path` too.
pub fn check_parent(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => check(parent),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Other failures (permissions, a missing file) would also be errors; only the refusal
    /// shows the link was not followed.
    fn assert_link_refusal<T: std::fmt::Debug>(result: io::Result<T>, path: &Path) {
        let err = result.expect_err("a magic link was followed");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
        assert_eq!(err.to_string(), link_refusal(path).to_string());
    }

    #[test]
    fn magic_links_are_refused_and_ordinary_ones_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("target.txt");
        std::fs::write(&target, "data").expect("write");
        let ordinary = dir.path().join("ordinary");
        std::os::unix::fs::symlink(&target, &ordinary).expect("symlink");
        let magic = dir.path().join("magic");
        std::os::unix::fs::symlink("/proc/self/exe", &magic).expect("symlink");

        assert_eq!(
            std::io::read_to_string(open_read(&ordinary).expect("ordinary link")).expect("read"),
            "data"
        );
        let err = open_read(&magic).expect_err("magic link followed");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        let exe = Path::new("/proc/self/exe");
        assert_link_refusal(open_read(exe), exe);
        assert_link_refusal(create_write(&magic), &magic);
        assert_link_refusal(check(&magic), &magic);
        assert!(check(&dir.path().join("missing")).is_ok());
        assert!(check(&ordinary).is_ok());
    }
}
