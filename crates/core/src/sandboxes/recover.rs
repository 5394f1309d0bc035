//! After a restart: taking back every recorded sandbox in the status the store gives it,
//! finishing what the server died in the middle of, and cleaning up what cannot be kept.

use std::sync::Arc;

use super::shared::Shared;
use super::{Live, TransitionError};
use crate::builds::LogLevel;
use crate::lifecycle::SandboxStatus;
use crate::model::Sandbox;
use crate::runtime::{AdoptedCheckpoint, Endpoint, RuntimeError, RuntimeHandle};
use crate::store::StoreError;

/// Takes sandboxes back: after a restart, those this node recorded; in a cluster, the paused
/// ones of a lost node, from the copies of their files it shared.
#[derive(Clone, Debug)]
pub struct Recovery {
    pub(super) shared: Arc<Shared>,
}

impl Recovery {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// After a restart: takes back every recorded sandbox that still runs, and cleans up the
    /// rest. Expired ones are left for the reaper so their end is logged like any other.
    pub async fn recover(&self) -> Result<usize, StoreError> {
        let mut adopted = 0;
        // Other nodes of a cluster record theirs in the same store; rows without a node are
        // from before nodes had names and belong to whoever runs on their data.
        let mut recorded = self.shared.store.sandboxes.all_sandboxes().await?;
        recorded.retain(|s| s.node_id == self.shared.config.node_id || s.node_id.is_empty());
        let ids: Vec<String> = recorded.iter().map(|s| s.id.clone()).collect();
        match self.shared.runtime.sweep(&ids).await {
            Ok(0) => {}
            Ok(n) => tracing::warn!(count = n, "removed unrecorded sandboxes"),
            Err(err) => tracing::error!(error = %err, "cannot sweep unrecorded sandboxes"),
        }
        for mut sandbox in recorded {
            if sandbox.status == SandboxStatus::Pausing {
                // The server died while ending its processes to keep its files: finish that.
                match self
                    .shared
                    .release_recorded(&sandbox.id, &sandbox.handle, sandbox.status)
                    .await
                {
                    Ok(released) => {
                        self.recover_to(&sandbox, SandboxStatus::Shelved, Some(&released))
                            .await?;
                        sandbox.handle = released;
                        sandbox.status = SandboxStatus::Shelved;
                    }
                    Err(err) => {
                        tracing::error!(sandbox_id = %sandbox.id, error = %err, "cannot finish a pause without memory");
                    }
                }
            }
            if matches!(
                sandbox.status,
                SandboxStatus::Shelved | SandboxStatus::Pausing
            ) {
                self.adopt_shelved(&sandbox).await?;
                continue;
            }
            if sandbox.status == SandboxStatus::Checkpointing
                && self.shared.runtime.is_alive(&sandbox.id, &sandbox.handle)
            {
                // The server died during the dump, before it ended the processes: what the
                // dump wrote is incomplete, and the sandbox is still frozen in memory.
                self.shared.runtime.discard_checkpoint(&sandbox.id).await;
                self.recover_to(&sandbox, SandboxStatus::Paused, None)
                    .await?;
                sandbox.status = SandboxStatus::Paused;
            }
            if matches!(
                sandbox.status,
                SandboxStatus::Checkpointed | SandboxStatus::Checkpointing
            ) {
                self.adopt_checkpointed(&sandbox).await?;
                continue;
            }
            match self
                .shared
                .runtime
                .adopt(&sandbox.id, &sandbox.handle)
                .await
            {
                Ok(Some(endpoint)) => {
                    if self
                        .take_back(&sandbox, endpoint, "sandbox adopted after a server restart")
                        .await?
                    {
                        adopted += 1;
                    }
                }
                Ok(None) => {
                    tracing::warn!(sandbox_id = %sandbox.id, "sandbox died while the server was down");
                    self.open_log(&sandbox).await;
                    self.shared
                        .activity
                        .ingest_agent_log(self.shared.runtime.as_ref(), &sandbox.id)
                        .await;
                    self.remove(&sandbox, "cannot clean up dead sandbox")
                        .await?;
                    self.close_log_lost(&sandbox, "sandbox died while the server was down")
                        .await;
                }
                Err(err) => {
                    // Not routed to until a restart adopts it, as before it was recovered.
                    self.shared.live().remove(&sandbox.id);
                    tracing::error!(sandbox_id = %sandbox.id, error = %err, "cannot adopt sandbox");
                }
            }
        }
        Ok(adopted)
    }

    /// After a restart: takes back a checkpointed sandbox (or one whose checkpoint the server
    /// died right after), without processes; one whose checkpoint is incomplete or cannot be
    /// restored any more is lost, and cleaned up.
    async fn adopt_checkpointed(&self, sandbox: &Sandbox) -> Result<(), StoreError> {
        let handle = match self
            .shared
            .runtime
            .adopt_checkpointed(&sandbox.id, &sandbox.handle)
            .await
        {
            Ok(AdoptedCheckpoint::Checkpointed(handle)) => handle,
            Ok(AdoptedCheckpoint::Restored(handle, endpoint)) => {
                return self.adopt_restored(sandbox, handle, endpoint).await;
            }
            Err(err) => {
                // The memory is lost (a host reboot ends the namespaces a checkpoint is
                // restored into), the files need not be: the sandbox stays paused with them
                // and boots afresh on them when resumed.
                match self
                    .shared
                    .runtime
                    .release(&sandbox.id, &sandbox.handle)
                    .await
                {
                    Ok(released) => {
                        tracing::warn!(sandbox_id = %sandbox.id, error = %err, "checkpointed sandbox cannot be restored; its files are kept");
                        self.recover_to(sandbox, SandboxStatus::Shelved, Some(&released))
                            .await?;
                        let shelved = Sandbox {
                            handle: released,
                            status: SandboxStatus::Shelved,
                            ..sandbox.clone()
                        };
                        self.adopt_shelved(&shelved).await?;
                        self.shared.activity
                            .event(
                                &sandbox.id,
                                LogLevel::Warn,
                                "sandbox lost its memory: its checkpoint cannot be restored; its files are kept",
                                &[("error", err.to_string())],
                            )
                            .await;
                        return Ok(());
                    }
                    Err(release_err) => {
                        tracing::error!(sandbox_id = %sandbox.id, error = %release_err, "cannot keep the files of a checkpointed sandbox");
                    }
                }
                tracing::error!(sandbox_id = %sandbox.id, error = %err, "checkpointed sandbox cannot be restored; removing it");
                self.open_log(sandbox).await;
                self.remove(sandbox, "cannot clean up checkpointed sandbox")
                    .await?;
                self.close_log_lost(sandbox, "sandbox lost: its checkpoint cannot be restored")
                    .await;
                return Ok(());
            }
        };
        if sandbox.status != SandboxStatus::Checkpointed || handle != sandbox.handle {
            self.recover_to(sandbox, SandboxStatus::Checkpointed, Some(&handle))
                .await?;
        }
        self.enter(sandbox, handle, None, SandboxStatus::Checkpointed);
        self.open_log(sandbox).await;
        self.shared
            .activity
            .event(
                &sandbox.id,
                LogLevel::Info,
                "checkpointed sandbox adopted after a server restart",
                &[],
            )
            .await;
        Ok(())
    }

    /// After a restart: records running a sandbox whose restore finished while the server
    /// was down (its end time was set when the resume began).
    async fn adopt_restored(
        &self,
        sandbox: &Sandbox,
        handle: RuntimeHandle,
        endpoint: Endpoint,
    ) -> Result<(), StoreError> {
        self.recover_to(sandbox, SandboxStatus::Running, Some(&handle))
            .await?;
        self.shared.runtime.discard_checkpoint(&sandbox.id).await;
        let mut running = sandbox.clone();
        running.handle = handle;
        running.status = SandboxStatus::Running;
        if self
            .take_back(
                &running,
                endpoint,
                "sandbox resumed: its restore finished while the server was down",
            )
            .await?
        {
            tracing::info!(sandbox_id = %sandbox.id, "restore finished while the server was down; sandbox runs");
        }
        Ok(())
    }

    /// After a restart: routes to a sandbox whose processes run (or are frozen, as the store
    /// says) once its egress rules are in place again; one whose rules cannot be applied is
    /// stopped, since running on with the node's default egress would ignore its owner's
    /// rules. Whether it was taken back.
    async fn take_back(
        &self,
        sandbox: &Sandbox,
        endpoint: Endpoint,
        event: &str,
    ) -> Result<bool, StoreError> {
        if let Err(err) = self.restore_network(sandbox).await {
            tracing::error!(sandbox_id = %sandbox.id, error = %err, "cannot restore egress rules; stopping the sandbox");
            self.remove(sandbox, "cannot stop sandbox").await?;
            return Ok(false);
        }
        let status = self.settle(sandbox).await?;
        self.enter(sandbox, sandbox.handle.clone(), Some(endpoint), status);
        self.open_log(sandbox).await;
        self.shared
            .activity
            .event(&sandbox.id, LogLevel::Info, event, &[])
            .await;
        Ok(true)
    }

    /// After a restart: takes back a sandbox paused without memory (no processes, only its
    /// files); one whose files are gone is cleaned up.
    pub(super) async fn adopt_shelved(&self, sandbox: &Sandbox) -> Result<(), StoreError> {
        if let Err(err) = self
            .shared
            .runtime
            .adopt_released(&sandbox.id, &sandbox.handle)
            .await
        {
            tracing::error!(sandbox_id = %sandbox.id, error = %err, "paused sandbox lost its files; removing it");
            self.remove(sandbox, "cannot clean up paused sandbox")
                .await?;
            self.close_log_lost(sandbox, "sandbox lost its files").await;
            return Ok(());
        }
        self.enter(
            sandbox,
            sandbox.handle.clone(),
            None,
            SandboxStatus::Shelved,
        );
        self.open_log(sandbox).await;
        Ok(())
    }

    /// Enters `sandbox` in the registry as the store recorded it, with the handle, endpoint
    /// and status it has now.
    fn enter(
        &self,
        sandbox: &Sandbox,
        handle: RuntimeHandle,
        endpoint: Option<Endpoint>,
        status: SandboxStatus,
    ) {
        self.shared.live().insert(
            sandbox.id.clone(),
            Live::recorded(&self.shared.signers, sandbox, handle, endpoint, status),
        );
    }

    /// Ends a sandbox that cannot be taken back: its processes and files (`cleanup_failed`
    /// is logged when they cannot be removed, as the record goes regardless), its place in
    /// the registry and its record.
    async fn remove(&self, sandbox: &Sandbox, cleanup_failed: &str) -> Result<(), StoreError> {
        if let Err(err) = self
            .shared
            .runtime
            .destroy(&sandbox.id, &sandbox.handle)
            .await
        {
            tracing::error!(sandbox_id = %sandbox.id, error = %err, "{cleanup_failed}");
        }
        self.shared.live().remove(&sandbox.id);
        self.shared
            .store
            .sandboxes
            .delete_sandbox(&sandbox.id)
            .await
    }

    /// Opens the log of a sandbox taken back or lost after a restart: sandboxes from before
    /// logs were kept get one from now on.
    async fn open_log(&self, sandbox: &Sandbox) {
        self.shared
            .activity
            .open(&sandbox.id, &sandbox.team_id, sandbox.started_at, &[])
            .await;
    }

    /// Closes the log of a sandbox that was lost, saying why.
    async fn close_log_lost(&self, sandbox: &Sandbox, why: &str) {
        self.shared
            .activity
            .close(&sandbox.id, LogLevel::Error, why)
            .await;
    }

    /// After a restart: makes the stored state and the processes agree. A pause or resume
    /// the server died in the middle of is finished in the direction the store says: a
    /// sandbox recorded paused is frozen again, one recorded running is thawed.
    async fn settle(&self, sandbox: &Sandbox) -> Result<SandboxStatus, StoreError> {
        let frozen = self.shared.runtime.is_paused(&sandbox.id, &sandbox.handle);
        match (sandbox.status == SandboxStatus::Paused, frozen) {
            (true, true) => Ok(SandboxStatus::Paused),
            (false, false) => Ok(SandboxStatus::Running),
            (true, false) => match self
                .shared
                .runtime
                .pause(&sandbox.id, &sandbox.handle)
                .await
            {
                Ok(()) => Ok(SandboxStatus::Paused),
                Err(err) => {
                    tracing::warn!(sandbox_id = %sandbox.id, error = %err, "cannot pause again; recording it running");
                    self.recover_to(sandbox, SandboxStatus::Running, None)
                        .await?;
                    Ok(SandboxStatus::Running)
                }
            },
            (false, true) => {
                if let Err(err) = self
                    .shared
                    .runtime
                    .resume(&sandbox.id, &sandbox.handle)
                    .await
                {
                    tracing::warn!(sandbox_id = %sandbox.id, error = %err, "cannot thaw; recording it paused");
                    self.recover_to(sandbox, SandboxStatus::Paused, None)
                        .await?;
                    return Ok(SandboxStatus::Paused);
                }
                Ok(SandboxStatus::Running)
            }
        }
    }

    /// After a restart, before anything is served: enters `sandbox` in the registry in the
    /// status the store gave it and moves it to `to` through the statuses the lifecycle
    /// allows between them, so that the one transition records `to` (with `handle`, when
    /// given) as any other change would. The statuses on the way are the registry's alone.
    async fn recover_to(
        &self,
        sandbox: &Sandbox,
        to: SandboxStatus,
        handle: Option<&RuntimeHandle>,
    ) -> Result<(), StoreError> {
        let id = sandbox.id.as_str();
        let entered = self.shared.live().get(id).map(|l| l.status);
        let from = match entered {
            Some(status) => status,
            None => {
                self.enter(sandbox, sandbox.handle.clone(), None, sandbox.status);
                sandbox.status
            }
        };
        let Some(path) = from.path_to(to) else {
            tracing::error!(sandbox_id = %id, from = from.name(), to = to.name(), "no transition leads there; the record is left as it is");
            return Ok(());
        };
        let Some((last, through)) = path.split_last() else {
            // Already there: only its handle changed.
            return self.shared.record(id, to, handle).await;
        };
        for step in through {
            self.shared.set_status(id, *step, None);
        }
        match self.shared.transition(id, *last, handle).await {
            Ok(_) => Ok(()),
            Err(TransitionError::Store(err)) => Err(err),
            Err(refused @ TransitionError::Refused { .. }) => {
                tracing::error!(sandbox_id = %id, error = %refused, "the record is left as it is");
                Ok(())
            }
        }
    }

    /// Applies an adopted sandbox's egress rules again: the node rewrites its firewall when
    /// it starts.
    async fn restore_network(&self, sandbox: &Sandbox) -> Result<(), RestoreNetworkError> {
        let rules = sandbox.network.validate(sandbox.allow_internet_access)?;
        if rules.is_empty() {
            return Ok(());
        }
        self.shared
            .runtime
            .update_network(&sandbox.id, &sandbox.handle, &rules)
            .await?;
        Ok(())
    }
}

/// Why an adopted sandbox's egress rules could not be applied again.
#[derive(Debug, thiserror::Error)]
enum RestoreNetworkError {
    #[error("its recorded network is no longer valid: {0}")]
    Invalid(#[from] crate::network::NetworkConfigError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}
