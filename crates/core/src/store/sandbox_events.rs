//! Sandbox lifecycle events.

use chrono::{DateTime, Utc};

use super::StoreError;
use crate::model::{SandboxEvent, SandboxEventQuery};

#[async_trait::async_trait]
pub trait SandboxEventRecords: Send + Sync {
    /// Appends `events`, kept in the order given.
    async fn add_sandbox_events(&self, events: &[SandboxEvent]) -> Result<(), StoreError>;
    /// A page of team `team_id`'s events, in the order they were added (or its reverse).
    async fn sandbox_events(
        &self,
        team_id: &str,
        query: &SandboxEventQuery,
    ) -> Result<Vec<SandboxEvent>, StoreError>;
    /// Removes events older than `before`; returns how many.
    async fn prune_sandbox_events(&self, before: DateTime<Utc>) -> Result<u64, StoreError>;
}
