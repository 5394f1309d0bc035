//! E2B's JSON shapes. Field names follow the wire exactly (`templateID`, `sandboxID`,
//! `allow_internet_access`), because the SDKs parse strictly.

use std::collections::BTreeMap;

use chrono::{DateTime, SecondsFormat, Utc};
use sandbar_core::{Sandbox, Template};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// E2B's infrastructure returns this constant; the SDKs require the field.
pub(crate) const CLIENT_ID: &str = "6532622b";

/// The node that runs the sandbox, in a cluster; E2B's constant on a single host.
fn client_id(s: &Sandbox) -> String {
    if s.node_id.is_empty() {
        CLIENT_ID.to_owned()
    } else {
        s.node_id.clone()
    }
}

pub(crate) fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// The headers of a page: `X-Next-Token` with the next page's cursor, none on the last page.
pub(crate) fn next_token_header(token: Option<&str>) -> axum::http::HeaderMap {
    let mut headers = axum::http::HeaderMap::new();
    if let Some(value) = token.and_then(|t| axum::http::HeaderValue::from_str(t).ok()) {
        headers.insert("X-Next-Token", value);
    }
    headers
}

/// Body of `POST /sandboxes` and `POST /v2/sandboxes`; unknown fields are ignored.
// Serialized when the API host of a cluster forwards a create it has checked: an absent field
// goes as `null`, which reads back as absent.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub(crate) struct NewSandbox {
    /// Template ID or alias (`name:tag` picks a tagged build).
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Seconds until the sandbox ends; 15 when omitted on `POST /sandboxes`, 300 on v2.
    #[schema(minimum = 0, maximum = 2147483647)]
    pub timeout: Option<i64>,
    #[serde(rename = "autoPause")]
    pub auto_pause: Option<bool>,
    /// false: a pause on timeout keeps only the files (needs `autoPause`, refuses
    /// `autoResume`).
    #[serde(rename = "autoPauseMemory")]
    pub auto_pause_memory: Option<bool>,
    /// `{"enabled": bool}`; needs `autoPause`.
    #[serde(rename = "autoResume")]
    #[schema(value_type = Option<Object>)]
    pub auto_resume: Option<serde_json::Value>,
    pub allow_internet_access: Option<bool>,
    pub network: Option<NetworkConfig>,
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(rename = "envVars")]
    pub env_vars: Option<BTreeMap<String, String>>,
    /// Not supported: anything but null is refused.
    #[schema(value_type = Option<Object>)]
    pub mcp: Option<serde_json::Value>,
    #[serde(rename = "volumeMounts")]
    #[schema(value_type = Option<Vec<VolumeMount>>)]
    pub volume_mounts: Option<Vec<serde_json::Value>>,
}

/// `SandboxNetworkConfig` on create, and (with `allow_internet_access`) the body of
/// `PUT /sandboxes/{id}/network`, `SandboxNetworkUpdateConfig`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, ToSchema)]
pub(crate) struct NetworkConfig {
    #[serde(rename = "allowOut")]
    pub allow_out: Option<Vec<String>>,
    #[serde(rename = "denyOut")]
    pub deny_out: Option<Vec<String>>,
    #[serde(rename = "dnsServers")]
    pub dns_servers: Option<Vec<String>>,
    /// Not supported: anything but null is refused.
    #[serde(rename = "egressProxy")]
    #[schema(value_type = Option<Object>)]
    pub egress_proxy: Option<serde_json::Value>,
    /// Not supported: anything but an empty object is refused.
    #[schema(value_type = Option<Object>)]
    pub rules: Option<serde_json::Map<String, serde_json::Value>>,
    /// Not supported: anything but an empty list is refused.
    #[serde(rename = "httpsPorts")]
    #[schema(value_type = Option<Vec<Value>>)]
    pub https_ports: Option<Vec<serde_json::Value>>,
    #[serde(rename = "allowPublicTraffic")]
    pub allow_public_traffic: Option<bool>,
    #[serde(rename = "maskRequestHost")]
    pub mask_request_host: Option<String>,
    /// Update only: false closes egress like `0.0.0.0/0` in `denyOut`.
    pub allow_internet_access: Option<bool>,
}

/// `SandboxNetworkConfig` as `GET /sandboxes/{id}` shows it.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct NetworkView {
    #[serde(rename = "allowOut")]
    allow_out: Vec<String>,
    #[serde(rename = "denyOut")]
    deny_out: Vec<String>,
    #[serde(rename = "dnsServers", skip_serializing_if = "Option::is_none")]
    dns_servers: Option<Vec<String>>,
    #[serde(rename = "allowPublicTraffic")]
    allow_public_traffic: bool,
    #[serde(rename = "maskRequestHost", skip_serializing_if = "Option::is_none")]
    mask_request_host: Option<String>,
}

impl From<&sandbar_core::NetworkConfig> for NetworkView {
    fn from(n: &sandbar_core::NetworkConfig) -> Self {
        Self {
            allow_out: n.egress.allow_out.clone(),
            deny_out: n.egress.deny_out.clone(),
            dns_servers: n.egress.dns_servers.clone(),
            allow_public_traffic: n.allow_public_traffic,
            mask_request_host: n.mask_request_host.clone(),
        }
    }
}

#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct TimeoutBody {
    /// Seconds from now after which the sandbox ends.
    #[schema(minimum = 0, maximum = 2147483647)]
    pub timeout: i64,
}

#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct RefreshBody {
    /// Seconds the sandbox is kept alive (at least 15).
    #[schema(minimum = 0, maximum = 3600)]
    pub duration: Option<i64>,
}

/// A volume mounted into a sandbox.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub(crate) struct VolumeMount {
    pub name: String,
    pub path: String,
}

/// A sandbox's state as the API names it.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub(crate) enum SandboxStateName {
    Running,
    Paused,
}

impl From<sandbar_core::SandboxState> for SandboxStateName {
    fn from(s: sandbar_core::SandboxState) -> Self {
        match s {
            sandbar_core::SandboxState::Running => Self::Running,
            sandbar_core::SandboxState::Paused => Self::Paused,
        }
    }
}

/// A template build's status as the API names it.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub(crate) enum BuildStatusName {
    Building,
    Waiting,
    Ready,
    Error,
}

impl From<sandbar_core::BuildStatus> for BuildStatusName {
    fn from(s: sandbar_core::BuildStatus) -> Self {
        match s {
            sandbar_core::BuildStatus::Building => Self::Building,
            sandbar_core::BuildStatus::Waiting => Self::Waiting,
            sandbar_core::BuildStatus::Ready => Self::Ready,
            sandbar_core::BuildStatus::Error => Self::Error,
        }
    }
}

/// A log line's level as the API names it.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub(crate) enum LogLevelName {
    Debug,
    Info,
    Warn,
    Error,
}

impl From<sandbar_core::builds::LogLevel> for LogLevelName {
    fn from(l: sandbar_core::builds::LogLevel) -> Self {
        use sandbar_core::builds::LogLevel as L;
        match l {
            L::Debug => Self::Debug,
            L::Info => Self::Info,
            L::Warn => Self::Warn,
            L::Error => Self::Error,
        }
    }
}

/// Response to create and connect.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Sandbox)]
pub(crate) struct SandboxCreated {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    alias: Option<String>,
    #[serde(rename = "clientID")]
    #[schema(value_type = String)]
    client_id: String,
    #[serde(rename = "envdVersion")]
    envd_version: String,
    #[serde(rename = "envdAccessToken")]
    envd_access_token: String,
    #[serde(rename = "trafficAccessToken")]
    #[schema(required = true)]
    traffic_access_token: Option<String>,
    #[schema(required = true)]
    domain: Option<String>,
}

impl From<&Sandbox> for SandboxCreated {
    fn from(s: &Sandbox) -> Self {
        Self {
            template_id: s.template_id.clone(),
            sandbox_id: s.id.clone(),
            alias: s.alias.clone(),
            client_id: client_id(s),
            envd_version: s.envd_version.clone(),
            envd_access_token: s.envd_access_token.clone(),
            traffic_access_token: s.traffic_access_token.clone(),
            domain: None,
        }
    }
}

/// An item of the sandbox lists.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ListedSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    alias: Option<String>,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    #[schema(value_type = String)]
    client_id: String,
    #[serde(rename = "startedAt")]
    #[schema(format = DateTime)]
    started_at: String,
    #[serde(rename = "endAt")]
    #[schema(format = DateTime)]
    end_at: String,
    #[serde(rename = "cpuCount")]
    cpu_count: u32,
    #[serde(rename = "memoryMB")]
    memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: u32,
    metadata: BTreeMap<String, String>,
    state: SandboxStateName,
    #[serde(rename = "envdVersion")]
    envd_version: String,
}

impl From<&Sandbox> for ListedSandbox {
    fn from(s: &Sandbox) -> Self {
        Self {
            template_id: s.template_id.clone(),
            alias: s.alias.clone(),
            sandbox_id: s.id.clone(),
            client_id: client_id(s),
            started_at: rfc3339(s.started_at),
            end_at: rfc3339(s.end_at),
            cpu_count: s.cpu_count,
            memory_mb: s.memory_mb,
            disk_size_mb: s.disk_size_mb,
            metadata: s.metadata.clone(),
            state: s.state().into(),
            envd_version: s.envd_version.clone(),
        }
    }
}

/// `GET /sandboxes/{id}`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SandboxDetail {
    #[serde(flatten)]
    listed: ListedSandbox,
    #[serde(rename = "envdAccessToken")]
    envd_access_token: String,
    #[schema(required = true)]
    domain: Option<String>,
    #[serde(rename = "allowInternetAccess")]
    allow_internet_access: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    network: Option<NetworkView>,
    lifecycle: Lifecycle,
    #[serde(rename = "volumeMounts", skip_serializing_if = "Vec::is_empty")]
    volume_mounts: Vec<VolumeMount>,
}

/// What happens to a sandbox when its time is up.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Lifecycle {
    #[serde(rename = "autoResume")]
    auto_resume: bool,
    #[serde(rename = "onTimeout")]
    on_timeout: OnTimeout,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub(crate) enum OnTimeout {
    Pause,
    Kill,
}

impl SandboxDetail {
    /// Adds the sandbox's volume mounts as `[{name, path}]`.
    pub(crate) fn with_volume_mounts(mut self, mounts: Vec<VolumeMount>) -> Self {
        self.volume_mounts = mounts;
        self
    }
}

impl From<&Sandbox> for SandboxDetail {
    fn from(s: &Sandbox) -> Self {
        Self {
            listed: s.into(),
            envd_access_token: s.envd_access_token.clone(),
            domain: None,
            allow_internet_access: s.allow_internet_access,
            network: (!s.network.is_default()).then(|| NetworkView::from(&s.network)),
            lifecycle: Lifecycle {
                auto_resume: s.auto_resume,
                on_timeout: if s.auto_pause {
                    OnTimeout::Pause
                } else {
                    OnTimeout::Kill
                },
            },
            volume_mounts: Vec::new(),
        }
    }
}

/// An item of `GET /templates`, and the template a Dockerfile build request made.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Template)]
pub(crate) struct TemplateItem {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "buildID")]
    build_id: String,
    #[serde(rename = "cpuCount")]
    cpu_count: u32,
    #[serde(rename = "memoryMB")]
    memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: u32,
    public: bool,
    aliases: Vec<String>,
    names: Vec<String>,
    #[serde(rename = "createdAt")]
    #[schema(format = DateTime)]
    created_at: String,
    #[serde(rename = "updatedAt")]
    #[schema(format = DateTime)]
    updated_at: String,
    /// Always null: templates record no creating user.
    #[serde(rename = "createdBy")]
    #[schema(value_type = Option<Object>, required = true)]
    created_by: Option<serde_json::Value>,
    #[serde(rename = "lastSpawnedAt")]
    #[schema(format = DateTime, required = true)]
    last_spawned_at: Option<String>,
    #[serde(rename = "spawnCount")]
    spawn_count: u64,
    #[serde(rename = "buildCount")]
    build_count: u64,
    #[serde(rename = "envdVersion")]
    envd_version: String,
    #[serde(rename = "buildStatus")]
    build_status: BuildStatusName,
}

impl TemplateItem {
    /// The record of a build request names the new build, not the template's current one.
    pub(crate) fn with_build_id(mut self, build_id: String) -> Self {
        self.build_id = build_id;
        self
    }
}

impl From<&Template> for TemplateItem {
    fn from(t: &Template) -> Self {
        Self {
            template_id: t.id.clone(),
            build_id: t.build_id.clone(),
            cpu_count: t.cpu_count,
            memory_mb: t.memory_mb,
            disk_size_mb: t.disk_size_mb,
            public: t.public,
            aliases: t.aliases.clone(),
            names: t.names(),
            created_at: rfc3339(t.created_at),
            updated_at: rfc3339(t.updated_at),
            created_by: None,
            last_spawned_at: t.last_spawned_at.map(rfc3339),
            spawn_count: t.spawn_count,
            build_count: t.build_count,
            envd_version: t.envd_version.clone(),
            build_status: t.build_status.into(),
        }
    }
}
