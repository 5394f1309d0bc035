//! The sandbox lifecycle: create, look up, list, extend, kill, expire and recover.
//!
//! The store is the record of every sandbox; `live` mirrors the ones this process manages so
//! the edge can route without a query, and so the concurrency limit is checked and reserved
//! atomically while a sandbox is still starting.
//!
//! [`Sandboxes`] is built once per server and hands out its parts, one per concern, which
//! share that state: [`SandboxRegistry`] (create, look up, list), [`EdgeRoutes`] (where the
//! edge sends traffic), [`Lifecycle`] (timeouts, kill, pause, resume, checkpoints),
//! [`Recovery`] (after a restart, and take-overs from lost nodes), [`Snapshots`] (snapshots
//! and forks), [`SandboxActivity`] (logs and metrics), [`NodeHealth`] (what the node reports)
//! and [`Reaper`] (the background rounds).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::activity::ActivityConfig;
use crate::agent_links::{AgentLease, AgentLinks};
use crate::cluster::NodeDirectory;
use crate::lifecycle::SandboxStatus;
use crate::model::{Sandbox, SandboxState, Team};
use crate::network::{NetworkConfig, NetworkConfigError};
use crate::runtime::{Endpoint, Runtime, RuntimeError, RuntimeHandle};
use crate::store::{Store, StoreError};
use crate::templates::{TemplateError, Templates};
use crate::volumes::{MountRequest, VolumeMountError, Volumes};

mod activity;
mod health;
mod lifecycle;
mod pause;
mod reap;
mod recover;
mod registry;
mod routes;
mod sampling;
mod shared;
mod signers;
mod snapshots;
mod spawns;
mod take_over;
pub use activity::SandboxActivity;
pub use health::NodeHealth;
pub use lifecycle::Lifecycle;
pub use reap::Reaper;
pub use recover::Recovery;
pub use registry::SandboxRegistry;
pub use routes::EdgeRoutes;
use shared::Shared;
pub use snapshots::{ForkResult, SnapshotError, SnapshotInfo, SnapshotQuery, Snapshots};
pub use take_over::TakeOverError;

#[derive(Debug, Clone)]
pub struct SandboxesConfig {
    /// How long a create waits for its template to finish building.
    pub template_wait: Duration,
    /// User for agent calls that name none.
    pub default_user: String,
    /// What is kept of sandbox logs and team metrics.
    pub activity: ActivityConfig,
    /// How long a sandbox paused with its memory stays frozen in memory before it is
    /// checkpointed to disk (where the runtime can).
    pub pause_grace: Duration,
    /// The name of the node these sandboxes run on, recorded with each, so that in a cluster
    /// every node takes back only its own after a restart; empty on a single host.
    pub node_id: String,
}

impl Default for SandboxesConfig {
    fn default() -> Self {
        Self {
            template_wait: Duration::from_secs(900),
            default_user: "user".into(),
            activity: ActivityConfig::default(),
            pause_grace: Duration::from_secs(10),
            node_id: String::new(),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct CreateSandbox {
    pub template: String,
    pub timeout_secs: u64,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub allow_internet_access: bool,
    pub network: NetworkConfig,
    /// Pause instead of stopping when the timeout passes.
    pub auto_pause: bool,
    /// Resume on traffic when paused.
    pub auto_resume: bool,
    /// A pause on timeout keeps only the files (`autoPauseMemory: false`).
    pub auto_pause_files_only: bool,
    /// The team's volumes to mount, in order.
    pub volume_mounts: Vec<MountRequest>,
}

/// How long a sandbox woken by traffic lives before its timeout applies again.
const AUTO_RESUME_TIMEOUT_SECS: u64 = 300;

/// How long a pause or snapshot waits for the agent to close the edge's connections. It takes
/// microseconds; past this the dump is tried anyway (and fails without harm if one is left).
const AGENT_LINKS_PATIENCE: Duration = Duration::from_secs(2);

/// How long a request to a sandbox waits for another request's resume, or for a snapshot
/// of it to be taken, before it is answered that the sandbox is not running.
const ROUTE_PATIENCE: Duration = Duration::from_secs(60);

/// How long a kill or a connect waits for a pause, resume, checkpoint, restore or snapshot
/// under way to finish. A restore or a boot on kept files takes seconds; a dump a fraction of
/// a second per 100 MiB.
const TRANSITION_PATIENCE: Duration = Duration::from_secs(60);

/// Seconds a client refused for want of capacity is told to wait when no running sandbox is
/// due to end.
const CAPACITY_WAIT_SECS: i64 = 5;
/// How long a create's own bookkeeping (its log's first lines, the template's spawn count)
/// waits, so that it does not compete with the sandbox's first command, which usually comes
/// at once. As long as the warm pool's wait for a pause in creates.
const AFTER_CREATE_QUIET: Duration = Duration::from_millis(25);

/// What a stop found when it tried to mark a sandbox stopping.
enum Claim {
    /// Marked stopping; it had `previous` and is destroyed with `handle`.
    Claimed {
        previous: SandboxStatus,
        handle: RuntimeHandle,
    },
    /// Recorded in the store but not in the registry.
    Unmanaged,
    /// Another stop has it.
    Stopping,
    /// No longer what the stop was for (extended, paused or resumed meanwhile).
    Declined,
    /// On its way between two statuses.
    Busy(SandboxStatus),
}

/// The secrets a request must match for a sandbox to let it through, shown to the edge's
/// check before traffic wakes a paused sandbox.
#[derive(Debug, Clone, Copy)]
pub struct WakeKeys<'a> {
    /// The agent's access token; `None` when the sandbox was made without one.
    pub envd_access_token: Option<&'a str>,
    /// The token user ports need; `None` when they are public.
    pub traffic_access_token: Option<&'a str>,
}

/// How a sandbox's user ports may be reached, for the edge.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserPortAccess {
    /// Token a request must carry (`e2b-traffic-access-token`); `None`: public.
    pub traffic_access_token: Option<String>,
    /// Host header to send instead of the client's (with `${PORT}` still in it).
    pub mask_request_host: Option<String>,
    /// The agent's access token, which the code interpreter's port needs too; `None` when
    /// the sandbox was made without one.
    pub envd_access_token: Option<String>,
}

impl UserPortAccess {
    fn of(sandbox: &Sandbox) -> Self {
        Self {
            traffic_access_token: sandbox
                .traffic_access_token
                .clone()
                .filter(|_| !sandbox.network.allow_public_traffic),
            mask_request_host: sandbox.network.mask_request_host.clone(),
            envd_access_token: Some(sandbox.envd_access_token.clone()).filter(|t| !t.is_empty()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CreateSandboxError {
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Network(#[from] NetworkConfigError),
    #[error(transparent)]
    Volumes(#[from] VolumeMountError),
    #[error("timeout {requested}s is longer than this team's maximum of {max}s")]
    TimeoutTooLong { requested: u64, max: u64 },
    #[error("team has reached its limit of {limit} concurrent sandboxes")]
    ConcurrencyLimit {
        limit: u32,
        /// When a slot is expected to free up: the team's next sandbox timeout.
        retry_after_secs: u64,
    },
    #[error("template '{template_id}' needs {field} {value}, above this team's limit of {max}")]
    ResourceLimit {
        template_id: String,
        field: &'static str,
        value: u32,
        max: u32,
    },
    #[error("cannot start sandbox: {source}")]
    NoCapacity {
        source: RuntimeError,
        /// When capacity is expected back: this node's next sandbox timeout.
        retry_after_secs: u64,
    },
    #[error("cannot start sandbox: {0}")]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Errors of operations on one existing sandbox.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox '{0}' not found")]
    NotFound(String),
    #[error("timeout {requested}s is longer than this team's maximum of {max}s")]
    TimeoutTooLong { requested: u64, max: u64 },
    #[error("sandbox operation failed: {0}")]
    Runtime(#[from] RuntimeError),
    #[error("sandbox '{id}' is {state}")]
    Conflict { id: String, state: &'static str },
    #[error(
        "cannot resume sandbox '{id}': team has reached its limit of {limit} concurrent sandboxes"
    )]
    ConcurrencyLimit {
        id: String,
        limit: u32,
        retry_after_secs: u64,
    },
    #[error("cannot resume sandbox '{id}': {source}")]
    NoCapacity {
        id: String,
        source: RuntimeError,
        /// When capacity is expected back: this node's next sandbox timeout.
        retry_after_secs: u64,
    },
    #[error(transparent)]
    TakeOver(#[from] TakeOverError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Why a status change did not happen.
#[derive(Debug, thiserror::Error)]
pub enum TransitionError {
    #[error("sandbox '{id}' cannot become {to} from {}", .from.map_or("gone", SandboxStatus::name), to = .to.name())]
    Refused {
        id: String,
        /// `None`: not in the registry.
        from: Option<SandboxStatus>,
        to: SandboxStatus,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<TransitionError> for SandboxError {
    fn from(e: TransitionError) -> Self {
        match e {
            TransitionError::Refused { id, from: None, .. } => SandboxError::NotFound(id),
            TransitionError::Refused {
                id,
                from: Some(from),
                ..
            } => SandboxError::Conflict {
                id,
                state: from.name(),
            },
            TransitionError::Store(e) => SandboxError::Store(e),
        }
    }
}

/// What a transition does besides checking the lifecycle's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TransitionPlan {
    /// Set in the registry before the store is written: a transient status is a claim, which
    /// a second caller must find taken at once; given back if the store refuses it.
    claim: bool,
    /// Written to the store: a status a restart must see. A settled status enters the
    /// registry only once the store has it, so the registry never shows one a restart
    /// would not find.
    record: bool,
}

/// The plan for `from → to`; `None` when the lifecycle refuses it.
fn transition_plan(from: SandboxStatus, to: SandboxStatus) -> Option<TransitionPlan> {
    from.can_become(to).then_some(TransitionPlan {
        claim: to.is_transient(),
        record: to.is_recorded(),
    })
}

#[derive(Debug, thiserror::Error)]
pub enum UpdateNetworkError {
    #[error("sandbox '{0}' not found")]
    NotFound(String),
    #[error(transparent)]
    Invalid(#[from] NetworkConfigError),
    #[error("cannot change the network of sandbox {sandbox_id}: {source}")]
    Runtime {
        sandbox_id: String,
        source: RuntimeError,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum ListSandboxesError {
    #[error("invalid nextToken '{0}'")]
    BadToken(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    /// Every pair must match exactly.
    pub metadata: BTreeMap<String, String>,
    /// `None` means every state.
    pub states: Option<Vec<SandboxState>>,
    pub limit: usize,
    pub next_token: Option<String>,
    /// Oldest first instead of newest first.
    pub ascending: bool,
    /// Only sandboxes started at or after this.
    pub started_after: Option<DateTime<Utc>>,
    /// Only sandboxes of this template, named by ID or by any of its names.
    pub template: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub next_token: Option<String>,
    /// Running sandboxes matching the filters on every page.
    pub running_total: usize,
    /// Sandboxes matching the filters on every page, in any state.
    pub total: usize,
}

/// Where the edge sends a request for a running sandbox.
#[derive(Debug)]
pub struct Route {
    pub endpoint: Endpoint,
    /// Held while a connection to the agent is open: a pause or a snapshot asks the edge to
    /// close such connections and waits for the leases to come back.
    pub agent: AgentLease,
}

impl Route {
    fn of(live: &Live) -> Option<Self> {
        Some(Route {
            endpoint: live.endpoint.clone()?,
            agent: live.agent_links.lease(),
        })
    }
}

#[derive(Debug, Clone)]
struct Live {
    team_id: String,
    end_at: DateTime<Utc>,
    endpoint: Option<Endpoint>,
    /// The agent's access token; listed in [`Shared::signers`] while this holds it.
    access_token: Arc<str>,
    /// What the runtime needs to check on or stop the sandbox; empty while starting.
    handle: RuntimeHandle,
    status: SandboxStatus,
    user_ports: UserPortAccess,
    auto_pause: bool,
    auto_resume: bool,
    cpu_count: u32,
    memory_mb: u32,
    disk_size_mb: u32,
    /// When it was last frozen in memory (the grace before a checkpoint runs from there).
    paused_at: Option<DateTime<Utc>>,
    /// Checkpoints that failed since it was last paused; after [`CHECKPOINT_ATTEMPTS`] it
    /// stays in memory until it is paused again.
    checkpoint_failures: u8,
    /// The edge's open connections to its agent, ended before it is frozen for a dump.
    agent_links: AgentLinks,
    /// Times it was woken since this server knew it: a copy of its files made before the
    /// latest wake is stale.
    wakes: u64,
    /// The value of `wakes` when its files were last copied to the cluster's layer store:
    /// equal to `wakes`, the copy is of this pause.
    files_shared_at: Option<u64>,
    /// The same for the checkpoint of its processes, copied once it is checkpointed.
    memory_shared_at: Option<u64>,
}

impl Live {
    /// Moves the entry to `to` if the lifecycle's table allows it from where it is; the
    /// status it had, or the one that refused. Every change of a status in the registry is
    /// made here.
    fn move_to(&mut self, to: SandboxStatus) -> Result<SandboxStatus, SandboxStatus> {
        if !self.status.can_become(to) {
            return Err(self.status);
        }
        Ok(std::mem::replace(&mut self.status, to))
    }

    /// The registry entry of a sandbox the store recorded, taken back after a restart.
    fn recorded(
        signers: &signers::Signers,
        sandbox: &Sandbox,
        handle: RuntimeHandle,
        endpoint: Option<Endpoint>,
        status: SandboxStatus,
    ) -> Self {
        Live {
            team_id: sandbox.team_id.clone(),
            end_at: sandbox.end_at,
            endpoint,
            access_token: signers.list(&sandbox.id, &sandbox.envd_access_token),
            handle,
            status,
            user_ports: UserPortAccess::of(sandbox),
            auto_pause: sandbox.auto_pause,
            auto_resume: sandbox.auto_resume,
            cpu_count: sandbox.cpu_count,
            memory_mb: sandbox.memory_mb,
            disk_size_mb: sandbox.disk_size_mb,
            // The grace before a checkpoint counts from when this server saw it frozen.
            paused_at: (status == SandboxStatus::Paused).then(Utc::now),
            checkpoint_failures: 0,
            agent_links: AgentLinks::new(),
            wakes: 0,
            files_shared_at: None,
            memory_shared_at: None,
        }
    }
}

/// One sample of a sandbox's resource use, as `GET /sandboxes/{id}/metrics` reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricPoint {
    pub at: DateTime<Utc>,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// Checkpoints tried for one pause: a dump can fail on a passing state of the sandbox's
/// sockets (CRIU not finding a Unix socket's peer), which a later attempt does not meet.
const CHECKPOINT_ATTEMPTS: u8 = 3;

/// How often sandboxes are sampled, and for how long samples are kept.
const METRICS_EVERY_ROUNDS: u64 = 4;
const METRICS_KEPT: usize = 1800;
/// Team activity is written once per bucket (5 s), old logs and metrics pruned every 10 min.
const TEAM_METRICS_EVERY_ROUNDS: u64 = 10;
const PRUNE_EVERY_ROUNDS: u64 = 1200;

#[derive(Debug, Default)]
struct MetricSeries {
    last_cpu: Option<(std::time::Instant, u64)>,
    /// The sandbox's out-of-memory kill count at the last sample.
    oom_kills: Option<u64>,
    points: std::collections::VecDeque<MetricPoint>,
}

/// The sandboxes of this server, built once at its start. Each part holds one concern; all
/// of them share the store, the runtime and the registry of live sandboxes.
pub struct Sandboxes {
    shared: Arc<Shared>,
    registry: SandboxRegistry,
    routes: EdgeRoutes,
    lifecycle: Lifecycle,
    recovery: Recovery,
    snapshots: Snapshots,
    activity: SandboxActivity,
    health: NodeHealth,
    reaper: Reaper,
}

impl std::fmt::Debug for Sandboxes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandboxes")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl Sandboxes {
    pub fn new(
        store: Arc<Store>,
        runtime: Arc<dyn Runtime>,
        templates: Templates,
        config: SandboxesConfig,
    ) -> Self {
        let shared = Arc::new(Shared::new(store, runtime, templates, config));
        let registry = SandboxRegistry::new(shared.clone());
        let recovery = Recovery::new(shared.clone());
        let lifecycle = Lifecycle::new(shared.clone(), recovery.clone());
        let activity = SandboxActivity::new(shared.clone());
        Self {
            routes: EdgeRoutes::new(shared.clone(), lifecycle.clone()),
            snapshots: Snapshots::new(shared.clone(), registry.clone()),
            health: NodeHealth::new(shared.clone()),
            reaper: Reaper::new(shared.clone(), lifecycle.clone(), activity.clone()),
            shared,
            registry,
            lifecycle,
            recovery,
            activity,
        }
    }

    /// The teams' webhooks, once the server has set them up.
    pub fn webhooks(&self) -> Option<&crate::webhooks::Webhooks> {
        self.shared.activity.webhooks()
    }

    /// Delivers the sandboxes' lifecycle events to their teams' webhooks from now on.
    pub fn deliver_events_to(&self, webhooks: crate::webhooks::Webhooks) {
        self.shared.activity.deliver_to(webhooks);
    }

    /// Shares the store with the nodes in `nodes`: a team's limit counts its sandboxes on
    /// every live node, and running sandboxes of lost nodes are not listed. Given once,
    /// while the server is built.
    pub fn with_cluster(self, nodes: Arc<NodeDirectory>) -> Self {
        if self.shared.nodes.set(nodes).is_err() {
            tracing::warn!("the cluster's nodes were given twice; the first are kept");
        }
        self
    }

    /// Lets sandboxes mount the team's volumes. Given once, while the server is built.
    pub fn with_volumes(self, volumes: Arc<Volumes>) -> Self {
        if self.shared.volumes.set(volumes).is_err() {
            tracing::warn!("the volumes were given twice; the first are kept");
        }
        self
    }

    pub fn volumes(&self) -> Option<&Arc<Volumes>> {
        self.shared.volumes.get()
    }

    /// Creating sandboxes, and looking them up and listing them.
    pub fn registry(&self) -> &SandboxRegistry {
        &self.registry
    }

    /// Where the edge sends a request naming a sandbox, and what it lets through.
    pub fn routes(&self) -> &EdgeRoutes {
        &self.routes
    }

    /// Timeouts, kills, network updates, pauses, resumes and checkpoints to disk.
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    /// Taking sandboxes back after a restart, and over from lost nodes of a cluster.
    pub fn recovery(&self) -> &Recovery {
        &self.recovery
    }

    /// Snapshots of running sandboxes, and forks.
    pub fn snapshots(&self) -> &Snapshots {
        &self.snapshots
    }

    /// Sandbox logs, resource samples and team metrics.
    pub fn activity(&self) -> &SandboxActivity {
        &self.activity
    }

    /// What this node reports about itself: memory, disks, counts and problems.
    pub fn health(&self) -> &NodeHealth {
        &self.health
    }

    /// The background rounds that expire, checkpoint and clean up sandboxes.
    pub fn reaper(&self) -> &Reaper {
        &self.reaper
    }
}

fn seconds(secs: u64) -> TimeDelta {
    TimeDelta::seconds(
        i64::try_from(secs)
            .unwrap_or(i64::MAX / 1000)
            .min(i64::MAX / 1000),
    )
}

/// Seconds until one of the team's slots is expected to free up: its next sandbox timeout. A
/// kill can free a slot at any moment, so a client is never told to wait more than a minute
/// even when the team's sandboxes live for hours.
fn slot_wait(live: &HashMap<String, Live>, team: &Team) -> u64 {
    let now = Utc::now();
    let next_end = live
        .values()
        .filter(|l| l.team_id == team.id && l.status.holds_a_slot())
        .map(|l| l.end_at)
        .min()
        .unwrap_or(now);
    (next_end - now).num_seconds().clamp(1, 60) as u64
}

#[cfg(test)]
mod tests {
    use super::{SandboxStatus, TransitionPlan, transition_plan};

    #[test]
    fn every_allowed_transition_has_a_plan_and_every_other_is_refused() {
        for from in SandboxStatus::ALL {
            for to in SandboxStatus::ALL {
                let plan = transition_plan(from, to);
                if !from.can_become(to) {
                    assert_eq!(plan, None, "{from:?} -> {to:?}");
                    continue;
                }
                let plan = plan.unwrap_or_else(|| panic!("{from:?} -> {to:?} refused"));
                assert_eq!(plan.claim, to.is_transient(), "{from:?} -> {to:?}");
                assert_eq!(plan.record, to.is_recorded(), "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn a_checkpoint_is_recorded_before_it_starts_and_when_it_ends() {
        use SandboxStatus::*;
        let claim = transition_plan(Paused, Checkpointing);
        assert_eq!(
            claim,
            Some(TransitionPlan {
                claim: true,
                record: true
            })
        );
        for to in [Checkpointed, Paused] {
            assert_eq!(
                transition_plan(Checkpointing, to),
                Some(TransitionPlan {
                    claim: false,
                    record: true
                })
            );
        }
        // Claims a restart need not see stay in the registry.
        for (from, to) in [
            (Running, Pausing),
            (Paused, Resuming),
            (Checkpointed, Restoring),
            (Running, Snapshotting),
        ] {
            assert_eq!(
                transition_plan(from, to),
                Some(TransitionPlan {
                    claim: true,
                    record: false
                }),
                "{from:?} -> {to:?}"
            );
        }
        assert_eq!(transition_plan(Checkpointing, Running), None);
        assert_eq!(transition_plan(Shelved, Checkpointing), None);
    }
}
