//! Pausing to disk and back: CRIU dumps of frozen sandboxes, their kept namespaces and the
//! restores.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sandbar_core::{HandlePhase, RuntimeError, RuntimeHandle};
use sandbar_jail::LISTENER_FD;

use super::criu_runs::{CriuDump, PLAN_DEADLINE, SPENT_PREFIX};
use super::handle::{is_alive, launched, without_processes};
use super::host::LinuxHost;
use super::host_ops::HostOps;
use super::{ns_inode, run_blocking, sandbox_err, sequence};

node_part! {
    /// Pauses sandboxes: freezes them, dumps them to disk as a checkpoint, or stops their
    /// processes keeping their files.
    pub(super) struct Pauser;
}

/// How long a pause waits for the agent to close its ends of connections from the host.
pub(super) const HOST_SOCKETS_PATIENCE: Duration = Duration::from_secs(2);

impl Pauser {
    /// Dumps the frozen sandbox `id` with CRIU, which ends its processes.
    pub(super) async fn dump(
        &self,
        id: &str,
        h: &RuntimeHandle,
    ) -> Result<crate::checkpoint::Header, RuntimeError> {
        let criu = self
            .node
            .criu
            .get()
            .ok_or_else(|| sandbox_err(id, "this node cannot checkpoint sandboxes"))?;
        if !is_alive(h) {
            return Err(sandbox_err(id, "the sandbox's processes are gone"));
        }
        if !self.node.cgroups.is_frozen(id) {
            return Err(sandbox_err(id, "the sandbox is not frozen"));
        }
        let freezer = self
            .node
            .cgroups
            .freezer_dir(id)
            .ok_or_else(|| sandbox_err(id, "the freezer controller is not mounted"))?;
        let netns = self
            .node
            .keep_netns(id, h.pid)
            .map_err(|e| sandbox_err(id, format!("cannot keep its network namespace: {e}")))?;
        let netns_inode =
            ns_inode(&netns).ok_or_else(|| sandbox_err(id, "its network namespace is gone"))?;
        let dir = self.node.places.checkpoint_dir(id);
        self.node.set_verified(&dir, false);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| sandbox_err(id, format!("create {}: {e}", dir.display())))?;
        let plan = match self
            .dump_into(id, h, &criu, &freezer, &dir, netns_inode, false)
            .await
        {
            Ok(plan) => plan,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let (version, digest) = (criu.version.clone(), self.node.agent_digest.clone());
        let sealing = std::time::Instant::now();
        let sealed_dir = dir.clone();
        let sealed = run_blocking(id, move || {
            crate::checkpoint::seal(&sealed_dir, version, digest, plan)
                .map_err(|e| format!("cannot write the checkpoint header: {e}"))
        })
        .await?;
        self.node.set_verified(&dir, true);
        tracing::debug!(sandbox_id = %id, seal_us = sealing.elapsed().as_micros() as u64, "checkpoint sealed");
        Ok(sealed)
    }

    /// Lists what frozen sandbox `id` holds and how CRIU is to dump it, from `/proc` alone,
    /// bounded in time; an object from outside the sandbox refuses the checkpoint.
    async fn plan_dump(
        &self,
        id: &str,
        h: &RuntimeHandle,
        netns_inode: u64,
    ) -> Result<crate::checkpoint::DumpPlan, RuntimeError> {
        let tasks = self.node.cgroups.members(id);
        let pid = h.pid;
        let volumes = h
            .volumes
            .iter()
            .map(|v| {
                crate::storage::volumes::volume_dir(
                    &self.node.config.data_dir,
                    &v.team_id,
                    &v.volume_id,
                )
                .map(|source| (PathBuf::from(&v.path), source))
                .map_err(|e| sandbox_err(id, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let placed = self
            .node
            .placed_files(id)
            .map_err(|e| sandbox_err(id, format!("cannot read the node's own files: {e}")))?;
        let kernel = self.node.kernel_filesystems.clone();
        let mut layer_dirs = vec![self.node.disks.path(id).join(sandbar_jail::layout::UPPER)];
        layer_dirs.extend(
            self.node
                .layers
                .stack(&h.layers)
                .map_err(|e| sandbox_err(id, e))?,
        );
        let layer_dirs = crate::checkpoint::LayerDirs(layer_dirs);
        let planning = tokio::task::spawn_blocking(move || {
            crate::checkpoint::plan_dump(
                &crate::checkpoint::HostProc,
                &crate::checkpoint::PlanInput {
                    pid,
                    tasks: &tasks,
                    netns_inode,
                    listener_fd: LISTENER_FD,
                    volumes: &volumes,
                    kernel: &kernel,
                    placed: &placed,
                    layers: &layer_dirs,
                },
            )
        });
        // The plan only reads /proc and never opens what the sandbox holds, so it does not
        // wait on the sandbox; bounded all the same, as every wait on a sandbox is.
        tokio::time::timeout(PLAN_DEADLINE, planning)
            .await
            .map_err(|_| {
                sandbox_err(
                    id,
                    format!(
                        "listing what it holds took over {} s; the checkpoint is abandoned",
                        PLAN_DEADLINE.as_secs()
                    ),
                )
            })?
            .map_err(|e| sandbox_err(id, e))?
            .map_err(|e| {
                if let crate::checkpoint::PlanError::Foreign { found, dev, .. } = &e {
                    tracing::info!(sandbox_id = %id, found, ?dev, "a checkpoint refused: the sandbox holds an object from outside it");
                }
                if e.is_refusal() {
                    RuntimeError::Uncheckpointable {
                        sandbox_id: id.to_owned(),
                        reason: e.to_string(),
                    }
                } else {
                    sandbox_err(id, e)
                }
            })
    }

    /// Runs `criu dump` of the frozen sandbox `id` (whose network namespace is
    /// `netns_inode`) into `images`, leaving its processes running or ending them; returns
    /// what the dump was told about the host.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn dump_into(
        &self,
        id: &str,
        h: &RuntimeHandle,
        criu: &crate::checkpoint::Criu,
        freezer: &Path,
        images: &Path,
        netns_inode: u64,
        leave_running: bool,
    ) -> Result<crate::checkpoint::DumpPlan, RuntimeError> {
        let plan = self.plan_dump(id, h, netns_inode).await?;
        crate::checkpoint::write_plan(images, &plan)
            .map_err(|e| sandbox_err(id, format!("cannot write {}: {e}", images.display())))?;
        LinuxHost(&self.node)
            .dump(
                id,
                &CriuDump {
                    init: h,
                    criu,
                    freezer,
                    images,
                    plan: &plan,
                    leave_running,
                },
            )
            .await?;
        Ok(plan)
    }
}

impl Pauser {
    /// What is left of sandbox `id` once a dump ended its processes: anything that escaped
    /// the dump, the memory its cgroup still holds, its memory grant and its agent socket.
    pub(super) async fn end_dumped(&self, id: &str) {
        sequence::end_dumped(&LinuxHost(&self.node), &self.node.holdings, id).await;
    }
}

impl Pauser {
    pub(super) async fn checkpoint_sandbox(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<RuntimeHandle, RuntimeError> {
        let h = launched(sandbox_id, handle)?;
        if h.phase == HandlePhase::Checkpointed {
            return Ok(handle.clone());
        }
        let started = std::time::Instant::now();
        sequence::dump_frozen(
            &LinuxHost(&self.node),
            sandbox_id,
            HOST_SOCKETS_PATIENCE,
            |e| sandbox_err(sandbox_id, e),
            || self.dump(sandbox_id, h),
        )
        .await?;
        let dumped_in = started.elapsed();
        sandbar_core::faults::crash_point("checkpoint.dumped");
        // CRIU ended the tree after the dump; anything that escaped it would run on.
        for _ in 0..250 {
            if !is_alive(h) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.end_dumped(sandbox_id).await;
        tracing::debug!(
            sandbox_id,
            dump_us = dumped_in.as_micros() as u64,
            release_us = (started.elapsed() - dumped_in).as_micros() as u64,
            "checkpoint timings"
        );
        Ok(without_processes(h, HandlePhase::Checkpointed))
    }
}

impl Pauser {
    pub(super) async fn pause(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(), RuntimeError> {
        let h = launched(sandbox_id, handle)?;
        if !is_alive(h) {
            return Err(sandbox_err(sandbox_id, "the sandbox is not running"));
        }
        sequence::settle_and_freeze(&LinuxHost(&self.node), sandbox_id, HOST_SOCKETS_PATIENCE)
            .await
            .map(drop)
            .map_err(|e| sandbox_err(sandbox_id, e))
    }

    pub(super) async fn resume(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(), RuntimeError> {
        let h = launched(sandbox_id, handle)?;
        if !is_alive(h) {
            return Err(sandbox_err(sandbox_id, "the sandbox's processes are gone"));
        }
        self.node
            .cgroups
            .thaw(sandbox_id)
            .map_err(|e| sandbox_err(sandbox_id, e))
    }

    pub(super) async fn release(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<RuntimeHandle, RuntimeError> {
        let h = launched(sandbox_id, handle)?;
        if h.phase == HandlePhase::Released {
            return Ok(handle.clone());
        }
        // Its disk and layers stay held: the kept writable layer only makes sense on top of
        // them.
        self.node.stop(sandbox_id, Some(h)).await?;
        // Namespaces kept by an earlier checkpoint would hold its old network alive.
        self.node.forget_checkpoint(sandbox_id);
        Ok(without_processes(h, HandlePhase::Released))
    }

    pub(super) async fn discard_checkpoint(&self, sandbox_id: &str) {
        let dir = self.node.places.checkpoint_dir(sandbox_id);
        self.node.set_verified(&dir, false);
        // Deleting the images of a large sandbox takes a while (a tenth of a second per GiB)
        // and nothing needs to wait for it: they are moved aside at once and removed behind.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let spent = dir.with_file_name(format!("{SPENT_PREFIX}{sandbox_id}-{nanos}"));
        match std::fs::rename(&dir, &spent) {
            Ok(()) => {
                tokio::task::spawn_blocking(move || crate::storage::disks::remove_tree(&spent));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => {
                let _ = crate::storage::disks::remove_tree(&dir);
            }
        }
    }
}
