//! Sandboxes as recorded.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::templates::TemplateImage;
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

/// How a paused sandbox is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseKind {
    /// Frozen in place: processes and memory held.
    Memory,
    /// Processes ended, only the files kept; resuming boots the sandbox again on them.
    Files,
    /// Frozen and being checkpointed: recorded before the checkpoint starts, so a restart
    /// knows to look at what it left.
    Checkpointing,
    /// Checkpointed to disk: processes and memory in the checkpoint, restored on resume.
    Checkpoint,
    /// Having its processes ended to keep only its files: recorded before they are ended, so
    /// a restart finishes the job instead of taking the sandbox for dead.
    Releasing,
}

impl PauseKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PauseKind::Memory => "memory",
            PauseKind::Files => "files",
            PauseKind::Checkpointing => "checkpointing",
            PauseKind::Checkpoint => "checkpoint",
            PauseKind::Releasing => "releasing",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "memory" => Some(PauseKind::Memory),
            "files" => Some(PauseKind::Files),
            "checkpointing" => Some(PauseKind::Checkpointing),
            "checkpoint" => Some(PauseKind::Checkpoint),
            "releasing" => Some(PauseKind::Releasing),
            _ => None,
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
    pub state: SandboxState,
    /// How the sandbox is kept while `state` is paused; `None` while running.
    pub paused_as: Option<PauseKind>,
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
}

#[cfg(test)]
mod tests {
    use super::PauseKind;

    #[test]
    fn every_pause_kind_reads_back_as_stored() {
        for kind in [
            PauseKind::Memory,
            PauseKind::Files,
            PauseKind::Checkpointing,
            PauseKind::Checkpoint,
            PauseKind::Releasing,
        ] {
            assert_eq!(PauseKind::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(PauseKind::parse("frozen"), None);
    }
}
