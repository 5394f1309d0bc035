//! Sandboxes as recorded.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::templates::TemplateImage;
use crate::lifecycle::SandboxStatus;
use crate::network::NetworkConfig;
use crate::runtime::RuntimeHandle;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    Running,
    Paused,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "running" => Some(SandboxState::Running),
            "paused" => Some(SandboxState::Paused),
            _ => None,
        }
    }
}

impl SandboxState {
    /// The state E2B's API shows for a sandbox recorded as `status`: paused in any way, or
    /// on the way there without memory, is paused.
    pub fn of(status: SandboxStatus) -> Self {
        if status.is_paused() || status == SandboxStatus::Pausing {
            SandboxState::Paused
        } else {
            SandboxState::Running
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sandbox {
    pub id: String,
    pub team_id: String,
    pub template_id: String,
    /// The alias the sandbox was created by, if it was created by one.
    pub alias: Option<String>,
    pub started_at: DateTime<Utc>,
    pub end_at: DateTime<Utc>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub allow_internet_access: bool,
    /// Egress rules and user-port access as the client set them.
    pub network: NetworkConfig,
    /// Required on user-port requests when `network.allow_public_traffic` is false.
    pub traffic_access_token: Option<String>,
    pub envd_access_token: String,
    pub envd_version: String,
    /// Where it is in its life, as a restart must see it: the settled statuses, and the
    /// transient ones recovery has to finish (see [`SandboxStatus::is_recorded`]).
    pub status: SandboxStatus,
    pub handle: RuntimeHandle,
    /// Pause instead of stopping when the timeout passes.
    pub auto_pause: bool,
    /// Traffic through the edge resumes the sandbox when it is paused.
    pub auto_resume: bool,
    /// Whether a pause on timeout keeps the memory (`autoPauseMemory`).
    pub auto_pause_memory: bool,
    /// What the sandbox booted from, to boot it again on its kept files; `None` for
    /// sandboxes recorded before this was kept.
    pub image: Option<TemplateImage>,
    /// The node that runs it, or held it last; empty for sandboxes recorded before nodes had
    /// names, which the next server to start on their data adopts.
    pub node_id: String,
}

impl Sandbox {
    pub fn state(&self) -> SandboxState {
        SandboxState::of(self.status)
    }
}

#[cfg(test)]
mod tests {
    use super::SandboxState;
    use crate::lifecycle::SandboxStatus;

    #[test]
    fn paused_in_any_way_or_released_is_paused() {
        for status in SandboxStatus::ALL {
            let paused = status.is_paused() || status == SandboxStatus::Pausing;
            assert_eq!(
                SandboxState::of(status) == SandboxState::Paused,
                paused,
                "{status:?}"
            );
        }
    }
}
