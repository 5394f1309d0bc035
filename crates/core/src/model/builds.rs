//! Template builds as recorded: what was asked, how it ended, what it logged.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::templates::{BuildStatus, TemplateImage};

/// Registry credentials for `fromImage`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryCredentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for RegistryCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryCredentials")
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BuildSource {
    /// An image from a registry, e.g. `python:3.12` or `127.0.0.1:5000/app:1`.
    Image {
        reference: String,
        #[serde(skip_serializing_if = "Option::is_none", default)]
        credentials: Option<RegistryCredentials>,
    },
    /// Another template's current image, by ID or name.
    Template { reference: String },
    /// A root filesystem the node makes itself (the default template's Debian root).
    Builtin { layer: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum StepKind {
    /// Files uploaded under `files_hash` (a tar relative to the build context), `src`
    /// selecting within it, placed at `dest`.
    Copy {
        src: String,
        dest: String,
        owner: Option<String>,
        mode: Option<u32>,
        files_hash: String,
    },
    Run {
        command: String,
        user: Option<String>,
    },
    Env {
        vars: Vec<(String, String)>,
    },
    Workdir {
        path: String,
    },
    User {
        user: String,
    },
}

impl StepKind {
    pub fn name(&self) -> &'static str {
        match self {
            StepKind::Copy { .. } => "COPY",
            StepKind::Run { .. } => "RUN",
            StepKind::Env { .. } => "ENV",
            StepKind::Workdir { .. } => "WORKDIR",
            StepKind::User { .. } => "USER",
        }
    }

    /// The step as a build log shows it.
    pub fn describe(&self) -> String {
        match self {
            StepKind::Copy { src, dest, .. } => format!("COPY {src} {dest}"),
            StepKind::Run { command, user } => match user {
                Some(u) => format!("RUN (as {u}) {command}"),
                None => format!("RUN {command}"),
            },
            StepKind::Env { vars } => {
                let pairs: Vec<String> = vars.iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!("ENV {}", pairs.join(" "))
            }
            StepKind::Workdir { path } => format!("WORKDIR {path}"),
            StepKind::User { user } => format!("USER {user}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildStep {
    pub kind: StepKind,
    /// Rebuild this step (and so every later one) whatever the cache holds.
    pub force: bool,
}

/// Everything a build was asked to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildSpec {
    pub source: BuildSource,
    pub steps: Vec<BuildStep>,
    /// Ignore the layer cache for the whole build.
    pub force: bool,
    pub start_cmd: Option<String>,
    /// See [`crate::TemplateImage::start_user`]; only built-in templates set it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_user: Option<String>,
    pub ready_cmd: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
    Error,
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "debug" => LogLevel::Debug,
            "info" => LogLevel::Info,
            "warn" => LogLevel::Warn,
            "error" => LogLevel::Error,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildLogEntry {
    pub timestamp: DateTime<Utc>,
    pub level: LogLevel,
    pub message: String,
    /// `base`, a step number counted from 1, or `finalize`.
    pub step: Option<String>,
}

/// Why a build ended in `error`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildFailure {
    pub message: String,
    pub step: Option<String>,
}

impl BuildFailure {
    pub fn at(step: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            step: Some(step.into()),
        }
    }
}

/// Step names the SDKs map back to their own call sites.
pub const BASE_STEP: &str = "base";
pub const FINALIZE_STEP: &str = "finalize";

#[derive(Debug, Clone, PartialEq)]
pub struct BuildRecord {
    pub id: String,
    pub template_id: String,
    pub team_id: Option<String>,
    pub status: BuildStatus,
    pub failure: Option<BuildFailure>,
    pub spec: Option<BuildSpec>,
    pub image: Option<TemplateImage>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// The node of a cluster that runs (or was asked for) the build; `None` on a single host.
    pub node_id: Option<String>,
}
