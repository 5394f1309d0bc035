//! What every part of [`super::Sandboxes`] shares: the store, the runtime and the registry
//! of live sandboxes, and the moves on that registry the parts make together (claims,
//! transitions, stops).

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use chrono::{TimeDelta, Utc};

use super::signers::Signers;
use super::spawns::SpawnTally;
use super::{
    AGENT_LINKS_PATIENCE, CAPACITY_WAIT_SECS, Claim, CreateSandboxError, Live, MetricSeries,
    SandboxError, SandboxesConfig, TransitionError, slot_wait, transition_plan,
};
use crate::activity::Activity;
use crate::agent_links::AgentLinks;
use crate::builds::LogLevel;
use crate::caps::TeamGate;
use crate::cluster::NodeDirectory;
use crate::disks::DiskReport;
use crate::lifecycle::SandboxStatus;
use crate::lock;
use crate::model::{LayerBlob, Sandbox, SandboxEvent, SandboxEventType, SlotClaim, Team};
use crate::runtime::{Runtime, RuntimeHandle};
use crate::store::{Store, StoreError};
use crate::templates::Templates;
use crate::volumes::Volumes;

/// The state behind every part of [`super::Sandboxes`], held once in an `Arc`.
pub(super) struct Shared {
    pub(super) store: Arc<Store>,
    pub(super) runtime: Arc<dyn Runtime>,
    pub(super) templates: Templates,
    pub(super) config: SandboxesConfig,
    live: Mutex<HashMap<String, Live>>,
    /// The agent tokens of the sandboxes in `live`, searched without its lock.
    pub(super) signers: Signers,
    /// Network updates run one at a time, so the firewall and the store agree on the last.
    pub(super) network_updates: tokio::sync::Mutex<()>,
    pub(super) metrics: Mutex<HashMap<String, MetricSeries>>,
    /// Set once, while the server is built.
    pub(super) volumes: OnceLock<Arc<Volumes>>,
    pub(super) activity: Activity,
    /// The cluster's nodes, where this host shares its store with others; set once, while
    /// the server is built.
    pub(super) nodes: OnceLock<Arc<NodeDirectory>>,
    /// Held while a paused sandbox's shared files are recorded or forgotten, so a copy made
    /// before a wake is never recorded after it.
    pub(super) shared_files: tokio::sync::Mutex<()>,
    /// One take-over of another node's sandbox at a time.
    pub(super) take_overs: tokio::sync::Mutex<()>,
    /// Set while the reaper's checkpoint of a paused sandbox runs beside it: one at a time,
    /// since a dump holds a CPU, and never on the reaper's own path.
    pub(super) checkpoint_running: Arc<AtomicBool>,
    /// Held by a snapshot from counting the team's snapshots to recording its own.
    pub(super) snapshot_gate: TeamGate,
    /// Template spawn counts waiting to be written.
    pub(super) spawns: Arc<SpawnTally>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(super) fn new(
        store: Arc<Store>,
        runtime: Arc<dyn Runtime>,
        templates: Templates,
        config: SandboxesConfig,
    ) -> Self {
        Self {
            activity: Activity::new(store.clone(), config.activity.clone()),
            store,
            runtime,
            templates,
            config,
            live: Mutex::new(HashMap::new()),
            signers: Signers::default(),
            network_updates: tokio::sync::Mutex::new(()),
            snapshot_gate: TeamGate::default(),
            spawns: Arc::default(),
            metrics: Mutex::new(HashMap::new()),
            volumes: OnceLock::new(),
            nodes: OnceLock::new(),
            shared_files: tokio::sync::Mutex::new(()),
            take_overs: tokio::sync::Mutex::new(()),
            checkpoint_running: Arc::new(AtomicBool::new(false)),
        }
    }

    pub(super) fn live(&self) -> MutexGuard<'_, HashMap<String, Live>> {
        lock(&self.live)
    }

    /// Whether a sandbox is listed: its node holds its lease (always, on a single host), or
    /// it is paused, which a resume on another node can take over.
    pub(super) fn listable(&self, sandbox: &Sandbox) -> bool {
        sandbox.status.is_paused()
            || self
                .nodes
                .get()
                .is_none_or(|nodes| nodes.is_live(&sandbox.node_id))
    }

    /// In a cluster: claims in the store one of the team's slots for sandbox `id`, counted
    /// against every slot the team holds on this node and the other live nodes as the store
    /// shows them (records, and claims of starts and resumes not recorded yet). The claim is
    /// let go when the returned guard drops.
    pub(super) async fn claim_slot(
        &self,
        team: &Team,
        id: &str,
    ) -> Result<Option<SlotClaimGuard>, CreateSandboxError> {
        let Some(nodes) = self.nodes.get() else {
            return Ok(None);
        };
        let live: Vec<String> = nodes.live().into_iter().map(|n| n.id).collect();
        let slot_statuses: Vec<&str> = SandboxStatus::ALL
            .iter()
            .filter(|s| s.holds_a_slot())
            .map(|s| s.name())
            .collect();
        let claim = SlotClaim {
            sandbox_id: id.to_owned(),
            team_id: team.id.clone(),
            node_id: self.config.node_id.clone(),
            until: Utc::now() + SLOT_CLAIM_LENGTH,
        };
        if self
            .store
            .nodes
            .claim_team_slot(
                &claim,
                team.limits.max_concurrent_sandboxes as usize,
                &live,
                &slot_statuses,
            )
            .await?
        {
            Ok(Some(SlotClaimGuard {
                store: self.store.clone(),
                sandbox_id: id.to_owned(),
            }))
        } else {
            Err(CreateSandboxError::ConcurrencyLimit {
                limit: team.limits.max_concurrent_sandboxes,
                retry_after_secs: CAPACITY_WAIT_SECS.unsigned_abs(),
            })
        }
    }

    /// The slot a resume takes: on this node ([`Self::within_slots`]) and, in a cluster,
    /// claimed against the team's sandboxes on the other nodes, held until the guard drops.
    /// `Err` with the seconds to wait when the team has none free.
    pub(super) async fn resume_slot(
        &self,
        team: &Team,
        resuming: &str,
    ) -> Result<Option<SlotClaimGuard>, u64> {
        self.within_slots(team, resuming)?;
        match self.claim_slot(team, resuming).await {
            Ok(claim) => Ok(claim),
            Err(CreateSandboxError::ConcurrencyLimit {
                retry_after_secs, ..
            }) => Err(retry_after_secs),
            Err(err) => {
                tracing::warn!(sandbox_id = %resuming, error = %err, "cannot claim a slot for a resume");
                Err(CAPACITY_WAIT_SECS.unsigned_abs())
            }
        }
    }

    /// Whether the team's sandboxes holding a slot, `resuming` (already marked) included, fit
    /// its concurrency limit; else how long to wait. Paused sandboxes free their slot, so a
    /// resume has to win one back like a create.
    pub(super) fn within_slots(&self, team: &Team, resuming: &str) -> Result<(), u64> {
        let live = self.live();
        let active = live
            .iter()
            .filter(|(id, l)| {
                l.team_id == team.id && (l.status.holds_a_slot() || id.as_str() == resuming)
            })
            .count();
        if active > team.limits.max_concurrent_sandboxes as usize {
            Err(slot_wait(&live, team))
        } else {
            Ok(())
        }
    }

    /// Seconds until this node's next running sandbox is due to end and give back what it
    /// holds; at least 1 and at most 60, since a kill or a pause frees as much at any moment.
    pub(super) fn capacity_wait(&self) -> u64 {
        let now = Utc::now();
        self.live()
            .values()
            .filter(|l| l.status == SandboxStatus::Running)
            .map(|l| (l.end_at - now).num_seconds())
            .min()
            .unwrap_or(CAPACITY_WAIT_SECS)
            .clamp(1, 60) as u64
    }

    /// A team's sandbox; another team's is reported as not found.
    pub(super) async fn get(&self, team: &Team, id: &str) -> Result<Sandbox, SandboxError> {
        let stopping = self
            .live()
            .get(id)
            .is_some_and(|l| l.status == SandboxStatus::Stopping);
        match self.store.sandboxes.sandbox(id).await? {
            Some(sandbox) if sandbox.team_id == team.id && !stopping => Ok(sandbox),
            _ => Err(SandboxError::NotFound(id.to_owned())),
        }
    }

    /// Claims a live sandbox for a transient status `to` in the registry alone, if its
    /// status passes `check` and allows it; the status it had otherwise. For the claims no
    /// restart needs to see: the store keeps what the sandbox was until the claim settles.
    pub(super) fn claim(
        &self,
        id: &str,
        check: impl Fn(SandboxStatus) -> bool,
        to: SandboxStatus,
    ) -> Result<SandboxStatus, Option<SandboxStatus>> {
        self.claim_where(id, |l| check(l.status), to)
    }

    /// [`Self::claim`] on a check of the whole registry entry, made under its lock.
    pub(super) fn claim_where(
        &self,
        id: &str,
        check: impl Fn(&Live) -> bool,
        to: SandboxStatus,
    ) -> Result<SandboxStatus, Option<SandboxStatus>> {
        let mut live = self.live();
        let entry = live.get_mut(id).ok_or(None)?;
        if !check(entry) {
            return Err(Some(entry.status));
        }
        entry.move_to(to).map_err(Some)
    }

    /// Marks sandbox `id` stopping if it is settled and `may` agrees, under the registry lock,
    /// so that an extend or a pause either happened before or finds it stopping.
    pub(super) fn claim_stop(&self, id: &str, may: impl Fn(&Live) -> bool) -> Claim {
        let mut live = self.live();
        let Some(entry) = live.get_mut(id) else {
            return Claim::Unmanaged;
        };
        if entry.status == SandboxStatus::Stopping {
            return Claim::Stopping;
        }
        if !may(entry) {
            return Claim::Declined;
        }
        if entry.status.is_transient() {
            return Claim::Busy(entry.status);
        }
        match entry.move_to(SandboxStatus::Stopping) {
            Ok(previous) => Claim::Claimed {
                previous,
                handle: entry.handle.clone(),
            },
            Err(status) => Claim::Busy(status),
        }
    }

    /// Waits until sandbox `id` is no longer on its way between two statuses; the status it
    /// settled in, `None` if it is gone or did not settle by `deadline`.
    pub(super) async fn settled(
        &self,
        id: &str,
        deadline: tokio::time::Instant,
    ) -> Option<SandboxStatus> {
        loop {
            let status = self.live().get(id).map(|l| l.status)?;
            if !status.is_transient() {
                return Some(status);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Moves the registry's status (and handle, when given) without the store: for a claim
    /// given back (the store never saw it), for a status the store could not record, which
    /// the registry has to show all the same, and for a settled status whose record was
    /// written first. The table is checked all the same: a move it refuses is a bug,
    /// logged, and the registry keeps what it had.
    pub(super) fn set_status(
        &self,
        id: &str,
        status: SandboxStatus,
        handle: Option<&RuntimeHandle>,
    ) {
        let mut live = self.live();
        let Some(entry) = live.get_mut(id) else {
            return;
        };
        match entry.move_to(status) {
            Ok(_) => {
                if let Some(handle) = handle {
                    entry.handle = handle.clone();
                }
            }
            Err(from) => {
                tracing::error!(sandbox_id = %id, from = from.name(), to = status.name(), "refused status change in the registry");
            }
        }
    }

    /// Records `status` for `id` in the store only, where the store must say more than the
    /// registry: the release a pause without memory (or a resume dropping memory) goes
    /// through while the registry holds the claim that asked for it, and a new handle in the
    /// status recovery found. Every other status change goes through [`Self::transition`].
    pub(super) async fn record(
        &self,
        id: &str,
        status: SandboxStatus,
        handle: Option<&RuntimeHandle>,
    ) -> Result<(), StoreError> {
        self.store
            .sandboxes
            .set_sandbox_status(id, status, handle)
            .await
    }

    /// Moves sandbox `id` to `to` if the lifecycle allows it from the status the registry
    /// holds, with the store's record in step (see [`transition_plan`]). `handle`, when
    /// given, is the sandbox's new runtime handle, recorded with it. The status it had.
    pub(super) async fn transition(
        &self,
        id: &str,
        to: SandboxStatus,
        handle: Option<&RuntimeHandle>,
    ) -> Result<SandboxStatus, TransitionError> {
        let (from, plan) = {
            let mut live = self.live();
            let refused = |from| TransitionError::Refused {
                id: id.to_owned(),
                from,
                to,
            };
            let entry = live.get_mut(id).ok_or_else(|| refused(None))?;
            let from = entry.status;
            let plan = transition_plan(from, to).ok_or_else(|| refused(Some(from)))?;
            if plan.claim {
                entry.move_to(to).map_err(|from| refused(Some(from)))?;
            }
            (from, plan)
        };
        if plan.record
            && let Err(err) = self
                .store
                .sandboxes
                .set_sandbox_status(id, to, handle)
                .await
        {
            if plan.claim {
                self.set_status(id, from, None);
            }
            return Err(err.into());
        }
        if plan.claim {
            if let Some(handle) = handle
                && let Some(entry) = self.live().get_mut(id)
            {
                entry.handle = handle.clone();
            }
        } else {
            self.set_status(id, to, handle);
        }
        Ok(from)
    }

    /// Running sandboxes (ID and handle) that `pick` selects, read from the registry alone.
    pub(super) fn running_where(
        &self,
        pick: impl Fn(&str, &Live) -> bool,
    ) -> Vec<(String, RuntimeHandle)> {
        self.live()
            .iter()
            .filter(|(id, l)| l.status == SandboxStatus::Running && pick(id, l))
            .map(|(id, l)| (id.clone(), l.handle.clone()))
            .collect()
    }

    /// Ends the edge's connections to the agent of sandbox `id` and waits until the agent has
    /// closed its ends. The caller has marked the sandbox so that no new ones are made.
    pub(super) async fn end_agent_links(&self, id: &str) {
        let links = self
            .live()
            .get_mut(id)
            .map(|l| std::mem::replace(&mut l.agent_links, AgentLinks::new()));
        if let Some(links) = links
            && !links.end(AGENT_LINKS_PATIENCE).await
        {
            tracing::warn!(sandbox_id = %id, "connections to the agent did not close in time; a dump may fail");
        }
    }

    /// Records lifecycle event `event_type` of `sandbox`, as it is now.
    pub(super) fn lifecycle_event(&self, event_type: SandboxEventType, sandbox: &Sandbox) {
        self.activity
            .sandbox_event(SandboxEvent::of(event_type, sandbox, Utc::now()));
    }

    /// The same for a sandbox known by ID, whose record is read from the store.
    pub(super) async fn lifecycle_event_of(&self, event_type: SandboxEventType, id: &str) {
        match self.store.sandboxes.sandbox(id).await {
            Ok(Some(sandbox)) => self.lifecycle_event(event_type, &sandbox),
            Ok(None) => {}
            Err(err) => {
                tracing::warn!(sandbox_id = %id, error = %err, "sandbox event not recorded: cannot read the sandbox");
            }
        }
    }

    /// Destroys a sandbox claimed for stopping (`previous`: the status it had, if managed
    /// here) and ends its log with `event`. `record` is the sandbox's record when the caller
    /// read it already (its `killed` event is made from it); else it is read here.
    pub(super) async fn finish_stop(
        &self,
        id: &str,
        previous: Option<SandboxStatus>,
        handle: &RuntimeHandle,
        record: Option<&Sandbox>,
        level: LogLevel,
        event: &str,
    ) -> Result<(), SandboxError> {
        if previous.is_none_or(SandboxStatus::is_paused) {
            self.forget_shared_files(id).await;
        }
        // Destroying the sandbox removes its agent log: read what is left first.
        self.activity
            .ingest_agent_log(self.runtime.as_ref(), id)
            .await;
        // Read for its `killed` event while it is still recorded.
        let read = match record {
            Some(_) => None,
            None => self.store.sandboxes.sandbox(id).await.ok().flatten(),
        };
        let ending = record.or(read.as_ref());
        if let Err(err) = self.runtime.destroy(id, handle).await {
            if let Some(previous) = previous {
                self.set_status(id, previous, None);
            }
            return Err(err.into());
        }
        let deleted = self.store.sandboxes.delete_sandbox(id).await;
        self.live().remove(id);
        lock(&self.metrics).remove(id);
        deleted?;
        if let Some(ending) = ending {
            self.lifecycle_event(SandboxEventType::Killed, ending);
        }
        self.activity.close(id, level, event).await;
        tracing::info!(sandbox_id = %id, "sandbox stopped");
        Ok(())
    }

    /// Forgets the copy of a sandbox's files made while it was paused: it is waking, and
    /// what it writes from now on would not be in it.
    pub(super) async fn forget_shared_files(&self, id: &str) {
        if self.nodes.get().is_none() {
            return;
        }
        let _recording = self.shared_files.lock().await;
        for name in [
            LayerBlob::sandbox_files(id),
            LayerBlob::sandbox_checkpoint(id),
        ] {
            if let Err(err) = self.store.layer_blobs.delete_layer_blob(&name).await {
                tracing::warn!(sandbox_id = %id, layer = %name, error = %err, "cannot forget the copy of a woken sandbox");
            }
        }
    }

    /// Ends the processes of sandbox `id` (handle `handle`) and keeps only its files. It is
    /// recorded `pausing` meanwhile, so a restart in between finishes the job rather than
    /// taking it for dead; if the release fails the store says `before` again. The caller
    /// records the result.
    pub(super) async fn release_recorded(
        &self,
        id: &str,
        handle: &RuntimeHandle,
        before: SandboxStatus,
    ) -> Result<RuntimeHandle, SandboxError> {
        self.record(id, SandboxStatus::Pausing, Some(handle))
            .await?;
        match self.runtime.release(id, handle).await {
            Ok(released) => {
                crate::faults::crash_point("pause.released");
                Ok(released)
            }
            Err(err) => {
                if let Err(err) = self.record(id, before, Some(handle)).await {
                    tracing::error!(sandbox_id = %id, error = %err, "cannot record the sandbox as it was");
                }
                Err(err.into())
            }
        }
    }

    /// The data disk alone, as a report.
    pub(super) fn data_disk(&self) -> DiskReport {
        DiskReport {
            data: self.runtime.data_disk(),
            ..DiskReport::default()
        }
    }

    /// What sandbox `id` is now, if this node manages it.
    pub(super) fn status_of(&self, id: &str) -> Option<SandboxStatus> {
        self.live().get(id).map(|l| l.status)
    }
}

/// How long a node's claim of a team's slot counts if the node never lets go of it (it died
/// in the middle of a create): longer than any start takes.
const SLOT_CLAIM_LENGTH: TimeDelta = TimeDelta::minutes(10);

/// Lets go of a claimed slot when dropped, in the background (the sandbox's record, or its
/// failure to start, is what the other nodes go by from then on).
pub(super) struct SlotClaimGuard {
    store: Arc<Store>,
    sandbox_id: String,
}

impl Drop for SlotClaimGuard {
    fn drop(&mut self) {
        let store = self.store.clone();
        let id = std::mem::take(&mut self.sandbox_id);
        tokio::spawn(async move {
            if let Err(err) = store.nodes.release_team_slot(&id).await {
                tracing::warn!(sandbox_id = %id, error = %err, "cannot let go of a claimed slot; it lapses by itself");
            }
        });
    }
}
