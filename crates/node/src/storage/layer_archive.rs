//! A layer directory written as an OCI layer archive (an uncompressed tar), the form in
//! which layers travel between nodes through the layer store: the overlayfs markers of the
//! directory become the archive's whiteout names (a character device 0:0 becomes
//! `.wh.<name>`, an opaque directory gets a `.wh..wh..opq` entry), which
//! [`sandbar_image::apply_layer`] turns back into markers on the receiving node.
//!
//! A build step's layer was written by a tenant's sandbox, so the walk goes through
//! directory handles and never follows a link; links are archived as links.

#![deny(clippy::disallowed_methods)]

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::{File, Metadata};
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use sandbar_fs::{Dir, Entry, Kind, Visitor};
use sha2::{Digest, Sha256};

const OPAQUE_XATTRS: [&str; 2] = ["user.overlay.opaque", "trusted.overlay.opaque"];
const CAPABILITY_XATTR: &str = "security.capability";

/// What was written: the archive's digest (`sha256:<hex>`) and length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Archived {
    pub digest: String,
    pub size: u64,
}

/// Hashes and counts what passes through to `inner`.
struct Hashing<W> {
    inner: W,
    hasher: Sha256,
    size: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.size += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes the layer at `dir` as an archive to `out`.
pub fn write_layer(dir: &Path, out: impl Write) -> io::Result<Archived> {
    write(dir, out, None)
}

/// Writes a sandbox's writable layer at `dir`, whose files belong to the host ids the
/// sandbox maps from `base` on, as an archive of the ids they have inside the sandbox.
/// An entry owned by an id outside that range makes it fail.
pub fn write_sandbox_layer(dir: &Path, out: impl Write, base: u32) -> io::Result<Archived> {
    write(dir, out, Some(base))
}

fn write(dir: &Path, out: impl Write, id_base: Option<u32>) -> io::Result<Archived> {
    let root = Dir::open_host(dir)?;
    let mut builder = tar::Builder::new(Hashing {
        inner: io::BufWriter::with_capacity(1 << 20, out),
        hasher: Sha256::new(),
        size: 0,
    });
    let mut walk = Walk {
        builder: &mut builder,
        links: HashMap::new(),
        id_base,
    };
    sandbar_fs::walk(root, &mut walk)?;
    builder.finish()?;
    let mut hashing = builder.into_inner()?;
    hashing.flush()?;
    Ok(Archived {
        digest: format!("sha256:{}", hex::encode(hashing.hasher.finalize())),
        size: hashing.size,
    })
}

struct Walk<'a, W: Write> {
    builder: &'a mut tar::Builder<W>,
    /// Files with more than one link, by (device, inode): the first path archived.
    links: HashMap<(u64, u64), PathBuf>,
    /// Subtracted from every owner (see [`write_sandbox_layer`]).
    id_base: Option<u32>,
}

/// Host ids one sandbox maps.
const SANDBOX_IDS: u32 = 65_536;

/// A PAX extended header record: `<length> <key>=<value>\n`, the length counting itself.
fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
    let rest = key.len() + value.len() + 3;
    let mut length = rest + rest.to_string().len();
    if length.to_string().len() != rest.to_string().len() {
        length += 1;
    }
    let mut record = format!("{length} {key}=").into_bytes();
    record.extend_from_slice(value);
    record.push(b'\n');
    record
}

/// The value of the extended attribute `name` of the open file `fd`, if it has one.
fn xattr(fd: impl AsFd, name: &str) -> Option<Vec<u8>> {
    let c_name = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0u8; 4096];
    // SAFETY: the descriptor is open for the call, the name is nul-terminated and `buf` is
    // writable for its length.
    let n = unsafe {
        libc::fgetxattr(
            fd.as_fd().as_raw_fd(),
            c_name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    let n = usize::try_from(n).ok()?;
    buf.truncate(n);
    Some(buf)
}

impl<W: Write> Walk<'_, W> {
    fn header_for(&self, meta: &Metadata, kind: tar::EntryType) -> io::Result<tar::Header> {
        let owner = |id: u32| match self.id_base {
            None => Ok(id),
            Some(base) => id
                .checked_sub(base)
                .filter(|inside| *inside < SANDBOX_IDS)
                .ok_or_else(|| {
                    io::Error::other(format!(
                        "an entry is owned by host id {id}, outside the sandbox's range from {base}"
                    ))
                }),
        };
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(meta.mode() & 0o7777);
        header.set_uid(u64::from(owner(meta.uid())?));
        header.set_gid(u64::from(owner(meta.gid())?));
        header.set_mtime(u64::try_from(meta.mtime()).unwrap_or(0));
        header.set_size(0);
        Ok(header)
    }

    /// An empty regular file that only names something (a whiteout or an opaque marker).
    fn marker(&mut self, meta: &Metadata, path: &Path) -> io::Result<()> {
        let mut header = self.header_for(meta, tar::EntryType::Regular)?;
        header.set_mode(0o600);
        self.builder.append_data(&mut header, path, io::empty())
    }

    fn file(&mut self, dir: &Dir, name: &OsStr, meta: &Metadata, path: &Path) -> io::Result<()> {
        if meta.nlink() > 1 {
            let key = (meta.dev(), meta.ino());
            if let Some(first) = self.links.get(&key) {
                let mut header = self.header_for(meta, tar::EntryType::Link)?;
                let first = first.clone();
                return self.builder.append_link(&mut header, path, &first);
            }
            self.links.insert(key, path.to_owned());
        }
        let file: File = dir.open_looked_at(name, meta).map_err(io::Error::other)?;
        if let Some(capability) = xattr(&file, CAPABILITY_XATTR) {
            let record = pax_record(&format!("SCHILY.xattr.{CAPABILITY_XATTR}"), &capability);
            let mut pax = tar::Header::new_ustar();
            pax.set_entry_type(tar::EntryType::XHeader);
            pax.set_path("PaxHeaders/entry")?;
            pax.set_mode(0o644);
            pax.set_size(record.len() as u64);
            pax.set_cksum();
            self.builder.append(&pax, record.as_slice())?;
        }
        let mut header = self.header_for(meta, tar::EntryType::Regular)?;
        header.set_size(meta.len());
        // A file that changed length since the stat would make a corrupt entry; layers are
        // read-only once made, so this only guards against a bug elsewhere.
        let reader = io::Read::take(file, meta.len());
        self.builder.append_data(&mut header, path, reader)
    }

    fn special(&mut self, name: &OsStr, meta: &Metadata, path: &Path) -> io::Result<()> {
        let kind = meta.file_type();
        if kind.is_char_device() && meta.rdev() == 0 {
            let mut whiteout = OsString::from(".wh.");
            whiteout.push(name);
            let parent = path.parent().unwrap_or(Path::new(""));
            return self.marker(meta, &parent.join(whiteout));
        }
        if kind.is_fifo() {
            let mut header = self.header_for(meta, tar::EntryType::Fifo)?;
            return self.builder.append_data(&mut header, path, io::empty());
        }
        // Device nodes and sockets never belong in a layer (unpacking refuses devices).
        tracing::debug!(path = %String::from_utf8_lossy(path.as_os_str().as_bytes()), "left out of the layer archive");
        Ok(())
    }
}

/// Directories are archived as the walk enters them, so each one's entry precedes its
/// contents; the walk keeps a bounded number of them open however deep the layer goes.
impl<W: Write> Visitor for Walk<'_, W> {
    type Error = io::Error;

    fn enter(&mut self, dir: &Dir, path: &Path) -> io::Result<()> {
        let meta = dir.metadata()?;
        let mut header = self.header_for(&meta, tar::EntryType::Directory)?;
        if path.as_os_str().is_empty() {
            // "./" carries the root's owner and mode (the sandbox's `/`); the tar crate's
            // path setter would refuse a name without a normal component.
            header.as_old_mut().name[..2].copy_from_slice(b"./");
            header.set_cksum();
            self.builder.append(&header, io::empty())?;
        } else {
            let mut name = path.as_os_str().to_owned();
            name.push("/");
            self.builder
                .append_data(&mut header, Path::new(&name), io::empty())?;
        }
        if OPAQUE_XATTRS
            .iter()
            .any(|x| xattr(dir, x).is_some_and(|v| v == b"y"))
        {
            self.marker(&meta, &path.join(".wh..wh..opq"))?;
        }
        Ok(())
    }

    fn entry(&mut self, dir: &Dir, entry: &Entry, path: &Path) -> io::Result<bool> {
        let Some(meta) = dir.stat(&entry.name).map_err(io::Error::other)? else {
            return Ok(false);
        };
        match entry.kind {
            Kind::Dir => return Ok(true),
            Kind::File => self.file(dir, &entry.name, &meta, path)?,
            Kind::Symlink => {
                let target = dir.read_link(&entry.name).map_err(io::Error::other)?;
                let mut header = self.header_for(&meta, tar::EntryType::Symlink)?;
                self.builder.append_link(&mut header, path, &target)?;
            }
            Kind::Other => self.special(&entry.name, &meta, path)?,
        }
        Ok(false)
    }
}

#[cfg(test)]
// The fixtures are trees the test itself makes in its own temporary directory.
#[allow(clippy::disallowed_methods, clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_layer_of_many_directories_is_archived_with_few_descriptors() {
        let name = concat!(
            module_path!(),
            "::a_layer_of_many_directories_is_archived_with_few_descriptors"
        );
        crate::few_descriptors::run_on_crowded_tree(name, |root, leaf| {
            let mut archive = Vec::new();
            write_layer(root, &mut archive).unwrap();
            let mut names = Vec::new();
            for entry in tar::Archive::new(archive.as_slice()).entries().unwrap() {
                names.push(entry.unwrap().path().unwrap().into_owned());
            }
            assert!(names.iter().any(|n| n == leaf));
            assert!(names.contains(&PathBuf::from("wide399/inner")));
            // Every directory precedes what it holds.
            let position = |p: &Path| names.iter().position(|n| n == p).unwrap();
            assert!(position(Path::new("deep/d")) < position(leaf));
        });
    }

    #[test]
    fn pax_records_count_their_own_length() {
        assert_eq!(pax_record("a", b"b"), b"6 a=b\n");
        let record = pax_record("key", b"valu");
        assert_eq!(record, b"12 key=valu\n");
        // 99 bytes without the length, whose two digits would make 101, which has three.
        let long = pax_record("k", &[b'v'; 95]);
        assert_eq!(long.len(), 102);
        assert!(long.starts_with(b"102 k="));
    }

    #[test]
    fn a_layer_round_trips_through_an_archive() {
        let tmp = tempfile::tempdir().expect("tmp");
        let layer = tmp.path().join("layer");
        std::fs::create_dir_all(layer.join("etc/app")).expect("dirs");
        std::fs::write(layer.join("etc/app/config"), b"setting=1\n").expect("file");
        std::fs::set_permissions(
            layer.join("etc/app/config"),
            std::fs::Permissions::from_mode(0o640),
        )
        .expect("chmod");
        std::fs::hard_link(layer.join("etc/app/config"), layer.join("etc/twin")).expect("link");
        std::os::unix::fs::symlink("../../outside", layer.join("etc/app/escape")).expect("symlink");
        std::fs::set_permissions(&layer, std::fs::Permissions::from_mode(0o751)).expect("root");
        let long = "d".repeat(120);
        std::fs::create_dir(layer.join(&long)).expect("long dir");
        std::fs::write(layer.join(&long).join("inside"), b"deep").expect("deep");

        let archive = tmp.path().join("layer.tar");
        let archived =
            write_layer(&layer, File::create(&archive).expect("create")).expect("archive");
        let bytes = std::fs::read(&archive).expect("read");
        assert_eq!(archived.size, bytes.len() as u64);
        assert_eq!(
            archived.digest,
            format!("sha256:{}", hex::encode(Sha256::digest(&bytes)))
        );
        // The same tree gives the same archive, so a layer published twice is one blob.
        let again = write_layer(&layer, io::sink()).expect("again");
        assert_eq!(again, archived);

        let unpacked = tmp.path().join("unpacked");
        std::fs::create_dir(&unpacked).expect("dest");
        sandbar_image::apply_layer(bytes.as_slice(), &unpacked).expect("apply");
        assert_eq!(
            std::fs::read(unpacked.join("etc/app/config")).expect("config"),
            b"setting=1\n"
        );
        let meta = std::fs::metadata(unpacked.join("etc/app/config")).expect("meta");
        assert_eq!(meta.mode() & 0o7777, 0o640);
        let twin = std::fs::metadata(unpacked.join("etc/twin")).expect("twin");
        assert_eq!(twin.ino(), meta.ino(), "hard links stay one file");
        assert_eq!(
            std::fs::read_link(unpacked.join("etc/app/escape")).expect("link"),
            Path::new("../../outside")
        );
        assert_eq!(
            std::fs::read(unpacked.join(&long).join("inside")).expect("deep"),
            b"deep"
        );
        let root = std::fs::metadata(&unpacked).expect("root");
        assert_eq!(root.mode() & 0o7777, 0o751, "the root keeps its mode");
    }

    /// Whiteouts are character devices, which only root may make; skipped otherwise.
    #[test]
    fn whiteouts_and_opaque_directories_travel_as_names() {
        let tmp = tempfile::tempdir().expect("tmp");
        let layer = tmp.path().join("layer");
        std::fs::create_dir_all(layer.join("opt/data")).expect("dirs");
        let whiteout =
            std::ffi::CString::new(layer.join("opt/gone").as_os_str().as_bytes().to_vec())
                .expect("path");
        // SAFETY: a nul-terminated path; mknod reads nothing else.
        let made = unsafe { libc::mknod(whiteout.as_ptr(), libc::S_IFCHR | 0o600, 0) };
        if made != 0 {
            eprintln!("skipping: cannot make a whiteout here (not root)");
            return;
        }
        let data = std::ffi::CString::new(layer.join("opt/data").as_os_str().as_bytes().to_vec())
            .expect("path");
        // SAFETY: nul-terminated path, name and a one-byte value that outlive the call.
        let set = unsafe {
            libc::setxattr(
                data.as_ptr(),
                c"user.overlay.opaque".as_ptr(),
                b"y".as_ptr().cast(),
                1,
                0,
            )
        };
        assert_eq!(set, 0, "set the opaque marker");

        let mut bytes = Vec::new();
        write_layer(&layer, &mut bytes).expect("archive");
        let names: Vec<String> = tar::Archive::new(bytes.as_slice())
            .entries()
            .expect("entries")
            .map(|e| {
                e.expect("entry")
                    .path()
                    .expect("path")
                    .display()
                    .to_string()
            })
            .collect();
        assert!(names.contains(&"opt/.wh.gone".to_owned()), "{names:?}");
        assert!(
            names.contains(&"opt/data/.wh..wh..opq".to_owned()),
            "{names:?}"
        );

        let unpacked = tmp.path().join("unpacked");
        std::fs::create_dir(&unpacked).expect("dest");
        sandbar_image::apply_layer(bytes.as_slice(), &unpacked).expect("apply");
        let gone = std::fs::symlink_metadata(unpacked.join("opt/gone")).expect("whiteout");
        assert!(gone.file_type().is_char_device() && gone.rdev() == 0);
        let mut value = [0u8; 1];
        let n = rustix::fs::getxattr(unpacked.join("opt/data"), "user.overlay.opaque", &mut value)
            .expect("opaque");
        assert_eq!(&value[..n], b"y");
    }
}
