//! The boot contract between a node and the agent it starts as a sandbox's PID 1.
//!
//! The node starts the agent binary with the argument `boot` and a Unix socket as its standard
//! input, over which it sends the agent's listening socket (which lands as file descriptor
//! [`LISTENER_FD`]) and the other descriptors of [`handoff`], then a serialised [`JailSpec`]. The
//! agent, still single-threaded, calls [`boot`]: it joins the sandbox's cgroups, clones the
//! sandbox's PID 1 into a new user namespace and fresh other namespaces, gives it its id range
//! and the id-mapped template (whose host PID the original process prints on standard output
//! before it exits); PID 1 builds the root filesystem and drops privileges. Only the PID 1
//! process returns from [`boot`], with what the agent needs to serve.

mod caps;
mod fs;
pub mod handoff;
pub mod host;
mod seccomp;
mod sys;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The envd protocol version the agent implements; the SDKs enable features by it, so every
/// feature they gate on this version or an older one must work. 0.6.4 is the newest gate of
/// the SDKs (Python e2b 2.63, npm e2b 2.51): file metadata as `user.e2b.*` xattrs (0.6.2),
/// entries in watch events (0.6.3) and watching network mounts when asked (0.6.4). envd
/// releases after it change nothing an SDK asks for by version.
pub const ENVD_VERSION: &str = "0.6.4";

/// Descriptor on which the node hands the agent its already-listening Unix socket.
pub const LISTENER_FD: i32 = 3;

/// Descriptor on which the node hands the boot process the sandbox's network namespace, made
/// and wired by the node ahead of time: the sandbox joins it rather than creating its own.
pub const NETNS_FD: i32 = 4;

/// Descriptor on which the node may hand the agent an eventfd the kernel signals when the
/// sandbox's memory cgroup runs out of memory (cgroup v1 `memory.oom_control` notifications).
/// Nothing of the cgroup filesystem is visible inside the sandbox; this is how PID 1 learns
/// that a process it reaps was killed for memory.
pub const OOM_EVENTS_FD: i32 = 5;

/// Where the kernel shows the id of the running boot. Every boot of a sandbox gets an id of
/// its own there (a read-only bind mount), so a client can tell a fresh boot from a resume.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// Whether `id` is a UUID in the kernel's text form (lower-case hex, `8-4-4-4-12`).
pub fn is_boot_id(id: &str) -> bool {
    id.len() == 36
        && id.bytes().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == b'-',
            _ => matches!(c, b'0'..=b'9' | b'a'..=b'f'),
        })
}

/// Whether `id` is a machine id as `/etc/machine-id` holds one: 32 lower-case hex digits.
pub fn is_machine_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
}

/// What the agent needs to know to serve a sandbox, independent of how it was isolated.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct AgentConfig {
    /// Token every envd call must carry in `X-Access-Token`; `None` disables the check.
    pub access_token: Option<String>,
    /// Linux user for calls that name none.
    pub default_user: String,
    /// Environment given to every process the agent starts (the template's and the
    /// sandbox's `envVars`).
    pub env_vars: BTreeMap<String, String>,
    /// Working directory of processes started without one (the template's `WORKDIR`); the
    /// user's home when unset.
    #[serde(default)]
    pub default_workdir: Option<String>,
    /// The sandbox's memory limit, named when a process is killed for outgrowing it.
    #[serde(default)]
    pub memory_limit_mb: Option<u32>,
}

/// Names inside a sandbox's directory on the host. The boot process works relative to that
/// directory, so neither the overlay's options nor anything else the sandbox can read names a
/// host path, and the sandbox's own (unprivileged) credentials never traverse host directories.
pub mod layout {
    /// Holds the mount points `0`, `1`, … of the id-mapped, read-only template layers, `0`
    /// the topmost.
    pub const LOWER: &str = "lower";
    /// The sandbox's writable layer, owned by the sandbox's root.
    pub const UPPER: &str = "upper";
    /// Overlay work directory, on the same filesystem as [`UPPER`], owned like it.
    pub const WORK: &str = "work";
    /// Mount point of the overlay that becomes the sandbox's `/`.
    pub const ROOT: &str = "root";
}

/// The host ids a sandbox's ids 0..`size` stand for: a range of its own, so a process that
/// escaped its namespaces would be an unprivileged user on the host who owns nothing of any
/// other sandbox.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct IdMap {
    /// Host uid and gid of the sandbox's root.
    pub host_base: u32,
    pub size: u32,
}

impl IdMap {
    /// The host id of the sandbox's id `id`, if it is inside the range.
    pub fn host_id(&self, id: u32) -> Option<u32> {
        (id < self.size).then(|| self.host_base + id)
    }
}

/// Everything the node decides about a sandbox's isolation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct JailSpec {
    /// Read-only template layers, the topmost first: the overlay's lower layers.
    pub template_layers: Vec<PathBuf>,
    /// The sandbox's directory: holds the [`layout`] entries, prepared by the node.
    pub sandbox_dir: PathBuf,
    pub hostname: String,
    /// Files the booting process writes `0` (itself) into to join the sandbox's cgroups,
    /// before it unshares its cgroup namespace.
    pub cgroup_join: Vec<PathBuf>,
    /// Name servers written to the sandbox's `/etc/resolv.conf`.
    pub nameservers: Vec<String>,
    pub id_map: IdMap,
    /// Pseudo-terminals the sandbox may hold at once (its own devpts instance's `max`): every
    /// instance draws from one kernel-wide pool.
    pub pty_max: u32,
    pub agent: AgentConfig,
    /// Persistent volumes, bind-mounted read-write.
    #[serde(default)]
    pub volumes: Vec<VolumeBind>,
    /// This boot's id (see [`is_boot_id`]), shown at [`BOOT_ID_PATH`]; without one the
    /// host's shows through.
    #[serde(default)]
    pub boot_id: Option<String>,
    /// Written to `/etc/machine-id` (see [`is_machine_id`]) when the sandbox's writable layer
    /// is new; `None` leaves what its kept files hold.
    #[serde(default)]
    pub machine_id: Option<String>,
}

/// A host directory mounted into the sandbox. Like the template, it is id-mapped through the
/// sandbox's user namespace: files stored with ids 0–65535 appear with the same ids in every
/// sandbox that mounts it, whatever host range the sandbox runs as.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeBind {
    /// The directory on the host; its last component is never followed if it is a link.
    pub source: PathBuf,
    /// Absolute path inside the sandbox, resolved inside the sandbox's root.
    pub target: PathBuf,
}

/// What [`boot`] hands to the agent inside the finished sandbox.
#[derive(Debug)]
pub struct Booted {
    pub listener: std::os::unix::net::UnixListener,
    pub config: AgentConfig,
    /// The sandbox's out-of-memory notifications, when the node passed them
    /// ([`OOM_EVENTS_FD`]).
    pub oom_events: Option<OwnedFd>,
}

/// Failures while building a sandbox; each names the step and the path involved.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot read the jail spec from standard input: {0}")]
    ReadSpec(#[source] std::io::Error),
    #[error("invalid jail spec: {0}")]
    ParseSpec(#[source] serde_json::Error),
    #[error("invalid jail spec: {0}")]
    InvalidSpec(String),
    #[error("cannot join cgroup {path}: {source}")]
    JoinCgroup {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{step} failed: {source}")]
    Syscall {
        step: String,
        source: std::io::Error,
    },
    #[error("cannot build the seccomp filter: {0}")]
    Seccomp(String),
}

impl BootError {
    fn syscall(step: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let step = step.into();
        move |source| BootError::Syscall { step, source }
    }
}

/// Namespaces every sandbox gets new; the user namespace is created in the same call, so it
/// owns all the others. The network namespace is the node's (see [`NETNS_FD`]), owned by the
/// host's user namespace: sandbox root cannot reconfigure its interfaces, and the namespace
/// outlives the sandbox's processes when the node keeps it (a checkpoint).
const NAMESPACES: libc::c_int = libc::CLONE_NEWUSER
    | libc::CLONE_NEWNS
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWPID;

/// Builds the sandbox and returns inside it as its PID 1. See the crate documentation.
///
/// Two processes take part, each single-threaded:
/// 1. this one, host root: joins the cgroups and the node's network namespace, makes the
///    sandbox's sysfs there, takes a detached copy of the template's mount, and, with its effective ids set to the sandbox's host base (so the new user namespace,
///    and every kernel count charged to its owner such as inotify instances, belongs to that
///    unprivileged host user and not to host root), clones the sandbox's PID 1 into a new user
///    namespace and all the other new namespaces at once. It then writes the child's id maps
///    and id-maps the template's mount through the new user namespace (both only host root
///    may do), lets the child go, prints its host PID and exits;
/// 2. PID 1: becomes root of its namespace, builds the root filesystem and drops privileges.
///
/// Must be called before any thread is started: it forks.
pub fn boot() -> Result<Booted, BootError> {
    handoff::take_over_from_node()?;
    let mut raw = String::new();
    std::io::stdin()
        .read_to_string(&mut raw)
        .map_err(BootError::ReadSpec)?;
    let spec: JailSpec = serde_json::from_str(&raw).map_err(BootError::ParseSpec)?;
    check_ids(&spec)?;

    for file in &spec.cgroup_join {
        std::fs::write(file, "0").map_err(|source| BootError::JoinCgroup {
            path: file.clone(),
            source,
        })?;
    }
    std::env::set_current_dir(&spec.sandbox_dir).map_err(BootError::syscall(format!(
        "chdir {}",
        spec.sandbox_dir.display()
    )))?;
    if spec.template_layers.is_empty() {
        return Err(BootError::syscall("open the template")(
            std::io::Error::other("the template has no layers"),
        ));
    }
    let mut template = Vec::with_capacity(spec.template_layers.len());
    for (i, layer) in spec.template_layers.iter().enumerate() {
        let mount_point = Path::new(layout::LOWER).join(i.to_string());
        if let Err(e) = std::fs::create_dir(&mount_point)
            && e.kind() != std::io::ErrorKind::AlreadyExists
        {
            return Err(BootError::syscall(format!(
                "create {}",
                mount_point.display()
            ))(e));
        }
        template.push(
            sys::open_tree_clone(layer)
                .map_err(BootError::syscall(format!("open_tree {}", layer.display())))?,
        );
    }
    let mut volumes = Vec::with_capacity(spec.volumes.len());
    for volume in &spec.volumes {
        volumes.push(
            sys::open_tree_clone_nofollow(&volume.source).map_err(BootError::syscall(format!(
                "open_tree {}",
                volume.source.display()
            )))?,
        );
    }
    // SAFETY: the node passes the sandbox's network namespace as NETNS_FD and nothing else in
    // this process owns that descriptor.
    let netns = unsafe { OwnedFd::from_raw_fd(NETNS_FD) };
    sys::join_netns(&netns).map_err(BootError::syscall("join the network namespace"))?;
    drop(netns);
    let sysfs = sys::detached_sysfs_read_only().map_err(BootError::syscall("make sysfs"))?;
    // Made here, as host root, so neither the file nor its filesystem is the sandbox's.
    let boot_id = spec
        .boot_id
        .as_deref()
        .map(|id| {
            sys::detached_file_read_only(Path::new(BOOT_ID_FILE), format!("{id}\n").as_bytes())
        })
        .transpose()
        .map_err(BootError::syscall("make the boot id"))?;
    let (mapped_rx, mapped_tx) = sys::pipe().map_err(BootError::syscall("pipe"))?;

    sys::set_effective_ids(spec.id_map.host_base, spec.id_map.host_base)
        .map_err(BootError::syscall("set effective ids"))?;
    let forked = sys::fork_into_namespaces(NAMESPACES);
    match forked {
        Ok(sys::Fork::Child) => {
            drop(mapped_tx);
            let ready = sys::wait_ready(&mapped_rx)
                .map_err(BootError::syscall("wait for the id maps"))
                .and_then(|()| {
                    sys::become_root()
                        .map_err(BootError::syscall("become root of the user namespace"))
                });
            drop(mapped_rx);
            return match ready {
                Ok(()) => build_and_lock(&spec, template, sysfs, volumes, boot_id)
                    .inspect_err(report_failure),
                Err(err) => {
                    report_failure(&err);
                    std::process::exit(1)
                }
            };
        }
        Ok(sys::Fork::Parent(_)) | Err(_) => {
            sys::set_effective_ids(0, 0).map_err(BootError::syscall("restore effective ids"))?;
        }
    }
    let child = match forked {
        Ok(sys::Fork::Parent(child)) => child,
        Ok(sys::Fork::Child) => unreachable!("the child returned above"),
        Err(e) => return Err(BootError::syscall("clone into new namespaces")(e)),
    };
    drop(mapped_rx);
    let result = map_ids(child, &spec, &template, &volumes)
        .and_then(|()| sys::signal_ready(&mapped_tx).map_err(BootError::syscall("resume PID 1")));
    drop((mapped_tx, template, sysfs, volumes, boot_id));
    if let Err(err) = result {
        report_failure(&err);
        // SAFETY: the child is our own, not yet reaped; without its id maps it is useless.
        unsafe { libc::kill(child, libc::SIGKILL) };
        std::process::exit(1);
    }
    // Once this process exits, the sandbox is no descendant of the node's process tree, so a
    // restarted node finds it alive.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{child}");
    let _ = out.flush();
    std::process::exit(0);
}

/// The boot id file's name in the filesystem made for it.
const BOOT_ID_FILE: &str = "boot_id";

/// The ids a spec carries end up in files and mounts: anything but the expected forms is
/// refused before any of that.
fn check_ids(spec: &JailSpec) -> Result<(), BootError> {
    if let Some(id) = spec.boot_id.as_deref().filter(|id| !is_boot_id(id)) {
        return Err(BootError::InvalidSpec(format!("malformed boot id '{id}'")));
    }
    if let Some(id) = spec.machine_id.as_deref().filter(|id| !is_machine_id(id)) {
        return Err(BootError::InvalidSpec(format!(
            "malformed machine id '{id}'"
        )));
    }
    Ok(())
}

/// Host root gives the child's new user namespace its id range and id-maps the template
/// through it.
fn map_ids(
    child: libc::pid_t,
    spec: &JailSpec,
    template: &[OwnedFd],
    volumes: &[OwnedFd],
) -> Result<(), BootError> {
    let map = format!("0 {} {}\n", spec.id_map.host_base, spec.id_map.size);
    for file in ["uid_map", "gid_map"] {
        let path = PathBuf::from(format!("/proc/{child}/{file}"));
        std::fs::write(&path, &map)
            .map_err(BootError::syscall(format!("write {}", path.display())))?;
    }
    let userns_path = format!("/proc/{child}/ns/user");
    let userns: OwnedFd = std::fs::File::open(&userns_path)
        .map_err(BootError::syscall(format!("open {userns_path}")))?
        .into();
    for (layer, path) in template.iter().zip(&spec.template_layers) {
        sys::idmap_read_only(layer, &userns).map_err(BootError::syscall(format!(
            "id-map the template layer {}",
            path.display()
        )))?;
    }
    for (tree, volume) in volumes.iter().zip(&spec.volumes) {
        sys::idmap_volume(tree, &userns).map_err(BootError::syscall(format!(
            "id-map the volume {}",
            volume.source.display()
        )))?;
    }
    Ok(())
}

/// Says why the boot failed on stderr, which the node made the sandbox's agent log.
fn report_failure(err: &BootError) {
    let _ = writeln!(std::io::stderr(), "sandbox boot failed: {err}");
}

/// Step 3, the sandbox's PID 1.
fn build_and_lock(
    spec: &JailSpec,
    template: Vec<OwnedFd>,
    sysfs: OwnedFd,
    volumes: Vec<OwnedFd>,
    boot_id: Option<OwnedFd>,
) -> Result<Booted, BootError> {
    sys::new_session().map_err(BootError::syscall("setsid"))?;
    sys::set_hostname(&spec.hostname).map_err(BootError::syscall("sethostname"))?;
    fs::build_root(spec, template, sysfs)?;
    fs::pivot_into(Path::new(layout::ROOT))?;
    // After the pivot, so a mount point's path (and any link the template put on it) resolves
    // inside the sandbox's own root and never on the host.
    fs::attach_volumes(spec, volumes)?;
    fs::write_etc(spec)?;
    fs::harden_proc_and_sys()?;
    // After /proc/sys turned read-only: the bind lands on that copy of it, the only one.
    if let Some(tree) = boot_id {
        fs::attach_boot_id(tree, Path::new(BOOT_ID_FILE))?;
    }

    // A core limit of exactly 1 is the one value that also stops a host whose core pattern
    // is a pipe from running its helper (as host root) for a crashing sandbox process; below
    // a page, no core file is written either. Lowering it stays possible (see
    // docs/security.md).
    sys::set_rlimit(libc::RLIMIT_CORE, 1, 1).map_err(BootError::syscall("limit core size"))?;
    sys::detach_stdio().map_err(BootError::syscall("redirect standard input and output"))?;

    // SAFETY: the node passes an open, listening Unix socket as LISTENER_FD and nothing else in
    // this process owns that descriptor.
    let listener_fd = unsafe { OwnedFd::from_raw_fd(LISTENER_FD) };
    sys::set_cloexec(&listener_fd).map_err(BootError::syscall("mark listener close-on-exec"))?;
    let oom_events = sys::take_eventfd(OOM_EVENTS_FD);
    if let Some(fd) = &oom_events {
        sys::set_cloexec(fd).map_err(BootError::syscall("mark the oom eventfd close-on-exec"))?;
    }

    seccomp::install()?;
    caps::drop_to_sandbox_set()?;
    // Non-dumpable keeps sandbox root from reaching the agent's host-side files through
    // /proc/1 (its executable, its log descriptor): this process was created on the host, so
    // a non-dumpable /proc/1 belongs to host root, whom the sandbox's user namespace does not
    // map.
    sys::set_non_dumpable().map_err(BootError::syscall("prctl(PR_SET_DUMPABLE)"))?;

    Ok(Booted {
        listener: std::os::unix::net::UnixListener::from(listener_fd),
        config: spec.agent.clone(),
        oom_events,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_round_trips_through_json() {
        let spec = JailSpec {
            template_layers: vec!["/t/1".into(), "/t/0".into()],
            sandbox_dir: "/s".into(),
            hostname: "sbx".into(),
            id_map: IdMap {
                host_base: 1 << 30,
                size: 65536,
            },
            pty_max: 64,
            cgroup_join: vec!["/sys/fs/cgroup/pids/sandbar/x/tasks".into()],
            nameservers: vec!["10.0.0.1".into()],
            agent: AgentConfig {
                access_token: Some("tok".into()),
                default_user: "user".into(),
                env_vars: BTreeMap::from([("A".into(), "1".into())]),
                default_workdir: Some("/app".into()),
                memory_limit_mb: Some(512),
            },
            volumes: vec![VolumeBind {
                source: "/v/t/1".into(),
                target: "/data".into(),
            }],
            boot_id: Some("0f6c1a2e-3b4d-4e5f-8a9b-0c1d2e3f4a5b".into()),
            machine_id: Some("0f6c1a2e3b4d4e5f8a9b0c1d2e3f4a5b".into()),
        };
        let json = serde_json::to_string(&spec).expect("serialise");
        let back: JailSpec = serde_json::from_str(&json).expect("parse");
        assert_eq!(spec, back);
        check_ids(&spec).expect("well-formed ids");
        // Specs from before the ids existed still parse, with neither.
        let mut old: serde_json::Value = serde_json::from_str(&json).expect("parse");
        let fields = old.as_object_mut().expect("an object");
        fields.remove("boot_id");
        fields.remove("machine_id");
        let old: JailSpec = serde_json::from_value(old).expect("parse");
        assert_eq!((old.boot_id, old.machine_id), (None, None));
    }

    #[test]
    fn only_well_formed_ids_pass() {
        assert!(is_boot_id("0f6c1a2e-3b4d-4e5f-8a9b-0c1d2e3f4a5b"));
        for bad in [
            "",
            "0F6C1A2E-3B4D-4E5F-8A9B-0C1D2E3F4A5B",
            "0f6c1a2e-3b4d-4e5f-8a9b-0c1d2e3f4a5",
            "0f6c1a2e-3b4d-4e5f-8a9b-0c1d2e3f4a5b\n",
            "0f6c1a2e3b4d-4e5f-8a9b-0c1d-2e3f4a5b",
            "../../../../etc/passwd-aaaaaaaaaaaaaa",
        ] {
            assert!(!is_boot_id(bad), "{bad:?}");
        }
        assert!(is_machine_id("0f6c1a2e3b4d4e5f8a9b0c1d2e3f4a5b"));
        for bad in [
            "",
            "0f6c1a2e3b4d4e5f8a9b0c1d2e3f4a5",
            "0f6c1a2e-3b4d-4e5f-8a9b-0c1d2e3f4a5b",
            "0F6C1A2E3B4D4E5F8A9B0C1D2E3F4A5B",
            "0f6c1a2e3b4d4e5f8a9b0c1d2e3f4a5g",
        ] {
            assert!(!is_machine_id(bad), "{bad:?}");
        }
    }
}
