//! Requests counted across the processes of a cluster, per team and minute.

use super::StoreError;

#[async_trait::async_trait]
pub trait RequestCountRecords: Send + Sync {
    /// Adds `requests` of `team_id` to the minute starting at `window` (Unix minutes) and
    /// returns that minute's total over every process.
    async fn add_team_requests(
        &self,
        team_id: &str,
        window: i64,
        requests: u64,
    ) -> Result<u64, StoreError>;
    /// Forgets the minutes before `window`; how many rows went.
    async fn prune_team_requests(&self, window: i64) -> Result<u64, StoreError>;
}
