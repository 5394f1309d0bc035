//! Changes to a live sandbox: its timeout, its network, a kill, and resumes (see `pause.rs`
//! for pauses and checkpoints to disk).

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::recover::Recovery;
use super::shared::Shared;
use super::{Claim, SandboxError, TRANSITION_PATIENCE, UpdateNetworkError, seconds};
use crate::builds::LogLevel;
use crate::lifecycle::SandboxStatus;
use crate::model::SandboxEventType;
use crate::model::{Sandbox, Team, Template};
use crate::network::{EgressConfig, NetworkConfig};
use crate::runtime::{Endpoint, LaunchSpec, RuntimeError, RuntimeHandle};

/// Moves live sandboxes through their lifecycle: timeouts, kills, network updates, pauses,
/// resumes and checkpoints to disk.
#[derive(Clone, Debug)]
pub struct Lifecycle {
    pub(super) shared: Arc<Shared>,
    /// Takes over a sandbox of a lost node before it is resumed here.
    recovery: Recovery,
}

impl Lifecycle {
    pub(super) fn new(shared: Arc<Shared>, recovery: Recovery) -> Self {
        Self { shared, recovery }
    }

    /// Sets the end time to `timeout_secs` from now; may shorten the sandbox's life.
    pub async fn set_timeout(
        &self,
        team: &Team,
        id: &str,
        timeout_secs: u64,
    ) -> Result<(), SandboxError> {
        self.check_timeout(team, timeout_secs)?;
        let sandbox = self.shared.get(team, id).await?;
        let end_at = Utc::now() + seconds(timeout_secs);
        self.move_end(&sandbox, end_at, "sandbox timeout set").await
    }

    /// Extends the end time to `timeout_secs` from now unless it is already later.
    pub async fn extend(
        &self,
        team: &Team,
        id: &str,
        timeout_secs: u64,
    ) -> Result<Sandbox, SandboxError> {
        self.check_timeout(team, timeout_secs)?;
        let mut sandbox = self.shared.get(team, id).await?;
        let wanted = Utc::now() + seconds(timeout_secs);
        if wanted > sandbox.end_at {
            self.move_end(&sandbox, wanted, "sandbox timeout extended")
                .await?;
            sandbox.end_at = wanted;
        }
        Ok(sandbox)
    }

    fn check_timeout(&self, team: &Team, timeout_secs: u64) -> Result<(), SandboxError> {
        if timeout_secs > team.limits.max_sandbox_timeout_secs {
            return Err(SandboxError::TimeoutTooLong {
                requested: timeout_secs,
                max: team.limits.max_sandbox_timeout_secs,
            });
        }
        Ok(())
    }

    /// Moves a sandbox's end. The registry changes first, under the lock the reaper claims an
    /// expired sandbox with: either the reaper then sees the new end and leaves the sandbox
    /// running, or it claimed the sandbox first and the extend fails (a stop is not found, a
    /// pause is a conflict that a connect waits out). A move that took is told in the
    /// sandbox's log as `message` and as an update event.
    async fn move_end(
        &self,
        sandbox: &Sandbox,
        end_at: DateTime<Utc>,
        message: &str,
    ) -> Result<(), SandboxError> {
        let id = sandbox.id.as_str();
        let before = {
            let mut live = self.shared.live();
            match live.get_mut(id) {
                Some(entry) if entry.status == SandboxStatus::Stopping => {
                    return Err(SandboxError::NotFound(id.to_owned()));
                }
                Some(entry) if entry.status == SandboxStatus::Pausing => {
                    return Err(SandboxError::Conflict {
                        id: id.to_owned(),
                        state: "being paused",
                    });
                }
                Some(entry) => Some(std::mem::replace(&mut entry.end_at, end_at)),
                None => None,
            }
        };
        if let Err(err) = self
            .shared
            .store
            .sandboxes
            .set_sandbox_end(id, end_at)
            .await
        {
            if let Some(before) = before
                && let Some(entry) = self.shared.live().get_mut(id)
                && entry.end_at == end_at
            {
                entry.end_at = before;
            }
            return Err(err.into());
        }
        self.shared
            .activity
            .event(
                id,
                LogLevel::Info,
                message,
                &[("endAt", end_at.to_rfc3339())],
            )
            .await;
        self.shared
            .lifecycle_event(SandboxEventType::Updated, sandbox);
        Ok(())
    }

    /// Kills a sandbox. A kill is the user's last word: a pause, resume, checkpoint, restore
    /// or snapshot under way is waited for, and the sandbox is stopped whatever it became.
    pub async fn kill(&self, team: &Team, id: &str) -> Result<(), SandboxError> {
        let sandbox = self.shared.get(team, id).await?;
        let deadline = tokio::time::Instant::now() + TRANSITION_PATIENCE;
        loop {
            match self.shared.claim_stop(id, |_| true) {
                Claim::Claimed { previous, handle } => {
                    return self
                        .shared
                        .finish_stop(
                            id,
                            Some(previous),
                            &handle,
                            Some(&sandbox),
                            LogLevel::Info,
                            "sandbox killed",
                        )
                        .await;
                }
                // Recorded but not managed here (its adoption failed): the store's handle is
                // all there is.
                Claim::Unmanaged => {
                    let sandbox = self.shared.get(team, id).await?;
                    return self
                        .shared
                        .finish_stop(
                            id,
                            None,
                            &sandbox.handle,
                            Some(&sandbox),
                            LogLevel::Info,
                            "sandbox killed",
                        )
                        .await;
                }
                Claim::Stopping | Claim::Declined => {
                    return Err(SandboxError::NotFound(sandbox.id));
                }
                Claim::Busy(status) => {
                    if self.shared.settled(id, deadline).await.is_none()
                        && tokio::time::Instant::now() >= deadline
                    {
                        return Err(SandboxError::Conflict {
                            id: id.to_owned(),
                            state: status.name(),
                        });
                    }
                }
            }
        }
    }

    /// Replaces a running sandbox's egress rules (`allowOut`, `denyOut`, `dnsServers`); an
    /// omitted `allow_internet_access` means allowed, as on create.
    pub async fn update_network(
        &self,
        team: &Team,
        id: &str,
        egress: EgressConfig,
        allow_internet_access: bool,
    ) -> Result<(), UpdateNetworkError> {
        let _serial = self.shared.network_updates.lock().await;
        let sandbox = match self.shared.get(team, id).await {
            Ok(sandbox) => sandbox,
            Err(SandboxError::Store(e)) => return Err(e.into()),
            Err(_) => return Err(UpdateNetworkError::NotFound(id.to_owned())),
        };
        let network = NetworkConfig {
            egress,
            ..sandbox.network.clone()
        };
        let rules = network.validate(allow_internet_access)?;
        self.shared
            .runtime
            .update_network(id, &sandbox.handle, &rules)
            .await
            .map_err(|source| UpdateNetworkError::Runtime {
                sandbox_id: id.to_owned(),
                source,
            })?;
        self.shared
            .store
            .sandboxes
            .set_sandbox_network(id, &network, allow_internet_access)
            .await?;
        self.shared
            .activity
            .event(id, LogLevel::Info, "sandbox network updated", &[])
            .await;
        self.shared
            .lifecycle_event(SandboxEventType::Updated, &sandbox);
        tracing::info!(sandbox_id = %id, "sandbox network updated");
        Ok(())
    }

    /// Thaws a paused sandbox and gives it `timeout_secs` to live from now. Returns the
    /// sandbox and whether it was paused (`Conflict` when `require_paused` and it was not).
    /// Without `memory`, a sandbox paused with its memory boots afresh on its files instead
    /// (its processes and their memory are dropped); for one paused without, or running,
    /// that changes nothing. Without `require_paused` (a connect) it is idempotent: a pause,
    /// resume or snapshot under way is waited for, and a running sandbox only gets a later
    /// end.
    pub async fn resume(
        &self,
        team: &Team,
        id: &str,
        timeout_secs: u64,
        require_paused: bool,
        memory: bool,
    ) -> Result<(Sandbox, bool), SandboxError> {
        self.check_timeout(team, timeout_secs)?;
        self.recovery.take_over_if_lost(team, id).await?;
        let deadline = tokio::time::Instant::now() + TRANSITION_PATIENCE;
        let (sandbox, from) = loop {
            let mut sandbox = self.shared.get(team, id).await?;
            let busy = match self.start_waking(&mut sandbox).await {
                Ok(from) => break (sandbox, from),
                Err(None | Some(SandboxStatus::Stopping)) => {
                    return Err(SandboxError::NotFound(id.to_owned()));
                }
                Err(Some(SandboxStatus::Running)) if !require_paused => {
                    match self.extend(team, id, timeout_secs).await {
                        Ok(sandbox) => return Ok((sandbox, false)),
                        // Paused by its timeout meanwhile: woken below once it settles.
                        Err(SandboxError::Conflict { .. }) => SandboxStatus::Pausing,
                        Err(err) => return Err(err),
                    }
                }
                Err(Some(status)) if !require_paused && status.is_transient() => status,
                Err(_) => {
                    return Err(SandboxError::Conflict {
                        id: id.to_owned(),
                        state: "not paused",
                    });
                }
            };
            // Gone meanwhile: the next look finds it not found.
            if self.shared.settled(id, deadline).await.is_none()
                && tokio::time::Instant::now() >= deadline
            {
                return Err(SandboxError::Conflict {
                    id: id.to_owned(),
                    state: busy.name(),
                });
            }
        };
        let _claim = match self.shared.resume_slot(team, id).await {
            Ok(claim) => claim,
            Err(retry_after_secs) => {
                self.shared.set_status(id, from, None);
                return Err(SandboxError::ConcurrencyLimit {
                    id: id.to_owned(),
                    limit: team.limits.max_concurrent_sandboxes,
                    retry_after_secs,
                });
            }
        };
        let (sandbox, from) = if memory || from == SandboxStatus::Shelved {
            (sandbox, from)
        } else {
            self.drop_memory(sandbox, from).await?
        };
        let sandbox = self
            .thaw(sandbox, from, timeout_secs, "request")
            .await
            .map_err(|err| match err {
                SandboxError::Runtime(source @ RuntimeError::NoCapacity { .. }) => {
                    SandboxError::NoCapacity {
                        id: id.to_owned(),
                        source,
                        retry_after_secs: self.shared.capacity_wait(),
                    }
                }
                err => err,
            })?;
        Ok((sandbox, true))
    }

    /// Turns a sandbox marked waking from `from` (paused in memory or checkpointed) into one
    /// paused without memory, so that waking it boots it afresh on its files.
    async fn drop_memory(
        &self,
        mut sandbox: Sandbox,
        from: SandboxStatus,
    ) -> Result<(Sandbox, SandboxStatus), SandboxError> {
        let id = sandbox.id.clone();
        if sandbox.image.is_none() {
            self.shared.set_status(&id, from, None);
            return Err(SandboxError::Conflict {
                id,
                state: "too old to boot afresh (its image was not recorded); resume it with its memory",
            });
        }
        let handle = self
            .shared
            .live()
            .get(&id)
            .map(|l| l.handle.clone())
            .unwrap_or_else(|| sandbox.handle.clone());
        let released = match self
            .shared
            .release_recorded(&id, &handle, sandbox.status)
            .await
        {
            Ok(released) => released,
            Err(err) => {
                self.shared.set_status(&id, from, None);
                return Err(err);
            }
        };
        if let Some(entry) = self.shared.live().get_mut(&id) {
            entry.endpoint = None;
            entry.handle = released.clone();
        }
        // The registry keeps its waking status: the caller boots it from shelved next.
        self.shared
            .record(&id, SandboxStatus::Shelved, Some(&released))
            .await?;
        self.shared
            .activity
            .event(&id, LogLevel::Info, "sandbox memory dropped on resume", &[])
            .await;
        sandbox.handle = released;
        sandbox.status = SandboxStatus::Shelved;
        Ok((sandbox, SandboxStatus::Shelved))
    }

    /// Marks a paused sandbox as waking (resuming, or restoring from a checkpoint) and returns
    /// the status it had; a checkpoint under way is waited for first, and `sandbox` gets the
    /// handle that checkpoint left. The status it has otherwise.
    pub(super) async fn start_waking(
        &self,
        sandbox: &mut Sandbox,
    ) -> Result<SandboxStatus, Option<SandboxStatus>> {
        let id = sandbox.id.as_str();
        // A dump takes a fraction of a second per 100 MiB; a minute covers any sandbox.
        for _ in 0..6000 {
            let status = self.shared.live().get(id).map(|l| l.status);
            if status != Some(SandboxStatus::Checkpointing) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut live = self.shared.live();
        let entry = live.get_mut(id).ok_or(None)?;
        let to = entry.status.waking().ok_or(Some(entry.status))?;
        let from = entry.move_to(to).map_err(Some)?;
        sandbox.handle = entry.handle.clone();
        entry.wakes += 1;
        Ok(from)
    }

    /// Thaws (or boots again, `from` shelved, or restores, `from` checkpointed) a sandbox
    /// already marked waking.
    pub(super) async fn thaw(
        &self,
        mut sandbox: Sandbox,
        from: SandboxStatus,
        timeout_secs: u64,
        by: &str,
    ) -> Result<Sandbox, SandboxError> {
        let id = sandbox.id.clone();
        self.shared.forget_shared_files(&id).await;
        let end_at = Utc::now() + seconds(timeout_secs);
        let booted = if matches!(from, SandboxStatus::Shelved | SandboxStatus::Checkpointed) {
            let booted = async {
                self.shared.store.sandboxes.set_sandbox_end(&id, end_at).await?;
                let (handle, endpoint) = if from == SandboxStatus::Shelved {
                    self.boot_again(&sandbox).await?
                } else {
                    let started = std::time::Instant::now();
                    let restored = self.shared.runtime.restore(&id, &sandbox.handle).await?;
                    tracing::info!(sandbox_id = %id, ms = started.elapsed().as_millis() as u64, "sandbox restored from its checkpoint");
                    restored
                };
                // Not routable before the transition below, which makes it running.
                if let Some(entry) = self.shared.live().get_mut(&id) {
                    entry.end_at = end_at;
                    entry.endpoint = Some(endpoint.clone());
                }
                if let Err(err) = self
                    .shared.transition(&id, SandboxStatus::Running, Some(&handle))
                    .await
                {
                    // Unrecorded processes would outlive the server: back to the kept files
                    // (a restored sandbox's checkpoint is spent, so it runs on, unrecorded).
                    if from == SandboxStatus::Shelved
                        && let Ok(released) = self.shared.runtime.release(&id, &handle).await
                    {
                        sandbox.handle = released;
                    }
                    return Err(err.into());
                }
                if from == SandboxStatus::Checkpointed {
                    // Kept until now so that a restart before the record finds the restore
                    // finished beside its images.
                    self.shared.runtime.discard_checkpoint(&id).await;
                }
                Ok::<_, SandboxError>((handle, endpoint))
            }
            .await;
            match booted {
                Ok(booted) => Some(booted),
                Err(err) => {
                    if from == SandboxStatus::Checkpointed {
                        tracing::error!(sandbox_id = %id, error = %err, "cannot restore the sandbox; it stays checkpointed");
                    }
                    if let Some(entry) = self.shared.live().get_mut(&id) {
                        entry.endpoint = None;
                    }
                    self.shared.set_status(&id, from, Some(&sandbox.handle));
                    return Err(err);
                }
            }
        } else {
            let result = async {
                self.shared
                    .store
                    .sandboxes
                    .set_sandbox_end(&id, end_at)
                    .await?;
                self.shared.runtime.resume(&id, &sandbox.handle).await?;
                crate::faults::crash_point("resume.thawed");
                if let Some(entry) = self.shared.live().get_mut(&id) {
                    entry.end_at = end_at;
                }
                self.shared
                    .transition(&id, SandboxStatus::Running, None)
                    .await?;
                Ok::<(), SandboxError>(())
            }
            .await;
            if let Err(err) = result {
                let _ = self.shared.runtime.pause(&id, &sandbox.handle).await;
                self.shared.set_status(&id, SandboxStatus::Paused, None);
                return Err(err);
            }
            None
        };
        if let Some((handle, _)) = booted {
            sandbox.handle = handle;
        }
        sandbox.end_at = end_at;
        sandbox.status = SandboxStatus::Running;
        self.shared
            .activity
            .event(
                &id,
                LogLevel::Info,
                "sandbox resumed",
                &[("by", by.to_owned()), ("endAt", end_at.to_rfc3339())],
            )
            .await;
        self.shared
            .lifecycle_event(SandboxEventType::Resumed, &sandbox);
        tracing::info!(sandbox_id = %id, "sandbox resumed");
        Ok(sandbox)
    }

    /// Boots a sandbox whose files were kept by [`Self::shelve`] again on them, as it was
    /// created: same environment, access token and image, the start command run again.
    async fn boot_again(
        &self,
        sandbox: &Sandbox,
    ) -> Result<(RuntimeHandle, Endpoint), SandboxError> {
        let template = self
            .shared
            .store
            .templates
            .template(&sandbox.template_id)
            .await?;
        let image = match (
            &sandbox.image,
            template.as_ref().and_then(|t| t.image.clone()),
        ) {
            (Some(image), _) => image.clone(),
            (None, Some(image)) => image,
            (None, None) => {
                return Err(SandboxError::Runtime(RuntimeError::TemplateMissing {
                    template_id: sandbox.template_id.clone(),
                }));
            }
        };
        // A template removed since: the sandbox still boots on what it recorded.
        let template = template.unwrap_or_else(|| Template {
            id: sandbox.template_id.clone(),
            aliases: sandbox.alias.iter().cloned().collect(),
            ..Template::of_sandbox(sandbox, image.clone(), sandbox.started_at)
        });
        let egress = sandbox
            .network
            .validate(sandbox.allow_internet_access)
            .map_err(|e| {
                SandboxError::Runtime(RuntimeError::Sandbox {
                    sandbox_id: sandbox.id.clone(),
                    message: format!("its recorded network is no longer valid: {e}"),
                })
            })?;
        let mut env_vars = image.env.clone();
        env_vars.extend(sandbox.env_vars.clone());
        // The team's rates as they are now, as a new sandbox of the team would get them.
        let disk_rates = self
            .shared
            .store
            .teams
            .team(&sandbox.team_id)
            .await?
            .map(|team| team.limits.disk_rates)
            .unwrap_or_default();
        let spec = LaunchSpec {
            sandbox_id: sandbox.id.clone(),
            template,
            image,
            cpu_count: sandbox.cpu_count,
            memory_mb: sandbox.memory_mb,
            disk_size_mb: sandbox.disk_size_mb,
            disk_rates,
            env_vars,
            allow_internet_access: !egress.is_isolated(),
            egress,
            envd_access_token: sandbox.envd_access_token.clone(),
            volumes: self
                .shared
                .store
                .sandboxes
                .sandbox_volumes(&sandbox.id)
                .await?,
            kept: Some(sandbox.handle.clone()),
        };
        Ok(self.shared.runtime.launch(spec).await?)
    }
}
