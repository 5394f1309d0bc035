//! Sandbox lifecycle events as clients read them: E2B's event shape (version 2), kept per
//! team for as long as sandbox logs.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::Sandbox;

/// The changes in a sandbox's life a client can subscribe to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SandboxEventType {
    #[serde(rename = "sandbox.lifecycle.created")]
    Created,
    #[serde(rename = "sandbox.lifecycle.updated")]
    Updated,
    #[serde(rename = "sandbox.lifecycle.paused")]
    Paused,
    #[serde(rename = "sandbox.lifecycle.resumed")]
    Resumed,
    #[serde(rename = "sandbox.lifecycle.checkpointed")]
    Checkpointed,
    #[serde(rename = "sandbox.lifecycle.killed")]
    Killed,
}

impl SandboxEventType {
    pub const ALL: [Self; 6] = [
        Self::Created,
        Self::Updated,
        Self::Paused,
        Self::Resumed,
        Self::Checkpointed,
        Self::Killed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Created => "sandbox.lifecycle.created",
            Self::Updated => "sandbox.lifecycle.updated",
            Self::Paused => "sandbox.lifecycle.paused",
            Self::Resumed => "sandbox.lifecycle.resumed",
            Self::Checkpointed => "sandbox.lifecycle.checkpointed",
            Self::Killed => "sandbox.lifecycle.killed",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == text)
    }

    /// Whether the event says how long the sandbox ran (its `execution`).
    fn ends_an_execution(self) -> bool {
        matches!(self, Self::Paused | Self::Killed)
    }
}

/// The version of the event shape this server writes.
pub const SANDBOX_EVENT_VERSION: &str = "v2";

/// One change in a sandbox's life, as served at `/events/sandboxes` and delivered to
/// webhooks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxEvent {
    pub version: String,
    pub id: String,
    #[serde(rename = "type")]
    pub event_type: SandboxEventType,
    pub event_data: SandboxEventData,
    pub sandbox_build_id: String,
    /// The run of the sandbox the event belongs to: a resume begins another.
    pub sandbox_execution_id: String,
    pub sandbox_id: String,
    pub sandbox_team_id: String,
    pub sandbox_template_id: String,
    pub timestamp: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxEventData {
    pub sandbox_metadata: BTreeMap<String, String>,
    /// On `paused` and `killed`: the run that ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution: Option<SandboxExecution>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxExecution {
    pub started_at: DateTime<Utc>,
    pub vcpu_count: u32,
    pub memory_mb: u32,
    /// Milliseconds from `started_at` to the event.
    pub execution_time: i64,
}

impl SandboxEvent {
    /// The event `event_type` of `sandbox`, happening at `at`, with a new ID.
    pub fn of(event_type: SandboxEventType, sandbox: &Sandbox, at: DateTime<Utc>) -> Self {
        let execution = event_type.ends_an_execution().then(|| SandboxExecution {
            started_at: sandbox.started_at,
            vcpu_count: sandbox.cpu_count,
            memory_mb: sandbox.memory_mb,
            execution_time: (at - sandbox.started_at).num_milliseconds().max(0),
        });
        Self {
            version: SANDBOX_EVENT_VERSION.to_owned(),
            id: crate::ids::new_uuid(),
            event_type,
            event_data: SandboxEventData {
                sandbox_metadata: sandbox.metadata.clone(),
                execution,
            },
            sandbox_build_id: sandbox
                .image
                .as_ref()
                .and_then(|image| image.layers.last().cloned())
                .unwrap_or_default(),
            sandbox_execution_id: format!(
                "{}-{}",
                sandbox.id,
                sandbox.started_at.timestamp_millis()
            ),
            sandbox_id: sandbox.id.clone(),
            sandbox_team_id: sandbox.team_id.clone(),
            sandbox_template_id: sandbox.template_id.clone(),
            timestamp: at,
        }
    }
}

/// Which of a team's events to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxEventQuery {
    /// Only this sandbox's.
    pub sandbox_id: Option<String>,
    /// Only these types; empty for all.
    pub types: Vec<SandboxEventType>,
    pub offset: u32,
    pub limit: u32,
    /// Oldest first; newest first when false.
    pub ascending: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_reads_back_from_its_name_and_serialises_as_it() {
        for t in SandboxEventType::ALL {
            assert_eq!(SandboxEventType::parse(t.as_str()), Some(t));
            assert_eq!(
                serde_json::to_value(t).expect("serialise"),
                serde_json::json!(t.as_str())
            );
        }
        assert_eq!(SandboxEventType::parse("sandbox.lifecycle.exploded"), None);
    }
}
