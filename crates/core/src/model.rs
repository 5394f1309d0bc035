//! The records the core reasons about.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::builds::TemplateImage;
use crate::network::NetworkConfig;
use crate::runtime::RuntimeHandle;

/// Alias of the template every installation builds on first start.
pub const DEFAULT_TEMPLATE_ALIAS: &str = "base";
/// Alias of the built-in template E2B's code interpreter SDKs create by default.
pub const INTERPRETER_TEMPLATE_ALIAS: &str = "code-interpreter-v1";
/// Names no team may give a template of its own.
pub const BUILT_IN_TEMPLATE_ALIASES: [&str; 2] =
    [DEFAULT_TEMPLATE_ALIAS, INTERPRETER_TEMPLATE_ALIAS];

/// A team owns every other resource; its limits are per team so operators can set them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Team {
    pub id: String,
    pub name: String,
    /// The team's namespace in template and snapshot names (`slug/name:tag`): unique, made
    /// from the name when the team is made.
    pub slug: String,
    pub max_concurrent_sandboxes: u32,
    pub max_sandbox_timeout_secs: u64,
    /// API requests allowed per minute; 0 means no limit.
    pub requests_per_minute: u32,
    /// Ceilings on one sandbox's resources; 0 leaves only the server's own limits.
    pub max_vcpu: u32,
    pub max_memory_mb: u32,
    pub max_disk_mb: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    Building,
    Waiting,
    Ready,
    Error,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildStatus::Building => "building",
            BuildStatus::Waiting => "waiting",
            BuildStatus::Ready => "ready",
            BuildStatus::Error => "error",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "building" => BuildStatus::Building,
            "waiting" => BuildStatus::Waiting,
            "ready" => BuildStatus::Ready,
            "error" => BuildStatus::Error,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    pub id: String,
    /// `None` for templates every team may use (the built-in ones).
    pub team_id: Option<String>,
    /// The owning team's slug, which namespaces the aliases; `None` for built-in templates.
    pub namespace: Option<String>,
    /// Names within the owner's namespace, unique there.
    pub aliases: Vec<String>,
    pub public: bool,
    pub build_id: String,
    pub build_status: BuildStatus,
    /// Why the last build failed, when it did.
    pub build_error: Option<String>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
    pub envd_version: String,
    /// What sandboxes of the template start from: the last successful build's image.
    pub image: Option<TemplateImage>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub last_spawned_at: Option<DateTime<Utc>>,
    pub spawn_count: u64,
    pub build_count: u64,
}

impl Template {
    pub fn visible_to(&self, team_id: &str) -> bool {
        self.public || self.team_id.as_deref().is_none_or(|owner| owner == team_id)
    }

    /// Full names as E2B gives them: `namespace/alias`, or the bare alias of a built-in.
    pub fn names(&self) -> Vec<String> {
        self.aliases
            .iter()
            .map(|alias| match &self.namespace {
                Some(namespace) => format!("{namespace}/{alias}"),
                None => alias.clone(),
            })
            .collect()
    }
}

/// A slug made from a team's name: lower-case letters and digits, runs of anything else
/// made one `-`, at most 48 bytes; `team` when nothing is left.
pub fn slug_of(name: &str) -> String {
    let mut slug = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.ends_with('-') && !slug.is_empty() {
            slug.push('-');
        }
        if slug.len() >= 48 {
            break;
        }
    }
    let slug = slug.trim_end_matches('-');
    if slug.is_empty() {
        "team".to_owned()
    } else {
        slug.to_owned()
    }
}

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
    use super::{PauseKind, slug_of};

    #[test]
    fn slugs_are_lower_case_letters_digits_and_single_dashes() {
        assert_eq!(slug_of("Acme Corp"), "acme-corp");
        assert_eq!(slug_of("  --Team__42!!"), "team-42");
        assert_eq!(slug_of("日本"), "team");
        assert_eq!(slug_of(&"a".repeat(100)).len(), 48);
    }

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
