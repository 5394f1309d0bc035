//! E2B's JSON shapes. Field names follow the wire exactly (`templateID`, `sandboxID`,
//! `allow_internet_access`), because the SDKs parse strictly.

use std::collections::BTreeMap;

use chrono::{DateTime, SecondsFormat, Utc};
use sandbar_core::{Sandbox, Template};
use serde::{Deserialize, Serialize};

/// E2B's infrastructure returns this constant; the SDKs require the field.
pub(crate) const CLIENT_ID: &str = "6532622b";

pub(crate) fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Body of `POST /sandboxes` and `POST /v2/sandboxes`; unknown fields are ignored.
#[derive(Debug, Deserialize)]
pub(crate) struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub timeout: Option<i64>,
    #[serde(rename = "autoPause")]
    pub auto_pause: Option<bool>,
    #[serde(rename = "autoPauseMemory")]
    pub auto_pause_memory: Option<bool>,
    #[serde(rename = "autoResume")]
    pub auto_resume: Option<serde_json::Value>,
    pub allow_internet_access: Option<bool>,
    pub network: Option<NetworkConfig>,
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(rename = "envVars")]
    pub env_vars: Option<BTreeMap<String, String>>,
    pub mcp: Option<serde_json::Value>,
    #[serde(rename = "volumeMounts")]
    pub volume_mounts: Option<Vec<serde_json::Value>>,
}

/// `SandboxNetworkConfig` on create, and (with `allow_internet_access`) the body of
/// `PUT /sandboxes/{id}/network`, `SandboxNetworkUpdateConfig`.
#[derive(Debug, Deserialize, Default)]
pub(crate) struct NetworkConfig {
    #[serde(rename = "allowOut")]
    pub allow_out: Option<Vec<String>>,
    #[serde(rename = "denyOut")]
    pub deny_out: Option<Vec<String>>,
    #[serde(rename = "dnsServers")]
    pub dns_servers: Option<Vec<String>>,
    #[serde(rename = "egressProxy")]
    pub egress_proxy: Option<serde_json::Value>,
    pub rules: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(rename = "httpsPorts")]
    pub https_ports: Option<Vec<serde_json::Value>>,
    #[serde(rename = "allowPublicTraffic")]
    pub allow_public_traffic: Option<bool>,
    #[serde(rename = "maskRequestHost")]
    pub mask_request_host: Option<String>,
    /// Update only: false closes egress like `0.0.0.0/0` in `denyOut`.
    pub allow_internet_access: Option<bool>,
}

/// `SandboxNetworkConfig` as `GET /sandboxes/{id}` shows it.
#[derive(Debug, Serialize)]
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

#[derive(Debug, Deserialize)]
pub(crate) struct TimeoutBody {
    pub timeout: i64,
}

#[derive(Debug, Deserialize)]
pub(crate) struct OptionalTimeoutBody {
    pub timeout: Option<i64>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct RefreshBody {
    pub duration: Option<i64>,
}

/// Response to create and connect.
#[derive(Debug, Serialize)]
pub(crate) struct SandboxCreated {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    alias: Option<String>,
    #[serde(rename = "clientID")]
    client_id: &'static str,
    #[serde(rename = "envdVersion")]
    envd_version: String,
    #[serde(rename = "envdAccessToken")]
    envd_access_token: String,
    #[serde(rename = "trafficAccessToken")]
    traffic_access_token: Option<String>,
    domain: Option<String>,
}

impl From<&Sandbox> for SandboxCreated {
    fn from(s: &Sandbox) -> Self {
        Self {
            template_id: s.template_id.clone(),
            sandbox_id: s.id.clone(),
            alias: s.alias.clone(),
            client_id: CLIENT_ID,
            envd_version: s.envd_version.clone(),
            envd_access_token: s.envd_access_token.clone(),
            traffic_access_token: s.traffic_access_token.clone(),
            domain: None,
        }
    }
}

/// An item of the sandbox lists.
#[derive(Debug, Serialize)]
pub(crate) struct ListedSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    alias: Option<String>,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: &'static str,
    #[serde(rename = "startedAt")]
    started_at: String,
    #[serde(rename = "endAt")]
    end_at: String,
    #[serde(rename = "cpuCount")]
    cpu_count: u32,
    #[serde(rename = "memoryMB")]
    memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: u32,
    metadata: BTreeMap<String, String>,
    state: &'static str,
    #[serde(rename = "envdVersion")]
    envd_version: String,
}

impl From<&Sandbox> for ListedSandbox {
    fn from(s: &Sandbox) -> Self {
        Self {
            template_id: s.template_id.clone(),
            alias: s.alias.clone(),
            sandbox_id: s.id.clone(),
            client_id: CLIENT_ID,
            started_at: rfc3339(s.started_at),
            end_at: rfc3339(s.end_at),
            cpu_count: s.cpu_count,
            memory_mb: s.memory_mb,
            disk_size_mb: s.disk_size_mb,
            metadata: s.metadata.clone(),
            state: s.state.as_str(),
            envd_version: s.envd_version.clone(),
        }
    }
}

/// `GET /sandboxes/{id}`.
#[derive(Debug, Serialize)]
pub(crate) struct SandboxDetail {
    #[serde(flatten)]
    listed: ListedSandbox,
    #[serde(rename = "envdAccessToken")]
    envd_access_token: String,
    domain: Option<String>,
    #[serde(rename = "allowInternetAccess")]
    allow_internet_access: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    network: Option<NetworkView>,
    lifecycle: serde_json::Value,
    #[serde(rename = "volumeMounts", skip_serializing_if = "Vec::is_empty")]
    volume_mounts: Vec<serde_json::Value>,
}

impl SandboxDetail {
    /// Adds the sandbox's volume mounts as `[{name, path}]`.
    pub(crate) fn with_volume_mounts(mut self, mounts: Vec<serde_json::Value>) -> Self {
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
            lifecycle: serde_json::json!({
                "autoResume": s.auto_resume,
                "onTimeout": if s.auto_pause { "pause" } else { "kill" },
            }),
            volume_mounts: Vec::new(),
        }
    }
}

/// An item of `GET /templates`.
#[derive(Debug, Serialize)]
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
    created_at: String,
    #[serde(rename = "updatedAt")]
    updated_at: String,
    #[serde(rename = "createdBy")]
    created_by: Option<serde_json::Value>,
    #[serde(rename = "lastSpawnedAt")]
    last_spawned_at: Option<String>,
    #[serde(rename = "spawnCount")]
    spawn_count: u64,
    #[serde(rename = "buildCount")]
    build_count: u64,
    #[serde(rename = "envdVersion")]
    envd_version: String,
    #[serde(rename = "buildStatus")]
    build_status: &'static str,
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
            names: t.aliases.clone(),
            created_at: rfc3339(t.created_at),
            updated_at: rfc3339(t.updated_at),
            created_by: None,
            last_spawned_at: t.last_spawned_at.map(rfc3339),
            spawn_count: t.spawn_count,
            build_count: t.build_count,
            envd_version: t.envd_version.clone(),
            build_status: t.build_status.as_str(),
        }
    }
}
