//! The sandbox's root filesystem: an overlay over the id-mapped template with fresh `/proc`,
//! `/sys` and `/dev`, entered with `pivot_root` so the host's tree is unreachable afterwards.
//!
//! Everything here runs as root of the sandbox's user namespace, with paths relative to the
//! sandbox's directory on the host (the working directory the boot process set).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use crate::sys::{self, mount};
use crate::{BootError, JailSpec, layout};

const NOSUID_NODEV_NOEXEC: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;

/// Host device nodes bound into every sandbox's `/dev`. A user namespace cannot create device
/// nodes, and binding the host's few harmless ones is what rootless container runtimes do.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

fn step(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> BootError {
    BootError::syscall(format!("{what} {}", path.display()))
}

pub(crate) fn build_root(
    spec: &JailSpec,
    template: Vec<OwnedFd>,
    sysfs: OwnedFd,
) -> Result<(), BootError> {
    // Nothing mounted from here on may propagate back into the host's mount namespace.
    mount(
        "",
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )
    .map_err(step("make private", Path::new("/")))?;

    let mut lowers = Vec::with_capacity(template.len());
    for (i, layer) in template.into_iter().enumerate() {
        let lower = Path::new(layout::LOWER).join(i.to_string());
        sys::move_mount_to(&layer, &lower).map_err(step("attach a template layer at", &lower))?;
        lowers.push(lower.display().to_string());
    }

    // Relative layer paths keep host paths out of the sandbox's /proc/mounts.
    let root = Path::new(layout::ROOT);
    let overlay = format!(
        "lowerdir={},upperdir={},workdir={},userxattr",
        lowers.join(":"),
        layout::UPPER,
        layout::WORK
    );
    mount("overlay", root, Some("overlay"), 0, Some(&overlay))
        .map_err(step("mount overlay on", root))?;

    let proc_dir = ensure_dir(root, "proc")?;
    mount("proc", &proc_dir, Some("proc"), NOSUID_NODEV_NOEXEC, None)
        .map_err(step("mount proc on", &proc_dir))?;

    let sys_dir = ensure_dir(root, "sys")?;
    sys::move_mount_to(&sysfs, &sys_dir).map_err(step("attach sysfs at", &sys_dir))?;

    build_dev(root, spec.pty_max)?;
    Ok(())
}

fn ensure_dir(root: &Path, name: &str) -> Result<PathBuf, BootError> {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).map_err(step("create", &dir))?;
    Ok(dir)
}

fn build_dev(root: &Path, pty_max: u32) -> Result<(), BootError> {
    let dev = ensure_dir(root, "dev")?;
    mount(
        "tmpfs",
        &dev,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC | libc::MS_STRICTATIME,
        Some("mode=755,size=64k,nr_inodes=64"),
    )
    .map_err(step("mount tmpfs on", &dev))?;

    for name in DEVICES {
        let node = dev.join(name);
        std::fs::File::create(&node).map_err(step("create", &node))?;
        let host = Path::new("/dev").join(name);
        mount(
            &host.to_string_lossy(),
            &node,
            None,
            libc::MS_BIND | libc::MS_NOSUID | libc::MS_NOEXEC,
            None,
        )
        .map_err(step("bind the host's device onto", &node))?;
    }

    let pts = ensure_dir(&dev, "pts")?;
    // Every devpts instance draws from the kernel's one pool of ptys: `max` keeps one sandbox
    // from taking them all.
    let options = format!("newinstance,ptmxmode=0666,mode=0620,gid=5,max={pty_max}");
    mount(
        "devpts",
        &pts,
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some(&options),
    )
    .map_err(step("mount devpts on", &pts))?;

    let shm = ensure_dir(&dev, "shm")?;
    mount(
        "shm",
        &shm,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some("mode=1777,size=65536k"),
    )
    .map_err(step("mount tmpfs on", &shm))?;

    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let path = dev.join(link);
        std::os::unix::fs::symlink(target, &path).map_err(step("symlink", &path))?;
    }
    Ok(())
}

/// Writes `/etc/hostname`, `hosts` and `resolv.conf` inside the finished root. The writable
/// layer may come from an earlier life of the sandbox or from a template, so any of these may
/// be a link planted by sandbox code: they are replaced, never written through.
pub(crate) fn write_etc(spec: &JailSpec) -> Result<(), BootError> {
    let etc = Path::new("/etc");
    if !etc.is_dir() {
        std::fs::create_dir(etc).map_err(step("create", etc))?;
    }
    let hosts = format!(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{}\n",
        spec.hostname
    );
    let resolv: String = spec
        .nameservers
        .iter()
        .map(|ns| format!("nameserver {ns}\n"))
        .collect();
    for (name, content) in [
        ("hostname", format!("{}\n", spec.hostname)),
        ("hosts", hosts),
        ("resolv.conf", resolv),
    ] {
        let path = etc.join(name);
        sys::replace_file(&path, content.as_bytes(), 0o644).map_err(step("write", &path))?;
    }
    if let Some(id) = &spec.machine_id {
        let path = etc.join("machine-id");
        sys::replace_file(&path, format!("{id}\n").as_bytes(), 0o444)
            .map_err(step("write", &path))?;
    }
    Ok(())
}

/// Where the boot id's filesystem is attached for the moment it takes to bind its file:
/// before any of the sandbox's own processes exist, and gone before them.
const BOOT_ID_STAGING: &str = "/dev/.boot-id";

/// Binds the file `name` of the detached, read-only filesystem `tree` over the kernel's boot
/// id, read-only. Only the bind stays: a sandbox sees no other way to the file, and sandbox
/// root may neither unmount it (no `CAP_SYS_ADMIN`, `umount2` refused by seccomp) nor write
/// through it (a read-only mount of a file host root owns).
pub(crate) fn attach_boot_id(tree: OwnedFd, name: &Path) -> Result<(), BootError> {
    let staging = Path::new(BOOT_ID_STAGING);
    std::fs::create_dir(staging).map_err(step("create", staging))?;
    let target = Path::new(crate::BOOT_ID_PATH);
    let source = staging.join(name);
    let source_text = source.display().to_string();
    let bound = sys::move_mount_to(&tree, staging)
        .map_err(step("attach the boot id at", staging))
        .and_then(|()| {
            mount(&source_text, target, None, libc::MS_BIND, None)
                .and_then(|()| {
                    mount(
                        &source_text,
                        target,
                        None,
                        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | NOSUID_NODEV_NOEXEC,
                        None,
                    )
                })
                .map_err(step("bind the boot id onto", target))
        });
    drop(tree);
    let _ = sys::umount_detach(staging);
    let _ = std::fs::remove_dir(staging);
    bound
}

/// Attaches each id-mapped volume at its mount point, creating the directory when missing.
pub(crate) fn attach_volumes(spec: &JailSpec, volumes: Vec<OwnedFd>) -> Result<(), BootError> {
    for (volume, tree) in spec.volumes.iter().zip(volumes) {
        let target = &volume.target;
        std::fs::create_dir_all(target).map_err(step("create the mount point", target))?;
        sys::move_mount_to(&tree, target).map_err(step("attach a volume at", target))?;
    }
    Ok(())
}

pub(crate) fn pivot_into(root: &Path) -> Result<(), BootError> {
    std::env::set_current_dir(root).map_err(step("chdir", root))?;
    // Stacking the old root under the new one and detaching it avoids needing a spare
    // directory inside the template.
    sys::pivot_root(Path::new("."), Path::new(".")).map_err(step("pivot_root", root))?;
    sys::umount_detach(Path::new(".")).map_err(step("detach old root from", root))?;
    std::env::set_current_dir("/").map_err(step("chdir", Path::new("/")))?;
    Ok(())
}

/// Files that describe or reach the host, hidden behind `/dev/null` as container runtimes do
/// (plus the kernel command line, which names the host's boot devices and options).
const MASKED_FILES: &[&str] = &[
    "/proc/kcore",
    "/proc/keys",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/sysrq-trigger",
    "/proc/latency_stats",
    "/proc/kpageflags",
    "/proc/kpagecount",
    "/proc/kpagecgroup",
    "/proc/slabinfo",
    "/proc/cmdline",
    "/proc/config.gz",
];

/// Directories replaced by an empty read-only tmpfs.
const MASKED_DIRS: &[&str] = &[
    "/proc/acpi",
    "/proc/scsi",
    "/proc/driver",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
    "/sys/kernel/debug",
    "/sys/kernel/security",
];

/// Directories that stay visible but read-only.
const READ_ONLY_DIRS: &[&str] = &["/proc/sys", "/proc/bus", "/proc/fs", "/proc/irq"];

/// Hides kernel interfaces that leak host state or allow host-wide changes.
pub(crate) fn harden_proc_and_sys() -> Result<(), BootError> {
    for file in MASKED_FILES {
        let path = Path::new(file);
        if path.exists() {
            mount("/dev/null", path, None, libc::MS_BIND, None).map_err(step("mask", path))?;
        }
    }
    // One empty tmpfs, bound over every masked directory: a checkpoint archives each tmpfs
    // it finds, and restoring one costs a process and ~10 ms, binds almost nothing.
    let mut mask: Option<&Path> = None;
    for dir in MASKED_DIRS {
        let path = Path::new(dir);
        if !path.is_dir() {
            continue;
        }
        match mask {
            None => {
                mount(
                    "tmpfs",
                    path,
                    Some("tmpfs"),
                    libc::MS_RDONLY | NOSUID_NODEV_NOEXEC,
                    Some("size=0,nr_inodes=1"),
                )
                .map_err(step("mask", path))?;
                mask = Some(path);
            }
            Some(first) => {
                mount(
                    &first.display().to_string(),
                    path,
                    None,
                    libc::MS_BIND,
                    None,
                )
                .map_err(step("mask", path))?;
                mount(
                    &first.display().to_string(),
                    path,
                    None,
                    libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | NOSUID_NODEV_NOEXEC,
                    None,
                )
                .map_err(step("make read-only", path))?;
            }
        }
    }
    for dir in READ_ONLY_DIRS {
        let path = Path::new(dir);
        if path.exists() {
            mount(dir, path, None, libc::MS_BIND | libc::MS_REC, None)
                .map_err(step("bind", path))?;
            mount(
                dir,
                path,
                None,
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_REC,
                None,
            )
            .map_err(step("make read-only", path))?;
        }
    }
    Ok(())
}
