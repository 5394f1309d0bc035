//! The sandbox lifecycle: create, look up, list, extend, kill, expire and recover.
//!
//! The store is the record of every sandbox; `live` mirrors the ones this process manages so
//! the edge can route without a query, and so the concurrency limit is checked and reserved
//! atomically while a sandbox is still starting.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::activity::{Activity, ActivityConfig};
use crate::agent_links::{AgentLease, AgentLinks};
use crate::builds::LogLevel;
use crate::ids;
use crate::lifecycle::SandboxStatus;
use crate::model::{Sandbox, SandboxState, Team, Template, TemplateImage};
use crate::network::{EgressConfig, EgressRules, NetworkConfig, NetworkConfigError};
use crate::runtime::{Endpoint, LaunchSpec, Runtime, RuntimeError, RuntimeHandle};
use crate::sandbox_logs::{SandboxLogEntry, SandboxLogQuery, SandboxLogsError};
use crate::store::{Store, StoreError};
use crate::team_metrics::{TeamMetric, TeamMetricMax, TeamMetricPoint, TeamMetricsError};
use crate::templates::{TemplateError, Templates};
use crate::volumes::{MountRequest, VolumeMount, VolumeMountError, Volumes};

mod metrics;
mod pause;
mod reap;
mod recover;
mod signers;
mod snapshots;
mod take_over;
pub use snapshots::{ForkResult, SnapshotError, SnapshotInfo, SnapshotQuery};
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

/// Whether a sandbox's end has passed, read at the moment of the check.
fn expired(live: &Live) -> bool {
    live.end_at <= Utc::now()
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
    /// The agent's access token; listed in [`Sandboxes::signers`] while this holds it.
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

pub struct Sandboxes {
    store: Arc<dyn Store>,
    runtime: Arc<dyn Runtime>,
    templates: Templates,
    config: SandboxesConfig,
    live: Mutex<HashMap<String, Live>>,
    /// The agent tokens of the sandboxes in `live`, searched without its lock.
    signers: signers::Signers,
    /// Network updates run one at a time, so the firewall and the store agree on the last.
    network_updates: tokio::sync::Mutex<()>,
    metrics: Mutex<HashMap<String, MetricSeries>>,
    volumes: Option<Arc<Volumes>>,
    activity: Activity,
    /// The cluster's nodes, where this host shares its store with others.
    nodes: Option<Arc<crate::cluster::NodeDirectory>>,
    /// Held while a paused sandbox's shared files are recorded or forgotten, so a copy made
    /// before a wake is never recorded after it.
    shared_files: tokio::sync::Mutex<()>,
    /// One take-over of another node's sandbox at a time.
    take_overs: tokio::sync::Mutex<()>,
    /// Set while the reaper's checkpoint of a paused sandbox runs beside it: one at a time,
    /// since a dump holds a CPU, and never on the reaper's own path.
    checkpoint_running: Arc<std::sync::atomic::AtomicBool>,
    /// Held by a snapshot from counting the team's snapshots to recording its own.
    snapshot_gate: crate::caps::TeamGate,
}

impl std::fmt::Debug for Sandboxes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandboxes")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn seconds(secs: u64) -> TimeDelta {
    TimeDelta::seconds(
        i64::try_from(secs)
            .unwrap_or(i64::MAX / 1000)
            .min(i64::MAX / 1000),
    )
}

fn page_token(sandbox: &Sandbox) -> String {
    hex::encode(format!(
        "{}:{}",
        sandbox.started_at.timestamp_micros(),
        sandbox.id
    ))
}

fn parse_page_token(token: &str) -> Option<(i64, String)> {
    let raw = String::from_utf8(hex::decode(token).ok()?).ok()?;
    let (micros, id) = raw.split_once(':')?;
    Some((micros.parse().ok()?, id.to_owned()))
}

impl Sandboxes {
    pub fn new(
        store: Arc<dyn Store>,
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
            signers: signers::Signers::default(),
            network_updates: tokio::sync::Mutex::new(()),
            snapshot_gate: crate::caps::TeamGate::default(),
            metrics: Mutex::new(HashMap::new()),
            volumes: None,
            nodes: None,
            shared_files: tokio::sync::Mutex::new(()),
            take_overs: tokio::sync::Mutex::new(()),
            checkpoint_running: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    /// Shares the store with the nodes in `nodes`: a team's limit counts its sandboxes on
    /// every live node, and running sandboxes of lost nodes are not listed.
    pub fn with_cluster(mut self, nodes: Arc<crate::cluster::NodeDirectory>) -> Self {
        self.nodes = Some(nodes);
        self
    }

    /// Whether a sandbox is listed: its node holds its lease (always, on a single host), or
    /// it is paused, which a resume on another node can take over.
    fn listable(&self, sandbox: &Sandbox) -> bool {
        sandbox.status.is_paused()
            || self
                .nodes
                .as_ref()
                .is_none_or(|nodes| nodes.is_live(&sandbox.node_id))
    }

    /// In a cluster: claims in the store one of the team's slots for sandbox `id`, counted
    /// against every slot the team holds on this node and the other live nodes as the store
    /// shows them (records, and claims of starts and resumes not recorded yet). The claim is
    /// let go when the returned guard drops.
    async fn claim_slot(
        &self,
        team: &Team,
        id: &str,
    ) -> Result<Option<SlotClaimGuard>, CreateSandboxError> {
        let Some(nodes) = &self.nodes else {
            return Ok(None);
        };
        let live: Vec<String> = nodes.live().into_iter().map(|n| n.id).collect();
        let slot_statuses: Vec<&str> = SandboxStatus::ALL
            .iter()
            .filter(|s| s.holds_a_slot())
            .map(|s| s.name())
            .collect();
        let claim = crate::model::SlotClaim {
            sandbox_id: id.to_owned(),
            team_id: team.id.clone(),
            node_id: self.config.node_id.clone(),
            until: Utc::now() + SLOT_CLAIM_LENGTH,
        };
        if self
            .store
            .claim_team_slot(
                &claim,
                team.max_concurrent_sandboxes as usize,
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
                limit: team.max_concurrent_sandboxes,
                retry_after_secs: CAPACITY_WAIT_SECS.unsigned_abs(),
            })
        }
    }

    /// Lets sandboxes mount the team's volumes.
    pub fn with_volumes(mut self, volumes: Arc<Volumes>) -> Self {
        self.volumes = Some(volumes);
        self
    }

    pub fn volumes(&self) -> Option<&Arc<Volumes>> {
        self.volumes.as_ref()
    }

    fn live(&self) -> MutexGuard<'_, HashMap<String, Live>> {
        // A panic while holding this lock leaves plain data behind, still consistent enough to
        // serve: recover it rather than poisoning every later request.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub async fn create(
        &self,
        team: &Team,
        request: CreateSandbox,
    ) -> Result<Sandbox, CreateSandboxError> {
        if request.timeout_secs > team.max_sandbox_timeout_secs {
            return Err(CreateSandboxError::TimeoutTooLong {
                requested: request.timeout_secs,
                max: team.max_sandbox_timeout_secs,
            });
        }
        let egress = request.network.validate(request.allow_internet_access)?;
        let template = self.templates.resolve(team, &request.template).await?;
        let template = self
            .templates
            .wait_ready(template, self.config.template_wait)
            .await?;
        self.create_from(team, request, template, egress).await
    }

    /// Starts a sandbox of `template` (whose image is the one it starts from) for a request
    /// already checked against the team's timeout and with its egress rules validated.
    async fn create_from(
        &self,
        team: &Team,
        request: CreateSandbox,
        template: Template,
        egress: EgressRules,
    ) -> Result<Sandbox, CreateSandboxError> {
        check_resources(team, &template)?;
        // After the wait for the template: the guard holds off volume deletes until the
        // mounts are recorded, which must not include a build's duration.
        let (mounts, _mounting) = match (&self.volumes, request.volume_mounts.is_empty()) {
            (_, true) => (Vec::new(), None),
            (None, false) => return Err(VolumeMountError::Disabled.into()),
            (Some(volumes), false) => {
                let (mounts, guard) = volumes.resolve_mounts(team, &request.volume_mounts).await?;
                (mounts, Some(guard))
            }
        };

        let id = ids::new_sandbox_id();
        let now = Utc::now();
        let reservation = self.reserve(team, &id, now + seconds(request.timeout_secs))?;
        // Held until the sandbox is recorded (the end of this function): until then the
        // claim is what the other nodes count.
        let _claim = self.claim_slot(team, &id).await?;

        let Some(image) = template.image.clone() else {
            return Err(TemplateError::StillBuilding(template.id.clone()).into());
        };
        // Restored from the template's capture with its start command running, where the
        // node can restore; the record names the layers the sandbox's files are on.
        let image = match image.restored_from_capture() {
            Some(restored) if self.runtime.checkpoints_ready().await => restored,
            _ => image,
        };
        let booted_from = image.clone();
        let spec = launch_spec(&id, &request, &template, image, egress, mounts.clone());
        let token = spec.envd_access_token.clone();
        let (handle, endpoint) = self.runtime.launch(spec).await.map_err(|err| match err {
            RuntimeError::NoCapacity { .. } => CreateSandboxError::NoCapacity {
                source: err,
                retry_after_secs: self.capacity_wait(),
            },
            err => err.into(),
        })?;

        // The timeout runs from the moment the sandbox is usable, not from the request.
        let sandbox =
            self.started_sandbox(&id, team, request, &template, handle, token, booted_from);
        self.record_started(&sandbox, &mounts).await?;
        reservation.keep();
        // Started before the sandbox counts as running; the reaper's reads of its agent log
        // wait for the log to exist.
        self.log_start(&sandbox, now);
        self.make_routable(&sandbox, endpoint);
        self.record_spawn_later(&template.id, sandbox.started_at);
        tracing::info!(sandbox_id = %id, template_id = %template.id, "sandbox started");
        Ok(sandbox)
    }

    /// The record of a sandbox of `template` just started for `request`, whose timeout runs
    /// from now.
    #[allow(clippy::too_many_arguments)]
    fn started_sandbox(
        &self,
        id: &str,
        team: &Team,
        request: CreateSandbox,
        template: &Template,
        handle: RuntimeHandle,
        envd_access_token: String,
        booted_from: TemplateImage,
    ) -> Sandbox {
        let started_at = Utc::now();
        let named = &request.template;
        let alias = template
            .aliases
            .iter()
            .find(|a| named.strip_suffix(":default").unwrap_or(named) == a.as_str())
            .or(template.aliases.first())
            .cloned();
        Sandbox {
            id: id.to_owned(),
            team_id: team.id.clone(),
            template_id: template.id.clone(),
            alias,
            started_at,
            end_at: started_at + seconds(request.timeout_secs),
            cpu_count: template.cpu_count,
            memory_mb: template.memory_mb,
            disk_size_mb: template.disk_size_mb,
            metadata: request.metadata,
            env_vars: request.env_vars,
            allow_internet_access: request.allow_internet_access,
            traffic_access_token: (!request.network.allow_public_traffic)
                .then(|| ids::new_secret("")),
            network: request.network,
            envd_access_token,
            envd_version: template.envd_version.clone(),
            status: SandboxStatus::Running,
            handle,
            auto_pause: request.auto_pause,
            auto_resume: request.auto_resume,
            auto_pause_memory: !request.auto_pause_files_only,
            image: Some(booted_from),
            node_id: self.config.node_id.clone(),
        }
    }

    /// Records a started sandbox and its volume mounts; if that fails, the sandbox is
    /// destroyed, since nothing could find it again.
    async fn record_started(
        &self,
        sandbox: &Sandbox,
        mounts: &[VolumeMount],
    ) -> Result<(), CreateSandboxError> {
        let id = &sandbox.id;
        let recorded = match self.store.insert_sandbox(sandbox).await {
            Ok(()) if mounts.is_empty() => Ok(()),
            Ok(()) => {
                let mounted = self.store.insert_sandbox_volumes(id, mounts).await;
                if mounted.is_err()
                    && let Err(err) = self.store.delete_sandbox(id).await
                {
                    tracing::error!(sandbox_id = %id, error = %err, "cannot remove half-recorded sandbox");
                }
                mounted
            }
            Err(err) => Err(err),
        };
        if let Err(err) = recorded {
            if let Err(destroy) = self.runtime.destroy(id, &sandbox.handle).await {
                tracing::error!(sandbox_id = %id, error = %destroy, "cannot clean up unrecorded sandbox");
            }
            return Err(err.into());
        }
        Ok(())
    }

    /// Gives a recorded sandbox's registry entry its endpoint, tokens and limits, then lets
    /// traffic reach it.
    fn make_routable(&self, sandbox: &Sandbox, endpoint: Endpoint) {
        let id = &sandbox.id;
        if let Some(entry) = self.live().get_mut(id) {
            entry.endpoint = Some(endpoint);
            entry.access_token = self.signers.list(id, &sandbox.envd_access_token);
            entry.handle = sandbox.handle.clone();
            entry.end_at = sandbox.end_at;
            entry.user_ports = UserPortAccess::of(sandbox);
            entry.auto_pause = sandbox.auto_pause;
            entry.auto_resume = sandbox.auto_resume;
            entry.cpu_count = sandbox.cpu_count;
            entry.memory_mb = sandbox.memory_mb;
            entry.disk_size_mb = sandbox.disk_size_mb;
        }
        // Routable only now that its endpoint and token are in place.
        self.set_status(id, SandboxStatus::Running, None);
    }

    /// Counts a spawn of `template_id`: a statistic nothing waits for, written after the
    /// first command had its chance.
    fn record_spawn_later(&self, template_id: &str, started_at: DateTime<Utc>) {
        let store = self.store.clone();
        let template_id = template_id.to_owned();
        tokio::spawn(async move {
            tokio::time::sleep(AFTER_CREATE_QUIET).await;
            if let Err(err) = store.record_template_spawn(&template_id, started_at).await {
                tracing::warn!(%template_id, error = %err, "cannot record template spawn");
            }
        });
    }

    /// The first lines of a new sandbox's log, and its start in the team's metrics.
    fn log_start(&self, sandbox: &Sandbox, requested_at: DateTime<Utc>) {
        let mut created = vec![
            ("templateID", sandbox.template_id.clone()),
            ("endAt", sandbox.end_at.to_rfc3339()),
        ];
        if let Some(alias) = &sandbox.alias {
            created.push(("alias", alias.clone()));
        }
        let startup_ms = (sandbox.started_at - requested_at).num_milliseconds();
        let entries = vec![
            SandboxLogEntry::event(requested_at, LogLevel::Info, "sandbox created", &created),
            SandboxLogEntry::event(
                sandbox.started_at,
                LogLevel::Info,
                "sandbox started",
                &[("startupMs", startup_ms.to_string())],
            ),
        ];
        self.activity.open_soon(
            &sandbox.id,
            &sandbox.team_id,
            requested_at,
            entries,
            AFTER_CREATE_QUIET,
        );
        let running = self
            .live()
            .values()
            .filter(|l| l.team_id == sandbox.team_id && l.status.holds_a_slot())
            .count();
        self.activity
            .started(&sandbox.team_id, u32::try_from(running).unwrap_or(u32::MAX));
    }

    /// A team's sandbox's log, also after the sandbox ended (for the retention period).
    pub async fn logs(
        &self,
        team: &Team,
        id: &str,
        query: &SandboxLogQuery,
    ) -> Result<Vec<SandboxLogEntry>, SandboxLogsError> {
        self.activity.logs(team, id, query).await
    }

    /// `team_id`'s activity from `start` to `end` (Unix seconds); only `team`'s own.
    pub async fn team_metrics(
        &self,
        team: &Team,
        team_id: &str,
        start: Option<i64>,
        end: Option<i64>,
    ) -> Result<Vec<TeamMetricPoint>, TeamMetricsError> {
        self.activity.team_metrics(team, team_id, start, end).await
    }

    /// The largest value of `metric` for `team_id` from `start` to `end`.
    pub async fn team_metric_max(
        &self,
        team: &Team,
        team_id: &str,
        metric: TeamMetric,
        start: Option<i64>,
        end: Option<i64>,
    ) -> Result<TeamMetricMax, TeamMetricsError> {
        self.activity
            .team_metric_max(team, team_id, metric, start, end)
            .await
    }

    /// Takes one of the team's slots on this node for sandbox `id` (marked starting).
    /// Counts sandbox `id` against its team's concurrency from now on, before its launch.
    fn reserve(
        &self,
        team: &Team,
        id: &str,
        end_at: DateTime<Utc>,
    ) -> Result<Reservation<'_>, CreateSandboxError> {
        let mut live = self.live();
        let active = live
            .values()
            .filter(|l| l.team_id == team.id && l.status.holds_a_slot())
            .count();
        if active >= team.max_concurrent_sandboxes as usize {
            return Err(CreateSandboxError::ConcurrencyLimit {
                limit: team.max_concurrent_sandboxes,
                retry_after_secs: slot_wait(&live, team),
            });
        }
        live.insert(
            id.to_owned(),
            Live {
                team_id: team.id.clone(),
                end_at,
                endpoint: None,
                access_token: Arc::from(""),
                handle: RuntimeHandle::default(),
                status: SandboxStatus::Starting,
                user_ports: UserPortAccess::default(),
                auto_pause: false,
                auto_resume: false,
                cpu_count: 0,
                memory_mb: 0,
                disk_size_mb: 0,
                paused_at: None,
                checkpoint_failures: 0,
                agent_links: AgentLinks::new(),
                wakes: 0,
                files_shared_at: None,
                memory_shared_at: None,
            },
        );
        Ok(Reservation {
            sandboxes: self,
            id: id.to_owned(),
            kept: false,
        })
    }

    /// A team's sandbox; another team's is reported as not found.
    pub async fn get(&self, team: &Team, id: &str) -> Result<Sandbox, SandboxError> {
        let stopping = self
            .live()
            .get(id)
            .is_some_and(|l| l.status == SandboxStatus::Stopping);
        match self.store.sandbox(id).await? {
            Some(sandbox) if sandbox.team_id == team.id && !stopping => Ok(sandbox),
            _ => Err(SandboxError::NotFound(id.to_owned())),
        }
    }

    /// Processes killed for reaching their sandbox's memory limit (see [`Runtime::oom_kills`]).
    pub fn oom_kills(&self) -> u64 {
        self.runtime.oom_kills()
    }

    /// The node's memory as measured now.
    pub fn memory(&self) -> Option<crate::runtime::MemoryReport> {
        self.runtime.memory()
    }

    /// Sandboxes the node keeps booted ahead of demand.
    pub fn warm_pool(&self) -> Option<crate::runtime::WarmPoolReport> {
        self.runtime.warm_pool()
    }

    /// The sandboxes' disk rates and what they read and wrote.
    pub fn disk_io(&self) -> Option<crate::runtime::DiskIoReport> {
        self.runtime.disk_io()
    }

    /// The node's disks as measured now.
    pub fn disks(&self) -> crate::disks::DiskReport {
        self.runtime.disks()
    }

    /// What ails this node, one sentence each: its disks, and paused sandboxes that stay in
    /// memory because their checkpoint was refused or abandoned (counted, not named: the
    /// answer is public, and each sandbox's log says why).
    pub fn health_problems(&self) -> Vec<String> {
        let mut problems = self.disks().problems();
        let kept = self
            .live()
            .values()
            .filter(|l| {
                l.status == SandboxStatus::Paused && l.checkpoint_failures >= CHECKPOINT_ATTEMPTS
            })
            .count();
        if kept > 0 {
            problems.push(format!(
                "{kept} paused sandbox{} stay{} in memory: {} checkpoint to disk was refused or did not finish; each sandbox's log says why",
                if kept == 1 { "" } else { "es" },
                if kept == 1 { "s" } else { "" },
                if kept == 1 { "its" } else { "their" },
            ));
        }
        problems
    }

    /// Refuses, naming the disk, work that would write to a data disk without room for it.
    pub fn room_to_write(&self) -> Result<(), crate::disks::DiskFull> {
        self.data_disk().write_refusal().map_or(Ok(()), Err)
    }

    /// The data disk alone, as a report.
    fn data_disk(&self) -> crate::disks::DiskReport {
        crate::disks::DiskReport {
            data: self.runtime.data_disk(),
            ..crate::disks::DiskReport::default()
        }
    }

    pub fn count_by_status(&self) -> Vec<(SandboxStatus, usize)> {
        let live = self.live();
        SandboxStatus::ALL
            .iter()
            .map(|&status| (status, live.values().filter(|l| l.status == status).count()))
            .collect()
    }

    pub async fn list(
        &self,
        team: &Team,
        query: &ListQuery,
    ) -> Result<Page<Sandbox>, ListSandboxesError> {
        let after = query
            .next_token
            .as_deref()
            .map(|t| parse_page_token(t).ok_or_else(|| ListSandboxesError::BadToken(t.to_owned())))
            .transpose()?;
        let stopping: Vec<String> = self
            .live()
            .iter()
            .filter(|(_, l)| l.status == SandboxStatus::Stopping)
            .map(|(id, _)| id.clone())
            .collect();
        let mut sandboxes = self.store.team_sandboxes(&team.id).await?;
        if query.ascending {
            sandboxes.reverse();
        }
        // A name resolves to one template; an unknown name simply matches nothing.
        let template_id = match &query.template {
            Some(name) => Some(
                self.templates
                    .resolve(team, name)
                    .await
                    .map(|t| t.id)
                    .unwrap_or_else(|_| name.clone()),
            ),
            None => None,
        };
        let filtered: Vec<Sandbox> = sandboxes
            .into_iter()
            .filter(|s| !stopping.contains(&s.id))
            // A lost node's sandboxes are neither running nor paused anywhere the API can
            // reach: they are left out until the node comes back.
            .filter(|s| self.listable(s))
            .filter(|s| s.status != SandboxStatus::Stopping)
            .filter(|s| {
                query
                    .states
                    .as_ref()
                    .is_none_or(|st| st.contains(&s.state()))
            })
            .filter(|s| {
                query
                    .metadata
                    .iter()
                    .all(|(k, v)| s.metadata.get(k) == Some(v))
            })
            .filter(|s| query.started_after.is_none_or(|t| s.started_at >= t))
            .filter(|s| {
                template_id.as_ref().is_none_or(|id| {
                    s.template_id == *id || s.alias.as_ref() == query.template.as_ref()
                })
            })
            .collect();
        let running_total = filtered
            .iter()
            .filter(|s| s.state() == SandboxState::Running)
            .count();
        let mut matching = filtered.into_iter().filter(|s| match &after {
            None => true,
            Some((micros, id)) => {
                let position = (s.started_at.timestamp_micros(), s.id.as_str());
                let cursor = (*micros, id.as_str());
                if query.ascending {
                    position > cursor
                } else {
                    position < cursor
                }
            }
        });
        let items: Vec<Sandbox> = matching.by_ref().take(query.limit).collect();
        let next_token = match (items.last(), matching.next()) {
            (Some(last), Some(_)) => Some(page_token(last)),
            _ => None,
        };
        Ok(Page {
            items,
            next_token,
            running_total,
        })
    }

    /// Sets the end time to `timeout_secs` from now; may shorten the sandbox's life.
    pub async fn set_timeout(
        &self,
        team: &Team,
        id: &str,
        timeout_secs: u64,
    ) -> Result<(), SandboxError> {
        self.check_timeout(team, timeout_secs)?;
        let sandbox = self.get(team, id).await?;
        let end_at = Utc::now() + seconds(timeout_secs);
        self.set_end(&sandbox, end_at).await?;
        self.activity
            .event(
                id,
                LogLevel::Info,
                "sandbox timeout set",
                &[("endAt", end_at.to_rfc3339())],
            )
            .await;
        Ok(())
    }

    /// Extends the end time to `timeout_secs` from now unless it is already later.
    pub async fn extend(
        &self,
        team: &Team,
        id: &str,
        timeout_secs: u64,
    ) -> Result<Sandbox, SandboxError> {
        self.check_timeout(team, timeout_secs)?;
        let mut sandbox = self.get(team, id).await?;
        let wanted = Utc::now() + seconds(timeout_secs);
        if wanted > sandbox.end_at {
            self.set_end(&sandbox, wanted).await?;
            sandbox.end_at = wanted;
            self.activity
                .event(
                    id,
                    LogLevel::Info,
                    "sandbox timeout extended",
                    &[("endAt", wanted.to_rfc3339())],
                )
                .await;
        }
        Ok(sandbox)
    }

    fn check_timeout(&self, team: &Team, timeout_secs: u64) -> Result<(), SandboxError> {
        if timeout_secs > team.max_sandbox_timeout_secs {
            return Err(SandboxError::TimeoutTooLong {
                requested: timeout_secs,
                max: team.max_sandbox_timeout_secs,
            });
        }
        Ok(())
    }

    /// Moves a sandbox's end. The registry changes first, under the lock the reaper claims an
    /// expired sandbox with: either the reaper then sees the new end and leaves the sandbox
    /// running, or it claimed the sandbox first and the extend fails (a stop is not found, a
    /// pause is a conflict that a connect waits out).
    async fn set_end(&self, sandbox: &Sandbox, end_at: DateTime<Utc>) -> Result<(), SandboxError> {
        let id = sandbox.id.as_str();
        let before = {
            let mut live = self.live();
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
        if let Err(err) = self.store.set_sandbox_end(id, end_at).await {
            if let Some(before) = before
                && let Some(entry) = self.live().get_mut(id)
                && entry.end_at == end_at
            {
                entry.end_at = before;
            }
            return Err(err.into());
        }
        Ok(())
    }

    /// Kills a sandbox. A kill is the user's last word: a pause, resume, checkpoint, restore
    /// or snapshot under way is waited for, and the sandbox is stopped whatever it became.
    pub async fn kill(&self, team: &Team, id: &str) -> Result<(), SandboxError> {
        let sandbox = self.get(team, id).await?;
        let deadline = tokio::time::Instant::now() + TRANSITION_PATIENCE;
        loop {
            match self.claim_stop(id, |_| true) {
                Claim::Claimed { previous, handle } => {
                    return self
                        .finish_stop(
                            id,
                            Some(previous),
                            &handle,
                            LogLevel::Info,
                            "sandbox killed",
                        )
                        .await;
                }
                // Recorded but not managed here (its adoption failed): the store's handle is
                // all there is.
                Claim::Unmanaged => {
                    let sandbox = self.get(team, id).await?;
                    return self
                        .finish_stop(id, None, &sandbox.handle, LogLevel::Info, "sandbox killed")
                        .await;
                }
                Claim::Stopping | Claim::Declined => {
                    return Err(SandboxError::NotFound(sandbox.id));
                }
                Claim::Busy(status) => {
                    if self.settled(id, deadline).await.is_none()
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

    /// Marks sandbox `id` stopping if it is settled and `may` agrees, under the registry lock,
    /// so that an extend or a pause either happened before or finds it stopping.
    fn claim_stop(&self, id: &str, may: impl Fn(&Live) -> bool) -> Claim {
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
    async fn settled(&self, id: &str, deadline: tokio::time::Instant) -> Option<SandboxStatus> {
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

    /// Destroys a sandbox claimed for stopping (`previous`: the status it had, if managed
    /// here) and ends its log with `event`.
    async fn finish_stop(
        &self,
        id: &str,
        previous: Option<SandboxStatus>,
        handle: &RuntimeHandle,
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
        if let Err(err) = self.runtime.destroy(id, handle).await {
            if let Some(previous) = previous {
                self.set_status(id, previous, None);
            }
            return Err(err.into());
        }
        let deleted = self.store.delete_sandbox(id).await;
        self.live().remove(id);
        self.metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        deleted?;
        self.activity.close(id, level, event).await;
        tracing::info!(sandbox_id = %id, "sandbox stopped");
        Ok(())
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
        let _serial = self.network_updates.lock().await;
        let sandbox = match self.get(team, id).await {
            Ok(sandbox) => sandbox,
            Err(SandboxError::Store(e)) => return Err(e.into()),
            Err(_) => return Err(UpdateNetworkError::NotFound(id.to_owned())),
        };
        let network = NetworkConfig {
            egress,
            ..sandbox.network
        };
        let rules = network.validate(allow_internet_access)?;
        self.runtime
            .update_network(id, &sandbox.handle, &rules)
            .await
            .map_err(|source| UpdateNetworkError::Runtime {
                sandbox_id: id.to_owned(),
                source,
            })?;
        self.store
            .set_sandbox_network(id, &network, allow_internet_access)
            .await?;
        self.activity
            .event(id, LogLevel::Info, "sandbox network updated", &[])
            .await;
        tracing::info!(sandbox_id = %id, "sandbox network updated");
        Ok(())
    }

    /// How the edge may let requests through to a running sandbox's user ports.
    pub fn user_port_access(&self, id: &str) -> Option<UserPortAccess> {
        self.live()
            .get(id)
            .filter(|l| l.status.is_routable())
            .map(|l| l.user_ports.clone())
    }

    /// How user ports of a sandbox in any live state (paused too) may be reached: the edge
    /// answers refused traffic to a paused sandbox as it would a running one.
    pub fn user_port_access_any_state(&self, id: &str) -> Option<UserPortAccess> {
        self.live().get(id).map(|l| l.user_ports.clone())
    }

    /// What sandbox `id` is now, if this node manages it.
    pub fn status_of(&self, id: &str) -> Option<SandboxStatus> {
        self.live().get(id).map(|l| l.status)
    }

    /// Where the edge should send traffic for a running sandbox.
    pub fn route(&self, id: &str) -> Option<Route> {
        self.live()
            .get(id)
            .filter(|l| l.status.is_routable())
            .and_then(Route::of)
    }

    /// The running sandbox whose agent access token satisfies `matches`. Signed file URLs
    /// carry no sandbox ID, only a signature made with that token. The tokens are checked
    /// without the registry's lock, which is then taken once, for the sandbox found.
    pub fn route_by_token(&self, matches: impl Fn(&str) -> bool) -> Option<(String, Route)> {
        let id = self.signers.find(matches)?;
        let route = self.route(&id)?;
        Some((id, route))
    }

    /// Ends the edge's connections to the agent of sandbox `id` and waits until the agent has
    /// closed its ends. The caller has marked the sandbox so that no new ones are made.
    async fn end_agent_links(&self, id: &str) {
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

    /// Running sandboxes (ID and handle) that `pick` selects, read from the registry alone.
    fn running_where(&self, pick: impl Fn(&str, &Live) -> bool) -> Vec<(String, RuntimeHandle)> {
        self.live()
            .iter()
            .filter(|(id, l)| l.status == SandboxStatus::Running && pick(id, l))
            .map(|(id, l)| (id.clone(), l.handle.clone()))
            .collect()
    }

    /// Stops each of `sandboxes` that `still` holds for when its turn comes, logging why; one
    /// failure does not hold up the rest. The reaper picks its sandboxes before it stops
    /// them: a request in between (an extend, a pause, a kill) wins over it.
    async fn stop_all(
        &self,
        sandboxes: Vec<(String, RuntimeHandle)>,
        still: impl Fn(&Live, &RuntimeHandle) -> bool,
        why: &str,
        level: LogLevel,
    ) {
        for (id, picked) in sandboxes {
            let Claim::Claimed { previous, handle } = self.claim_stop(&id, |l| still(l, &picked))
            else {
                continue;
            };
            match self
                .finish_stop(&id, Some(previous), &handle, level, why)
                .await
            {
                Ok(()) => tracing::info!(sandbox_id = %id, "{why}: stopped"),
                Err(err) => tracing::error!(sandbox_id = %id, error = %err, "{why}: cannot stop"),
            }
        }
    }

    /// Claims a live sandbox for a transient status `to` in the registry alone, if its
    /// status passes `check` and allows it; the status it had otherwise. For the claims no
    /// restart needs to see: the store keeps what the sandbox was until the claim settles.
    fn claim(
        &self,
        id: &str,
        check: impl Fn(SandboxStatus) -> bool,
        to: SandboxStatus,
    ) -> Result<SandboxStatus, Option<SandboxStatus>> {
        self.claim_where(id, |l| check(l.status), to)
    }

    /// [`Self::claim`] on a check of the whole registry entry, made under its lock.
    fn claim_where(
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

    /// Whether the team's sandboxes holding a slot, `resuming` (already marked) included, fit
    /// its concurrency limit; else how long to wait. Paused sandboxes free their slot, so a
    /// resume has to win one back like a create.
    fn within_slots(&self, team: &Team, resuming: &str) -> Result<(), u64> {
        let live = self.live();
        let active = live
            .iter()
            .filter(|(id, l)| {
                l.team_id == team.id && (l.status.holds_a_slot() || id.as_str() == resuming)
            })
            .count();
        if active > team.max_concurrent_sandboxes as usize {
            Err(slot_wait(&live, team))
        } else {
            Ok(())
        }
    }

    /// The slot a resume takes: on this node ([`Self::within_slots`]) and, in a cluster,
    /// claimed against the team's sandboxes on the other nodes, held until the guard drops.
    /// `Err` with the seconds to wait when the team has none free.
    async fn resume_slot(
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

    /// Moves the registry's status (and handle, when given) without the store: for a claim
    /// given back (the store never saw it), for a status the store could not record, which
    /// the registry has to show all the same, and for a settled status whose record was
    /// written first. The table is checked all the same: a move it refuses is a bug,
    /// logged, and the registry keeps what it had.
    fn set_status(&self, id: &str, status: SandboxStatus, handle: Option<&RuntimeHandle>) {
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
    async fn record(
        &self,
        id: &str,
        status: SandboxStatus,
        handle: Option<&RuntimeHandle>,
    ) -> Result<(), StoreError> {
        self.store.set_sandbox_status(id, status, handle).await
    }

    /// Moves sandbox `id` to `to` if the lifecycle allows it from the status the registry
    /// holds, with the store's record in step (see [`transition_plan`]). `handle`, when
    /// given, is the sandbox's new runtime handle, recorded with it. The status it had.
    async fn transition(
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
            && let Err(err) = self.store.set_sandbox_status(id, to, handle).await
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

    /// Boots a sandbox whose files were kept by [`Self::shelve`] again on them, as it was
    /// created: same environment, access token and image, the start command run again.
    async fn boot_again(
        &self,
        sandbox: &Sandbox,
    ) -> Result<(RuntimeHandle, Endpoint), SandboxError> {
        let template = self.store.template(&sandbox.template_id).await?;
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
        let template = template.unwrap_or_else(|| Template {
            id: sandbox.template_id.clone(),
            team_id: Some(sandbox.team_id.clone()),
            namespace: None,
            aliases: sandbox.alias.iter().cloned().collect(),
            public: false,
            build_id: String::new(),
            build_status: crate::model::BuildStatus::Ready,
            build_error: None,
            cpu_count: sandbox.cpu_count,
            memory_mb: sandbox.memory_mb,
            disk_size_mb: sandbox.disk_size_mb,
            envd_version: sandbox.envd_version.clone(),
            image: Some(image.clone()),
            created_at: sandbox.started_at,
            updated_at: sandbox.started_at,
            last_spawned_at: None,
            spawn_count: 0,
            build_count: 0,
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
        let spec = LaunchSpec {
            sandbox_id: sandbox.id.clone(),
            template,
            image,
            cpu_count: sandbox.cpu_count,
            memory_mb: sandbox.memory_mb,
            disk_size_mb: sandbox.disk_size_mb,
            env_vars,
            allow_internet_access: !egress.is_isolated(),
            egress,
            envd_access_token: sandbox.envd_access_token.clone(),
            volumes: self.store.sandbox_volumes(&sandbox.id).await?,
            kept: Some(sandbox.handle.clone()),
        };
        Ok(self.runtime.launch(spec).await?)
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
        self.take_over_if_lost(team, id).await?;
        let deadline = tokio::time::Instant::now() + TRANSITION_PATIENCE;
        let (sandbox, from) = loop {
            let mut sandbox = self.get(team, id).await?;
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
            if self.settled(id, deadline).await.is_none() && tokio::time::Instant::now() >= deadline
            {
                return Err(SandboxError::Conflict {
                    id: id.to_owned(),
                    state: busy.name(),
                });
            }
        };
        let _claim = match self.resume_slot(team, id).await {
            Ok(claim) => claim,
            Err(retry_after_secs) => {
                self.set_status(id, from, None);
                return Err(SandboxError::ConcurrencyLimit {
                    id: id.to_owned(),
                    limit: team.max_concurrent_sandboxes,
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
                        retry_after_secs: self.capacity_wait(),
                    }
                }
                err => err,
            })?;
        Ok((sandbox, true))
    }

    /// Seconds until this node's next running sandbox is due to end and give back what it
    /// holds; at least 1 and at most 60, since a kill or a pause frees as much at any moment.
    fn capacity_wait(&self) -> u64 {
        let now = Utc::now();
        self.live()
            .values()
            .filter(|l| l.status == SandboxStatus::Running)
            .map(|l| (l.end_at - now).num_seconds())
            .min()
            .unwrap_or(CAPACITY_WAIT_SECS)
            .clamp(1, 60) as u64
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
            self.set_status(&id, from, None);
            return Err(SandboxError::Conflict {
                id,
                state: "too old to boot afresh (its image was not recorded); resume it with its memory",
            });
        }
        let handle = self
            .live()
            .get(&id)
            .map(|l| l.handle.clone())
            .unwrap_or_else(|| sandbox.handle.clone());
        let released = match self.release_recorded(&id, &handle, sandbox.status).await {
            Ok(released) => released,
            Err(err) => {
                self.set_status(&id, from, None);
                return Err(err);
            }
        };
        if let Some(entry) = self.live().get_mut(&id) {
            entry.endpoint = None;
            entry.handle = released.clone();
        }
        // The registry keeps its waking status: the caller boots it from shelved next.
        self.record(&id, SandboxStatus::Shelved, Some(&released))
            .await?;
        self.activity
            .event(&id, LogLevel::Info, "sandbox memory dropped on resume", &[])
            .await;
        sandbox.handle = released;
        sandbox.status = SandboxStatus::Shelved;
        Ok((sandbox, SandboxStatus::Shelved))
    }

    /// Marks a paused sandbox as waking (resuming, or restoring from a checkpoint) and returns
    /// the status it had; a checkpoint under way is waited for first, and `sandbox` gets the
    /// handle that checkpoint left. The status it has otherwise.
    async fn start_waking(
        &self,
        sandbox: &mut Sandbox,
    ) -> Result<SandboxStatus, Option<SandboxStatus>> {
        let id = sandbox.id.as_str();
        // A dump takes a fraction of a second per 100 MiB; a minute covers any sandbox.
        for _ in 0..6000 {
            let status = self.live().get(id).map(|l| l.status);
            if status != Some(SandboxStatus::Checkpointing) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut live = self.live();
        let entry = live.get_mut(id).ok_or(None)?;
        let to = entry.status.waking().ok_or(Some(entry.status))?;
        let from = entry.move_to(to).map_err(Some)?;
        sandbox.handle = entry.handle.clone();
        entry.wakes += 1;
        Ok(from)
    }

    /// Thaws (or boots again, `from` shelved, or restores, `from` checkpointed) a sandbox
    /// already marked waking.
    async fn thaw(
        &self,
        mut sandbox: Sandbox,
        from: SandboxStatus,
        timeout_secs: u64,
        by: &str,
    ) -> Result<Sandbox, SandboxError> {
        let id = sandbox.id.clone();
        self.forget_shared_files(&id).await;
        let end_at = Utc::now() + seconds(timeout_secs);
        let booted = if matches!(from, SandboxStatus::Shelved | SandboxStatus::Checkpointed) {
            let booted = async {
                self.store.set_sandbox_end(&id, end_at).await?;
                let (handle, endpoint) = if from == SandboxStatus::Shelved {
                    self.boot_again(&sandbox).await?
                } else {
                    let started = std::time::Instant::now();
                    let restored = self.runtime.restore(&id, &sandbox.handle).await?;
                    tracing::info!(sandbox_id = %id, ms = started.elapsed().as_millis() as u64, "sandbox restored from its checkpoint");
                    restored
                };
                // Not routable before the transition below, which makes it running.
                if let Some(entry) = self.live().get_mut(&id) {
                    entry.end_at = end_at;
                    entry.endpoint = Some(endpoint.clone());
                }
                if let Err(err) = self
                    .transition(&id, SandboxStatus::Running, Some(&handle))
                    .await
                {
                    // Unrecorded processes would outlive the server: back to the kept files
                    // (a restored sandbox's checkpoint is spent, so it runs on, unrecorded).
                    if from == SandboxStatus::Shelved
                        && let Ok(released) = self.runtime.release(&id, &handle).await
                    {
                        sandbox.handle = released;
                    }
                    return Err(err.into());
                }
                if from == SandboxStatus::Checkpointed {
                    // Kept until now so that a restart before the record finds the restore
                    // finished beside its images.
                    self.runtime.discard_checkpoint(&id).await;
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
                    if let Some(entry) = self.live().get_mut(&id) {
                        entry.endpoint = None;
                    }
                    self.set_status(&id, from, Some(&sandbox.handle));
                    return Err(err);
                }
            }
        } else {
            let result = async {
                self.store.set_sandbox_end(&id, end_at).await?;
                self.runtime.resume(&id, &sandbox.handle).await?;
                crate::faults::crash_point("resume.thawed");
                if let Some(entry) = self.live().get_mut(&id) {
                    entry.end_at = end_at;
                }
                self.transition(&id, SandboxStatus::Running, None).await?;
                Ok::<(), SandboxError>(())
            }
            .await;
            if let Err(err) = result {
                let _ = self.runtime.pause(&id, &sandbox.handle).await;
                self.set_status(&id, SandboxStatus::Paused, None);
                return Err(err);
            }
            None
        };
        if let Some((handle, _)) = booted {
            sandbox.handle = handle;
        }
        sandbox.end_at = end_at;
        sandbox.status = SandboxStatus::Running;
        self.activity
            .event(
                &id,
                LogLevel::Info,
                "sandbox resumed",
                &[("by", by.to_owned()), ("endAt", end_at.to_rfc3339())],
            )
            .await;
        tracing::info!(sandbox_id = %id, "sandbox resumed");
        Ok(sandbox)
    }

    /// The endpoint of a running sandbox; a paused one with `autoResume` is resumed first
    /// (the edge calls this for every request naming a sandbox), but only for a request that
    /// `lets_through` says the running sandbox would let through: traffic the edge or the
    /// agent would refuse never wakes a sandbox.
    pub async fn route_or_wake(
        &self,
        id: &str,
        lets_through: impl Fn(&WakeKeys<'_>) -> bool,
    ) -> Result<Route, SandboxError> {
        let not_running = || SandboxError::NotFound(id.to_owned());
        if let Some(route) = self.route(id) {
            return Ok(route);
        }
        let wake = self.live().get(id).is_some_and(|l| {
            l.auto_resume
                && matches!(
                    l.status,
                    SandboxStatus::Paused
                        | SandboxStatus::Checkpointing
                        | SandboxStatus::Checkpointed
                )
                && lets_through(&WakeKeys {
                    envd_access_token: (!l.access_token.is_empty()).then_some(&*l.access_token),
                    traffic_access_token: l.user_ports.traffic_access_token.as_deref(),
                })
        });
        if !wake {
            // A snapshot or a resume under way is waited for; anything else is not running.
            return self.settled_route(id).await.ok_or_else(not_running);
        }
        let mut sandbox = self.store.sandbox(id).await?.ok_or_else(not_running)?;
        let team = self
            .store
            .team(&sandbox.team_id)
            .await?
            .ok_or_else(not_running)?;
        if let Ok(from) = self.start_waking(&mut sandbox).await {
            let _claim = match self.resume_slot(&team, id).await {
                Ok(claim) => claim,
                Err(retry_after_secs) => {
                    self.set_status(id, from, None);
                    tracing::warn!(sandbox_id = %id, team_id = %team.id, "not resumed by traffic: the team is at its concurrency limit");
                    return Err(SandboxError::ConcurrencyLimit {
                        id: id.to_owned(),
                        limit: team.max_concurrent_sandboxes,
                        retry_after_secs,
                    });
                }
            };
            match self
                .thaw(sandbox, from, AUTO_RESUME_TIMEOUT_SECS, "traffic")
                .await
            {
                Ok(_) => tracing::info!(sandbox_id = %id, "resumed by traffic"),
                Err(err) => {
                    tracing::warn!(sandbox_id = %id, error = %err, "cannot resume on traffic")
                }
            }
            return self.route(id).ok_or_else(not_running);
        }
        // Another request is resuming it (a restore from disk takes up to a few seconds).
        self.settled_route(id).await.ok_or_else(not_running)
    }

    /// The route of sandbox `id` once the resume or snapshot under way has finished, if it
    /// runs then.
    async fn settled_route(&self, id: &str) -> Option<Route> {
        let deadline = tokio::time::Instant::now() + ROUTE_PATIENCE;
        loop {
            if let Some(route) = self.route(id) {
                return Some(route);
            }
            let busy = self.live().get(id).is_some_and(|l| {
                matches!(
                    l.status,
                    SandboxStatus::Snapshotting
                        | SandboxStatus::Resuming
                        | SandboxStatus::Restoring
                )
            });
            if !busy || tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Applies an adopted sandbox's egress rules again: the node rewrites its firewall when
    /// it starts.
    async fn restore_network(&self, sandbox: &Sandbox) -> Result<(), String> {
        let rules = sandbox
            .network
            .validate(sandbox.allow_internet_access)
            .map_err(|e| e.to_string())?;
        if rules.is_empty() {
            return Ok(());
        }
        self.runtime
            .update_network(&sandbox.id, &sandbox.handle, &rules)
            .await
            .map_err(|e| e.to_string())
    }
}

/// How long a node's claim of a team's slot counts if the node never lets go of it (it died
/// in the middle of a create): longer than any start takes.
const SLOT_CLAIM_LENGTH: TimeDelta = TimeDelta::minutes(10);

/// Lets go of a claimed slot when dropped, in the background (the sandbox's record, or its
/// failure to start, is what the other nodes go by from then on).
struct SlotClaimGuard {
    store: Arc<dyn Store>,
    sandbox_id: String,
}

impl Drop for SlotClaimGuard {
    fn drop(&mut self) {
        let store = self.store.clone();
        let id = std::mem::take(&mut self.sandbox_id);
        tokio::spawn(async move {
            if let Err(err) = store.release_team_slot(&id).await {
                tracing::warn!(sandbox_id = %id, error = %err, "cannot let go of a claimed slot; it lapses by itself");
            }
        });
    }
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

/// What the node needs to start sandbox `id` of `template` from `image` for `request`.
fn launch_spec(
    id: &str,
    request: &CreateSandbox,
    template: &Template,
    image: TemplateImage,
    egress: EgressRules,
    volumes: Vec<VolumeMount>,
) -> LaunchSpec {
    let mut env_vars = image.env.clone();
    env_vars.extend(request.env_vars.clone());
    LaunchSpec {
        sandbox_id: id.to_owned(),
        image,
        cpu_count: template.cpu_count,
        memory_mb: template.memory_mb,
        disk_size_mb: template.disk_size_mb,
        env_vars,
        allow_internet_access: !egress.is_isolated(),
        egress,
        envd_access_token: ids::new_secret(""),
        template: template.clone(),
        volumes,
        kept: None,
    }
}

/// A team's per-sandbox ceilings (0: none) against what the template would get.
fn check_resources(team: &Team, template: &Template) -> Result<(), CreateSandboxError> {
    for (field, value, max) in [
        ("cpuCount", template.cpu_count, team.max_vcpu),
        ("memoryMB", template.memory_mb, team.max_memory_mb),
        ("diskSizeMB", template.disk_size_mb, team.max_disk_mb),
    ] {
        if max != 0 && value > max {
            return Err(CreateSandboxError::ResourceLimit {
                template_id: template.id.clone(),
                field,
                value,
                max,
            });
        }
    }
    Ok(())
}

/// A sandbox counted against its team's concurrency before it is recorded. Dropped before
/// [`Reservation::keep`] (a create that failed, or whose request went away mid-way), the
/// count goes back.
#[must_use]
struct Reservation<'a> {
    sandboxes: &'a Sandboxes,
    id: String,
    kept: bool,
}

impl Reservation<'_> {
    /// The sandbox is recorded: it counts for as long as it lives.
    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.sandboxes.live().remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn page_tokens_round_trip() {
        let token = hex::encode("1700000000000000:iabc");
        assert_eq!(
            parse_page_token(&token),
            Some((1_700_000_000_000_000, "iabc".to_owned()))
        );
        assert_eq!(parse_page_token("zz"), None);
        assert_eq!(parse_page_token(&hex::encode("nocolon")), None);
    }
}
