//! Booting a sandbox: its cgroups, disk, network namespace and jailed agent, the template's
//! start and ready commands, and its egress rules.

use sandbar_core::{CarriedCheckpoint, Endpoint, LaunchSpec, RuntimeError, RuntimeHandle};

use crate::net::netns::PreparedNetns;

use super::handle::launched;
use super::holdings::{Opening, SlotHold};
use super::host::LinuxHost;
use super::layers::LayerKeeper;
use super::layers::is_snapshot_key;
use super::warm::WarmSandbox;
use super::warm_boot::WarmKeeper;
use super::{SANDBOX_IDS, run_blocking, sandbox_err, sequence};

node_part! {
    /// Launches sandboxes: fresh, on kept files, from a snapshot or a checkpoint carried
    /// here, and the agent and start commands of each.
    pub(super) struct Launcher;
}

impl Launcher {
    pub(super) async fn launch_in(
        &self,
        spec: &LaunchSpec,
        netns: PreparedNetns,
        kept: Option<&RuntimeHandle>,
    ) -> Result<(RuntimeHandle, Endpoint), sequence::BootFailure> {
        let id_map = self.node.id_map(netns.slot);
        sequence::boot(
            &LinuxHost(&self.node),
            spec,
            netns,
            id_map,
            self.node.limits_of(spec),
            kept,
        )
        .await
    }
}

impl Launcher {
    /// Whether a template's capture can be restored here: without CRIU or with its
    /// checkpoint gone, the sandbox boots on the same layers and runs the start command.
    fn can_restore_capture(&self, checkpoint: &str) -> bool {
        let usable = self.node.criu.get().is_some()
            && checkpoint
                .strip_prefix("checkpoint/")
                .filter(|key| is_snapshot_key(key))
                .is_some_and(|key| self.node.places.snapshots_dir().join(key).is_dir())
            && !self
                .node
                .unrestorable_captures
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(checkpoint);
        if !usable {
            tracing::warn!(
                checkpoint,
                "the template's capture cannot be restored; booting and running its start command"
            );
        }
        usable
    }

    pub(super) async fn launch_sandbox(
        &self,
        spec: LaunchSpec,
    ) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        self.launch_sandbox_from(spec, true).await
    }

    /// Launches sandbox `spec`, from a warm sandbox if `may_take_warm` and one waits.
    async fn launch_sandbox_from(
        &self,
        spec: LaunchSpec,
        may_take_warm: bool,
    ) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        let id = spec.sandbox_id.clone();
        let kept = spec.kept.as_ref().map(|k| launched(&id, k)).transpose()?;
        LayerKeeper::of(&self.node)
            .fetch_missing_layers(&spec.template.id, &spec.image.parts())
            .await?;
        let _creating = self
            .node
            .warm
            .creating(|booting| self.node.cgroups.request_freeze(booting).is_ok());
        let mut opening = self.open_holdings(&spec, kept.is_none()).await?;
        if let Some(warm) = self.take_warm_sandbox(&spec, may_take_warm) {
            return match self.launch_on_warm(&spec, &warm, opening).await? {
                Some(launched) => Ok(launched),
                None => Box::pin(self.launch_sandbox_from(spec, false)).await,
            };
        }
        let netns = self.claim_netns(&id, spec.allow_internet_access).await?;
        let slot = netns.slot;
        opening.hold_slot(SlotHold::taken(&self.node.slots, slot));
        opening.use_layers(spec.image.layers.clone());
        let checkpoint = self.restorable_checkpoint(&spec);
        let carried = self.carried_checkpoint(&id, kept);
        let launched = self
            .boot_in(&spec, netns, checkpoint, kept, carried.as_ref())
            .await;
        let failure = match launched {
            Ok((handle, endpoint)) => {
                opening.commit();
                return Ok((handle, endpoint));
            }
            Err(failure) => failure,
        };
        // A sandbox booted on kept files keeps them (and the layers under them, which the
        // opening gives back) for another try.
        let err = sequence::undo_failed_boot(
            &LinuxHost(&self.node),
            &self.node.holdings,
            &self.node.slots,
            opening,
            slot,
            failure,
            kept.is_some(),
        )
        .await;
        let relaunch = self
            .relaunch_after_failed_restore(&spec, checkpoint, kept, carried.is_some(), slot, &err)
            .await?;
        if relaunch {
            return Box::pin(self.launch_sandbox_from(spec, may_take_warm)).await;
        }
        Err(err)
    }

    /// Opens the holdings of sandbox `spec` with its memory and, if `with_disk`, its disk.
    async fn open_holdings(
        &self,
        spec: &LaunchSpec,
        with_disk: bool,
    ) -> Result<Opening<'_>, RuntimeError> {
        let id = &spec.sandbox_id;
        let mut opening = self.node.holdings.opening(id);
        opening.hold_memory(self.node.grant_memory(id, spec.memory_mb)?);
        if with_disk {
            opening.hold_disk(self.node.admit_disk(id, spec.disk_size_mb).await?);
        }
        Ok(opening)
    }

    fn take_warm_sandbox(&self, spec: &LaunchSpec, may_take_warm: bool) -> Option<WarmSandbox> {
        crate::runtime::warm::WarmKey::of(spec)
            .filter(|_| may_take_warm)
            .and_then(|key| self.node.warm.take(&key, spec.cpu_count))
    }

    /// Launches sandbox `spec` on the `warm` sandbox taken for it; `None` when the sandbox is
    /// to boot afresh instead, the failed take having given back all it held.
    async fn launch_on_warm(
        &self,
        spec: &LaunchSpec,
        warm: &WarmSandbox,
        mut opening: Opening<'_>,
    ) -> Result<Option<(RuntimeHandle, Endpoint)>, RuntimeError> {
        let id = &spec.sandbox_id;
        match WarmKeeper::of(&self.node)
            .take_warm(spec, warm, &mut opening)
            .await
        {
            Ok((handle, endpoint)) => {
                opening.commit();
                Ok(Some((handle, endpoint)))
            }
            // The template's own start or ready command failed: a fresh boot would only
            // fail the same way, as late again.
            Err(err @ RuntimeError::NotReady { .. }) => Err(err),
            Err(err) => {
                tracing::warn!(
                    sandbox_id = %id,
                    warm = %warm.name,
                    error = %err,
                    "cannot take a warm sandbox"
                );
                Ok(None)
            }
        }
    }

    async fn claim_netns(
        &self,
        id: &str,
        allow_internet_access: bool,
    ) -> Result<PreparedNetns, RuntimeError> {
        match self.node.netns_pool.claim(allow_internet_access).await {
            Some(Ok(netns)) => Ok(netns),
            Some(Err(err)) => Err(sandbox_err(id, err)),
            None => Err(RuntimeError::NoCapacity {
                sandbox_id: id.to_owned(),
                message: "no free network slot on this node".into(),
            }),
        }
    }

    /// The checkpoint sandbox `spec` is restored from, leaving out a template's capture this
    /// node cannot restore.
    fn restorable_checkpoint<'s>(&self, spec: &'s LaunchSpec) -> Option<&'s str> {
        spec.image
            .snapshot
            .as_ref()
            .and_then(|s| s.checkpoint.as_deref())
            .filter(|checkpoint| !spec.image.is_capture() || self.can_restore_capture(checkpoint))
    }

    /// A checkpoint carried from a lost node, while it is still here to restore.
    fn carried_checkpoint(
        &self,
        id: &str,
        kept: Option<&RuntimeHandle>,
    ) -> Option<CarriedCheckpoint> {
        kept.and_then(|k| k.carried.clone()).filter(|_| {
            self.node
                .places
                .carried_checkpoint_dir(id)
                .join(crate::checkpoint::HEADER_FILE)
                .is_file()
        })
    }

    /// Boots sandbox `spec` in `netns`: restored from its `checkpoint` when it has no kept
    /// files, from the `carried` checkpoint on its `kept` files, or else afresh.
    async fn boot_in(
        &self,
        spec: &LaunchSpec,
        netns: PreparedNetns,
        checkpoint: Option<&str>,
        kept: Option<&RuntimeHandle>,
        carried: Option<&CarriedCheckpoint>,
    ) -> Result<(RuntimeHandle, Endpoint), sequence::BootFailure> {
        match (checkpoint, kept, carried) {
            (Some(checkpoint), None, _) => self.launch_restored(spec, netns, checkpoint).await,
            (_, Some(kept), Some(carried)) => self.launch_carried(spec, netns, kept, carried).await,
            _ => self.launch_in(spec, netns, kept).await,
        }
    }

    /// Whether sandbox `spec`, whose restore failed with `err`, is to be launched again
    /// without the restore, which would only fail the same way.
    async fn relaunch_after_failed_restore(
        &self,
        spec: &LaunchSpec,
        checkpoint: Option<&str>,
        kept: Option<&RuntimeHandle>,
        carried: bool,
        slot: u32,
        err: &RuntimeError,
    ) -> Result<bool, RuntimeError> {
        let id = &spec.sandbox_id;
        if let (Some(checkpoint), None) = (checkpoint, kept)
            && spec.image.is_capture()
        {
            // A capture only saves the start command's time: the sandbox boots and
            // runs it instead, now and from now on.
            tracing::warn!(sandbox_id = %id, checkpoint, error = %err, "cannot restore the template's capture; booting and running its start command");
            self.node
                .unrestorable_captures
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(checkpoint.to_owned());
            return Ok(true);
        }
        if let (Some(kept), true) = (kept, carried) {
            // The files outlived the restore; its processes start afresh on them.
            tracing::warn!(sandbox_id = %id, error = %err, "cannot restore the checkpoint carried from a lost node; booting afresh on its files");
            self.node.forget_checkpoint(id);
            self.give_kept_files_back(id, slot, kept).await?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Moves the kept files of sandbox `id` back to the ids of its kept handle, from those
    /// of `slot`, where a boot that failed had moved them.
    async fn give_kept_files_back(
        &self,
        id: &str,
        slot: u32,
        kept: &RuntimeHandle,
    ) -> Result<(), RuntimeError> {
        let upper = self.node.disks.path(id).join(sandbar_jail::layout::UPPER);
        let (from, to) = (self.node.id_map(slot).host_base, kept.id_base.unwrap_or(0));
        run_blocking(id, move || {
            crate::storage::layers::move_owners(&upper, from, to, SANDBOX_IDS)
                .map_err(|e| format!("cannot give its kept files their ids back: {e}"))
        })
        .await
    }
}
