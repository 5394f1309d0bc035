//! The sandbox's root filesystem: an overlay over the template with fresh `/proc`, `/sys` and
//! `/dev`, entered with `pivot_root` so the host's tree is unreachable afterwards.

use std::path::{Path, PathBuf};

use crate::sys::{self, mknod_char, mount};
use crate::{BootError, JailSpec};

const NOSUID_NODEV_NOEXEC: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;

fn step(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> BootError {
    BootError::syscall(format!("{what} {}", path.display()))
}

pub(crate) fn build_root(spec: &JailSpec) -> Result<(), BootError> {
    // Nothing mounted from here on may propagate back into the host's mount namespace.
    mount(
        "",
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )
    .map_err(step("make private", Path::new("/")))?;

    let root = &spec.root_dir;
    let overlay = format!(
        "lowerdir={},upperdir={},workdir={}",
        spec.lower_dir.display(),
        spec.upper_dir.display(),
        spec.work_dir.display()
    );
    mount("overlay", root, Some("overlay"), 0, Some(&overlay))
        .map_err(step("mount overlay on", root))?;

    let proc_dir = ensure_dir(root, "proc")?;
    mount("proc", &proc_dir, Some("proc"), NOSUID_NODEV_NOEXEC, None)
        .map_err(step("mount proc on", &proc_dir))?;

    let sys_dir = ensure_dir(root, "sys")?;
    mount(
        "sysfs",
        &sys_dir,
        Some("sysfs"),
        NOSUID_NODEV_NOEXEC | libc::MS_RDONLY,
        None,
    )
    .map_err(step("mount sysfs on", &sys_dir))?;

    build_dev(root)?;
    write_etc(root, spec)?;
    Ok(())
}

fn ensure_dir(root: &Path, name: &str) -> Result<PathBuf, BootError> {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).map_err(step("create", &dir))?;
    Ok(dir)
}

fn build_dev(root: &Path) -> Result<(), BootError> {
    let dev = ensure_dir(root, "dev")?;
    mount(
        "tmpfs",
        &dev,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_STRICTATIME,
        Some("mode=755,size=65536k"),
    )
    .map_err(step("mount tmpfs on", &dev))?;

    for (name, minor) in [
        ("null", 3),
        ("zero", 5),
        ("full", 7),
        ("random", 8),
        ("urandom", 9),
    ] {
        let node = dev.join(name);
        mknod_char(&node, 0o666, 1, minor).map_err(step("mknod", &node))?;
    }
    let tty = dev.join("tty");
    mknod_char(&tty, 0o666, 5, 0).map_err(step("mknod", &tty))?;

    let pts = ensure_dir(&dev, "pts")?;
    mount(
        "devpts",
        &pts,
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
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

fn write_etc(root: &Path, spec: &JailSpec) -> Result<(), BootError> {
    let etc = ensure_dir(root, "etc")?;
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
        // Images often ship these as symlinks into /run; replace them with plain files.
        let _ = std::fs::remove_file(&path);
        std::fs::write(&path, content).map_err(step("write", &path))?;
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

/// Hides kernel interfaces that leak host state or allow host-wide changes, as container
/// runtimes do by default.
pub(crate) fn harden_proc() -> Result<(), BootError> {
    for file in [
        "/proc/kcore",
        "/proc/keys",
        "/proc/timer_list",
        "/proc/sched_debug",
        "/proc/sysrq-trigger",
        "/proc/latency_stats",
    ] {
        let path = Path::new(file);
        if path.exists() {
            mount("/dev/null", path, None, libc::MS_BIND, None).map_err(step("mask", path))?;
        }
    }
    for dir in ["/proc/acpi", "/proc/scsi"] {
        let path = Path::new(dir);
        if path.exists() {
            mount("tmpfs", path, Some("tmpfs"), libc::MS_RDONLY, None)
                .map_err(step("mask", path))?;
        }
    }
    for dir in ["/proc/sys", "/proc/bus", "/proc/fs", "/proc/irq"] {
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
