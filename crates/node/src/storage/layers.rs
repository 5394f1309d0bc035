//! Template layers on this node: where each named layer lives, reading files through a stack
//! of layers as an overlay would show them, and turning a build sandbox's writable layer
//! into a shared read-only one.
//!
//! Layer names are what the store keeps (`base/v1`, `image/<sha256>`, `layer/<key>`); only
//! this module turns them into paths, so no host path reaches the domain model.

#![deny(clippy::disallowed_methods)]

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use sandbar_fs::{Dir, Kind, Links, Tree};

/// The kinds of layer that are built-in roots the node builds itself, each in
/// `<templates>/<kind>-v<version>/rootfs` (see `crate::build::templates::RootRecipe`).
pub const BUILT_IN_ROOTS: [&str; 3] = ["base", "interpreter", "desktop"];

/// Where the node keeps layers.
#[derive(Debug, Clone)]
pub struct LayerStore {
    /// Built-in roots made by the node (`base/v1` → `<templates>/base-v1/rootfs`).
    templates_dir: PathBuf,
    /// Layers unpacked from registry images, by the uncompressed tar's sha256.
    images_dir: PathBuf,
    /// Where image layers were unpacked before they moved to the pool; a layer only there
    /// is still found.
    legacy_images_dir: Option<PathBuf>,
    /// Layers made by build steps, by cache key; on the sandbox disk pool so a build
    /// sandbox's writable layer becomes one by a rename.
    steps_dir: PathBuf,
    /// Checkpoints of snapshots' and captures' processes (`checkpoint/<key>`), which a
    /// template names beside its layers and nodes share the same way.
    checkpoints_dir: Option<PathBuf>,
}

fn is_hex(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.bytes().all(|c| c.is_ascii_hexdigit())
}

impl LayerStore {
    pub fn new(templates_dir: PathBuf, images_dir: PathBuf, steps_dir: PathBuf) -> Self {
        Self {
            templates_dir,
            images_dir,
            legacy_images_dir: None,
            steps_dir,
            checkpoints_dir: None,
        }
    }

    /// Also knows the checkpoints in `dir` by name.
    pub fn with_checkpoints_dir(mut self, dir: PathBuf) -> Self {
        self.checkpoints_dir = Some(dir);
        self
    }

    /// Also finds image layers in `dir`, where an earlier version unpacked them.
    pub fn with_legacy_images_dir(mut self, dir: PathBuf) -> Self {
        self.legacy_images_dir = Some(dir);
        self
    }

    /// Every directory layers (and checkpoints) are kept in.
    pub fn dirs(&self) -> Vec<&Path> {
        [&self.templates_dir, &self.images_dir, &self.steps_dir]
            .into_iter()
            .map(PathBuf::as_path)
            .chain(self.checkpoints_dir.as_deref())
            .collect()
    }

    pub fn steps_dir(&self) -> &Path {
        &self.steps_dir
    }

    pub fn images_dir(&self) -> &Path {
        &self.images_dir
    }

    fn image_path(&self, id: &str) -> PathBuf {
        let current = self.images_dir.join(id);
        match &self.legacy_images_dir {
            Some(legacy)
                if !sandbar_fs::host_is_dir(&current)
                    && sandbar_fs::host_is_dir(&legacy.join(id)) =>
            {
                legacy.join(id)
            }
            _ => current,
        }
    }

    /// The directory of the layer named `name`, if the name is well formed.
    pub fn path(&self, name: &str) -> Option<PathBuf> {
        let (kind, id) = name.split_once('/')?;
        match kind {
            kind if BUILT_IN_ROOTS.contains(&kind)
                && id.starts_with('v')
                && id[1..].bytes().all(|c| c.is_ascii_digit()) =>
            {
                Some(
                    self.templates_dir
                        .join(format!("{kind}-{id}"))
                        .join("rootfs"),
                )
            }
            "image" if is_hex(id) => Some(self.image_path(id)),
            "layer" if is_hex(id) => {
                Some(self.steps_dir.join(id).join(sandbar_jail::layout::UPPER))
            }
            "checkpoint" if id.len() == 32 && is_hex(id) => {
                Some(self.checkpoints_dir.as_ref()?.join(id))
            }
            _ => None,
        }
    }

    /// Whether the layer exists on this node; a checkpoint, once it is sealed.
    pub fn exists(&self, name: &str) -> bool {
        let Some(path) = self.path(name) else {
            return false;
        };
        if name.starts_with("checkpoint/") {
            return sandbar_fs::host_is_file(&path.join(crate::checkpoint::HEADER_FILE));
        }
        sandbar_fs::host_is_dir(&path)
    }

    pub fn step_layer_name(key: &str) -> String {
        format!("layer/{key}")
    }

    /// Paths of `layers` (bottom first) for an overlay, topmost first.
    pub fn stack(&self, layers: &[String]) -> Result<Vec<PathBuf>, StackError> {
        layers
            .iter()
            .rev()
            .map(|name| {
                self.path(name)
                    .filter(|p| sandbar_fs::host_is_dir(p))
                    .ok_or_else(|| StackError::Missing { name: name.clone() })
            })
            .collect()
    }

    /// The layers `layers` (bottom first) opened for reading, topmost first.
    pub fn trees(&self, layers: &[String]) -> Result<Stack, StackError> {
        let paths = self.stack(layers)?;
        Stack::open(&paths).map_err(|source| StackError::Open {
            top: paths.first().cloned().unwrap_or_default(),
            source,
        })
    }
}

/// Why the layers of an image cannot be stacked on this node.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("layer {name} is missing on this node")]
    Missing { name: String },
    /// `top` is the topmost layer's directory.
    #[error("cannot open the layers: {source}")]
    Open {
        top: PathBuf,
        source: std::io::Error,
    },
}

/// Why a path inside an image cannot be resolved through its layers.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("too many symbolic links resolving {path}")]
    TooManyLinks { path: String },
}

/// The layers of a stack opened for reading, topmost first. Each is a tree a tenant may
/// have filled (an image layer, a build step's writable layer), so links in them are data:
/// no path is ever resolved through one on the host.
#[derive(Debug)]
pub struct Stack {
    layers: Vec<Tree>,
}

impl Stack {
    /// Opens the layer directories `paths` (topmost first).
    pub fn open(paths: &[PathBuf]) -> std::io::Result<Stack> {
        let layers = paths
            .iter()
            .map(|p| Tree::open(p, Links::Refused))
            .collect::<std::io::Result<_>>()?;
        Ok(Stack { layers })
    }

    /// The same stack with `top` above it (a layer being written, seen as the merge would).
    pub fn with_top(&self, top: &Tree) -> std::io::Result<Stack> {
        let mut layers = vec![top.with_links(Links::Refused)?];
        for layer in &self.layers {
            layers.push(layer.with_links(Links::Refused)?);
        }
        Ok(Stack { layers })
    }

    pub fn layer(&self, index: usize) -> Option<&Tree> {
        self.layers.get(index)
    }
}

/// What a path is in a stack of layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Missing,
    /// A non-directory, in the layer of that index.
    File(usize),
    /// A directory; the index is the topmost layer holding it.
    Dir(usize),
    Symlink(PathBuf),
}

fn is_opaque(layer: &Tree, dir: &Path) -> bool {
    let Ok(dir) = layer.dir(dir) else {
        return false;
    };
    ["user.overlay.opaque", "trusted.overlay.opaque"]
        .iter()
        .any(|name| matches!(xattr_get(&dir, name), Some(v) if v == b"y"))
}

fn xattr_get(dir: &Dir, name: &str) -> Option<Vec<u8>> {
    use std::os::fd::AsRawFd;
    let c_name = std::ffi::CString::new(name).ok()?;
    let mut buf = [0u8; 64];
    // SAFETY: the descriptor is open for the call, the name is nul-terminated and `buf` is
    // writable for its length.
    let n = unsafe {
        libc::fgetxattr(
            dir.as_fd().as_raw_fd(),
            c_name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    usize::try_from(n).ok().map(|n| buf[..n].to_vec())
}

/// Looks `relative` up through `stack` as an overlay mount would show it, without following
/// a final link. Each layer is read on its own with links refused; a link or file on the way
/// in a layer ends the path there (in the merge it is not a directory), so nothing a layer
/// holds can send the lookup elsewhere. Callers follow links with [`resolve`].
pub fn lookup(stack: &Stack, relative: &Path) -> Found {
    let components: Vec<_> = relative
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .collect();
    if components.is_empty() {
        return Found::Dir(0);
    }
    for (index, layer) in stack.layers.iter().enumerate() {
        // A whiteout or an opaque directory on the way hides every layer below.
        let mut hidden = false;
        let mut prefix = PathBuf::new();
        for (i, component) in components.iter().enumerate() {
            prefix.push(component);
            let Ok(Some(meta)) = layer.symlink_metadata(&prefix) else {
                break;
            };
            if sandbar_fs::is_whiteout(&meta) {
                return Found::Missing;
            }
            if i + 1 == components.len() {
                return match Kind::of(&meta) {
                    Kind::Symlink => Found::Symlink(layer.read_link(&prefix).unwrap_or_default()),
                    Kind::Dir => Found::Dir(index),
                    Kind::File | Kind::Other => Found::File(index),
                };
            }
            if !meta.is_dir() {
                return Found::Missing;
            }
            if is_opaque(layer, &prefix) {
                hidden = true;
            }
        }
        if hidden {
            // The path's parent is opaque in this layer and the entry is not in it.
            return Found::Missing;
        }
    }
    Found::Missing
}

/// Resolves `path` (absolute, inside the image) through `stack`, following links in every
/// component as the sandbox would, but never leaving the image's root: the result is a
/// path below the root with no link in it (its last components may not exist yet).
pub fn resolve(stack: &Stack, path: &str) -> Result<PathBuf, ResolveError> {
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
                    return Err(ResolveError::TooManyLinks {
                        path: path.to_owned(),
                    });
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
pub fn read_file(stack: &Stack, path: &str) -> Option<String> {
    let relative = resolve(stack, path).ok()?;
    match lookup(stack, &relative) {
        Found::File(index) => stack.layers[index].read_to_string(&relative).ok(),
        _ => None,
    }
}

/// The owner and mode of the directory `relative` as the merge shows it, if it is one.
pub fn dir_owner_mode(stack: &Stack, relative: &Path) -> Option<(u32, u32, u32)> {
    match lookup(stack, relative) {
        Found::Dir(index) => {
            let meta = stack.layers[index].symlink_metadata(relative).ok()??;
            Some((meta.uid(), meta.gid(), meta.mode() & 0o7777))
        }
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
        crate::storage::disks::remove_tree(&dir.join(scratch))?;
    }
    shift_owners(&dir.join(sandbar_jail::layout::UPPER), base, size)?;
    Dir::open_host(dir)?.chown_self(0, 0)
}

/// Gives every entry of a build sandbox's writable layer the owner it has inside the
/// sandbox (host id minus the sandbox's base), so the layer means the same to every
/// sandbox that id-maps it. Entries outside the sandbox's range are refused.
pub fn shift_owners(root: &Path, base: u32, size: u32) -> std::io::Result<()> {
    move_owners(root, base, 0, size)
}

/// Moves every entry under `root` owned by host ids `from..from + size` to the same offset
/// in `to..to + size`, keeping setuid and setgid bits; an entry outside the range is refused.
/// The tree was written by a sandbox, so it is walked through directory handles, never
/// following a link.
pub fn move_owners(root: &Path, from: u32, to: u32, size: u32) -> std::io::Result<()> {
    sandbar_fs::walk(
        Dir::open_host(root)?,
        &mut OwnerMove {
            root,
            from,
            to,
            size,
        },
    )
}

/// [`move_owners`] as a walk: the top gets its owner when entered, every entry below from
/// its parent, by name.
struct OwnerMove<'a> {
    root: &'a Path,
    from: u32,
    to: u32,
    size: u32,
}

impl OwnerMove<'_> {
    fn shift(&self, id: u32, path: &Path) -> std::io::Result<u32> {
        id.checked_sub(self.from)
            .filter(|i| *i < self.size)
            .map(|i| i + self.to)
            .ok_or_else(|| {
                std::io::Error::other(format!(
                    "{} is owned by host id {id}, outside the sandbox's range",
                    self.root.join(path).display()
                ))
            })
    }
}

impl sandbar_fs::Visitor for OwnerMove<'_> {
    type Error = std::io::Error;

    fn enter(&mut self, dir: &Dir, path: &Path) -> std::io::Result<()> {
        if !path.as_os_str().is_empty() {
            return Ok(());
        }
        let meta = dir.metadata()?;
        dir.chown_self(self.shift(meta.uid(), path)?, self.shift(meta.gid(), path)?)?;
        if meta.mode() & 0o6000 != 0 {
            dir.chmod_self(meta.mode())?;
        }
        Ok(())
    }

    fn entry(
        &mut self,
        dir: &Dir,
        entry: &sandbar_fs::Entry,
        path: &Path,
    ) -> std::io::Result<bool> {
        let Some(meta) = dir.stat(&entry.name)? else {
            return Ok(false);
        };
        dir.chown(
            &entry.name,
            self.shift(meta.uid(), path)?,
            self.shift(meta.gid(), path)?,
        )?;
        if !meta.file_type().is_symlink() && meta.mode() & 0o6000 != 0 {
            // A change of owner clears setuid and setgid; the layer keeps what the step made.
            dir.chmod(&entry.name, meta.mode())?;
        }
        Ok(meta.is_dir())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mkdirs(root: &Path, dirs: &[&str]) {
        for d in dirs {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
    }

    /// A lower and an upper layer in `root`, with these directories in each.
    fn two_layers(root: &Path, lower_dirs: &[&str], upper_dirs: &[&str]) -> (PathBuf, PathBuf) {
        let (lower, upper) = (root.join("lower"), root.join("upper"));
        mkdirs(&lower, lower_dirs);
        mkdirs(&upper, upper_dirs);
        (lower, upper)
    }

    #[test]
    fn owners_move_with_few_descriptors_however_many_directories() {
        let name = concat!(
            module_path!(),
            "::owners_move_with_few_descriptors_however_many_directories"
        );
        crate::few_descriptors::run_on_crowded_tree(name, |root, leaf| {
            // SAFETY: getuid and getgid cannot fail.
            let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
            if uid == 0 {
                move_owners(root, 0, 100_000, 65_536).unwrap();
                for moved in [root.join(leaf), root.join("wide399/inner")] {
                    let meta = std::fs::symlink_metadata(&moved).unwrap();
                    assert_eq!((meta.uid(), meta.gid()), (100_000, 100_000), "{moved:?}");
                }
            } else {
                // Without the right to give files away, ids move onto themselves.
                let from = uid.min(gid);
                move_owners(root, from, from, uid.max(gid) - from + 1).unwrap();
            }
        });
    }

    #[test]
    fn image_layers_left_where_an_earlier_version_put_them_are_found() {
        let tmp = tempfile::tempdir().unwrap();
        let (pool, legacy) = (tmp.path().join("pool"), tmp.path().join("legacy"));
        std::fs::create_dir_all(legacy.join("aa")).unwrap();
        std::fs::create_dir_all(pool.join("bb")).unwrap();
        std::fs::create_dir_all(legacy.join("bb")).unwrap();
        let store = LayerStore::new("/t".into(), pool.clone(), "/s".into())
            .with_legacy_images_dir(legacy.clone());
        assert_eq!(store.path("image/aa"), Some(legacy.join("aa")));
        assert_eq!(store.path("image/bb"), Some(pool.join("bb")));
        assert_eq!(store.path("image/cc"), Some(pool.join("cc")));
    }

    #[test]
    fn a_checkpoint_is_named_like_a_layer_and_exists_once_sealed() {
        let tmp = tempfile::tempdir().unwrap();
        let key = "0123456789abcdef0123456789abcdef";
        let name = format!("checkpoint/{key}");
        let without = LayerStore::new("/t".into(), "/i".into(), "/s".into());
        assert_eq!(
            without.path(&name),
            None,
            "no checkpoints where none are kept"
        );
        let store = without.with_checkpoints_dir(tmp.path().to_owned());
        assert_eq!(store.path(&name), Some(tmp.path().join(key)));
        assert_eq!(store.path("checkpoint/abc"), None, "keys have 32 digits");
        assert_eq!(store.path("checkpoint/../../etc"), None);
        std::fs::create_dir(tmp.path().join(key)).unwrap();
        assert!(
            !store.exists(&name),
            "a dump under way is not a checkpoint yet"
        );
        std::fs::write(
            tmp.path().join(key).join(crate::checkpoint::HEADER_FILE),
            b"",
        )
        .unwrap();
        assert!(store.exists(&name));
        assert!(store.dirs().contains(&tmp.path()));
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
        let (lower, upper) = two_layers(tmp.path(), &["usr/bin", "etc"], &["etc"]);
        std::fs::write(lower.join("etc/passwd"), "root:x:0:0::/root:/bin/sh\n").unwrap();
        std::fs::write(upper.join("etc/passwd"), "root:x:0:0::/root:/bin/bash\n").unwrap();
        std::os::unix::fs::symlink("usr/bin", lower.join("bin")).unwrap();
        std::os::unix::fs::symlink("/../../../etc", lower.join("escape")).unwrap();
        let stack = Stack::open(&[upper.clone(), lower.clone()]).unwrap();
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
        let (lower, upper) = two_layers(tmp.path(), &["etc", "opt/data"], &["etc", "opt/data"]);
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
        let stack = Stack::open(&[upper, lower]).unwrap();
        assert_eq!(lookup(&stack, Path::new("etc/motd")), Found::Missing);
        assert_eq!(
            lookup(&stack, Path::new("opt/data/old.txt")),
            Found::Missing
        );
        assert_eq!(lookup(&stack, Path::new("opt/data")), Found::Dir(0));
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
        // Something owned outside the range is refused rather than mapped. The directories
        // are put back in the range first, so the refusal can only be the file's.
        for p in [&root, &root.join("a"), &root.join("a/b")] {
            std::os::unix::fs::lchown(p, Some(base + 1000), Some(base + 1000)).unwrap();
        }
        std::os::unix::fs::lchown(&file, Some(5), Some(5)).unwrap();
        let err = shift_owners(&root, base, 65536).expect_err("an owner outside the range");
        assert_eq!(
            err.to_string(),
            format!(
                "{} is owned by host id 5, outside the sandbox's range",
                file.display()
            )
        );
    }
}
