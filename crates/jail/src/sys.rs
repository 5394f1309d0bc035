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

pub(crate) fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: unshare takes flags only and touches no memory of ours.
    check(unsafe { libc::unshare(flags) })
}

pub(crate) enum Fork {
    Parent(libc::pid_t),
    Child,
}

pub(crate) fn fork() -> io::Result<Fork> {
    // SAFETY: the caller runs single-threaded (boot happens before any runtime starts), so the
    // child inherits a consistent copy of the process.
    let pid = unsafe { libc::fork() };
    match pid {
        p if p < 0 => Err(io::Error::last_os_error()),
        0 => Ok(Fork::Child),
        p => Ok(Fork::Parent(p)),
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

pub(crate) fn mknod_char(
    path: &Path,
    mode: libc::mode_t,
    major: u32,
    minor: u32,
) -> io::Result<()> {
    let c = cstring(path)?;
    // SAFETY: `c` is a valid nul-terminated path.
    check(unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | mode,
            libc::makedev(major, minor),
        )
    })?;
    // mknod honours the umask; device nodes need their exact mode.
    // SAFETY: as above.
    check(unsafe { libc::chmod(c.as_ptr(), mode) })
}

pub(crate) fn set_cloexec(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: F_SETFD on a descriptor we own.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) })
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
