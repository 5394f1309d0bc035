//! Requests counted per team and minute across a cluster's processes.

use sandbar_core::StoreError;
use sandbar_core::store::RequestCountRecords;

use crate::{SqliteStore, err};

#[async_trait::async_trait]
impl RequestCountRecords for SqliteStore {
    async fn add_team_requests(
        &self,
        team_id: &str,
        window: i64,
        requests: u64,
    ) -> Result<u64, StoreError> {
        let total: i64 = sqlx::query_scalar(
            "INSERT INTO team_request_windows (team_id, window_start, requests) VALUES (?, ?, ?) \
             ON CONFLICT (team_id, window_start) DO UPDATE SET requests = requests + excluded.requests \
             RETURNING requests",
        )
        .bind(team_id)
        .bind(window)
        .bind(i64::try_from(requests).map_err(err)?)
        .fetch_one(&self.pool)
        .await
        .map_err(err)?;
        u64::try_from(total).map_err(err)
    }

    async fn prune_team_requests(&self, window: i64) -> Result<u64, StoreError> {
        let done = sqlx::query("DELETE FROM team_request_windows WHERE window_start < ?")
            .bind(window)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(done.rows_affected())
    }
}
