//! Sandbox logs: lifecycle events and the agent's lines.

use chrono::{DateTime, Utc};

use super::StoreError;
use crate::model::{SandboxLogEntry, SandboxLogQuery};

#[async_trait::async_trait]
pub trait SandboxLogRecords: Send + Sync {
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
}
