//! What both databases read back and bind, whatever their dialect: the rows their queries
//! select and how each becomes the core's record, with the checks on the counts and sizes in
//! it, and the values of the columns every statement on a table lists in the same order. The
//! rows are generic over how a database reads a timestamp ([`Stamp`]), which is all that
//! differs between the two once a row is selected; the SQL is in each aggregate's module.

use chrono::{DateTime, Utc};
use sandbar_core::store::{StoredAccessToken, StoredApiKey, StoredSecret};
use sandbar_core::{
    BuildFailure, BuildLogEntry, BuildRecord, BuildSpec, BuildStatus, DiskRates, LayerBlob,
    LogLevel, NodeRecord, RuntimeHandle, Sandbox, SandboxLogEntry, SandboxLogQuery, SandboxStatus,
    StoreError, Team, TeamCaps, TeamMetricBucket, Template, TemplateImage, Volume, VolumeMount,
};

use sandbar_core::auth::TeamLimits;
use sandbar_core::webhooks::{Webhook, WebhookDelivery};
use sandbar_core::{SandboxEvent, SandboxEventQuery, SandboxEventType};
use sqlx::query::Query;
use sqlx::{Database, Encode, QueryBuilder, Type};

use crate::{err, time};

/// A timestamp column as a database reads it: microseconds since the Unix epoch in SQLite,
/// `timestamptz` in PostgreSQL.
pub(crate) trait Stamp {
    fn utc(self) -> DateTime<Utc>;
}

impl Stamp for i64 {
    fn utc(self) -> DateTime<Utc> {
        time(self)
    }
}

impl Stamp for DateTime<Utc> {
    fn utc(self) -> DateTime<Utc> {
        self
    }
}

/// A template's names as a database gathers them: a JSON array in SQLite, an array sorted
/// byte-wise in PostgreSQL.
pub(crate) trait Aliases {
    fn sorted(self) -> Result<Vec<String>, StoreError>;
}

impl Aliases for Option<String> {
    fn sorted(self) -> Result<Vec<String>, StoreError> {
        let mut aliases: Vec<String> = json_of(self)?.unwrap_or_default();
        aliases.sort();
        Ok(aliases)
    }
}

impl Aliases for Vec<String> {
    fn sorted(self) -> Result<Vec<String>, StoreError> {
        Ok(self)
    }
}

/// `query` with `values` bound, in order.
pub(crate) fn bind_all<'q, DB, V>(
    query: Query<'q, DB, DB::Arguments>,
    values: impl IntoIterator<Item = V>,
) -> Query<'q, DB, DB::Arguments>
where
    DB: Database,
    V: for<'t> Encode<'t, DB> + Type<DB>,
{
    values
        .into_iter()
        .fold(query, |query, value| query.bind(value))
}

/// A team's limit columns, in the order every statement on `teams` lists them.
pub(crate) fn limit_columns(limits: &TeamLimits) -> [i64; 17] {
    [
        i64::from(limits.max_concurrent_sandboxes),
        big(limits.max_sandbox_timeout_secs),
        i64::from(limits.requests_per_minute),
        i64::from(limits.max_vcpu),
        i64::from(limits.max_memory_mb),
        i64::from(limits.max_disk_mb),
        i64::from(limits.caps.max_snapshots),
        i64::from(limits.caps.max_snapshot_mb),
        i64::from(limits.caps.max_templates),
        i64::from(limits.caps.max_volumes),
        i64::from(limits.caps.max_volume_mb),
        i64::from(limits.caps.max_tags_per_template),
        i64::from(limits.caps.max_api_keys),
        i64::from(limits.disk_rates.read_mbps),
        i64::from(limits.disk_rates.write_mbps),
        i64::from(limits.disk_rates.read_iops),
        i64::from(limits.disk_rates.write_iops),
    ]
}

/// `query` with a secret's columns bound as every insert of an API key or access token lists
/// them: id, team, name, hash, mask and when it was made (`created_at`, as the database keeps
/// a time).
pub(crate) fn bind_secret<'q, DB, T>(
    query: Query<'q, DB, DB::Arguments>,
    secret: &StoredSecret,
    created_at: T,
) -> Query<'q, DB, DB::Arguments>
where
    DB: Database,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    T: for<'t> Encode<'t, DB> + Type<DB>,
{
    let text = [
        &secret.id,
        &secret.team_id,
        &secret.name,
        &secret.secret_hash,
        &secret.mask_prefix,
        &secret.mask_suffix,
    ];
    bind_all(query, text.map(String::clone)).bind(created_at)
}

/// A count or size the records hold as `u32`.
pub(crate) fn u32_of(value: i64, what: &str, id: &str) -> Result<u32, StoreError> {
    u32::try_from(value).map_err(|_| err(format!("{what} of {id} out of range: {value}")))
}

/// A count the records hold as `u64`.
pub(crate) fn u64_of(value: i64, what: &str, id: &str) -> Result<u64, StoreError> {
    u64::try_from(value).map_err(|_| err(format!("{what} of {id} out of range: {value}")))
}

/// A `u64` as a BIGINT, saturating: nothing the store keeps comes near the limit.
pub(crate) fn big(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

pub(crate) fn json_of<T: serde::de::DeserializeOwned>(
    text: Option<String>,
) -> Result<Option<T>, StoreError> {
    text.map(|t| serde_json::from_str(&t).map_err(err))
        .transpose()
}

/// `slug_of(name)`, or with `-2`, `-3`, … after it when `taken` says a team has it already.
pub(crate) async fn free_slug<F, Fut>(name: &str, mut taken: F) -> Result<String, StoreError>
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = Result<bool, StoreError>>,
{
    let base = sandbar_core::model::slug_of(name);
    let mut candidate = base.clone();
    for n in 2.. {
        if !taken(candidate.clone()).await? {
            break;
        }
        candidate = format!("{base}-{n}");
    }
    Ok(candidate)
}

/// A log level as the sandbox log keeps it: a rank, so a minimum level is a comparison.
pub(crate) fn level_rank(level: LogLevel) -> i64 {
    match level {
        LogLevel::Debug => 0,
        LogLevel::Info => 1,
        LogLevel::Warn => 2,
        LogLevel::Error => 3,
    }
}

pub(crate) fn level_of_rank(rank: i64) -> LogLevel {
    match rank {
        i64::MIN..=0 => LogLevel::Debug,
        1 => LogLevel::Info,
        2 => LogLevel::Warn,
        _ => LogLevel::Error,
    }
}

/// Where a page of sandbox log lines starts, in microseconds: the cursor's millisecond going
/// forward, the whole of it going back.
pub(crate) fn log_cursor_micros(query: &SandboxLogQuery) -> Option<i64> {
    query.cursor_ms.map(|ms| {
        if query.forward {
            ms.saturating_mul(1000)
        } else {
            ms.saturating_mul(1000).saturating_add(999)
        }
    })
}

#[derive(sqlx::FromRow)]
pub(crate) struct TeamRow {
    id: String,
    name: String,
    /// Empty on teams made before names had namespaces, until the store gives them one.
    slug: Option<String>,
    #[sqlx(flatten)]
    limits: LimitsRow,
}

impl TryFrom<TeamRow> for Team {
    type Error = StoreError;

    fn try_from(r: TeamRow) -> Result<Self, StoreError> {
        r.limits.into_team(r.id, r.name, r.slug)
    }
}

/// A team's limit columns, which no other table has, so a join can select them as they are.
#[derive(sqlx::FromRow)]
pub(crate) struct LimitsRow {
    max_concurrent_sandboxes: i64,
    max_sandbox_timeout_secs: i64,
    requests_per_minute: i64,
    max_vcpu: i64,
    max_memory_mb: i64,
    max_disk_mb: i64,
    max_snapshots: i64,
    max_snapshot_mb: i64,
    max_templates: i64,
    max_volumes: i64,
    max_volume_mb: i64,
    max_tags_per_template: i64,
    max_api_keys: i64,
    disk_read_mbps: i64,
    disk_write_mbps: i64,
    disk_read_iops: i64,
    disk_write_iops: i64,
}

impl LimitsRow {
    fn into_team(self, id: String, name: String, slug: Option<String>) -> Result<Team, StoreError> {
        let limit = |value: i64| u32_of(value, "team limit", &id);
        let limits = TeamLimits {
            max_concurrent_sandboxes: limit(self.max_concurrent_sandboxes)?,
            max_sandbox_timeout_secs: u64_of(self.max_sandbox_timeout_secs, "team limit", &id)?,
            requests_per_minute: limit(self.requests_per_minute)?,
            max_vcpu: limit(self.max_vcpu)?,
            max_memory_mb: limit(self.max_memory_mb)?,
            max_disk_mb: limit(self.max_disk_mb)?,
            caps: TeamCaps {
                max_snapshots: limit(self.max_snapshots)?,
                max_snapshot_mb: limit(self.max_snapshot_mb)?,
                max_templates: limit(self.max_templates)?,
                max_volumes: limit(self.max_volumes)?,
                max_volume_mb: limit(self.max_volume_mb)?,
                max_tags_per_template: limit(self.max_tags_per_template)?,
                max_api_keys: limit(self.max_api_keys)?,
            },
            disk_rates: DiskRates {
                read_mbps: limit(self.disk_read_mbps)?,
                write_mbps: limit(self.disk_write_mbps)?,
                read_iops: limit(self.disk_read_iops)?,
                write_iops: limit(self.disk_write_iops)?,
            },
        };
        Ok(Team {
            limits,
            name,
            slug: slug.unwrap_or_default(),
            id,
        })
    }
}

/// An API key with its team's name, slug and limits, in one row: the team's id is the key's.
#[derive(sqlx::FromRow)]
pub(crate) struct KeyTeamRow<T> {
    #[sqlx(flatten)]
    key: ApiKeyRow<T>,
    team_name: String,
    team_slug: Option<String>,
    #[sqlx(flatten)]
    limits: LimitsRow,
}

impl<T: Stamp> TryFrom<KeyTeamRow<T>> for (StoredApiKey, Team) {
    type Error = StoreError;

    fn try_from(r: KeyTeamRow<T>) -> Result<Self, StoreError> {
        let key = StoredApiKey::from(r.key);
        let team = r
            .limits
            .into_team(key.secret.team_id.clone(), r.team_name, r.team_slug)?;
        Ok((key, team))
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct TeamMemberRow {
    #[sqlx(flatten)]
    team: TeamRow,
    is_default: bool,
}

impl TryFrom<TeamMemberRow> for (Team, bool) {
    type Error = StoreError;

    fn try_from(r: TeamMemberRow) -> Result<Self, StoreError> {
        Ok((Team::try_from(r.team)?, r.is_default))
    }
}

/// An API key or access token; queries name the hash column `secret_hash`.
#[derive(sqlx::FromRow)]
pub(crate) struct SecretRow<T> {
    id: String,
    team_id: String,
    name: String,
    secret_hash: String,
    mask_prefix: String,
    mask_suffix: String,
    created_at: T,
}

impl<T: Stamp> From<SecretRow<T>> for StoredSecret {
    fn from(r: SecretRow<T>) -> Self {
        StoredSecret {
            id: r.id,
            team_id: r.team_id,
            name: r.name,
            secret_hash: r.secret_hash,
            mask_prefix: r.mask_prefix,
            mask_suffix: r.mask_suffix,
            created_at: r.created_at.utc(),
        }
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct ApiKeyRow<T> {
    #[sqlx(flatten)]
    secret: SecretRow<T>,
    created_by: Option<String>,
    last_used: Option<T>,
}

impl<T: Stamp> From<ApiKeyRow<T>> for StoredApiKey {
    fn from(r: ApiKeyRow<T>) -> Self {
        StoredApiKey {
            secret: r.secret.into(),
            created_by: r.created_by,
            last_used: r.last_used.map(Stamp::utc),
        }
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct AccessTokenRow<T> {
    #[sqlx(flatten)]
    secret: SecretRow<T>,
    user_id: String,
}

impl<T: Stamp> From<AccessTokenRow<T>> for StoredAccessToken {
    fn from(r: AccessTokenRow<T>) -> Self {
        StoredAccessToken {
            secret: r.secret.into(),
            user_id: r.user_id,
        }
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct BuildRow<T> {
    id: String,
    template_id: String,
    team_id: Option<String>,
    status: String,
    failure: Option<String>,
    spec: Option<String>,
    image: Option<String>,
    cpu_count: i64,
    memory_mb: i64,
    disk_size_mb: i64,
    created_at: T,
    updated_at: T,
    finished_at: Option<T>,
    node_id: Option<String>,
}

impl<T: Stamp> TryFrom<BuildRow<T>> for BuildRecord {
    type Error = StoreError;

    fn try_from(r: BuildRow<T>) -> Result<Self, StoreError> {
        let id = r.id;
        Ok(BuildRecord {
            status: BuildStatus::parse(&r.status)
                .ok_or_else(|| err(format!("build {id} has unknown status {}", r.status)))?,
            failure: json_of::<BuildFailure>(r.failure)?,
            spec: json_of::<BuildSpec>(r.spec)?,
            image: json_of::<TemplateImage>(r.image)?,
            cpu_count: u32_of(r.cpu_count, "cpu count", &id)?,
            memory_mb: u32_of(r.memory_mb, "memory", &id)?,
            disk_size_mb: u32_of(r.disk_size_mb, "disk size", &id)?,
            template_id: r.template_id,
            team_id: r.team_id,
            created_at: r.created_at.utc(),
            updated_at: r.updated_at.utc(),
            finished_at: r.finished_at.map(Stamp::utc),
            node_id: r.node_id,
            id,
        })
    }
}

/// A build with one of its tags.
#[derive(sqlx::FromRow)]
pub(crate) struct TaggedBuildRow<T> {
    pub(crate) tag: String,
    #[sqlx(flatten)]
    build: BuildRow<T>,
}

impl<T: Stamp> TryFrom<TaggedBuildRow<T>> for (String, BuildRecord) {
    type Error = StoreError;

    fn try_from(r: TaggedBuildRow<T>) -> Result<Self, StoreError> {
        Ok((r.tag, BuildRecord::try_from(r.build)?))
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct BuildLogRow<T> {
    at: T,
    level: String,
    step: Option<String>,
    message: String,
}

impl<T: Stamp> From<BuildLogRow<T>> for BuildLogEntry {
    fn from(r: BuildLogRow<T>) -> Self {
        BuildLogEntry {
            timestamp: r.at.utc(),
            level: LogLevel::parse(&r.level).unwrap_or(LogLevel::Info),
            step: r.step,
            message: r.message,
        }
    }
}

/// The build log lines at `min_level` or above, `offset` lines in. Levels are names, so the
/// minimum is applied here, before the offset, whatever the database.
pub(crate) fn build_log_page<T: Stamp>(
    rows: Vec<BuildLogRow<T>>,
    offset: u64,
    limit: u64,
    min_level: Option<LogLevel>,
) -> Vec<BuildLogEntry> {
    rows.into_iter()
        .map(BuildLogEntry::from)
        .filter(|e| min_level.is_none_or(|min| e.level >= min))
        .skip(usize::try_from(offset).unwrap_or(usize::MAX))
        .take(usize::try_from(limit).unwrap_or(usize::MAX))
        .collect()
}

/// A row selected by `template_query!`.
#[derive(sqlx::FromRow)]
pub(crate) struct TemplateRow<T, A> {
    id: String,
    team_id: Option<String>,
    namespace: Option<String>,
    public: bool,
    build_id: String,
    build_status: String,
    build_error: Option<String>,
    cpu_count: i64,
    memory_mb: i64,
    disk_size_mb: i64,
    envd_version: String,
    image: Option<String>,
    created_at: T,
    updated_at: T,
    last_spawned_at: Option<T>,
    spawn_count: i64,
    build_count: i64,
    aliases: A,
}

impl<T: Stamp, A: Aliases> TryFrom<TemplateRow<T, A>> for Template {
    type Error = StoreError;

    fn try_from(r: TemplateRow<T, A>) -> Result<Self, StoreError> {
        let id = r.id;
        Ok(Template {
            build_status: BuildStatus::parse(&r.build_status).ok_or_else(|| {
                err(format!(
                    "template {id} has unknown build status {}",
                    r.build_status
                ))
            })?,
            cpu_count: u32_of(r.cpu_count, "cpu count", &id)?,
            memory_mb: u32_of(r.memory_mb, "memory", &id)?,
            disk_size_mb: u32_of(r.disk_size_mb, "disk size", &id)?,
            spawn_count: u64_of(r.spawn_count, "spawn count", &id)?,
            build_count: u64_of(r.build_count, "build count", &id)?,
            image: json_of::<TemplateImage>(r.image)?,
            aliases: r.aliases.sorted()?,
            team_id: r.team_id,
            namespace: r.namespace,
            public: r.public,
            build_id: r.build_id,
            build_error: r.build_error,
            envd_version: r.envd_version,
            created_at: r.created_at.utc(),
            updated_at: r.updated_at.utc(),
            last_spawned_at: r.last_spawned_at.map(Stamp::utc),
            id,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct SandboxRow<T> {
    id: String,
    team_id: String,
    template_id: String,
    alias: Option<String>,
    started_at: T,
    end_at: T,
    cpu_count: i64,
    memory_mb: i64,
    disk_size_mb: i64,
    metadata: String,
    env_vars: String,
    allow_internet_access: bool,
    envd_access_token: String,
    envd_version: String,
    status: String,
    handle: String,
    network: String,
    traffic_access_token: Option<String>,
    auto_pause: bool,
    auto_resume: bool,
    auto_pause_memory: bool,
    image: Option<String>,
    node_id: String,
}

impl<T: Stamp> TryFrom<SandboxRow<T>> for Sandbox {
    type Error = StoreError;

    fn try_from(r: SandboxRow<T>) -> Result<Self, StoreError> {
        let id = r.id;
        let status = SandboxStatus::parse(&r.status)
            .ok_or_else(|| err(format!("sandbox {id} has unknown status {}", r.status)))?;
        Ok(Sandbox {
            cpu_count: u32_of(r.cpu_count, "cpu count", &id)?,
            memory_mb: u32_of(r.memory_mb, "memory", &id)?,
            disk_size_mb: u32_of(r.disk_size_mb, "disk size", &id)?,
            team_id: r.team_id,
            template_id: r.template_id,
            alias: r.alias,
            started_at: r.started_at.utc(),
            end_at: r.end_at.utc(),
            metadata: serde_json::from_str(&r.metadata).map_err(err)?,
            env_vars: serde_json::from_str(&r.env_vars).map_err(err)?,
            allow_internet_access: r.allow_internet_access,
            network: serde_json::from_str(&r.network).map_err(err)?,
            traffic_access_token: r.traffic_access_token,
            auto_pause: r.auto_pause,
            auto_resume: r.auto_resume,
            auto_pause_memory: r.auto_pause_memory,
            image: json_of(r.image)?,
            envd_access_token: r.envd_access_token,
            envd_version: r.envd_version,
            status,
            handle: RuntimeHandle::from_stored(&r.handle)
                .map_err(|e| err(format!("sandbox {id} has a bad handle: {e}")))?,
            node_id: r.node_id,
            id,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct MountRow {
    volume_id: String,
    team_id: String,
    name: String,
    path: String,
}

impl From<MountRow> for VolumeMount {
    fn from(r: MountRow) -> Self {
        VolumeMount {
            volume_id: r.volume_id,
            team_id: r.team_id,
            name: r.name,
            path: r.path,
        }
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct VolumeRow<T> {
    id: String,
    team_id: String,
    name: String,
    token_hash: String,
    created_at: T,
}

impl<T: Stamp> From<VolumeRow<T>> for Volume {
    fn from(r: VolumeRow<T>) -> Self {
        Volume {
            id: r.id,
            team_id: r.team_id,
            name: r.name,
            token_hash: r.token_hash,
            created_at: r.created_at.utc(),
        }
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct SandboxLogRow<T> {
    at: T,
    level: i64,
    message: String,
    fields: String,
}

impl<T: Stamp> TryFrom<SandboxLogRow<T>> for SandboxLogEntry {
    type Error = StoreError;

    fn try_from(r: SandboxLogRow<T>) -> Result<Self, StoreError> {
        Ok(SandboxLogEntry {
            at: r.at.utc(),
            level: level_of_rank(r.level),
            message: r.message,
            fields: serde_json::from_str(&r.fields).map_err(err)?,
        })
    }
}

/// A team's activity bucket, without the team the query was for.
#[derive(sqlx::FromRow)]
pub(crate) struct BucketRow {
    bucket: i64,
    concurrent: i64,
    starts: i64,
}

impl BucketRow {
    pub(crate) fn of_team(self, team_id: &str) -> Result<TeamMetricBucket, StoreError> {
        Ok(TeamMetricBucket {
            team_id: team_id.to_owned(),
            bucket: self.bucket,
            concurrent: u32_of(self.concurrent, "concurrency", team_id)?,
            starts: u32_of(self.starts, "starts", team_id)?,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct NodeRow<T> {
    id: String,
    url: String,
    started_at: T,
    lease_until: T,
    report: String,
}

impl<T: Stamp> TryFrom<NodeRow<T>> for NodeRecord {
    type Error = StoreError;

    fn try_from(r: NodeRow<T>) -> Result<Self, StoreError> {
        Ok(NodeRecord {
            report: serde_json::from_str(&r.report).map_err(err)?,
            id: r.id,
            url: r.url,
            started_at: r.started_at.utc(),
            lease_until: r.lease_until.utc(),
        })
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct LayerBlobRow<T> {
    layer: String,
    digest: String,
    size_bytes: i64,
    node_id: String,
    published_at: T,
}

impl<T: Stamp> TryFrom<LayerBlobRow<T>> for LayerBlob {
    type Error = StoreError;

    fn try_from(r: LayerBlobRow<T>) -> Result<Self, StoreError> {
        Ok(LayerBlob {
            layer: r.layer,
            digest: r.digest,
            size_bytes: u64::try_from(r.size_bytes).map_err(err)?,
            node_id: r.node_id,
            published_at: r.published_at.utc(),
        })
    }
}

/// `query` with an event's columns bound as its insert lists them: id, team, sandbox, type,
/// when (microseconds), and the event as served (JSON), which is what a read gives back.
pub(crate) fn bind_event<'q, DB>(
    query: Query<'q, DB, DB::Arguments>,
    event: &SandboxEvent,
) -> Result<Query<'q, DB, DB::Arguments>, StoreError>
where
    DB: Database,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
{
    let body = serde_json::to_string(event).map_err(err)?;
    let text = [
        event.id.clone(),
        event.sandbox_team_id.clone(),
        event.sandbox_id.clone(),
        event.event_type.as_str().to_owned(),
    ];
    Ok(bind_all(query, text)
        .bind(event.timestamp.timestamp_micros())
        .bind(body))
}

pub(crate) fn event_of(body: &str) -> Result<SandboxEvent, StoreError> {
    serde_json::from_str(body).map_err(|e| err(format!("unreadable sandbox event: {e}")))
}

/// The select of a page of team `team_id`'s events, the same in both dialects: bodies, in
/// the order the events were added (or its reverse).
pub(crate) fn events_page<DB>(team_id: &str, query: &SandboxEventQuery) -> QueryBuilder<DB>
where
    DB: Database,
    DB::Arguments: Default,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
{
    let mut sql = QueryBuilder::new("SELECT body FROM sandbox_events WHERE team_id = ");
    sql.push_bind(team_id.to_owned());
    if let Some(sandbox_id) = &query.sandbox_id {
        sql.push(" AND sandbox_id = ").push_bind(sandbox_id.clone());
    }
    if !query.types.is_empty() {
        sql.push(" AND type IN (");
        let mut types = sql.separated(", ");
        for t in &query.types {
            types.push_bind(t.as_str().to_owned());
        }
        sql.push(")");
    }
    sql.push(if query.ascending {
        " ORDER BY seq ASC"
    } else {
        " ORDER BY seq DESC"
    })
    .push(" LIMIT ")
    .push_bind(i64::from(query.limit))
    .push(" OFFSET ")
    .push_bind(i64::from(query.offset));
    sql
}

/// A webhook as both databases select it.
#[derive(sqlx::FromRow)]
pub(crate) struct WebhookRow {
    id: String,
    team_id: String,
    name: String,
    url: String,
    enabled: bool,
    events: String,
    secret: String,
    created_at: i64,
}

fn event_type_of(name: &str, what: &str, id: &str) -> Result<SandboxEventType, StoreError> {
    SandboxEventType::parse(name)
        .ok_or_else(|| err(format!("{what} {id}: unknown event type '{name}'")))
}

impl TryFrom<WebhookRow> for Webhook {
    type Error = StoreError;

    fn try_from(r: WebhookRow) -> Result<Self, StoreError> {
        let names: Vec<String> = serde_json::from_str(&r.events).map_err(err)?;
        let events = names
            .iter()
            .map(|n| event_type_of(n, "webhook", &r.id))
            .collect::<Result<_, _>>()?;
        Ok(Webhook {
            id: r.id,
            team_id: r.team_id,
            name: r.name,
            url: r.url,
            enabled: r.enabled,
            events,
            secret: r.secret,
            created_at: time(r.created_at),
        })
    }
}

/// `query` with what a team may change of a webhook bound in the order both its insert and
/// its update list them: name, url, enabled, events (a JSON array of names), secret.
pub(crate) fn bind_webhook_settings<'q, DB>(
    query: Query<'q, DB, DB::Arguments>,
    webhook: &Webhook,
) -> Result<Query<'q, DB, DB::Arguments>, StoreError>
where
    DB: Database,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    bool: for<'t> Encode<'t, DB> + Type<DB>,
{
    let names: Vec<&str> = webhook.events.iter().map(|e| e.as_str()).collect();
    let events = serde_json::to_string(&names).map_err(err)?;
    Ok(query
        .bind(webhook.name.clone())
        .bind(webhook.url.clone())
        .bind(webhook.enabled)
        .bind(events)
        .bind(webhook.secret.clone()))
}

/// An attempt as both databases select it.
#[derive(sqlx::FromRow)]
pub(crate) struct DeliveryRow {
    id: String,
    webhook_id: String,
    event_id: String,
    event_type: String,
    attempt: i64,
    status_code: Option<i64>,
    error: Option<String>,
    at: i64,
}

impl TryFrom<DeliveryRow> for WebhookDelivery {
    type Error = StoreError;

    fn try_from(r: DeliveryRow) -> Result<Self, StoreError> {
        Ok(WebhookDelivery {
            event_type: event_type_of(&r.event_type, "delivery", &r.id)?,
            id: r.id,
            webhook_id: r.webhook_id,
            event_id: r.event_id,
            attempt: u32::try_from(r.attempt).unwrap_or(u32::MAX),
            status_code: r.status_code.and_then(|c| u16::try_from(c).ok()),
            error: r.error,
            at: time(r.at),
        })
    }
}

/// `query` with an attempt's columns bound as its insert lists them: id, webhook, event,
/// type, attempt, status, error, when (microseconds).
pub(crate) fn bind_delivery<'q, DB>(
    query: Query<'q, DB, DB::Arguments>,
    delivery: &WebhookDelivery,
) -> Query<'q, DB, DB::Arguments>
where
    DB: Database,
    String: for<'t> Encode<'t, DB> + Type<DB>,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
    Option<i64>: for<'t> Encode<'t, DB> + Type<DB>,
    Option<String>: for<'t> Encode<'t, DB> + Type<DB>,
{
    let text = [
        delivery.id.clone(),
        delivery.webhook_id.clone(),
        delivery.event_id.clone(),
        delivery.event_type.as_str().to_owned(),
    ];
    bind_all(query, text)
        .bind(i64::from(delivery.attempt))
        .bind(delivery.status_code.map(i64::from))
        .bind(delivery.error.clone())
        .bind(delivery.at.timestamp_micros())
}
