//! Requests counted per team and minute across a cluster's processes.

use sandbar_core::StoreError;
use sandbar_core::store::RequestCountRecords;

use crate::SqliteDb;
use crate::err;

/// Requests counted per team and minute across a cluster's processes, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteRequestCounts {
    pub(crate) db: SqliteDb,
}

#[async_trait::async_trait]
impl RequestCountRecords for SqliteRequestCounts {
    async fn add_team_requests(
        &self,
        window: i64,
        counts: &[(String, u64)],
    ) -> Result<Vec<(String, u64)>, StoreError> {
        if counts.is_empty() {
            return Ok(Vec::new());
        }
        // `WHERE true` tells SQLite's parser the upsert belongs to the INSERT, not the join.
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "INSERT INTO team_request_windows (team_id, window_start, requests) \
             SELECT json_extract(value, '$[0]'), ?, json_extract(value, '$[1]') FROM json_each(?) WHERE true \
             ON CONFLICT (team_id, window_start) DO UPDATE SET requests = requests + excluded.requests \
             RETURNING team_id, requests",
        )
        .bind(window)
        .bind(serde_json::to_string(counts).map_err(err)?)
        .fetch_all(&self.db.writes)
        .await
        .map_err(err)?;
        rows.into_iter()
            .map(|(team, total)| Ok((team, u64::try_from(total).map_err(err)?)))
            .collect()
    }

    async fn prune_team_requests(&self, window: i64) -> Result<u64, StoreError> {
        let done = sqlx::query("DELETE FROM team_request_windows WHERE window_start < ?")
            .bind(window)
            .execute(&self.db.writes)
            .await
            .map_err(err)?;
        Ok(done.rows_affected())
    }
}
