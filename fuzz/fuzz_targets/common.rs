//! Trees made from fuzz input, and the sentinel that nothing may touch.

use std::collections::BTreeMap;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use arbitrary::Arbitrary;

/// One tar entry, with the hostile shapes weighted in: `..`, absolute names and links.
#[derive(Debug, Arbitrary)]
pub enum Entry {
    Dir(Name),
    File(Name, Vec<u8>, u16),
    Symlink(Name, Target),
    HardLink(Name, Name),
}

#[derive(Debug, Arbitrary)]
pub struct Name(pub Vec<Part>);

#[derive(Debug, Arbitrary, Clone, Copy)]
pub enum Part {
    A,
    B,
    L,
    Up,
    Dot,
    Root,
}

#[derive(Debug, Arbitrary)]
pub enum Target {
    Inside(Name),
    Sentinel,
    SentinelFile,
    HostRoot,
}

impl Name {
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (i, part) in self.0.iter().take(6).enumerate() {
            if i > 0 && !matches!(part, Part::Root) {
                out.push('/');
            }
            out.push_str(match part {
                Part::A => "a",
                Part::B => "b",
                Part::L => "l",
                Part::Up => "..",
                Part::Dot => ".",
                Part::Root => "/",
            });
        }
        if out.is_empty() { "a".into() } else { out }
    }
}

/// Writes `entries` as a tar with raw headers, so names keep their `..` and leading `/`.
pub fn tar_of(entries: &[Entry], sentinel: &Path) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries.iter().take(32) {
        let mut header = tar::Header::new_old();
        let name = match entry {
            Entry::Dir(n) | Entry::File(n, ..) | Entry::Symlink(n, _) | Entry::HardLink(n, _) => {
                n.render()
            }
        };
        let bytes = name.as_bytes();
        if bytes.len() >= 100 {
            continue;
        }
        header.as_old_mut().name[..bytes.len()].copy_from_slice(bytes);
        header.set_mode(0o755);
        let mut data: &[u8] = &[];
        match entry {
            Entry::Dir(_) => header.set_entry_type(tar::EntryType::Directory),
            Entry::File(_, content, mode) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(u32::from(*mode) & 0o7777);
                data = content;
            }
            Entry::Symlink(_, target) => {
                header.set_entry_type(tar::EntryType::Symlink);
                let t: PathBuf = match target {
                    Target::Inside(n) => n.render().into(),
                    Target::Sentinel => sentinel.to_owned(),
                    Target::SentinelFile => sentinel.join("secret"),
                    Target::HostRoot => "/".into(),
                };
                let _ = header.set_link_name(&t);
            }
            Entry::HardLink(_, target) => {
                header.set_entry_type(tar::EntryType::Link);
                let _ = header.set_link_name(target.render());
            }
        }
        header.set_size(data.len() as u64);
        header.set_cksum();
        let _ = builder.append(&header, data);
    }
    builder.into_inner().unwrap_or_default()
}

pub const MARKER: &[u8] = b"sentinel-7f3a";

/// A scratch directory with a sentinel tree beside the working trees.
pub struct Scratch {
    pub tmp: tempfile::TempDir,
    pub sentinel: PathBuf,
}

impl Scratch {
    pub fn new() -> Scratch {
        let tmp = tempfile::tempdir().expect("a scratch directory");
        let sentinel = tmp.path().join("sentinel");
        std::fs::create_dir_all(sentinel.join("sub")).expect("the sentinel");
        std::fs::write(sentinel.join("secret"), MARKER).expect("the sentinel");
        std::fs::write(sentinel.join("sub/file"), MARKER).expect("the sentinel");
        Scratch { tmp, sentinel }
    }

    pub fn dir(&self, name: &str) -> PathBuf {
        let dir = self.tmp.path().join(name);
        std::fs::create_dir(&dir).expect("a working directory");
        dir
    }
}

/// Kind, mode, owner and content of every entry below `dir`.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (u32, u32, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(path) = pending.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let content = if meta.file_type().is_symlink() {
            std::fs::read_link(&path)
                .map(|t| t.as_os_str().as_bytes().to_vec())
                .unwrap_or_default()
        } else if meta.is_file() {
            std::fs::read(&path).unwrap_or_default()
        } else {
            Vec::new()
        };
        out.insert(path.clone(), (meta.mode(), meta.uid(), content));
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path).into_iter().flatten().flatten() {
                pending.push(entry.path());
            }
        }
    }
    out
}

/// Fails when a file below `dir` holds the sentinel's content.
pub fn assert_no_sentinel_content(dir: &Path) {
    for (path, (_, _, content)) in snapshot(dir) {
        assert!(
            !content.windows(MARKER.len()).any(|w| w == MARKER),
            "{} holds the sentinel's content",
            path.display()
        );
    }
}
