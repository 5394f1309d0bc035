//! User-defined file metadata, kept as `user.e2b.<key>` extended attributes as envd keeps it,
//! so metadata written through the SDK, by `setfattr` inside the sandbox, or carried by a
//! snapshot of the files reads back the same way.
//!
//! Attributes are changed only through a descriptor the caller opened (an upload's own file),
//! and read through a descriptor opened by the agent's path layer, so neither follows a link
//! the path layer would refuse.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use http::HeaderMap;

/// The attribute namespace: `user.` is the one unprivileged processes may use, `e2b.` keeps the
/// keys apart from other tools' `user.*` attributes, and matches what envd and the SDKs expect.
pub const XATTR_PREFIX: &str = "user.e2b.";

/// Upload headers carrying metadata: `X-Metadata-<key>: <value>` (header names arrive
/// lower-cased, which is also how envd stores the keys).
pub const HEADER_PREFIX: &str = "x-metadata-";

/// The kernel limits an attribute's whole name to 255 bytes.
pub const MAX_KEY_LEN: usize = 255 - XATTR_PREFIX.len();

/// Budget for a file's whole set (names with prefix, plus values): ext4 keeps all of an inode's
/// attributes in one 4 KiB block, so envd refuses more up front, and so does the agent, so a
/// set accepted here is one any E2B sandbox accepts too.
pub const MAX_TOTAL_LEN: usize = 4096;

/// A file's metadata, keys without the prefix.
pub type Metadata = BTreeMap<String, String>;

/// Why an upload's metadata was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InvalidMetadata {
    /// A key longer than an attribute name may be.
    #[error("invalid metadata: key '{key}' is longer than {max} bytes")]
    KeyTooLong {
        /// The key.
        key: String,
        /// The longest key allowed.
        max: usize,
    },
    /// A key or value with a byte outside printable US-ASCII.
    #[error("invalid metadata: {what} has the non-printable byte 0x{byte:02x} at offset {offset}")]
    NotPrintable {
        /// Which key or value.
        what: String,
        /// The byte.
        byte: u8,
        /// Where it is.
        offset: usize,
    },
    /// The set is larger than a file's attributes may be.
    #[error("invalid metadata: {total} bytes in all, more than the {max} a file may hold")]
    TooLarge {
        /// Size of the set as counted.
        total: usize,
        /// The budget.
        max: usize,
    },
}

/// Why metadata could not be written to a file.
#[derive(Debug, thiserror::Error)]
pub enum WriteMetadataError {
    /// The file's filesystem has no extended attributes (`/proc`, `/sys`, some tmpfs).
    #[error("file '{0}' is on a filesystem without extended attributes")]
    Unsupported(PathBuf),
    /// The disk or the sandbox's quota has no room for the attributes.
    #[error("no space left for the metadata of '{path}': {source}")]
    NoSpace {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// Any other failure.
    #[error("writing the metadata of '{path}': {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

/// Why a file's metadata could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadMetadataError {
    /// Opening the file or reading its attributes failed.
    #[error("reading the metadata of '{path}': {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

/// The metadata an upload carries in its `X-Metadata-*` headers: keys lower-cased, the first
/// value of a repeated header, empty keys ignored (as envd does), the set validated whole.
pub fn from_headers(headers: &HeaderMap) -> Result<Metadata, InvalidMetadata> {
    let mut metadata = Metadata::new();
    for name in headers.keys() {
        let Some(key) = name.as_str().strip_prefix(HEADER_PREFIX) else {
            continue;
        };
        if key.is_empty() {
            continue;
        }
        let Some(value) = headers.get(name) else {
            continue;
        };
        let value = value.as_bytes();
        printable("value", key, value)?;
        // Printable ASCII is UTF-8, so nothing is lost here.
        metadata.insert(key.to_owned(), String::from_utf8_lossy(value).into_owned());
    }
    validate(&metadata)?;
    Ok(metadata)
}

fn printable(kind: &str, key: &str, bytes: &[u8]) -> Result<(), InvalidMetadata> {
    match bytes.iter().position(|b| !(0x20..=0x7e).contains(b)) {
        None => Ok(()),
        Some(offset) => Err(InvalidMetadata::NotPrintable {
            what: if kind == "key" {
                format!("key '{}'", key.escape_default())
            } else {
                format!("the value of key '{}'", key.escape_default())
            },
            byte: bytes[offset],
            offset,
        }),
    }
}

/// Checks a set against envd's rules: printable US-ASCII keys and values, keys that fit an
/// attribute name, and a whole set within [`MAX_TOTAL_LEN`].
pub fn validate(metadata: &Metadata) -> Result<(), InvalidMetadata> {
    let mut total = 0;
    for (key, value) in metadata {
        if key.len() > MAX_KEY_LEN {
            return Err(InvalidMetadata::KeyTooLong {
                key: key.clone(),
                max: MAX_KEY_LEN,
            });
        }
        printable("key", key, key.as_bytes())?;
        printable("value", key, value.as_bytes())?;
        total += XATTR_PREFIX.len() + key.len() + value.len();
    }
    if total > MAX_TOTAL_LEN {
        return Err(InvalidMetadata::TooLarge {
            total,
            max: MAX_TOTAL_LEN,
        });
    }
    Ok(())
}

fn unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOTSUP))
}

fn no_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// Replaces the metadata of the file open as `file` with `metadata`: keys the set does not
/// name are removed, so overwriting a file without metadata clears what an earlier upload left
/// (truncating a file keeps its attributes).
pub fn write(file: impl AsFd, path: &Path, metadata: &Metadata) -> Result<(), WriteMetadataError> {
    let fd = file.as_fd();
    let fail = |source: io::Error| {
        if unsupported(&source) {
            WriteMetadataError::Unsupported(path.to_owned())
        } else if no_space(&source) {
            WriteMetadataError::NoSpace {
                path: path.to_owned(),
                source,
            }
        } else {
            WriteMetadataError::Io {
                path: path.to_owned(),
                source,
            }
        }
    };
    for name in list_fd(fd).map_err(fail)? {
        let Some(key) = name.strip_prefix(XATTR_PREFIX.as_bytes()) else {
            continue;
        };
        if std::str::from_utf8(key).is_ok_and(|k| metadata.contains_key(k)) {
            continue;
        }
        match rustix::fs::fremovexattr(fd, name.as_slice()) {
            Ok(()) | Err(rustix::io::Errno::NODATA) => {}
            Err(e) => return Err(fail(e.into())),
        }
    }
    for (key, value) in metadata {
        rustix::fs::fsetxattr(
            fd,
            format!("{XATTR_PREFIX}{key}").as_str(),
            value.as_bytes(),
            rustix::fs::XattrFlags::empty(),
        )
        .map_err(|e| fail(e.into()))?;
    }
    Ok(())
}

/// The metadata of the file open as `file` (any descriptor, `O_PATH` ones included).
/// A filesystem without attributes has none; entries that are not UTF-8 (set by other means
/// than the SDK) are left out, since the protocol carries strings.
pub fn read(file: impl AsFd, path: &Path) -> Result<Metadata, ReadMetadataError> {
    let fail = |source: io::Error| ReadMetadataError::Io {
        path: path.to_owned(),
        source,
    };
    // An `O_PATH` descriptor takes no f*xattr calls; its own entry under /proc/self/fd names
    // exactly the inode it holds, whatever happened to the path since.
    let handle = format!("/proc/self/fd/{}", file.as_fd().as_raw_fd());
    let names = match list_path(&handle) {
        Ok(names) => names,
        Err(e) if unsupported(&e) => return Ok(Metadata::new()),
        Err(e) => return Err(fail(e)),
    };
    let mut metadata = Metadata::new();
    for name in names {
        let Some(key) = name.strip_prefix(XATTR_PREFIX.as_bytes()) else {
            continue;
        };
        let value = match get_path(&handle, &name) {
            Ok(value) => value,
            // Removed since it was listed.
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => continue,
            Err(e) => return Err(fail(e)),
        };
        if let (Ok(key), Ok(value)) = (String::from_utf8(key.to_vec()), String::from_utf8(value)) {
            metadata.insert(key, value);
        }
    }
    Ok(metadata)
}

/// The metadata of what `path` leads to, resolved by the agent's path layer (ordinary
/// symlinks followed, as envd reports a link's target's metadata; magic links never).
pub fn read_at(path: &Path) -> Result<Metadata, ReadMetadataError> {
    let file = crate::paths::open_path(path).map_err(|source| ReadMetadataError::Io {
        path: path.to_owned(),
        source,
    })?;
    read(&file, path)
}

/// Rounds of "ask the size, then read" before giving up on a list or value that keeps
/// growing under us.
const SIZE_RACE_ATTEMPTS: usize = 4;

fn split_names(buf: &[u8]) -> Vec<Vec<u8>> {
    buf.split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(<[u8]>::to_vec)
        .collect()
}

fn list_fd(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    sized(
        || rustix::fs::flistxattr_query(fd),
        |buf| rustix::fs::flistxattr(fd, buf),
    )
    .map(|buf| split_names(&buf))
}

fn list_path(path: &str) -> io::Result<Vec<Vec<u8>>> {
    sized(
        || rustix::fs::listxattr_query(path),
        |buf| rustix::fs::listxattr(path, buf),
    )
    .map(|buf| split_names(&buf))
}

fn get_path(path: &str, name: &[u8]) -> io::Result<Vec<u8>> {
    sized(
        || rustix::fs::getxattr_query(path, name),
        |buf| rustix::fs::getxattr(path, name, buf),
    )
}

/// Runs a query-then-read pair of xattr calls, retrying when the data grew in between.
fn sized(
    query: impl Fn() -> rustix::io::Result<usize>,
    read: impl Fn(&mut [u8]) -> rustix::io::Result<usize>,
) -> io::Result<Vec<u8>> {
    for _ in 0..SIZE_RACE_ATTEMPTS {
        let size = query()?;
        if size == 0 {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; size];
        match read(&mut buf) {
            Ok(n) => {
                buf.truncate(n);
                return Ok(buf);
            }
            Err(rustix::io::Errno::RANGE) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(io::Error::from_raw_os_error(libc::ERANGE))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn set(pairs: &[(&str, &str)]) -> Metadata {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// A scratch directory next to the crate rather than in /tmp, which may be a tmpfs without
    /// user attributes (before Linux 6.6).
    fn scratch() -> tempfile::TempDir {
        tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap()
    }

    #[test]
    fn headers_become_lower_case_keys() {
        let mut headers = HeaderMap::new();
        headers.insert("X-Metadata-Owner", "Alice".parse().unwrap());
        headers.insert("x-metadata-purpose", "test run".parse().unwrap());
        headers.insert("x-metadata-", "ignored".parse().unwrap());
        headers.insert("content-type", "text/plain".parse().unwrap());
        assert_eq!(
            from_headers(&headers).unwrap(),
            set(&[("owner", "Alice"), ("purpose", "test run")])
        );
    }

    #[test]
    fn bad_sets_are_refused() {
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert!(matches!(
            validate(&set(&[(&long, "v")])),
            Err(InvalidMetadata::KeyTooLong { .. })
        ));
        assert!(matches!(
            validate(&set(&[("k", "tab\there")])),
            Err(InvalidMetadata::NotPrintable {
                byte: b'\t',
                offset: 3,
                ..
            })
        ));
        let big = "v".repeat(MAX_TOTAL_LEN);
        assert!(matches!(
            validate(&set(&[("k", &big)])),
            Err(InvalidMetadata::TooLarge { .. })
        ));
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-metadata-k",
            http::HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        );
        // UTF-8 beyond ASCII is refused at its first byte, as envd refuses it.
        assert_eq!(
            from_headers(&headers),
            Err(InvalidMetadata::NotPrintable {
                what: "the value of key 'k'".into(),
                byte: 0xc3,
                offset: 3,
            })
        );
        assert!(validate(&set(&[(&"k".repeat(MAX_KEY_LEN), "v")])).is_ok());
    }

    #[test]
    fn write_replaces_the_set_and_read_follows_links() {
        let dir = scratch();
        let path = dir.path().join("file.txt");
        let file = crate::paths::create_write(&path).unwrap();
        // Another tool's attribute is none of ours: kept, and not reported.
        rustix::fs::fsetxattr(&file, "user.other", b"x", rustix::fs::XattrFlags::empty()).unwrap();

        write(&file, &path, &set(&[("a", "1"), ("b", "2")])).unwrap();
        assert_eq!(read_at(&path).unwrap(), set(&[("a", "1"), ("b", "2")]));

        write(&file, &path, &set(&[("b", "3")])).unwrap();
        assert_eq!(read_at(&path).unwrap(), set(&[("b", "3")]));

        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert_eq!(read_at(&link).unwrap(), set(&[("b", "3")]));

        write(&file, &path, &Metadata::new()).unwrap();
        assert!(read_at(&path).unwrap().is_empty());
        assert_eq!(
            rustix::fs::fgetxattr(&file, "user.other", &mut [0u8; 8][..]).unwrap(),
            1
        );

        // Set behind the agent's back with bytes the protocol cannot carry: left out.
        rustix::fs::fsetxattr(
            &file,
            "user.e2b.raw",
            b"\xff\xfe",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        assert!(read_at(&path).unwrap().is_empty());
    }

    #[test]
    fn magic_links_are_not_read_through() {
        let dir = scratch();
        let magic = dir.path().join("magic");
        std::os::unix::fs::symlink("/proc/self/exe", &magic).unwrap();
        assert_read_fails(&magic, io::ErrorKind::InvalidInput);
        assert_read_fails(&dir.path().join("missing"), io::ErrorKind::NotFound);
    }

    /// Reading the metadata at `at` fails with an error of `kind` that names it.
    fn assert_read_fails(at: &Path, kind: io::ErrorKind) {
        let read = read_at(at);
        assert!(
            matches!(
                &read,
                Err(ReadMetadataError::Io { path, source }) if path == at && source.kind() == kind
            ),
            "{read:?}"
        );
    }
}
