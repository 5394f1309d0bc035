//! Template layers on this node: where each named layer lives, reading files through a stack
//! of layers as an overlay would show them, and turning a build sandbox's writable layer
//! into a shared read-only one.
//!
//! Layer names are what the store keeps (`base/v1`, `image/<sha256>`, `layer/<key>`); only
//! this module turns them into paths, so no host path reaches the domain model.

use std::ffi::OsStr;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// Where the node keeps layers.
#[derive(Debug, Clone)]
pub struct LayerStore {
    /// Built-in roots made by the node (`base/v1` → `<templates>/base-v1/rootfs`).
    templates_dir: PathBuf,
    /// Layers unpacked from registry images, by the uncompressed tar's sha256.
    images_dir: PathBuf,
    /// Layers made by build steps, by cache key; on the sandbox disk pool so a build
    /// sandbox's writable layer becomes one by a rename.
    steps_dir: PathBuf,
}

fn is_hex(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.bytes().all(|c| c.is_ascii_hexdigit())
}

impl LayerStore {
    pub fn new(templates_dir: PathBuf, images_dir: PathBuf, steps_dir: PathBuf) -> Self {
        Self {
            templates_dir,
            images_dir,
            steps_dir,
        }
    }

    pub fn steps_dir(&self) -> &Path {
        &self.steps_dir
    }

    /// The directory of the layer named `name`, if the name is well formed.
    pub fn path(&self, name: &str) -> Option<PathBuf> {
        let (kind, id) = name.split_once('/')?;
        match kind {
            "base" if id.starts_with('v') && id[1..].bytes().all(|c| c.is_ascii_digit()) => {
                Some(self.templates_dir.join(format!("base-{id}")).join("rootfs"))
            }
            "image" if is_hex(id) => Some(self.images_dir.join(id)),
            "layer" if is_hex(id) => {
                Some(self.steps_dir.join(id).join(sandbar_jail::layout::UPPER))
            }
            _ => None,
        }
    }

    /// Whether the layer exists on this node.
    pub fn exists(&self, name: &str) -> bool {
        self.path(name).is_some_and(|p| p.is_dir())
    }

    pub fn step_layer_name(key: &str) -> String {
        format!("layer/{key}")
    }

    /// Paths of `layers` (bottom first) for an overlay, topmost first.
    pub fn stack(&self, layers: &[String]) -> Result<Vec<PathBuf>, String> {
        layers
            .iter()
            .rev()
            .map(|name| {
                self.path(name)
                    .filter(|p| p.is_dir())
                    .ok_or_else(|| format!("layer {name} is missing on this node"))
            })
            .collect()
    }
}

/// What a path is in a stack of layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Missing,
    File(PathBuf),
    Dir,
    Symlink(PathBuf),
}

fn is_whiteout(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    meta.file_type().is_char_device() && meta.rdev() == 0
}

fn is_opaque(dir: &Path) -> bool {
    ["user.overlay.opaque", "trusted.overlay.opaque"]
        .iter()
        .any(|name| matches!(xattr_get(dir, name), Some(v) if v == b"y"))
}

fn xattr_get(path: &Path, name: &str) -> Option<Vec<u8>> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    let c_name = std::ffi::CString::new(name).ok()?;
    let mut buf = [0u8; 64];
    // SAFETY: both strings are nul-terminated and `buf` is writable for its length.
    let n = unsafe {
        libc::lgetxattr(
            c_path.as_ptr(),
            c_name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    (n >= 0).then(|| buf[..n as usize].to_vec())
}

/// Looks `relative` (no `..`, no leading `/`) up through `stack` (topmost first), without
/// following a final symlink, as an overlay mount would show it. Intermediate components are
/// taken literally: callers resolve symlinks with [`resolve`].
pub fn lookup(stack: &[PathBuf], relative: &Path) -> Found {
    for layer in stack {
        // A whiteout or an opaque directory on the way hides every layer below.
        let mut hidden = false;
        let mut prefix = layer.clone();
        let components: Vec<_> = relative.components().collect();
        for (i, component) in components.iter().enumerate() {
            prefix.push(component);
            let Ok(meta) = std::fs::symlink_metadata(&prefix) else {
                break;
            };
            if is_whiteout(&meta) {
                return Found::Missing;
            }
            if i + 1 == components.len() {
                if meta.file_type().is_symlink() {
                    return Found::Symlink(std::fs::read_link(&prefix).unwrap_or_default());
                }
                if meta.is_dir() {
                    return Found::Dir;
                }
                return Found::File(prefix);
            }
            if meta.is_dir() && is_opaque(&prefix) {
                hidden = true;
            }
        }
        if hidden {
            // The path's parent is opaque in this layer and the entry is not in it.
            return Found::Missing;
        }
        if components.is_empty() {
            return Found::Dir;
        }
    }
    Found::Missing
}

/// Resolves `path` (absolute, inside the image) through `stack`, following symlinks in
/// every component as the sandbox would, but never leaving the image's root.
pub fn resolve(stack: &[PathBuf], path: &str) -> Result<PathBuf, String> {
    let mut resolved = PathBuf::new();
    let mut pending: Vec<std::ffi::OsString> = Path::new(path)
        .components()
        .rev()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_owned()),
            Component::ParentDir => Some(OsStr::new("..").to_owned()),
            _ => None,
        })
        .collect();
    let mut links = 0;
    while let Some(part) = pending.pop() {
        if part == ".." {
            resolved.pop();
            continue;
        }
        let candidate = resolved.join(&part);
        match lookup(stack, &candidate) {
            Found::Symlink(target) => {
                links += 1;
                if links > 40 {
                    return Err(format!("too many symbolic links resolving {path}"));
                }
                if target.is_absolute() {
                    resolved = PathBuf::new();
                }
                for c in target.components().rev() {
                    match c {
                        Component::Normal(n) => pending.push(n.to_owned()),
                        Component::ParentDir => pending.push(OsStr::new("..").to_owned()),
                        _ => {}
                    }
                }
            }
            _ => resolved = candidate,
        }
    }
    Ok(resolved)
}

/// Reads a regular file through the stack (e.g. `/etc/passwd`).
pub fn read_file(stack: &[PathBuf], path: &str) -> Option<String> {
    let relative = resolve(stack, path).ok()?;
    match lookup(stack, &relative) {
        Found::File(p) => std::fs::read_to_string(p).ok(),
        _ => None,
    }
}

/// Turns a sandbox's directory (a stopped build sandbox's, or the copy a snapshot made)
/// into a layer: the overlay's scratch directories go, and the writable layer's owners are
/// shifted from the sandbox's host ids (from `base`) into the range every sandbox maps.
pub fn seal_layer(dir: &Path, base: u32, size: u32) -> std::io::Result<()> {
    for scratch in [
        sandbar_jail::layout::WORK,
        sandbar_jail::layout::LOWER,
        sandbar_jail::layout::ROOT,
    ] {
        crate::disks::remove_tree(&dir.join(scratch))?;
    }
    shift_owners(&dir.join(sandbar_jail::layout::UPPER), base, size)?;
    std::os::unix::fs::lchown(dir, Some(0), Some(0))
}

/// Gives every entry of a build sandbox's writable layer the owner it has inside the
/// sandbox (host id minus the sandbox's base), so the layer means the same to every
/// sandbox that id-maps it. Entries outside the sandbox's range are refused.
pub fn shift_owners(root: &Path, base: u32, size: u32) -> std::io::Result<()> {
    move_owners(root, base, 0, size)
}

/// Moves every entry under `root` owned by host ids `from..from + size` to the same offset
/// in `to..to + size`, keeping setuid and setgid bits; an entry outside the range is refused.
pub fn move_owners(root: &Path, from: u32, to: u32, size: u32) -> std::io::Result<()> {
    let shift = |id: u32, path: &Path| {
        id.checked_sub(from)
            .filter(|i| *i < size)
            .map(|i| i + to)
            .ok_or_else(|| {
                std::io::Error::other(format!(
                    "{} is owned by host id {id}, outside the sandbox's range",
                    path.display()
                ))
            })
    };
    let mut pending = vec![root.to_owned()];
    while let Some(path) = pending.pop() {
        let meta = std::fs::symlink_metadata(&path)?;
        let uid = shift(meta.uid(), &path)?;
        let gid = shift(meta.gid(), &path)?;
        std::os::unix::fs::lchown(&path, Some(uid), Some(gid))?;
        if !meta.file_type().is_symlink() && meta.mode() & 0o6000 != 0 {
            // A change of owner clears setuid and setgid; the layer keeps what the step made.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(meta.mode() & 0o7777))?;
        }
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                pending.push(entry?.path());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn mkdirs(root: &Path, dirs: &[&str]) {
        for d in dirs {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
    }

    #[test]
    fn names_map_to_paths_and_bad_names_to_none() {
        let store = LayerStore::new("/t".into(), "/i".into(), "/s".into());
        assert_eq!(
            store.path("base/v1"),
            Some(PathBuf::from("/t/base-v1/rootfs"))
        );
        assert_eq!(store.path("image/abc123"), Some(PathBuf::from("/i/abc123")));
        assert_eq!(store.path("layer/ff"), Some(PathBuf::from("/s/ff/upper")));
        assert_eq!(store.path("layer/../etc"), None);
        assert_eq!(store.path("image/"), None);
        assert_eq!(store.path("other/x"), None);
        assert_eq!(store.path("base/../x"), None);
    }

    #[test]
    fn lookups_see_the_top_layer_first_and_follow_links_inside_the_image() {
        let tmp = tempfile::tempdir().unwrap();
        let lower = tmp.path().join("lower");
        let upper = tmp.path().join("upper");
        mkdirs(&lower, &["usr/bin", "etc"]);
        mkdirs(&upper, &["etc"]);
        std::fs::write(lower.join("etc/passwd"), "root:x:0:0::/root:/bin/sh\n").unwrap();
        std::fs::write(upper.join("etc/passwd"), "root:x:0:0::/root:/bin/bash\n").unwrap();
        std::os::unix::fs::symlink("usr/bin", lower.join("bin")).unwrap();
        std::os::unix::fs::symlink("/../../../etc", lower.join("escape")).unwrap();
        let stack = vec![upper.clone(), lower.clone()];
        assert_eq!(
            read_file(&stack, "/etc/passwd").as_deref(),
            Some("root:x:0:0::/root:/bin/bash\n")
        );
        assert_eq!(
            resolve(&stack, "/bin/tool").unwrap(),
            PathBuf::from("usr/bin/tool")
        );
        // A link climbing above the root stays at the root, as inside the sandbox.
        assert_eq!(
            resolve(&stack, "/escape/passwd").unwrap(),
            PathBuf::from("etc/passwd")
        );
    }

    #[test]
    fn whiteouts_and_opaque_directories_hide_lower_entries() {
        let tmp = tempfile::tempdir().unwrap();
        let lower = tmp.path().join("lower");
        let upper = tmp.path().join("upper");
        mkdirs(&lower, &["etc", "opt/data"]);
        mkdirs(&upper, &["etc", "opt/data"]);
        std::fs::write(lower.join("etc/motd"), "hi").unwrap();
        std::fs::write(lower.join("opt/data/old.txt"), "old").unwrap();
        let whiteout =
            std::ffi::CString::new(upper.join("etc/motd").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid path; a 0:0 character device is overlayfs's whiteout.
        let made = unsafe { libc::mknod(whiteout.as_ptr(), libc::S_IFCHR | 0o600, 0) };
        assert_eq!(made, 0);
        let dir =
            std::ffi::CString::new(upper.join("opt/data").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid nul-terminated strings and a one-byte value.
        let set = unsafe {
            libc::setxattr(
                dir.as_ptr(),
                c"user.overlay.opaque".as_ptr(),
                b"y".as_ptr().cast(),
                1,
                0,
            )
        };
        assert_eq!(set, 0);
        let stack = vec![upper, lower];
        assert_eq!(lookup(&stack, Path::new("etc/motd")), Found::Missing);
        assert_eq!(
            lookup(&stack, Path::new("opt/data/old.txt")),
            Found::Missing
        );
        assert_eq!(lookup(&stack, Path::new("opt/data")), Found::Dir);
    }

    #[test]
    fn owners_shift_back_into_the_sandbox_range_keeping_setuid() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("upper");
        mkdirs(&root, &["a/b"]);
        let file = root.join("a/b/tool");
        std::fs::write(&file, "x").unwrap();
        let base = 1 << 30;
        for p in [&root, &root.join("a"), &root.join("a/b"), &file] {
            std::os::unix::fs::lchown(p, Some(base + 1000), Some(base + 1000)).unwrap();
        }
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o4755)).unwrap();
        shift_owners(&root, base, 65536).unwrap();
        let meta = std::fs::metadata(&file).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (1000, 1000));
        assert_eq!(meta.mode() & 0o7777, 0o4755);
        // Something owned outside the range is refused rather than mapped.
        std::os::unix::fs::lchown(&file, Some(5), Some(5)).unwrap();
        assert!(shift_owners(&root, base, 65536).is_err());
    }
}
