//! Pausing: frozen in place, or released to keep only the files, and the checkpoint to disk
//! a sandbox frozen past its grace gets.

use std::sync::Arc;

use chrono::{TimeDelta, Utc};

use super::lifecycle::Lifecycle;
use super::{CHECKPOINT_ATTEMPTS, SandboxError, TransitionError};
use crate::builds::LogLevel;
use crate::lifecycle::SandboxStatus;
use crate::model::SandboxEventType;
use crate::model::{Sandbox, Team};
use crate::runtime::{RuntimeError, RuntimeHandle};

impl Lifecycle {
    /// Pauses a running sandbox: frozen in place when `memory`, else its processes end and
    /// only its files are kept. `Conflict` if it is not running.
    pub async fn pause(&self, team: &Team, id: &str, memory: bool) -> Result<(), SandboxError> {
        let sandbox = self.shared.get(team, id).await?;
        self.pause_sandbox(&sandbox, memory).await
    }

    async fn pause_sandbox(&self, sandbox: &Sandbox, memory: bool) -> Result<(), SandboxError> {
        let id = sandbox.id.as_str();
        match self
            .shared
            .claim(id, SandboxStatus::can_pause, SandboxStatus::Pausing)
        {
            Ok(_) => {}
            Err(Some(status)) if status.is_paused() => {
                return Err(SandboxError::Conflict {
                    id: id.to_owned(),
                    state: "already paused",
                });
            }
            Err(_) => {
                return Err(SandboxError::Conflict {
                    id: id.to_owned(),
                    state: "not running",
                });
            }
        }
        self.pause_marked(sandbox, memory).await
    }

    /// Pauses a sandbox already marked `Pausing`.
    pub(super) async fn pause_marked(
        &self,
        sandbox: &Sandbox,
        memory: bool,
    ) -> Result<(), SandboxError> {
        let id = sandbox.id.as_str();
        // Before anything stops: the agent has to be running to close its ends.
        self.shared.end_agent_links(id).await;
        if !memory {
            return self.shelve(sandbox).await;
        }
        if let Err(err) = self.shared.runtime.pause(id, &sandbox.handle).await {
            self.shared.set_status(id, SandboxStatus::Running, None);
            return Err(err.into());
        }
        crate::faults::crash_point("pause.frozen");
        if let Err(err) = self
            .shared
            .transition(id, SandboxStatus::Paused, None)
            .await
        {
            // The store still says running: thaw so both agree.
            let _ = self.shared.runtime.resume(id, &sandbox.handle).await;
            self.shared.set_status(id, SandboxStatus::Running, None);
            return Err(err.into());
        }
        if let Some(entry) = self.shared.live().get_mut(id) {
            entry.paused_at = Some(Utc::now());
            entry.checkpoint_failures = 0;
        }
        self.shared
            .activity
            .event(id, LogLevel::Info, "sandbox paused", &[])
            .await;
        self.shared
            .lifecycle_event(SandboxEventType::Paused, sandbox);
        tracing::info!(sandbox_id = %id, "sandbox paused");
        Ok(())
    }

    /// Ends the processes of a sandbox marked `Pausing` and keeps only its files.
    async fn shelve(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        let id = sandbox.id.as_str();
        // The agent's last lines, before its processes end.
        self.shared
            .activity
            .ingest_agent_log(self.shared.runtime.as_ref(), id)
            .await;
        let handle = match self
            .shared
            .release_recorded(id, &sandbox.handle, SandboxStatus::Running)
            .await
        {
            Ok(handle) => handle,
            Err(err) => {
                // Still running if the release failed early; if its processes are gone, the
                // reaper stops it like any dead sandbox.
                self.shared.set_status(id, SandboxStatus::Running, None);
                return Err(err);
            }
        };
        self.record_processes_ended(id, SandboxStatus::Shelved, &handle)
            .await?;
        self.shared
            .activity
            .event(
                id,
                LogLevel::Info,
                "sandbox paused",
                &[("memory", "false".to_owned())],
            )
            .await;
        self.shared
            .lifecycle_event(SandboxEventType::Paused, sandbox);
        tracing::info!(sandbox_id = %id, "sandbox paused without memory");
        Ok(())
    }

    /// Records that sandbox `id`'s processes ended, leaving it `status` with `handle`: its
    /// endpoint goes, and the registry holds the new status even where the store could not
    /// be told, since the processes are gone whatever the store says.
    async fn record_processes_ended(
        &self,
        id: &str,
        status: SandboxStatus,
        handle: &RuntimeHandle,
    ) -> Result<(), TransitionError> {
        if let Some(entry) = self.shared.live().get_mut(id) {
            entry.endpoint = None;
        }
        let recorded = self.shared.transition(id, status, Some(handle)).await;
        if recorded.is_err() {
            self.shared.set_status(id, status, Some(handle));
        }
        recorded.map(drop)
    }

    /// Starts [`Self::checkpoint_paused`] beside the caller unless one still runs: the
    /// reaper goes on ending other sandboxes however long a dump takes. The node bounds each
    /// step of a checkpoint itself (its plan, the dump, the seal) and gives back a sandbox
    /// whose dump it abandons still paused in memory, so nothing here cancels one half-way.
    pub fn spawn_checkpoint_paused(&self) {
        use std::sync::atomic::Ordering;
        if self.shared.checkpoint_running.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        let running = self.shared.checkpoint_running.clone();
        tokio::spawn(async move {
            // Cleared however the task ends, a panic included.
            struct Clear(Arc<std::sync::atomic::AtomicBool>);
            impl Drop for Clear {
                fn drop(&mut self) {
                    self.0.store(false, Ordering::Release);
                }
            }
            let _clear = Clear(running);
            this.checkpoint_paused().await;
        });
    }

    /// Checkpoints to disk the sandbox frozen in memory longest, once its grace has passed:
    /// one per round, since a dump holds a CPU while it runs.
    pub async fn checkpoint_paused(&self) {
        let Ok(grace) = TimeDelta::from_std(self.shared.config.pause_grace) else {
            return;
        };
        let due = Utc::now() - grace;
        let next = self
            .shared
            .live()
            .iter()
            .filter(|(_, l)| {
                l.status == SandboxStatus::Paused && l.checkpoint_failures < CHECKPOINT_ATTEMPTS
            })
            .filter_map(|(id, l)| Some((l.paused_at?, id.clone())))
            .filter(|(at, _)| *at <= due)
            .min();
        let Some((_, id)) = next else { return };
        // Asked only once a sandbox is due: a node without CRIU may look for one installed
        // since, which it limits in time, but no round of the reaper should start a look.
        if !self.shared.runtime.checkpoints_ready().await {
            return;
        }
        // A checkpoint writes about the sandbox's memory to the data disk: without room for
        // that, the sandbox stays frozen in memory rather than leave a half-written dump.
        let handle = self.shared.live().get(&id).map(|l| l.handle.clone());
        let memory = handle
            .and_then(|h| self.shared.runtime.stats(&id, &h))
            .map_or(0, |s| s.memory_used);
        if !self.shared.data_disk().data_has_room_for(memory) {
            tracing::debug!(sandbox_id = %id, memory, "no room on the data disk to checkpoint the paused sandbox; it stays in memory");
            return;
        }
        self.checkpoint_sandbox(&id).await;
    }

    /// Checkpoints a sandbox frozen in memory; on failure it stays frozen, and after
    /// [`CHECKPOINT_ATTEMPTS`] failures it is not tried again until its next pause.
    async fn checkpoint_sandbox(&self, id: &str) {
        let handle = {
            let mut live = self.shared.live();
            let Some(entry) = live.get_mut(id) else {
                return;
            };
            if entry.status != SandboxStatus::Paused {
                return;
            }
            entry.handle.clone()
        };
        let started = std::time::Instant::now();
        let result = async {
            // Recorded first, so a restart after a crash in the middle looks at what is left.
            match self
                .shared
                .transition(id, SandboxStatus::Checkpointing, None)
                .await
            {
                // Another request took it meanwhile.
                Err(TransitionError::Refused { .. }) => return Ok(None),
                claimed => claimed?,
            };
            Ok::<_, SandboxError>(Some(self.shared.runtime.checkpoint(id, &handle).await?))
        }
        .await;
        match result {
            Ok(None) => {}
            Ok(Some(checkpointed)) => {
                if let Err(err) = self
                    .record_processes_ended(id, SandboxStatus::Checkpointed, &checkpointed)
                    .await
                {
                    // A restart finds it recorded as checkpointing, with its processes gone
                    // and a complete checkpoint: it is adopted as checkpointed then.
                    tracing::error!(sandbox_id = %id, error = %err, "cannot record the checkpoint");
                }
                let ms = started.elapsed().as_millis() as u64;
                self.shared
                    .activity
                    .event(
                        id,
                        LogLevel::Info,
                        "sandbox checkpointed to disk",
                        &[("ms", ms.to_string())],
                    )
                    .await;
                self.shared
                    .lifecycle_event_of(SandboxEventType::Checkpointed, id)
                    .await;
                tracing::info!(sandbox_id = %id, ms, "sandbox checkpointed to disk");
            }
            Err(err) => {
                // A refusal is about what the sandbox holds, which stays as it is while it
                // is frozen: it is not tried again until its next pause.
                let refused = matches!(
                    err,
                    SandboxError::Runtime(RuntimeError::Uncheckpointable { .. })
                );
                if let Some(entry) = self.shared.live().get_mut(id) {
                    entry.checkpoint_failures = if refused {
                        CHECKPOINT_ATTEMPTS
                    } else {
                        entry.checkpoint_failures.saturating_add(1)
                    };
                }
                // Not claimed (another caller had it): nothing to give back.
                if self.shared.status_of(id) == Some(SandboxStatus::Checkpointing)
                    && let Err(err) = self
                        .shared
                        .transition(id, SandboxStatus::Paused, None)
                        .await
                {
                    tracing::error!(sandbox_id = %id, error = %err, "cannot record the sandbox paused");
                    self.shared.set_status(id, SandboxStatus::Paused, None);
                }
                self.shared
                    .activity
                    .event(
                        id,
                        LogLevel::Warn,
                        "sandbox stays paused in memory: checkpoint failed",
                        &[("error", err.to_string())],
                    )
                    .await;
                tracing::warn!(sandbox_id = %id, error = %err, "checkpoint failed; the sandbox stays paused in memory");
            }
        }
    }
}
