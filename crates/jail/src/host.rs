//! Mounts the node makes on the host for a sandbox restored from a checkpoint: what the boot
//! process and PID 1 make for a new sandbox, made again from outside.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use crate::{layout, sys};

/// Mounts the sandbox's root again at `dir/root`, as its boot did inside: each template
/// layer (`layers`, topmost first) read-only and id-mapped through the user namespace file
/// `userns` at `dir/lower/N`, the overlay of the writable layer on top. Undone by
/// [`unmount_root`].
pub fn mount_root(dir: &Path, layers: &[PathBuf], userns: &Path) -> io::Result<()> {
    let userns: OwnedFd = std::fs::File::open(userns)?.into();
    let mut lowers = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        let target = dir.join(layout::LOWER).join(i.to_string());
        if let Err(e) = std::fs::create_dir(&target)
            && e.kind() != io::ErrorKind::AlreadyExists
        {
            return Err(e);
        }
        let tree = sys::open_tree_clone(layer)?;
        sys::idmap_read_only(&tree, &userns)?;
        sys::move_mount_to(&tree, &target)?;
        lowers.push(target.display().to_string());
    }
    let options = format!(
        "lowerdir={},upperdir={},workdir={},userxattr",
        lowers.join(":"),
        dir.join(layout::UPPER).display(),
        dir.join(layout::WORK).display()
    );
    sys::mount(
        "overlay",
        &dir.join(layout::ROOT),
        Some("overlay"),
        0,
        Some(&options),
    )
}

/// Detaches what [`mount_root`] mounted; whatever is not mounted is skipped.
pub fn unmount_root(dir: &Path, layers: usize) {
    let _ = sys::umount_detach(&dir.join(layout::ROOT));
    for i in 0..layers {
        let _ = sys::umount_detach(&dir.join(layout::LOWER).join(i.to_string()));
    }
}

/// Mounts a read-only sysfs showing the network namespace `netns` at `target`. Sysfs shows
/// the network namespace of whoever mounts it, so a thread of its own joins that namespace
/// first and ends with it.
pub fn mount_sysfs_of(netns: &Path, target: &Path) -> io::Result<()> {
    let netns: OwnedFd = std::fs::File::open(netns)?.into();
    let target = target.to_owned();
    std::thread::spawn(move || -> io::Result<()> {
        sys::join_netns(&netns)?;
        let tree = sys::detached_sysfs_read_only()?;
        sys::move_mount_to(&tree, &target)
    })
    .join()
    .map_err(|_| io::Error::other("the sysfs thread panicked"))?
}

/// Bind-mounts `source` (such as `/proc/PID/ns/net`) on `target`, created as an empty file.
pub fn bind_file(source: &Path, target: &Path) -> io::Result<()> {
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(target)?;
    sys::mount(
        &source.display().to_string(),
        target,
        None,
        libc::MS_BIND,
        None,
    )
}

/// Detaches the mount at `target`.
pub fn unmount(target: &Path) -> io::Result<()> {
    sys::umount_detach(target)
}
