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
use crate::model::{PauseKind, Sandbox, SandboxState, Team, Template};
use crate::network::{EgressConfig, EgressRules, NetworkConfig, NetworkConfigError};
use crate::runtime::{
    AdoptedCheckpoint, Endpoint, LaunchSpec, Runtime, RuntimeError, RuntimeHandle,
};
use crate::sandbox_logs::{SandboxLogEntry, SandboxLogQuery, SandboxLogsError};
use crate::store::{Store, StoreError};
use crate::team_metrics::{TeamMetric, TeamMetricMax, TeamMetricPoint, TeamMetricsError};
use crate::templates::{TemplateError, Templates};
use crate::volumes::{MountRequest, VolumeMountError, Volumes};

mod snapshots;
pub use snapshots::{ForkResult, SnapshotError, SnapshotInfo, SnapshotQuery};

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
}

impl Default for SandboxesConfig {
    fn default() -> Self {
        Self {
            template_wait: Duration::from_secs(900),
            default_user: "user".into(),
            activity: ActivityConfig::default(),
            pause_grace: Duration::from_secs(10),
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
    Store(#[from] StoreError),
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
    /// The agent's access token, to find the sandbox a signed file URL belongs to.
    access_token: String,
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
}

impl Live {
    /// The registry entry of a sandbox the store recorded, taken back after a restart.
    fn recorded(
        sandbox: &Sandbox,
        handle: RuntimeHandle,
        endpoint: Option<Endpoint>,
        status: SandboxStatus,
    ) -> Self {
        Live {
            team_id: sandbox.team_id.clone(),
            end_at: sandbox.end_at,
            endpoint,
            access_token: sandbox.envd_access_token.clone(),
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
    /// Network updates run one at a time, so the firewall and the store agree on the last.
    network_updates: tokio::sync::Mutex<()>,
    metrics: Mutex<HashMap<String, MetricSeries>>,
    volumes: Option<Arc<Volumes>>,
    activity: Activity,
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
            network_updates: tokio::sync::Mutex::new(()),
            metrics: Mutex::new(HashMap::new()),
            volumes: None,
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
        self.reserve(team, &id, now + seconds(request.timeout_secs))?;

        let Some(image) = template.image.clone() else {
            self.live().remove(&id);
            return Err(TemplateError::StillBuilding(template.id.clone()).into());
        };
        // Restored from the template's capture with its start command running, where the
        // node can restore; the record names the layers the sandbox's files are on.
        let image = match image.restored_from_capture() {
            Some(restored) if self.runtime.checkpoints_ready().await => restored,
            _ => image,
        };
        let booted_from = image.clone();
        let mut env_vars = image.env.clone();
        env_vars.extend(request.env_vars.clone());
        let spec = LaunchSpec {
            sandbox_id: id.clone(),
            image,
            cpu_count: template.cpu_count,
            memory_mb: template.memory_mb,
            disk_size_mb: template.disk_size_mb,
            env_vars,
            allow_internet_access: !egress.is_isolated(),
            egress,
            envd_access_token: ids::new_secret(""),
            template: template.clone(),
            volumes: mounts.clone(),
            kept: None,
        };
        let token = spec.envd_access_token.clone();
        let (handle, endpoint) = match self.runtime.launch(spec).await {
            Ok(started) => started,
            Err(err) => {
                self.live().remove(&id);
                return Err(match err {
                    RuntimeError::NoCapacity { .. } => CreateSandboxError::NoCapacity {
                        source: err,
                        retry_after_secs: self.capacity_wait(),
                    },
                    err => err.into(),
                });
            }
        };

        // The timeout runs from the moment the sandbox is usable, not from the request.
        let started_at = Utc::now();
        let sandbox = Sandbox {
            id: id.clone(),
            team_id: team.id.clone(),
            template_id: template.id.clone(),
            alias: template
                .aliases
                .iter()
                .find(|a| {
                    let named = &request.template;
                    named.strip_suffix(":default").unwrap_or(named) == a.as_str()
                })
                .or(template.aliases.first())
                .cloned(),
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
            envd_access_token: token,
            envd_version: template.envd_version.clone(),
            state: SandboxState::Running,
            paused_as: None,
            handle,
            auto_pause: request.auto_pause,
            auto_resume: request.auto_resume,
            auto_pause_memory: !request.auto_pause_files_only,
            image: Some(booted_from),
        };
        let recorded = match self.store.insert_sandbox(&sandbox).await {
            Ok(()) if mounts.is_empty() => Ok(()),
            Ok(()) => {
                let mounted = self.store.insert_sandbox_volumes(&id, &mounts).await;
                if mounted.is_err()
                    && let Err(err) = self.store.delete_sandbox(&id).await
                {
                    tracing::error!(sandbox_id = %id, error = %err, "cannot remove half-recorded sandbox");
                }
                mounted
            }
            Err(err) => Err(err),
        };
        if let Err(err) = recorded {
            if let Err(destroy) = self.runtime.destroy(&id, &sandbox.handle).await {
                tracing::error!(sandbox_id = %id, error = %destroy, "cannot clean up unrecorded sandbox");
            }
            self.live().remove(&id);
            return Err(err.into());
        }
        // Logged before the sandbox counts as running, so the reaper never reads its agent
        // log before the log exists.
        self.log_start(&sandbox, now).await;
        if let Some(entry) = self.live().get_mut(&id) {
            entry.status = SandboxStatus::Running;
            entry.endpoint = Some(endpoint);
            entry.access_token = sandbox.envd_access_token.clone();
            entry.handle = sandbox.handle.clone();
            entry.end_at = sandbox.end_at;
            entry.user_ports = UserPortAccess::of(&sandbox);
            entry.auto_pause = sandbox.auto_pause;
            entry.auto_resume = sandbox.auto_resume;
            entry.cpu_count = sandbox.cpu_count;
            entry.memory_mb = sandbox.memory_mb;
            entry.disk_size_mb = sandbox.disk_size_mb;
        }
        // A statistic nothing waits for: written after the response.
        let store = self.store.clone();
        let template_id = template.id.clone();
        tokio::spawn(async move {
            if let Err(err) = store.record_template_spawn(&template_id, started_at).await {
                tracing::warn!(%template_id, error = %err, "cannot record template spawn");
            }
        });
        tracing::info!(sandbox_id = %id, template_id = %template.id, "sandbox started");
        Ok(sandbox)
    }

    /// The first lines of a new sandbox's log, and its start in the team's metrics.
    async fn log_start(&self, sandbox: &Sandbox, requested_at: DateTime<Utc>) {
        let mut created = vec![
            ("templateID", sandbox.template_id.clone()),
            ("endAt", sandbox.end_at.to_rfc3339()),
        ];
        if let Some(alias) = &sandbox.alias {
            created.push(("alias", alias.clone()));
        }
        let startup_ms = (sandbox.started_at - requested_at).num_milliseconds();
        let entries = [
            SandboxLogEntry::event(requested_at, LogLevel::Info, "sandbox created", &created),
            SandboxLogEntry::event(
                sandbox.started_at,
                LogLevel::Info,
                "sandbox started",
                &[("startupMs", startup_ms.to_string())],
            ),
        ];
        self.activity
            .open(&sandbox.id, &sandbox.team_id, requested_at, &entries)
            .await;
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

    fn reserve(
        &self,
        team: &Team,
        id: &str,
        end_at: DateTime<Utc>,
    ) -> Result<(), CreateSandboxError> {
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
                access_token: String::new(),
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
            },
        );
        Ok(())
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

    /// The node's disks as measured now.
    pub fn disks(&self) -> crate::disks::DiskReport {
        self.runtime.disks()
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
            .filter(|s| query.states.as_ref().is_none_or(|st| st.contains(&s.state)))
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
            .filter(|s| s.state == SandboxState::Running)
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
        if entry.status.is_transient() || !entry.status.can_stop() {
            return Claim::Busy(entry.status);
        }
        Claim::Claimed {
            previous: std::mem::replace(&mut entry.status, SandboxStatus::Stopping),
            handle: entry.handle.clone(),
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
        // Destroying the sandbox removes its agent log: read what is left first.
        self.activity
            .ingest_agent_log(self.runtime.as_ref(), id)
            .await;
        if let Err(err) = self.runtime.destroy(id, handle).await {
            if let Some(phase) = previous
                && let Some(entry) = self.live().get_mut(id)
            {
                entry.status = phase;
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
    /// carry no sandbox ID, only a signature made with that token.
    pub fn route_by_token(&self, matches: impl Fn(&str) -> bool) -> Option<(String, Route)> {
        self.live()
            .iter()
            .filter(|(_, l)| l.status.is_routable() && !l.access_token.is_empty())
            .find(|(_, l)| matches(&l.access_token))
            .and_then(|(id, l)| Some((id.clone(), Route::of(l)?)))
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

    /// Stops every sandbox whose end time has passed.
    pub async fn reap_expired(&self) {
        let to_pause = self.running_where(|_, l| expired(l) && l.auto_pause);
        for (id, _) in to_pause {
            let sandbox = match self.store.sandbox(&id).await {
                Ok(Some(sandbox)) => sandbox,
                Ok(None) => continue,
                Err(err) => {
                    tracing::error!(sandbox_id = %id, error = %err, "sandbox timed out: cannot pause");
                    continue;
                }
            };
            // Claimed under the lock an extend takes: one that came first keeps it running.
            let claimed = self.transition_where(
                &id,
                |l| l.status == SandboxStatus::Running && expired(l) && l.auto_pause,
                SandboxStatus::Pausing,
            );
            if claimed.is_err() {
                continue;
            }
            self.activity
                .event(&id, LogLevel::Info, "sandbox timed out: pausing", &[])
                .await;
            let paused = self.pause_marked(&sandbox, sandbox.auto_pause_memory).await;
            match paused {
                Ok(()) => tracing::info!(sandbox_id = %id, "sandbox timed out: paused"),
                Err(err) => {
                    tracing::error!(sandbox_id = %id, error = %err, "sandbox timed out: cannot pause")
                }
            }
        }
        let due = self.running_where(|_, l| expired(l) && !l.auto_pause);
        self.stop_all(
            due,
            |l, _| l.status == SandboxStatus::Running && expired(l) && !l.auto_pause,
            "sandbox timed out",
            LogLevel::Info,
        )
        .await;
    }

    /// Checkpoints to disk the sandbox frozen in memory longest, once its grace has passed:
    /// one per round, since a dump holds a CPU while it runs.
    pub async fn checkpoint_paused(&self) {
        let Ok(grace) = TimeDelta::from_std(self.config.pause_grace) else {
            return;
        };
        let due = Utc::now() - grace;
        let next = self
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
        if !self.runtime.checkpoints_ready().await {
            return;
        }
        // A checkpoint writes about the sandbox's memory to the data disk: without room for
        // that, the sandbox stays frozen in memory rather than leave a half-written dump.
        let handle = self.live().get(&id).map(|l| l.handle.clone());
        let memory = handle
            .and_then(|h| self.runtime.stats(&id, &h))
            .map_or(0, |s| s.memory_used);
        if !self.data_disk().data_has_room_for(memory) {
            tracing::debug!(sandbox_id = %id, memory, "no room on the data disk to checkpoint the paused sandbox; it stays in memory");
            return;
        }
        self.checkpoint_sandbox(&id).await;
    }

    /// Checkpoints a sandbox frozen in memory; on failure it stays frozen, and after
    /// [`CHECKPOINT_ATTEMPTS`] failures it is not tried again until its next pause.
    async fn checkpoint_sandbox(&self, id: &str) {
        let handle = {
            let mut live = self.live();
            let Some(entry) = live.get_mut(id) else {
                return;
            };
            if !(entry.status == SandboxStatus::Paused
                && entry.status.can_become(SandboxStatus::Checkpointing))
            {
                return;
            }
            entry.status = SandboxStatus::Checkpointing;
            entry.handle.clone()
        };
        let started = std::time::Instant::now();
        let result = async {
            // Recorded first, so a restart after a crash in the middle looks at what is left.
            self.store
                .set_sandbox_paused(id, Some(PauseKind::Checkpointing), &handle)
                .await?;
            Ok::<_, SandboxError>(self.runtime.checkpoint(id, &handle).await?)
        }
        .await;
        match result {
            Ok(checkpointed) => {
                if let Some(entry) = self.live().get_mut(id) {
                    entry.status = SandboxStatus::Checkpointed;
                    entry.handle = checkpointed.clone();
                    entry.endpoint = None;
                }
                if let Err(err) = self
                    .store
                    .set_sandbox_paused(id, Some(PauseKind::Checkpoint), &checkpointed)
                    .await
                {
                    // A restart finds it recorded as checkpointing, with its processes gone
                    // and a complete checkpoint: it is adopted as checkpointed then.
                    tracing::error!(sandbox_id = %id, error = %err, "cannot record the checkpoint");
                }
                let ms = started.elapsed().as_millis() as u64;
                self.activity
                    .event(
                        id,
                        LogLevel::Info,
                        "sandbox checkpointed to disk",
                        &[("ms", ms.to_string())],
                    )
                    .await;
                tracing::info!(sandbox_id = %id, ms, "sandbox checkpointed to disk");
            }
            Err(err) => {
                if let Some(entry) = self.live().get_mut(id) {
                    entry.status = SandboxStatus::Paused;
                    entry.checkpoint_failures += 1;
                }
                if let Err(err) = self
                    .store
                    .set_sandbox_paused(id, Some(PauseKind::Memory), &handle)
                    .await
                {
                    tracing::error!(sandbox_id = %id, error = %err, "cannot record the sandbox paused");
                }
                self.activity
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

    /// Cleans up sandboxes whose processes died on their own (their agent can no longer
    /// answer), so they stop being listed and routed to.
    pub async fn reap_dead(&self) {
        // Checked outside the registry lock: each check reads /proc.
        let dead = self
            .running_where(|_, _| true)
            .into_iter()
            .filter(|(id, handle)| !self.runtime.is_alive(id, handle))
            .collect();
        // Unless it was paused, shelved or resumed meanwhile: its handle would differ.
        self.stop_all(
            dead,
            |l, picked| l.status == SandboxStatus::Running && l.handle == *picked,
            "sandbox died",
            LogLevel::Error,
        )
        .await;
    }

    /// Reads new agent log lines of every running sandbox.
    async fn ingest_agent_logs(&self) {
        let ids: Vec<String> = self
            .live()
            .iter()
            .filter(|(_, l)| l.status == SandboxStatus::Running)
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            self.activity
                .ingest_agent_log(self.runtime.as_ref(), &id)
                .await;
        }
    }

    async fn flush_team_metrics(&self) {
        let mut running: HashMap<String, u32> = HashMap::new();
        for l in self.live().values() {
            if l.status.holds_a_slot() {
                *running.entry(l.team_id.clone()).or_default() += 1;
            }
        }
        self.activity.flush_team_metrics(running).await;
    }

    /// Expires sandboxes about twice a second and looks for dead ones every few seconds,
    /// forever.
    pub async fn run_reaper(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for round in 0u64.. {
            tick.tick().await;
            self.reap_expired().await;
            self.checkpoint_paused().await;
            if round % 10 == 0 {
                self.reap_dead().await;
            }
            if round % METRICS_EVERY_ROUNDS == 0 {
                for (id, killed) in self.sample_metrics() {
                    self.log_oom_kills(&id, killed).await;
                }
                self.ingest_agent_logs().await;
            }
            if round % TEAM_METRICS_EVERY_ROUNDS == 0 {
                self.flush_team_metrics().await;
            }
            if round % PRUNE_EVERY_ROUNDS == 0 {
                self.activity.prune().await;
            }
        }
    }

    /// After a restart: takes back every recorded sandbox that still runs, and cleans up the
    /// rest. Expired ones are left for the reaper so their end is logged like any other.
    pub async fn recover(&self) -> Result<usize, StoreError> {
        let mut adopted = 0;
        let recorded = self.store.all_sandboxes().await?;
        let ids: Vec<String> = recorded.iter().map(|s| s.id.clone()).collect();
        match self.runtime.sweep(&ids).await {
            Ok(0) => {}
            Ok(n) => tracing::warn!(count = n, "removed unrecorded sandboxes"),
            Err(err) => tracing::error!(error = %err, "cannot sweep unrecorded sandboxes"),
        }
        for mut sandbox in recorded {
            if sandbox.paused_as == Some(PauseKind::Releasing) {
                // The server died while ending its processes to keep its files: finish that.
                match self
                    .release_recorded(&sandbox.id, &sandbox.handle, sandbox.paused_as)
                    .await
                {
                    Ok(released) => {
                        self.store
                            .set_sandbox_paused(&sandbox.id, Some(PauseKind::Files), &released)
                            .await?;
                        sandbox.handle = released;
                        sandbox.paused_as = Some(PauseKind::Files);
                    }
                    Err(err) => {
                        tracing::error!(sandbox_id = %sandbox.id, error = %err, "cannot finish a pause without memory");
                    }
                }
            }
            if matches!(
                sandbox.paused_as,
                Some(PauseKind::Files | PauseKind::Releasing)
            ) {
                self.adopt_shelved(&sandbox).await?;
                continue;
            }
            if sandbox.paused_as == Some(PauseKind::Checkpointing)
                && self.runtime.is_alive(&sandbox.id, &sandbox.handle)
            {
                // The server died during the dump, before it ended the processes: what the
                // dump wrote is incomplete, and the sandbox is still frozen in memory.
                self.runtime.discard_checkpoint(&sandbox.id).await;
                self.store
                    .set_sandbox_paused(&sandbox.id, Some(PauseKind::Memory), &sandbox.handle)
                    .await?;
                sandbox.paused_as = Some(PauseKind::Memory);
            }
            if matches!(
                sandbox.paused_as,
                Some(PauseKind::Checkpoint | PauseKind::Checkpointing)
            ) {
                self.adopt_checkpointed(&sandbox).await?;
                continue;
            }
            match self.runtime.adopt(&sandbox.id, &sandbox.handle).await {
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
                    self.activity
                        .open(&sandbox.id, &sandbox.team_id, sandbox.started_at, &[])
                        .await;
                    self.activity
                        .ingest_agent_log(self.runtime.as_ref(), &sandbox.id)
                        .await;
                    if let Err(err) = self.runtime.destroy(&sandbox.id, &sandbox.handle).await {
                        tracing::error!(sandbox_id = %sandbox.id, error = %err, "cannot clean up dead sandbox");
                    }
                    self.store.delete_sandbox(&sandbox.id).await?;
                    self.activity
                        .close(
                            &sandbox.id,
                            LogLevel::Error,
                            "sandbox died while the server was down",
                        )
                        .await;
                }
                Err(err) => {
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
                match self.runtime.release(&sandbox.id, &sandbox.handle).await {
                    Ok(released) => {
                        tracing::warn!(sandbox_id = %sandbox.id, error = %err, "checkpointed sandbox cannot be restored; its files are kept");
                        self.store
                            .set_sandbox_paused(&sandbox.id, Some(PauseKind::Files), &released)
                            .await?;
                        let shelved = Sandbox {
                            handle: released,
                            paused_as: Some(PauseKind::Files),
                            ..sandbox.clone()
                        };
                        self.adopt_shelved(&shelved).await?;
                        self.activity
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
                self.activity
                    .open(&sandbox.id, &sandbox.team_id, sandbox.started_at, &[])
                    .await;
                if let Err(err) = self.runtime.destroy(&sandbox.id, &sandbox.handle).await {
                    tracing::error!(sandbox_id = %sandbox.id, error = %err, "cannot clean up checkpointed sandbox");
                }
                self.store.delete_sandbox(&sandbox.id).await?;
                self.activity
                    .close(
                        &sandbox.id,
                        LogLevel::Error,
                        "sandbox lost: its checkpoint cannot be restored",
                    )
                    .await;
                return Ok(());
            }
        };
        if sandbox.paused_as != Some(PauseKind::Checkpoint) || handle != sandbox.handle {
            self.store
                .set_sandbox_paused(&sandbox.id, Some(PauseKind::Checkpoint), &handle)
                .await?;
        }
        self.live().insert(
            sandbox.id.clone(),
            Live::recorded(sandbox, handle, None, SandboxStatus::Checkpointed),
        );
        self.activity
            .open(&sandbox.id, &sandbox.team_id, sandbox.started_at, &[])
            .await;
        self.activity
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
        self.store
            .set_sandbox_paused(&sandbox.id, None, &handle)
            .await?;
        self.runtime.discard_checkpoint(&sandbox.id).await;
        let mut running = sandbox.clone();
        running.handle = handle;
        running.paused_as = None;
        running.state = SandboxState::Running;
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
            if let Err(err) = self.runtime.destroy(&sandbox.id, &sandbox.handle).await {
                tracing::error!(sandbox_id = %sandbox.id, error = %err, "cannot stop sandbox");
            }
            self.store.delete_sandbox(&sandbox.id).await?;
            return Ok(false);
        }
        let status = self.settle(sandbox).await?;
        self.live().insert(
            sandbox.id.clone(),
            Live::recorded(sandbox, sandbox.handle.clone(), Some(endpoint), status),
        );
        // Sandboxes from before logs were kept get a log from now on.
        self.activity
            .open(&sandbox.id, &sandbox.team_id, sandbox.started_at, &[])
            .await;
        self.activity
            .event(&sandbox.id, LogLevel::Info, event, &[])
            .await;
        Ok(true)
    }

    /// After a restart: takes back a sandbox paused without memory (no processes, only its
    /// files); one whose files are gone is cleaned up.
    async fn adopt_shelved(&self, sandbox: &Sandbox) -> Result<(), StoreError> {
        if let Err(err) = self
            .runtime
            .adopt_released(&sandbox.id, &sandbox.handle)
            .await
        {
            tracing::error!(sandbox_id = %sandbox.id, error = %err, "paused sandbox lost its files; removing it");
            if let Err(err) = self.runtime.destroy(&sandbox.id, &sandbox.handle).await {
                tracing::error!(sandbox_id = %sandbox.id, error = %err, "cannot clean up paused sandbox");
            }
            self.store.delete_sandbox(&sandbox.id).await?;
            self.activity
                .close(&sandbox.id, LogLevel::Error, "sandbox lost its files")
                .await;
            return Ok(());
        }
        self.live().insert(
            sandbox.id.clone(),
            Live::recorded(
                sandbox,
                sandbox.handle.clone(),
                None,
                SandboxStatus::Shelved,
            ),
        );
        self.activity
            .open(&sandbox.id, &sandbox.team_id, sandbox.started_at, &[])
            .await;
        Ok(())
    }

    /// Takes one resource sample of every running or paused sandbox.
    /// Tells a sandbox's log, and the server's, that the kernel killed `killed` of its
    /// processes for lack of memory. The agent names the processes it sees killed at the
    /// sandbox's limit; only the kernel's count also covers kills with the host short of
    /// memory, which signal nothing to the sandbox.
    async fn log_oom_kills(&self, id: &str, killed: u64) {
        tracing::warn!(sandbox_id = %id, killed, "the kernel killed sandbox processes for lack of memory");
        self.activity
            .event(
                id,
                LogLevel::Warn,
                &format!(
                    "out of memory: the kernel killed {killed} process{} of this sandbox (at its memory limit, or with the host short of memory)",
                    if killed == 1 { "" } else { "es" }
                ),
                &[("oomKills", killed.to_string())],
            )
            .await;
    }

    /// Samples every live sandbox's use; returns the sandboxes whose processes the kernel
    /// killed for lack of memory since the last sample, with how many.
    pub fn sample_metrics(&self) -> Vec<(String, u64)> {
        let targets: Vec<(String, RuntimeHandle, u32, u32, u32)> = self
            .live()
            .iter()
            .filter(|(_, l)| {
                matches!(
                    l.status,
                    SandboxStatus::Running | SandboxStatus::Paused | SandboxStatus::Checkpointed
                )
            })
            .map(|(id, l)| {
                (
                    id.clone(),
                    l.handle.clone(),
                    l.cpu_count,
                    l.memory_mb,
                    l.disk_size_mb,
                )
            })
            .collect();
        let now = std::time::Instant::now();
        let at = Utc::now();
        let mut metrics = self.metrics.lock().unwrap_or_else(|e| e.into_inner());
        let mut killed = Vec::new();
        for (id, handle, cpu_count, memory_mb, disk_size_mb) in targets {
            let Some(stats) = self.runtime.stats(&id, &handle) else {
                continue;
            };
            let series = metrics.entry(id.clone()).or_default();
            if let Some(before) = series.oom_kills
                && stats.oom_kills > before
            {
                killed.push((id, stats.oom_kills - before));
            }
            series.oom_kills = Some(stats.oom_kills);
            let cpu_used_pct = match series.last_cpu {
                Some((then, cpu_ns)) => {
                    let wall = now.duration_since(then).as_nanos() as f64;
                    let used = stats.cpu_ns.saturating_sub(cpu_ns) as f64;
                    if wall > 0.0 {
                        (used / (wall * f64::from(cpu_count.max(1))) * 100.0).clamp(0.0, 100.0)
                    } else {
                        0.0
                    }
                }
                None => 0.0,
            };
            series.last_cpu = Some((now, stats.cpu_ns));
            series.points.push_back(MetricPoint {
                at,
                cpu_count,
                cpu_used_pct,
                mem_used: stats.memory_used,
                mem_total: u64::from(memory_mb) << 20,
                mem_cache: stats.memory_cache,
                disk_used: stats.disk_used,
                disk_total: if stats.disk_total > 0 {
                    stats.disk_total
                } else {
                    u64::from(disk_size_mb) << 20
                },
            });
            while series.points.len() > METRICS_KEPT {
                series.points.pop_front();
            }
        }
        killed
    }

    /// A team's sandbox's samples between `start` and `end` (inclusive, either open).
    pub async fn metrics(
        &self,
        team: &Team,
        id: &str,
        start: Option<DateTime<Utc>>,
        end: Option<DateTime<Utc>>,
    ) -> Result<Vec<MetricPoint>, SandboxError> {
        self.get(team, id).await?;
        Ok(self.metric_points(id, start, end))
    }

    /// The newest sample of each of `ids` that belongs to `team`.
    pub async fn latest_metrics(
        &self,
        team: &Team,
        ids: &[String],
    ) -> Result<Vec<(String, MetricPoint)>, SandboxError> {
        let mut out = Vec::new();
        for id in ids {
            if self.get(team, id).await.is_err() {
                continue;
            }
            if let Some(point) = self.metric_points(id, None, None).pop() {
                out.push((id.clone(), point));
            }
        }
        Ok(out)
    }

    fn metric_points(
        &self,
        id: &str,
        start: Option<DateTime<Utc>>,
        end: Option<DateTime<Utc>>,
    ) -> Vec<MetricPoint> {
        self.metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .map(|series| {
                series
                    .points
                    .iter()
                    .filter(|p| start.is_none_or(|s| p.at >= s) && end.is_none_or(|e| p.at <= e))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// After a restart: makes the stored state and the processes agree. A pause or resume
    /// the server died in the middle of is finished in the direction the store says: a
    /// sandbox recorded paused is frozen again, one recorded running is thawed.
    async fn settle(&self, sandbox: &Sandbox) -> Result<SandboxStatus, StoreError> {
        let frozen = self.runtime.is_paused(&sandbox.id, &sandbox.handle);
        match (sandbox.state, frozen) {
            (SandboxState::Paused, true) => Ok(SandboxStatus::Paused),
            (SandboxState::Running, false) => Ok(SandboxStatus::Running),
            (SandboxState::Paused, false) => {
                match self.runtime.pause(&sandbox.id, &sandbox.handle).await {
                    Ok(()) => Ok(SandboxStatus::Paused),
                    Err(err) => {
                        tracing::warn!(sandbox_id = %sandbox.id, error = %err, "cannot pause again; recording it running");
                        self.store
                            .set_sandbox_state(&sandbox.id, SandboxState::Running)
                            .await?;
                        Ok(SandboxStatus::Running)
                    }
                }
            }
            (SandboxState::Running, true) => {
                if let Err(err) = self.runtime.resume(&sandbox.id, &sandbox.handle).await {
                    tracing::warn!(sandbox_id = %sandbox.id, error = %err, "cannot thaw; recording it paused");
                    self.store
                        .set_sandbox_state(&sandbox.id, SandboxState::Paused)
                        .await?;
                    return Ok(SandboxStatus::Paused);
                }
                Ok(SandboxStatus::Running)
            }
        }
    }

    /// Moves a live sandbox from `from` to `to` if its status allows; the status it had
    /// otherwise.
    fn transition(
        &self,
        id: &str,
        check: impl Fn(SandboxStatus) -> bool,
        to: SandboxStatus,
    ) -> Result<SandboxStatus, Option<SandboxStatus>> {
        self.transition_where(id, |l| check(l.status), to)
    }

    /// [`Self::transition`] on a check of the whole registry entry, made under its lock.
    fn transition_where(
        &self,
        id: &str,
        check: impl Fn(&Live) -> bool,
        to: SandboxStatus,
    ) -> Result<SandboxStatus, Option<SandboxStatus>> {
        let mut live = self.live();
        let entry = live.get_mut(id).ok_or(None)?;
        if !check(entry) || !entry.status.can_become(to) {
            return Err(Some(entry.status));
        }
        Ok(std::mem::replace(&mut entry.status, to))
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

    fn set_status(&self, id: &str, status: SandboxStatus) {
        if let Some(entry) = self.live().get_mut(id) {
            entry.status = status;
        }
    }

    /// Pauses a running sandbox: frozen in place when `memory`, else its processes end and
    /// only its files are kept. `Conflict` if it is not running.
    pub async fn pause(&self, team: &Team, id: &str, memory: bool) -> Result<(), SandboxError> {
        let sandbox = self.get(team, id).await?;
        self.pause_sandbox(&sandbox, memory).await
    }

    async fn pause_sandbox(&self, sandbox: &Sandbox, memory: bool) -> Result<(), SandboxError> {
        let id = sandbox.id.as_str();
        match self.transition(id, SandboxStatus::can_pause, SandboxStatus::Pausing) {
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
    async fn pause_marked(&self, sandbox: &Sandbox, memory: bool) -> Result<(), SandboxError> {
        let id = sandbox.id.as_str();
        // Before anything stops: the agent has to be running to close its ends.
        self.end_agent_links(id).await;
        if !memory {
            return self.shelve(sandbox).await;
        }
        if let Err(err) = self.runtime.pause(id, &sandbox.handle).await {
            self.set_status(id, SandboxStatus::Running);
            return Err(err.into());
        }
        crate::faults::crash_point("pause.frozen");
        if let Err(err) = self.store.set_sandbox_state(id, SandboxState::Paused).await {
            // The store still says running: thaw so both agree.
            let _ = self.runtime.resume(id, &sandbox.handle).await;
            self.set_status(id, SandboxStatus::Running);
            return Err(err.into());
        }
        if let Some(entry) = self.live().get_mut(id) {
            entry.status = SandboxStatus::Paused;
            entry.paused_at = Some(Utc::now());
            entry.checkpoint_failures = 0;
        }
        self.activity
            .event(id, LogLevel::Info, "sandbox paused", &[])
            .await;
        tracing::info!(sandbox_id = %id, "sandbox paused");
        Ok(())
    }

    /// Ends the processes of a sandbox marked `Pausing` and keeps only its files.
    async fn shelve(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        let id = sandbox.id.as_str();
        // The agent's last lines, before its processes end.
        self.activity
            .ingest_agent_log(self.runtime.as_ref(), id)
            .await;
        let handle = match self.release_recorded(id, &sandbox.handle, None).await {
            Ok(handle) => handle,
            Err(err) => {
                // Still running if the release failed early; if its processes are gone, the
                // reaper stops it like any dead sandbox.
                self.set_status(id, SandboxStatus::Running);
                return Err(err);
            }
        };
        if let Some(entry) = self.live().get_mut(id) {
            entry.status = SandboxStatus::Shelved;
            entry.endpoint = None;
            entry.handle = handle.clone();
        }
        self.store
            .set_sandbox_paused(id, Some(PauseKind::Files), &handle)
            .await?;
        self.activity
            .event(
                id,
                LogLevel::Info,
                "sandbox paused",
                &[("memory", "false".to_owned())],
            )
            .await;
        tracing::info!(sandbox_id = %id, "sandbox paused without memory");
        Ok(())
    }

    /// Ends the processes of sandbox `id` (handle `handle`) and keeps only its files. It is
    /// recorded `releasing` meanwhile, so a restart in between finishes the job rather than
    /// taking it for dead; if the release fails the store says `before` again (`None`:
    /// running). The caller records the result.
    async fn release_recorded(
        &self,
        id: &str,
        handle: &RuntimeHandle,
        before: Option<PauseKind>,
    ) -> Result<RuntimeHandle, SandboxError> {
        self.store
            .set_sandbox_paused(id, Some(PauseKind::Releasing), handle)
            .await?;
        match self.runtime.release(id, handle).await {
            Ok(released) => {
                crate::faults::crash_point("pause.released");
                Ok(released)
            }
            Err(err) => {
                if let Err(err) = self.store.set_sandbox_paused(id, before, handle).await {
                    tracing::error!(sandbox_id = %id, error = %err, "cannot record the sandbox as it was");
                }
                Err(err.into())
            }
        }
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
        if let Err(retry_after_secs) = self.within_slots(team, id) {
            self.set_status(id, from);
            return Err(SandboxError::ConcurrencyLimit {
                id: id.to_owned(),
                limit: team.max_concurrent_sandboxes,
                retry_after_secs,
            });
        }
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
            self.set_status(&id, from);
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
        let released = match self.release_recorded(&id, &handle, sandbox.paused_as).await {
            Ok(released) => released,
            Err(err) => {
                self.set_status(&id, from);
                return Err(err);
            }
        };
        if let Some(entry) = self.live().get_mut(&id) {
            entry.endpoint = None;
            entry.handle = released.clone();
        }
        self.store
            .set_sandbox_paused(&id, Some(PauseKind::Files), &released)
            .await?;
        self.activity
            .event(&id, LogLevel::Info, "sandbox memory dropped on resume", &[])
            .await;
        sandbox.handle = released;
        sandbox.paused_as = Some(PauseKind::Files);
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
        sandbox.handle = entry.handle.clone();
        Ok(std::mem::replace(&mut entry.status, to))
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
                if let Err(err) = self.store.set_sandbox_paused(&id, None, &handle).await {
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
                        entry.status = from;
                        entry.handle = sandbox.handle.clone();
                    }
                    return Err(err);
                }
            }
        } else {
            let result = async {
                self.store.set_sandbox_end(&id, end_at).await?;
                self.runtime.resume(&id, &sandbox.handle).await?;
                crate::faults::crash_point("resume.thawed");
                self.store
                    .set_sandbox_state(&id, SandboxState::Running)
                    .await?;
                Ok::<(), SandboxError>(())
            }
            .await;
            if let Err(err) = result {
                let _ = self.runtime.pause(&id, &sandbox.handle).await;
                self.set_status(&id, SandboxStatus::Paused);
                return Err(err);
            }
            None
        };
        if let Some((handle, _)) = &booted {
            sandbox.handle = handle.clone();
            sandbox.paused_as = None;
        }
        if let Some(entry) = self.live().get_mut(&id) {
            entry.end_at = end_at;
            entry.status = SandboxStatus::Running;
            if let Some((handle, endpoint)) = booted {
                entry.handle = handle;
                entry.endpoint = Some(endpoint);
            }
        }
        sandbox.end_at = end_at;
        sandbox.state = SandboxState::Running;
        sandbox.paused_as = None;
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
                    envd_access_token: (!l.access_token.is_empty())
                        .then_some(l.access_token.as_str()),
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
            if let Err(retry_after_secs) = self.within_slots(&team, id) {
                self.set_status(id, from);
                tracing::warn!(sandbox_id = %id, team_id = %team.id, "not resumed by traffic: the team is at its concurrency limit");
                return Err(SandboxError::ConcurrencyLimit {
                    id: id.to_owned(),
                    limit: team.max_concurrent_sandboxes,
                    retry_after_secs,
                });
            }
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

#[cfg(test)]
mod tests {
    use super::*;

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
