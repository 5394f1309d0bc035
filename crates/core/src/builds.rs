//! Template builds: what a build asks for, what it produces, and the service that queues,
//! runs (through a [`Builder`]), records and reports them.
//!
//! A built template is a [`TemplateImage`]: a stack of read-only layers (opaque names the
//! node resolves) plus the environment, user, working directory and start command every
//! sandbox of the template gets. The core decides who may build what and keeps the record;
//! how layers are made is the builder's business.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use tokio::io::AsyncRead;
use tokio::sync::{Notify, watch};

use crate::build_queue::{BuildLimits, BuildOwner, BuildQueue};
use crate::caps::check_count;
use crate::lock;
use crate::model::{BUILT_IN_TEMPLATE_ALIASES, BuildStatus, Team, Template};
use crate::store::{Store, StoreError};

pub use crate::model::builds::{
    BASE_STEP, BuildFailure, BuildLogEntry, BuildRecord, BuildSource, BuildSpec, BuildStep,
    FINALIZE_STEP, LogLevel, RegistryCredentials, StepKind,
};
pub use crate::model::templates::{SnapshotImage, StartedImage, TemplateImage, split_name};

/// One build handed to a [`Builder`].
#[derive(Debug, Clone)]
pub struct BuildJob {
    pub build_id: String,
    pub template_id: String,
    pub team_id: Option<String>,
    pub spec: BuildSpec,
    /// The image of `BuildSource::Template`, resolved by the core.
    pub base: Option<TemplateImage>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
    /// The longest one `RUN` step may take; past it the step's sandbox goes and the build
    /// fails.
    pub step_timeout: Duration,
}

/// The message a build ends with when a `RUN` step outlives `limit`.
pub fn step_timeout_message(step: &str, command: &str, limit: Duration) -> String {
    format!(
        "step {step} (RUN {command}) exceeded the {} s step limit",
        limit.as_secs()
    )
}

/// The message a cancelled build ends with.
pub const CANCELLED_MESSAGE: &str = "the build was cancelled by request";

/// Where a builder reports progress.
#[derive(Clone)]
pub struct BuildLog {
    sink: Arc<dyn Fn(BuildLogEntry) + Send + Sync>,
}

impl std::fmt::Debug for BuildLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuildLog").finish_non_exhaustive()
    }
}

impl BuildLog {
    pub fn new(sink: impl Fn(BuildLogEntry) + Send + Sync + 'static) -> Self {
        Self {
            sink: Arc::new(sink),
        }
    }

    pub fn log(&self, level: LogLevel, step: Option<&str>, message: impl Into<String>) {
        (self.sink)(BuildLogEntry {
            timestamp: Utc::now(),
            level,
            message: message.into(),
            step: step.map(str::to_owned),
        });
    }

    pub fn info(&self, step: Option<&str>, message: impl Into<String>) {
        self.log(LogLevel::Info, step, message);
    }
}

pub type UploadBody = Pin<Box<dyn AsyncRead + Send>>;

#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("upload of files {hash} is larger than the limit of {limit} bytes")]
    TooLarge { hash: String, limit: u64 },
    #[error(
        "upload of files {hash} refused: the team already keeps {limit} uploads, the most it may (uploads are removed once a build used them or after a while unused)"
    )]
    TeamCount { hash: String, limit: usize },
    #[error(
        "upload of files {hash} refused: the team's uploads would take more than {limit} bytes, the most it may keep (uploads are removed once a build used them or after a while unused)"
    )]
    TeamBytes { hash: String, limit: u64 },
    #[error("upload of files {hash} is not a valid gzip stream: {message}")]
    Corrupt { hash: String, message: String },
    #[error("upload of files {hash} failed: {message}")]
    Failed { hash: String, message: String },
}

/// Makes templates: pulls sources, runs steps, keeps layers and uploaded files.
#[async_trait::async_trait]
pub trait Builder: Send + Sync + 'static {
    /// Runs `job` to the end, reporting through `log`.
    async fn build(&self, job: BuildJob, log: BuildLog) -> Result<TemplateImage, BuildFailure>;
    /// Whether the team already uploaded the files of `hash`; if so, they now also belong to
    /// `template_id`.
    async fn has_upload(&self, team_id: &str, template_id: &str, hash: &str) -> bool;
    /// Keeps an uploaded build-context tar under the team and hash, for `template_id`.
    async fn store_upload(
        &self,
        team_id: &str,
        template_id: &str,
        hash: &str,
        body: UploadBody,
        limit: u64,
    ) -> Result<(), UploadError>;
    /// Template `template_id` of the team was deleted: uploads that belonged to it alone go.
    fn forget_template_uploads(&self, _team_id: &str, _template_id: &str) {}
    /// Drops layers that none of `in_use` (and no running sandbox) needs.
    async fn collect_garbage(&self, in_use: &[String]);
    /// `job` was queued: the uploads it reads must stay until [`Builder::release_uploads`].
    fn hold_uploads(&self, _job: &BuildJob) {}
    /// `job` ended, or will never run: its uploads may go unless another build holds them.
    fn release_uploads(&self, _job: &BuildJob) {}
    /// Removes uploads that no build used for longer than the node keeps them.
    async fn sweep_uploads(&self) {}
}

/// Log lines one build keeps; later ones are counted and dropped.
pub const BUILD_LOG_MAX_LINES: usize = 10_000;
/// Bytes of log messages one build keeps.
pub const BUILD_LOG_MAX_BYTES: usize = 4 << 20;
/// Room kept beyond the caps for warnings and errors, so the reason a build failed is never
/// among the lines dropped.
const BUILD_LOG_WARNING_LINES: usize = 100;
const BUILD_LOG_WARNING_BYTES: usize = 256 << 10;

/// Bounds one build's log, whatever its steps print.
#[derive(Debug)]
struct LogCap {
    max_lines: usize,
    max_bytes: usize,
    lines: usize,
    bytes: usize,
    dropped_lines: u64,
    dropped_bytes: u64,
}

impl LogCap {
    fn new(max_lines: usize, max_bytes: usize) -> Self {
        Self {
            max_lines,
            max_bytes,
            lines: 0,
            bytes: 0,
            dropped_lines: 0,
            dropped_bytes: 0,
        }
    }

    /// Whether `entry` is kept; counts it either way.
    fn admit(&mut self, entry: &BuildLogEntry) -> bool {
        let (max_lines, max_bytes) = if entry.level >= LogLevel::Warn {
            (
                self.max_lines + BUILD_LOG_WARNING_LINES,
                self.max_bytes + BUILD_LOG_WARNING_BYTES,
            )
        } else {
            (self.max_lines, self.max_bytes)
        };
        let size = entry.message.len();
        if self.lines < max_lines && self.bytes.saturating_add(size) <= max_bytes {
            self.lines += 1;
            self.bytes += size;
            true
        } else {
            self.dropped_lines += 1;
            self.dropped_bytes += size as u64;
            false
        }
    }

    /// What the log says at its end when lines were dropped.
    fn note(&self) -> Option<String> {
        (self.dropped_lines > 0).then(|| {
            format!(
                "{} more log lines ({} bytes) of this build were not kept: a build keeps at most {} lines and {} bytes of log",
                self.dropped_lines, self.dropped_bytes, self.max_lines, self.max_bytes
            )
        })
    }
}

/// Holds a queued build's uploads until it is dropped, whether the build ran, failed or was
/// aborted before it started.
struct UploadHold {
    builder: Arc<dyn Builder>,
    job: BuildJob,
}

impl UploadHold {
    fn new(builder: Arc<dyn Builder>, job: BuildJob) -> Self {
        builder.hold_uploads(&job);
        Self { builder, job }
    }
}

impl Drop for UploadHold {
    fn drop(&mut self) {
        self.builder.release_uploads(&self.job);
    }
}

/// Decides, while a build is requested, whether the registry an image reference names may be
/// contacted, so the caller hears at once rather than from a failed build. The node checks
/// every connection of the pull again: an answer here can change by the time it runs.
#[async_trait::async_trait]
pub trait RegistryCheck: Send + Sync + 'static {
    /// Why the registry of `reference` may not be contacted, if it may not.
    async fn refusal(&self, reference: &str) -> Option<String>;
}

#[derive(Debug, thiserror::Error)]
pub enum RequestBuildError {
    #[error(transparent)]
    Dockerfile(#[from] crate::dockerfile::DockerfileError),
    #[error("image '{reference}' cannot be pulled: {reason}")]
    RegistryRefused { reference: String, reason: String },
    #[error("template '{0}' not found")]
    TemplateNotFound(String),
    #[error("invalid template name '{0}': use lower-case letters, digits, '-', '_' and '.'")]
    BadName(String),
    #[error("invalid tag '{0}'")]
    BadTag(String),
    #[error("a template name is required")]
    MissingName,
    #[error("template name '{0}' is in another team's namespace")]
    NameTaken(String),
    #[error("{field} must be between {min} and {max}, got {value}")]
    OutOfRange {
        field: &'static str,
        min: u32,
        max: u32,
        value: u32,
    },
    #[error("{field} {value} is above this team's limit of {max}")]
    TeamLimit {
        field: &'static str,
        value: u32,
        max: u32,
    },
    #[error(transparent)]
    Cap(#[from] crate::caps::CapError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum StartBuildError {
    #[error("template '{0}' not found")]
    TemplateNotFound(String),
    #[error("build '{build_id}' of template '{template_id}' not found")]
    BuildNotFound {
        template_id: String,
        build_id: String,
    },
    #[error("build '{0}' was already started")]
    AlreadyStarted(String),
    #[error("invalid build: {0}")]
    Invalid(String),
    #[error("image '{reference}' cannot be pulled: {reason}")]
    RegistryRefused { reference: String, reason: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum BuildLookupError {
    #[error("template '{0}' not found")]
    TemplateNotFound(String),
    #[error("build '{build_id}' of template '{template_id}' not found")]
    BuildNotFound {
        template_id: String,
        build_id: String,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum CancelBuildError {
    #[error("template '{0}' not found")]
    TemplateNotFound(String),
    #[error("build '{build_id}' of template '{template_id}' not found")]
    BuildNotFound {
        template_id: String,
        build_id: String,
    },
    #[error("build '{build_id}' already ended with status {status}")]
    AlreadyEnded {
        build_id: String,
        status: &'static str,
    },
    #[error("build '{build_id}' runs on node '{node_id}', which this request could not reach")]
    OnAnotherNode { build_id: String, node_id: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How long a cancel waits for the build's end to be recorded.
const CANCEL_WAIT: Duration = Duration::from_secs(30);

fn cancelled_failure() -> BuildFailure {
    BuildFailure {
        message: CANCELLED_MESSAGE.to_owned(),
        step: None,
    }
}

/// Resolves once `flag` is set; never when its sender went away unset.
async fn until_cancelled(flag: &mut watch::Receiver<bool>) {
    if flag.wait_for(|cancelled| *cancelled).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Takes a build off the live list when its task ends, however it ends.
struct LiveEntry {
    live: Arc<Mutex<HashMap<String, Arc<watch::Sender<bool>>>>>,
    build_id: String,
}

impl Drop for LiveEntry {
    fn drop(&mut self) {
        lock(&self.live).remove(&self.build_id);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UploadLinkError {
    #[error("template '{0}' not found")]
    TemplateNotFound(String),
    #[error("invalid files hash '{0}': expected 64 hexadecimal characters")]
    BadHash(String),
    #[error("the upload link is invalid, used or expired")]
    BadToken,
    #[error(transparent)]
    Upload(#[from] UploadError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateAdminError {
    #[error("template '{0}' not found")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error("template '{0}' is built in and cannot be changed")]
    BuiltIn(String),
    #[error(transparent)]
    Cap(#[from] crate::caps::CapError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Stands for the build context's files hash until a Dockerfile build starts.
const CONTEXT_PLACEHOLDER: &str =
    "0000000000000000000000000000000000000000000000000000000000000000";

/// What `POST /templates` asks for.
#[derive(Debug, Clone, Default)]
pub struct DockerfileRequest {
    pub dockerfile: String,
    pub alias: Option<String>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    pub cpu_count: Option<u32>,
    pub memory_mb: Option<u32>,
}

/// What `POST /v3/templates` asks for.
#[derive(Debug, Clone, Default)]
pub struct RequestBuild {
    pub name: Option<String>,
    pub tags: Vec<String>,
    pub cpu_count: Option<u32>,
    pub memory_mb: Option<u32>,
}

#[derive(Debug, Clone)]
pub struct BuildRequested {
    pub template: Template,
    pub build_id: String,
    pub tags: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
pub struct BuildsConfig {
    pub default_cpu_count: u32,
    pub default_memory_mb: u32,
    pub disk_size_mb: u32,
    pub max_cpu_count: u32,
    pub max_memory_mb: u32,
    /// Largest build-context upload accepted, in bytes.
    pub max_upload_bytes: u64,
    /// How long an upload link stays valid.
    pub upload_link_ttl: Duration,
    /// Builds that run at once on this node; others wait for a slot.
    pub concurrent_builds: usize,
    /// Builds of one team that run at once; a team's further builds wait for its own.
    pub builds_per_team: usize,
    /// The longest one `RUN` step may take.
    pub step_timeout: Duration,
    /// The agent protocol version sandboxes of new templates report.
    pub envd_version: &'static str,
}

struct UploadGrant {
    team_id: String,
    template_id: String,
    hash: String,
    expires: tokio::time::Instant,
}

/// The errors of operations on one build of a team's template, which say the same when
/// [`Builds::own_build`] finds no such template or build.
trait OwnBuildError: From<StoreError> {
    fn template_not_found(template_id: &str) -> Self;
    fn build_not_found(template_id: &str, build_id: &str) -> Self;
}

/// For the error enums whose not-found variants are spelled alike.
macro_rules! own_build_error {
    ($($error:ty),+) => {$(
        impl OwnBuildError for $error {
            fn template_not_found(template_id: &str) -> Self {
                Self::TemplateNotFound(template_id.to_owned())
            }
            fn build_not_found(template_id: &str, build_id: &str) -> Self {
                Self::BuildNotFound {
                    template_id: template_id.to_owned(),
                    build_id: build_id.to_owned(),
                }
            }
        }
    )+};
}

own_build_error!(StartBuildError, CancelBuildError);

/// The build service: requests, uploads, the queue and its records.
#[derive(Clone)]
pub struct Builds {
    store: Arc<Store>,
    builder: Arc<dyn Builder>,
    config: BuildsConfig,
    queue: Arc<BuildQueue>,
    /// Builds queued or running here, by ID: setting one's flag cancels it, and its sender
    /// closes once the build's end is recorded.
    live: Arc<Mutex<HashMap<String, Arc<watch::Sender<bool>>>>>,
    grants: Arc<Mutex<HashMap<String, UploadGrant>>>,
    /// The files a template's Dockerfile build reads as its context: the last ones its
    /// owner asked an upload link for.
    contexts: Arc<Mutex<HashMap<String, String>>>,
    finished: Arc<Notify>,
    tasks: Arc<Mutex<tokio::task::JoinSet<()>>>,
    registry_check: Option<Arc<dyn RegistryCheck>>,
    /// The cluster node these builds run on; `None` on a single host.
    node_id: Option<String>,
    /// Held from counting a team's templates or a template's tags to recording new ones.
    cap_gate: Arc<crate::caps::TeamGate>,
}

impl std::fmt::Debug for Builds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Builds")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The CPUs and memory a build was granted.
#[derive(Debug, Clone, Copy)]
struct BuildResources {
    cpu_count: u32,
    memory_mb: u32,
}

/// The template name in `full` (`name:tag`, with the team's namespace or none) and the tags
/// the build gets: `tags` and the name's own, sorted and without repeats.
fn requested_name_and_tags<'a>(
    team: &Team,
    full: &'a str,
    mut tags: Vec<String>,
) -> Result<(&'a str, Vec<String>), RequestBuildError> {
    let (name, tag) = split_name(full);
    // A name may carry the team's own namespace, as E2B's names do; no other.
    let name = match name.split_once('/') {
        Some((namespace, alias)) if namespace == team.slug => alias,
        Some(_) => return Err(RequestBuildError::NameTaken(full.to_owned())),
        None => name,
    };
    if !valid_name(name) || BUILT_IN_TEMPLATE_ALIASES.contains(&name) {
        return Err(RequestBuildError::BadName(full.to_owned()));
    }
    if let Some(tag) = tag {
        tags.push(tag.to_owned());
    }
    for tag in &tags {
        if !valid_tag(tag) {
            return Err(RequestBuildError::BadTag(tag.clone()));
        }
    }
    tags.sort();
    tags.dedup();
    Ok((name, tags))
}

pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"-_.".contains(&c))
        && name
            .bytes()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
}

fn valid_tag(tag: &str) -> bool {
    crate::ids::is_plain_name(tag, 128, b"-_.")
}

pub fn valid_files_hash(hash: &str) -> bool {
    hash.len() == 64 && hash.bytes().all(|c| c.is_ascii_hexdigit())
}

impl Builds {
    /// `finished` is notified whenever a build ends (see [`crate::Templates::build_finished`]).
    pub fn new(
        store: Arc<Store>,
        builder: Arc<dyn Builder>,
        config: BuildsConfig,
        finished: Arc<Notify>,
    ) -> Self {
        Self {
            store,
            builder,
            queue: BuildQueue::new(BuildLimits {
                total: config.concurrent_builds.max(1),
                per_team: config.builds_per_team.max(1),
            }),
            live: Arc::new(Mutex::new(HashMap::new())),
            config,
            grants: Arc::new(Mutex::new(HashMap::new())),
            contexts: Arc::new(Mutex::new(HashMap::new())),
            finished,
            tasks: Arc::new(Mutex::new(tokio::task::JoinSet::new())),
            registry_check: None,
            node_id: None,
            cap_gate: Arc::default(),
        }
    }

    /// Builds that run on node `node_id` of a cluster, which their records name.
    pub fn on_node(mut self, node_id: String) -> Self {
        self.node_id = Some(node_id);
        self
    }

    /// How many of this node's build slots are taken or waited for, for its lease report.
    pub fn slot_use(&self) -> crate::model::BuildSlotUse {
        self.queue.slot_use()
    }

    /// Refuses builds from registries `check` refuses, when they are requested.
    pub fn with_registry_check(mut self, check: Arc<dyn RegistryCheck>) -> Self {
        self.registry_check = Some(check);
        self
    }

    /// The image reference of `source` and why its registry is refused, if it is.
    async fn registry_refusal(&self, source: &BuildSource) -> Option<(String, String)> {
        let (BuildSource::Image { reference, .. }, Some(check)) = (source, &self.registry_check)
        else {
            return None;
        };
        let reason = check.refusal(reference).await?;
        Some((reference.clone(), reason))
    }

    /// Marks as failed the unfinished builds a previous run of this process left (on a single
    /// host, every unfinished build; on a node, those recorded on it), and those `lost` says
    /// were on a node that is gone (given the recorded node, `None` for a build recorded on
    /// none): their work is gone.
    pub async fn recover(&self, lost: impl Fn(Option<&str>) -> bool) -> Result<usize, StoreError> {
        let stale: Vec<BuildRecord> = self
            .store
            .builds
            .unfinished_builds()
            .await?
            .into_iter()
            .filter(|b| {
                self.node_id.is_none()
                    || b.node_id.is_some() && b.node_id == self.node_id
                    || lost(b.node_id.as_deref())
            })
            .collect();
        for build in &stale {
            self.finish(
                build,
                Err(BuildFailure {
                    message: "the build was interrupted by a server restart".into(),
                    step: None,
                }),
            )
            .await?;
        }
        Ok(stale.len())
    }

    /// Stops running builds (their sandboxes go with the builder's cleanup) and records them
    /// as failed.
    pub async fn shutdown(&self) {
        let mut tasks = std::mem::take(&mut *lock(&self.tasks));
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
        // Only this node's: other nodes' builds go on.
        if let Err(e) = self.recover(|_| false).await {
            tracing::warn!(error = %e, "cannot record interrupted builds");
        }
    }

    /// `POST /v3/templates`: finds or creates the team's template by name and opens a build.
    pub async fn request(
        &self,
        team: &Team,
        request: RequestBuild,
    ) -> Result<BuildRequested, RequestBuildError> {
        let full = request.name.ok_or(RequestBuildError::MissingName)?;
        let (name, tags) = requested_name_and_tags(team, &full, request.tags)?;
        let resources = self.requested_resources(team, request.cpu_count, request.memory_mb)?;
        let now = Utc::now();
        // A built-in template's name stays unambiguous in every namespace.
        if self
            .store
            .templates
            .template_by_name(None, name)
            .await?
            .is_some()
        {
            return Err(RequestBuildError::BadName(full.clone()));
        }
        let _turn = self.cap_gate.enter(&team.id).await;
        let existing = self
            .store
            .templates
            .template_by_name(Some(&team.id), name)
            .await?;
        self.check_request_caps(team, existing.as_ref(), &tags)
            .await?;
        let template = match existing {
            Some(t) => t,
            None => self.new_team_template(team, name, resources, now),
        };
        self.open_build(team, template, resources, tags, now).await
    }

    /// The CPUs and memory a build asks for, or the defaults, within the server's and the
    /// team's limits.
    fn requested_resources(
        &self,
        team: &Team,
        cpu_count: Option<u32>,
        memory_mb: Option<u32>,
    ) -> Result<BuildResources, RequestBuildError> {
        let cpu = cpu_count.unwrap_or(self.config.default_cpu_count);
        if cpu == 0 || cpu > self.config.max_cpu_count {
            return Err(RequestBuildError::OutOfRange {
                field: "cpuCount",
                min: 1,
                max: self.config.max_cpu_count,
                value: cpu,
            });
        }
        let memory = memory_mb.unwrap_or(self.config.default_memory_mb);
        if !(128..=self.config.max_memory_mb).contains(&memory) {
            return Err(RequestBuildError::OutOfRange {
                field: "memoryMB",
                min: 128,
                max: self.config.max_memory_mb,
                value: memory,
            });
        }
        if let Some((field, value, max)) =
            team.limits
                .exceeded_by(cpu, memory, self.config.disk_size_mb)
        {
            return Err(RequestBuildError::TeamLimit { field, value, max });
        }
        Ok(BuildResources {
            cpu_count: cpu,
            memory_mb: memory,
        })
    }

    /// Refuses a build past the team's caps: a new template counts against its templates and
    /// its tags against the tags per template; an existing one's tags join those it has.
    async fn check_request_caps(
        &self,
        team: &Team,
        existing: Option<&Template>,
        tags: &[String],
    ) -> Result<(), RequestBuildError> {
        match existing {
            None => {
                let kept = self
                    .store
                    .templates
                    .templates()
                    .await?
                    .iter()
                    .filter(|t| t.team_id.as_deref() == Some(team.id.as_str()))
                    .filter(|t| t.image.as_ref().is_none_or(|i| i.snapshot.is_none()))
                    .count();
                check_count(team, "templates", team.limits.caps.max_templates, kept)?;
                check_count(
                    team,
                    "tags per template",
                    team.limits.caps.max_tags_per_template,
                    tags.len().saturating_sub(1),
                )?;
                Ok(())
            }
            Some(t) => {
                self.check_tag_cap::<RequestBuildError>(team, &t.id, tags)
                    .await
            }
        }
    }

    /// A template the team names for the first time, not built yet.
    fn new_team_template(
        &self,
        team: &Team,
        name: &str,
        resources: BuildResources,
        now: chrono::DateTime<Utc>,
    ) -> Template {
        Template {
            team_id: Some(team.id.clone()),
            namespace: Some(team.slug.clone()),
            aliases: vec![name.to_owned()],
            envd_version: self.config.envd_version.to_owned(),
            ..Template::unbuilt(
                crate::ids::new_template_id(),
                resources.cpu_count,
                resources.memory_mb,
                self.config.disk_size_mb,
                now,
            )
        }
    }

    /// Records a new waiting build of `template` with its tags; the build starts when its
    /// files or steps arrive.
    async fn open_build(
        &self,
        team: &Team,
        mut template: Template,
        resources: BuildResources,
        tags: Vec<String>,
        now: chrono::DateTime<Utc>,
    ) -> Result<BuildRequested, RequestBuildError> {
        let build_id = crate::ids::new_uuid();
        template.build_id = build_id.clone();
        template.build_status = BuildStatus::Waiting;
        template.build_error = None;
        template.build_count += 1;
        // Its sandboxes boot the current agent, so a rebuilt template reports its version, as
        // rebuilding brings an E2B template the current envd.
        template.envd_version = self.config.envd_version.to_owned();
        template.updated_at = now;
        self.store.templates.upsert_template(&template).await?;
        self.store
            .builds
            .insert_build(&BuildRecord {
                id: build_id.clone(),
                template_id: template.id.clone(),
                team_id: Some(team.id.clone()),
                status: BuildStatus::Waiting,
                failure: None,
                spec: None,
                image: None,
                cpu_count: resources.cpu_count,
                memory_mb: resources.memory_mb,
                disk_size_mb: self.config.disk_size_mb,
                created_at: now,
                updated_at: now,
                finished_at: None,
                node_id: self.node_id.clone(),
            })
            .await?;
        self.store
            .builds
            .set_build_tags(&template.id, &build_id, &tags)
            .await?;
        Ok(BuildRequested {
            template,
            build_id,
            tags,
        })
    }

    /// Refuses `adding` tags on the template when, with the tags its builds already carry,
    /// they would pass the team's cap on tags per template.
    async fn check_tag_cap<E: From<crate::caps::CapError> + From<StoreError>>(
        &self,
        team: &Team,
        template_id: &str,
        adding: &[String],
    ) -> Result<(), E> {
        let limit = team.limits.caps.max_tags_per_template;
        if limit == 0 || adding.is_empty() {
            return Ok(());
        }
        let mut names: std::collections::BTreeSet<String> = self
            .store
            .builds
            .template_tags(template_id)
            .await?
            .into_iter()
            .map(|(tag, _)| tag)
            .collect();
        let before = names.len();
        names.extend(adding.iter().cloned());
        if names.len() == before {
            return Ok(());
        }
        Ok(check_count(
            team,
            "tags per template",
            limit,
            names.len() - 1,
        )?)
    }

    async fn own_template(&self, team: &Team, template_id: &str) -> Result<Template, StoreError> {
        self.store
            .templates
            .template(template_id)
            .await?
            .filter(|t| t.team_id.as_deref() == Some(team.id.as_str()))
            .ok_or_else(|| StoreError::NotFound {
                what: "template",
                id: template_id.to_owned(),
            })
    }

    /// Build `build_id` of the team's own template `template_id`, or the error naming which
    /// of the two it does not have.
    async fn own_build<E: OwnBuildError>(
        &self,
        team: &Team,
        template_id: &str,
        build_id: &str,
    ) -> Result<(Template, BuildRecord), E> {
        let Some(template) = self
            .store
            .templates
            .template(template_id)
            .await?
            .filter(|t| t.team_id.as_deref() == Some(team.id.as_str()))
        else {
            return Err(E::template_not_found(template_id));
        };
        self.store
            .builds
            .build(build_id)
            .await?
            .filter(|b| b.template_id == template.id)
            .map(|build| (template, build))
            .ok_or_else(|| E::build_not_found(template_id, build_id))
    }

    /// `GET /templates/{id}/files/{hash}`: whether the files are cached, and if not a
    /// single-use token to upload them with.
    pub async fn upload_link(
        &self,
        team: &Team,
        template_id: &str,
        hash: &str,
    ) -> Result<(bool, Option<String>), UploadLinkError> {
        if !valid_files_hash(hash) {
            return Err(UploadLinkError::BadHash(hash.to_owned()));
        }
        let template = self
            .own_template(team, template_id)
            .await
            .map_err(|_| UploadLinkError::TemplateNotFound(template_id.to_owned()))?;
        let present = self.builder.has_upload(&team.id, &template.id, hash).await;
        lock(&self.contexts).insert(template_id.to_owned(), hash.to_owned());
        let token = crate::ids::new_secret("");
        let mut grants = lock(&self.grants);
        let now = tokio::time::Instant::now();
        grants.retain(|_, g| g.expires > now);
        grants.insert(
            token.clone(),
            UploadGrant {
                team_id: team.id.clone(),
                template_id: template.id.clone(),
                hash: hash.to_owned(),
                expires: now + self.config.upload_link_ttl,
            },
        );
        Ok((present, Some(token)))
    }

    /// The `PUT` behind an upload link: no API key, the token is the authority.
    pub async fn upload(
        &self,
        hash: &str,
        token: &str,
        body: UploadBody,
    ) -> Result<(), UploadLinkError> {
        let grant = {
            let mut grants = lock(&self.grants);
            grants.remove(token)
        };
        let grant = grant
            .filter(|g| g.expires > tokio::time::Instant::now() && g.hash == hash)
            .ok_or(UploadLinkError::BadToken)?;
        self.builder
            .store_upload(
                &grant.team_id,
                &grant.template_id,
                &grant.hash,
                body,
                self.config.max_upload_bytes,
            )
            .await?;
        // The template may have been deleted while its files arrived: they go with it.
        if self
            .store
            .templates
            .template(&grant.template_id)
            .await?
            .is_none()
        {
            self.builder
                .forget_template_uploads(&grant.team_id, &grant.template_id);
        }
        Ok(())
    }

    /// `POST /v2/templates/{id}/builds/{buildID}`: validates and queues the build.
    pub async fn start(
        &self,
        team: &Team,
        template_id: &str,
        build_id: &str,
        spec: BuildSpec,
    ) -> Result<(), StartBuildError> {
        let (template, build) = self.waiting_build(team, template_id, build_id).await?;
        let base = match &spec.source {
            BuildSource::Template { reference } => {
                let base = self.resolve_base(team, reference).await?;
                if base.id == template.id {
                    return Err(StartBuildError::Invalid(format!(
                        "template '{reference}' cannot be built from itself"
                    )));
                }
                Some(base.image.ok_or_else(|| {
                    StartBuildError::Invalid(format!(
                        "template '{reference}' has no successful build yet"
                    ))
                })?)
            }
            BuildSource::Builtin { layer } => {
                return Err(StartBuildError::Invalid(format!(
                    "'{layer}' can only be built by the server itself"
                )));
            }
            BuildSource::Image { reference, .. } => {
                if reference.is_empty() || reference.len() > 512 || reference.contains(' ') {
                    return Err(StartBuildError::Invalid(format!(
                        "invalid image reference '{reference}'"
                    )));
                }
                None
            }
        };
        for (i, step) in spec.steps.iter().enumerate() {
            if let StepKind::Copy { files_hash, .. } = &step.kind
                && !valid_files_hash(files_hash)
            {
                return Err(StartBuildError::Invalid(format!(
                    "step {}: invalid filesHash '{files_hash}'",
                    i + 1
                )));
            }
        }
        self.launch(team, &template, build, spec, base).await
    }

    /// The team's build `build_id` of `template_id`, which must not have started yet.
    async fn waiting_build(
        &self,
        team: &Team,
        template_id: &str,
        build_id: &str,
    ) -> Result<(Template, BuildRecord), StartBuildError> {
        let (template, build) = self
            .own_build::<StartBuildError>(team, template_id, build_id)
            .await?;
        if build.status != BuildStatus::Waiting {
            return Err(StartBuildError::AlreadyStarted(build_id.to_owned()));
        }
        Ok((template, build))
    }

    /// Refuses a source the registry policy forbids; otherwise marks the build running and
    /// queues it.
    async fn launch(
        &self,
        team: &Team,
        template: &Template,
        mut build: BuildRecord,
        spec: BuildSpec,
        base: Option<TemplateImage>,
    ) -> Result<(), StartBuildError> {
        if let Some((reference, reason)) = self.registry_refusal(&spec.source).await {
            return Err(StartBuildError::RegistryRefused { reference, reason });
        }
        build.spec = Some(spec.clone());
        build.status = BuildStatus::Building;
        build.updated_at = Utc::now();
        build.node_id = self.node_id.clone();
        self.store.builds.update_build(&build).await?;
        self.store
            .templates
            .set_template_build(&template.id, BuildStatus::Building, None)
            .await?;
        let job = self.job_of(&build, Some(team.id.clone()), spec, base);
        self.spawn(build, job);
        Ok(())
    }

    /// What the builder is given to run `build`, sized as the build was recorded.
    fn job_of(
        &self,
        build: &BuildRecord,
        team_id: Option<String>,
        spec: BuildSpec,
        base: Option<TemplateImage>,
    ) -> BuildJob {
        BuildJob {
            build_id: build.id.clone(),
            template_id: build.template_id.clone(),
            team_id,
            spec,
            base,
            cpu_count: build.cpu_count,
            memory_mb: build.memory_mb,
            disk_size_mb: build.disk_size_mb,
            step_timeout: self.config.step_timeout,
        }
    }

    /// `POST /templates` and `POST /templates/{id}`: a Dockerfile build, parsed now (a bad
    /// Dockerfile is refused before anything is recorded) and started by
    /// [`Builds::start_dockerfile`].
    pub async fn request_dockerfile(
        &self,
        team: &Team,
        template_id: Option<&str>,
        request: DockerfileRequest,
    ) -> Result<BuildRequested, RequestBuildError> {
        let parsed = crate::dockerfile::to_build(&request.dockerfile, Some(CONTEXT_PLACEHOLDER))?;
        if let Some((reference, reason)) = self.registry_refusal(&parsed.spec.source).await {
            return Err(RequestBuildError::RegistryRefused { reference, reason });
        }
        let name = match template_id {
            Some(id) => {
                let template = self
                    .own_template(team, id)
                    .await
                    .map_err(|_| RequestBuildError::TemplateNotFound(id.to_owned()))?;
                template.aliases.first().cloned().or(request.alias.clone())
            }
            None => request.alias.clone(),
        };
        let requested = match (template_id, name) {
            (_, Some(name)) => {
                self.request(
                    team,
                    RequestBuild {
                        name: Some(name),
                        tags: Vec::new(),
                        cpu_count: request.cpu_count,
                        memory_mb: request.memory_mb,
                    },
                )
                .await?
            }
            (Some(id), None) => return Err(RequestBuildError::TemplateNotFound(id.to_owned())),
            (None, None) => {
                self.request(
                    team,
                    RequestBuild {
                        name: Some(format!("template-{}", &crate::ids::new_secret("")[..12])),
                        tags: Vec::new(),
                        cpu_count: request.cpu_count,
                        memory_mb: request.memory_mb,
                    },
                )
                .await?
            }
        };
        let mut spec = parsed.spec;
        spec.start_cmd = request.start_cmd.or(spec.start_cmd);
        spec.ready_cmd = request.ready_cmd;
        let mut build = self
            .store
            .builds
            .build(&requested.build_id)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "build",
                id: requested.build_id.clone(),
            })?;
        build.spec = Some(spec);
        self.store.builds.update_build(&build).await?;
        Ok(requested)
    }

    /// `POST /templates/{id}/builds/{buildID}`: starts a Dockerfile build, its `COPY`/`ADD`
    /// reading the files last uploaded for the template.
    pub async fn start_dockerfile(
        &self,
        team: &Team,
        template_id: &str,
        build_id: &str,
    ) -> Result<(), StartBuildError> {
        let (template, build) = self.waiting_build(team, template_id, build_id).await?;
        let mut spec = build.spec.clone().ok_or_else(|| {
            StartBuildError::Invalid(format!(
                "build '{build_id}' has no Dockerfile; start it with POST /v2/templates/{template_id}/builds/{build_id}"
            ))
        })?;
        let context = lock(&self.contexts).get(&template.id).cloned();
        for (i, step) in spec.steps.iter_mut().enumerate() {
            if let StepKind::Copy { files_hash, .. } = &mut step.kind {
                *files_hash = context.clone().ok_or_else(|| {
                    StartBuildError::Invalid(format!(
                        "step {}: the Dockerfile copies files but no build context was uploaded (GET /templates/{template_id}/files/{{hash}}, then PUT the tar)",
                        i + 1
                    ))
                })?;
            }
        }
        self.launch(team, &template, build, spec, None).await
    }

    /// Starts a build of a built-in template (no team, no upload), e.g. at first start.
    pub async fn start_builtin(
        &self,
        template: &Template,
        spec: BuildSpec,
        base: Option<TemplateImage>,
    ) -> Result<String, StoreError> {
        let now = Utc::now();
        let build = BuildRecord {
            id: crate::ids::new_uuid(),
            template_id: template.id.clone(),
            team_id: None,
            status: BuildStatus::Building,
            failure: None,
            spec: Some(spec.clone()),
            image: None,
            cpu_count: template.cpu_count,
            memory_mb: template.memory_mb,
            disk_size_mb: template.disk_size_mb,
            created_at: now,
            updated_at: now,
            finished_at: None,
            node_id: self.node_id.clone(),
        };
        self.store.builds.insert_build(&build).await?;
        let mut template = template.clone();
        template.build_id = build.id.clone();
        template.build_status = BuildStatus::Building;
        template.build_count += 1;
        template.updated_at = now;
        self.store.templates.upsert_template(&template).await?;
        let job = self.job_of(&build, None, spec, base);
        let id = build.id.clone();
        self.spawn(build, job);
        Ok(id)
    }

    async fn resolve_base(
        &self,
        team: &Team,
        reference: &str,
    ) -> Result<Template, StartBuildError> {
        crate::templates::find_tagged_template(self.store.as_ref(), team, reference)
            .await?
            .ok_or_else(|| StartBuildError::Invalid(format!("template '{reference}' not found")))
    }

    fn spawn(&self, build: BuildRecord, job: BuildJob) {
        let this = self.clone();
        // Held from the queue on, so a build waiting for a slot keeps its files.
        let hold = UploadHold::new(self.builder.clone(), job.clone());
        let (cancel, mut cancelled) = watch::channel(false);
        lock(&self.live).insert(build.id.clone(), Arc::new(cancel));
        let owner = BuildOwner::of(job.team_id.as_deref());
        let turn = self.queue.enqueue(owner, &build.id);
        let mut tasks = lock(&self.tasks);
        while tasks.try_join_next().is_some() {}
        tasks.spawn(async move {
            let _live = LiveEntry {
                live: this.live.clone(),
                build_id: build.id.clone(),
            };
            let store = this.store.clone();
            let build_id = build.id.clone();
            // Log lines are written in order by one task, so a slow store never reorders them.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<BuildLogEntry>();
            let writer = tokio::spawn(async move {
                let mut seq: u64 = 0;
                while let Some(entry) = rx.recv().await {
                    if let Err(e) = store.builds.append_build_log(&build_id, seq, &entry).await {
                        tracing::warn!(error = %e, "cannot record a build log line");
                    }
                    seq += 1;
                }
            });
            // The channel is unbounded, so the cap is applied before a line enters it.
            let cap = Arc::new(Mutex::new(LogCap::new(
                BUILD_LOG_MAX_LINES,
                BUILD_LOG_MAX_BYTES,
            )));
            let sink_cap = cap.clone();
            let sink = tx.clone();
            let log = BuildLog::new(move |entry| {
                let kept = lock(&sink_cap)
                    .admit(&entry);
                if kept {
                    let _ = sink.send(entry);
                }
            });
            let mut turn = turn;
            let slot = match turn.try_recv() {
                Ok(slot) => Some(slot),
                Err(_) => {
                    let limits = this.queue.limits();
                    log.info(
                        None,
                        format!(
                            "waiting for a build slot: {} builds of a team and {} in all run at once on this node",
                            limits.per_team, limits.total
                        ),
                    );
                    tokio::select! {
                        slot = turn => slot.ok(),
                        () = until_cancelled(&mut cancelled) => {
                            this.queue.withdraw(&build.id);
                            None
                        }
                    }
                }
            };
            let outcome = match slot {
                Some(slot) => {
                    tracing::info!(template_id = %job.template_id, build_id = %job.build_id, "build started");
                    // A cancelled build's future is dropped where it stands: the builder
                    // removes what it started as its parts are dropped.
                    let outcome = tokio::select! {
                        outcome = this.builder.build(job, log) => outcome,
                        () = until_cancelled(&mut cancelled) => Err(cancelled_failure()),
                    };
                    drop(slot);
                    outcome
                }
                None => {
                    // Its sink holds the writer's channel open.
                    drop(log);
                    Err(cancelled_failure())
                }
            };
            drop(hold);
            if outcome
                .as_ref()
                .is_err_and(|f| f.message == CANCELLED_MESSAGE)
            {
                let _ = tx.send(BuildLogEntry {
                    timestamp: Utc::now(),
                    level: LogLevel::Error,
                    message: CANCELLED_MESSAGE.to_owned(),
                    step: None,
                });
            }
            let note = lock(&cap).note();
            if let Some(note) = note {
                let _ = tx.send(BuildLogEntry {
                    timestamp: Utc::now(),
                    level: LogLevel::Warn,
                    message: note,
                    step: None,
                });
            }
            drop(tx);
            // The builder dropped its log handle; wait until every line is stored so a
            // finished build's logs are complete when its status says so.
            let _ = writer.await;
            if let Err(e) = this.finish(&build, outcome).await {
                tracing::error!(error = %e, build_id = %build.id, "cannot record the build's end");
            }
            // Only now may a canceller hear that the build ended.
            drop(cancelled);
        });
    }

    /// `DELETE /templates/{id}/builds/{buildID}`: ends a waiting or running build of the
    /// team's as failed, its sandbox removed; answers once its end is recorded.
    pub async fn cancel(
        &self,
        team: &Team,
        template_id: &str,
        build_id: &str,
    ) -> Result<(), CancelBuildError> {
        let (_, build) = self
            .own_build::<CancelBuildError>(team, template_id, build_id)
            .await?;
        if matches!(build.status, BuildStatus::Ready | BuildStatus::Error) {
            return Err(CancelBuildError::AlreadyEnded {
                build_id: build_id.to_owned(),
                status: build.status.as_str(),
            });
        }
        let live = lock(&self.live).get(build_id).cloned();
        if let Some(cancel) = live {
            cancel.send_replace(true);
            // The builder's cleanup is bounded by what dropping its work costs; the wait
            // is bounded too, so a stuck store never holds the request forever.
            if tokio::time::timeout(CANCEL_WAIT, cancel.closed())
                .await
                .is_err()
            {
                tracing::warn!(%build_id, "a cancelled build has not recorded its end yet");
            }
            return Ok(());
        }
        if build.status == BuildStatus::Building
            && build.node_id.is_some()
            && build.node_id != self.node_id
        {
            return Err(CancelBuildError::OnAnotherNode {
                build_id: build_id.to_owned(),
                node_id: build.node_id.unwrap_or_default(),
            });
        }
        // Never started (or left by a run of the server that is gone): nothing runs it.
        self.store
            .builds
            .append_build_log(
                &build.id,
                0,
                &BuildLogEntry {
                    timestamp: Utc::now(),
                    level: LogLevel::Error,
                    message: CANCELLED_MESSAGE.to_owned(),
                    step: None,
                },
            )
            .await?;
        self.finish(&build, Err(cancelled_failure())).await?;
        Ok(())
    }

    async fn finish(
        &self,
        build: &BuildRecord,
        outcome: Result<TemplateImage, BuildFailure>,
    ) -> Result<(), StoreError> {
        let mut record = self
            .store
            .builds
            .build(&build.id)
            .await?
            .unwrap_or(build.clone());
        let now = Utc::now();
        record.updated_at = now;
        record.finished_at = Some(now);
        match outcome {
            Ok(image) => {
                tracing::info!(build_id = %record.id, "build ready");
                record.status = BuildStatus::Ready;
                record.image = Some(image.clone());
                self.store.builds.update_build(&record).await?;
                self.store
                    .templates
                    .set_template_image(&record.template_id, &record.id, &image)
                    .await?;
            }
            Err(failure) => {
                tracing::info!(build_id = %record.id, reason = %failure.message, "build failed");
                record.status = BuildStatus::Error;
                record.failure = Some(failure.clone());
                self.store.builds.update_build(&record).await?;
                if let Some(t) = self.store.templates.template(&record.template_id).await?
                    && t.build_id == record.id
                {
                    self.store
                        .templates
                        .set_template_build(
                            &record.template_id,
                            BuildStatus::Error,
                            Some(&failure.message),
                        )
                        .await?;
                }
            }
        }
        self.finished.notify_waiters();
        self.collect_garbage().await;
        Ok(())
    }

    /// Removes uploads left unused for too long, every `every`, forever.
    pub async fn run_upload_sweeper(self, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.builder.sweep_uploads().await;
        }
    }

    /// Asks the builder to drop layers no template build still refers to.
    pub async fn collect_garbage(&self) {
        match self.store.templates.layers_in_use().await {
            Ok(in_use) => self.builder.collect_garbage(&in_use).await,
            Err(e) => tracing::warn!(error = %e, "cannot list layers in use"),
        }
    }

    /// A build of a template the team may see, with its log lines from `offset`.
    pub async fn status(
        &self,
        team: &Team,
        template_id: &str,
        build_id: &str,
        offset: u64,
        limit: u64,
        min_level: Option<LogLevel>,
    ) -> Result<(BuildRecord, Vec<BuildLogEntry>), BuildLookupError> {
        let build = self.visible_build(team, template_id, build_id).await?;
        let logs = self
            .store
            .builds
            .build_logs(&build.id, offset, limit, min_level)
            .await?;
        Ok((build, logs))
    }

    pub async fn visible_build(
        &self,
        team: &Team,
        template_id: &str,
        build_id: &str,
    ) -> Result<BuildRecord, BuildLookupError> {
        let template = self
            .store
            .templates
            .template(template_id)
            .await?
            .filter(|t| t.team_id.as_deref().is_none_or(|o| o == team.id))
            .ok_or_else(|| BuildLookupError::TemplateNotFound(template_id.to_owned()))?;
        self.store
            .builds
            .build(build_id)
            .await?
            .filter(|b| b.template_id == template.id)
            .ok_or_else(|| BuildLookupError::BuildNotFound {
                template_id: template_id.to_owned(),
                build_id: build_id.to_owned(),
            })
    }

    /// All log lines of a build (for cursor-based reading).
    pub async fn all_logs(&self, build_id: &str) -> Result<Vec<BuildLogEntry>, StoreError> {
        self.store
            .builds
            .build_logs(build_id, 0, u64::MAX, None)
            .await
    }

    pub async fn builds_of(&self, template_id: &str) -> Result<Vec<BuildRecord>, StoreError> {
        self.store.builds.template_builds(template_id).await
    }

    /// `DELETE /templates/{id}`: running sandboxes keep their layers (the node holds them
    /// until they stop).
    pub async fn delete_template(
        &self,
        team: &Team,
        template_id: &str,
    ) -> Result<(), TemplateAdminError> {
        let template = match (
            self.find_own(team, template_id).await,
            split_name(template_id),
        ) {
            // A snapshot is known to clients by its snapshot ID, `<name or ID>:default`.
            (Err(TemplateAdminError::NotFound(_)), (name, Some("default"))) => {
                match self.find_own(team, name).await {
                    Ok(own) if own.image.as_ref().is_some_and(|i| i.snapshot.is_some()) => own,
                    Err(TemplateAdminError::Store(err)) => return Err(err.into()),
                    _ => return Err(TemplateAdminError::NotFound(template_id.to_owned())),
                }
            }
            (found, _) => found?,
        };
        self.store.templates.delete_template(&template.id).await?;
        lock(&self.contexts).remove(&template.id);
        if let Some(team_id) = &template.team_id {
            self.builder.forget_template_uploads(team_id, &template.id);
        }
        self.collect_garbage().await;
        Ok(())
    }

    pub async fn set_public(
        &self,
        team: &Team,
        template_id: &str,
        public: bool,
    ) -> Result<Template, TemplateAdminError> {
        let mut template = self.find_own(team, template_id).await?;
        template.public = public;
        template.updated_at = Utc::now();
        self.store.templates.upsert_template(&template).await?;
        Ok(template)
    }

    /// `POST /templates/tags`: gives the build `target` (`name` or `name:tag`) more tags.
    pub async fn assign_tags(
        &self,
        team: &Team,
        target: &str,
        tags: &[String],
    ) -> Result<(String, Vec<String>), TemplateAdminError> {
        let (name, tag) = split_name(target);
        for t in tags {
            if !valid_tag(t) {
                return Err(TemplateAdminError::Invalid(format!("invalid tag '{t}'")));
            }
        }
        if tags.is_empty() {
            return Err(TemplateAdminError::Invalid("tags must not be empty".into()));
        }
        let template = self.find_own(team, name).await?;
        let build = match tag.filter(|t| *t != "default") {
            Some(tag) => self.store.builds.tagged_build(&template.id, tag).await?,
            None => self
                .store
                .builds
                .template_builds(&template.id)
                .await?
                .into_iter()
                .filter(|b| b.status == BuildStatus::Ready)
                .max_by_key(|b| b.finished_at),
        }
        .ok_or_else(|| TemplateAdminError::NotFound(target.to_owned()))?;
        let mut tags = tags.to_vec();
        tags.sort();
        tags.dedup();
        let _turn = self.cap_gate.enter(&team.id).await;
        self.check_tag_cap::<TemplateAdminError>(team, &template.id, &tags)
            .await?;
        // A tag names one build: moving it takes it off the build it named before.
        self.store
            .builds
            .delete_build_tags(&template.id, &tags)
            .await?;
        self.store
            .builds
            .set_build_tags(&template.id, &build.id, &tags)
            .await?;
        Ok((build.id, tags))
    }

    /// `DELETE /templates/tags`.
    pub async fn delete_tags(
        &self,
        team: &Team,
        name: &str,
        tags: &[String],
    ) -> Result<(), TemplateAdminError> {
        let template = self.find_own(team, name).await?;
        if tags.is_empty() {
            return Err(TemplateAdminError::Invalid("tags must not be empty".into()));
        }
        if self
            .store
            .builds
            .delete_build_tags(&template.id, tags)
            .await?
            == 0
        {
            return Err(TemplateAdminError::NotFound(format!(
                "{name}:{}",
                tags.join(",")
            )));
        }
        self.collect_garbage().await;
        Ok(())
    }

    /// `GET /templates/{id}/tags`.
    pub async fn tags(
        &self,
        team: &Team,
        template_id: &str,
    ) -> Result<Vec<(String, BuildRecord)>, TemplateAdminError> {
        let template = self.find_own(team, template_id).await?;
        Ok(self.store.builds.template_tags(&template.id).await?)
    }

    async fn find_own(&self, team: &Team, reference: &str) -> Result<Template, TemplateAdminError> {
        let template = crate::templates::find_template(self.store.as_ref(), team, reference)
            .await?
            .ok_or_else(|| TemplateAdminError::NotFound(reference.to_owned()))?;
        match template.team_id.as_deref() {
            None => Err(TemplateAdminError::BuiltIn(reference.to_owned())),
            Some(owner) if owner == team.id => Ok(template),
            Some(_) => Err(TemplateAdminError::NotFound(reference.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_tags() {
        assert_eq!(split_name("app:v1"), ("app", Some("v1")));
        assert_eq!(split_name("app"), ("app", None));
        assert!(valid_name("my-app_1.0"));
        assert!(!valid_name("My-App"));
        assert!(!valid_name("-x"));
        assert!(!valid_name(""));
        assert!(valid_tag("v1.2-rc"));
        assert!(!valid_tag("a/b"));
        assert!(valid_files_hash(&"a".repeat(64)));
        assert!(!valid_files_hash(&"g".repeat(64)));
    }

    fn entry(level: LogLevel, message: &str) -> BuildLogEntry {
        BuildLogEntry {
            timestamp: Utc::now(),
            level,
            message: message.to_owned(),
            step: None,
        }
    }

    #[test]
    fn a_build_log_is_capped_in_lines_and_bytes_and_says_what_it_dropped() {
        let mut cap = LogCap::new(3, 10);
        assert!(cap.admit(&entry(LogLevel::Info, "1234")));
        assert!(cap.admit(&entry(LogLevel::Info, "5678")));
        // Two bytes left: a longer line is dropped, a short one still fits.
        assert!(!cap.admit(&entry(LogLevel::Info, "abc")));
        assert!(cap.admit(&entry(LogLevel::Info, "ab")));
        // Three lines kept: nothing more at info level, even empty.
        assert!(!cap.admit(&entry(LogLevel::Info, "")));
        // Errors have room of their own.
        assert!(cap.admit(&entry(LogLevel::Error, "step 2 failed")));
        assert_eq!(
            cap.note().as_deref(),
            Some(
                "2 more log lines (3 bytes) of this build were not kept: a build keeps at most 3 lines and 10 bytes of log"
            )
        );
        assert_eq!(LogCap::new(3, 10).note(), None);
    }

    #[test]
    fn steps_describe_themselves() {
        let run = StepKind::Run {
            command: "echo hi".into(),
            user: Some("root".into()),
        };
        assert_eq!(run.describe(), "RUN (as root) echo hi");
        let env = StepKind::Env {
            vars: vec![("A".into(), "1".into()), ("B".into(), "2".into())],
        };
        assert_eq!(env.describe(), "ENV A=1 B=2");
    }
}
