//! What the core needs from persistent storage.

use chrono::{DateTime, Utc};

use crate::auth::TeamLimits;
use crate::builds::{BuildLogEntry, BuildRecord, LogLevel, TemplateImage};
use crate::model::{BuildStatus, PauseKind, Sandbox, SandboxState, Team, Template};
use crate::network::NetworkConfig;
use crate::runtime::RuntimeHandle;
use crate::sandbox_logs::{SandboxLogEntry, SandboxLogQuery};
use crate::team_metrics::TeamMetricBucket;
use crate::volumes::{Volume, VolumeMount};

/// Storage failures are opaque to the core: it can only report them.
#[derive(Debug, thiserror::Error)]
#[error("store: {0}")]
pub struct StoreError(pub String);

/// A stored credential: only the hash of the secret is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSecret {
    pub id: String,
    pub team_id: String,
    pub name: String,
    pub secret_hash: String,
    pub mask_prefix: String,
    pub mask_suffix: String,
    pub created_at: DateTime<Utc>,
}

/// An API key as listed: its secret's hash and mask, who made it and when it was last used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredApiKey {
    pub secret: StoredSecret,
    /// The user whose access token created the key; `None` for the operator's keys.
    pub created_by: Option<String>,
    pub last_used: Option<DateTime<Utc>>,
}

/// An access token; `secret.team_id` is the team it was created for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAccessToken {
    pub secret: StoredSecret,
    pub user_id: String,
}

#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    async fn team_count(&self) -> Result<u64, StoreError>;
    async fn insert_team(&self, team: &Team) -> Result<(), StoreError>;
    async fn insert_api_key(&self, key: &StoredSecret) -> Result<(), StoreError>;
    async fn insert_access_token(&self, token: &StoredSecret) -> Result<(), StoreError>;
    /// The team owning the API key whose hash is `hash`, recording the use.
    async fn team_by_api_key_hash(&self, hash: &str) -> Result<Option<Team>, StoreError>;
    async fn team_by_access_token_hash(&self, hash: &str) -> Result<Option<Team>, StoreError>;

    async fn upsert_template(&self, template: &Template) -> Result<(), StoreError>;
    async fn template(&self, id: &str) -> Result<Option<Template>, StoreError>;
    /// The template named `alias` in a team's namespace (`None`: the built-in templates).
    async fn template_by_name(
        &self,
        team_id: Option<&str>,
        alias: &str,
    ) -> Result<Option<Template>, StoreError>;
    /// Public templates of any team named `alias`, oldest first.
    async fn public_templates_named(&self, alias: &str) -> Result<Vec<Template>, StoreError>;
    async fn team_by_slug(&self, slug: &str) -> Result<Option<Team>, StoreError>;
    /// A slug for a new team named `name` that no team has yet.
    async fn free_team_slug(&self, name: &str) -> Result<String, StoreError>;
    async fn templates(&self) -> Result<Vec<Template>, StoreError>;
    /// Records the status of the template's latest build.
    async fn set_template_build(
        &self,
        id: &str,
        status: BuildStatus,
        error: Option<&str>,
    ) -> Result<(), StoreError>;
    /// Makes `build_id`'s image the one new sandboxes of the template get.
    async fn set_template_image(
        &self,
        id: &str,
        build_id: &str,
        image: &TemplateImage,
    ) -> Result<(), StoreError>;
    /// Removes a template with its names, builds, tags and logs.
    async fn delete_template(&self, id: &str) -> Result<(), StoreError>;

    async fn insert_build(&self, build: &BuildRecord) -> Result<(), StoreError>;
    async fn update_build(&self, build: &BuildRecord) -> Result<(), StoreError>;
    async fn build(&self, id: &str) -> Result<Option<BuildRecord>, StoreError>;
    /// A template's builds, newest first.
    async fn template_builds(&self, template_id: &str) -> Result<Vec<BuildRecord>, StoreError>;
    /// Builds still `waiting` or `building`.
    async fn unfinished_builds(&self) -> Result<Vec<BuildRecord>, StoreError>;
    async fn set_build_tags(
        &self,
        template_id: &str,
        build_id: &str,
        tags: &[String],
    ) -> Result<(), StoreError>;
    /// Removes `tags` from every build of the template; returns how many were removed.
    async fn delete_build_tags(
        &self,
        template_id: &str,
        tags: &[String],
    ) -> Result<u64, StoreError>;
    /// Every (tag, build) pair of the template's successful builds, by tag.
    async fn template_tags(
        &self,
        template_id: &str,
    ) -> Result<Vec<(String, BuildRecord)>, StoreError>;
    /// The newest successful build of the template carrying `tag`.
    async fn tagged_build(
        &self,
        template_id: &str,
        tag: &str,
    ) -> Result<Option<BuildRecord>, StoreError>;
    async fn append_build_log(
        &self,
        build_id: &str,
        seq: u64,
        entry: &BuildLogEntry,
    ) -> Result<(), StoreError>;
    async fn build_logs(
        &self,
        build_id: &str,
        offset: u64,
        limit: u64,
        min_level: Option<LogLevel>,
    ) -> Result<Vec<BuildLogEntry>, StoreError>;
    /// Every layer named by a successful build that a template or tag still points at, or
    /// that a recorded sandbox booted from.
    async fn layers_in_use(&self) -> Result<Vec<String>, StoreError>;
    async fn record_template_spawn(&self, id: &str, at: DateTime<Utc>) -> Result<(), StoreError>;

    async fn insert_sandbox(&self, sandbox: &Sandbox) -> Result<(), StoreError>;
    async fn sandbox(&self, id: &str) -> Result<Option<Sandbox>, StoreError>;
    /// A team's sandboxes, newest first.
    async fn team_sandboxes(&self, team_id: &str) -> Result<Vec<Sandbox>, StoreError>;
    async fn all_sandboxes(&self) -> Result<Vec<Sandbox>, StoreError>;
    async fn set_sandbox_end(&self, id: &str, end_at: DateTime<Utc>) -> Result<(), StoreError>;
    async fn set_sandbox_network(
        &self,
        id: &str,
        network: &NetworkConfig,
        allow_internet_access: bool,
    ) -> Result<(), StoreError>;
    /// Sets the state; a paused one is recorded as paused with its memory.
    async fn set_sandbox_state(&self, id: &str, state: SandboxState) -> Result<(), StoreError>;
    /// Records the sandbox paused as `paused_as` (running when `None`) with the runtime
    /// handle that now describes it, in one write.
    async fn set_sandbox_paused(
        &self,
        id: &str,
        paused_as: Option<PauseKind>,
        handle: &RuntimeHandle,
    ) -> Result<(), StoreError>;
    async fn delete_sandbox(&self, id: &str) -> Result<(), StoreError>;

    // Keys, access tokens, users and team limits
    /// The API key whose hash is `hash`, with its team.
    async fn api_key_by_hash(&self, hash: &str)
    -> Result<Option<(StoredApiKey, Team)>, StoreError>;
    async fn touch_api_key(&self, id: &str, at: DateTime<Utc>) -> Result<(), StoreError>;
    async fn insert_team_api_key(&self, key: &StoredApiKey) -> Result<(), StoreError>;
    /// A team's API keys, oldest first.
    async fn team_api_keys(&self, team_id: &str) -> Result<Vec<StoredApiKey>, StoreError>;
    /// Renames the key if it belongs to `team_id`; whether it did.
    async fn rename_api_key(&self, team_id: &str, id: &str, name: &str)
    -> Result<bool, StoreError>;
    /// Deletes the key if it belongs to `team_id` (any team's for `None`); whether it did.
    async fn delete_api_key(&self, team_id: Option<&str>, id: &str) -> Result<bool, StoreError>;
    /// Creates a user who is a member of `team_id`.
    async fn insert_user(
        &self,
        id: &str,
        team_id: &str,
        is_default: bool,
    ) -> Result<(), StoreError>;
    async fn insert_user_access_token(&self, token: &StoredAccessToken) -> Result<(), StoreError>;
    async fn access_token_by_hash(
        &self,
        hash: &str,
    ) -> Result<Option<StoredAccessToken>, StoreError>;
    /// Deletes the token if it belongs to `user_id`; whether it did.
    async fn delete_access_token(&self, user_id: &str, id: &str) -> Result<bool, StoreError>;
    /// The teams `user_id` is a member of, each with whether it is the user's default.
    async fn user_teams(&self, user_id: &str) -> Result<Vec<(Team, bool)>, StoreError>;
    async fn team(&self, id: &str) -> Result<Option<Team>, StoreError>;
    /// Every team, oldest first.
    async fn teams(&self) -> Result<Vec<Team>, StoreError>;
    /// Replaces the team's limits; whether the team exists.
    async fn set_team_limits(&self, id: &str, limits: &TeamLimits) -> Result<bool, StoreError>;

    // Volumes
    /// Records a new volume; false if the team already has a volume of that name.
    async fn insert_volume(&self, volume: &Volume) -> Result<bool, StoreError>;
    async fn volume(&self, id: &str) -> Result<Option<Volume>, StoreError>;
    async fn volume_by_name(&self, team_id: &str, name: &str)
    -> Result<Option<Volume>, StoreError>;
    /// A team's volumes, oldest first.
    async fn team_volumes(&self, team_id: &str) -> Result<Vec<Volume>, StoreError>;
    /// Recorded sandboxes (running or paused) that mount the volume.
    async fn volume_users(&self, volume_id: &str) -> Result<Vec<String>, StoreError>;
    async fn delete_volume(&self, id: &str) -> Result<(), StoreError>;
    /// Records a sandbox's mounts, in order; the sandbox must be recorded already.
    async fn insert_sandbox_volumes(
        &self,
        sandbox_id: &str,
        mounts: &[VolumeMount],
    ) -> Result<(), StoreError>;
    async fn sandbox_volumes(&self, sandbox_id: &str) -> Result<Vec<VolumeMount>, StoreError>;

    // Sandbox logs and team metrics
    /// Records that `sandbox_id`'s logs belong to `team_id` with their first lines; kept as
    /// it is when already recorded.
    async fn open_sandbox_log(
        &self,
        sandbox_id: &str,
        team_id: &str,
        at: DateTime<Utc>,
        entries: &[SandboxLogEntry],
    ) -> Result<(), StoreError>;
    /// The team `sandbox_id`'s logs belong to, while they are kept.
    async fn sandbox_log_team(&self, sandbox_id: &str) -> Result<Option<String>, StoreError>;
    /// How far the sandbox's agent log has been read, in bytes.
    async fn sandbox_log_offset(&self, sandbox_id: &str) -> Result<u64, StoreError>;
    /// Appends lines, and moves the agent log offset if given, in one transaction; drops the
    /// oldest lines beyond `keep`. Does nothing for a sandbox whose log was never opened.
    async fn append_sandbox_logs(
        &self,
        sandbox_id: &str,
        entries: &[SandboxLogEntry],
        agent_log_offset: Option<u64>,
        keep: u64,
    ) -> Result<(), StoreError>;
    /// Marks the sandbox ended: its logs are kept for the retention period from `at`.
    async fn end_sandbox_log(&self, sandbox_id: &str, at: DateTime<Utc>) -> Result<(), StoreError>;
    async fn sandbox_logs(
        &self,
        sandbox_id: &str,
        query: &SandboxLogQuery,
    ) -> Result<Vec<SandboxLogEntry>, StoreError>;
    /// Removes the logs of sandboxes that ended before `before`; returns how many sandboxes.
    async fn prune_sandbox_logs(&self, before: DateTime<Utc>) -> Result<u64, StoreError>;
    /// Adds buckets: the larger concurrency and the sum of starts win over a stored bucket.
    async fn add_team_metrics(&self, buckets: &[TeamMetricBucket]) -> Result<(), StoreError>;
    /// A team's buckets from `start` to `end` (Unix seconds, inclusive), oldest first.
    async fn team_metrics(
        &self,
        team_id: &str,
        start: i64,
        end: i64,
    ) -> Result<Vec<TeamMetricBucket>, StoreError>;
    async fn prune_team_metrics(&self, before: i64) -> Result<u64, StoreError>;
}
