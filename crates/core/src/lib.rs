//! Sandbar's domain: teams and their credentials, templates, sandboxes, and the typed
//! operations on them.
//!
//! The core knows nothing of HTTP, SQL or Linux: it talks to storage through [`Store`] and to
//! the machine that runs sandboxes through [`Runtime`], so transports and backends can change
//! without touching the rules written here.

pub mod activity;
mod agent_links;
pub mod auth;
pub mod build_queue;
pub mod builds;
pub mod caps;
pub mod cluster;
pub mod disks;
pub mod dockerfile;
pub mod faults;
pub mod ids;
pub mod inputs;
pub mod keys;
pub mod lifecycle;
pub mod limits;
mod lookup_cache;
pub mod model;
pub mod network;
pub mod runtime;
pub mod sandbox_logs;
pub mod sandboxes;
mod secrets;
pub mod store;
pub mod team_metrics;
pub mod templates;
pub mod volumes;
pub mod webhooks;

/// `mutex`, taken even when a panic poisoned it. What the core guards is plain data changed
/// in single steps (an insert, a remove, a count), whole after a panic: refusing every later
/// caller would turn one panic into an outage.
pub(crate) fn lock<T: ?Sized>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub use activity::ActivityConfig;
pub use agent_links::{AgentLease, HangUp};
pub use auth::{Auth, AuthError, Credentials};
pub use builds::{
    BuildFailure, BuildJob, BuildLog, BuildLogEntry, BuildRecord, BuildSource, BuildSpec,
    BuildStep, Builder, Builds, BuildsConfig, LogLevel, RegistryCheck, SnapshotImage, StartedImage,
    StepKind, TemplateImage,
};
pub use caps::CapError;
pub use cluster::NodeDirectory;
pub use disks::{DiskFull, DiskReport, DiskSpace, PoolHolds};
pub use keys::{
    ApiKeyInfo, CreateCredentialError, CreatedAccessToken, CreatedApiKey, DeleteAccessTokenError,
    DeleteApiKeyError, LimitChanges, Mask, NewTeam, RenameApiKeyError, TeamAccessError,
    TeamAdminError, TeamView, User,
};
pub use lifecycle::SandboxStatus;
pub use limits::{RateLimited, RateLimits};
pub use model::{
    BUILT_IN_TEMPLATE_ALIASES, BuildSlotUse, BuildStatus, DEFAULT_TEMPLATE_ALIAS,
    DESKTOP_TEMPLATE_ALIAS, DiskRates, INTERPRETER_TEMPLATE_ALIAS, LayerBlob, NodeRecord,
    NodeReport, Sandbox, SandboxEvent, SandboxEventQuery, SandboxEventType, SandboxState,
    SlotClaim, Team, TeamCaps, Template,
};
pub use network::{EgressConfig, EgressRules, NetworkConfig, NetworkConfigError};
pub use runtime::{
    AdoptedCheckpoint, AgentLogChunk, CarriedCheckpoint, DiskIoReport, Endpoint, HandlePhase,
    HandleVolume, LaunchSpec, MemoryReport, Runtime, RuntimeError, RuntimeHandle, SnapshotParts,
    TakenOver, WarmPoolReport,
};
pub use sandbox_logs::{SandboxLogEntry, SandboxLogQuery, SandboxLogsError};
pub use sandboxes::{
    CreateSandbox, CreateSandboxError, EdgeRoutes, Lifecycle, ListQuery, ListSandboxesError,
    MetricPoint, NodeHealth, Page, Reaper, Recovery, Route, SandboxActivity, SandboxError,
    SandboxRegistry, Sandboxes, SandboxesConfig, Snapshots, TakeOverError, UpdateNetworkError,
    UserPortAccess, WakeKeys,
};
pub use store::{Store, StoreError};
pub use team_metrics::{
    TeamMetric, TeamMetricBucket, TeamMetricMax, TeamMetricPoint, TeamMetricsError,
};
pub use templates::{TemplateError, Templates};
pub use volumes::{
    CreateVolumeError, DeleteVolumeError, GetVolumeError, MountRequest, OpenedFile, StagedFile,
    Volume, VolumeContentError, VolumeFile, VolumeHost, VolumeIoError, VolumeMount,
    VolumeMountError, Volumes,
};
