//! Mounts the node makes on the host for a sandbox restored from a checkpoint: what the boot
//! process and PID 1 make for a new sandbox, made again from outside; and the procfs
//! instance the node writes network sysctls through.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::{IdMap, layout, sys};

/// Mounts the sandbox's root again at `dir/root`, as its boot did inside: each template
/// layer (`layers`, topmost first) read-only and id-mapped through the user namespace file
/// `userns` at `dir/lower/N`, the overlay of the writable layer on top. Undone by
/// [`unmount_root`].
pub fn mount_root(dir: &Path, layers: &[PathBuf], userns: &Path) -> io::Result<()> {
    let userns: OwnedFd = std::fs::File::open(userns)?.into();
    mount_root_mapped(dir, layers, &userns)
}

/// [`mount_root`] with the user namespace given as an open descriptor.
pub fn mount_root_mapped(dir: &Path, layers: &[PathBuf], userns: &OwnedFd) -> io::Result<()> {
    let mut lowers = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        let target = dir.join(layout::LOWER).join(i.to_string());
        if let Err(e) = std::fs::create_dir(&target)
            && e.kind() != io::ErrorKind::AlreadyExists
        {
            return Err(e);
        }
        let tree = sys::open_tree_clone(layer)?;
        sys::idmap_read_only(&tree, userns)?;
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

/// Mounts the volume directory `source` at `target` (created if missing), id-mapped through
/// `userns` as a sandbox sees its volumes: what a restore binds back at the volume's place.
pub fn mount_volume_mapped(source: &Path, userns: &OwnedFd, target: &Path) -> io::Result<()> {
    if let Err(e) = std::fs::create_dir(target)
        && e.kind() != io::ErrorKind::AlreadyExists
    {
        return Err(e);
    }
    let tree = sys::open_tree_clone_nofollow(source)?;
    sys::idmap_volume(&tree, userns)?;
    sys::move_mount_to(&tree, target)
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

/// Sysctls written through a procfs instance of the node's own, mounted nowhere.
///
/// Every network namespace that looks up a sysctl under the host's `/proc/sys/net` leaves a
/// dentry for `net` and `ipv4` there, told apart from the others' only at compare time, so a
/// lookup through the shared `/proc` walks one entry per namespace: with 1,000 sandboxes,
/// each write cost a walk of thousands of entries. An instance has a dentry cache of its own,
/// holding only what was looked up through it. What a write reaches is the network namespace
/// of the calling thread, as through `/proc`.
#[derive(Debug)]
pub struct Sysctls {
    proc: OwnedFd,
}

impl Sysctls {
    pub fn new() -> io::Result<Self> {
        Ok(Self {
            proc: sys::detached_proc()?,
        })
    }

    /// Writes `value` to the sysctl at `name` (as under `/proc/sys`, e.g.
    /// `net/ipv4/ping_group_range`).
    pub fn write(&self, name: &str, value: &str) -> io::Result<()> {
        use std::io::Write;
        let path = sys::cstring(&Path::new("sys").join(name))?;
        // SAFETY: `proc` is an open directory and `path` a nul-terminated relative name; the
        // result is checked before it is owned.
        let fd = unsafe {
            libc::openat(
                self.proc.as_raw_fd(),
                path.as_ptr(),
                libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("/proc/sys/{name}: {e}")));
        }
        // SAFETY: openat returned a new descriptor that nothing else owns.
        let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.write_all(value.as_bytes())
            .map_err(|e| io::Error::new(e.kind(), format!("/proc/sys/{name}: {e}")))
    }
}

/// Mounts at the directory `dir` (created if missing) a read-only filesystem holding only
/// the file `boot_id` with `id`, as a sandbox's boot made it: what a restore binds back over
/// the kernel's boot id. Returns the file's path; undone by [`unmount`] of `dir`.
pub fn mount_boot_id(dir: &Path, id: &str) -> io::Result<PathBuf> {
    if !crate::is_boot_id(id) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("malformed boot id '{id}'"),
        ));
    }
    if let Err(e) = std::fs::create_dir(dir)
        && e.kind() != io::ErrorKind::AlreadyExists
    {
        return Err(e);
    }
    let name = Path::new(crate::BOOT_ID_FILE);
    let tree = sys::detached_file_read_only(name, format!("{id}\n").as_bytes())?;
    sys::move_mount_to(&tree, dir)?;
    Ok(dir.join(name))
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

/// A user namespace that maps ids `0..map.size` to host ids from `map.host_base`, held only by
/// the returned descriptor: for id-mapping a sandbox's template layers before any of its
/// processes exists (a restore, where CRIU makes the sandbox's own user namespace).
pub fn new_user_namespace(map: IdMap) -> io::Result<OwnedFd> {
    let (rx, tx) = sys::pipe()?;
    let (rx_fd, tx_fd) = (rx.as_raw_fd(), tx.as_raw_fd());
    // SAFETY: a fork-style clone (no new stack, no shared memory). The child only calls
    // close, read and _exit, which are async-signal-safe, so forking from a threaded server is
    // sound.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid == 0 {
        // SAFETY: see above; the child waits until the parent closes its end, then ends.
        unsafe {
            libc::close(tx_fd);
            let mut byte = 0u8;
            libc::read(rx_fd, (&mut byte as *mut u8).cast(), 1);
            libc::_exit(0);
        }
    }
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    let pid = pid as libc::pid_t;
    drop(rx);
    let made = (|| -> io::Result<OwnedFd> {
        let line = format!("0 {} {}\n", map.host_base, map.size);
        for file in ["uid_map", "gid_map"] {
            std::fs::write(format!("/proc/{pid}/{file}"), &line)?;
        }
        Ok(std::fs::File::open(format!("/proc/{pid}/ns/user"))?.into())
    })();
    drop(tx);
    let mut status = 0;
    // SAFETY: `pid` is our own child, which ends once its pipe is closed.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    made
}

/// Replaces `relative` (such as `etc/resolv.conf`) under the directory `root` with a regular
/// file holding `content`, owned by `owner`, resolving every component as if `root` were `/`:
/// a link planted in the tree cannot send the write anywhere else on the host.
pub fn replace_file_beneath(
    root: &Path,
    relative: &Path,
    content: &[u8],
    mode: u32,
    owner: u32,
) -> io::Result<()> {
    use std::io::Write;
    let root_dir = std::fs::File::open(root)?;
    let parent = relative.parent().unwrap_or(Path::new(""));
    let name = relative
        .file_name()
        .ok_or_else(|| io::Error::other(format!("{} names no file", relative.display())))?;
    let dir = sys::open_beneath(&root_dir, parent, libc::O_DIRECTORY | libc::O_PATH)?;
    let name = sys::cstring(Path::new(name))?;
    // SAFETY: `dir` is an open directory and `name` a valid nul-terminated file name.
    let rc = unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::NotFound {
            return Err(err);
        }
    }
    // SAFETY: as above; O_EXCL|O_NOFOLLOW creates a new file and never follows a link.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            mode as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openat returned a new descriptor that nothing else owns.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    std::os::unix::fs::fchown(&file, Some(owner), Some(owner))?;
    file.write_all(content)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_file_replaced_beneath_a_root_never_lands_outside_it() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        // SAFETY: geteuid has no preconditions.
        let owner = unsafe { libc::geteuid() };
        std::fs::create_dir(root.path().join("etc")).unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, "host file").unwrap();
        // A link planted in the tree is replaced, not written through.
        std::os::unix::fs::symlink(&victim, root.path().join("etc/resolv.conf")).unwrap();
        replace_file_beneath(
            root.path(),
            Path::new("etc/resolv.conf"),
            b"ns",
            0o644,
            owner,
        )
        .unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "host file");
        assert_eq!(
            std::fs::read_to_string(root.path().join("etc/resolv.conf")).unwrap(),
            "ns"
        );
        // A directory link to an absolute host path resolves inside the root, where it is
        // missing.
        std::fs::remove_dir_all(root.path().join("etc")).unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("etc")).unwrap();
        let err = replace_file_beneath(root.path(), Path::new("etc/victim"), b"x", 0o644, owner)
            .expect_err("written through a link to the host");
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "host file");
    }
}
