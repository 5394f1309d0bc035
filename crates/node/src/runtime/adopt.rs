//! Taking sandboxes over: those a restarted server finds still running, paused to disk or
//! released, and those carried from another node.

use std::collections::BTreeSet;

use sandbar_core::{AdoptedCheckpoint, Endpoint, HandlePhase, RuntimeError, RuntimeHandle};

use super::criu_runs::SnapshotOrigin;
use super::handle::{is_alive, launched, start_ticks, without_processes};
use super::launch::Launcher;
use super::pausing::Pauser;
use super::{is_nsfs, run_blocking, sandbox_err};

node_part! {
    /// Adopts sandboxes this process did not start: those a restarted server finds, and those
    /// taken over from another node.
    pub(super) struct Adopter;
}

impl Adopter {
    pub(super) async fn adopt_checkpointed_sandbox(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<AdoptedCheckpoint, RuntimeError> {
        let h = launched(sandbox_id, handle)?;
        let dir = self.node.places.checkpoint_dir(sandbox_id);
        if h.phase == HandlePhase::Checkpointed {
            // The server may have died during a restore (CRIU was waited for at start): its
            // host-side mounts are left over, and the restore finished or not.
            self.node.unmount_restore(sandbox_id, h.layers.len());
            if let Some(restored) = self.finished_restore(sandbox_id, h) {
                return Ok(restored);
            }
            if let Err(e) = self.node.cgroups.kill_all(sandbox_id).await {
                return Err(sandbox_err(
                    sandbox_id,
                    format!("cannot end what an unfinished restore started: {e}"),
                ));
            }
            crate::checkpoint::clear_restore(&dir);
            let _ = std::fs::remove_file(self.node.places.socket_path(sandbox_id));
        } else {
            if is_alive(h) {
                return Err(sandbox_err(sandbox_id, "its processes still run"));
            }
            // The dump ended the processes: if the server died before sealing it, it is
            // sealed now, and what `checkpoint` does after a dump is done here.
            if !dir.join(crate::checkpoint::HEADER_FILE).exists() {
                let criu = self
                    .node
                    .criu
                    .get_or_probe()
                    .await
                    .ok_or_else(|| sandbox_err(sandbox_id, "this node cannot checkpoint"))?;
                let (version, digest) = (criu.version.clone(), self.node.agent_digest.clone());
                let sealed_dir = dir.clone();
                run_blocking(sandbox_id, move || {
                    crate::checkpoint::seal_finished_dump(&sealed_dir, version, digest)
                })
                .await?;
                tracing::info!(
                    sandbox_id,
                    "sealed a checkpoint whose dump outlived the server"
                );
            }
            Pauser::of(&self.node).end_dumped(sandbox_id).await;
        }
        let header_dir = dir.clone();
        run_blocking(sandbox_id, move || {
            crate::checkpoint::read_header(&header_dir, false)
        })
        .await?;
        for kind in ["net", "user"] {
            let kept = self.node.places.kept_ns(sandbox_id, kind);
            if !is_nsfs(&kept) {
                return Err(sandbox_err(
                    sandbox_id,
                    format!("its kept namespace {} is gone", kept.display()),
                ));
            }
        }
        self.node
            .adopt_holdings(sandbox_id, h, HandlePhase::Checkpointed);
        Ok(AdoptedCheckpoint::Checkpointed(without_processes(
            h,
            HandlePhase::Checkpointed,
        )))
    }

    /// The checkpointed sandbox `id` (handle `h`) running, if a restore the server died
    /// during ran to its end: CRIU wrote its statistics, and the PID 1 it wrote lives in the
    /// sandbox's cgroup.
    pub(super) fn finished_restore(
        &self,
        id: &str,
        h: &RuntimeHandle,
    ) -> Option<AdoptedCheckpoint> {
        let pid = crate::checkpoint::finished_restore(&self.node.places.checkpoint_dir(id))?;
        if !self.node.cgroups.members(id).contains(&pid) {
            return None;
        }
        let running = RuntimeHandle {
            pid,
            start_ticks: start_ticks(pid)?,
            phase: HandlePhase::Running,
            ..h.clone()
        };
        let endpoint = self.node.endpoint(id, h.slot).ok()?;
        self.node.adopt_holdings(id, h, HandlePhase::Running);
        tracing::info!(sandbox_id = %id, pid, "a restore finished while the server was down");
        Some(AdoptedCheckpoint::Restored(running, endpoint))
    }

    pub(super) async fn sweep(&self, recorded: &[String]) -> Result<usize, RuntimeError> {
        let mut removed = 0;
        let mut found: BTreeSet<String> = self.node.disks.list().into_iter().collect();
        found.extend(self.node.cgroups.names());
        for id in found {
            if recorded.contains(&id) {
                continue;
            }
            self.node.teardown(&id, None).await?;
            removed += 1;
        }
        Ok(removed)
    }

    pub(super) async fn share_files(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<Option<sandbar_core::LayerBlob>, RuntimeError> {
        let Some(shared) = self.node.shared_layers.get() else {
            return Ok(None);
        };
        let h = launched(sandbox_id, handle)?;
        let upper = self
            .node
            .disks
            .path(sandbox_id)
            .join(sandbar_jail::layout::UPPER);
        shared
            .share_sandbox_files(sandbox_id, &upper, h.id_base.unwrap_or(0))
            .await
            .map(Some)
            .map_err(|e| sandbox_err(sandbox_id, e))
    }

    pub(super) async fn share_checkpoint(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<Option<sandbar_core::LayerBlob>, RuntimeError> {
        let Some(shared) = self.node.shared_layers.get() else {
            return Ok(None);
        };
        let h = launched(sandbox_id, handle)?;
        if h.phase != HandlePhase::Checkpointed {
            return Ok(None);
        }
        let images = self.node.places.checkpoint_dir(sandbox_id);
        let origin = SnapshotOrigin {
            id_base: h.id_base.unwrap_or(0),
            // The processes keep their token: a restore elsewhere hands over nothing.
            access_token: String::new(),
            log: self.node.places.log_path(sandbox_id),
        };
        serde_json::to_vec(&origin)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(images.join(crate::checkpoint::CARRY_ORIGIN), bytes))
            .map_err(|e| sandbox_err(sandbox_id, format!("cannot describe its checkpoint: {e}")))?;
        shared
            .share_sandbox_checkpoint(sandbox_id, &images)
            .await
            .map(Some)
            .map_err(|e| sandbox_err(sandbox_id, e))
    }

    pub(super) async fn take_over_files(
        &self,
        sandbox: &sandbar_core::Sandbox,
        files: &sandbar_core::LayerBlob,
        checkpoint: Option<&sandbar_core::LayerBlob>,
    ) -> Result<sandbar_core::TakenOver, RuntimeError> {
        let id = sandbox.id.as_str();
        let Some(shared) = self.node.shared_layers.get() else {
            return Err(sandbox_err(id, "this node has no layer store"));
        };
        // What an earlier attempt left; the sandbox is not this node's yet.
        self.node.disks.remove(id).map_err(|e| sandbox_err(id, e))?;
        let _ = crate::storage::disks::remove_tree(&self.node.places.carried_checkpoint_dir(id));
        let mut opening = self.node.holdings.opening(id);
        opening.hold_disk(self.node.admit_disk(id, sandbox.disk_size_mb).await?);
        let laid_out = async {
            let dir = self
                .node
                .disks
                .create(id, sandbox.disk_size_mb, 0)
                .map_err(|e| sandbox_err(id, e))?;
            shared
                .fetch_sandbox_files(files, &dir.join(sandbar_jail::layout::UPPER))
                .await
                .map_err(|e| sandbox_err(id, e))
        }
        .await;
        if let Err(err) = laid_out {
            let _ = self.node.disks.remove(id);
            return Err(err);
        }
        let carried = match checkpoint {
            None => None,
            Some(blob) => match Launcher::of(&self.node).carry_checkpoint(id, blob).await {
                Ok(carried) => Some(carried),
                Err(e) => {
                    tracing::warn!(sandbox_id = %id, error = %e, "the lost node's checkpoint cannot be restored here; the sandbox will boot afresh on its files");
                    let _ = crate::storage::disks::remove_tree(
                        &self.node.places.carried_checkpoint_dir(id),
                    );
                    None
                }
            },
        };
        let origin = launched(id, &sandbox.handle).ok();
        let handle = RuntimeHandle {
            // The files carry the ids they have inside the sandbox: a boot on them moves
            // them to the range of the slot it gets.
            id_base: Some(0),
            memory_mb: sandbox.memory_mb,
            layers: sandbox
                .image
                .as_ref()
                .map(|image| image.layers.clone())
                .unwrap_or_default(),
            phase: HandlePhase::Released,
            // A restored sandbox goes on with the boot it had.
            boot_id: carried.as_ref().and(origin.and_then(|h| h.boot_id.clone())),
            carried,
            ..RuntimeHandle::unstarted(0)
        };
        opening.use_layers(handle.layers.clone());
        opening.commit();
        Ok(sandbar_core::TakenOver {
            with_memory: handle.carried.is_some(),
            handle,
        })
    }

    pub(super) async fn adopt_released(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(), RuntimeError> {
        let h = launched(sandbox_id, handle)?;
        let upper = self
            .node
            .disks
            .path(sandbox_id)
            .join(sandbar_jail::layout::UPPER);
        if h.phase != HandlePhase::Released || !upper.is_dir() {
            return Err(sandbox_err(
                sandbox_id,
                format!("no kept files at {}", upper.display()),
            ));
        }
        self.node
            .adopt_holdings(sandbox_id, h, HandlePhase::Released);
        Ok(())
    }

    pub(super) async fn adopt(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<Option<Endpoint>, RuntimeError> {
        let handle = launched(sandbox_id, handle)?;
        if !is_alive(handle) {
            return Ok(None);
        }
        // A checkpoint it was restored from, if the server died before discarding it.
        let _ = crate::storage::disks::remove_tree(&self.node.places.checkpoint_dir(sandbox_id));
        self.node
            .adopt_holdings(sandbox_id, handle, HandlePhase::Running);
        Ok(Some(self.node.endpoint(sandbox_id, handle.slot)?))
    }
}
