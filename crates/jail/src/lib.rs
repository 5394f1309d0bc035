//! The boot contract between a node and the agent it starts as a sandbox's PID 1.
//!
//! The node starts the agent binary with the argument `boot`, a serialised [`JailSpec`] on its
//! standard input and the agent's listening socket as file descriptor [`LISTENER_FD`]. The
//! agent, still single-threaded, calls [`boot`]: it joins the sandbox's cgroups, enters fresh
//! namespaces, forks the sandbox's PID 1 (whose host PID the original process prints on
//! standard output before it exits), builds the root filesystem and drops privileges. Only the
//! PID 1 process returns from [`boot`], with what the agent needs to serve.

mod caps;
mod fs;
mod seccomp;
mod sys;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The envd protocol version the agent implements; the SDKs enable features by it. 0.5.7
/// turns on `close_stdin` and octet-stream and gzip uploads, all implemented; the next gate
/// (file metadata as xattrs, 0.6.2) is not.
pub const ENVD_VERSION: &str = "0.5.7";

/// Descriptor on which the node hands the agent its already-listening Unix socket.
pub const LISTENER_FD: i32 = 3;

/// What the agent needs to know to serve a sandbox, independent of how it was isolated.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct AgentConfig {
    /// Token every envd call must carry in `X-Access-Token`; `None` disables the check.
    pub access_token: Option<String>,
    /// Linux user for calls that name none.
    pub default_user: String,
    /// Environment given to every process the agent starts (the sandbox's `envVars`).
    pub env_vars: BTreeMap<String, String>,
}

/// Everything the node decides about a sandbox's isolation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct JailSpec {
    /// Read-only template root filesystem, the overlay's lower layer.
    pub lower_dir: PathBuf,
    /// The sandbox's own writable layer.
    pub upper_dir: PathBuf,
    /// Overlay work directory, on the same filesystem as `upper_dir`.
    pub work_dir: PathBuf,
    /// Empty directory the overlay is mounted on (inside the sandbox's mount namespace only).
    pub root_dir: PathBuf,
    pub hostname: String,
    /// Files the booting process writes `0` (itself) into to join the sandbox's cgroups,
    /// before it unshares its cgroup namespace.
    pub cgroup_join: Vec<PathBuf>,
    /// Name servers written to the sandbox's `/etc/resolv.conf`.
    pub nameservers: Vec<String>,
    pub agent: AgentConfig,
}

/// What [`boot`] hands to the agent inside the finished sandbox.
#[derive(Debug)]
pub struct Booted {
    pub listener: std::os::unix::net::UnixListener,
    pub config: AgentConfig,
}

/// Failures while building a sandbox; each names the step and the path involved.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot read the jail spec from standard input: {0}")]
    ReadSpec(#[source] std::io::Error),
    #[error("invalid jail spec: {0}")]
    ParseSpec(#[source] serde_json::Error),
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

/// Builds the sandbox and returns inside it as its PID 1. See the crate documentation.
///
/// Must be called before any thread is started: it forks.
pub fn boot() -> Result<Booted, BootError> {
    let mut raw = String::new();
    std::io::stdin()
        .read_to_string(&mut raw)
        .map_err(BootError::ReadSpec)?;
    let spec: JailSpec = serde_json::from_str(&raw).map_err(BootError::ParseSpec)?;

    for file in &spec.cgroup_join {
        std::fs::write(file, "0").map_err(|source| BootError::JoinCgroup {
            path: file.clone(),
            source,
        })?;
    }
    sys::unshare(
        libc::CLONE_NEWNS
            | libc::CLONE_NEWUTS
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWNET
            | libc::CLONE_NEWCGROUP
            | libc::CLONE_NEWPID,
    )
    .map_err(BootError::syscall("unshare"))?;

    // The first child in the new PID namespace becomes its init. The parent only reports the
    // child's host PID and leaves, so the sandbox is no descendant of the node's process tree
    // once the node reaps it: a restarted node finds the sandbox alive.
    match sys::fork().map_err(BootError::syscall("fork"))? {
        sys::Fork::Parent(child) => {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{child}");
            let _ = out.flush();
            std::process::exit(0);
        }
        sys::Fork::Child => {}
    }

    let result = enter(&spec);
    if let Err(err) = &result {
        let _ = writeln!(std::io::stderr(), "sandbox boot failed: {err}");
    }
    result
}

fn enter(spec: &JailSpec) -> Result<Booted, BootError> {
    sys::set_hostname(&spec.hostname).map_err(BootError::syscall("sethostname"))?;
    fs::build_root(spec)?;
    fs::pivot_into(&spec.root_dir)?;
    fs::harden_proc()?;

    // The agent must survive its sandbox running out of memory, or every process dies with it.
    let _ = std::fs::write("/proc/self/oom_score_adj", "-1000");
    sys::detach_stdio().map_err(BootError::syscall("redirect standard input and output"))?;

    // SAFETY: the node passes an open, listening Unix socket as LISTENER_FD and nothing else in
    // this process owns that descriptor.
    let listener_fd = unsafe { OwnedFd::from_raw_fd(LISTENER_FD) };
    sys::set_cloexec(&listener_fd).map_err(BootError::syscall("mark listener close-on-exec"))?;

    seccomp::install()?;
    caps::drop_to_sandbox_set()?;
    // Non-dumpable keeps sandbox root from reaching the agent's host-side files through
    // /proc/1 (its executable, its log descriptor).
    sys::set_non_dumpable().map_err(BootError::syscall("prctl(PR_SET_DUMPABLE)"))?;

    Ok(Booted {
        listener: std::os::unix::net::UnixListener::from(listener_fd),
        config: spec.agent.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_round_trips_through_json() {
        let spec = JailSpec {
            lower_dir: "/t".into(),
            upper_dir: "/u".into(),
            work_dir: "/w".into(),
            root_dir: "/r".into(),
            hostname: "sbx".into(),
            cgroup_join: vec!["/sys/fs/cgroup/pids/sandbar/x/tasks".into()],
            nameservers: vec!["10.0.0.1".into()],
            agent: AgentConfig {
                access_token: Some("tok".into()),
                default_user: "user".into(),
                env_vars: BTreeMap::from([("A".into(), "1".into())]),
            },
        };
        let json = serde_json::to_string(&spec).expect("serialise");
        let back: JailSpec = serde_json::from_str(&json).expect("parse");
        assert_eq!(spec, back);
    }
}
