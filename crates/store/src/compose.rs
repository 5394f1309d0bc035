//! [`sandbar_core::Store`] from one type per aggregate. Each backend names its aggregate
//! types in a [`Backend`]; [`Records`] holds one of each and answers every store trait by
//! handing the call to the aggregate that keeps those records, so the delegation is written
//! once for both databases.

use std::fmt::Debug;

use chrono::{DateTime, Utc};
use sandbar_core::auth::TeamLimits;
use sandbar_core::model::{
    BuildLogEntry, BuildRecord, BuildStatus, LayerBlob, LogLevel, NodeRecord, Sandbox,
    SandboxLogEntry, SandboxLogQuery, SlotClaim, Team, TeamMetricBucket, Template, TemplateImage,
    Volume, VolumeMount,
};
use sandbar_core::store::{
    BuildRecords, LayerBlobRecords, NodeRecords, RequestCountRecords, SandboxLogRecords,
    SandboxRecords, StoredAccessToken, StoredApiKey, StoredSecret, TeamMetricRecords, TeamRecords,
    TemplateRecords, VolumeRecords,
};
use sandbar_core::{NetworkConfig, RuntimeHandle, SandboxStatus, StoreError};

/// A database's aggregate types: the records of each trait of the core's store.
pub trait Backend: Debug + Clone + Send + Sync + 'static {
    type Teams: TeamRecords + Debug + Clone;
    type Templates: TemplateRecords + Debug + Clone;
    type Builds: BuildRecords + Debug + Clone;
    type Sandboxes: SandboxRecords + Debug + Clone;
    type Volumes: VolumeRecords + Debug + Clone;
    type SandboxLogs: SandboxLogRecords + Debug + Clone;
    type TeamMetrics: TeamMetricRecords + Debug + Clone;
    type Nodes: NodeRecords + Debug + Clone;
    type LayerBlobs: LayerBlobRecords + Debug + Clone;
    type RequestCounts: RequestCountRecords + Debug + Clone;
}

/// Every aggregate of one database: the store the services hold.
#[derive(Debug, Clone)]
pub struct Records<B: Backend> {
    pub(crate) teams: B::Teams,
    pub(crate) templates: B::Templates,
    pub(crate) builds: B::Builds,
    pub(crate) sandboxes: B::Sandboxes,
    pub(crate) volumes: B::Volumes,
    pub(crate) sandbox_logs: B::SandboxLogs,
    pub(crate) team_metrics: B::TeamMetrics,
    pub(crate) nodes: B::Nodes,
    pub(crate) layer_blobs: B::LayerBlobs,
    pub(crate) request_counts: B::RequestCounts,
}

#[async_trait::async_trait]
impl<B: Backend> TeamRecords for Records<B> {
    async fn team_count(&self) -> Result<u64, StoreError> {
        self.teams.team_count().await
    }

    async fn insert_team(&self, team: &Team) -> Result<(), StoreError> {
        self.teams.insert_team(team).await
    }

    async fn insert_api_key(&self, key: &StoredSecret) -> Result<(), StoreError> {
        self.teams.insert_api_key(key).await
    }

    async fn insert_access_token(&self, token: &StoredSecret) -> Result<(), StoreError> {
        self.teams.insert_access_token(token).await
    }

    async fn team_by_api_key_hash(&self, hash: &str) -> Result<Option<Team>, StoreError> {
        self.teams.team_by_api_key_hash(hash).await
    }

    async fn team_by_access_token_hash(&self, hash: &str) -> Result<Option<Team>, StoreError> {
        self.teams.team_by_access_token_hash(hash).await
    }

    async fn team_by_slug(&self, slug: &str) -> Result<Option<Team>, StoreError> {
        self.teams.team_by_slug(slug).await
    }

    async fn free_team_slug(&self, name: &str) -> Result<String, StoreError> {
        self.teams.free_team_slug(name).await
    }

    async fn api_key_by_hash(
        &self,
        hash: &str,
    ) -> Result<Option<(StoredApiKey, Team)>, StoreError> {
        self.teams.api_key_by_hash(hash).await
    }

    async fn touch_api_key(&self, id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
        self.teams.touch_api_key(id, at).await
    }

    async fn insert_team_api_key(&self, key: &StoredApiKey) -> Result<(), StoreError> {
        self.teams.insert_team_api_key(key).await
    }

    async fn team_api_keys(&self, team_id: &str) -> Result<Vec<StoredApiKey>, StoreError> {
        self.teams.team_api_keys(team_id).await
    }

    async fn rename_api_key(
        &self,
        team_id: &str,
        id: &str,
        name: &str,
    ) -> Result<bool, StoreError> {
        self.teams.rename_api_key(team_id, id, name).await
    }

    async fn delete_api_key(&self, team_id: Option<&str>, id: &str) -> Result<bool, StoreError> {
        self.teams.delete_api_key(team_id, id).await
    }

    async fn insert_user(
        &self,
        id: &str,
        team_id: &str,
        is_default: bool,
    ) -> Result<(), StoreError> {
        self.teams.insert_user(id, team_id, is_default).await
    }

    async fn insert_user_access_token(&self, token: &StoredAccessToken) -> Result<(), StoreError> {
        self.teams.insert_user_access_token(token).await
    }

    async fn access_token_by_hash(
        &self,
        hash: &str,
    ) -> Result<Option<StoredAccessToken>, StoreError> {
        self.teams.access_token_by_hash(hash).await
    }

    async fn delete_access_token(&self, user_id: &str, id: &str) -> Result<bool, StoreError> {
        self.teams.delete_access_token(user_id, id).await
    }

    async fn user_teams(&self, user_id: &str) -> Result<Vec<(Team, bool)>, StoreError> {
        self.teams.user_teams(user_id).await
    }

    async fn team(&self, id: &str) -> Result<Option<Team>, StoreError> {
        self.teams.team(id).await
    }

    async fn teams(&self) -> Result<Vec<Team>, StoreError> {
        self.teams.teams().await
    }

    async fn set_team_limits(&self, id: &str, limits: &TeamLimits) -> Result<bool, StoreError> {
        self.teams.set_team_limits(id, limits).await
    }
}

#[async_trait::async_trait]
impl<B: Backend> TemplateRecords for Records<B> {
    async fn upsert_template(&self, template: &Template) -> Result<(), StoreError> {
        self.templates.upsert_template(template).await
    }

    async fn template(&self, id: &str) -> Result<Option<Template>, StoreError> {
        self.templates.template(id).await
    }

    async fn template_by_name(
        &self,
        team_id: Option<&str>,
        alias: &str,
    ) -> Result<Option<Template>, StoreError> {
        self.templates.template_by_name(team_id, alias).await
    }

    async fn public_templates_named(&self, alias: &str) -> Result<Vec<Template>, StoreError> {
        self.templates.public_templates_named(alias).await
    }

    async fn templates(&self) -> Result<Vec<Template>, StoreError> {
        self.templates.templates().await
    }

    async fn set_template_build(
        &self,
        id: &str,
        status: BuildStatus,
        error: Option<&str>,
    ) -> Result<(), StoreError> {
        self.templates.set_template_build(id, status, error).await
    }

    async fn set_template_image(
        &self,
        id: &str,
        build_id: &str,
        image: &TemplateImage,
    ) -> Result<(), StoreError> {
        self.templates.set_template_image(id, build_id, image).await
    }

    async fn delete_template(&self, id: &str) -> Result<(), StoreError> {
        self.templates.delete_template(id).await
    }

    async fn record_template_spawns(
        &self,
        id: &str,
        count: u32,
        last: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        self.templates.record_template_spawns(id, count, last).await
    }

    async fn layers_in_use(&self) -> Result<Vec<String>, StoreError> {
        self.templates.layers_in_use().await
    }
}

#[async_trait::async_trait]
impl<B: Backend> BuildRecords for Records<B> {
    async fn insert_build(&self, build: &BuildRecord) -> Result<(), StoreError> {
        self.builds.insert_build(build).await
    }

    async fn update_build(&self, build: &BuildRecord) -> Result<(), StoreError> {
        self.builds.update_build(build).await
    }

    async fn build(&self, id: &str) -> Result<Option<BuildRecord>, StoreError> {
        self.builds.build(id).await
    }

    async fn assign_waiting_build(
        &self,
        build_id: &str,
        node_id: &str,
    ) -> Result<bool, StoreError> {
        self.builds.assign_waiting_build(build_id, node_id).await
    }

    async fn template_builds(&self, template_id: &str) -> Result<Vec<BuildRecord>, StoreError> {
        self.builds.template_builds(template_id).await
    }

    async fn unfinished_builds(&self) -> Result<Vec<BuildRecord>, StoreError> {
        self.builds.unfinished_builds().await
    }

    async fn set_build_tags(
        &self,
        template_id: &str,
        build_id: &str,
        tags: &[String],
    ) -> Result<(), StoreError> {
        self.builds
            .set_build_tags(template_id, build_id, tags)
            .await
    }

    async fn delete_build_tags(
        &self,
        template_id: &str,
        tags: &[String],
    ) -> Result<u64, StoreError> {
        self.builds.delete_build_tags(template_id, tags).await
    }

    async fn template_tags(
        &self,
        template_id: &str,
    ) -> Result<Vec<(String, BuildRecord)>, StoreError> {
        self.builds.template_tags(template_id).await
    }

    async fn tagged_build(
        &self,
        template_id: &str,
        tag: &str,
    ) -> Result<Option<BuildRecord>, StoreError> {
        self.builds.tagged_build(template_id, tag).await
    }

    async fn append_build_log(
        &self,
        build_id: &str,
        seq: u64,
        entry: &BuildLogEntry,
    ) -> Result<(), StoreError> {
        self.builds.append_build_log(build_id, seq, entry).await
    }

    async fn build_logs(
        &self,
        build_id: &str,
        offset: u64,
        limit: u64,
        min_level: Option<LogLevel>,
    ) -> Result<Vec<BuildLogEntry>, StoreError> {
        self.builds
            .build_logs(build_id, offset, limit, min_level)
            .await
    }
}

#[async_trait::async_trait]
impl<B: Backend> SandboxRecords for Records<B> {
    async fn insert_sandbox(&self, sandbox: &Sandbox) -> Result<(), StoreError> {
        self.sandboxes.insert_sandbox(sandbox).await
    }

    async fn sandbox(&self, id: &str) -> Result<Option<Sandbox>, StoreError> {
        self.sandboxes.sandbox(id).await
    }

    async fn team_sandboxes(&self, team_id: &str) -> Result<Vec<Sandbox>, StoreError> {
        self.sandboxes.team_sandboxes(team_id).await
    }

    async fn all_sandboxes(&self) -> Result<Vec<Sandbox>, StoreError> {
        self.sandboxes.all_sandboxes().await
    }

    async fn set_sandbox_end(&self, id: &str, end_at: DateTime<Utc>) -> Result<(), StoreError> {
        self.sandboxes.set_sandbox_end(id, end_at).await
    }

    async fn set_sandbox_network(
        &self,
        id: &str,
        network: &NetworkConfig,
        allow_internet_access: bool,
    ) -> Result<(), StoreError> {
        self.sandboxes
            .set_sandbox_network(id, network, allow_internet_access)
            .await
    }

    async fn set_sandbox_status(
        &self,
        id: &str,
        status: SandboxStatus,
        handle: Option<&RuntimeHandle>,
    ) -> Result<(), StoreError> {
        self.sandboxes.set_sandbox_status(id, status, handle).await
    }

    async fn delete_sandbox(&self, id: &str) -> Result<(), StoreError> {
        self.sandboxes.delete_sandbox(id).await
    }

    async fn insert_sandbox_volumes(
        &self,
        sandbox_id: &str,
        mounts: &[VolumeMount],
    ) -> Result<(), StoreError> {
        self.sandboxes
            .insert_sandbox_volumes(sandbox_id, mounts)
            .await
    }

    async fn sandbox_volumes(&self, sandbox_id: &str) -> Result<Vec<VolumeMount>, StoreError> {
        self.sandboxes.sandbox_volumes(sandbox_id).await
    }
}

#[async_trait::async_trait]
impl<B: Backend> VolumeRecords for Records<B> {
    async fn insert_volume(&self, volume: &Volume) -> Result<bool, StoreError> {
        self.volumes.insert_volume(volume).await
    }

    async fn volume(&self, id: &str) -> Result<Option<Volume>, StoreError> {
        self.volumes.volume(id).await
    }

    async fn volume_by_name(
        &self,
        team_id: &str,
        name: &str,
    ) -> Result<Option<Volume>, StoreError> {
        self.volumes.volume_by_name(team_id, name).await
    }

    async fn team_volumes(&self, team_id: &str) -> Result<Vec<Volume>, StoreError> {
        self.volumes.team_volumes(team_id).await
    }

    async fn volume_users(&self, volume_id: &str) -> Result<Vec<String>, StoreError> {
        self.volumes.volume_users(volume_id).await
    }

    async fn delete_volume(&self, id: &str) -> Result<(), StoreError> {
        self.volumes.delete_volume(id).await
    }
}

#[async_trait::async_trait]
impl<B: Backend> SandboxLogRecords for Records<B> {
    async fn open_sandbox_log(
        &self,
        sandbox_id: &str,
        team_id: &str,
        at: DateTime<Utc>,
        entries: &[SandboxLogEntry],
    ) -> Result<(), StoreError> {
        self.sandbox_logs
            .open_sandbox_log(sandbox_id, team_id, at, entries)
            .await
    }

    async fn sandbox_log_team(&self, sandbox_id: &str) -> Result<Option<String>, StoreError> {
        self.sandbox_logs.sandbox_log_team(sandbox_id).await
    }

    async fn sandbox_log_offset(&self, sandbox_id: &str) -> Result<u64, StoreError> {
        self.sandbox_logs.sandbox_log_offset(sandbox_id).await
    }

    async fn append_sandbox_logs(
        &self,
        sandbox_id: &str,
        entries: &[SandboxLogEntry],
        agent_log_offset: Option<u64>,
        keep: u64,
    ) -> Result<(), StoreError> {
        self.sandbox_logs
            .append_sandbox_logs(sandbox_id, entries, agent_log_offset, keep)
            .await
    }

    async fn end_sandbox_log(&self, sandbox_id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
        self.sandbox_logs.end_sandbox_log(sandbox_id, at).await
    }

    async fn sandbox_logs(
        &self,
        sandbox_id: &str,
        query: &SandboxLogQuery,
    ) -> Result<Vec<SandboxLogEntry>, StoreError> {
        self.sandbox_logs.sandbox_logs(sandbox_id, query).await
    }

    async fn prune_sandbox_logs(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        self.sandbox_logs.prune_sandbox_logs(before).await
    }
}

#[async_trait::async_trait]
impl<B: Backend> TeamMetricRecords for Records<B> {
    async fn add_team_metrics(&self, buckets: &[TeamMetricBucket]) -> Result<(), StoreError> {
        self.team_metrics.add_team_metrics(buckets).await
    }

    async fn team_metrics(
        &self,
        team_id: &str,
        start: i64,
        end: i64,
    ) -> Result<Vec<TeamMetricBucket>, StoreError> {
        self.team_metrics.team_metrics(team_id, start, end).await
    }

    async fn prune_team_metrics(&self, before: i64) -> Result<u64, StoreError> {
        self.team_metrics.prune_team_metrics(before).await
    }
}

#[async_trait::async_trait]
impl<B: Backend> NodeRecords for Records<B> {
    async fn renew_node(&self, node: &NodeRecord) -> Result<(), StoreError> {
        self.nodes.renew_node(node).await
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.nodes.nodes().await
    }

    async fn sandbox_node(&self, sandbox_id: &str) -> Result<Option<String>, StoreError> {
        self.nodes.sandbox_node(sandbox_id).await
    }

    async fn move_sandbox(
        &self,
        sandbox_id: &str,
        from: &str,
        to: &str,
    ) -> Result<bool, StoreError> {
        self.nodes.move_sandbox(sandbox_id, from, to).await
    }

    async fn claim_team_slot(
        &self,
        claim: &SlotClaim,
        limit: usize,
        live_nodes: &[String],
        slot_statuses: &[&str],
    ) -> Result<bool, StoreError> {
        self.nodes
            .claim_team_slot(claim, limit, live_nodes, slot_statuses)
            .await
    }

    async fn release_team_slot(&self, sandbox_id: &str) -> Result<(), StoreError> {
        self.nodes.release_team_slot(sandbox_id).await
    }
}

#[async_trait::async_trait]
impl<B: Backend> LayerBlobRecords for Records<B> {
    async fn record_layer_blob(&self, blob: &LayerBlob) -> Result<(), StoreError> {
        self.layer_blobs.record_layer_blob(blob).await
    }

    async fn replace_layer_blob(&self, blob: &LayerBlob) -> Result<(), StoreError> {
        self.layer_blobs.replace_layer_blob(blob).await
    }

    async fn delete_layer_blob(&self, layer: &str) -> Result<(), StoreError> {
        self.layer_blobs.delete_layer_blob(layer).await
    }

    async fn layer_blobs(&self, layers: &[String]) -> Result<Vec<LayerBlob>, StoreError> {
        self.layer_blobs.layer_blobs(layers).await
    }

    async fn all_layer_blobs(&self) -> Result<Vec<LayerBlob>, StoreError> {
        self.layer_blobs.all_layer_blobs().await
    }
}

#[async_trait::async_trait]
impl<B: Backend> RequestCountRecords for Records<B> {
    async fn add_team_requests(
        &self,
        window: i64,
        counts: &[(String, u64)],
    ) -> Result<Vec<(String, u64)>, StoreError> {
        self.request_counts.add_team_requests(window, counts).await
    }

    async fn prune_team_requests(&self, window: i64) -> Result<u64, StoreError> {
        self.request_counts.prune_team_requests(window).await
    }
}
