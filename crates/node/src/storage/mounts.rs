//! The mounts of the server's own mount namespace below a directory, and their removal: what
//! a build that died without cleaning up (or an older server that ran builds in the host's
//! namespace) may have left mounted inside a directory about to be removed.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DetachError {
    #[error("cannot read /proc/thread-self/mountinfo: {0}")]
    Read(std::io::Error),
    #[error("cannot unmount {path}: {source}")]
    Unmount {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("mounts below {0} keep coming back")]
    Stuck(PathBuf),
}

/// Decodes the octal escapes (`\040` for a space, `\011`, `\012`, `\134`) the kernel writes
/// for characters that would break a mountinfo line.
fn unescape(field: &str) -> PathBuf {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value = bytes[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
            if let Ok(byte) = u8::try_from(value) {
                out.push(byte);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    PathBuf::from(OsString::from_vec(out))
}

/// Every mount point named in `mountinfo` (the fifth field of each line), in table order.
pub fn mount_points(mountinfo: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape)
        .collect()
}

/// The mount points of `mountinfo` at or below `dir`, deepest first, so each can be unmounted
/// before the one it sits on.
pub fn mounts_below(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = mount_points(mountinfo)
        .into_iter()
        .filter(|point| point.starts_with(dir))
        .collect();
    // Later lines were mounted later: keep that order among equals, deepest first overall.
    found.reverse();
    found.sort_by_key(|point| std::cmp::Reverse(point.components().count()));
    found
}

/// Detaches (lazily, so a busy mount goes too) everything mounted at or below `dir` in this
/// mount namespace. Returns how many mounts went.
pub fn detach_below(dir: &Path) -> Result<usize, DetachError> {
    let mut detached = 0;
    // Stacked mounts show one layer per pass; a handful of passes covers any real leftover.
    for _ in 0..16 {
        // The calling thread's view: a thread may have a mount namespace of its own.
        let table =
            std::fs::read_to_string("/proc/thread-self/mountinfo").map_err(DetachError::Read)?;
        let below = mounts_below(&table, dir);
        if below.is_empty() {
            return Ok(detached);
        }
        for point in below {
            match rustix::mount::unmount(&point, rustix::mount::UnmountFlags::DETACH) {
                Ok(()) => detached += 1,
                // Gone with its parent already, or no longer a mount point.
                Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => {}
                Err(e) => {
                    return Err(DetachError::Unmount {
                        path: point,
                        source: e.into(),
                    });
                }
            }
        }
    }
    Err(DetachError::Stuck(dir.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw
90 22 0:50 / /var/tmp/data/templates/.base-v1.partial/proc rw - proc proc rw
91 22 0:51 / /var/tmp/data/templates/.base-v1.partial/sys ro - sysfs sysfs ro
92 22 0:52 / /var/tmp/data/templates/.base-v1.partial/dev/pts rw - devpts devpts rw
93 22 0:53 / /var/tmp/data/templates/.base-v1.partial/dev/shm rw - tmpfs tmpfs rw
94 22 0:54 / /var/tmp/data/templates/.base-v1.partialx rw - tmpfs tmpfs rw
95 22 0:55 / /var/tmp/with\\040space/in\\134dir rw - tmpfs tmpfs rw
";

    #[test]
    fn reads_every_mount_point_with_escapes_decoded() {
        let points = mount_points(TABLE);
        assert_eq!(points.len(), 8);
        assert_eq!(points[0], Path::new("/"));
        assert_eq!(points[7], Path::new("/var/tmp/with space/in\\dir"));
    }

    #[test]
    fn finds_mounts_below_a_directory_deepest_first_and_not_its_neighbours() {
        let below = mounts_below(TABLE, Path::new("/var/tmp/data/templates/.base-v1.partial"));
        let base = Path::new("/var/tmp/data/templates/.base-v1.partial");
        assert_eq!(
            below,
            vec![
                base.join("dev/shm"),
                base.join("dev/pts"),
                base.join("sys"),
                base.join("proc"),
            ]
        );
        assert!(mounts_below(TABLE, Path::new("/nowhere")).is_empty());
    }

    #[test]
    fn a_bad_escape_is_kept_as_written() {
        assert_eq!(unescape("a\\9b"), Path::new("a\\9b"));
        assert_eq!(unescape("end\\04"), Path::new("end\\04"));
        assert_eq!(unescape("\\777"), Path::new("\\777"));
    }
}
