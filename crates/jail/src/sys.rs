//! Thin, checked wrappers over the raw system calls the boot sequence needs.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub(crate) fn cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a nul byte"))
}

pub(crate) enum Fork {
    Parent(libc::pid_t),
    Child,
}

/// `prctl` option reading the address the kernel clears when the calling thread exits.
const PR_GET_TID_ADDRESS: libc::c_int = 40;

/// Forks into new namespaces (`clone` with namespace flags, which `fork` cannot pass). The
/// child's thread id is written where libc keeps the thread's own id, as libc's `fork` does,
/// so the child's libc state is the same as after `fork`. The caller must be single-threaded.
pub(crate) fn fork_into_namespaces(namespaces: libc::c_int) -> io::Result<Fork> {
    let mut tid_address: *mut libc::pid_t = std::ptr::null_mut();
    // SAFETY: PR_GET_TID_ADDRESS stores one pointer at the address given.
    let known = unsafe {
        libc::prctl(
            PR_GET_TID_ADDRESS,
            &mut tid_address as *mut *mut libc::pid_t as libc::c_ulong,
            0,
            0,
            0,
        )
    } == 0
        && !tid_address.is_null();
    let mut flags = namespaces as libc::c_ulong | libc::SIGCHLD as libc::c_ulong;
    if known {
        flags |= (libc::CLONE_CHILD_SETTID | libc::CLONE_CHILD_CLEARTID) as libc::c_ulong;
    }
    // SAFETY: a fork-style clone (no new stack, no shared memory) from a single-threaded
    // process; the child tid pointer is libc's own slot for this thread, which the child's
    // copy of the memory has at the same address.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            flags,
            0usize,
            0usize,
            if known {
                tid_address
            } else {
                std::ptr::null_mut()
            },
            0usize,
        )
    };
    match pid {
        p if p < 0 => Err(io::Error::last_os_error()),
        0 => Ok(Fork::Child),
        p => Ok(Fork::Parent(p as libc::pid_t)),
    }
}

pub(crate) fn set_hostname(name: &str) -> io::Result<()> {
    // SAFETY: the pointer and length describe `name`'s bytes, which outlive the call.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })
}

pub(crate) fn mount(
    source: &str,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source = CString::new(source)?;
    let target = cstring(target)?;
    let fstype = fstype.map(CString::new).transpose()?;
    let data = data.map(CString::new).transpose()?;
    // SAFETY: every pointer is either null or a valid nul-terminated string that lives until
    // the call returns.
    check(unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            flags,
            data.as_ref()
                .map_or(std::ptr::null(), |s| s.as_ptr().cast()),
        )
    })
}

pub(crate) fn umount_detach(target: &Path) -> io::Result<()> {
    let target = cstring(target)?;
    // SAFETY: `target` is a valid nul-terminated path.
    check(unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) })
}

pub(crate) fn pivot_root(new_root: &Path, put_old: &Path) -> io::Result<()> {
    let new_root = cstring(new_root)?;
    let put_old = cstring(put_old)?;
    // SAFETY: both arguments are valid nul-terminated paths; libc has no wrapper for this call.
    check(unsafe { libc::syscall(libc::SYS_pivot_root, new_root.as_ptr(), put_old.as_ptr()) } as _)
}

pub(crate) fn set_cloexec(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: F_SETFD on a descriptor we own.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) })
}

/// Takes `fd` if it is open and an eventfd; the node passes it only on hosts where it can
/// register one, and anything else there is not the agent's to keep.
pub(crate) fn take_eventfd(fd: i32) -> Option<OwnedFd> {
    // SAFETY: F_GETFD only asks whether the descriptor is open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return None;
    }
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    if link.as_os_str() != "anon_inode:[eventfd]" {
        return None;
    }
    // SAFETY: the descriptor is open, and nothing else in this process owns it.
    Some(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Makes the caller the leader of a new session. The boot process that forked PID 1 leads
/// PID 1's original session from outside the sandbox's PID namespace; a checkpoint cannot
/// record a session whose leader it cannot see.
pub(crate) fn new_session() -> io::Result<()> {
    // SAFETY: setsid takes no arguments; PID 1 of a fresh namespace leads no process group.
    check(unsafe { libc::setsid() })
}

pub(crate) fn set_non_dumpable() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) })
}

/// Points standard input and output at `/dev/null` of the new root: the node's pipes must not
/// stay open in the sandbox, but standard error keeps going to the node's log file.
pub(crate) fn detach_stdio() -> io::Result<()> {
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?;
    for target in [0, 1] {
        // SAFETY: dup2 onto the standard descriptors, which this process owns.
        check(unsafe { libc::dup2(null.as_raw_fd(), target) })?;
    }
    Ok(())
}

/// A detached copy of the mount at `path` (`open_tree(OPEN_TREE_CLONE)`): a mount that no
/// namespace shows until it is attached with [`move_mount_to`], and whose attributes (such as
/// an id mapping) can be changed first.
pub(crate) fn open_tree_clone(path: &Path) -> io::Result<OwnedFd> {
    open_tree_with(path, 0)
}

/// [`open_tree_clone`] refusing a symlink as the last component of `path`.
pub(crate) fn open_tree_clone_nofollow(path: &Path) -> io::Result<OwnedFd> {
    open_tree_with(path, libc::AT_SYMLINK_NOFOLLOW as libc::c_uint)
}

fn open_tree_with(path: &Path, extra: libc::c_uint) -> io::Result<OwnedFd> {
    let c = cstring(path)?;
    // SAFETY: `c` is a valid nul-terminated path; the returned descriptor is checked before it
    // is owned.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c.as_ptr(),
            (libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC) as libc::c_uint | extra,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: open_tree returned a new descriptor that nothing else owns.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) })
}

/// The kernel's `struct mount_attr` (size version 0).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const MOUNT_ATTR_RDONLY: u64 = 0x0000_0001;
const MOUNT_ATTR_NODEV: u64 = 0x0000_0004;
const MOUNT_ATTR_NOSUID: u64 = 0x0000_0002;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// Makes the detached mount `tree` id-mapped through `userns`, writable, without devices or
/// set-id programs: a volume shared by sandboxes of different host ranges.
pub(crate) fn idmap_volume(tree: &OwnedFd, userns: &OwnedFd) -> io::Result<()> {
    set_attr(
        tree,
        MOUNT_ATTR_IDMAP | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID,
        userns,
    )
}

/// Makes the detached mount `tree` read-only, device-free and id-mapped through the user
/// namespace `userns`: files owned by host id N appear owned by N inside that namespace.
pub(crate) fn idmap_read_only(tree: &OwnedFd, userns: &OwnedFd) -> io::Result<()> {
    set_attr(
        tree,
        MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV,
        userns,
    )
}

fn set_attr(tree: &OwnedFd, attr_set: u64, userns: &OwnedFd) -> io::Result<()> {
    mount_setattr(tree, attr_set, userns.as_raw_fd() as u64)
}

/// `mount_setattr(2)` on the whole mount `tree`; `userns_fd` 0 unless `attr_set` asks for an
/// id mapping.
fn mount_setattr(tree: &OwnedFd, attr_set: u64, userns_fd: u64) -> io::Result<()> {
    let attr = MountAttr {
        attr_set,
        attr_clr: 0,
        propagation: 0,
        userns_fd,
    };
    let empty = c"";
    // SAFETY: `attr` has the kernel's layout and its size is passed; the path is an empty
    // nul-terminated string used with AT_EMPTY_PATH on a descriptor we own.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    check(rc as libc::c_int)
}

const MOUNT_ATTR_NOEXEC: u64 = 0x0000_0008;
const FSOPEN_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
const FSMOUNT_CLOEXEC: libc::c_uint = 1;

/// Moves the calling (single-threaded) process into the network namespace `netns`.
pub(crate) fn join_netns(netns: &OwnedFd) -> io::Result<()> {
    // SAFETY: setns on a descriptor we own, naming the namespace type it must be.
    check(unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) })
}

/// A new, detached instance of the filesystem `fstype` with the string `options`, mounted
/// with the `MOUNT_ATTR_*` flags `attrs`: no namespace shows it until it is attached with
/// [`move_mount_to`].
fn detached_filesystem(
    fstype: &std::ffi::CStr,
    options: &[(&std::ffi::CStr, &std::ffi::CStr)],
    attrs: u64,
) -> io::Result<OwnedFd> {
    // SAFETY: a nul-terminated filesystem name; the descriptor is checked before it is owned.
    let context = unsafe { libc::syscall(libc::SYS_fsopen, fstype.as_ptr(), FSOPEN_CLOEXEC) };
    if context < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fsopen returned a new descriptor that nothing else owns.
    let context = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(context as i32) };
    for (key, value) in options {
        // SAFETY: FSCONFIG_SET_STRING takes a nul-terminated key and value, both alive here.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                context.as_raw_fd(),
                FSCONFIG_SET_STRING,
                key.as_ptr(),
                value.as_ptr(),
                0,
            )
        };
        check(rc as libc::c_int)?;
    }
    // SAFETY: FSCONFIG_CMD_CREATE takes no key, value or auxiliary argument.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            context.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        )
    };
    check(rc as libc::c_int)?;
    // SAFETY: a configured filesystem context we own; the result is checked before it is owned.
    let mounted = unsafe {
        libc::syscall(
            libc::SYS_fsmount,
            context.as_raw_fd(),
            FSMOUNT_CLOEXEC,
            attrs as libc::c_uint,
        )
    };
    if mounted < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fsmount returned a new descriptor that nothing else owns.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(mounted as i32) })
}

/// A new, detached, read-only sysfs instance showing the caller's network namespace. Made by
/// the boot process because mounting sysfs needs `CAP_SYS_ADMIN` over the owner of that
/// namespace, which the sandbox's root does not have when the node made the namespace.
pub(crate) fn detached_sysfs_read_only() -> io::Result<OwnedFd> {
    detached_filesystem(
        c"sysfs",
        &[],
        MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
    )
}

/// A new, detached procfs instance.
pub(crate) fn detached_proc() -> io::Result<OwnedFd> {
    detached_filesystem(
        c"proc",
        &[],
        MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
    )
}

/// A new, detached, read-only tmpfs holding only the file `name` with `content`, mode 0444:
/// what a bind mount shows in place of a host file (the boot id). Made by host root, so the
/// filesystem belongs to the host's user namespace and the file to host root, whom a
/// sandbox's user namespace does not map: no sandbox id may write it, and no sandbox may make
/// the mount writable again.
pub(crate) fn detached_file_read_only(name: &Path, content: &[u8]) -> io::Result<OwnedFd> {
    use std::io::Write;
    let tree = detached_filesystem(
        c"tmpfs",
        &[(c"size", c"4k"), (c"nr_inodes", c"2"), (c"mode", c"0555")],
        MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
    )?;
    let c = cstring(name)?;
    // SAFETY: `tree` is an open directory and `c` a valid nul-terminated name;
    // O_EXCL|O_NOFOLLOW creates a new file in a filesystem nobody else has seen.
    let fd = unsafe {
        libc::openat(
            tree.as_raw_fd(),
            c.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o444 as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openat returned a new descriptor that nothing else owns.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.write_all(content)?;
    drop(file);
    set_flags(&tree, MOUNT_ATTR_RDONLY)?;
    Ok(tree)
}

/// Sets the `MOUNT_ATTR_*` flags `attr_set` on the mount `tree` (no id mapping).
fn set_flags(tree: &OwnedFd, attr_set: u64) -> io::Result<()> {
    mount_setattr(tree, attr_set, 0)
}

/// Attaches the detached mount `tree` at `target` (relative to the working directory).
pub(crate) fn move_mount_to(tree: &OwnedFd, target: &Path) -> io::Result<()> {
    let target = cstring(target)?;
    let empty = c"";
    // SAFETY: both paths are valid nul-terminated strings; `tree` is a descriptor we own.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH as libc::c_uint,
        )
    };
    check(rc as libc::c_int)
}

/// Sets only the effective user and group, keeping the real and saved ids (root), so that
/// the process can become root again.
pub(crate) fn set_effective_ids(uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: setresgid/setresuid with integer arguments only; -1 leaves an id unchanged.
    check(unsafe { libc::setresgid(u32::MAX, gid, u32::MAX) })?;
    // SAFETY: as above.
    check(unsafe { libc::setresuid(u32::MAX, uid, u32::MAX) })
}

/// Becomes root of the current user namespace with no supplementary groups.
pub(crate) fn become_root() -> io::Result<()> {
    // SAFETY: setgroups with an empty list, then integer-only id calls.
    check(unsafe { libc::setgroups(0, std::ptr::null()) })?;
    // SAFETY: integer arguments only.
    check(unsafe { libc::setresgid(0, 0, 0) })?;
    // SAFETY: integer arguments only.
    check(unsafe { libc::setresuid(0, 0, 0) })
}

pub(crate) fn set_rlimit(
    resource: libc::__rlimit_resource_t,
    soft: u64,
    hard: u64,
) -> io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: `limit` is a valid rlimit that outlives the call.
    check(unsafe { libc::setrlimit(resource, &limit) })
}

/// Creates (or replaces) the regular file `path` with `content` without following a link
/// anywhere: the old entry is unlinked (a symlink is removed, not followed) and the new file
/// is created exclusively, with every directory on the way resolved without magic links.
pub(crate) fn replace_file(path: &Path, content: &[u8], mode: u32) -> io::Result<()> {
    use std::io::Write;
    let c = cstring(path)?;
    // SAFETY: `c` is a valid nul-terminated path.
    let rc = unsafe { libc::unlink(c.as_ptr()) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::NotFound {
            return Err(err);
        }
    }
    let fd = sandbar_fs::open_at(
        rustix::fs::CWD,
        path,
        rustix::fs::OFlags::WRONLY
            | rustix::fs::OFlags::CREATE
            | rustix::fs::OFlags::EXCL
            | rustix::fs::OFlags::NOFOLLOW,
        rustix::fs::Mode::from_raw_mode(mode),
        sandbar_fs::Links::Ordinary,
    )?;
    std::fs::File::from(fd).write_all(content)
}

/// Opens `relative` under the directory `root` as if `root` were `/` (`RESOLVE_IN_ROOT`),
/// without magic links.
pub(crate) fn open_beneath(
    root: &std::fs::File,
    relative: &Path,
    flags: libc::c_int,
) -> io::Result<OwnedFd> {
    Ok(sandbar_fs::open_at(
        root,
        relative,
        rustix::fs::OFlags::from_bits_retain(flags.cast_unsigned()),
        rustix::fs::Mode::empty(),
        sandbar_fs::Links::InRoot,
    )?)
}

pub(crate) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 returned two new descriptors that nothing else owns.
    Ok(unsafe {
        (
            <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fds[0]),
            <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fds[1]),
        )
    })
}

/// Writes one byte: the boot steps hand each other control through pipes.
pub(crate) fn signal_ready(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: writes one byte from a valid buffer to a descriptor we own.
    let rc = unsafe { libc::write(fd.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
    if rc == 1 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Waits for one byte; end of file means the other side died first.
pub(crate) fn wait_ready(fd: &OwnedFd) -> io::Result<()> {
    let mut byte = [0u8; 1];
    loop {
        // SAFETY: reads at most one byte into a valid buffer from a descriptor we own.
        let rc = unsafe { libc::read(fd.as_raw_fd(), byte.as_mut_ptr().cast(), 1) };
        match rc {
            1 => return Ok(()),
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the other boot step exited",
                ));
            }
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn open_in(
        tree: &OwnedFd,
        name: &std::ffi::CStr,
        flags: libc::c_int,
    ) -> io::Result<std::fs::File> {
        // SAFETY: `tree` is an open directory and `name` a valid nul-terminated name.
        let fd = unsafe { libc::openat(tree.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: openat returned a new descriptor that nothing else owns.
        Ok(unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) })
    }

    #[test]
    fn a_detached_file_is_read_only_and_owned_by_its_maker() {
        // SAFETY: geteuid takes no arguments.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root to make a filesystem");
            return;
        }
        let tree = detached_file_read_only(Path::new("boot_id"), b"id\n").unwrap();
        let mut file = open_in(&tree, c"boot_id", libc::O_RDONLY).unwrap();
        let mut content = String::new();
        std::io::Read::read_to_string(&mut file, &mut content).unwrap();
        assert_eq!(content, "id\n");
        let meta = file.metadata().unwrap();
        assert_eq!((meta.mode() & 0o7777, meta.uid()), (0o444, 0));
        let refused = open_in(&tree, c"boot_id", libc::O_WRONLY).unwrap_err();
        assert_eq!(refused.raw_os_error(), Some(libc::EROFS));
        let refused = open_in(&tree, c"other", libc::O_WRONLY | libc::O_CREAT).unwrap_err();
        assert_eq!(refused.raw_os_error(), Some(libc::EROFS));
    }
}
