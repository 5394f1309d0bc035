//! How CRIU runs on the host: the dump of a frozen sandbox, the flags its dumps and restores
//! share, the check that a checkpoint's CRIU is this node's, and the removal of what an
//! interrupted run left. The pause, snapshot and restore flows above decide when it runs.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use sandbar_core::{RuntimeError, RuntimeHandle};
use serde::{Deserialize, Serialize};

use super::sandbox_err;
use crate::resources::cgroups::CgroupDriver;

/// One CRIU dump of a frozen sandbox: its init, the CRIU that runs it, the sandbox's freezer,
/// where its images go and what its plan told CRIU about the host.
pub(super) struct CriuDump<'a> {
    pub(super) init: &'a RuntimeHandle,
    pub(super) criu: &'a crate::checkpoint::Criu,
    pub(super) freezer: &'a Path,
    pub(super) images: &'a Path,
    pub(super) plan: &'a crate::checkpoint::DumpPlan,
    /// A snapshot's dump leaves the processes running; a checkpoint's ends them.
    pub(super) leave_running: bool,
}

/// Runs `criu dump` of sandbox `id` by `dump.plan`, bounded by the time its memory takes
/// to write; a failure names what the sandbox still held from the host.
pub(super) async fn run_dump(
    cgroups: &CgroupDriver,
    id: &str,
    dump: &CriuDump<'_>,
) -> Result<(), RuntimeError> {
    let CriuDump {
        init: h,
        criu,
        freezer,
        images,
        plan,
        leave_running,
    } = *dump;
    let mut command = criu.command();
    command
        .arg("dump")
        .arg("--tree")
        .arg(h.pid.to_string())
        .arg("--images-dir")
        .arg(images)
        .arg("--log-file")
        .arg(crate::checkpoint::DUMP_LOG)
        .arg("-v2")
        .arg("--freeze-cgroup")
        .arg(freezer)
        .args(NO_NETWORK_LOCK)
        .arg(TCP_CLOSE)
        .args(&plan.args)
        // PID 1 is non-dumpable; the ownership check CRIU would run from inside its user
        // namespace cannot open its namespaces (patch 0001).
        .env("CRIU_SKIP_USERNS_CHECK", "1")
        // Nothing to a pipe: CRIU must be able to finish the dump if the server dies.
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if leave_running {
        command.arg("--leave-running");
    }
    let mut child = command
        .spawn()
        .map_err(|e| sandbox_err(id, format!("run {}: {e}", criu.path.display())))?;
    sandbar_core::faults::crash_point(if leave_running {
        "snapshot.dumping"
    } else {
        "checkpoint.dumping"
    });
    let deadline = dump_deadline(h.memory_mb);
    let status = match tokio::time::timeout(deadline, child.wait()).await {
        Ok(status) => {
            status.map_err(|e| sandbox_err(id, format!("wait for {}: {e}", criu.path.display())))?
        }
        Err(_) => {
            // CRIU lets go of the tasks it seized when it dies; they stay in their
            // frozen cgroup, paused in memory as before the dump.
            let _ = child.kill().await;
            return Err(sandbox_err(
                id,
                format!(
                    "the dump did not finish within {} s and was abandoned; the sandbox stays paused in memory",
                    deadline.as_secs()
                ),
            ));
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut errors = crate::checkpoint::log_errors(&images.join(crate::checkpoint::DUMP_LOG));
    let held = crate::checkpoint::host_unix_sockets(&cgroups.members(id));
    if !held.is_empty() {
        errors = format!(
            "{errors}; from the host: {}",
            crate::checkpoint::describe_host_sockets(&held)
        );
    }
    let what = if leave_running {
        "snapshot"
    } else {
        "checkpoint"
    };
    Err(sandbox_err(
        id,
        format!("{what} failed ({status}): {errors}"),
    ))
}

/// Established TCP connections are not kept: their sockets come back shut down, as after a
/// network outage, and the programs holding them see the connection end. Keeping them
/// (`--tcp-established`) would freeze their peers outside the sandbox for as long as it is
/// paused and fail when the peer has moved on; without either, a sandbox with any open
/// connection could not be checkpointed at all. Given at the dump and again at the restore.
pub(super) const TCP_CLOSE: &str = "--tcp-close";

/// How long a dump plan may take: it reads `/proc` only.
pub(super) const PLAN_DEADLINE: Duration = Duration::from_secs(20);

/// How long a dump of a sandbox with a memory limit of `memory_mb` may take before it is
/// abandoned: far longer than writing that much memory takes here.
pub(super) fn dump_deadline(memory_mb: u32) -> Duration {
    Duration::from_secs(30 + 30 * u64::from(memory_mb).div_ceil(1024))
}

/// Runs `criu restore` to its end, or kills it (and so lets go of the tasks it holds) once
/// `deadline` has passed.
pub(super) async fn run_criu(
    command: &mut tokio::process::Command,
    deadline: Duration,
) -> std::io::Result<std::process::ExitStatus> {
    let mut child = command.spawn()?;
    sandbar_core::faults::crash_point("restore.restoring");
    match tokio::time::timeout(deadline, child.wait()).await {
        Ok(status) => status,
        Err(_) => {
            let _ = child.kill().await;
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("criu did not finish within {} s", deadline.as_secs()),
            ))
        }
    }
}

/// What a snapshot's checkpoint directory holds besides the images: what a restore into
/// another sandbox must change.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct SnapshotOrigin {
    /// Host id of the snapshotted sandbox's root: its user namespace image names that range.
    pub(super) id_base: u32,
    /// The token its agent held, which the restored agent answers to until it is given its
    /// own.
    pub(super) access_token: String,
    /// Its agent log, which the checkpoint's agent holds open.
    pub(super) log: PathBuf,
}

pub(super) const SNAPSHOT_ORIGIN: &str = "origin.json";

/// CRIU would otherwise lock the sandbox's network namespace with `iptables-restore` around
/// a dump and a restore (two processes each time, about 50 ms of a restore; the restore
/// follows what the dump recorded). The lock keeps established TCP connections from being
/// reset meanwhile; a sandbox's are not kept anyway ([`TCP_CLOSE`]), and nothing routes to
/// it while it is dumped or restored.
pub(super) const NO_NETWORK_LOCK: [&str; 2] = ["--network-lock", "skip"];

/// Names a checkpoint directory gets when it is spent and is being removed.
pub(super) const SPENT_PREFIX: &str = ".spent-";

/// Removes spent checkpoints whose removal a stopped server did not finish.
pub(super) fn remove_spent_checkpoints(checkpoints: &Path) {
    let Ok(entries) = std::fs::read_dir(checkpoints) else {
        return;
    };
    for entry in entries.flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(SPENT_PREFIX)
        {
            let _ = crate::storage::disks::remove_tree(&entry.path());
        }
    }
}

/// How long a restart waits for a dump or restore the previous server left running: far
/// longer than one of a sandbox of the largest size takes.
pub(super) const ORPHANED_CRIU_WAIT: Duration = Duration::from_secs(120);

pub(super) fn check_criu_version(
    id: &str,
    criu: &crate::checkpoint::Criu,
    header: &crate::checkpoint::Header,
) -> Result<(), RuntimeError> {
    if header.criu_version != criu.version {
        return Err(sandbox_err(
            id,
            format!(
                "the checkpoint was made by CRIU {}, this node has {}",
                header.criu_version, criu.version
            ),
        ));
    }
    Ok(())
}
