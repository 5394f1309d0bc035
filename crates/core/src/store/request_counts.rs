//! Requests counted across the processes of a cluster, per team and minute.

use super::StoreError;

#[async_trait::async_trait]
pub trait RequestCountRecords: Send + Sync {
    /// Adds each team's requests in `counts` to the minute starting at `window` (Unix
    /// minutes), in one statement, and returns each team's total for that minute over every
    /// process.
    async fn add_team_requests(
        &self,
        window: i64,
        counts: &[(String, u64)],
    ) -> Result<Vec<(String, u64)>, StoreError>;
    /// Forgets the minutes before `window`; how many rows went.
    async fn prune_team_requests(&self, window: i64) -> Result<u64, StoreError>;
}
