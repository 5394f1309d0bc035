//! Team activity buckets.

use super::StoreError;
use crate::model::TeamMetricBucket;

#[async_trait::async_trait]
pub trait TeamMetricRecords: Send + Sync {
    /// Adds buckets: the larger concurrency and the sum of starts win over a stored bucket.
    async fn add_team_metrics(&self, buckets: &[TeamMetricBucket]) -> Result<(), StoreError>;
    /// A team's buckets from `start` to `end` (Unix seconds, inclusive), oldest first.
    async fn team_metrics(
        &self,
        team_id: &str,
        start: i64,
        end: i64,
    ) -> Result<Vec<TeamMetricBucket>, StoreError>;
    async fn prune_team_metrics(&self, before: i64) -> Result<u64, StoreError>;
}
